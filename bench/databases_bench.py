"""Many databases (issue 22): the relay rate of 3 databases x 1 worker beside 1 database x 3
workers, side by side in one cluster and one run, alternating, against one nats-server -js.

Each run fills the same number of events in total (BENCH_DB_BACKLOG, split evenly over the
databases of the layout), with the endpoint unset so nothing is claimed, gives each database a
stream of its own, then sets the endpoint and times until every outbox is drained. Each stream must
then hold its database's events once. Prints a markdown table; asserts nothing about speed."""

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pg_test"))
sys.path.insert(0, str(ROOT / "bench"))
from conftest import RUN_DIR, Cluster, free_port  # noqa: E402
from relay_harness import NatsServer, wait_for  # noqa: E402
from results import fill, stream_count  # noqa: E402

BACKLOG = int(os.environ.get("BENCH_DB_BACKLOG", "60000"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
FEATURES = 3000
LAYOUTS = {"1 database x 3 workers": (["one"], 3), "3 databases x 1 worker": (["m1", "m2", "m3"], 1)}


def prepare(c: Cluster, db: str) -> None:
    c.create_db(db)
    with c.connect(db) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute("""SELECT feature_outbox.edit_feature(g, ST_SetSRID(ST_MakePoint(-120 + (g %% 100) * 0.5, 25 + (g / 100) * 0.7), 4326), 'created')
                          FROM generate_series(1, %s) g""", (FEATURES,))


def unpublished(c: Cluster, db: str) -> int:
    with c.connect(db) as conn:
        return conn.execute("SELECT count(*) FROM feature_outbox.outbox WHERE published_at IS NULL").fetchone()[0]


def system(c: Cluster, **settings) -> None:
    with c.connect() as conn:
        for k, v in settings.items():
            conn.execute(f"ALTER SYSTEM SET feature_outbox.{k} = '{v}'")
        conn.execute("SELECT pg_reload_conf()")


def workers_running(c: Cluster, dbs: list[str], per: int) -> bool:
    with c.connect() as conn:
        n = dict(conn.execute("SELECT datname, count(*) FROM pg_stat_activity WHERE backend_type = 'feature_outbox relay' "
                              "GROUP BY datname").fetchall())
    return all(n.get(db) == per for db in dbs)


def run(c: Cluster, server: NatsServer, dbs: list[str], per: int, tag: str) -> float:
    system(c, endpoint="")
    with c.connect() as conn:
        for db in dbs:
            conn.execute(f"ALTER DATABASE {db} SET feature_outbox.nats_stream = 'B{tag}{db.upper()}'")
            conn.execute(f"ALTER DATABASE {db} SET feature_outbox.nats_subject_prefix = 'b{tag}{db}'")
    for db in dbs:
        fill(c, BACKLOG // len(dbs), db)
    time.sleep(2.5)  # the per-database settings restart the workers
    wait_for(lambda: workers_running(c, dbs, per), 20, "the workers")
    started = time.monotonic()
    system(c, endpoint=server.url)
    wait_for(lambda: all(unpublished(c, db) == 0 for db in dbs), 600, "every outbox to drain", interval=0.02)
    rate = BACKLOG / (time.monotonic() - started)
    for db in dbs:
        arrived = stream_count(server, f"B{tag}{db.upper()}")
        assert arrived == BACKLOG // len(dbs), f"{arrived} events of {db} in its stream"
    return rate


def main() -> None:
    server = NatsServer(RUN_DIR / "bench_databases_nats")
    server.start()
    c = Cluster(RUN_DIR / "bench_databases", free_port())
    c.start("feature_outbox.poll_interval = '200ms'", "max_worker_processes = 16")
    try:
        for dbs, _ in LAYOUTS.values():
            for db in dbs:
                prepare(c, db)
        rates = {name: [] for name in LAYOUTS}
        for repeat in range(REPEATS):
            for name, (dbs, per) in LAYOUTS.items():
                system(c, database=",".join(dbs), relay_workers=per)
                c.restart()
                rates[name].append(run(c, server, dbs, per, f"{repeat}{per}"))
        print(f"{BACKLOG:,} events in total per run ({FEATURES:,} point features per database), one nats-server -js, "
              f"{REPEATS} runs each, alternating; median (min – max):\n")
        print("| layout | events/s |")
        print("|---|---|")
        for name, values in rates.items():
            print(f"| {name} | {statistics.median(values):,.0f} ({min(values):,.0f} – {max(values):,.0f}) |")
        a, b = (statistics.median(v) for v in rates.values())
        print(f"\n3 databases x 1 worker run at {b / a:.2f} of 1 database x 3 workers.")
    finally:
        c.stop()
        server.stop()


if __name__ == "__main__":
    main()
