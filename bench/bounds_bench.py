"""Where the relay's speed is bounded (issue 24): each drain of make bench's relay and HTTP rows again,
with the CPU it cost, so that a ratio that misses its target shows whether the machine had more to give.

For each drain (a 100,000-row backlog of county events, 1 relay worker): events/s; how many of the
machine's cores were busy (/proc/stat); and the CPU time per event of each process taking part
(/proc/<pid>/stat, all threads): the relay worker, the other PostgreSQL processes, nats-server,
nginx, and the rest of the machine. "Ceiling" is the rate at which that CPU per event would fill every
core: a drain whose cores are all busy cannot go faster than it without spending less per event.
Drains: the in-worker floor (e, discard sink), JetStream (a), and webhooks to Debian's nginx with
http_concurrency 1 and 8. The backlog is polled from one kept connection (its CPU is the poller's
own column, not PostgreSQL's). Prints a markdown table; asserts nothing about speed."""

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pg_test"))
sys.path.insert(0, str(ROOT / "bench"))
from conftest import RUN_DIR, Cluster, free_port  # noqa: E402
from relay_harness import NatsServer, wait_for  # noqa: E402
from results import DB, Nginx, configure, load_counties, memory, worker_drain  # noqa: E402

BACKLOG = int(os.environ.get("BENCH_BACKLOG", "100000"))
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
TICK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count()


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of pid (0 once it has exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def busy_seconds() -> float:
    """CPU seconds the machine spent on anything but idle and I/O wait, summed over the cores."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICK


def children(parent: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                    out.append(int(p.name))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


class Meter:
    """Around one drain (results.worker_drain's meter): wall time, CPU seconds the machine was busy,
    and the CPU seconds of each process group. PostgreSQL's other processes are taken as they are at
    the start and at the end: a process that started meanwhile counts whole, one that exited
    meanwhile falls to the rest of the machine."""

    def __init__(self, c: Cluster, groups: dict):
        self.postmaster = int((c.dir / "data" / "postmaster.pid").read_text().split()[0])
        self.groups = {"relay worker": [memory(c)[0][0]], **groups}

    def __call__(self, poller):
        self.pids = {**self.groups, "poller": [poller.info.backend_pid]}
        return self

    def cpu(self) -> dict:
        ours = {p for v in self.pids.values() for p in v}
        by_group = {k: {p: cpu_seconds(p) for p in v} for k, v in self.pids.items()}
        by_group["PostgreSQL, other"] = {p: cpu_seconds(p) for p in [self.postmaster, *children(self.postmaster)] if p not in ours}
        return by_group

    def __enter__(self):
        self.before, self.busy, self.t = self.cpu(), busy_seconds(), time.monotonic()
        return self

    def __exit__(self, *exc):
        self.wall, self.busy = time.monotonic() - self.t, busy_seconds() - self.busy
        after = self.cpu()
        self.spent = {k: sum(max(0.0, cpu - self.before[k].get(p, 0.0)) for p, cpu in after[k].items() if cpu) for k in after}
        return False


def drain(c: Cluster, server: NatsServer, run: int, sink: str | None, groups: dict) -> dict:
    """One timed drain (results.worker_drain): events/s, cores busy, and CPU µs per event of each
    process group."""
    meter = Meter(c, groups)
    rate = worker_drain(c, server, run, sink_url=sink, meter=meter)
    us = {k: v * 1e6 / BACKLOG for k, v in meter.spent.items()}
    us["rest of the machine"] = max(0.0, meter.busy * 1e6 / BACKLOG - sum(us.values()))
    return {"rate": rate, "cores": meter.busy / meter.wall, "us": us}


def main():
    server = NatsServer(RUN_DIR / "bounds-nats")
    server.start()
    c = Cluster(RUN_DIR / "bounds", free_port())
    c.start(f"feature_outbox.database = '{DB}'", "feature_outbox.relay_workers = 1", "feature_outbox.endpoint = ''",
            "feature_outbox.retention = 0", "shared_buffers = '512MB'", "max_wal_size = '4GB'", "synchronous_commit = off")
    nginx = None
    try:
        c.create_db(DB)
        load_counties(c)
        wait_for(lambda: memory(c) and len(memory(c)) == 1, 20, "the worker")
        nginx = Nginx()
        nats_pids = [server.proc.pid]
        nginx_pids = [nginx.proc.pid, *children(nginx.proc.pid)]
        # nats-server and nginx are counted in every drain: the stream a JetStream drain leaves is
        # deleted after it, and nats-server's work on that overlaps the next drain.
        groups = {"nats-server": nats_pids, "nginx": nginx_pids}
        drains = [("(e) in-worker floor, discard sink", "discard://floor", {}),
                  ("(a) JetStream", None, {}),
                  ("HTTP to nginx, http_concurrency 1", nginx.url, {"http_concurrency": 1, "http_batch": 1}),
                  ("HTTP to nginx, http_concurrency 8", nginx.url, {"http_concurrency": 8, "http_batch": 1})]
        results = {name: [] for name, *_ in drains}
        run = 0
        for _ in range(REPEATS):  # alternating, so that drift on a noisy machine touches every row alike
            for name, sink, settings in drains:
                if settings:
                    configure(c, **settings)
                run += 1
                results[name].append(drain(c, server, run, sink, groups))
        columns = ["relay worker", "PostgreSQL, other", "nats-server", "nginx", "poller", "rest of the machine"]
        print(f"{BACKLOG:,}-row backlog of county events, 1 relay worker, {CORES} cores; median of {REPEATS} drains "
              "(the run with the median rate). CPU in µs per event.")
        print()
        print("| drain | events/s | cores busy | " + " | ".join(columns) + " | total | ceiling (all cores) |")
        print("|---|---|---|" + "---|" * (len(columns) + 2))
        median = {}
        for name, runs in results.items():
            m = sorted(runs, key=lambda r: r["rate"])[len(runs) // 2]
            median[name] = m
            total = sum(m["us"].values())
            print(f"| {name} | {m['rate']:,.0f} | {m['cores']:.2f} of {CORES} | "
                  + " | ".join(f"{m['us'][k]:.1f}" if k in m["us"] else "" for k in columns)
                  + f" | {total:.1f} | {CORES * 1e6 / total:,.0f} |")
        e, a = median["(e) in-worker floor, discard sink"], median["(a) JetStream"]
        h1, h8 = median["HTTP to nginx, http_concurrency 1"], median["HTTP to nginx, http_concurrency 8"]
        ceiling = lambda m: CORES * 1e6 / sum(m["us"].values())  # noqa: E731
        print()
        print(f"JetStream: a/e = {a['rate'] / e['rate']:.2f}; 0.75 of e is {0.75 * e['rate']:,.0f} events/s, which needs at most "
              f"{CORES * 1e6 / (0.75 * e['rate']):.1f} µs of CPU per event on {CORES} cores; (a) spends {sum(a['us'].values()):.1f}, "
              f"nats-server alone {a['us']['nats-server']:.1f}: its ceiling is {ceiling(a) / e['rate']:.2f} of e.")
        print(f"HTTP: concurrency 8 / 1 = {h8['rate'] / h1['rate']:.2f}; concurrency 1 already keeps {h1['cores']:.2f} of {CORES} cores busy, "
              f"so concurrency 8's ceiling is {ceiling(h8) / h1['rate']:.2f}× concurrency 1 at its CPU per event.")
    finally:
        if nginx:
            nginx.close()
        c.stop()
        server.stop()


if __name__ == "__main__":
    main()
