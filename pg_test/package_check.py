"""The Debian packages of one PostgreSQL major, installed in a clean root of its Debian release
(scripts/pgroot.sh run clean-N: postgresql-N-postgis-3 and nats-server, no Rust, no compiler), each
part in a root freshly extracted from its tarball:

  quickstart  apt install the package; the README's quick start as written; its events in NATS,
              checked field by field against the outbox; a mistyped feature_outbox.* name refused
              (the reserved prefix); then dpkg -r removes every file (N any)
  upgrade     the 0.2.0 package with events waiting while NATS is down, the current package
              installed over it, restart, ALTER EXTENSION UPDATE, NATS back: each waiting event
              arrives exactly once, and edits after the update too (N = 15, 17)
  dump        a PostgreSQL 15 database of the host's installed build (published and waiting rows, a
              user layer) dumped with pg_dump N and restored into the package's cluster N: the
              waiting rows relayed exactly once, ids continue, the restored layer takes edits (N = 17, 18)

Run on the host as root by scripts/package_test.sh N (make package-test PG=N), with the host's
venv: .venv/bin/python pg_test/package_check.py N [part ...]. Not a pytest module: its name matches
neither of pytest's default patterns, test_*.py and *_test.py.

The servers of a part (PostgreSQL, nats-server) run inside the root, started by one long-lived
`scripts/pgroot.sh run clean-N bash -c LOOP`: the driver sends it one shell command per line on
stdin (base64) and reads its output up to a marker line with the exit status; the loop stops what
is still running when its stdin closes. The root shares the host's network: the driver reaches the
servers on 127.0.0.1 with psycopg and nats-py.
"""

import base64
import json
import os
import queue
import re
import secrets
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import nats.js.errors
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import ROOT, free_port  # noqa: E402
from relay_harness import consume  # noqa: E402
from test_first_hour import readme_block  # noqa: E402

ROOTS = Path("/var/tmp/feature_outbox_roots")   # scripts/pgroot.sh's
WORK = "/var/tmp/pkgtest"                         # inside the root
HOST_WORK = Path("/var/tmp/feature_outbox_package_test")  # the host's PostgreSQL 15 cluster (dump)
RELEASE_020 = "0.2.0"
FAST_RETRY = ("feature_outbox.retry_backoff_min = '100ms'", "feature_outbox.retry_backoff_max = '1s'",
              "feature_outbox.publish_timeout = '2s'")
SCALE = float(os.environ.get("FEATURE_OUTBOX_WAIT_SCALE", "3"))


def cargo_version() -> str:
    text = (ROOT / "Cargo.toml").read_text()
    return re.search(r'^\[package\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.M | re.S)[1]


def deb_path(major: int, version: str) -> Path:
    return ROOT / "dist" / f"postgresql-{major}-feature-outbox_{version}-1_amd64.deb"


# --- reporting ------------------------------------------------------------------------------------

class Report:
    def __init__(self):
        self.results: list[tuple[str, bool, str]] = []
        self.times: list[tuple[str, float]] = []

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.results.append((name, bool(ok), detail))
        print(f"  {'PASS' if ok else 'FAIL'}  {name}{'' if ok or not detail else ': ' + detail}", flush=True)
        return bool(ok)

    def step(self, name: str):
        report = self

        class Step:
            def __enter__(self):
                self.t = time.monotonic()
                print(f"-- {name}", flush=True)

            def __exit__(self, *exc):
                took = time.monotonic() - self.t
                report.times.append((name, took))
                print(f"   {name}: {took:.1f} s", flush=True)
        return Step()

    @property
    def failed(self) -> list[str]:
        return [n for n, ok, _ in self.results if not ok]


R = Report()


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout * SCALE
    while True:
        try:
            value = predicate()
        except psycopg.OperationalError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout * SCALE:g} s waiting for {what}")
        time.sleep(0.1)


# --- the root ---------------------------------------------------------------------------------------

# Runs inside the root: one command a line (base64) in, its output and "<mark> <status>" out. At the
# end of its input it stops every server started under $WORK, so that pgroot.sh can unmount.
LOOP = r"""
set -u
stop_all() {
  for pid in /var/tmp/pkgtest/*/postmaster.pid /var/tmp/pkgtest/*/data/postmaster.pid; do
    [ -f "$pid" ] || continue
    runuser -u postgres -- pg_ctl -D "$(dirname "$pid")" -m immediate -w stop >/dev/null 2>&1 || true
  done
  for pid in /var/tmp/pkgtest/*/nats.pid; do
    [ -f "$pid" ] || continue
    kill "$(cat "$pid")" 2>/dev/null && sleep 0.5
    rm -f "$pid"
  done
}
trap stop_all EXIT
trap 'exit 143' TERM HUP INT   # pgroot.sh passes a signal on: stop the servers then too
while IFS= read -r line; do
  cmd=$(printf '%s' "$line" | base64 -d)
  bash -c "$cmd" </dev/null 2>&1 &
  wait "$!"   # a trapped signal interrupts this wait, not a foreground command
  printf '\n%s %d\n' "$MARK" "$?"
done
"""


class CommandFailed(Exception):
    pass


