"""make bench, section by section, side by side in one run; writes bench/RESULTS.md (issue 12).

Release build (with the test-only discard:// sink for the in-worker floor), its own cluster and
nats-server, the shared counties. Every figure is the median of REPEATS runs with its min-max.
  1. relay: a 100,000-row backlog of county events into JetStream, by 1 and 2 workers; the guide's
     algorithm as an external Python relay (asyncpg + nats-py, one acked publish per row); the
     database floor (the same claim and mark from Python, no publish); the in-worker floor (the
     worker's claim and mark, discard:// sink). Every run has fresh event ids and its own stream,
     and counts what arrived.
  2. HTTP: the same backlog to a loopback receiver that answers 200 at once (Python, 2 workers), and
     to Debian's nginx answering 204 (1 worker) with http_concurrency 1 and 8 and http_batch 100.
  3. commit-to-subscriber latency of county polygon edits at a steady 1,000/s for 30 s, 1 and 2
     workers, with wake_at_commit on (and off for 2), client side and database side.
  4. write path: edit_feature beside the guide's three-round-trip client recipe, from the same
     Python client; bench/edit_bench.py adds the pgbench figures.
  5. the claim and the backlog view with 0 and with 1,000,000 retained published rows.
  6. each worker's private memory after the relay runs.
"""

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import asyncpg
import h3
import nats
import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pg_test"))
from conftest import PG_BIN, PG_MAJOR, RUN_DIR, Cluster, county_data, free_port  # noqa: E402
from relay_harness import CLAIM_FROM, NatsServer, Receiver, wait_for  # noqa: E402
from drills import port_open  # noqa: E402

DB = "results"
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
BACKLOG = int(os.environ.get("BENCH_BACKLOG", "100000"))
LATENCY_S = int(os.environ.get("BENCH_LATENCY_SECONDS", "30"))
RATE = 1000
# PostgreSQL 15's figures are bench/RESULTS.md; another major's (make bench PG=N) RESULTS.pgN.md.
OUT = ROOT / "bench" / ("RESULTS.md" if PG_MAJOR == 15 else f"RESULTS.pg{PG_MAJOR}.md")
lines: list[str] = []


def say(text=""):
    print(text, flush=True)
    lines.append(text)


def spread(values, fmt="{:,.0f}"):
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))} – {fmt.format(max(values))})"


def configure(c, restart=False, **settings):
    with c.connect() as conn:
        for k, v in settings.items():
            conn.execute(f"ALTER SYSTEM SET feature_outbox.{k} = '{v}'")
        conn.execute("SELECT pg_reload_conf()")
    if restart:
        c.restart()


def paused(c):
    """No endpoint: the workers claim nothing (a closed port would still let them lock a batch for a
    moment, which an external relay's SKIP LOCKED would skip)."""
    configure(c, endpoint="")
    time.sleep(0.3)


def fill(c, n, db=DB):
    """n unpublished events of db's built-in features (the counties here), fresh event ids, in one INSERT."""
    with c.connect(db) as conn:
        conn.execute("UPDATE feature_outbox.outbox SET published_at = now() WHERE published_at IS NULL")
        conn.execute("""INSERT INTO feature_outbox.outbox (feature_id, feature_version, event_type, routing_key, layer)
                        SELECT s.feature_id, 1, 'moved', s.routing_key, 'features'
                          FROM generate_series(0, %s - 1) g
                          JOIN (SELECT feature_id, routing_key, row_number() OVER (ORDER BY feature_id) - 1 AS k,
                                       count(*) OVER () AS n FROM feature_outbox.feature_state) s ON s.k = g %% s.n""", (n,))
        conn.execute("VACUUM ANALYZE feature_outbox.outbox")


def load_counties(c):
    """The extension in DB and every county created through edit_feature; the (id, GeoJSON) pairs."""
    counties = [(int(r["id"]), json.dumps(r["geometry"])) for r in map(json.loads, county_data().read_text().splitlines())]
    with c.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        with conn.transaction(), conn.cursor() as cur:
            cur.executemany("SELECT feature_outbox.edit_feature(%s, %s, 'created')", counties)
    return counties


