"""The cache destination end to end (issue 40), shared by pg_test/test_tile_cache.py (100 edits in
`make test`) and the fault drills (1,000 edits in `make faults`): county polygons of one state served
by Martin behind Varnish (the documented VCL), tiles warmed, then edits of every kind through
edit_feature; once the outbox and the output's queue are empty, every warmed tile fetched through
Varnish must equal the same tile fetched from Martin directly, decoded, and the cached tiles the edits
did not expire must still be served from the cache."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import psycopg

from conftest import RUN_DIR, Cluster, county_data, free_port
from relay_harness import wait_for
from tile_cache_harness import SECRET, Martin, Varnish, decoded, fetch, lon_lat_to_tile

DB = "tilecache"
SOURCE = "cache_counties"   # the table, and so Martin's source id
OUTPUT = "cache"
STATE = "08"                # Colorado: 64 counties
TABLE = f"""CREATE TABLE public.{SOURCE} (id bigint PRIMARY KEY, geom geometry(Geometry, 4326) NOT NULL,
                                          version integer NOT NULL DEFAULT 0, name text)"""
SETTINGS = (f"feature_outbox.database = '{DB}'", "feature_outbox.retry_backoff_min = '100ms'",
            "feature_outbox.retry_backoff_max = '1s'", "feature_outbox.publish_timeout = '2s'",
            "feature_outbox.poll_interval = '200ms'")


def tiles_over(bbox, z: int) -> list[tuple[int, int, int]]:
    (x0, y1), (x1, y0) = lon_lat_to_tile(bbox[0], bbox[1], z), lon_lat_to_tile(bbox[2], bbox[3], z)
    return [(z, x, y) for x in range(x0, x1 + 1) for y in range(y0, y1 + 1)]


@dataclass
class Stack:
    c: Cluster
    martin: Martin
    varnish: Varnish
    counties: dict                                  # id -> GeoJSON geometry as committed
    bbox: tuple
    moved_vertices: list = field(default_factory=list)
    next_id: int = 900_000

    @property
    def direct(self) -> str:
        return f"http://127.0.0.1:{self.martin.port}"

    @property
    def cached(self) -> str:
        return f"http://127.0.0.1:{self.varnish.port}"

    def stop(self) -> None:
        self.varnish.stop()
        self.martin.stop()
        self.c.stop()


def start(name: str, endpoint: str, *settings: str, method: str = "xkey") -> Stack:
    """A cluster relaying to `endpoint`, the state's counties in SOURCE, Martin and Varnish in front,
    and an expire output at zooms 0-14 purging Varnish (and writing public.cache_tiles, so the test
    knows which tiles were expired)."""
    c = Cluster(RUN_DIR / name, free_port())
    c.start(*SETTINGS, f"feature_outbox.endpoint = '{endpoint}'", *settings)
    c.create_db(DB)
    secret = RUN_DIR / name / "cache-secret"
    secret.write_text(SECRET + "\n")
    counties = {int(r["id"]): r["geometry"] for r in map(json.loads, county_data().read_text().splitlines())
                if r["id"].startswith(STATE)}
    with c.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute(TABLE)
        conn.execute(f"SELECT feature_outbox.register_layer('{SOURCE}', 'public.{SOURCE}', properties => '{{name}}')")
        for fid, g in counties.items():
            conn.execute(f"SELECT feature_outbox.edit_feature('{SOURCE}', %s::bigint, ST_GeomFromGeoJSON(%s), 'created', "
                         "jsonb_build_object('name', %s::text))", (fid, json.dumps(g), f"county {fid}"))
        conn.commit()
        bbox = conn.execute(f"SELECT ST_XMin(e), ST_YMin(e), ST_XMax(e), ST_YMax(e) FROM (SELECT ST_Extent(geom) e FROM public.{SOURCE}) s").fetchone()
        conn.execute(f"ALTER SYSTEM SET feature_outbox.cache_secret_file = '{secret}'")
        conn.execute("SELECT pg_reload_conf()")
    martin = Martin(RUN_DIR / name / "martin", f"postgres://postgres@127.0.0.1:{c.port}/{DB}", SOURCE, {"name": "text"})
    martin.start()
    varnish = Varnish(RUN_DIR / name / "varnish", martin.port)
    varnish.start()
    stack = Stack(c, martin, varnish, counties, tuple(bbox))
    with c.connect(DB) as conn:
        # The creates above are published; their tiles were never cached, so no output yet.
        wait_for(lambda: drained(conn), 60, "the creates to be relayed")
        conn.execute(f"""SELECT feature_outbox.define_expire_output('{OUTPUT}', 14, cache_url => %s, cache_method => %s,
                                                                   "table" => 'public.cache_tiles')""",
                     (varnish.url(SOURCE), method))
        conn.execute(f"SELECT feature_outbox.expire_layer('{SOURCE}', '{OUTPUT}')")
    return stack


def drained(conn) -> bool:
    """No event waits, and no edit's tiles wait (parked ones do not count: they wait for an operator)."""
    return conn.execute("""SELECT NOT EXISTS (SELECT FROM feature_outbox.outbox WHERE published_at IS NULL AND parked_at IS NULL)
                              AND NOT EXISTS (SELECT FROM feature_outbox.tile_queue WHERE parked_at IS NULL)""").fetchone()[0]


