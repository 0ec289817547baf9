"""The standby gate's cost, side by side in one run (make bench, section 13). Prints figures only.

One primary (the release build), a local streaming standby on physical slot replica1 (pg_basebackup
-R, as an HA manager makes one), one nats-server -js, the shared counties, 1 relay worker:
  1. commit-to-acknowledgement latency of county polygon edits at 1,000/s (sleeping between edits,
     never spinning) for BENCH_LATENCY_SECONDS, wake_at_commit on: without the gate; with
     feature_outbox.standby_slots = 'replica1'; and with synchronous_commit = on and the standby in
     synchronous_standby_names instead (no gate). Both clocks: the client's (edit_feature's return to
     the subscriber's receipt, and the edit's own commit time, what editors feel) and the
     database's (published_at - created_at of the run's rows).
  2. the relay's drain of a BENCH_BACKLOG backlog into JetStream with and without the gate,
     alternating, BENCH_REPEATS each.
"""

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pg_test"))
sys.path.insert(0, str(ROOT / "bench"))
from conftest import RUN_DIR, Cluster, free_port  # noqa: E402
from relay_harness import NatsServer, alter_system, wait_for  # noqa: E402
from standby_harness import make_standby  # noqa: E402
from results import DB, Subscriber, configure, load_counties, memory, paused, spread, worker_drain  # noqa: E402

REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
LATENCY_S = int(os.environ.get("BENCH_LATENCY_SECONDS", "30"))
RATE = 1000
SLOT = "replica1"


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def latency(c, server, counties, label, synchronous=False):
    """Edits at RATE/s for LATENCY_S: (commit p50, p99, commit->ack p50, p99, max, database p50, p99)."""
    prefix = "lat" + label
    configure(c, endpoint=server.url, nats_stream="LAT" + label.upper(), nats_subject_prefix=prefix)
    time.sleep(0.5)
    sub = Subscriber(server.url, prefix + ".>")
    committed, commit_ms = {}, []
    try:
        with c.connect(DB) as conn:
            if synchronous:
                conn.execute("SET synchronous_commit = on")
            since = conn.execute("SELECT max(id) FROM feature_outbox.outbox").fetchone()[0] or 0
            start = time.monotonic()
            for i in range(RATE * LATENCY_S):
                time.sleep(max(0.0, start + i / RATE - time.monotonic()))
                fid, geometry = counties[i % len(counties)]
                t = time.monotonic()
                v = conn.execute("SELECT feature_outbox.edit_feature(%s, %s, 'moved')", (fid, geometry)).fetchone()[0]
                done = time.monotonic()
                commit_ms.append((done - t) * 1000)
                committed[(str(fid), str(v))] = done
        wait_for(lambda: all(k in sub.arrived for k in committed), 60, "every latency event")
    finally:
        sub.close()
    ms = [(sub.arrived[k] - t) * 1000 for k, t in committed.items()]
    with c.connect(DB) as conn:
        db = conn.execute("""SELECT percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY ms)
                               FROM (SELECT extract(epoch FROM published_at - created_at) * 1000 AS ms
                                       FROM feature_outbox.outbox WHERE id > %s) d""", (since,)).fetchone()[0]
    paused(c)
    return (pct(commit_ms, 0.5), pct(commit_ms, 0.99), pct(ms, 0.5), pct(ms, 0.99), max(ms), db[0], db[1])


def main():
    server = NatsServer(RUN_DIR / "standby-bench-nats")
    server.start()
    c = Cluster(RUN_DIR / "standby-bench", free_port())
    c.start(f"feature_outbox.database = '{DB}'", "feature_outbox.relay_workers = 1", "feature_outbox.endpoint = ''",
            "feature_outbox.retention = 0", "feature_outbox.retry_backoff_max = '200ms'", "shared_buffers = '512MB'",
            "max_wal_size = '4GB'", "synchronous_commit = off")
    standby = None
    try:
        c.create_db(DB)
        counties = load_counties(c)
        with c.connect() as conn:
            conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (SLOT,))
        standby = make_standby(c, RUN_DIR / "standby-bench-replica", slot=SLOT, name=SLOT)
        wait_for(lambda: memory(c) and len(memory(c)) == 1, 20, "the worker")

        print(f"Commit-to-acknowledgement at {RATE:,} county edits/s for {LATENCY_S} s, 1 worker, a local streaming standby on slot {SLOT}:")
        print()
        print("| run | editors' commit p50 ms | p99 ms | commit → subscriber p50 ms | p99 ms | max ms | database p50 ms | p99 ms |")
        print("|---|---|---|---|---|---|---|---|")
        rows = {}
        for label, gate, synchronous in (("open", "", False), ("gated", SLOT, False), ("sync", "", True)):
            alter_system(c, {"feature_outbox.standby_slots": gate,
                             "synchronous_standby_names": f'"{SLOT}"' if synchronous else ""})
            r = latency(c, server, counties, label, synchronous)
            rows[label] = r
            name = {"open": "no gate", "gated": f"standby_slots = '{SLOT}'", "sync": "synchronous_commit = on, standby synchronous, no gate"}[label]
            print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in r[:4]) + f" | {r[4]:.1f} | {r[5]:.2f} | {r[6]:.2f} |")
        alter_system(c, {"synchronous_standby_names": "", "feature_outbox.standby_slots": ""})
        print()
        print(f"Gate minus no gate, commit → subscriber p99: {rows['gated'][3] - rows['open'][3]:+.2f} ms (target ≤ +1 ms); "
              f"database p99: {rows['gated'][6] - rows['open'][6]:+.2f} ms. Editors' commit p99: no gate {rows['open'][1]:.2f} ms, "
              f"gate {rows['gated'][1]:.2f} ms, synchronous_commit = on {rows['sync'][1]:.2f} ms.")
        print()

        rates = {"open": [], "gated": []}
        for i in range(REPEATS):
            for label, gate in (("open", ""), ("gated", SLOT)):
                alter_system(c, {"feature_outbox.standby_slots": gate})
                rates[label].append(worker_drain(c, server, 1300 + 2 * i + (label == "gated")))
        ratio = statistics.median(rates["gated"]) / statistics.median(rates["open"])
        print(f"Drain of {int(os.environ.get('BENCH_BACKLOG', '100000')):,} county events into JetStream, 1 worker (events/s):")
        print()
        print("| run | events/s |")
        print("|---|---|")
        print(f"| no gate | {spread(rates['open'])} |")
        print(f"| standby_slots = '{SLOT}' | {spread(rates['gated'])} |")
        print()
        print(f"gate / no gate = {ratio:.2f} (target ≥ 0.9).")
    finally:
        if standby is not None:
            standby.stop()
        c.stop()
        server.stop()


if __name__ == "__main__":
    main()