def wait_drained(conn):
    """Waits until the outbox of conn's database has no unpublished row, polling every 20 ms. Each
    look starts at the lowest unpublished id the last one found: published_at never goes back to
    NULL here, so nothing below it can be unpublished, and the look does not walk the dead index
    entries the drain leaves behind it. (A count(*) over a new connection each time cost about 20 µs
    of CPU per drained event, bench/bounds_bench.py's poller column, taken from the relay measured.)"""
    low = 0

    def drained():
        nonlocal low
        row = conn.execute("SELECT id FROM feature_outbox.outbox WHERE published_at IS NULL AND id >= %s "
                           "ORDER BY id LIMIT 1", (low,)).fetchone()
        low = row[0] if row else low
        return row is None
    wait_for(drained, 600, "the backlog to drain", interval=0.02)


def stream_count(server, stream):
    """Messages in `stream` (JetStream keeps one per Nats-Msg-Id), then deletes it to free the store."""
    async def count():
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            n = (await js.stream_info(stream)).state.messages
            await js.delete_stream(stream)
            return n
        finally:
            await nc.close()
    return asyncio.run(count())


def worker_drain(c, server, run, sink_url=None, meter=lambda poller: contextlib.nullcontext()):
    """Events/s of the in-database relay draining the backlog from the moment it is pointed at the
    sink; the stream (its own, per run) must then hold every event once. `meter(poller)`, a context
    manager, is entered just before the sink is set and left once the backlog is drained (poller:
    the connection that watches it)."""
    stream, prefix = f"R{run}", f"r{run}"
    configure(c, nats_stream=stream, nats_subject_prefix=prefix)
    fill(c, BACKLOG)
    with c.connect(DB) as conn, meter(conn):
        t = time.monotonic()
        configure(c, endpoint=sink_url or server.url)
        wait_drained(conn)
        rate = BACKLOG / (time.monotonic() - t)
    if sink_url is None:
        arrived = stream_count(server, stream)
        assert arrived == BACKLOG, f"{arrived} of {BACKLOG} events in stream {stream}"
    paused(c)
    return rate


async def guide_relay(dsn, url, stream, publish=True):
    """The guide's relay as written: claim 200 (joined to features, ST_AsGeoJSON), one acked
    publish per row with the event_id as Nats-Msg-Id, then UPDATE ... ANY, commit."""
    conn = await asyncpg.connect(dsn)
    nc = await nats.connect(url)
    js = nc.jetstream()
    if publish:
        await js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"])
    n = 0
    while True:
        async with conn.transaction():
            rows = await conn.fetch("""
                SELECT o.id, o.event_id::text AS event_id, o.feature_id, o.feature_version, o.event_type,
                       o.routing_key, o.previous_routing_key, ST_AsGeoJSON(f.geom) AS geometry
                  FROM feature_outbox.outbox o JOIN feature_outbox.features f ON f.id = o.feature_id
                 WHERE o.published_at IS NULL ORDER BY o.id LIMIT 200 FOR UPDATE OF o SKIP LOCKED""")
            if not rows:
                break
            if publish:
                for r in rows:
                    body = json.dumps({"event_id": r["event_id"], "action": r["event_type"],
                                       "feature_id": str(r["feature_id"]), "event_version": r["feature_version"],
                                       "routing_key": r["routing_key"], "previous_routing_key": r["previous_routing_key"],
                                       "geometry": json.loads(r["geometry"])}).encode()
                    await js.publish(f"{stream.lower()}.{r['event_type']}.{r['routing_key']}", body,
                                     headers={"Nats-Msg-Id": r["event_id"]})
            await conn.execute("UPDATE feature_outbox.outbox SET published_at = now() WHERE id = ANY($1::bigint[])",
                               [r["id"] for r in rows])
            n += len(rows)
    await nc.close()
    await conn.close()
    return n


