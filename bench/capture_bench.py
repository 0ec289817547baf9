"""Capture of direct writes (issue 49; make bench, section 14), side by side in one run. Prints figures only.

The release build, one cluster with wal_level = logical and synchronous_commit = on (PostgreSQL's
default; fsync stays off), one nats-server -js, 1 relay worker, the shared counties (numbered 1 to
3,231 in FIPS order, two copies of each shape 0.001° apart):
  1. latency: plain UPDATEs of county polygons on a captured user layer, one per transaction at
     BENCH_CAPTURE_RATE (200)/s for BENCH_CAPTURE_SECONDS (25), the client at synchronous_commit on,
     then off: from each UPDATE's commit in the client (wall clock) to the event's outbox row
     (created_at: the capture worker's transaction start), to its published_at, and to the
     subscriber's receipt of it from JetStream.
  2. throughput: a layer of BENCH_CAPTURE_ROWS (100,000) points (a grid around each county's point
     on surface) with a registered property, captured: their INSERT in one statement, then an
     UPDATE of the property in one statement, each timed from its commit until the worker has
     written every event (origin captured), then until the slot has caught up with the worker's own
     writes. Beside it the same rows' UPDATE through record_edit from one client, the layer not
     captured and no slot: UPDATE then record_edit per row, pipelined, 1,000 rows a transaction.
     The relay is paused in both, so that only the writing is measured; the CPU the writing
     process used (the worker; the client's backend) is a figure the other loads of a shared
     machine leave alone.
  3. wal_level: edit_feature of county polygons (bench/edit_bench.py's pgbench script, 2 clients) with
     wal_level = replica, logical, and logical with a layer captured (the worker decodes every edit's
     outbox row to skip it), restarting between them, rounds interleaved.
"""

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pg_test"))
sys.path.insert(0, str(ROOT / "bench"))
import edit_bench  # noqa: E402
from conftest import RUN_DIR, Cluster, free_port  # noqa: E402
from relay_harness import NatsServer, alter_system, configure, wait_for  # noqa: E402
from results import Subscriber, spread  # noqa: E402

DB = "capture"
RATE = int(os.environ.get("BENCH_CAPTURE_RATE", "200"))
SECONDS = int(os.environ.get("BENCH_CAPTURE_SECONDS", "25"))
ROWS = int(os.environ.get("BENCH_CAPTURE_ROWS", "100000"))
ROUNDS = int(os.environ.get("BENCH_CAPTURE_ROUNDS", "2"))
BATCH = 1000  # rows per transaction of the record_edit client

SETUP = r"""
CREATE SCHEMA bench;
CREATE TABLE bench.raw (doc jsonb);
"""

LOAD = r"""
CREATE TABLE bench.shapes (id bigint, k int, g geometry(Geometry, 4326), PRIMARY KEY (id, k));
INSERT INTO bench.shapes (id, k, g)
SELECT r.n, k, ST_Translate(ST_SetSRID(ST_GeomFromGeoJSON(r.doc->'geometry'), 4326), k * 0.001, 0)
  FROM (SELECT doc, row_number() OVER (ORDER BY doc->>'id') AS n FROM bench.raw) r, generate_series(0, 1) k;
-- The built-in features (section 3's edit_feature) and a user layer of the same counties (section 1).
SELECT count(feature_outbox.edit_feature(id, g, 'created')) FROM bench.shapes WHERE k = 0;
CREATE TABLE bench.counties (id bigint PRIMARY KEY, geom geometry(Geometry, 4326) NOT NULL,
                             version integer NOT NULL DEFAULT 0, name text);
SELECT feature_outbox.register_layer('counties', 'bench.counties', properties => '{name}');
INSERT INTO bench.counties (id, geom, name) SELECT id, g, 'county ' || id FROM bench.shapes WHERE k = 0;
SELECT count(feature_outbox.record_edit('counties', id, 'created')) FROM bench.counties;
-- Section 2's layer, empty: its rows arrive captured.
CREATE TABLE bench.points (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL,
                           version integer NOT NULL DEFAULT 0, kind text);
SELECT feature_outbox.register_layer('points', 'bench.points', properties => '{kind}');
"""

# A grid of points 0.01° apart around each county's point on surface.
POINTS = r"""
INSERT INTO bench.points (id, geom, kind)
SELECT row_number() OVER (ORDER BY s.id, j), ST_Translate(ST_PointOnSurface(s.g), j %% 6 * 0.01, j / 6 * 0.01), 'a'
  FROM bench.shapes s, generate_series(0, %(each)s - 1) j
 WHERE s.k = 0
 ORDER BY s.id, j
 LIMIT %(rows)s
"""

