"""Tile caches: how soon after its commit an edit's tiles are purged (make bench, section 12). Prints
figures only; asserts nothing about speed.

pg_test/tile_cache_run.py's stack (Colorado's counties in layer cache_counties, Martin behind Varnish
with the documented VCL and xkey, a nats-server for the events), its expire output `cache` redefined
for zooms 5-14 with only the cache as destination (no expire table: its upsert would dominate), and
a second layer of points, cache_points, attached to the same output (Martin serves the counties
only: point moves purge their tiles' keys, counted here, but their tiles are not polled). For
BENCH_TILE_CACHE_SECONDS (30) one client makes 200 edits/s, each in its own transaction (autocommit),
sleeping between them: a one-vertex move of a county, then a move of a point, in turn.
  1. On the database's clock (track_commit_timestamp): from the commit of the edit's transaction
     (its xid, txid_current() in the edit's statement) to the commit of the relay transaction that
     deleted the edit's tile_queue row (a bench-only AFTER DELETE trigger logs its xid). That
     transaction purged the cache before it committed, so its commit time is an upper bound on
     when the purge was acknowledged. (The outbox row's xmin would not do: the relay's mark
     rewrites the row, and the new version's xmin is the relay's.)
  2. By a client: for every 4th county move, a thread fetches through Varnish, about 50 ms ahead of
     the edit, the zoom-14 tile holding the moved vertex's new position (which warms it), then polls
     it every 5 ms from the edit's commit until the decoded tile differs from that fetch (5 s at
     most). Four threads at most, shared by the fetches ahead and the polls. Each tile is polled
     once a run, and never for a county invalid before or after its move (six of Colorado's have
     a degenerate ring: a move of its vertex renders no change, and the poll would time out or
     see a later edit).
"""

import gzip
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pg_test"))
import tile_cache_run as tcr  # noqa: E402
from conftest import RUN_DIR  # noqa: E402
from relay_harness import NatsServer, wait_for  # noqa: E402
from tile_cache_harness import decoded, fetch  # noqa: E402

SECONDS = float(os.environ.get("BENCH_TILE_CACHE_SECONDS", "30"))
RATE = 200               # edits/s, half county one-vertex moves, half point moves
MINZOOM, MAXZOOM = 5, 14
POINTS = 1000
POINTS_LAYER = "cache_points"
SAMPLE_EVERY = 4         # of the county moves, every 4th is polled
LEAD = 10                # edits ahead (50 ms at 200/s) the polled tile is fetched before its edit
POLL_S, POLL_MAX_S = 0.005, 5.0
POLLERS = 4              # threads for the fetches ahead and the polls: 2 cores are shared by everything
TARGET_MS = 50

LOG = """
CREATE TABLE public.bench_purged (outbox_id bigint NOT NULL, xid bigint NOT NULL,
                                  at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION public.bench_log_purged() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog AS $$
BEGIN
    INSERT INTO public.bench_purged (outbox_id, xid) VALUES (OLD.outbox_id, txid_current());
    RETURN NULL;
END
$$;
CREATE TRIGGER bench_log_purged AFTER DELETE ON feature_outbox.tile_queue
    FOR EACH ROW EXECUTE FUNCTION public.bench_log_purged();
"""


def say(text=""):
    print(text, flush=True)