def external_drain(c, server, run, publish):
    fill(c, BACKLOG)
    t = time.monotonic()
    n = asyncio.run(guide_relay(f"postgresql://postgres@127.0.0.1:{c.port}/{DB}", server.url, f"G{run}", publish))
    rate = n / (time.monotonic() - t)
    assert n == BACKLOG
    if publish:
        arrived = stream_count(server, f"G{run}")
        assert arrived == BACKLOG, f"{arrived} of {BACKLOG} events in the reference relay's stream"
    return rate


class Nginx:
    """Debian's nginx on a free loopback port, answering 204 to every request after reading its
    body: a webhook receiver that is not the bottleneck (one worker process, keep-alive)."""

    def __init__(self):
        self.dir = RUN_DIR / "results-nginx"
        subprocess.run(["rm", "-rf", str(self.dir)], check=True)
        (self.dir / "logs").mkdir(parents=True)
        self.port = free_port()
        (self.dir / "nginx.conf").write_text(f"""
            worker_processes 1;
            daemon off;
            pid {self.dir}/nginx.pid;
            error_log {self.dir}/logs/error.log;
            events {{ worker_connections 1024; }}
            http {{
                access_log off;
                client_max_body_size 0;
                client_body_buffer_size 16m;
                client_body_temp_path {self.dir}/body;
                keepalive_requests 1000000;
                server {{
                    listen 127.0.0.1:{self.port};
                    location / {{ return 204; }}
                }}
            }}""")
        self.proc = subprocess.Popen(["nginx", "-p", str(self.dir), "-c", str(self.dir / "nginx.conf"), "-e", str(self.dir / "logs" / "error.log")])
        wait_for(lambda: port_open(self.port), 10, "nginx to listen")

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}/hook"

    def close(self):
        self.proc.terminate()
        self.proc.wait(10)


class Subscriber:
    """Core NATS subscription on <prefix>.>: when each (feature, version) arrived."""

    def __init__(self, url, subject):
        self.arrived = {}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.start(url, subject), self.loop).result(10)

    async def start(self, url, subject):
        self.nc = await nats.connect(url)

        async def got(msg):
            h = msg.headers or {}
            self.arrived.setdefault((h.get("Feature-Id"), h.get("Feature-Version")), time.monotonic())

        await self.nc.subscribe(subject, cb=got)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.nc.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def latency(c, server, counties, wake):
    configure(c, endpoint=server.url, nats_stream="LAT" + ("ON" if wake else "OFF"),
              nats_subject_prefix="lat" + ("on" if wake else "off"), wake_at_commit="on" if wake else "off")
    time.sleep(0.5)
    sub = Subscriber(server.url, "lat" + ("on" if wake else "off") + ".>")
    committed = {}
    try:
        with c.connect(DB) as conn:
            since = conn.execute("SELECT max(id) FROM feature_outbox.outbox").fetchone()[0] or 0
            versions = dict(conn.execute("SELECT id, version FROM feature_outbox.features").fetchall())
            start = time.monotonic()
            for i in range(RATE * LATENCY_S):
                due = start + i / RATE
                # Sleep, never spin: a spinning client takes one of the 2 cores from the relay.
                time.sleep(max(0.0, due - time.monotonic()))
                fid, geometry = counties[i % len(counties)]
                v = conn.execute("SELECT feature_outbox.edit_feature(%s, %s, 'moved')", (fid, geometry)).fetchone()[0]
                committed[(str(fid), str(v))] = time.monotonic()
                versions[fid] = v
            achieved = len(committed) / (time.monotonic() - start)
        wait_for(lambda: all(k in sub.arrived for k in committed), 30, "every latency event")
    finally:
        sub.close()
    ms = sorted((sub.arrived[k] - t) * 1000 for k, t in committed.items())
    pick = lambda q: ms[min(len(ms) - 1, int(len(ms) * q))]
    # The database's own view of the same rows: from the edit's transaction start (created_at) to the
    # relay's mark (published_at), as a user would query it.
    with c.connect(DB) as conn:
        db = conn.execute("""SELECT percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY ms), max(ms)
                               FROM (SELECT extract(epoch FROM published_at - created_at) * 1000 AS ms
                                       FROM feature_outbox.outbox WHERE id > %s) d""", (since,)).fetchone()
    paused(c)
    return achieved, pick(0.5), pick(0.95), pick(0.99), ms[-1], (*db[0], db[1])


