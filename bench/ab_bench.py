"""This build against an earlier one, side by side in one run: make bench's section 16 (against the
last release in sql/released/RELEASES, issue 51) and make bench-ab (against any release or commit).

The earlier build runs from a copy of the PostgreSQL tree with that build installed
(FEATURE_OUTBOX_AB_BIN, its bin directory; FEATURE_OUTBOX_AB_LABEL names it). bench/ab_setup.sh
makes one, once per commit, and stamps it with the commit. Rounds interleave the builds
(BENCH_ROUNDS, default 3), so that what else the machine does falls on both; each figure is the
median, with min - max.
  edit: pgbench, 2 clients, `moved` of county polygons and of points, built-in table and a user
        layer, beside the floor (bare UPDATE + outbox INSERT + ST_IsValid + ST_PointOnSurface);
  relay: one worker draining a BENCH_AB_BACKLOG-row backlog (default 30,000) into nats-server,
        and into the in-worker floor (the same worker, discard:// sink); with the relay workers'
        CPU time per event (the scheduler's run time), which moves far less than the rates between runs;
  instructions: the same edits counted by callgrind (valgrind), instructions per edit in a
        single-user backend, the difference of a 100- and a 600-edit run of one fixed sequence,
        on the clusters as loaded (before pgbench), both builds at once: repeatable to 0.2 %
        whatever else the machine does, where the TPS figures move by 8 % and more from run to
        run on 2 cores (skipped without valgrind, or with BENCH_AB_INSTRUCTIONS=0).
Every figure is printed for both builds with this build's ratio to the earlier one, and marked
(`▼`) when this build is more than 3 % worse; a closing line lists the marked figures. The floor
is the same SQL in both builds, into a LIKE copy of each build's outbox table (so a wider outbox
row counts there as well); its rates' ratio is mostly the run's noise.
Prints figures only; asserts nothing about speed. argv[1], if given, is the heading.
"""

import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "pg_test"))
import edit_bench  # noqa: E402
import edit_steps  # noqa: E402
import results  # noqa: E402
from conftest import PG_BIN, RUN_DIR, Cluster, county_data, free_port  # noqa: E402
from relay_harness import NatsServer, wait_for  # noqa: E402

OTHER_BIN = Path(os.environ.get("FEATURE_OUTBOX_AB_BIN", "/nonexistent"))
OTHER = os.environ.get("FEATURE_OUTBOX_AB_LABEL", "earlier")
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
results.BACKLOG = int(os.environ.get("BENCH_AB_BACKLOG", "30000"))
RELAY_WORKERS = int(os.environ.get("BENCH_AB_WORKERS", "1"))
FLOOR = 2  # edit_bench.ROWS index of the floor
EDITS = {"built-in edit_feature(id, geometry)": 3, "layer edit_feature('bench', id, geometry)": 6}


def edit_cluster(name: str, bin: Path) -> tuple[Cluster, int]:
    return edit_bench.edit_cluster(RUN_DIR / f"ab-edit-{name}", bin)


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


def resume(c: Cluster) -> None:
    """Starts a stopped cluster again as it was (Cluster.start would make a fresh one)."""
    as_pg = ["runuser", "-u", "postgres", "--"] if os.getuid() == 0 else ["sudo", "-u", "postgres"]
    subprocess.run([*as_pg, str(c.bin / "pg_ctl"), "-D", str(c.dir / "data"), "-l", str(c.dir / "server.log"), "-w", "start"],
                   check=True, stdout=subprocess.DEVNULL)


def instructions_per_edit(c: Cluster, n: int, base: int, sql: str) -> float:
    """Instructions per edit of `sql` (an edit_bench.ROWS statement) in a single-user backend of the
    stopped cluster `c`, under callgrind: (600-edit run - 100-edit run) / 500, one fixed sequence
    (bench/edit_steps.py, which also splits it by step)."""
    return edit_steps.per_edit(c, n, base, sql)[0]


WORSE = 0.03  # a figure more than this much worse than the earlier build's is marked
worse: list[str] = []  # the marked figures, for the closing line


def pct(x: float, sign: str = "") -> str:
    """x as a percentage the way the book writes them: 4.2 %."""
    return f"{x * 100:{sign}.1f} %"


def mark(what: str, ratio: float, lower_is_better: bool = False) -> str:
    """The marker of a figure whose this/other ratio is `ratio`: `▼` and by how much, when this build
    is more than WORSE worse (a lower rate, or more instructions); noted in `worse`."""
    change = ratio - 1
    if (change > WORSE) if lower_is_better else (change < -WORSE):
        note = f"▼ {pct(change, '+')}"
        worse.append(f"{what} {note}")
        return note
    return ""


