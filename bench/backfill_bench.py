"""backfill() beside concurrent edits (make bench). Prints figures only.

A layer of BENCH_BACKFILL_FEATURES (default 100,000) points in a table of the user's own, and the
built-in table with as many. Two editor connections move random features of the layer with
edit_feature(layer, ...) all the time; each call's latency is recorded. Three phases per layer:
  no backfill       the editors alone
  backfill          CALL feature_outbox.backfill(layer): commits every 500 features
  one transaction   the same snapshots written by one chunk of every feature in one transaction,
                    what a single INSERT ... SELECT ... FOR SHARE would do
For each: the time it took, snapshots per second, and the editors' p50, p99 and max latency, and how
many edits waited over 100 ms.
"""

import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pg_test"))
from conftest import RUN_DIR, Cluster, free_port  # noqa: E402

DB = "backfill_bench"
N = int(os.environ.get("BENCH_BACKFILL_FEATURES", "100000"))
EDITORS = 2
IDLE_SECONDS = 3.0


def editors(c, layer, stop, latencies):
    def run(seed):
        rng = random.Random(seed)
        with psycopg.connect(c.dsn(DB), autocommit=True) as conn:
            sql = ("SELECT feature_outbox.edit_feature(%s::bigint, ST_SetSRID(ST_MakePoint(%s, %s), 4326), 'moved')" if layer == "features"
                   else "SELECT feature_outbox.edit_feature('" + layer + "', %s::bigint, ST_SetSRID(ST_MakePoint(%s, %s), 4326), 'moved')")
            conn.execute(sql, (1, -100.0, 40.0))  # plans cached before timing
            while not stop.is_set():
                t = time.perf_counter()
                conn.execute(sql, (rng.randint(1, N), rng.uniform(-120, -80), rng.uniform(30, 45)))
                latencies.append((time.perf_counter(), (time.perf_counter() - t) * 1000))
    threads = [threading.Thread(target=run, args=(s,)) for s in range(EDITORS)]
    for t in threads:
        t.start()
    return threads


def phase(c, layer, name, work):
    stop, latencies = threading.Event(), []
    threads = editors(c, layer, stop, latencies)
    time.sleep(0.5)
    start = time.perf_counter()
    written = work()
    end = time.perf_counter()
    stop.set()
    for t in threads:
        t.join()
    during = sorted(ms for at, ms in latencies if start <= at <= end + 0.05)
    q = statistics.quantiles(during, n=100) if len(during) > 1 else [0] * 99
    over = sum(1 for ms in during if ms > 100)
    rate = f"{written / (end - start):>9,.0f}" if written else f"{'':>9}"
    print(f"| {layer} | {name} | {end - start:>6.2f} | {rate} | {len(during):>6,} | {q[49]:>6.2f} | {q[98]:>6.2f} | {during[-1] if during else 0:>7.1f} | {over:>5} |")


def main():
    c = Cluster(RUN_DIR / "backfill_bench", free_port())
    c.start("feature_outbox.relay_workers = 0")
    try:
        c.create_db(DB)
        with c.connect(DB) as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
            conn.execute("CREATE TABLE public.points (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0)")
            conn.execute("SELECT feature_outbox.register_layer('points', 'public.points')")
            for layer in ("points", "features"):
                prefix = f"'{layer}', " if layer != "features" else ""
                for i in range(0, N, 10000):
                    conn.execute(f"""SELECT feature_outbox.edit_feature({prefix}i, ST_SetSRID(ST_MakePoint(-120 + (i %% 400) * 0.1, 30 + (i / 400) * 0.0002), 4326), 'created')
                                       FROM generate_series(%s::bigint, %s::bigint) i""", (i + 1, min(i + 10000, N)))
            conn.execute("VACUUM ANALYZE")
        print(f"{N:,} features per layer, {EDITORS} editors moving random ones; release build, fsync off")
        print()
        print("| layer | phase | seconds | snapshots/s | edits | p50 ms | p99 ms | max ms | >100 ms |")
        print("|---|---|---|---|---|---|---|---|---|")
        for layer in ("points", "features"):
            phase(c, layer, "no backfill", lambda: time.sleep(IDLE_SECONDS) or 0)
            with c.connect(DB) as conn:
                phase(c, layer, "backfill (500 a chunk)",
                      lambda: conn.execute("CALL feature_outbox.backfill(%s)", (layer,)).fetchone()[0])
            with psycopg.connect(c.dsn(DB)) as conn:
                def one():
                    n = int(conn.execute("SELECT feature_outbox._backfill_chunk(%s, NULL, NULL::text, %s)", (layer, N + 1)).fetchone()[0][1])
                    conn.commit()
                    return n
                phase(c, layer, "one transaction", one)
    finally:
        c.stop()


if __name__ == "__main__":
    main()