class Root:
    """A clean root of `major`, extracted afresh, for as long as this object lives."""

    def __init__(self, major: int):
        self.major = major
        self.path = ROOTS / f"clean{major}"
        self.mark = "@@pkgtest-" + secrets.token_hex(8)
        self.proc = subprocess.Popen(
            ["bash", str(ROOT / "scripts/pgroot.sh"), "run", f"clean-{major}", "env", f"MARK={self.mark}",
             "bash", "-c", LOOP],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        out = self.sh("echo ready", timeout=600)   # waits for the extraction (or the first build)
        for line in out.splitlines():
            if line != "ready":
                print(f"   {line}")

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def sh(self, cmd: str, check: bool = True, timeout: float = 300) -> str:
        """Runs `cmd` with bash in the root; returns its output (stdout and stderr)."""
        self.proc.stdin.write(base64.b64encode(cmd.encode()).decode() + "\n")
        self.proc.stdin.flush()
        out = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise CommandFailed(f"no answer in {timeout} s to: {cmd}\n{''.join(out)}")
            if line is None:
                raise CommandFailed(f"the root's command loop ended (status {self.proc.wait()}) during: {cmd}\n{''.join(out)}")
            if self.mark in line:
                rc = int(line.split(self.mark, 1)[1])
                text = "".join(out)
                text = text[:-1] if text.endswith("\n") else text
                if check and rc != 0:
                    raise CommandFailed(f"exit {rc}: {cmd}\n{text}")
                self.rc = rc
                return text
            out.append(line)

    def host(self, path: str) -> Path:
        """Where a path of the root is on the host."""
        return self.path / path.lstrip("/")

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                self.proc.wait(60)
        while True:   # what pgroot.sh said at the end (processes left behind, unmount warnings)
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                break
            if line is None:
                break
            if line.strip() and self.mark not in line:
                print(f"   {line.rstrip()}")

    def apt_install(self, deb: Path) -> str:
        rel = deb.relative_to(ROOT)
        return self.sh(f"cd {ROOT} && apt-get install -y ./{rel}", timeout=300)

    def installed_version(self, pkg: str) -> str:
        return self.sh(f"dpkg-query -W -f='${{Status}} ${{Version}}' {pkg} 2>/dev/null || true")

    def nats(self, name: str) -> "RootNats":
        return RootNats(self, name)

    def cluster(self, name: str, *settings: str) -> "RootCluster":
        return RootCluster(self, name, settings)


class RootNats:
    """The root's Debian nats-server -js, on its own port and store; stop() and start() keep both."""

    def __init__(self, root: Root, name: str):
        self.root, self.dir, self.port = root, f"{WORK}/{name}", free_port()
        root.sh(f"mkdir -p {self.dir}/store")
        self.start()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self):
        log = self.root.host(f"{self.dir}/nats.log")
        start = log.stat().st_size if log.exists() else 0
        self.root.sh(f"nats-server -js -a 127.0.0.1 -p {self.port} -sd {self.dir}/store >>{self.dir}/nats.log 2>&1 & "
                     f"echo $! >{self.dir}/nats.pid")
        wait_for(lambda: log.exists() and "Server is ready" in log.read_text(errors="replace")[start:], 10,
                 "nats-server to start")

    def stop(self):
        self.root.sh(f"kill $(cat {self.dir}/nats.pid); while kill -0 $(cat {self.dir}/nats.pid) 2>/dev/null; do sleep 0.1; done; "
                     f"rm -f {self.dir}/nats.pid")

    def version(self) -> str:
        return self.root.sh("nats-server --version")

    def messages(self) -> list[dict]:
        """Every message of the stream FEATURES (departure notices included: their id ends in :departed)."""
        try:
            return consume([self.url], ["features.>"])
        except nats.js.errors.NotFoundError:   # no stream yet: the relay makes it at its first publish
            return []


