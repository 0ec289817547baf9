"""The fault drills (issue 13), each a function returning its row (drills.Row). `make faults` runs
them full and writes pg_test/FAULTS.md; pg_test/test_faults.py runs each short in `make test`.

    .venv/bin/python pg_test/faults.py [--short] [--only NAME ...] [--out pg_test/FAULTS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import email.utils
import json
import platform
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import nats
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import PG_BIN, RUN_DIR, Cluster, free_port  # noqa: E402
from drills import (DB, HEADER, LAYER, PIPELINED, PIPELINED_LOG, TABLE, CoreSubscriber, Editors, Nats, Row, crash_and_restart,  # noqa: E402
                    some_backed_off, drain, kill_workers, nats_and_cluster, relay_pids, running, seen_states,
                    states_through, workers,
                    kill_tree, nats_binary, nats_cluster, parked, read_stream, start_cluster,
                    tally)
from relay_harness import wait_for  # noqa: E402
from tile_drills import tiles_postmaster_crash, tiles_worker_kill  # noqa: E402
from kafka_drills import kafka_broker_kill, kafka_order, kafka_unreachable, kafka_worker_kill  # noqa: E402
from tile_cache_drills import tile_cache_faults  # noqa: E402
from sink_drills import kafka_hang, nats_hang  # noqa: E402
from capture_drills import capture_postmaster_crash, capture_worker_kill  # noqa: E402


def settle(c: Cluster, editors: Editors, recovered: float, seconds: float = 2.0):
    """The editors go on for `seconds` after recovery, then stop; the outbox drains. (ledger, drain_s)."""
    time.sleep(seconds)
    ledger = editors.stop()
    return ledger, drain(c, recovered)


# ---- 1. a relay worker terminated mid-batch -----------------------------------------------------------------

def worker_kill(short: bool, nats_version: str = "debian") -> Row:
    with nats_and_cluster("kill", nats_version, "feature_outbox.relay_workers = 2", PIPELINED) as (server, c):
        editors = Editors(c, n=3, rate=100).start()
        times = 4 if short else 10
        kill_workers(c, times, 2)
        recovered = time.time()
        wait_for(lambda: running(c, 2), 30, "the workers to come back")
        ledger, drain_s = settle(c, editors, recovered, 1)
        row = tally(f"1. worker killed x{times} (pg_terminate_backend, kill -9)", ledger, read_stream([server.url]), drain_s)
        row.checks = {"the catch-up ran pipelined": PIPELINED_LOG in c.log()}
        return row


# ---- 2. a postmaster crash mid-batch ------------------------------------------------------------------------

def postmaster_crash(short: bool, nats_version: str = "debian") -> Row:
    # Woken by the poll only, the worker finds about a second of edits each time: full batches, so
    # the crash lands while it pipelines, and so does the catch-up after it. (The launcher starts the
    # worker as soon as recovery ends: woken at each commit, it would keep up in batches of one.)
    with nats_and_cluster("crash", nats_version, "fsync = on", "synchronous_commit = on", PIPELINED,
                          "feature_outbox.wake_at_commit = off") as (server, c):
        editors = Editors(c, n=3, rate=100).start()
        time.sleep(2 if short else 5)
        crash_and_restart(c)
        recovered = time.time()
        ledger, drain_s = settle(c, editors, recovered, 2 if short else 5)
        row = tally("2. postmaster crash (-m immediate), fsync on", ledger, read_stream([server.url]), drain_s)
        row.checks = {"the catch-up ran pipelined": PIPELINED_LOG in c.log()}
        return row


# ---- 3. a 3-node JetStream cluster loses its leader, then its quorum ------------------------------------------

async def stream_leader(urls: list[str]) -> str:
    nc = await nats.connect(servers=urls, connect_timeout=3)
    try:
        info = await nc.jetstream().stream_info("FEATURES")
        return info.cluster.leader
    finally:
        await nc.close()


def jetstream_cluster(short: bool, nats_version: str = "debian") -> Row:
    nodes = nats_cluster(RUN_DIR / "drills" / "nats_jsc", nats_binary(nats_version))
    urls = [n.url for n in nodes]
    c = start_cluster("jsc", "feature_outbox.relay_workers = 2", "feature_outbox.nats_replicas = 3", PIPELINED,
                      endpoint=",".join(urls))
    note = []
    try:
        editors = Editors(c, n=3, rate=100).start()
        wait_for(lambda: safe(lambda: asyncio.run(stream_leader(urls))), 30, "the R3 stream to have a leader")
        time.sleep(1.5)
        leader = asyncio.run(stream_leader(urls))
        by_name = {n.name: n for n in nodes}
        killed_at = time.time()
        by_name[leader].kill()
        note.append(f"leader {leader} killed")
        time.sleep(3 if short else 8)
        # A second node: no quorum (1 of 3). The workers back off visibly and park nothing.
        second = next(n for n in nodes if n.proc is not None)
        second.kill()
        if not short:
            time.sleep(15)

        def backing_off_now():
            states = workers(c, "state", "last_error")
            return any(s == "backing off" for s, _ in states) and any(e for _, e in states)

        # A state to reach, not a time to wait: a busy machine takes longer to notice the lost quorum.
        try:
            backing_off = wait_for(backing_off_now, 30, "the workers to back off without quorum")
        except AssertionError:
            backing_off = False
        parked_during = parked(c)
        note.append(f"no quorum: workers {'backing off with last_error' if backing_off else 'NOT backing off'}, {parked_during} parked")
        by_name[leader].start()
        second.start()
        recovered = time.time()
        time.sleep(2 if short else 5)
        ledger = editors.stop()
        drain_s = drain(c, recovered, timeout=180)
        row = tally("3. JetStream R3: leader killed, then quorum lost", ledger, read_stream(urls), drain_s,
                    note=", ".join(note))
        row.checks = {"workers back off without quorum": backing_off, "nothing parked without quorum": parked_during == 0,
                      "the catch-up ran pipelined": PIPELINED_LOG in c.log()}
        if row.lost:
            # The cluster acknowledged messages it no longer has (seen on 2.9.10, once in ten
            # runs). The outbox still holds them: replay from the first kill and count again.
            with c.connect(DB) as conn:
                replayed = conn.execute("SELECT feature_outbox.replay_published(to_timestamp(%s))", (killed_at,)).fetchone()[0]
            drain(c, time.time())
            again = tally(row.drill, ledger, read_stream(urls), drain_s)
            row.note += (f"; the stream lost {row.lost:,} acknowledged messages when the nodes came back; "
                         f"replay_published(since the first kill) requeued {replayed:,}, after which {again.lost:,} were missing")
            row.checks["a replay restores what the cluster lost"] = again.lost == 0 and again.invented == 0
        return row
    finally:
        c.stop()
        for n in nodes:
            n.stop()


def safe(f):
    try:
        return f()
    except Exception:
        return None


# ---- 4. PostgreSQL failover to a streaming standby --------------------------------------------------------------

def failover(short: bool, synchronous: bool, nats_version: str = "debian") -> Row:
    server = Nats(RUN_DIR / "drills" / f"nats_failover_{int(synchronous)}", nats_binary(nats_version))
    server.start()
    name = "sync" if synchronous else "async"
    primary = start_cluster(f"primary_{name}", "wal_level = replica", "max_wal_senders = 4", "fsync = on",
                            "synchronous_commit = on", "feature_outbox.relay_workers = 2", endpoint=server.url)
    standby = Cluster(RUN_DIR / "drills" / f"standby_{name}", free_port())
    try:
        make_standby(primary, standby, "standby1")
        if synchronous:
            with primary.connect(DB) as conn:
                conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'standby1'")
                conn.execute("SELECT pg_reload_conf()")
            wait_for(lambda: sync_state(primary) == "sync", 20, "the standby to be synchronous")
        editors = Editors(primary, n=3, rate=100).start()
        time.sleep(3 if short else 10)
        kill_tree(primary)  # the whole process group: no orphaned worker keeps publishing
        editors.set_dsn(standby.dsn(DB))
        subprocess.run(["runuser", "-u", "postgres", "--", PG_BIN / "pg_ctl", "-D", standby.dir / "data", "-w", "promote"],
                       check=True, stdout=subprocess.DEVNULL)
        recovered = time.time()
        wait_for(lambda: running(standby, 2), 30, "the new primary's workers to start at promotion")
        time.sleep(2 if short else 5)
        ledger = editors.stop()
        drain_s = drain(standby, recovered)
        with standby.connect(DB) as conn:
            held = {e for (e,) in conn.execute("SELECT event_id::text FROM feature_outbox.outbox")}
        deliveries = read_stream([server.url])
        row = tally(f"4. failover to {'a synchronous' if synchronous else 'an asynchronous'} standby", ledger, deliveries, drain_s, held=held)
        missing = set(ledger.committed) - held
        if synchronous:
            row.checks = {"every committed edit is on the new primary": not missing}
        else:
            # What asynchronous replication can lose: edits committed on the old primary that had not
            # reached the standby, with their events; if the old primary's relay published one first,
            # it counts as invented (the new primary does not hold its edit).
            row.note = (f"committed on the old primary but not replicated: {len(missing)}; {row.note}").strip("; ")
            row.checks = {"lost only edits the standby never received": row.lost_ids <= missing,
                          "invented only events of those edits": row.invented_ids <= missing}
        return row
    finally:
        for x in (standby, primary):
            try:
                x.stop()
            except Exception:
                pass
        server.stop()


def make_standby(primary: Cluster, standby: Cluster, name: str) -> None:
    as_pg = ["runuser", "-u", "postgres", "--"]
    subprocess.run(["rm", "-rf", str(standby.dir)], check=True)
    subprocess.run(["install", "-d", "-o", "postgres", "-g", "postgres", "-m", "0700", str(standby.dir)], check=True)
    subprocess.run([*as_pg, PG_BIN / "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
                    "-D", standby.dir / "data", "-R", "-X", "stream", "-c", "fast"], check=True)
    auto = standby.dir / "data" / "postgresql.auto.conf"
    text = auto.read_text().replace(f"port = {primary.port}", f"port = {standby.port}")
    text = text.replace(f"unix_socket_directories = '{primary.dir}'", f"unix_socket_directories = '{standby.dir}'")
    text = text.replace("primary_conninfo = '", f"primary_conninfo = 'application_name={name} ")
    subprocess.run([*as_pg, "tee", str(auto)], input=text, text=True, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*as_pg, PG_BIN / "pg_ctl", "-D", standby.dir / "data", "-l", standby.dir / "server.log", "-w", "start"],
                   check=True, stdout=subprocess.DEVNULL)
    wait_for(lambda: sync_state(primary) is not None, 20, "the standby to stream")


def sync_state(c: Cluster):
    with c.connect("postgres") as conn:
        r = conn.execute("SELECT sync_state FROM pg_stat_replication LIMIT 1").fetchone()
    return r[0] if r else None


# ---- 5. NATS stopped, then started -------------------------------------------------------------------------------

def nats_outage(short: bool, nats_version: str = "debian") -> Row:
    with nats_and_cluster("outage", nats_version) as (server, c):
        editors = Editors(c, n=3, rate=100).start()
        time.sleep(2)
        server.stop()
        seen = states_through(c, 8 if short else 30)
        server.start()
        recovered = time.time()
        ledger, drain_s = settle(c, editors, recovered)
        row = tally(f"5. NATS stopped {8 if short else 30} s", ledger, read_stream([server.url]), drain_s,
                    note=f"seen during the outage: {seen_states(seen)}; {parked(c)} parked")
        row.checks = {"workers back off during the outage": some_backed_off(seen), "nothing parked": parked(c) == 0}
        return row


# ---- 6. the stream deleted while relaying ------------------------------------------------------------------------

async def delete_stream(url: str) -> None:
    nc = await nats.connect(url)
    await nc.jetstream().delete_stream("FEATURES")
    await nc.close()


def stream_deleted(short: bool, nats_version: str = "debian") -> Row:
    with nats_and_cluster("deleted", nats_version) as (server, c):
        wait_for(lambda: safe(lambda: asyncio.run(stream_exists(server.url))), 20, "the relay to create the stream")
        sub = CoreSubscriber(server.url)  # what is published, whatever happens to the stream
        editors = Editors(c, n=3, rate=100).start()
        time.sleep(2)
        asyncio.run(delete_stream(server.url))
        deleted = time.time()
        recreated = wait_for(lambda: safe(lambda: asyncio.run(stream_exists(server.url))), 60, "the stream to come back")
        back_after = time.time() - deleted
        ledger, drain_s = settle(c, editors, deleted)
        time.sleep(0.5)
        row = tally("6. stream deleted while relaying", ledger, sub.stop(), drain_s,
                    note=f"the worker recreated it {back_after:.1f} s later; delivered: a core subscription's messages")
        row.checks = {"the worker recreates the stream": bool(recreated)}
        return row


async def stream_exists(url: str) -> bool:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().stream_info("FEATURES")
        return True
    finally:
        await nc.close()


# ---- 7. a slow, then refusing, then resetting HTTP receiver ---------------------------------------------------------

class PhasedReceiver:
    """A real HTTP server (the standard library's ThreadingHTTPServer) whose answer depends on the
    phase: `slow` answers 200 after 2.5 s (over publish_timeout: the relay has given up by then),
    `503` answers 503 with Retry-After as an HTTP-date, `reset` reads the request and closes the
    connection with a TCP reset before any status line, `ok` answers 200. Records the webhook-id and
    body of every request it answered 200, as a receiver that processes what it accepted."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        self.phase, self.accepted, self.requests, self.lock = "slow", [], 0, threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with outer.lock:
                    outer.requests += 1
                    phase = outer.phase
                if phase == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()
                    return
                if phase == "503":
                    self.send_response(503)
                    self.send_header("Retry-After", email.utils.formatdate(time.time() + 1, usegmt=True))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if phase == "slow":
                    time.sleep(2.5)
                with outer.lock:
                    outer.accepted.append((self.headers["webhook-id"], json.loads(body)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"

    def close(self):
        self.server.shutdown()


def http_receiver(short: bool, nats_version: str = "debian") -> Row:
    receiver = PhasedReceiver()
    c = start_cluster("http", endpoint=receiver.url)
    try:
        editors = Editors(c, n=3, rate=50).start()
        step = 4 if short else 10
        for phase in ("slow", "503", "reset"):
            receiver.phase = phase
            time.sleep(step)
        receiver.phase = "ok"
        recovered = time.time()
        time.sleep(2)
        ledger = editors.stop()
        drain_s = drain(c, recovered)
        row = tally("7. HTTP: slow, 503 Retry-After (HTTP-date), resets, then 200", ledger, receiver.accepted, drain_s,
                    note=f"{receiver.requests} requests; {parked(c)} parked")
        row.checks = {"nothing parked": parked(c) == 0}
        return row
    finally:
        c.stop()
        receiver.close()


# ---- 8. a long REPEATABLE READ transaction during load ----------------------------------------------------------------

def long_transaction(short: bool, nats_version: str = "debian") -> Row:
    with nats_and_cluster("long", nats_version, "feature_outbox.relay_workers = 2") as (server, c):
        holder = psycopg.connect(c.dsn(DB))
        holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        holder.execute("SELECT count(*) FROM feature_outbox.outbox")  # takes the snapshot, and keeps it
        editors = Editors(c, n=3, rate=100).start()
        hold = 20 if short else 120
        worst_relay_xact, wrong_backlog, end = 0.0, 0, time.monotonic() + hold
        while time.monotonic() < end:
            with c.connect(DB) as conn:
                worst = conn.execute("""SELECT coalesce(max(extract(epoch FROM now() - xact_start)), 0) FROM pg_stat_activity
                                         WHERE backend_type = 'feature_outbox relay' AND xact_start IS NOT NULL""").fetchone()[0]
                worst_relay_xact = max(worst_relay_xact, float(worst))
                with conn.transaction():  # one snapshot for both counts
                    conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    view, real = conn.execute("""SELECT (SELECT unpublished_rows FROM feature_outbox.backlog),
                                                        (SELECT count(*) FROM feature_outbox.outbox WHERE published_at IS NULL)""").fetchone()
                    wrong_backlog += view != real
            time.sleep(0.5)
        holder.close()
        ledger, drain_s = settle(c, editors, time.time(), 0)
        row = tally(f"8. REPEATABLE READ transaction open {hold} s", ledger, read_stream([server.url]), drain_s,
                    note=f"longest relay transaction seen {worst_relay_xact:.2f} s; backlog view wrong {wrong_backlog} times")
        row.checks = {"relay transactions stay under 5 s": worst_relay_xact < 5, "the backlog view stays right": wrong_backlog == 0}
        return row


# ---- 9. commits out of id order -----------------------------------------------------------------------------------------

def out_of_order(short: bool, nats_version: str = "debian") -> Row:
    with nats_and_cluster("ooo", nats_version) as (server, c):
        editors = Editors(c, n=2, rate=100)
        laggards = []
        for i in range(3 if short else 10):
            conn = psycopg.connect(c.dsn(DB))
            fid = 900_000 + i
            conn.execute(f"SELECT feature_outbox.edit_feature('{LAYER}', %s, ST_SetSRID(ST_MakePoint(10, 10), 4326), 'created')", (fid,))
            eid, oid = conn.execute("SELECT event_id::text, id FROM feature_outbox.outbox WHERE feature_id = %s", (fid,)).fetchone()
            laggards.append((conn, fid, eid, oid))
        editors.start()
        time.sleep(3 if short else 10)
        with c.connect(DB) as conn:
            published_above = conn.execute("SELECT count(*) FROM feature_outbox.outbox WHERE published_at IS NOT NULL AND id > %s",
                                           (max(o for *_, o in laggards),)).fetchone()[0]
        for conn, fid, eid, _ in laggards:
            conn.commit()
            conn.close()
            editors.ledger.committed[eid] = (LAYER, fid, 1)
        ledger, drain_s = settle(c, editors, time.time(), 1)
        row = tally("9. lower ids committed after higher ones were published", ledger, read_stream([server.url]), drain_s,
                    note=f"{len(laggards)} late commits below {published_above} published rows")
        row.checks = {"higher ids were published first": published_above > 0}
        return row


# ---- 10. load ---------------------------------------------------------------------------------------------------------------

def load(short: bool, nats_version: str = "debian") -> Row:
    with nats_and_cluster("load", nats_version, "feature_outbox.relay_workers = 2") as (server, c):
        per = 1000 if short else 25_000
        started = time.monotonic()
        ledger = Editors(c, n=4, limit=per, rate=None, rollback=0.05, features=5000).start().wait()
        wrote = time.monotonic() - started
        drain_s = drain(c, time.time(), timeout=600)
        return tally(f"10. load: 4 editors x {per:,} edits, 2 workers", ledger, read_stream([server.url]), drain_s,
                     note=f"{len(ledger.committed) / wrote:,.0f} edits/s committed while relaying")


# ---- 11. three databases on one server, their workers killed ------------------------------------------------------

def many_databases(short: bool, nats_version: str = "debian") -> Row:
    """Three databases served by one launcher (feature_outbox.database = '*'), each with its own
    stream and prefix; editors in each; the workers of one database after another killed."""
    dbs = {DB: ("features", "FEATURES"), "drills_b": ("features_b", "FEATURES_B"), "drills_c": ("features_c", "FEATURES_C")}
    with nats_and_cluster("databases", nats_version, "feature_outbox.database = '*'", "feature_outbox.relay_workers = 1",
                          PIPELINED) as (server, c):
        for db, (prefix, stream) in dbs.items():
            if db != DB:
                c.create_db(db)
                with c.connect(db) as conn:
                    conn.execute("CREATE EXTENSION feature_outbox CASCADE")
                    conn.execute(TABLE)
                    conn.execute(f"SELECT feature_outbox.register_layer('{LAYER}', 'public.drill')")
            with c.connect() as conn:
                conn.execute(f"ALTER DATABASE {db} SET feature_outbox.nats_subject_prefix = '{prefix}'")
                conn.execute(f"ALTER DATABASE {db} SET feature_outbox.nats_stream = '{stream}'")
        served = lambda: all(len(relay_pids(c, db)) == 1 for db in dbs)  # noqa: E731
        wait_for(served, 30, "a worker in each database")
        time.sleep(2.5)  # the per-database settings restarted them
        editors = {db: Editors(c, n=1, rate=100, dsn=c.dsn(db)).start() for db in dbs}
        times = 6 if short else 15
        for i in range(times):
            time.sleep(0.7)
            wait_for(served, 30, "every database's worker to run")
            db = list(dbs)[i % 3]
            [pid] = relay_pids(c, db)
            if i % 2 == 0:
                with c.connect() as conn:
                    conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            else:
                subprocess.run(["kill", "-9", str(pid)], check=False)  # the postmaster resets every backend
        recovered = time.time()
        wait_for(served, 30, "the workers to come back")
        time.sleep(1)
        ledgers = {db: e.stop() for db, e in editors.items()}
        rows = [tally(db, ledgers[db], read_stream([server.url], stream), drain(c, recovered, db=db))
                for db, (prefix, stream) in dbs.items()]
        total = Row(f"11. three databases, their workers killed x{times} (pg_terminate_backend, kill -9)",
                    *[sum(getattr(r, f) for r in rows) for f in ("committed", "delivered", "duplicates", "lost", "invented")],
                    drain_s=max(r.drain_s for r in rows), uncertain=sum(r.uncertain for r in rows),
                    note="; ".join(f"{r.drill}: {r.committed:,} committed, {r.delivered:,} delivered"
                                   + (f" ({r.uncertain} commits cut off)" if r.uncertain else "") for r in rows))
        total.checks = {"every database relayed": all(r.delivered > 0 for r in rows)}
        return total


DRILLS = {
    "worker_kill": worker_kill,
    "postmaster_crash": postmaster_crash,
    "jetstream_cluster": jetstream_cluster,
    "failover_sync": lambda short, v="debian": failover(short, True, v),
    "failover_async": lambda short, v="debian": failover(short, False, v),
    "nats_outage": nats_outage,
    "stream_deleted": stream_deleted,
    "http_receiver": http_receiver,
    "long_transaction": long_transaction,
    "out_of_order": out_of_order,
    "load": load,
    "many_databases": many_databases,
    "tiles_worker_kill": tiles_worker_kill,
    "tiles_postmaster_crash": tiles_postmaster_crash,
    "kafka_worker_kill": kafka_worker_kill,
    "kafka_broker_kill": kafka_broker_kill,
    "kafka_unreachable": kafka_unreachable,
    "kafka_order": kafka_order,
    "tile_cache_faults": tile_cache_faults,
    "nats_hang": nats_hang,
    "kafka_hang": kafka_hang,
    "capture_worker_kill": capture_worker_kill,
    "capture_postmaster_crash": capture_postmaster_crash,
}
NATS_DRILLS = {"worker_kill", "jetstream_cluster", "nats_outage", "stream_deleted"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "FAULTS.md"))
    args = ap.parse_args()
    names = args.only or list(DRILLS)
    rows = []
    versions = ["debian"] + (["current"] if Path(nats_binary("current")).exists() else [])
    for name in names:
        for v in (versions if name in NATS_DRILLS else ["debian"]):
            print(f"drill {name} (nats-server {v}) ...", flush=True)
            row = DRILLS[name](args.short, v)
            if name in NATS_DRILLS:
                row.drill += f" (nats-server {Nats(RUN_DIR / 'drills' / 'version', nats_binary(v)).version()})"
            print(row.line(), row.note, flush=True)
            rows.append(row)
    machine = f"{platform.node()}: {platform.machine()}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores, {platform.platform()}"
    pg = subprocess.run([PG_BIN / "postgres", "--version"], capture_output=True, text=True).stdout.strip()
    text = ["# Fault drills", "",
            f"`make faults` ({'short' if args.short else 'full'} drills), {time.strftime('%Y-%m-%d')}.", "",
            f"- machine: {machine}", f"- {pg}; nats-server: " + ", ".join(
                Nats(RUN_DIR / "drills" / "version", nats_binary(v)).version() + f" ({v})" for v in versions), "",
            "lost and invented compare the committed edits (their event_ids, read in each edit's own transaction) with the",
            "distinct events delivered. A commit cut off by the fault may or may not have committed: it counts as neither.", "",
            HEADER, *[r.line() for r in rows], "", "Notes, by row:", "",
            *[f"- {r.drill}: {r.note}" for r in rows if r.note], ""]
    Path(args.out).write_text("\n".join(text))
    print(f"wrote {args.out}")
    bad = [r for r in rows if ((r.lost or r.invented) and "asynchronous" not in r.drill) or not all(r.checks.values())]
    for r in bad:
        print(f"FAILED: {r.drill}: lost {r.lost}, invented {r.invented}, checks {r.checks}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
