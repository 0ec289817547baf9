"""A Patroni cluster on this machine for the HA drills (issue 54): one etcd (its own loopback ports and
data directory) and N Patroni members (default 3), each with its own PostgreSQL data directory under
the test run directory, its PostgreSQL port and its REST API port, all on 127.0.0.1.

PostgreSQL is the tree pg_test takes everywhere (conftest.PG_BIN: FEATURE_OUTBOX_TEST_PG_BIN, default
Debian's /usr/lib/postgresql/15/bin). Patroni runs as the `postgres` user when the tests run as root
(PostgreSQL refuses root, and Patroni starts it as its own user). Two Patroni versions:

    "3.0"    Debian 12's patroni 3.0.x (/usr/bin/patroni), scripts/tools.sh patroni
    "4.1.5"  PyPI's patroni 4.1.5 in the tool cache's virtualenv, scripts/tools.sh patroni4

Every relay setting is set ONCE for the whole cluster, in Patroni's dynamic configuration
(bootstrap.dcs.postgresql.parameters), the way an operator sets it with `patronictl edit-config`:
shared_preload_libraries, feature_outbox.database, feature_outbox.endpoint and the rest. Both Patroni
versions pass a dotted name such as feature_outbox.endpoint through to postgresql.conf unchecked
(3.0: `if '.' in name: return value`; 4.x: the same, unless the name is one of its own validators'),
while an unknown plain name is dropped with "WARNING: Removing invalid parameter `name` from
postgresql.parameters" in Patroni's log (seen on 3.0.2 and 4.1.5). docs/src/patroni.md has the recipe.

    with PatroniCluster(RUN_DIR / "patroni", "4.1.5", parameters={...}) as pc:
        pc.start()
        leader = pc.wait_for_leader(60)
        pc.pause_replication(pc.replicas()[0])
        pc.kill_node(leader)          # Patroni and the whole postmaster tree, SIGKILL: a lost node
        new = pc.wait_for_leader(90, exclude={leader})
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import yaml

from conftest import PG_BIN, RUN_DIR, free_port, tools

SCOPE = "fo"
# Patroni's versions by the name the drills use: the scripts/tools.sh tool that installs each.
VERSIONS = {"3.0": "patroni", "4.1.5": "patroni4"}
AS_ROOT = os.getuid() == 0


# ---- the tools ------------------------------------------------------------------------------------

@functools.cache
def etcd_binary() -> str:
    return tools("etcd")["etcd"]


@functools.cache
def patroni_commands(version: str) -> tuple[list[str], list[str]]:
    """(the command that runs a Patroni member, the command that runs patronictl) for `version`.

    Debian's is /usr/bin/patroni. PyPI's lives in the tool cache's virtualenv, which the postgres user
    may not reach (the cache is under root's home, mode 0700, in CI): the harness copies the stamped
    venv, as it is, into the run directory and runs its interpreter there. A venv's bin/python finds
    its packages through the pyvenv.cfg beside it, so the copy needs no rewriting; only its console
    scripts name the cache's interpreter, and the members run Patroni's main() by the copy's python. patronictl
    runs as the caller, from the cache."""
    tool = VERSIONS[version]
    binary = Path(tools(tool)[tool])
    if tool == "patroni":
        return [str(binary)], [str(binary.parent / "patronictl")]
    venv = binary.parents[1]
    copy = RUN_DIR / "tools" / venv.name
    if not (copy / "STAMP").exists() or (copy / "STAMP").read_bytes() != (venv / "STAMP").read_bytes():
        shutil.rmtree(copy, ignore_errors=True)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(venv, copy, symlinks=True)
        os.chmod(RUN_DIR, 0o755)
        os.chmod(copy.parent, 0o755)
    # What the venv's bin/patroni runs, by the copy's interpreter (-m patroni would call itself __main__.py).
    run = "import sys; sys.argv[0] = 'patroni'; from patroni.__main__ import main; sys.exit(main())"
    return [str(copy / "bin" / "python"), "-c", run], [str(venv / "bin" / "patronictl")]


def patroni_version(version: str) -> str:
    """What the Patroni of `version` says it is, e.g. 'patroni 3.0.2'."""
    member, _ = patroni_commands(version)
    return subprocess.run([*member, "--version"], check=True, stdout=subprocess.PIPE, text=True).stdout.strip()


def slot_name(member: str) -> str:
    """The physical replication slot Patroni keeps for a member (patroni.dcs.slot_name_from_member_name):
    lowercased, '-' and '.' replaced by '_', any other character outside [a-z0-9_] by u<codepoint>."""
    out = []
    for c in member.lower():
        out.append(c if c.isascii() and (c.isalnum() or c == "_") else "_" if c in "-." else f"u{ord(c):04d}")
    return "".join(out)[:63]


# ---- processes ------------------------------------------------------------------------------------

def _ppids() -> dict[int, int]:
    """pid -> parent pid, of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            out[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(pid: int) -> list[int]:
    parents = _ppids()
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        todo += kids
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except (psycopg.Error, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


# ---- etcd -----------------------------------------------------------------------------------------

class Etcd:
    """One etcd 3.4 member on its own loopback ports: the DCS of one Patroni cluster."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            [etcd_binary(), "--name", "etcd0", "--data-dir", str(self.dir / "data"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"etcd0={peer}", "--initial-cluster-state", "new",
             "--initial-cluster-token", f"feature-outbox-{self.client_port}",
             # small and quiet: a drill writes a few thousand keys
             "--snapshot-count", "5000", "--quota-backend-bytes", str(256 * 2**20)],
            stdout=open(self.dir / "etcd.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self.healthy, 30, "etcd to answer /health")

    def healthy(self) -> bool:
        with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
            return json.loads(r.read()).get("health") == "true"

    def stop(self) -> None:
        if self.proc:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


# ---- Patroni --------------------------------------------------------------------------------------

@dataclass
class Member:
    name: str
    dir: Path
    pg_port: int
    rest_port: int
    proc: subprocess.Popen | None = None
    killed: bool = False
    paused: dict = field(default_factory=dict)   # member name -> pid stopped with SIGSTOP

    @property
    def slot(self) -> str:
        return slot_name(self.name)

    @property
    def data(self) -> Path:
        return self.dir / "data"

    @property
    def log(self) -> Path:
        return self.dir / "patroni.log"

    def dsn(self, db: str = "postgres", **extra) -> str:
        more = "".join(f" {k}={v}" for k, v in extra.items())
        return f"host=127.0.0.1 port={self.pg_port} user=postgres dbname={db} connect_timeout=2{more}"

    def connect(self, db: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(self.dsn(db), autocommit=True)

    def query(self, sql: str, *args, db: str = "postgres") -> list[tuple]:
        with self.connect(db) as conn:
            return conn.execute(sql, args or None).fetchall()

    def rest(self, path: str, method: str = "GET", body: dict | None = None, timeout: float = 2) -> tuple[int, dict | str]:
        """Patroni's REST API on this member: (HTTP status, JSON body, or text). Health endpoints
        answer 503 with a JSON body; that is an answer, not an error."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.rest_port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def postmaster_pid(self) -> int | None:
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if alive(pid) else None

    def in_recovery(self) -> bool:
        return self.query("SELECT pg_is_in_recovery()")[0][0]


class PatroniCluster:
    """etcd and `size` Patroni members named node-1 .. node-N (slots node_1 .. node_N).

    parameters: PostgreSQL parameters for the whole cluster, in bootstrap.dcs.postgresql.parameters
    (the relay's settings go here, once). dcs: further dynamic configuration (synchronous_mode,
    member_slots_ttl, ...) over the defaults below. local: per-member postgresql.parameters, by
    member name, for what must differ between members (Patroni's local configuration takes
    precedence over the dynamic one)."""

    # Patroni's timing: ttl 20 s is Patroni 4's minimum (3.0 takes less, 4 raises it to 20), loop_wait
    # 2 s and retry_timeout 5 s keep loop_wait + 2 * retry_timeout <= ttl. A failover then starts
    # when the dead leader's key expires, up to ttl after its last renewal, and the next loop of a
    # replica (loop_wait) runs the race.
    DCS = {
        "ttl": 20,
        "loop_wait": 2,
        "retry_timeout": 5,
        # A replica further behind the last leader position known in the DCS than this (bytes) does
        # not take part in the race. Patroni's default is 1 MB; a drill pausing replication for a few
        # seconds of edits can exceed it, and then no member is promoted at all. 64 MB: the drill is
        # about what the relay published, not about Patroni refusing a lagging replica.
        "maximum_lag_on_failover": 64 * 2**20,
        "synchronous_mode": False,
        "postgresql": {"use_pg_rewind": True, "use_slots": True},
    }
    PARAMETERS = {
        "shared_preload_libraries": "feature_outbox",
        "wal_level": "replica",
        "hot_standby": "on",
        "wal_log_hints": "on",   # pg_rewind, for a demoted leader coming back
        "max_wal_senders": 10,
        "max_replication_slots": 10,
        "max_connections": 50,
        # Throwaway clusters: no fsync (only a SIGKILLed process loses data here, never the OS), and
        # a commit returns once its WAL is written locally, which a walsender then streams.
        "fsync": "off",
        "synchronous_commit": "on",
        "max_wal_size": "256MB",
        "min_wal_size": "64MB",
        "checkpoint_timeout": "5min",
        "log_line_prefix": "%m [%p] %q%a ",
        "log_min_messages": "warning",
    }

    def __init__(self, directory: Path, version: str = "4.1.5", size: int = 3, parameters: dict | None = None,
                 dcs: dict | None = None, local: dict | None = None):
        if version not in VERSIONS:
            raise ValueError(f"Patroni version {version!r}: one of {', '.join(VERSIONS)}")
        self.dir, self.version, self.size = directory, version, size
        self.parameters = {**self.PARAMETERS, **(parameters or {})}
        self.dcs = {**self.DCS, **(dcs or {})}
        self.local = local or {}
        self.etcd = Etcd(directory / "etcd")
        self.members = [Member(f"node-{i + 1}", directory / f"node-{i + 1}", free_port(), free_port()) for i in range(size)]
        self.command, self.ctl = patroni_commands(version)

    # -- life cycle --

    def __enter__(self) -> "PatroniCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def config(self, m: Member) -> dict:
        dcs = json.loads(json.dumps(self.dcs))
        dcs["postgresql"]["parameters"] = dict(self.parameters)
        return {
            "scope": SCOPE,
            "namespace": "/feature_outbox/",
            "name": m.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"127.0.0.1:{m.rest_port}", "connect_address": f"127.0.0.1:{m.rest_port}"},
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd.client_port}"]},
            "bootstrap": {"dcs": dcs, "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}, "no-sync"]},
            "postgresql": {
                "listen": f"127.0.0.1:{m.pg_port}",
                "connect_address": f"127.0.0.1:{m.pg_port}",
                "data_dir": str(m.data),
                "bin_dir": str(PG_BIN),
                "pgpass": str(m.dir / "pgpass"),
                "authentication": {"superuser": {"username": "postgres", "password": "postgres"},
                                   "replication": {"username": "replicator", "password": "replicator"},
                                   "rewind": {"username": "postgres", "password": "postgres"}},
                "parameters": {"unix_socket_directories": str(m.dir), **self.local.get(m.name, {})},
                "pg_hba": ["local all all trust", "host all all 127.0.0.1/32 trust",
                           "host replication all 127.0.0.1/32 trust"],
            },
            "watchdog": {"mode": "off"},
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False, "nosync": False},
        }

    def start(self, timeout: float = 180) -> None:
        """etcd, then every member; returns once a leader runs and every replica streams from it."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        os.chmod(self.dir, 0o755)
        self.etcd.start()
        for m in self.members:
            self.start_member(m)
        leader = self.wait_for_leader(timeout)
        self.wait_streaming(leader, self.size - 1, timeout)

    def start_member(self, m: Member) -> None:
        """Patroni for member m, as postgres (when root): it bootstraps the cluster or clones the leader."""
        if not m.dir.exists():
            m.dir.mkdir(parents=True)
            if AS_ROOT:
                shutil.chown(m.dir, "postgres", "postgres")
            os.chmod(m.dir, 0o700)
        conf = self.dir / f"{m.name}.yml"
        conf.write_text(yaml.safe_dump(self.config(m), sort_keys=False))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PATRONI_", "PG"))}
        env.update(LC_ALL="C.UTF-8", LANG="C.UTF-8", PYTHONUNBUFFERED="1")
        as_pg = {}
        if AS_ROOT:
            env["HOME"] = "/var/lib/postgresql"
            as_pg = {"user": "postgres", "group": "postgres", "extra_groups": []}
        m.proc = subprocess.Popen([*self.command, str(conf)], stdout=open(m.log, "ab"), stderr=subprocess.STDOUT,
                                  env=env, cwd="/", start_new_session=True, **as_pg)
        m.killed = False

    def stop_all(self) -> None:
        """Every member's Patroni and PostgreSQL, and etcd, killed; the data directories removed (logs
        are kept in the run directory). Safe to call at any point, twice, or after a failed start."""
        for m in self.members:
            try:
                self.kill_node(m, wait=False)
            except Exception:
                pass
        for m in self.members:
            pm = m.postmaster_pid()
            for pid in [p for p in (pm, m.proc.pid if m.proc else None) if p]:
                deadline = time.monotonic() + 10
                while alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
            if m.proc:
                try:
                    m.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        self.etcd.stop()
        for m in self.members:
            shutil.rmtree(m.data, ignore_errors=True)
        shutil.rmtree(self.etcd.dir / "data", ignore_errors=True)

    # -- faults --

    def kill_node(self, m: Member | str, wait: bool = True) -> None:
        """A lost node: its Patroni and its whole PostgreSQL process tree SIGKILLed. Everything is
        stopped first (SIGSTOP), so that neither Patroni restarts nor the postmaster forks anything
        between the listing and the kill, then killed at once: no orphaned relay worker publishes."""
        m = self.member(m)
        roots = [p for p in (m.proc.pid if m.proc and m.proc.poll() is None else None, m.postmaster_pid()) if p]
        signal_all(roots, signal.SIGSTOP)
        tree = set(roots)
        for r in roots:
            tree.update(descendants(r))
        signal_all(tree, signal.SIGSTOP)
        signal_all(tree, signal.SIGKILL)
        m.killed = True
        m.paused.clear()
        if wait:
            wait_until(lambda: not any(alive(p) for p in tree), 10, f"{m.name}'s processes to die")
        if m.proc:
            try:
                m.proc.wait(10 if wait else 0.1)
            except subprocess.TimeoutExpired:
                pass

    def pause_replication(self, replica: Member | str, side: str = "sender") -> int:
        """Streaming to `replica` stops until resume_replication: SIGSTOP of the leader's walsender
        that serves it (side="sender", the default) or of the replica's walreceiver ("receiver").
        Returns the stopped pid.

        The sender side is what a drill wants: WAL committed meanwhile stays on the leader and is lost
        with it. A stopped walreceiver does not stop the leader's walsender from filling the socket
        buffers on both ends: a few hundred kB of WAL can still arrive once the receiver resumes,
        even after the leader died."""
        replica = self.member(replica)
        if side == "sender":
            leader = self.member(self.leader())
            rows = leader.query("SELECT pid FROM pg_stat_replication WHERE application_name = %s", replica.name)
            if not rows:
                raise AssertionError(f"{leader.name} has no walsender for {replica.name}")
            pid = rows[0][0]
        else:
            rows = replica.query("SELECT pid FROM pg_stat_wal_receiver")
            if not rows:
                raise AssertionError(f"{replica.name} has no walreceiver")
            pid = rows[0][0]
        os.kill(pid, signal.SIGSTOP)
        replica.paused[side] = pid
        return pid

    def resume_replication(self, replica: Member | str) -> None:
        replica = self.member(replica)
        signal_all(replica.paused.values(), signal.SIGCONT)
        replica.paused.clear()

    # -- state --

    def member(self, m: Member | str) -> Member:
        if isinstance(m, Member):
            return m
        return next(x for x in self.members if x.name == m)

    def live(self) -> list[Member]:
        return [m for m in self.members if not m.killed]

    def cluster_view(self) -> dict:
        """GET /cluster from the first live member that answers."""
        for m in self.live():
            try:
                status, body = m.rest("/cluster")
                if status == 200 and isinstance(body, dict):
                    return body
            except OSError:
                continue
        raise AssertionError("no member answers GET /cluster")

    def leader(self) -> str | None:
        """The member Patroni reports as leader (GET /cluster), or None."""
        try:
            view = self.cluster_view()
        except AssertionError:
            return None
        return next((x["name"] for x in view.get("members", []) if x.get("role") in ("leader", "master")), None)

    def replicas(self) -> list[str]:
        view = self.cluster_view()
        return [x["name"] for x in view.get("members", []) if x.get("role") not in ("leader", "master")
                and not self.member(x["name"]).killed]

    def wait_for_leader(self, timeout: float, exclude: set[str] = frozenset()) -> str:
        """The name of a live member, not in `exclude`, that Patroni reports as leader and whose
        PostgreSQL accepts writes (no longer in recovery). Polled every 0.1 s: the caller's clock
        just after this returns is the promotion time to within about that."""
        def found():
            name = self.leader()
            if name and name not in exclude and not self.member(name).killed and not self.member(name).in_recovery():
                return name
            return None
        return wait_until(found, timeout, f"a leader other than {sorted(exclude)}" if exclude else "a leader", interval=0.1)

    def wait_streaming(self, leader: str, n: int, timeout: float = 60) -> None:
        """Until the leader has `n` walsenders streaming to members (pg_basebackup's own walsender,
        while a replica is being created, streams too: only members' application names count), and
        Patroni reports each of them running."""
        lm = self.member(leader)
        names = [m.name for m in self.live()]
        wait_until(lambda: lm.query("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming' "
                                    "AND application_name = ANY(%s)", names)[0][0] >= n,
                   timeout, f"{n} replicas to stream from {leader}")
        wait_until(lambda: sum(1 for x in self.cluster_view()["members"] if x.get("role") not in ("leader", "master")
                               and x.get("state") in ("running", "streaming")) >= n,
                   timeout, f"Patroni to report {n} replicas running")

    def wait_replayed(self, leader: str, timeout: float = 60) -> None:
        """Until every live replica has replayed the leader's current insert position."""
        lm = self.member(leader)
        lsn = lm.query("SELECT pg_current_wal_insert_lsn()")[0][0]
        for m in self.live():
            if m.name != leader:
                wait_until(lambda: m.query("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", lsn)[0][0], timeout,
                           f"{m.name} to replay {lsn}")

    def edit_config(self, parameters: dict | None = None, **dcs) -> dict:
        """A change of the dynamic configuration, as `patronictl edit-config` makes it: PATCH /config
        on a live member. `parameters` go to postgresql.parameters (a value None removes the
        parameter), anything else to the top level (ttl=30, synchronous_mode=True). Every member
        applies it at its next loop (loop_wait): a reload for a sighup setting, a pending restart
        for a postmaster one. Returns the new configuration."""
        body = dict(dcs)
        if parameters:
            body["postgresql"] = {"parameters": parameters}
        status, out = self.live()[0].rest("/config", "PATCH", body)
        if status != 200:
            raise AssertionError(f"PATCH /config answered {status}: {out}")
        return out

    def patronictl(self, *args: str) -> str:
        """patronictl against this cluster, with the first live member's configuration file."""
        conf = self.dir / f"{self.live()[0].name}.yml"
        return subprocess.run([*self.ctl, "-c", str(conf), *args], check=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True).stdout

    def multi_host_dsn(self, db: str, **extra) -> str:
        """A libpq connection string naming every member, target_session_attrs=read-write: it reaches
        whichever member is the leader, as an application behind Patroni without a proxy would."""
        more = "".join(f" {k}={v}" for k, v in extra.items())
        hosts = ",".join("127.0.0.1" for _ in self.members)
        ports = ",".join(str(m.pg_port) for m in self.members)
        return f"host={hosts} port={ports} user=postgres dbname={db} target_session_attrs=read-write connect_timeout=2{more}"
