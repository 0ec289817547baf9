"""Relay and edit throughput benchmark (make bench). Prints figures; no pass/fail on speed.

1. edit_feature: N point edits and 3,231 real county polygons, events/s.
2. Relay to NATS JetStream: N unpublished rows drained by 1 and by 2 workers, events/s.
3. Relay to HTTP: a smaller batch to a local receiver, events/s.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pg_test"))
from conftest import COUNTIES, RUN_DIR, Cluster, free_port  # noqa: E402
from relay_harness import NatsServer, Receiver, all_published, point_edits, wait_for  # noqa: E402

N = int(os.environ.get("BENCH_EVENTS", "50000"))
DB = "bench"


def configure(c, settle=0.3, **settings):
    with c.connect() as conn:
        for k, v in settings.items():
            conn.execute(f"ALTER SYSTEM SET feature_outbox.{k} = '{v}'")
        conn.execute("SELECT pg_reload_conf()")
    time.sleep(settle)


def drained(c):
    with c.connect(DB) as conn:
        return all_published(conn)


def edits(c, n, first_id):
    with c.connect(DB) as conn:
        t = time.monotonic()
        point_edits(conn, first_id, n)
        return time.monotonic() - t


def drain(c, label, n, t):
    """From t, the moment before the reload that pointed the paused relay at its sink."""
    wait_for(lambda: drained(c), 600, f"{label} to drain", interval=0.05)
    dt = time.monotonic() - t
    print(f"  {label:<38} {n:>7} events in {dt:6.2f} s = {n / dt:>9,.0f} events/s")


def main():
    nats = NatsServer(RUN_DIR / "bench-nats")
    nats.start()
    receiver = Receiver()
    c = Cluster(RUN_DIR / "bench", free_port())
    c.start(f"feature_outbox.database = '{DB}'", "feature_outbox.relay_workers = 2",
            f"feature_outbox.endpoint = 'http://127.0.0.1:{free_port()}/paused'",
            "feature_outbox.retry_backoff_max = '200ms'", "shared_buffers = '512MB'")
    try:
        c.create_db(DB)
        c.restart()
        with c.connect(DB) as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        print(f"feature_outbox benchmark ({os.cpu_count()} cores)")
        print("edit_feature (relay paused):")
        dt = edits(c, N, 1)
        print(f"  {'point edits, one statement':<38} {N:>7} events in {dt:6.2f} s = {N / dt:>9,.0f} edits/s")
        rows = [json.loads(line) for line in COUNTIES.read_text().splitlines()]
        with c.connect(DB) as conn:
            t = time.monotonic()
            with conn.transaction():
                for r in rows:
                    conn.execute("SELECT feature_outbox.edit_feature(%s, %s, 'created')",
                                 (10_000_000 + int(r["id"]), json.dumps(r["geometry"])))
            dt = time.monotonic() - t
        print(f"  {'county polygons, one call each':<38} {len(rows):>7} events in {dt:6.2f} s = {len(rows) / dt:>9,.0f} edits/s")
        total = N + len(rows)

        print("relay to NATS JetStream (batch_size 200):")
        t = time.monotonic()
        configure(c, settle=0, endpoint=nats.url)
        drain(c, "2 workers, backlog of points+counties", total, t)
        configure(c, endpoint=f"http://127.0.0.1:{free_port()}/paused")
        edits(c, N, 20_000_000)
        t = time.monotonic()
        configure(c, settle=0, endpoint=nats.url, batch_size=1000)
        drain(c, "2 workers, batch_size 1000", N, t)

        print("relay to HTTP (keep-alive, local receiver):")
        configure(c, endpoint=f"http://127.0.0.1:{free_port()}/paused", batch_size=200)
        m = min(N, 10_000)
        edits(c, m, 30_000_000)
        t = time.monotonic()
        configure(c, settle=0, endpoint=receiver.url)
        drain(c, "2 workers", m, t)
        print(f"  receiver saw {len(receiver.requests)} requests for {m} events")
    finally:
        c.stop()
        nats.stop()
        receiver.close()


if __name__ == "__main__":
    main()