def recipe_vs_edit(c, seconds=5):
    """edit_feature against the guide's client recipe (UPDATE ... RETURNING, a centroid SELECT, the
    H3 cell in the client, INSERT), 2 client threads each, the same moves."""
    with c.connect(DB) as conn:
        conn.execute("DROP SCHEMA IF EXISTS recipe CASCADE")
        conn.execute("CREATE SCHEMA recipe")
        conn.execute("CREATE TABLE recipe.features AS SELECT id, geom, version FROM feature_outbox.features")
        conn.execute("ALTER TABLE recipe.features ADD PRIMARY KEY (id)")
        conn.execute("CREATE TABLE recipe.outbox (LIKE feature_outbox.outbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES)")
        ids = [r[0] for r in conn.execute("SELECT id FROM feature_outbox.features ORDER BY id")]

    def recipe(conn, fid, k):
        with conn.transaction():
            (version,) = conn.execute("UPDATE recipe.features f SET geom = ST_Translate(f.geom, %s, 0), version = f.version + 1"
                                      " WHERE f.id = %s RETURNING f.version", (k, fid)).fetchone()
            lon, lat = conn.execute("SELECT ST_X(c), ST_Y(c) FROM (SELECT ST_Centroid(geom) c FROM recipe.features WHERE id = %s) x",
                                    (fid,)).fetchone()
            cell = h3.latlng_to_cell(lat, lon, 8)
            conn.execute("INSERT INTO recipe.outbox (feature_id, feature_version, event_type, routing_key, layer)"
                         " VALUES (%s, %s, 'moved', %s, 'features')", (fid, version, cell))

    def edit(conn, fid, k):
        with conn.transaction():
            conn.execute("SELECT feature_outbox.edit_feature(f.id, ST_Translate(f.geom, %s, 0), 'moved')"
                         " FROM feature_outbox.features f WHERE f.id = %s", (k, fid))

    def run(step):
        counts = [0, 0]

        def client(j):
            with psycopg.connect(c.dsn(DB)) as conn:
                conn.autocommit = True
                deadline, i = time.monotonic() + seconds, j
                while time.monotonic() < deadline:
                    step(conn, ids[i % len(ids)], 0.001 if (i // len(ids)) % 2 == 0 else -0.001)
                    i += 2
                    counts[j] += 1
        threads = [threading.Thread(target=client, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) / seconds

    out = {"recipe": [], "edit": []}
    for _ in range(REPEATS):
        out["recipe"].append(run(recipe))
        out["edit"].append(run(edit))
    return out


def claim_times(c):
    claim = CLAIM_FROM.format(low="feature_outbox._relay_low_water()")
    with c.connect(DB) as conn:
        conn.execute("SET enable_seqscan = off")
        conn.execute("SET enable_bitmapscan = off")
        conn.execute("SET jit = off")  # as the relay's claim (src/relay/claim.rs): JIT compiled it for ~100 ms

        def timed(sql):
            ts = []
            for _ in range(7):
                t = time.perf_counter()
                conn.execute(sql).fetchall()
                ts.append((time.perf_counter() - t) * 1000)
            return statistics.median(ts)
        return timed(claim), timed("SELECT * FROM feature_outbox.backlog")


def cpu_profile(c, server, run):
    """perf's view of one more 2-worker drain: CPU share by process, and by library inside the
    workers. None when perf is missing or not allowed."""
    if subprocess.run(["sh", "-c", "command -v perf"], capture_output=True).returncode != 0:
        return None
    data = RUN_DIR / "results-perf.data"
    stream, prefix = f"R{run}", f"r{run}"
    configure(c, nats_stream=stream, nats_subject_prefix=prefix)
    fill(c, BACKLOG)
    perf = subprocess.Popen(["perf", "record", "-a", "-F", "499", "-o", str(data), "--", "sleep", "600"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    with c.connect(DB) as conn:
        configure(c, endpoint=server.url)
        wait_drained(conn)
    perf.send_signal(2)
    perf.wait(30)
    stream_count(server, stream)
    paused(c)

    def report(*args):
        out = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", *args],
                             capture_output=True, text=True).stdout
        rows = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith("%") and not line.startswith("#"):
                rows.append((" ".join(parts[1:]), float(parts[0].rstrip("%"))))
        return rows
    workers = [str(pid) for pid, *_ in memory(c)]
    by_pid = report("--sort", "pid")
    if not by_pid:
        return None
    shares: dict = {}
    for name, share in by_pid:  # "12345:postgres"
        pid, _, comm = name.partition(":")
        label = f"relay worker (pid {pid})" if pid in workers else comm
        shares[label] = shares.get(label, 0.0) + share
    by_process = sorted(shares.items(), key=lambda kv: -kv[1])[:8]
    in_workers = report("--sort", "dso", "--pid", ",".join(workers))[:8]
    return by_process, in_workers


def memory(c):
    with c.connect(DB) as conn:
        pids = [r[0] for r in conn.execute("SELECT pid FROM feature_outbox.workers WHERE pid IS NOT NULL ORDER BY worker")]
    out = []
    for pid in pids:
        fields = {}
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            k, v = line.split(":", 1)
            fields[k] = int(v.split()[0]) / 1024
        out.append((pid, fields.get("Rss", 0), fields.get("Pss", 0), fields.get("Anonymous", 0)))
    return out


def main():
    t0 = time.monotonic()
    server = NatsServer(RUN_DIR / "results-nats")
    server.start()
    receiver = Receiver()
    c = Cluster(RUN_DIR / "results", free_port())
    c.start(f"feature_outbox.database = '{DB}'", "feature_outbox.relay_workers = 1",
            "feature_outbox.endpoint = ''", "feature_outbox.retention = 0",
            "feature_outbox.retry_backoff_max = '200ms'", "shared_buffers = '512MB'", "max_wal_size = '4GB'",
            "synchronous_commit = off", *([f"feature_outbox.batch_size = {os.environ['BENCH_BATCH']}"] if os.environ.get("BENCH_BATCH") else []))
    try:
        c.create_db(DB)
        c.restart()
        counties = load_counties(c)
        say(f"# feature_outbox benchmark results")
        say()
        say(f"`make bench` ({os.cpu_count()} cores, release build, "
            f"PostgreSQL {subprocess.run([PG_BIN / 'postgres', '--version'], capture_output=True, text=True).stdout.split()[2]}"
            f", nats-server on loopback, "
            f"{len(counties):,} county polygons). Median of {REPEATS} runs, min – max in brackets.")
        say()

        # 1. relay ------------------------------------------------------------------------------
        rates = {k: [] for k in ("a", "b", "c", "d", "e")}
        run = 0
        for workers in (1, 2):
            configure(c, restart=True, relay_workers=workers)
            wait_for(lambda: memory(c) and len(memory(c)) == workers, 20, "the workers")
            for _ in range(REPEATS):
                run += 1
                rates["a" if workers == 1 else "b"].append(worker_drain(c, server, run))
            if workers == 1:
                for _ in range(REPEATS):
                    run += 1
                    rates["e"].append(worker_drain(c, server, run, sink_url="discard://floor"))
                mem = memory(c)
        for _ in range(REPEATS):
            run += 1
            rates["c"].append(external_drain(c, server, run, publish=True))
            run += 1
            rates["d"].append(external_drain(c, server, run, publish=False))
        med = {k: statistics.median(v) for k, v in rates.items()}
        say(f"## 1. Relay: a {BACKLOG:,}-row backlog into JetStream (events/s)")
        say()
        say("| relay | events/s |")
        say("|---|---|")
        say(f"| (a) feature_outbox, 1 worker | {spread(rates['a'])} |")
        say(f"| (b) feature_outbox, 2 workers | {spread(rates['b'])} |")
        say(f"| (c) the guide's relay, external (Python, one acked publish per row) | {spread(rates['c'])} |")
        say(f"| (d) database floor: the guide's claim and mark from Python, no publish | {spread(rates['d'])} |")
        say(f"| (e) in-worker floor: the worker's claim and mark, discard sink | {spread(rates['e'])} |")
        say()
        say(f"batch_size {os.environ.get('BENCH_BATCH', '1000 (the default)')}; the guide's relay and floor claim 200 rows, as the guide does.")
        say(f"a/c = {med['a'] / med['c']:.1f}×, a/d = {med['a'] / med['d']:.2f} (target ≥ 0.60), "
            f"b/a = {med['b'] / med['a']:.2f}, b/c = {med['b'] / med['c']:.1f}× (target ≥ 10×), a/e = {med['a'] / med['e']:.2f}.")
        say(f"Every run counted {BACKLOG:,} events in its own stream (fresh event ids, so no duplicate-window short-cut).")
        say()
        profile = cpu_profile(c, server, run + 1)
        if profile:
            say("Where the CPU goes during a 2-worker drain (`perf record -a`, share of all samples on both cores):")
            say()
            say("| process | share | | library, within the relay workers | share |")
            say("|---|---|---|---|---|")
            for (comm, share), (dso, dshare) in zip(profile[0] + [("", 0.0)] * 8, profile[1] + [("", 0.0)] * 8):
                if comm or dso:
                    say(f"| {comm} | {share:.1f} % | | {dso} | {dshare:.1f} % |")
            say()

        # 2. HTTP -------------------------------------------------------------------------------
        http = [worker_drain(c, server, 1000 + i, sink_url=receiver.url) for i in range(REPEATS)]
        say("## 2. HTTP: the same backlog to a loopback receiver")
        say()
        say(f"Python's ThreadingHTTPServer answering 200, 2 workers: {spread(http)} events/s (it answered "
            f"{len(receiver.requests):,} requests in {REPEATS} runs).")
        say()
        nginx = Nginx()
        try:
            configure(c, restart=True, relay_workers=1)
            wait_for(lambda: memory(c) and len(memory(c)) == 1, 20, "the worker")
            rows = []
            for concurrency, batch in ((1, 1), (8, 1), (8, 100)):
                configure(c, http_concurrency=concurrency, http_batch=batch)
                rates_http = [worker_drain(c, server, 1100 + 10 * concurrency + batch + i, sink_url=nginx.url) for i in range(REPEATS)]
                rows.append((concurrency, batch, rates_http))
            configure(c, http_concurrency=8, http_batch=1)
        finally:
            nginx.close()
        say("Debian's nginx answering 204 (one worker process, not the bottleneck), 1 relay worker:")
        say()
        say("| http_concurrency | http_batch | events/s | / http_concurrency 1 | / JetStream, 1 worker (a) |")
        say("|---|---|---|---|---|")
        base = statistics.median(rows[0][2])
        for concurrency, batch, r in rows:
            m = statistics.median(r)
            say(f"| {concurrency} | {batch} | {spread(r)} | {m / base:.2f} | {m / med['a']:.2f} |")
        say()
        say("Targets: http_concurrency 8 ≥ 3× http_concurrency 1; http_batch 100 ≥ 0.8 of (a).")
        say()

        # 3. latency ------------------------------------------------------------------------------
        say(f"## 3. Commit-to-subscriber latency: county polygons at {RATE:,} edits/s for {LATENCY_S} s")
        say()
        say("Client side: from edit_feature's return in the editing client to the subscriber's receipt. "
            "Database side: `published_at - created_at` of the same outbox rows.")
        say()
        say("| workers | wake_at_commit | edits/s achieved | p50 ms | p95 ms | p99 ms | max ms | database p50 ms | p95 ms | p99 ms | max ms |")
        say("|---|---|---|---|---|---|---|---|---|---|---|")
        for workers, wake in ((1, True), (2, True), (2, False)):
            configure(c, restart=True, relay_workers=workers)
            wait_for(lambda: memory(c) and len(memory(c)) == workers, 20, "the workers")
            achieved, p50, p95, p99, top, db = latency(c, server, counties, wake)
            say(f"| {workers} | {'on' if wake else 'off'} | {achieved:,.0f} | {p50:.2f} | {p95:.2f} | {p99:.2f} | {top:.1f} | "
                + " | ".join(f"{v:.2f}" for v in db[:3]) + f" | {db[3]:.1f} |")
        configure(c, wake_at_commit="on")
        say()
        say("Target: p99 ≤ 10 ms with wake_at_commit on, 1 and 2 workers, on both sides. Off, rows wait for the worker's 1 s poll.")
        say()

        # 4. write path ---------------------------------------------------------------------------
        w = recipe_vs_edit(c)
        say("## 4. Write path: edit_feature beside the guide's three-round-trip client recipe")
        say()
        say("2 Python clients (psycopg), one county `moved` per transaction, 5 s per run:")
        say()
        say("| path | edits/s |")
        say("|---|---|")
        say(f"| guide recipe: UPDATE ... RETURNING, centroid SELECT, H3 in the client, INSERT | {spread(w['recipe'])} |")
        say(f"| `edit_feature(id, geometry, 'moved')`, one round trip | {spread(w['edit'])} |")
        say()
        say(f"edit_feature / recipe = {statistics.median(w['edit']) / statistics.median(w['recipe']):.2f}. "
            "edit_feature also validates, routes on ST_PointOnSurface (inside the feature) and keeps the per-feature state.")
        say()
        say("pgbench against the floor (bench/edit_bench.py):")
        say()
        say("```")
        edit = subprocess.run([sys.executable, str(ROOT / "bench" / "edit_bench.py")], capture_output=True, text=True,
                              env={**os.environ, "BENCH_SECONDS": os.environ.get("BENCH_SECONDS", "5")})
        for line in (edit.stdout + edit.stderr).strip().splitlines():
            say(line)
        say("```")
        say()

        # 5. claim vs history ------------------------------------------------------------------------
        configure(c, endpoint="discard://idle")  # an idle worker that keeps the low-water mark
        with c.connect(DB) as conn:
            conn.execute("DELETE FROM feature_outbox.outbox")
            conn.execute("VACUUM ANALYZE feature_outbox.outbox")
        empty = claim_times(c)
        with c.connect(DB) as conn:
            conn.execute("""INSERT INTO feature_outbox.outbox (feature_id, feature_version, event_type, routing_key, layer, published_at)
                            SELECT g % 3231, 1, 'moved', '8800000000fffff', 'features', now() FROM generate_series(1, 1000000) g""")
            conn.execute("VACUUM ANALYZE feature_outbox.outbox")
        time.sleep(1.5)  # the low-water mark passes the published history
        full = claim_times(c)
        say("## 5. The claim and the backlog view against retained history (ms, median of 7)")
        say()
        say("| | 0 published rows | 1,000,000 published rows |")
        say("|---|---|---|")
        say(f"| claim of 200, empty backlog | {empty[0]:.2f} | {full[0]:.2f} |")
        say(f"| `SELECT * FROM backlog` | {empty[1]:.2f} | {full[1]:.2f} |")
        say()

        # 6. memory ---------------------------------------------------------------------------------
        say("## 6. Worker memory after the relay runs (1 worker, MB)")
        say()
        say("| pid | RSS | Pss | anonymous (its own heap) |")
        say("|---|---|---|---|")
        for pid, rss, pss, private in mem:
            say(f"| {pid} | {rss:.1f} | {pss:.1f} | {private:.1f} |")
        say()
        say("RSS and Pss count the shared buffers the worker touched (shared memory: `Private` in smaps would")
        say("count buffers only this worker mapped); anonymous memory is the worker's own heap, its tokio runtime,")
        say("TLS roots and client buffers (target ≤ 32 MB).")
        say()
        say(f"Run time: {(time.monotonic() - t0) / 60:.1f} min.")
    finally:
        c.stop()
        server.stop()
        receiver.close()
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