class RootCluster:
    """A cluster of the root's PostgreSQL, run as postgres on its own port, made by initdb."""

    def __init__(self, root: Root, name: str, settings: tuple[str, ...]):
        self.root, self.dir, self.port = root, f"{WORK}/{name}", free_port()
        bin = f"/usr/lib/postgresql/{root.major}/bin"
        self.bin = bin
        conf = "\n".join([f"port = {self.port}", "listen_addresses = '127.0.0.1'",
                          f"unix_socket_directories = '{self.dir}'", "fsync = off", *settings]) + "\n"
        root.sh(f"install -d -o postgres -g postgres -m 0700 {self.dir} && "
                f"runuser -u postgres -- {bin}/initdb -D {self.dir}/data -A trust -U postgres -E UTF8 --no-sync >{self.dir}/initdb.log")
        with self.root.host(f"{self.dir}/data/postgresql.auto.conf").open("a") as f:
            f.write(conf)
        self.pg_ctl("start")

    def pg_ctl(self, action: str):
        self.root.sh(f"runuser -u postgres -- {self.bin}/pg_ctl -D {self.dir}/data -l {self.dir}/server.log -w -t 60 "
                     f"{'-m fast ' if action != 'start' else ''}{action} >/dev/null", timeout=120)

    def connect(self, db: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(f"host=127.0.0.1 port={self.port} user=postgres dbname={db}", autocommit=True)

    def one(self, db: str, sql: str, *args):
        with self.connect(db) as conn:
            conn.row_factory = psycopg.rows.dict_row
            return conn.execute(sql, args).fetchone()

    def all(self, db: str, sql: str, *args):
        with self.connect(db) as conn:
            conn.row_factory = psycopg.rows.dict_row
            return conn.execute(sql, args).fetchall()

    def log(self) -> str:
        return self.root.host(f"{self.dir}/server.log").read_text(errors="replace")

    def psql(self, db: str, script_path: str, check=False) -> str:
        return self.root.sh(f"{self.bin}/psql -X -v ON_ERROR_STOP=1 -h 127.0.0.1 -p {self.port} -U postgres -d {db} "
                            f"-f {script_path}", check=check)


class HostCluster:
    """A throwaway cluster of the host's PostgreSQL 15 (scripts/cluster.sh), with the extension as
    installed on the host (make install or make test)."""

    def __init__(self, name: str, *settings: str):
        self.dir, self.port = HOST_WORK / name, free_port()
        self.env = {**os.environ, "FEATURE_OUTBOX_PG": "15"}
        self.env.pop("FEATURE_OUTBOX_PG_BIN", None)
        subprocess.run([ROOT / "scripts/cluster.sh", "start", self.dir, str(self.port), *settings],
                       check=True, env=self.env)

    def stop(self):
        subprocess.run([ROOT / "scripts/cluster.sh", "stop", self.dir], check=True, env=self.env)
        subprocess.run(["rm", "-rf", "--one-file-system", self.dir], check=True)

    connect = RootCluster.connect
    one = RootCluster.one
    all = RootCluster.all


# --- checks shared by the parts --------------------------------------------------------------------

OUTBOX = """SELECT id, event_id::text, layer, feature_id, feature_version, event_type, routing_key,
                   previous_routing_key, published_at IS NOT NULL AS published
              FROM feature_outbox.outbox ORDER BY id"""


def events_by_id(messages: list[dict]) -> tuple[dict, Counter]:
    """The stream's events (departure notices left out) by Nats-Msg-Id, and how often each id came."""
    plain = [m for m in messages if not m["id"].endswith(":departed")]
    return {m["id"]: m for m in plain}, Counter(m["id"] for m in plain)


def check_event_matches_row(label: str, msg: dict, row: dict) -> bool:
    e = msg["event"]
    want = {"event_id": row["event_id"], "layer": row["layer"], "feature_id": str(row["feature_id"]),
            "event_version": row["feature_version"], "action": row["event_type"], "routing_key": row["routing_key"],
            "previous_routing_key": row["previous_routing_key"], "schema_version": 3, "crs": "EPSG:4326"}
    got = {k: e.get(k) for k in want}
    subject_ok = msg["subject"].startswith(f"features.{row['layer']}.{row['event_type']}.") \
        and msg["subject"].endswith("." + row["routing_key"])
    return R.check(f"{label}: event of outbox row {row['id']} ({row['layer']} {row['feature_id']} "
                   f"{row['event_type']} v{row['feature_version']}) has the row's fields and subject",
                   got == want and subject_ok, f"got {got} on {msg['subject']}, want {want}")


def close_to(a, b, tol=1e-6) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= tol
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close_to(x, y, tol) for x, y in zip(a, b))
    return a == b


def exactly_once(label: str, nats: RootNats, expected_ids: set[str], forbidden_ids: set[str], settle: float = 5):
    """The stream has each expected id once, none of the forbidden, and nothing else; read again
    `settle` seconds later to catch a late duplicate."""
    _, first = events_by_id(nats.messages())
    time.sleep(settle)
    messages = nats.messages()
    by_id, counts = events_by_id(messages)
    dup = {i: n for i, n in Counter(m["id"] for m in messages).items() if n > 1}   # departure notices too
    missing = expected_ids - set(counts)
    extra = set(counts) - expected_ids
    R.check(f"{label}: every one of the {len(expected_ids)} events arrived", not missing, f"missing {sorted(missing)}")
    R.check(f"{label}: none arrived twice", not dup, f"{dup}")
    R.check(f"{label}: nothing else in the stream (no event published before, re-sent)",
            not extra and not (forbidden_ids & set(counts)), f"extra {sorted(extra)}")
    R.check(f"{label}: no new message {settle:g} s after the backlog drained", counts == first,
            f"{sum(first.values())} then {sum(counts.values())}")
    return by_id


def quick_start_settings(endpoint: str) -> list[str]:
    settings = []
    for line in readme_block("ini", "## Quick start").splitlines():
        line = line.split("#")[0].strip() if not line.lstrip().startswith("#") else ""
        if line.startswith("feature_outbox.endpoint"):
            line = f"feature_outbox.endpoint = '{endpoint}'"
        if line:
            settings.append(line)
    return settings


def check_package_files(root: Root, pkg: str, version: str):
    out = root.sh(f"dpkg -L {pkg}")
    files = [f for f in out.splitlines() if root.host(f).is_file()]
    lib = f"/usr/lib/postgresql/{root.major}/lib/feature_outbox.so"
    ext = f"/usr/share/postgresql/{root.major}/extension"
    want = {lib, f"{ext}/feature_outbox.control", f"{ext}/feature_outbox--{version}.sql",
            f"/usr/share/doc/{pkg}/copyright"}
    want |= {f"{ext}/{p.name}" for p in (ROOT / "sql").glob("feature_outbox--*.sql")} if version == cargo_version() else set()
    R.check(f"{pkg} {version} installs the library, control file, install and upgrade scripts, copyright",
            want <= set(files), f"missing {sorted(want - set(files))}")
    owners = root.sh(f"stat -c '%U:%G %a %n' {' '.join(files)}").splitlines()
    R.check("its files are root:root, mode 644", all(o.startswith("root:root 644 ") for o in owners), "\n".join(owners))
    return files