SLOTS = "SELECT count(*) FROM pg_catalog.pg_replication_slots WHERE slot_name LIKE 'feature_outbox_capture%%'"


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def capture(conn, layer, on=True):
    """capture_layer (the worker then reads the slot) or uncapture_layer (and, with the last layer,
    waits until the worker has dropped the slot)."""
    if on:
        conn.execute(f"CALL feature_outbox.capture_layer('{layer}')")
        wait_for(lambda: conn.execute("SELECT state FROM feature_outbox.capture").fetchone()[0] == "idle", 20,
                 "the capture worker")
    else:
        conn.execute(f"CALL feature_outbox.uncapture_layer('{layer}')")
        if conn.execute("SELECT cardinality(layers) FROM feature_outbox.capture").fetchone()[0] == 0:
            wait_for(lambda: conn.execute(SLOTS).fetchone()[0] == 0, 20, "the slot dropped")


def top_id(conn):
    return conn.execute("SELECT coalesce(max(id), 0) FROM feature_outbox.outbox").fetchone()[0]


def latency(c, server, n, label, synchronous):
    """UPDATEs of county polygons at RATE/s for SECONDS, autocommit: the writes/s achieved, and the
    times in ms from each commit to the event's outbox row (created_at: the start of the capture
    worker's transaction), to its published_at and to the subscriber's receipt (lists)."""
    prefix = "cap" + label
    configure(c, endpoint=server.url, nats_stream="CAP" + label.upper(), nats_subject_prefix=prefix)
    time.sleep(0.5)
    sub = Subscriber(server.url, prefix + ".>")
    committed, walls = {}, {}
    try:
        with c.connect(DB) as conn:
            conn.execute(f"SET synchronous_commit = {'on' if synchronous else 'off'}")
            since = top_id(conn)
            versions = dict(conn.execute("SELECT id, version FROM bench.counties").fetchall())
            start = time.monotonic()
            for i in range(RATE * SECONDS):
                # Sleep, never spin: a spinning client takes one of the 2 cores from the workers.
                time.sleep(max(0.0, start + i / RATE - time.monotonic()))
                fid = i % n + 1
                # The other copy of the shape: version 1 (the setup's) has copy 0, each event flips it.
                conn.execute("UPDATE bench.counties c SET geom = s.g FROM bench.shapes s WHERE c.id = %s AND s.id = %s AND s.k = %s",
                             (fid, fid, versions[fid] % 2))
                done, wall = time.monotonic(), time.time()
                versions[fid] += 1  # the worker's event bumps the version column by one
                committed[(str(fid), str(versions[fid]))] = done
                walls[(fid, versions[fid])] = wall
            achieved = len(committed) / (time.monotonic() - start)
        wait_for(lambda: all(k in sub.arrived for k in committed), 60, "every captured event at the subscriber")
    finally:
        sub.close()
    with c.connect(DB) as conn:
        rows = conn.execute("""SELECT feature_id, feature_version, extract(epoch FROM created_at), extract(epoch FROM published_at)
                                 FROM feature_outbox.outbox WHERE id > %s AND layer = 'counties' AND origin = 'captured'""", (since,)).fetchall()
    assert len(rows) == len(committed), f"{len(rows)} captured events for {len(committed)} UPDATEs"
    to_row = [(float(at) - walls[(fid, v)]) * 1000 for fid, v, at, _ in rows]
    to_pub = [(float(at) - walls[(fid, v)]) * 1000 for fid, v, _, at in rows]
    to_sub = [(sub.arrived[k] - t) * 1000 for k, t in committed.items()]
    configure(c, endpoint="")
    return achieved, to_row, to_pub, to_sub


def wait_written(conn, since, rows, timeout=600):
    """Polls the outbox's top id every 20 ms (the worker alone writes) until `rows` events are in."""
    wait_for(lambda: top_id(conn) - since >= rows, timeout, f"{rows:,} captured events", interval=0.02)


def check_events(conn, since, rows, event_type, origin):
    """Exactly one event of `event_type` and `origin` per row since outbox id `since`."""
    n, distinct, kinds = conn.execute("""SELECT count(*), count(DISTINCT feature_id), array_agg(DISTINCT (event_type, origin)::text)
                                           FROM feature_outbox.outbox WHERE id > %s AND layer = 'points'""", (since,)).fetchone()
    assert (n, distinct, kinds) == (rows, rows, [f"({event_type},{origin})"]), f"{n} events of {distinct} features, {kinds}"