def warm_set(stack: Stack, sample: int, rng: random.Random) -> list[tuple[int, int, int]]:
    """Every tile at zooms 0-10 over the state, and a fixed sample of `sample` at zooms 11-14."""
    tiles = [t for z in range(0, 11) for t in tiles_over(stack.bbox, z)]
    deep = [t for z in range(11, 15) for t in tiles_over(stack.bbox, z)] if sample else []
    return tiles + (rng.sample(deep, min(sample, len(deep))) if sample else [])


def get_all(base: str, tiles, workers: int = 8) -> dict:
    with ThreadPoolExecutor(workers) as pool:
        return dict(zip(tiles, pool.map(lambda t: fetch(base, SOURCE, *t), tiles)))


def square(lon: float, lat: float, d: float) -> dict:
    return {"type": "Polygon", "coordinates": [[[lon, lat], [lon + d, lat], [lon + d, lat + d], [lon, lat + d], [lon, lat]]]}


def one_vertex_moved(g: dict, rng: random.Random) -> tuple[dict, tuple[float, float], tuple[float, float]]:
    """`g` with one vertex of its first ring moved by up to 0.002 degrees (the ring stays closed)."""
    g = json.loads(json.dumps(g))
    ring = g["coordinates"][0] if g["type"] == "Polygon" else g["coordinates"][0][0]
    i = rng.randrange(1, len(ring) - 1)
    before = tuple(ring[i])
    ring[i] = [ring[i][0] + rng.uniform(-0.002, 0.002), ring[i][1] + rng.uniform(-0.002, 0.002)]
    return g, before, tuple(ring[i])


def shifted(g: dict, dx: float, dy: float) -> dict:
    def move(c):
        return [move(x) for x in c] if isinstance(c[0], list) else [c[0] + dx, c[1] + dy]
    return {"type": g["type"], "coordinates": move(g["coordinates"])}


def plan(stack: Stack, n: int, rng: random.Random) -> list[tuple]:
    """`n` edits of every kind, planned against the state they will meet: creates of small squares,
    moves, one-vertex moves, attribute updates and retires (which delete: the layer has no retired
    column). Each is (kind, id, GeoJSON or None, name or None); the moved vertices go to
    stack.moved_vertices, before and after, so that their tiles can be warmed first. stack.counties
    becomes the state after them: apply() follows."""
    planned, next_id = [], stack.next_id
    shapes = stack.counties
    for i in range(n):
        kind = rng.choices(["created", "moved", "vertex", "updated", "retired"], [2, 2, 4, 1, 1])[0]
        fid = rng.choice(sorted(shapes))
        if kind == "created":
            fid, next_id = next_id, next_id + 1
            lon = rng.uniform(stack.bbox[0], stack.bbox[2] - 0.05)
            lat = rng.uniform(stack.bbox[1], stack.bbox[3] - 0.05)
            shapes[fid] = square(lon, lat, rng.uniform(0.001, 0.05))
            planned.append(("created", fid, shapes[fid], f"new {fid}"))
        elif kind == "moved":
            shapes[fid] = shifted(shapes[fid], rng.uniform(-0.01, 0.01), rng.uniform(-0.01, 0.01))
            planned.append(("moved", fid, shapes[fid], None))
        elif kind == "vertex":
            shapes[fid], before, after = one_vertex_moved(shapes[fid], rng)
            stack.moved_vertices += [before, after]
            planned.append(("moved", fid, shapes[fid], None))
        elif kind == "updated":
            planned.append(("updated", fid, None, f"renamed {fid} at {i}"))
        else:
            del shapes[fid]
            planned.append(("retired", fid, None, None))
    stack.next_id = next_id
    return planned


