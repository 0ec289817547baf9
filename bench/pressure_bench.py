"""The outbox under pressure (make bench): relay and backlog with and without a long transaction.

One worker relays to nats-server -js. First 20k edits are relayed and vacuumed, then the figures
are taken. Then a REPEATABLE READ transaction stays open while 80k more edits are relayed, each 20k
vacuumed, and the same figures are taken again, side by side:
  - commit-to-subscriber latency of single edits on an otherwise empty backlog (a core NATS
    subscriber on the stream's subjects), p50 and p95 of BENCH_SINGLES (default 100);
  - `SELECT * FROM backlog`, median of 5;
  - the claim of 200 on an empty backlog, as the worker runs it, median of 5, and the same claim
    from id 0, as it ran before the low-water id;
  - the drain of a 20k backlog, events/s.
Prints figures; asserts nothing.
"""

import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import nats
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pg_test"))
from conftest import RUN_DIR, Cluster, free_port  # noqa: E402
from relay_harness import CLAIM_FROM, NatsServer, all_published, point_edits, wait_for  # noqa: E402

DB = "pressure"
SINGLES = int(os.environ.get("BENCH_SINGLES", "100"))
CLAIM = CLAIM_FROM.format(low="feature_outbox._relay_low_water()")


class Subscriber:
    """A core NATS subscription on features.>, in its own thread: when each feature id arrived."""

    def __init__(self, url):
        self.arrived, self.ready = {}, threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.start(url), self.loop).result(10)

    async def start(self, url):
        self.nc = await nats.connect(url)

        async def got(msg):
            feature = msg.headers.get("Feature-Id") if msg.headers else None
            self.arrived.setdefault(feature or msg.subject, time.monotonic())

        await self.nc.subscribe("features.>", cb=got)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.nc.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def timed(conn, sql, runs=5):
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        conn.execute(sql).fetchall()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def configure(c, endpoint, settle=0.5):
    with c.connect() as conn:
        conn.execute(f"ALTER SYSTEM SET feature_outbox.endpoint = '{endpoint}'")
        conn.execute("SELECT pg_reload_conf()")
    time.sleep(settle)


def measure(c, conn, nats_server, sub, first):
    # Single edits, each relayed before the next: commit-to-subscriber latency.
    latencies = []
    for i in range(first, first + SINGLES):
        conn.execute("SELECT feature_outbox.edit_feature(%s, '{\"type\":\"Point\",\"coordinates\":[3,4]}', 'created')", (i,))
        committed = time.monotonic()
        arrived = wait_for(lambda: sub.arrived.get(str(i)), 10, f"feature {i} at the subscriber", interval=0.0002)
        latencies.append((arrived - committed) * 1000)
    latencies.sort()
    wait_for(lambda: all_published(conn), 30, "the singles to drain")
    conn.execute("SET enable_seqscan = off")
    conn.execute("SET enable_bitmapscan = off")
    conn.execute("SET jit = off")  # as the relay's claim (src/relay/claim.rs): JIT compiled it for ~100 ms
    figures = {
        "latency p50 (ms)": latencies[len(latencies) // 2],
        "latency p95 (ms)": latencies[int(len(latencies) * 0.95)],
        "SELECT * FROM backlog (ms)": timed(conn, "SELECT * FROM feature_outbox.backlog"),
        "claim of 200, empty backlog (ms)": timed(conn, CLAIM),
        # What the claim cost before the mark: the scan from the lowest id.
        "the same claim from id 0 (ms)": timed(conn, CLAIM_FROM.format(low=0)),
    }
    conn.execute("RESET enable_seqscan")
    conn.execute("RESET enable_bitmapscan")
    conn.execute("RESET jit")
    # A 20k backlog, built while the relay is paused, then drained.
    configure(c, f"http://127.0.0.1:{free_port()}/paused")
    point_edits(conn, first + SINGLES, 20_000)
    waiting = conn.execute("SELECT count(*) FROM feature_outbox.outbox WHERE published_at IS NULL").fetchone()[0]
    assert waiting == 20_000, f"the paused relay published {20_000 - waiting} rows"
    t = time.monotonic()  # from the reload that points the paused worker at NATS again
    configure(c, nats_server.url, settle=0)
    wait_for(lambda: all_published(conn), 300, "the 20k backlog to drain", interval=0.02)
    figures["drain of 20k (events/s)"] = 20_000 / (time.monotonic() - t)
    return figures


def main():
    nats_server = NatsServer(RUN_DIR / "bench-pressure-nats")
    nats_server.start()
    c = Cluster(RUN_DIR / "bench-pressure", free_port())
    c.start(f"feature_outbox.database = '{DB}'", f"feature_outbox.endpoint = '{nats_server.url}'",
            "feature_outbox.relay_workers = 1", "feature_outbox.retry_backoff_max = '200ms'",
            "feature_outbox.retention = '1h'", "shared_buffers = '256MB'")
    sub = Subscriber(nats_server.url)
    long = None
    try:
        c.create_db(DB)
        c.restart()
        with c.connect(DB) as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
            point_edits(conn, 1, 20_000)
            wait_for(lambda: all_published(conn), 120, "the first 20k to be relayed")
            conn.execute("VACUUM feature_outbox.outbox")
            before = measure(c, conn, nats_server, sub, 100_000)
            conn.execute("VACUUM feature_outbox.outbox")

            long = psycopg.connect(c.dsn(DB))
            long.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            long.execute("SELECT count(*) FROM feature_outbox.outbox")  # the snapshot it keeps
            for k in range(4):
                point_edits(conn, 1_000_000 + k * 20_000, 20_000)
                wait_for(lambda: all_published(conn), 120, "20k more to be relayed")
                conn.execute("VACUUM feature_outbox.outbox")
            after = measure(c, conn, nats_server, sub, 2_000_000)
            mark = conn.execute("SELECT feature_outbox._relay_low_water()").fetchone()[0]
        print(f"the outbox under pressure: 1 worker to NATS JetStream, {os.cpu_count()} cores")
        print(f"  {'figure':<36} {'no long transaction':>20} {'REPEATABLE READ held, 80k relayed':>36}")
        for name in before:
            print(f"  {name:<36} {before[name]:>20,.2f} {after[name]:>36,.2f}")
        print(f"  (low-water id at the end: {mark:,})")
    finally:
        if long is not None:
            long.close()
        sub.close()
        c.stop()
        nats_server.stop()


if __name__ == "__main__":
    main()