def cpu_s(pid):
    """CPU seconds (user + system) process `pid` has used: a figure the other loads of a shared
    machine leave alone, unlike the time it took."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def captured_statement(conn, sql, params, event_type):
    """Runs `sql` (one statement, autocommit) on the captured layer: (statement s, commit to the last
    event s, last event to the slot caught up s, the capture worker's CPU s to the last event and
    for the catching up)."""
    worker = conn.execute("SELECT pid FROM feature_outbox.capture").fetchone()[0]
    since = top_id(conn)
    cpu0, t = cpu_s(worker), time.monotonic()
    conn.execute(sql, params)
    committed = time.monotonic()
    wait_written(conn, since, ROWS)
    done, cpu1 = time.monotonic(), cpu_s(worker)
    # Then the worker reads its own writes back (skipping them) until the slot is at the WAL's end.
    end = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    wait_for(lambda: conn.execute("SELECT confirmed_flush_lsn >= %s FROM pg_catalog.pg_replication_slots "
                                  "WHERE slot_name LIKE 'feature_outbox_capture%%'", (end,)).fetchone()[0], 600,
             "the slot to catch up", interval=0.05)
    caught_up, cpu2 = time.monotonic(), cpu_s(worker)
    check_events(conn, since, ROWS, event_type, "captured")
    return committed - t, done - committed, caught_up - done, cpu1 - cpu0, cpu2 - cpu1


def record_edit_client(conn, kind):
    """The same UPDATE as one client writes it with record_edit: per row, pipelined, BATCH rows a
    transaction; (elapsed s, its backend's CPU s)."""
    backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    since = top_id(conn)
    cpu0, t = cpu_s(backend), time.monotonic()
    for lo in range(1, ROWS + 1, BATCH):
        with conn.transaction(), conn.pipeline():
            for fid in range(lo, min(lo + BATCH, ROWS + 1)):
                conn.execute("UPDATE bench.points SET kind = %s WHERE id = %s", (kind, fid))
                conn.execute("SELECT feature_outbox.record_edit('points', %s::bigint, 'updated')", (fid,))
    elapsed, cpu = time.monotonic() - t, cpu_s(backend) - cpu0
    check_events(conn, since, ROWS, "updated", "application")
    return elapsed, cpu


def wal_levels(c, n):
    """edit_feature TPS and WAL bytes per edit by wal_level (and a captured layer), ROUNDS x edit_bench.SECONDS."""
    script = edit_bench.PICK.format(n=n, base=0) + edit_bench.ROWS[3][1] + "\n"
    cases = ("replica", "logical", "logical, a layer captured")
    tps = {k: [] for k in cases}
    wal = {k: [] for k in cases}
    level = "logical"
    for _ in range(ROUNDS):
        for case in cases:
            want = case.split(",")[0]
            if want != level:
                alter_system(c, {"wal_level": want})
                c.restart()
                level = want
            with c.connect(DB) as conn:
                if case.endswith("captured"):
                    capture(conn, "counties")
                conn.execute("CHECKPOINT")
                before = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
            r = edit_bench.pgbench(c, script, DB)
            with c.connect(DB) as conn:
                bytes_ = conn.execute("SELECT pg_current_wal_lsn() - %s::pg_lsn", (str(before),)).fetchone()[0]
                if case.endswith("captured"):
                    capture(conn, "counties", on=False)
            tps[case].append(r)
            wal[case].append(float(bytes_) / (r * edit_bench.SECONDS))
    return tps, wal


def main():
    t0 = time.monotonic()
    server = NatsServer(RUN_DIR / "capture-bench-nats")
    server.start()
    c = Cluster(RUN_DIR / "capture-bench", free_port())
    c.start(f"feature_outbox.database = '{DB}'", "feature_outbox.relay_workers = 1", "feature_outbox.endpoint = ''",
            "feature_outbox.retention = 0", "feature_outbox.retry_backoff_max = '200ms'", "shared_buffers = '512MB'",
            "max_wal_size = '4GB'", "wal_level = logical", "synchronous_commit = on")
    try:
        c.create_db(DB)
        with c.connect(DB) as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
            conn.execute(SETUP)
            edit_bench.copy_counties(conn)
            with conn.transaction():
                conn.execute(LOAD)
            n = conn.execute("SELECT count(*) FROM bench.counties").fetchone()[0]
            conn.execute("VACUUM ANALYZE")
        setup_s = time.monotonic() - t0

        # 2. throughput (first: no relay has run, so the outbox holds only the setup's events) -----
        with c.connect(DB) as conn:
            capture(conn, "points")
            insert = captured_statement(conn, POINTS, {"each": -(-ROWS // n), "rows": ROWS}, "created")
            conn.execute("VACUUM ANALYZE bench.points")
            update = captured_statement(conn, "UPDATE bench.points SET kind = 'b'", None, "updated")
            capture(conn, "points", on=False)
            conn.execute("VACUUM ANALYZE")
            client = record_edit_client(conn, "c")

        # 1. latency -----------------------------------------------------------------------------------
        with c.connect(DB) as conn:
            conn.execute("DELETE FROM feature_outbox.outbox")  # published or not: the relay starts clean
            conn.execute("VACUUM ANALYZE")
            capture(conn, "counties")
        runs = [("on", *latency(c, server, n, "sync", True)), ("off", *latency(c, server, n, "async", False))]
        with c.connect(DB) as conn:
            capture(conn, "counties", on=False)

        # 3. wal_level -----------------------------------------------------------------------------------
        tps, wal = wal_levels(c, n)

        print(f"Plain UPDATEs of county polygons on a captured layer, one per transaction at {RATE}/s for {SECONDS} s, "
              f"1 relay worker, into JetStream; from the UPDATE's commit in the client:")
        print()
        print("| client's synchronous_commit | writes/s achieved | → outbox row p50 ms | p99 ms | → published_at p50 ms | p99 ms | → subscriber p50 ms | p99 ms | max ms |")
        print("|---|---|---|---|---|---|---|---|---|")
        for label, achieved, to_row, to_pub, to_sub in runs:
            print(f"| {label} | {achieved:,.0f} | {pct(to_row, 0.5):.0f} | {pct(to_row, 0.99):.0f} | {pct(to_pub, 0.5):.0f} | "
                  f"{pct(to_pub, 0.99):.0f} | {pct(to_sub, 0.5):.0f} | {pct(to_sub, 0.99):.0f} | {max(to_sub):.0f} |")
        print()
        print(f"Target: commit → subscriber p99 ≤ 1,000 ms (goal 100 ms): {pct(runs[0][4], 0.99):.0f} ms at synchronous_commit on. "
              "The worker reads the slot every 100 ms, up to the last record written, which it flushes first: "
              "an asynchronous commit is read as soon as a synchronous one.")
        print()
        ins_rate, upd_rate = ROWS / insert[1], ROWS / update[1]
        client_rate = ROWS / client[0]
        us = lambda cpu: f"{cpu / ROWS * 1e6:,.0f}"
        print(f"{ROWS:,} points (a registered property `kind`), relay paused; events written per second, and the CPU "
              "of the process that wrote them (the capture worker; the client's backend):")
        print()
        print("| writer | statement s | events written s | events/s, from the commit | from the statement's start | "
              "CPU µs per event | slot caught up s later | worker CPU s meanwhile |")
        print("|---|---|---|---|---|---|---|---|")
        for name, r, rate in ((f"INSERT, one statement, captured (`created`)", insert, ins_rate),
                              (f"UPDATE of `kind`, one statement, captured (`updated`)", update, upd_rate)):
            print(f"| {name} | {r[0]:.1f} | {r[1]:.1f} | {rate:,.0f} | {ROWS / (r[0] + r[1]):,.0f} | {us(r[3])} | {r[2]:.1f} | {r[4]:.1f} |")
        print(f"| UPDATE + record_edit per row, one client, pipelined, {BATCH:,} rows a transaction, not captured | | "
              f"{client[0]:.1f} | | {client_rate:,.0f} | {us(client[1])} | | |")
        print()
        print(f"Captured UPDATE / record_edit = {upd_rate / client_rate:.2f} from the commit (target ≥ 0.7), "
              f"{ROWS / (update[0] + update[1]) / client_rate:.2f} from the UPDATE's start; CPU per event, record_edit's backend / "
              f"the capture worker = {client[1] / update[3]:.2f}. Every run: {ROWS:,} events of {ROWS:,} features. "
              "After its last event the worker reads its own writes back (and skips them) until the slot has caught up.")
        print()
        print(f"edit_feature of county polygons by wal_level (bench/edit_bench.py's pgbench, {edit_bench.CLIENTS} clients, "
              f"median of {ROUNDS} x {edit_bench.SECONDS} s, restart between):")
        print()
        print("| wal_level | edits/s | / replica | WAL bytes per edit |")
        print("|---|---|---|---|")
        base = statistics.median(tps["replica"])
        for case in tps:
            print(f"| {case} | {spread(tps[case])} | {statistics.median(tps[case]) / base:.2f} | {statistics.median(wal[case]):,.0f} |")
        print()
        print(f"Setup {setup_s:.0f} s; section {(time.monotonic() - t0) / 60:.1f} min.")
    finally:
        c.stop()
        server.stop()


if __name__ == "__main__":
    main()