# --- part b + e: the quick start, then dpkg -r ---------------------------------------------------------

def part_quickstart(major: int):
    version = cargo_version()
    pkg = f"postgresql-{major}-feature-outbox"
    with R.step(f"quickstart: fresh clean-{major} root"):
        root = Root(major)
    try:
        with R.step(f"quickstart: apt install ./{deb_path(major, version).relative_to(ROOT)}"):
            out = root.apt_install(deb_path(major, version))
            R.check("apt resolves the dependencies from the root (offline) and installs only the package",
                    re.search(r"^0 upgraded, 1 newly installed", out, re.M) is not None, out[-800:])
            R.check(f"dpkg says {pkg} {version}-1 is installed",
                    root.installed_version(pkg) == f"install ok installed {version}-1", root.installed_version(pkg))
            files = check_package_files(root, pkg, version)
        with R.step("quickstart: nats-server and a cluster with the README's postgresql.conf lines"):
            nats = root.nats("nats")
            print(f"   {nats.version().strip()}; {root.sh(f'/usr/lib/postgresql/{major}/bin/postgres --version').strip()}")
            settings = quick_start_settings(nats.url)
            R.check("the quick start sets shared_preload_libraries, database, relay_workers, endpoint and wal_level",
                    [s.split("=")[0].strip() for s in settings] == ["shared_preload_libraries", "feature_outbox.database",
                                                                   "feature_outbox.relay_workers", "feature_outbox.endpoint",
                                                                   "wal_level"],
                    str(settings))
            c = root.cluster("pg", *settings)
            root.sh(f"runuser -u postgres -- createdb -h 127.0.0.1 -p {c.port} gis")
        with R.step("quickstart: the README's SQL block as written (psql)"):
            script = readme_block("sql", "## Quick start")
            root.host(f"{WORK}/quickstart.sql").write_text(script)
            out = c.psql("gis", f"{WORK}/quickstart.sql")
            R.check("psql runs the quick start with ON_ERROR_STOP and exits 0", root.rc == 0, out[-2000:])
            R.check("no permission denied, no ERROR", "permission denied" not in out and "ERROR" not in out, out[-2000:])
        with R.step("quickstart: its seven events in NATS, field by field"):
            wait_for(lambda: c.one("gis", "SELECT unpublished_rows FROM feature_outbox.backlog")["unpublished_rows"] == 0,
                     20, "the backlog to drain")
            rows = c.all("gis", OUTBOX)
            by_id = exactly_once("quick start", nats, {r["event_id"] for r in rows}, set(), settle=3)
            plan = [(r["layer"], r["feature_id"], r["event_type"], r["feature_version"]) for r in rows]
            R.check("the outbox holds the quick start's edits: parcels 4471 created/updated/updated/retired v1-4, "
                    "features 4471 created/moved/retired v1-3",
                    plan == [("parcels", 4471, "created", 1), ("parcels", 4471, "updated", 2), ("parcels", 4471, "updated", 3),
                             ("parcels", 4471, "retired", 4), ("features", 4471, "created", 1),
                             ("features", 4471, "moved", 2), ("features", 4471, "retired", 3)], str(plan))
            for r in rows:
                if r["event_id"] in by_id:
                    check_event_matches_row("quick start", by_id[r["event_id"]], r)
            events = {(by_id[r["event_id"]]["event"]["layer"], r["feature_version"]): by_id[r["event_id"]]["event"]
                      for r in rows if r["event_id"] in by_id}
            last = events.get(("parcels", 4))
            R.check("the last parcels event carries the row as the quick start left it "
                    "(name Block 4471 North, zoning C4; its box in degrees)",
                    last is not None and last["properties"] == {"name": "Block 4471 North", "zoning": "C4"}
                    and close_to(last["bbox"], [-73.99, 40.75, -73.98, 40.76], 1e-6) and last["geometry"]["type"] == "Polygon",
                    json.dumps(last))
            retired = events.get(("features", 3))
            R.check("the built-in feature's retired event keeps the last geometry, Point(2.35 48.85)",
                    retired is not None and retired["geometry"] == {"type": "Point", "coordinates": [2.35, 48.85]}
                    and retired["properties"] == {}, json.dumps(retired))
            moved = events.get(("features", 2))
            R.check("the move from Berlin to Paris has a previous box around Berlin",
                    moved is not None and close_to(moved["previous_bbox"], [13.40, 52.52, 13.41, 52.53], 1e-9),
                    json.dumps(moved))
            w = c.one("gis", "SELECT sum(duplicate_acks) AS d, sum(relayed_rows) AS r FROM feature_outbox.workers")
            R.check("the relay saw no duplicate PubAck and relayed 7 rows", w["d"] == 0 and w["r"] == 7, str(w))
            b = c.one("gis", "SELECT * FROM feature_outbox.backlog")
            R.check("backlog: 0 unpublished, 1 relay worker running, no error",
                    b["unpublished_rows"] == 0 and b["relay_workers_running"] == 1 and b["relay_last_error"] is None, str(b))
        with R.step("quickstart: the reserved prefix (0.5.0): a mistyped feature_outbox.* name is refused"):
            alter_system = "42704" if major == 15 else "42602"  # 15's ALTER SYSTEM takes no unknown name at all
            for sql, want in (("SET feature_outbox.standby_slotz = 'typo'", "42602"),
                              ("ALTER DATABASE gis SET feature_outbox.standby_slotz = 'typo'", "42602"),
                              ("ALTER SYSTEM SET feature_outbox.standby_slotz = 'typo'", alter_system)):
                with c.connect("gis") as conn:
                    try:
                        conn.execute(sql)
                        got = None
                    except psycopg.Error as e:
                        got = e.sqlstate
                R.check(f"{sql}: {want}", got == want, f"SQLSTATE {got}")
        with R.step(f"quickstart: dpkg -r {pkg}"):
            c.pg_ctl("stop")
            nats.stop()
            root.sh(f"dpkg -r {pkg}")
            left = [f for f in files if root.host(f).exists()]
            R.check("dpkg -r removes every file of the package", not left, str(left))
            ours = [p.name for p in root.host(f"/usr/lib/postgresql/{major}/lib").glob("feature_outbox*")] + \
                   [p.name for p in root.host(f"/usr/share/postgresql/{major}/extension").glob("feature_outbox*")]
            R.check(f"nothing named feature_outbox* is left in /usr/lib/postgresql/{major}/lib and .../extension",
                    not ours, str(ours))
            R.check(f"/usr/share/doc/{pkg} is gone", not root.host(f"/usr/share/doc/{pkg}").exists())
            root.sh(f"dpkg -L {pkg}", check=False)
            R.check("dpkg -L knows the package no more", root.rc != 0)
            R.check("dpkg has no record of it (not even config-files)",
                    root.installed_version(pkg) in ("", f"deinstall ok not-installed {version}-1")
                    or "not-installed" in root.installed_version(pkg), root.installed_version(pkg))
    finally:
        root.close()


