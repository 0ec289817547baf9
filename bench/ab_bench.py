"""This build against an earlier release, side by side in one run: the bigint edit path and the relay,
each as a ratio to its own floor on the same cluster, so that the two builds' ratios compare even on
a noisy machine (issue 20: the bigint path stays within 5 % of 0.2.0's).

The earlier build runs from a copy of the PostgreSQL tree with that build installed
(FEATURE_OUTBOX_AB_BIN, its bin directory; FEATURE_OUTBOX_AB_LABEL names it). bench/ab_setup.sh
makes one from a release commit. Rounds interleave the builds (BENCH_ROUNDS, default 3); each figure
is the median, with min - max.
  edit: pgbench, 2 clients, `moved` of county polygons and of points, built-in table and a user
        layer, against the floor (bare UPDATE + outbox INSERT + ST_IsValid + ST_PointOnSurface);
  relay: one worker draining a BENCH_AB_BACKLOG-row backlog (default 30,000) into nats-server,
        against the in-worker floor (the same worker, discard:// sink).
  instructions: the same edits counted by callgrind (valgrind), instructions per edit in a
        single-user backend, the difference of a 100- and a 600-edit run of one fixed sequence:
        repeatable whatever else the machine does, where the TPS figures move by ~8 % from run to
        run on 2 cores (skipped without valgrind, or with BENCH_AB_INSTRUCTIONS=0).
Prints figures only; asserts nothing about speed.
"""

import os
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "pg_test"))
import edit_bench  # noqa: E402
import edit_steps  # noqa: E402
import results  # noqa: E402
from conftest import PG_BIN, RUN_DIR, Cluster, county_data, free_port  # noqa: E402
from relay_harness import NatsServer, wait_for  # noqa: E402

OTHER_BIN = Path(os.environ.get("FEATURE_OUTBOX_AB_BIN", "/opt/pg020/usr/lib/postgresql/15/bin"))
OTHER = os.environ.get("FEATURE_OUTBOX_AB_LABEL", "0.2.0")
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
results.BACKLOG = int(os.environ.get("BENCH_AB_BACKLOG", "30000"))
RELAY_WORKERS = int(os.environ.get("BENCH_AB_WORKERS", "1"))
FLOOR = 2  # edit_bench.ROWS index of the floor
EDITS = {"built-in edit_feature(id, geometry)": 3, "layer edit_feature('bench', id, geometry)": 6}