def edit_table(labels: dict, sets: list, value, cell, lower_is_better: bool, unit: str) -> None:
    """One row per shape set and path: each build's cell(b, shapes, row), this build's ratio to the
    other's value(b, shapes, row), each build's value against its own floor, and the marker."""
    this, other = labels
    floor_col = "× floor" if lower_is_better else "of floor"
    print(f"| shapes | path | {labels[this]} | {labels[other]} | this / {OTHER} | {floor_col}: this, {OTHER} | |")
    print("|---|---|---|---|---|---|---|")
    for label, _ in sets:
        for what, r in [("floor", FLOOR), *EDITS.items()]:
            ratio = value(this, label, r) / value(other, label, r)
            of_floor = {b: value(b, label, r) / value(b, label, FLOOR) for b in labels}
            f = "" if r == FLOOR else (f"{of_floor[this]:.3f}, {of_floor[other]:.3f}" if lower_is_better
                                       else f"{pct(of_floor[this])}, {pct(of_floor[other])}")
            m = mark(f"{label}, {what} ({unit})", ratio, lower_is_better)
            print(f"| {label} | {what} | {cell(this, label, r)} | {cell(other, label, r)} | {ratio:.3f} | {f} | {m} |")


def took(what: str, since: float) -> float:
    """Says on stderr how long a part took; returns now."""
    now = time.monotonic()
    print(f"ab_bench: {what} in {now - since:.0f} s", file=sys.stderr, flush=True)
    return now


def version(c: Cluster, db: str) -> str:
    with c.connect(db) as conn:
        return conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'feature_outbox'").fetchone()[0]


def spread(values):
    return f"{statistics.median(values):,.0f} ({min(values):,.0f} - {max(values):,.0f})"


def main() -> None:
    if not (OTHER_BIN / "postgres").exists():
        raise SystemExit(f"no PostgreSQL tree at {OTHER_BIN} (FEATURE_OUTBOX_AB_BIN): bench/ab_setup.sh makes one")
    t0 = time.monotonic()
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
            labels = {b: label_of(b, version(clusters[b][0], edit_bench.DB)) for b in builds}
            t = took("the edit clusters, loaded", t0)
        # Instructions first, on the clusters as loaded: after pgbench each cluster's tables would hold
        # as many dead rows as its build made edits, and the counts would follow the rates.
        if clusters and os.environ.get("BENCH_AB_INSTRUCTIONS", "1") != "0" and shutil.which("valgrind"):
            for c, _ in clusters.values():
                c.stop()
            # Counts do not depend on what else runs: both builds at once, a thread each (one
            # single-user backend at a time per data directory).
            def count(b):
                c, n = clusters[b]
                return {(b, label, r): instructions_per_edit(c, n, base, edit_bench.ROWS[r][1]) for label, base in sets for r in rows}
            with ThreadPoolExecutor(len(builds)) as pool:
                for counts in pool.map(count, builds):
                    ins.update(counts)
            for c, _ in clusters.values():
                resume(c)
            t = took("callgrind", t)
        for _ in range(ROUNDS if clusters else 0):
            for label, base in sets:
                for r in rows:
                    name, sql = edit_bench.ROWS[r]
                    for b in builds:
                        c, n = clusters[b]
                        tps[(b, label, r)].append(edit_bench.pgbench(c, edit_bench.PICK.format(n=n, base=base) + sql + "\n"))
        if clusters:
            t = took("pgbench", t)
    finally:
        for c, _ in clusters.values():
            c.stop()
    # bench/ab_setup.sh's stamp, at the top of the tree, names the commit.
    stamp = OTHER_BIN.parents[4] / "STAMP"
    commit = next((l[7:] for l in stamp.read_text().splitlines() if l.startswith("commit=")), "") if stamp.exists() else ""
    heading = sys.argv[1] if len(sys.argv) > 1 else f"A/B: this build against {OTHER}"
    print(f"## {heading}\n")
    print(f"This build against {OTHER}{f' (commit {commit[:12]})' if commit else ''}, side by side in one run on "
          f"{os.cpu_count()} cores: median of {ROUNDS} interleaved rounds (min - max), this build's ratio to {OTHER}, "
          f"and `▼` where this build is more than {WORSE * 100:g} % worse. The floor is the same SQL in both builds, into a copy "
          f"of each build's outbox table: a wider outbox row shows there too. Rates on a busy machine move by 8 % "
          f"and more from run to run, the floors' with them; instruction counts repeat to 0.2 %.\n")
    if clusters:
        edit_tables(labels, sets, tps, ins)
    if "relay" in parts:
        relay_ab(builds, labels)
    print(f"\n{summary()} ({time.monotonic() - t0:.0f} s)")


def label_of(b: str, version: str) -> str:
    return b if b == version else f"{b} ({version})"


def summary() -> str:
    if not worse:
        return f"No figure is more than {WORSE * 100:g} % worse than {OTHER}'s."
    return f"REGRESSION: {len(worse)} figure(s) more than {WORSE * 100:g} % worse than {OTHER}'s: " + "; ".join(worse) + "."