# --- part c: 0.2.0 package -> current package, with events waiting ---------------------------------------

SITES = """CREATE TABLE public.sites (id bigint PRIMARY KEY, geom geometry(Point, 3857) NOT NULL,
                                  version integer NOT NULL DEFAULT 0, label text)"""


def pt(lon, lat):
    return json.dumps({"type": "Point", "coordinates": [lon, lat]})


def part_upgrade(major: int):
    version = cargo_version()
    pkg = f"postgresql-{major}-feature-outbox"
    with R.step(f"upgrade: fresh clean-{major} root"):
        root = Root(major)
    try:
        with R.step(f"upgrade: apt install the {RELEASE_020} package"):
            root.apt_install(deb_path(major, RELEASE_020))
            R.check(f"{pkg} {RELEASE_020}-1 installed",
                    root.installed_version(pkg) == f"install ok installed {RELEASE_020}-1", root.installed_version(pkg))
            check_package_files(root, pkg, RELEASE_020)
        with R.step(f"upgrade: {RELEASE_020} with a layer, published events, then NATS down and events waiting"):
            nats = root.nats("nats")
            c = root.cluster("pg", "shared_preload_libraries = 'feature_outbox'", "feature_outbox.database = 'gis'",
                             f"feature_outbox.endpoint = '{nats.url}'", *FAST_RETRY)
            root.sh(f"runuser -u postgres -- createdb -h 127.0.0.1 -p {c.port} gis")
            with c.connect("gis") as conn:
                conn.execute("CREATE EXTENSION feature_outbox CASCADE")
                R.check(f"CREATE EXTENSION makes {RELEASE_020}",
                        conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'feature_outbox'").fetchone()[0] == RELEASE_020)
                conn.execute(SITES)
                conn.execute("SELECT feature_outbox.register_layer('sites', 'public.sites', properties => '{label}')")
                for i in range(1, 4):
                    conn.execute("SELECT feature_outbox.edit_feature('sites', %s, %s, 'created', %s)",
                                 (i, pt(10 + i, 50), json.dumps({"label": f"site {i}"})))
                    conn.execute("SELECT feature_outbox.edit_feature(%s, %s::text, 'created')", (100 + i, pt(-70, -30 + i)))
            wait_for(lambda: c.one("gis", "SELECT count(*) AS n FROM feature_outbox.outbox WHERE published_at IS NULL")["n"] == 0,
                     20, "the first events to be relayed")
            published = {r["event_id"] for r in c.all("gis", OUTBOX)}
            R.check("6 events published by 0.2.0", len(published) == 6 and len(nats.messages()) == 6, str(len(published)))
            nats.stop()
            with c.connect("gis") as conn:
                conn.execute("SELECT feature_outbox.edit_feature('sites', 1, %s, 'moved')", (pt(11.5, 50.5),))
                conn.execute("SELECT feature_outbox.edit_feature('sites', 2, NULL::text, 'updated', %s)",
                             (json.dumps({"label": "site 2 renamed"}),))
                conn.execute("SELECT feature_outbox.edit_feature('sites', 3, NULL::text, 'retired')")
                conn.execute("SELECT feature_outbox.edit_feature(101, %s::text, 'moved')", (pt(-71, -29),))
            time.sleep(2)   # the relay tries, fails, backs off
            b = c.one("gis", "SELECT unpublished_rows, relay_last_error FROM feature_outbox.backlog")
            R.check("backlog shows the 4 waiting events, and why", b["unpublished_rows"] == 4 and b["relay_last_error"], str(b))
        with R.step(f"upgrade: apt install the {version} package over it, restart"):
            out = root.apt_install(deb_path(major, version))
            R.check(f"apt upgrades {pkg} to {version}-1",
                    root.installed_version(pkg) == f"install ok installed {version}-1"
                    and re.search(r"^1 upgraded, 0 newly installed", out, re.M) is not None, out[-800:])
            check_package_files(root, pkg, version)
            c.pg_ctl("restart")
            st = wait_for(lambda: (w := c.one("gis", "SELECT state FROM feature_outbox.workers"))
                          and w["state"] == "waiting for ALTER EXTENSION UPDATE" and w, 20, "the worker to wait for the update")
            R.check("between restart and update the worker waits for ALTER EXTENSION UPDATE", bool(st), str(st))
            err = c.one("gis", "SELECT relay_last_error FROM feature_outbox.backlog")["relay_last_error"] or ""
            R.check("backlog.relay_last_error names both versions",
                    RELEASE_020 in err and version in err, err)
            with c.connect("gis") as conn:   # the old SQL on the new library, as the README says
                conn.execute("SELECT feature_outbox.edit_feature('sites', 4, %s, 'created', %s)",
                             (pt(15, 51), json.dumps({"label": "site 4, between restart and update"})))
        with R.step("upgrade: ALTER EXTENSION feature_outbox UPDATE, then NATS back"):
            with c.connect("gis") as conn:
                conn.execute("ALTER EXTENSION feature_outbox UPDATE")
                R.check(f"the extension is at {version}",
                        conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'feature_outbox'").fetchone()[0] == version)
            waiting = {r["event_id"]: r for r in c.all("gis", OUTBOX) if not r["published"]}
            R.check("5 events wait (4 from before the install, 1 from between restart and update)", len(waiting) == 5,
                    str(len(waiting)))
            nats.start()
            wait_for(lambda: c.one("gis", "SELECT unpublished_rows FROM feature_outbox.backlog")["unpublished_rows"] == 0,
                     30, "the waiting events to be relayed")
            by_id = exactly_once("upgrade", nats, published | set(waiting), set())
            for eid, r in waiting.items():
                if eid in by_id:
                    check_event_matches_row("upgrade", by_id[eid], r)
            e = by_id.get(next((i for i, r in waiting.items() if r["feature_id"] == 2 and r["layer"] == "sites"), ""), {}).get("event", {})
            R.check("the waiting updated event of site 2 carries its new label", e.get("properties") == {"label": "site 2 renamed"}, str(e))
            dup = c.one("gis", "SELECT sum(duplicate_acks) AS d, sum(relayed_rows) AS r FROM feature_outbox.workers")
            R.check("the relay saw no duplicate PubAck and relayed 5 rows", dup["d"] == 0 and dup["r"] == 5, str(dup))
        with R.step("upgrade: edits after the update"):
            before = set(events_by_id(nats.messages())[1])
            with c.connect("gis") as conn:
                conn.execute("SELECT feature_outbox.edit_feature('sites', 4, %s, 'moved')", (pt(16, 52),))
                conn.execute("SELECT feature_outbox.edit_feature(104, %s::text, 'created')", (pt(-60, -20),))
            wait_for(lambda: c.one("gis", "SELECT unpublished_rows FROM feature_outbox.backlog")["unpublished_rows"] == 0,
                     20, "the new edits to be relayed")
            rows = [r for r in c.all("gis", OUTBOX) if r["event_id"] not in before]
            by_id = exactly_once("after the update", nats, before | {r["event_id"] for r in rows}, set(), settle=2)
            R.check("two new events", len(rows) == 2, str(rows))
            for r in rows:
                if r["event_id"] in by_id:
                    check_event_matches_row("after the update", by_id[r["event_id"]], r)
            moved = next((by_id[r["event_id"]]["event"] for r in rows if r["layer"] == "sites" and r["event_id"] in by_id), {})
            R.check("site 4's move carries its new point and registration_id (0.3.0's field)",
                    moved.get("geometry", {}).get("type") == "Point" and close_to(moved["geometry"]["coordinates"], [16, 52], 1e-9)
                    and moved.get("event_version") == 2 and "registration_id" in moved, str(moved))
            c.pg_ctl("stop")
            nats.stop()
    finally:
        root.close()


# --- part d: a PostgreSQL 15 dump restored into the package's cluster -----------------------------------

PARCELS = """CREATE TABLE public.parcels (id bigint PRIMARY KEY, geom geometry(Polygon, 2263) NOT NULL,
                                     version integer NOT NULL DEFAULT 0, name text, zoning text, retired_at timestamptz)"""


def square(lon, lat, d=0.01):
    return json.dumps({"type": "Polygon", "coordinates": [[[lon, lat], [lon + d, lat], [lon + d, lat + d], [lon, lat + d], [lon, lat]]]})


def part_dump(major: int):
    version = cargo_version()
    so, control = Path("/usr/lib/postgresql/15/lib/feature_outbox.so"), Path("/usr/share/postgresql/15/extension/feature_outbox.control")
    if not R.check("the host's PostgreSQL 15 has feature_outbox installed (make install)", so.exists() and control.exists(),
                   f"{so} or {control} missing: run `make install` (PG=15) first"):
        return
    with R.step(f"dump: fresh clean-{major} root"):
        root = Root(major)
    src = None
    try:
        with R.step("dump: the source, the host's PostgreSQL 15: a layer, published and waiting rows"):
            nats1 = root.nats("nats-source")
            src = HostCluster("source15", "feature_outbox.database = 'gis'", f"feature_outbox.endpoint = '{nats1.url}'", *FAST_RETRY)
            with src.connect() as conn:
                conn.execute("CREATE DATABASE gis")
            with src.connect("gis") as conn:
                conn.execute("CREATE EXTENSION feature_outbox CASCADE")
                src_version = conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'feature_outbox'").fetchone()[0]
                print(f"   host: {conn.execute('SELECT version()').fetchone()[0][:40]}, feature_outbox {src_version}")
                conn.execute(PARCELS)
                conn.execute("SELECT feature_outbox.register_layer('parcels', 'public.parcels', properties => '{name,zoning}',"
                             " retired_column => 'retired_at')")
                for i in range(1, 5):
                    conn.execute("SELECT feature_outbox.edit_feature('parcels', %s, %s, 'created', %s)",
                                 (i, square(-74 + i / 100, 40.7), json.dumps({"name": f"Block {i}", "zoning": "R6"})))
                conn.execute("SELECT feature_outbox.edit_feature(1, %s::text, 'created')", (pt(13.4, 52.5),))
            wait_for(lambda: src.one("gis", "SELECT count(*) AS n FROM feature_outbox.outbox WHERE published_at IS NULL")["n"] == 0,
                     20, "the source's first events to be relayed")
            published = {r["event_id"] for r in src.all("gis", OUTBOX)}
            R.check("source: 5 events published", len(published) == 5, str(len(published)))
            nats1.stop()
            with src.connect("gis") as conn:
                conn.execute("SELECT feature_outbox.edit_feature('parcels', 1, %s, 'moved')", (square(-73.95, 40.72),))
                conn.execute("SELECT feature_outbox.edit_feature('parcels', 2, NULL::text, 'updated', %s)",
                             (json.dumps({"zoning": "C4"}),))
                conn.execute("SELECT feature_outbox.edit_feature('parcels', 3, NULL::text, 'retired')")
                conn.execute("SELECT feature_outbox.edit_feature(1, %s::text, 'moved')", (pt(2.35, 48.85),))
            time.sleep(1)
            b = src.one("gis", "SELECT unpublished_rows FROM feature_outbox.backlog")
            R.check("source: 4 events wait", b["unpublished_rows"] == 4, str(b))
            src_rows = {r["event_id"]: r for r in src.all("gis", OUTBOX)}
            waiting = {i: r for i, r in src_rows.items() if not r["published"]}
            src_max = max(r["id"] for r in src_rows.values())
            src_state = src.one("gis", "SELECT routing_key FROM feature_outbox.feature_state WHERE layer = 'parcels' AND feature_id = 4")
            src_identity = src.one("gis", "SELECT identity::text AS id FROM feature_outbox.database_identity")["id"]
        with R.step(f"dump: pg_dump -Fc with the root's pg_dump {major}"):
            root.sh(f"mkdir -p {WORK}/dump && /usr/lib/postgresql/{major}/bin/pg_dump -h 127.0.0.1 -p {src.port} -U postgres "
                    f"-Fc -f {WORK}/dump/gis.pgdump gis")
            src.stop()
            src = None
        with R.step(f"dump: apt install the {version} package, restore into PostgreSQL {major}"):
            root.apt_install(deb_path(major, version))
            nats2 = root.nats("nats-target")   # its own stream: a re-sent published event would show
            c = root.cluster("pg", "shared_preload_libraries = 'feature_outbox'", "feature_outbox.database = 'gis'",
                             f"feature_outbox.endpoint = '{nats2.url}'", *FAST_RETRY)
            root.sh(f"runuser -u postgres -- createdb -h 127.0.0.1 -p {c.port} gis")
            out = root.sh(f"/usr/lib/postgresql/{major}/bin/pg_restore -h 127.0.0.1 -p {c.port} -U postgres --exit-on-error "
                          f"-d gis {WORK}/dump/gis.pgdump", check=False)
            R.check("pg_restore into an empty database exits 0 and prints nothing", root.rc == 0 and out == "", out[-2000:])
            ext = c.one("gis", "SELECT extversion FROM pg_extension WHERE extname = 'feature_outbox'")
            R.check(f"the restored database has feature_outbox {version}", ext and ext["extversion"] == version, str(ext))
        with R.step("dump: the restore waits as a copy until resolve_copy('moved'), as Upgrading says"):
            # A restore is a copy of the source database (0.4.0, sql/identity.sql): its relay holds
            # the rows until the operator says what it is. This one replaces the source.
            wait_for(lambda: c.one("gis", "SELECT relay_held_reason FROM feature_outbox.backlog")["relay_held_reason"] is not None,
                     30, "the relay to hold the restored database as a copy")
            b = c.one("gis", "SELECT unpublished_rows FROM feature_outbox.backlog")
            R.check("nothing is relayed while the restore is held", b["unpublished_rows"] == len(waiting), str(b))
            kept = c.one("gis", "SELECT feature_outbox.resolve_copy('moved')::text AS id")["id"]
            R.check("resolve_copy('moved') keeps the source's identity", kept == src_identity, f"{kept} != {src_identity}")
        with R.step("dump: the waiting rows relayed exactly once"):
            wait_for(lambda: c.one("gis", "SELECT unpublished_rows FROM feature_outbox.backlog")["unpublished_rows"] == 0,
                     30, "the restored waiting rows to be relayed")
            rows = {r["event_id"]: r for r in c.all("gis", OUTBOX)}
            R.check("every source outbox row was restored under its id",
                    {i: r["id"] for i, r in rows.items()} == {i: r["id"] for i, r in src_rows.items()},
                    f"{len(rows)} rows restored of {len(src_rows)}")
            by_id = exactly_once("restored", nats2, set(waiting), published)
            for eid, r in waiting.items():
                if eid in by_id:
                    check_event_matches_row("restored", by_id[eid], rows[eid])
            e = by_id.get(next((i for i, r in waiting.items() if r["feature_id"] == 2), ""), {}).get("event", {})
            R.check("parcel 2's waiting update carries the row's properties (zoning C4)",
                    e.get("properties") == {"name": "Block 2", "zoning": "C4"}, str(e))
            w = c.one("gis", "SELECT sum(duplicate_acks) AS d, sum(relayed_rows) AS r FROM feature_outbox.workers")
            R.check("the restored cluster's relay saw no duplicate PubAck and relayed 4 rows", w["d"] == 0 and w["r"] == 4, str(w))
        with R.step("dump: new edits on the restored layer"):
            with c.connect("gis") as conn:
                conn.execute("SELECT feature_outbox.edit_feature('parcels', 4, %s, 'moved', %s)",
                             (square(-73.9, 40.8), json.dumps({"zoning": "M1"})))
                conn.execute("SELECT feature_outbox.edit_feature('parcels', 5, %s, 'created', %s)",
                             (square(-73.8, 40.8), json.dumps({"name": "Block 5", "zoning": "R6"})))
                conn.execute("SELECT feature_outbox.edit_feature(2, %s::text, 'created')", (pt(-0.12, 51.5),))
            wait_for(lambda: c.one("gis", "SELECT unpublished_rows FROM feature_outbox.backlog")["unpublished_rows"] == 0,
                     20, "the new edits to be relayed")
            new = [r for r in c.all("gis", OUTBOX) if r["event_id"] not in rows]
            R.check("new outbox ids continue above the restored ones", len(new) == 3 and min(r["id"] for r in new) > src_max,
                    f"{[r['id'] for r in new]} after {src_max}")
            by_id = exactly_once("after the restore", nats2, set(waiting) | {r["event_id"] for r in new}, published, settle=2)
            for r in new:
                if r["event_id"] in by_id:
                    check_event_matches_row("after the restore", by_id[r["event_id"]], r)
            moved = next((by_id[r["event_id"]]["event"] for r in new if r["feature_id"] == 4 and r["event_id"] in by_id), {})
            R.check("parcel 4's move: version 2, previous key from the restored state, new box and properties",
                    moved.get("event_version") == 2 and moved.get("previous_routing_key") == src_state["routing_key"]
                    and close_to(moved.get("bbox"), [-73.9, 40.8, -73.89, 40.81], 1e-6)
                    and moved.get("properties") == {"name": "Block 4", "zoning": "M1"}, json.dumps(moved))
            layer = c.one("gis", "SELECT table_name::text AS t, properties::text AS p FROM feature_outbox.layers WHERE layer = 'parcels'")
            R.check("the layers view shows the restored layer", layer == {"t": "parcels", "p": "{name,zoning}"}, str(layer))
            c.pg_ctl("stop")
            nats2.stop()
    finally:
        if src is not None:
            src.stop()
        root.close()


PARTS = {"quickstart": part_quickstart, "upgrade": part_upgrade, "dump": part_dump}


def parts_for(major: int) -> list[str]:
    return ["quickstart"] + (["upgrade"] if major in (15, 17) else []) + (["dump"] if major in (17, 18) else [])


def main(argv: list[str]) -> int:
    major = int(argv[0])
    parts = argv[1:] or parts_for(major)
    t = time.monotonic()
    for name in parts:
        try:
            PARTS[name](major)
        except Exception as e:
            traceback.print_exc()
            R.check(f"{name}: ran to its end", False, f"{type(e).__name__}: {str(e)[-3000:]}")
    print(f"\npackage test, PostgreSQL {major}: {', '.join(parts)} in {time.monotonic() - t:.0f} s")
    for name, took in R.times:
        print(f"  {took:7.1f} s  {name}")
    passed = sum(ok for _, ok, _ in R.results)
    print(f"{passed} passed, {len(R.failed)} failed")
    for name in R.failed:
        print(f"  FAILED: {name}")
    return 1 if R.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