def pick(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


def dist(values, fmt="{:.1f}"):
    """p50 | p95 | p99 | max (nearest rank), as table cells."""
    if not values:
        return "– | – | – | –"
    return " | ".join(fmt.format(pick(values, q)) for q in (0.5, 0.95, 0.99)) + " | " + fmt.format(max(values))


def xid(col: str) -> str:
    """A txid_current() value as the xid pg_xact_commit_timestamp takes (its low 32 bits)."""
    return f"(({col}) % 4294967296)::text::xid"


def backlog(conn):
    return conn.execute(f"SELECT purge_requests, tiles_by_zoom, edits, parked_edits, last_error FROM feature_outbox.expire_backlog "
                        f"WHERE output = '{tcr.OUTPUT}'").fetchone()


def setup(stack, rng: random.Random) -> dict:
    """The output at zooms 5-14, the cache only; the points layer attached and its points created
    (and their tiles purged) before the run; the purge log. Returns the points, id -> (lon, lat)."""
    with stack.c.connect(tcr.DB) as conn:
        conn.execute(f"SELECT feature_outbox.define_expire_output('{tcr.OUTPUT}', {MAXZOOM}, minzoom => {MINZOOM}, "
                     "cache_url => %s, cache_method => 'xkey')", (stack.varnish.url(tcr.SOURCE),))
        conn.execute(f"""CREATE TABLE public.{POINTS_LAYER} (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL,
                                                             version integer NOT NULL DEFAULT 0, name text)""")
        conn.execute(f"SELECT feature_outbox.register_layer('{POINTS_LAYER}', 'public.{POINTS_LAYER}', properties => '{{name}}')")
        conn.execute(f"SELECT feature_outbox.expire_layer('{POINTS_LAYER}', '{tcr.OUTPUT}')")
        x0, y0, x1, y1 = stack.bbox
        points = {i: (rng.uniform(x0, x1), rng.uniform(y0, y1)) for i in range(1, POINTS + 1)}
        with conn.transaction():
            with conn.cursor() as cur:
                cur.executemany(f"SELECT feature_outbox.edit_feature('{POINTS_LAYER}', %s::bigint, ST_SetSRID(ST_MakePoint(%s, %s), 4326), "
                                "'created', jsonb_build_object('name', %s::text))",
                                [(i, lon, lat, f"point {i}") for i, (lon, lat) in points.items()])
        wait_for(lambda: tcr.drained(conn), 120, "the points' creates and their purges")
        conn.execute(LOG)
        conn.execute("ANALYZE")
    return points


def plan(stack, points: dict, n: int, rng: random.Random) -> tuple[list[tuple], dict]:
    """n edits: (layer, id, GeoJSON, polled zoom-14 tile or None), county one-vertex moves and point
    moves in turn. Every SAMPLE_EVERY-th county move is polled, at the tile of its vertex's new
    position, unless that tile is polled already (each tile once a run), or the county is invalid
    before or after the move: six of Colorado's counties have a degenerate ring (fewer than 4
    points), and a move of its vertex changes no rendered tile. Returns the edits and the samples
    dropped, by reason."""
    shapes, out, polled, vertex_moves, candidates, again = stack.counties, [], set(), 0, [], 0
    for i in range(n):
        if i % 2 == 0:
            fid = rng.choice(sorted(shapes))
            while True:  # a move a tile can show: at least 0.0005 degrees (about 90 px at zoom 14)
                g, before, after = tcr.one_vertex_moved(shapes[fid], rng)
                if abs(after[0] - before[0]) + abs(after[1] - before[1]) >= 0.0005:
                    break
            tile = None
            if vertex_moves % SAMPLE_EVERY == 0:
                tile = (MAXZOOM, *tcr.lon_lat_to_tile(*after, MAXZOOM))
                if tile in polled:
                    tile, again = None, again + 1
                else:
                    polled.add(tile)
                    candidates.append((i, json.dumps(shapes[fid]), json.dumps(g)))
            shapes[fid] = g
            vertex_moves += 1
            out.append((tcr.SOURCE, fid, g, tile))
        else:
            pid = rng.randrange(1, POINTS + 1)
            x0, y0, x1, y1 = stack.bbox
            lon, lat = points[pid]
            points[pid] = (min(max(lon + rng.uniform(-0.01, 0.01), x0), x1), min(max(lat + rng.uniform(-0.01, 0.01), y0), y1))
            out.append((POINTS_LAYER, pid, {"type": "Point", "coordinates": list(points[pid])}, None))
    with stack.c.connect(tcr.DB) as conn:
        invalid = conn.execute("""SELECT array_agg(i) FROM unnest(%s::int[], %s::text[], %s::text[]) c(i, a, b)
                                   WHERE NOT (ST_IsValid(ST_GeomFromGeoJSON(a)) AND ST_IsValid(ST_GeomFromGeoJSON(b)))""",
                               [list(c) for c in zip(*candidates)] if candidates else ([], [], [])).fetchone()[0] or []
    for i in invalid:
        out[i] = (*out[i][:3], None)
    return out, {"its tile polled already": again, "the county invalid before or after the move": len(invalid)}


class Poller:
    """Threads that fetch a tile ahead of its edit and poll it after, each over its own keep-alive
    connection to Varnish."""

    def __init__(self, port: int):
        self.port = port
        self.local = threading.local()
        self.pool = ThreadPoolExecutor(POLLERS, thread_name_prefix="poll")

    def get(self, tile) -> tuple[bytes, str]:
        z, x, y = tile
        for attempt in (0, 1):
            conn = getattr(self.local, "conn", None)
            if conn is None:
                conn = self.local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            try:
                conn.request("GET", f"/{tcr.SOURCE}/{z}/{x}/{y}", headers={"Accept-Encoding": "gzip"})
                r = conn.getresponse()
                body = r.read()
                if r.getheader("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                return body, r.getheader("X-Cache", "")
            except (http.client.HTTPException, OSError):
                conn.close()
                self.local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def ahead(self, tile):
        """Fetches the tile as it is before its edit; the future's result is (body, decoded)."""
        def run():
            body, _ = self.get(tile)
            return body, decoded(body)
        return self.pool.submit(run)

    def poll(self, tile, before, committed: float):
        """Polls from `committed` (monotonic) until the tile differs from `before`: (ms after the
        commit the new tile arrived, or None after POLL_MAX_S; ms from the commit to the first
        poll; polls; the changed response's X-Cache)."""
        body0, dec0 = before

        def run():
            first, polls = None, 0
            while True:
                t = time.monotonic()
                if t - committed > POLL_MAX_S:
                    return None, first, polls, ""
                first = first if first is not None else (t - committed) * 1000
                body, cache = self.get(tile)
                polls += 1
                if body != body0 and decoded(body) != dec0:
                    return (time.monotonic() - committed) * 1000, first, polls, cache
                time.sleep(max(0.0, t + POLL_S - time.monotonic()))
        return self.pool.submit(run)


def edit(stack, planned: list[tuple], poller: Poller) -> tuple[list, list, float, dict]:
    """Makes the planned edits at RATE, sleeping between them. Returns each edit's (layer, id,
    version, xid), the polls' futures, the achieved rate, and the samples skipped."""
    done, polls, skipped = [], [], {"the fetch ahead not back by the edit": 0}
    with stack.c.connect(tcr.DB) as conn:
        conn.autocommit = True
        start = time.monotonic()
        aheads = {j: poller.ahead(planned[j][3]) for j in range(min(LEAD, len(planned))) if planned[j][3]}
        for i, (layer, fid, g, tile) in enumerate(planned):
            if i + LEAD < len(planned) and planned[i + LEAD][3]:
                aheads[i + LEAD] = poller.ahead(planned[i + LEAD][3])
            # Sleep, never spin: the client shares 2 cores with everything it measures.
            time.sleep(max(0.0, start + i / RATE - time.monotonic()))
            before = aheads.pop(i, None)
            if before is not None and not before.done():
                skipped["the fetch ahead not back by the edit"] += 1
                before = None
            v, x = conn.execute(f"SELECT v, txid_current() FROM feature_outbox.edit_feature('{layer}', %s::bigint, "
                                "ST_GeomFromGeoJSON(%s), 'moved') v", (fid, json.dumps(g))).fetchone()
            committed = time.monotonic()
            if before is not None:
                polls.append(poller.poll(tile, before.result(), committed))
            done.append((layer, fid, v, x))
        achieved = len(planned) / (time.monotonic() - start)
    return done, polls, achieved, skipped


def database_side(conn, done: list) -> dict:
    """Per kind, ms from the edit's commit to the commit of the relay transaction that deleted its
    queue row (the purge acknowledged before it), and the split at the delete (the trigger's clock)."""
    conn.execute("CREATE TEMP TABLE bench_edits (layer text, fid bigint, version int, x bigint)")
    with conn.cursor().copy("COPY bench_edits FROM STDIN") as copy:
        for row in done:
            copy.write_row(row)
    rows = conn.execute(f"""
        SELECT e.layer, o.id IS NOT NULL, l.xid IS NOT NULL,
               extract(epoch FROM pg_xact_commit_timestamp({xid('l.xid')}) - pg_xact_commit_timestamp({xid('e.x')})) * 1000,
               extract(epoch FROM l.at - pg_xact_commit_timestamp({xid('e.x')})) * 1000,
               extract(epoch FROM pg_xact_commit_timestamp({xid('l.xid')}) - l.at) * 1000,
               extract(epoch FROM o.published_at - pg_xact_commit_timestamp({xid('e.x')})) * 1000
          FROM bench_edits e
          LEFT JOIN feature_outbox.outbox o ON o.layer = e.layer AND o.feature_id = e.fid AND o.feature_version = e.version
          LEFT JOIN public.bench_purged l ON l.outbox_id = o.id""").fetchall()
    out = {"total": {}, "deleted": [], "purged": [], "published": [], "missing": 0}
    for layer, found, logged, total, deleted, purged, published in rows:
        if not (found and logged):
            out["missing"] += 1
            continue
        out["total"].setdefault(layer, []).append(float(total))
        out["deleted"].append(float(deleted))
        out["purged"].append(float(purged))
        out["published"].append(float(published))
    return out


def render_times(stack, tiles, n=40) -> list[float]:
    """ms Martin takes to render zoom-14 tiles of the run, fetched directly (no cache), one by one."""
    out = []
    for t in tiles[:n]:
        t0 = time.monotonic()
        fetch(stack.direct, tcr.SOURCE, *t)
        out.append((time.monotonic() - t0) * 1000)
    return out


def main() -> None:
    rng = random.Random(12)
    server = NatsServer(RUN_DIR / "tile-cache-bench-nats")
    server.start()
    stack = tcr.start("tile_cache_bench", server.url, "track_commit_timestamp = on")
    try:
        points = setup(stack, rng)
        n = int(RATE * SECONDS)
        planned, dropped = plan(stack, points, n, rng)
        sampled = [p[3] for p in planned if p[3]]
        with stack.c.connect(tcr.DB) as conn:
            settings = dict(conn.execute("""SELECT name, setting || coalesce(unit, '') FROM pg_settings WHERE name IN
                ('feature_outbox.poll_interval', 'feature_outbox.wake_at_commit', 'feature_outbox.relay_workers')""").fetchall())
            since = conn.execute("SELECT coalesce(max(id), 0) FROM feature_outbox.outbox").fetchone()[0]
            purges0, by_zoom0, edits0, _, _ = backlog(conn)
        render = render_times(stack, sampled) or [float("nan")]
        poller = Poller(stack.varnish.port)
        done, polls, achieved, skipped = edit(stack, planned, poller)
        with stack.c.connect(tcr.DB) as conn:
            wait_for(lambda: tcr.drained(conn), 300, "the outbox and the tile queue to drain")
            purges1, by_zoom1, edits1, parked, error = backlog(conn)
            db = database_side(conn, done)
            per_chunk = conn.execute("SELECT count(*)::float8 / greatest(count(DISTINCT xid), 1) FROM public.bench_purged l "
                                     "WHERE l.outbox_id > %s", (since,)).fetchone()[0]
        results = [f.result() for f in polls]
        poller.pool.shutdown()
    finally:
        stack.stop()
        server.stop()

    tiles = sum(by_zoom1) - sum(by_zoom0)
    purges = purges1 - purges0
    seen = [r[0] for r in results if r[0] is not None]
    timeouts = sum(1 for r in results if r[0] is None)
    first = [r[1] for r in results if r[1] is not None]
    polls_each = [r[2] for r in results]
    misses = sum(1 for r in results if r[0] is not None and r[3] == "MISS")
    every = [v for vs in db["total"].values() for v in vs]
    say(f"One client at {RATE} edits/s for {SECONDS:g} s, each edit its own transaction, a one-vertex move of a Colorado county "
        f"(layer {tcr.SOURCE}, served by Martin behind Varnish) and a move of a point (layer {POINTS_LAYER}, {POINTS:,} points; "
        f"its tiles' keys are purged, not polled) in turn; expire output `{tcr.OUTPUT}` at zooms {MINZOOM}-{MAXZOOM}, its only "
        f"destination the cache (cache_method xkey). Relay workers: {settings.get('feature_outbox.relay_workers')}; poll_interval {settings.get('feature_outbox.poll_interval')}, "
        f"wake_at_commit {settings.get('feature_outbox.wake_at_commit')}; 2 cores for PostgreSQL, the relay, nats-server, Varnish, "
        f"Martin and the client.\n")
    say(f"- edits: {len(done):,} at {achieved:,.1f} edits/s achieved ({edits1 - edits0:,} edits delivered by the output, {parked} parked"
        f"{', last error: ' + error if error else ''})")
    say(f"- purge requests: {purges:,} ({len(done) / max(purges, 1):.1f} edits per request; {per_chunk:.1f} edits per relay transaction)")
    say(f"- tiles purged: {tiles:,} ({tiles / max(len(done), 1):,.0f} per edit; by zoom {MINZOOM}-{MAXZOOM}: "
        f"{', '.join(f'{b - a:,}' for a, b in zip(by_zoom0[MINZOOM:MAXZOOM + 1], by_zoom1[MINZOOM:MAXZOOM + 1]))})")
    say(f"- Martin rendering a zoom-14 tile of the run, directly, one at a time: {statistics.median(render):.1f} ms median, "
        f"{max(render):.1f} ms max ({len(render)} tiles)\n")
    say("| ms after the edit's commit | edits | p50 | p95 | p99 | max |")
    say("|---|---|---|---|---|---|")
    say(f"| purge acknowledged, database clock (upper bound: the purging transaction's commit), all edits | {len(every):,} | {dist(every)} |")
    for layer, label in ((tcr.SOURCE, "county one-vertex moves"), (POINTS_LAYER, "point moves")):
        say(f"| ... {label} | {len(db['total'].get(layer, [])):,} | {dist(db['total'].get(layer, []))} |")
    say(f"| ... of which: until the relay deleted the queue row (wake, event, chunk read, tile math) | {len(db['deleted']):,} | {dist(db['deleted'])} |")
    say(f"| ... of which: from that delete to its commit (the next chunk's read, the purge request, counters, commit) | {len(db['purged']):,} | {dist(db['purged'])} |")
    say(f"| event marked published (outbox.published_at: the mark's clock, after the PubAck) | {len(db['published']):,} | {dist(db['published'])} |")
    say(f"| fresh tile seen by a client polling zoom 14 through Varnish every {POLL_S * 1000:g} ms | {len(seen):,} | {dist(seen)} |")
    say(f"| ... its first poll | {len(first):,} | {dist(first)} |")
    say()
    why = "; ".join(f"{v} {k}" for k, v in {**dropped, **skipped}.items())
    say(f"Polled: {len(results):,} of the {len(sampled) + sum(dropped.values()):,} county moves sampled (every {SAMPLE_EVERY}th; "
        f"not polled: {why}), {timeouts} timed out "
        f"after {POLL_MAX_S:g} s, {misses} of the fresh tiles a cache MISS (rendered after the purge), "
        f"{statistics.mean(polls_each) if polls_each else 0:.1f} polls each on average. Edits whose purge was not logged: {db['missing']}.\n")
    db99 = pick(every, 0.99) if every else float("nan")
    cl99 = pick(seen, 0.99) if seen else float("nan")
    verdict = lambda v: "met" if v <= TARGET_MS else "missed"
    say(f"Target: commit → purge acknowledged p99 ≤ {TARGET_MS} ms. Database clock: p99 {db99:.1f} ms ({verdict(db99)}); "
        f"polling client: p99 {cl99:.1f} ms ({verdict(cl99)}{f', {timeouts} timed out' if timeouts else ''}).")


if __name__ == "__main__":
    main()