def edit_cluster(name: str, bin: Path) -> tuple[Cluster, int]:
    c = Cluster(RUN_DIR / f"ab-edit-{name}", free_port(), bin)
    c.start(f"feature_outbox.database = '{edit_bench.DB}'", "feature_outbox.relay_workers = 1",
            f"feature_outbox.endpoint = 'http://127.0.0.1:{free_port()}/closed'",
            "feature_outbox.retry_backoff_min = '60s'", "feature_outbox.retry_backoff_max = '60s'",
            "shared_buffers = '256MB'", "max_wal_size = '4GB'", "autovacuum_naptime = '10s'")
    c.create_db(edit_bench.DB)
    c.restart()
    with c.connect(edit_bench.DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute(edit_bench.SETUP)
        with conn.cursor().copy("COPY bench.raw (doc) FROM STDIN") as copy:
            for line in county_data().read_text().splitlines():
                copy.write_row((line,))
        conn.execute(edit_bench.LOAD % {"base": edit_bench.POINT_BASE})
        n = conn.execute("SELECT count(*) FROM bench.raw").fetchone()[0]
        conn.execute("VACUUM ANALYZE")
    return c, n


def relay_cluster(name: str, bin: Path) -> Cluster:
    c = Cluster(RUN_DIR / f"ab-relay-{name}", free_port(), bin)
    c.start(f"feature_outbox.database = '{results.DB}'", f"feature_outbox.relay_workers = {RELAY_WORKERS}",
            "feature_outbox.endpoint = ''", "feature_outbox.retention = 0", "feature_outbox.retry_backoff_max = '200ms'",
            "shared_buffers = '512MB'", "max_wal_size = '4GB'", "synchronous_commit = off")
    c.create_db(results.DB)
    c.restart()
    with c.connect(results.DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute("SELECT feature_outbox.edit_feature((d->>'id')::bigint, (d->'geometry')::text, 'created') "
                     "FROM (SELECT unnest(%s::jsonb[]) d) x", ([line for line in county_data().read_text().splitlines()],))
    return c


def instructions_per_edit(c: Cluster, n: int, base: int, sql: str) -> float:
    """Instructions per edit of `sql` (an edit_bench.ROWS statement) in a single-user backend of the
    stopped cluster `c`, under callgrind: (600-edit run - 100-edit run) / 500, one fixed sequence
    (bench/edit_steps.py, which also splits it by step)."""
    return edit_steps.per_edit(c, n, base, sql)[0]


def edit_table(labels: dict, sets: list, rate, cell) -> None:
    """One row per shape set and path: each build's cell(b, shapes, row), with rate(b, shapes, row)
    as a fraction of its floor's, and this build's fraction over the other's."""
    builds = list(labels)
    print(f"| shapes | path | {' | '.join(labels[b] for b in builds)} | this build / {OTHER} |")
    print("|---|---|" + "---|" * (len(builds) + 1))
    for label, _ in sets:
        for what, r in [("floor", FLOOR), *EDITS.items()]:
            ratios = {b: rate(b, label, r) / rate(b, label, FLOOR) for b in builds}
            cells = " | ".join(cell(b, label, r) + ("" if r == FLOOR else f", {ratios[b]:.1%} of floor") for b in builds)
            ab = "" if r == FLOOR else f"{ratios['this build'] / ratios[OTHER]:.3f}"
            print(f"| {label} | {what} | {cells} | {ab} |")


def version(c: Cluster, db: str) -> str:
    with c.connect(db) as conn:
        return conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'feature_outbox'").fetchone()[0]


def spread(values):
    return f"{statistics.median(values):,.0f} ({min(values):,.0f} - {max(values):,.0f})"


def main() -> None:
    if not (OTHER_BIN / "postgres").exists():
        raise SystemExit(f"no PostgreSQL tree at {OTHER_BIN}: run bench/ab_setup.sh first")
    builds = {"this build": PG_BIN, OTHER: OTHER_BIN}
    sets = [("county polygons", 0), ("points", edit_bench.POINT_BASE)]
    rows = [FLOOR, *EDITS.values()]
    tps = {(b, s, r): [] for b in builds for s, _ in sets for r in rows}
    clusters = {}
    ins = {}
    # BENCH_AB_PARTS: edit, relay or both (the default).
    parts = os.environ.get("BENCH_AB_PARTS", "edit,relay").split(",")
    labels = {b: b for b in builds}
    try:
        for b, bin in (builds.items() if "edit" in parts else []):
            clusters[b] = edit_cluster(b.replace(" ", "-").replace(".", ""), bin)
        if clusters:
            labels = {b: f"{b} ({version(clusters[b][0], edit_bench.DB)})" for b in builds}
        for _ in range(ROUNDS if clusters else 0):
            for label, base in sets:
                for r in rows:
                    name, sql = edit_bench.ROWS[r]
                    for b in builds:
                        c, n = clusters[b]
                        tps[(b, label, r)].append(edit_bench.pgbench(c, edit_bench.PICK.format(n=n, base=base) + sql + "\n"))
        if clusters and os.environ.get("BENCH_AB_INSTRUCTIONS", "1") != "0" and shutil.which("valgrind"):
            for b, (c, n) in clusters.items():
                c.stop()
                for label, base in sets:
                    for r in rows:
                        ins[(b, label, r)] = instructions_per_edit(c, n, base, edit_bench.ROWS[r][1])
    finally:
        for c, _ in clusters.values():
            c.stop()
    print(f"## A/B: this build against {OTHER}, side by side (median of {ROUNDS}, min - max)\n")
    if clusters:
        edit_tables(labels, sets, tps, ins)
    if "relay" in parts:
        relay_ab(builds, labels)


def edit_tables(labels, sets, tps, ins) -> None:
    print(f"Edit path: pgbench, {edit_bench.CLIENTS} clients, {edit_bench.SECONDS} s a run, `moved`, TPS and ratio to the floor "
          f"(bare UPDATE + outbox INSERT + ST_IsValid + ST_PointOnSurface) on the same cluster.\n")
    edit_table(labels, sets, lambda b, label, r: statistics.median(tps[(b, label, r)]),
               lambda b, label, r: spread(tps[(b, label, r)]))
    if ins:
        print(f"\nThe same edits counted by callgrind: instructions per edit in a single-user backend (no client, "
              f"no relay), one fixed sequence of 500, and ratio to the floor.\n")
        # Fewer instructions is faster: the rate is their inverse.
        edit_table(labels, sets, lambda b, label, r: 1 / ins[(b, label, r)], lambda b, label, r: f"{ins[(b, label, r)]:,.0f}")


def relay_ab(builds, labels) -> None:
    """One worker of each build drains the same backlog into nats-server and into the discard floor."""
    server = NatsServer(RUN_DIR / "ab-nats")
    server.start()
    rates = {(b, k): [] for b in builds for k in ("nats", "floor")}
    relays = {}
    try:
        for b, bin in builds.items():
            relays[b] = relay_cluster(b.replace(" ", "-").replace(".", ""), bin)
        for b, c in relays.items():
            wait_for(lambda: results.memory(c) and len(results.memory(c)) == RELAY_WORKERS, 20, "the relay workers")
        run = 0
        for _ in range(ROUNDS):
            for b, c in relays.items():
                run += 1
                rates[(b, "nats")].append(results.worker_drain(c, server, f"{run}"))
                run += 1
                rates[(b, "floor")].append(results.worker_drain(c, server, f"{run}", sink_url="discard://floor"))
    finally:
        for c in relays.values():
            c.stop()
        server.stop()
    print(f"\nRelay: {RELAY_WORKERS} worker(s), a {results.BACKLOG:,}-row backlog of county events, events/s into nats-server and "
          f"into the discard:// floor (the worker's own claim and mark).\n")
    print(f"| build | nats-server | floor | ratio to floor |")
    print("|---|---|---|---|")
    ratio = {}
    for b in builds:
        ratio[b] = statistics.median(rates[(b, "nats")]) / statistics.median(rates[(b, "floor")])
        print(f"| {labels[b]} | {spread(rates[(b, 'nats')])} | {spread(rates[(b, 'floor')])} | {ratio[b]:.1%} |")
    print(f"\nthis build / {OTHER}, relay ratio to floor: {ratio['this build'] / ratio[OTHER]:.3f}")


if __name__ == "__main__":
    main()