def edit_tables(labels, sets, tps, ins) -> None:
    print(f"Edit path: pgbench, {edit_bench.CLIENTS} clients, {edit_bench.SECONDS} s a run, `moved` to a translated copy, TPS, "
          f"and each build's TPS as a fraction of its floor's (bare UPDATE + outbox INSERT + ST_IsValid + ST_PointOnSurface, "
          f"one statement) on the same cluster.\n")
    edit_table(labels, sets, lambda b, label, r: statistics.median(tps[(b, label, r)]),
               lambda b, label, r: spread(tps[(b, label, r)]), False, "TPS")
    if ins:
        print(f"\nThe same edits counted by callgrind: instructions per edit in a single-user backend (no client, "
              f"no relay), one fixed sequence of 500, and each build's count as a multiple of its floor's. "
              f"Fewer is better; these repeat to 0.2 % from run to run.\n")
        edit_table(labels, sets, lambda b, label, r: ins[(b, label, r)], lambda b, label, r: f"{ins[(b, label, r)]:,.0f}",
                   True, "instructions")


def relay_ab(builds, labels) -> None:
    """One worker of each build drains the same backlog into nats-server and into the discard floor."""
    t = time.monotonic()
    server = NatsServer(RUN_DIR / "ab-nats")
    server.start()
    rates = {(b, k): [] for b in builds for k in ("nats", "floor")}
    cpu = {key: [] for key in rates}
    relays = {}
    try:
        for b, bin in builds.items():
            relays[b] = relay_cluster(b.replace(" ", "-").replace(".", ""), bin)
        for b, c in relays.items():
            wait_for(lambda: results.memory(c) and len(results.memory(c)) == RELAY_WORKERS, 20, "the relay workers")
            if labels[b] == b:
                labels[b] = label_of(b, version(c, results.DB))
        run = 0
        for _ in range(ROUNDS):
            for b, c in relays.items():
                for key, sink in (("nats", None), ("floor", "discard://floor")):
                    run += 1
                    meter = WorkerCpu(c)
                    rates[(b, key)].append(results.worker_drain(c, server, f"{run}", sink_url=sink, meter=meter))
                    cpu[(b, key)].append(meter.spent * 1e6 / results.BACKLOG)
    finally:
        for c in relays.values():
            c.stop()
        server.stop()
    took("the relay part", t)
    this, other = builds
    print(f"\nRelay: {RELAY_WORKERS} worker(s), a {results.BACKLOG:,}-row backlog of county events, events/s into nats-server, "
          f"into the discard:// floor (the worker's own claim and mark), and the one as a fraction of the other.\n")
    print(f"| figure | {labels[this]} | {labels[other]} | this / {OTHER} | |")
    print("|---|---|---|---|---|")
    med = {k: statistics.median(v) for k, v in rates.items()}
    for key, what in (("nats", "into nats-server, events/s"), ("floor", "discard:// floor, events/s")):
        ratio = med[(this, key)] / med[(other, key)]
        print(f"| {what} | {spread(rates[(this, key)])} | {spread(rates[(other, key)])} | {ratio:.3f} | "
              f"{mark(f'relay {what}', ratio)} |")
    of = {b: med[(b, "nats")] / med[(b, "floor")] for b in builds}
    ratio = of[this] / of[other]
    print(f"| nats-server / floor | {pct(of[this])} | {pct(of[other])} | {ratio:.3f} | {mark('relay nats-server / floor', ratio)} |")
    for key, what in (("nats", "worker CPU per event into nats-server, µs"), ("floor", "worker CPU per event, discard:// floor, µs")):
        ratio = statistics.median(cpu[(this, key)]) / statistics.median(cpu[(other, key)])
        print(f"| {what} | {spread_us(cpu[(this, key)])} | {spread_us(cpu[(other, key)])} | {ratio:.3f} | "
              f"{mark(f'relay {what}', ratio, lower_is_better=True)} |")


class WorkerCpu:
    """results.worker_drain's meter: the CPU seconds the relay workers (every thread) spent over one
    drain, from the scheduler's nanosecond run times: /proc/<pid>/stat's 10 ms ticks are 2 % of a
    30,000-row floor drain, and moved its figure by a tick from run to run."""

    def __init__(self, c: Cluster):
        self.pids = [r[0] for r in results.memory(c)]

    def __call__(self, poller):
        return self

    def __enter__(self):
        self.before = sum(run_seconds(p) for p in self.pids)
        return self

    def __exit__(self, *exc):
        self.spent = sum(run_seconds(p) for p in self.pids) - self.before
        return False


def run_seconds(pid: int) -> float:
    """Seconds every thread of pid has run on a CPU (/proc/<pid>/task/*/schedstat, first field, ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def spread_us(values):
    return f"{statistics.median(values):.2f} ({min(values):.2f} - {max(values):.2f})"


if __name__ == "__main__":
    main()