def apply(stack: Stack, planned: list[tuple], rate: float | None = None, during=None) -> dict:
    """Makes the planned edits through edit_feature, each in its own transaction, at `rate` per
    second (None: as fast as they go); `during()` runs halfway. Returns the count by kind."""
    kinds = {}
    conn = None
    start_at = time.monotonic()
    for i, (kind, fid, g, name) in enumerate(planned):
        if during and i == len(planned) // 2:
            during()
        if rate:
            time.sleep(max(0.0, start_at + i / rate - time.monotonic()))
        geom = json.dumps(g) if g else None
        props = json.dumps({"name": name}) if name else None
        for attempt in range(50):
            try:
                if conn is None:
                    conn = psycopg.connect(stack.c.dsn(DB), autocommit=True, connect_timeout=2)
                conn.execute(f"SELECT feature_outbox.edit_feature('{SOURCE}', %s::bigint, ST_GeomFromGeoJSON(%s), %s, %s::jsonb)",
                             (fid, geom, kind, props))
                break
            except psycopg.errors.UniqueViolation:
                break   # a create whose commit was cut off had committed
            except psycopg.OperationalError:
                # A server reset (a relay worker killed with kill -9 resets every backend): the edit
                # is made again; whether the cut-off one committed does not matter to the tiles.
                conn = None
                time.sleep(0.2)
        kinds[kind] = kinds.get(kind, 0) + 1
    if conn is not None:
        conn.close()
    return kinds


def vertex_tiles(points) -> list[tuple[int, int, int]]:
    """The tiles at zooms 11-14 holding each moved vertex, before and after, and their 8 neighbours."""
    out = set()
    for lon, lat in points:
        for z in range(11, 15):
            x, y = lon_lat_to_tile(lon, lat, z)
            out |= {(z, x + dx, y + dy) for dx in (-1, 0, 1) for dy in (-1, 0, 1)}
    return sorted(out)


@dataclass
class Result:
    checked: int
    stale: list
    kept_hits: int
    kept: int
    expired: int
    kinds: dict
    purge_requests: int
    parked: int


def run(stack: Stack, edits: int, sample: int, seed: int = 7, rate: float | None = None, during=None,
        timeout: float = 180) -> Result:
    """Warm (zooms 0-10 over the state, `sample` tiles at 11-14, the tiles around each vertex the
    edits will move), edit, drain, compare every warmed tile through Varnish against Martin directly."""
    rng = random.Random(seed)
    planned = plan(stack, edits, random.Random(seed + 1))
    warm = sorted(set(warm_set(stack, sample, rng)) | set(vertex_tiles(stack.moved_vertices)))
    with stack.c.connect(DB) as conn:
        conn.execute("TRUNCATE public.cache_tiles")
        purged_before = conn.execute(f"SELECT purge_requests FROM feature_outbox.expire_backlog WHERE output = '{OUTPUT}'").fetchone()[0]
    get_all(stack.cached, warm)
    before = set(warm)
    kinds = apply(stack, planned, rate, during)

    def settled():
        # A connection per look: a fault drill's kill -9 of a relay worker resets every backend.
        try:
            with stack.c.connect(DB) as conn:
                return drained(conn)
        except psycopg.OperationalError:
            return False
    wait_for(settled, timeout, "the events and the tile queue to drain")
    with stack.c.connect(DB) as conn:
        expired = set(conn.execute("SELECT zoom, x, y FROM public.cache_tiles").fetchall())
        purges, parked = conn.execute(f"""SELECT purge_requests, parked_edits FROM feature_outbox.expire_backlog
                                           WHERE output = '{OUTPUT}'""").fetchone()
    check = sorted(before)
    through = get_all(stack.cached, check)
    direct = get_all(stack.direct, check)
    stale = [t for t in check if decoded(through[t][0]) != decoded(direct[t][0])]
    kept = [t for t in before if t not in expired]
    hits = sum(1 for t in kept if through[t][1] == "HIT")
    return Result(len(check), stale, hits, len(kept), len(expired & before), dict(kinds), purges - purged_before, parked)


@contextmanager
def stack_for(name: str, endpoint: str, *settings: str, method: str = "xkey"):
    s = start(name, endpoint, *settings, method=method)
    try:
        yield s
    finally:
        s.stop()

