"""Tile expiry end to end (sql/tiles.sql, src/relay/expire.rs): a real cluster whose relay publishes
events to a real nats-server -js, two expire outputs with all three destinations each (osm2pgsql's
expire table, a NATS subject in its own JetStream stream, an HTTP URL on this process's receiver),
and a layer attached to both. Every test checks what a user of a destination sees.

What arrives is compared with a tile cover that PostGIS computes here, independently of the
product's tile code (src/tiles/): candidate tiles from the shape's box, kept where
ST_Intersects(ST_Transform(shape, 3857), ST_TileEnvelope(z, x, y, margin => buffer)). The shape is
the edit's: the new one for created and updated, the old one for retired; for a move with diff on
and unchanged properties ST_SymDifference(old, new) (taken in EPSG:3857, where the relay takes it),
else both shapes. "Exactly the reference": every reference tile present, at most 1.1 x the
reference's count in all, no zoom outside the output's. No shape here is near the antimeridian or
the poles, and none reaches max_tiles_geometry."""

import asyncio
import json
import math
import re

import nats
import psycopg
import pytest

from conftest import RUN_DIR, county_data, free_port
from drills import relay_pids
from relay_harness import NatsServer, receiver, reconfigure, relay_cluster, wait_for  # noqa: F401 (receiver: a fixture)

DB = "tiles"
RATIO = 1.1
# Two outputs over the same layer: osm2pgsql's defaults (diff on, buffer 0.1) over zooms 0-14, and
# diff off with another buffer over zooms 2-12, so that zooms outside an output's range show.
OUTPUTS = {
    "tiles": dict(minzoom=0, maxzoom=14, buffer=0.1, diff=True, table="public.expire_tiles", subject="tiles.all",
                  path="/tiles", stream="TILES_TILES"),
    "nodiff": dict(minzoom=2, maxzoom=12, buffer=0.05, diff=False, table="public.expire_nodiff", subject="tiles.nodiff",
                   path="/nodiff", stream="TILES_NODIFF"),
}
# osm2pgsql's own expire table DDL (osm2pgsql src/expire-output.cpp): public.expire_nodiff is made
# with it before its output is defined, as an osm2pgsql user's table would be; public.expire_tiles
# is made by define_expire_output.
OSM2PGSQL_TABLE = ("CREATE TABLE IF NOT EXISTS public.expire_nodiff (zoom int4 NOT NULL, x int4 NOT NULL, y int4 NOT NULL,"
                   " first timestamp with time zone DEFAULT CURRENT_TIMESTAMP(0),"
                   " last timestamp with time zone DEFAULT CURRENT_TIMESTAMP(0), PRIMARY KEY (zoom, x, y))")

# The independent reference: the tiles (zoom, x, y) at minzoom..maxzoom whose envelope, grown by
# buffer x its width on every side, intersects g (any SRID; taken to EPSG:3857).
REFERENCE_SQL = """
CREATE FUNCTION public.ref_tiles(g geometry, minzoom integer, maxzoom integer, buffer float8)
RETURNS TABLE (zoom integer, x integer, y integer)
LANGUAGE sql STABLE AS $$
    WITH m AS (SELECT ST_Transform(g, 3857) AS g),
         b AS (SELECT m.g, ST_XMin(m.g) AS x0, ST_XMax(m.g) AS x1, ST_YMin(m.g) AS y0, ST_YMax(m.g) AS y1
                 FROM m WHERE NOT ST_IsEmpty(m.g))
    SELECT z, tx, ty
      FROM b, generate_series(minzoom, maxzoom) z,
           LATERAL (SELECT 2 * 20037508.342789244 / (1 << z) AS tw, 1 << z AS n) w,
           generate_series(greatest(0, floor((b.x0 + 20037508.342789244) / w.tw - buffer)::int - 1),
                           least(w.n - 1, floor((b.x1 + 20037508.342789244) / w.tw + buffer)::int + 1)) tx,
           generate_series(greatest(0, floor((20037508.342789244 - b.y1) / w.tw - buffer)::int - 1),
                           least(w.n - 1, floor((20037508.342789244 - b.y0) / w.tw + buffer)::int + 1)) ty
     WHERE ST_Intersects(b.g, ST_TileEnvelope(z, tx, ty, margin => buffer))
$$;
"""

LINE = re.compile(r"^(\d+)/(\d+)/(\d+)$")
# Per path, the status the receiver answers (200 when absent); set by the tests.
DOWN: dict[str, int] = {}
# Per check: (what, output, destination, tiles received, reference tiles), for the summary.
STATS: list[tuple[str, str, str, int, int]] = []


@pytest.fixture(scope="module")
def nats_server():
    server = NatsServer(RUN_DIR / "tiles_nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def relay(nats_server, receiver):
    base = f"http://127.0.0.1:{receiver.server.server_port}"
    setup = [
        "CREATE TABLE public.shapes (id bigint PRIMARY KEY, geom geometry(Geometry, 4326) NOT NULL,"
        " version integer NOT NULL DEFAULT 0, name text)",
        "SELECT feature_outbox.register_layer('shapes', 'public.shapes', properties => '{name}')",
        OSM2PGSQL_TABLE,
        REFERENCE_SQL,
        # The test build's fault point (pg_test/conftest.py declares the publish one the same way).
        """CREATE FUNCTION public._test_crash_after_next_tiles() RETURNS void
           LANGUAGE c VOLATILE AS 'feature_outbox', '_test_crash_after_next_tiles_wrapper'""",
    ]
    for name, o in OUTPUTS.items():
        setup.append(f"""SELECT feature_outbox.define_expire_output('{name}', {o['maxzoom']}, {o['minzoom']}, '{o['table']}',
                                                                   '{o['subject']}', '{base}{o['path']}')""")
        setup.append(f"SELECT feature_outbox.expire_layer('shapes', '{name}', buffer => {o['buffer']}, diff => {o['diff']})")
    c = relay_cluster("tiles", DB, f"feature_outbox.endpoint = '{nats_server.url}'", "feature_outbox.poll_interval = '60s'",
                      "feature_outbox.publish_timeout = '2s'", "feature_outbox.retry_backoff_min = '100ms'",
                      "feature_outbox.retry_backoff_max = '1s'", setup=tuple(setup))
    c.base_url = base
    with c.connect(DB) as conn:
        wait_for(lambda: conn.execute("SELECT array_agg(state) = '{idle}' FROM feature_outbox.workers").fetchone()[0], 20,
                 "the relay worker to become idle")
    yield c
    c.stop()
    if STATS:
        worst = max(STATS, key=lambda s: s[3] / s[4])
        extra = sum(s[3] - s[4] for s in STATS)
        print(f"\ntile checks: {len(STATS)}, tiles beyond the reference in all: {extra}, largest ratio {worst[3] / worst[4]:.3f} "
              f"({worst[0]}: {worst[1]} {worst[2]}, {worst[3]} for {worst[4]})")


@pytest.fixture(autouse=True)
def answering(receiver):
    DOWN.clear()

    def respond(request):
        request["status"] = DOWN.get(request["path"], 200)
        return request["status"], {}
    receiver.respond = respond
    yield
    DOWN.clear()


@pytest.fixture
def db(relay):
    with relay.connect(DB) as conn:
        yield conn


# --- shapes ---------------------------------------------------------------------------------------

def wkt_point(p):
    return f"POINT({p[0]} {p[1]})"


def wkt_line(pts):
    return "LINESTRING(" + ", ".join(f"{x} {y}" for x, y in pts) + ")"


def wkt_polygon(*rings):
    return "POLYGON(" + ", ".join("(" + ", ".join(f"{x} {y}" for x, y in r) + ")" for r in rings) + ")"


def moved(pts, dx, dy):
    return [(round(x + dx, 6), round(y + dy, 6)) for x, y in pts]


def rect(x0, y0, x1, y1):
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0)]


def geom(shape: str) -> str:
    """SQL for a shape given as WKT or GeoJSON, in EPSG:4326."""
    return f"ST_SetSRID(ST_GeomFromGeoJSON('{shape}'), 4326)" if shape.startswith("{") else f"ST_GeomFromText('{shape}', 4326)"


# --- edits and references -------------------------------------------------------------------------

def edit(db, fid, event_type, shape=None, name=None) -> int:
    """One edit of layer shapes in its own transaction; returns its outbox id."""
    props = json.dumps({"name": name}) if name is not None else None
    g = geom(shape) if shape else "NULL::geometry"
    db.execute(f"SELECT feature_outbox.edit_feature('shapes', %s::bigint, {g}, %s, %s::jsonb)", (fid, event_type, props))
    return db.execute("SELECT max(id) FROM feature_outbox.outbox WHERE layer = 'shapes' AND feature_id = %s", (fid,)).fetchone()[0]


def reference(db, output: str, *shapes: str, sym: tuple[str, str] | None = None) -> set:
    """The reference tiles of `output` for the union of `shapes`' covers, or, with sym=(old, new),
    for ST_SymDifference(old, new) in EPSG:3857."""
    o = OUTPUTS[output]
    args = (o["minzoom"], o["maxzoom"], o["buffer"])
    out = set()
    for s in shapes:
        out |= set(db.execute(f"SELECT zoom, x, y FROM public.ref_tiles({geom(s)}, %s, %s, %s)", args).fetchall())
    if sym:
        old, new = sym
        out |= set(db.execute(f"""SELECT zoom, x, y FROM public.ref_tiles(
                                      ST_SymDifference(ST_Transform({geom(old)}, 3857), ST_Transform({geom(new)}, 3857)), %s, %s, %s)""",
                              args).fetchall())
    return out


def expected(db, output, event_type, old=None, new=None, properties_changed=False) -> set:
    """What an edit must expire in `output`, by osm2pgsql's rules."""
    if event_type in ("created", "updated"):
        return reference(db, output, new)
    if event_type == "retired":
        return reference(db, output, old)
    if OUTPUTS[output]["diff"] and not properties_changed:
        return reference(db, output, sym=(old, new))
    return reference(db, output, old, new)


def drained(db) -> bool:
    return db.execute("SELECT NOT EXISTS (SELECT 1 FROM feature_outbox.tile_queue)").fetchone()[0]


def wait_drained(db, what="every output's tiles to be delivered"):
    wait_for(lambda: drained(db), 30, what)


# --- what the destinations received ---------------------------------------------------------------

def stream_messages(server, stream: str, after: int = 0) -> list[dict]:
    """The messages of a JetStream stream after sequence `after`: seq, subject, headers, body."""
    async def read():
        nc = await nats.connect(server.url, connect_timeout=5, max_reconnect_attempts=2)
        js = nc.jetstream()
        try:
            info = await js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            await nc.close()
            return []
        out = []
        if info.state.messages:
            for seq in range(max(after + 1, info.state.first_seq), info.state.last_seq + 1):
                m = await js.get_msg(stream, seq)
                out.append({"seq": seq, "subject": m.subject, "headers": dict(m.headers or {}), "body": m.data.decode()})
        await nc.close()
        return out
    return asyncio.run(read())


def parse_list(body: str, what: str) -> list[tuple[int, int, int]]:
    """A tile list in osm2pgsql's expire-file format: `z/x/y` lines of integers, each ending in a
    newline, tiles within the world, no duplicates in one list."""
    assert body and body.endswith("\n"), f"{what}: a list ends in a newline: {body[-40:]!r}"
    tiles = []
    for line in body[:-1].split("\n"):
        m = LINE.match(line)
        assert m, f"{what}: {line!r} is not z/x/y"
        z, x, y = map(int, m.groups())
        assert 0 <= z <= 20 and 0 <= x < 1 << z and 0 <= y < 1 << z, f"{what}: {line} is outside the world"
        tiles.append((z, x, y))
    assert len(tiles) == len(set(tiles)), f"{what}: a tile twice in one list"
    return tiles


class Destinations:
    """What each output's three destinations received since `mark()`: the expire table's rows (the
    tables are emptied at the mark), the NATS stream's messages after the mark's sequence, and the
    receiver's 2xx requests after the mark's count."""

    def __init__(self, relay, db, nats_server, receiver):
        self.relay, self.db, self.nats, self.receiver = relay, db, nats_server, receiver
        self.seq, self.requests = {}, 0

    def mark(self, empty_tables=True):
        wait_drained(self.db)
        for name, o in OUTPUTS.items():
            if empty_tables:
                self.db.execute(f"DELETE FROM {o['table']}")
            msgs = stream_messages(self.nats, o["stream"])
            self.seq[name] = msgs[-1]["seq"] if msgs else 0
        with self.receiver.lock:
            self.requests = len(self.receiver.requests)
        return self

    def table(self, output) -> set:
        return set(self.db.execute(f"SELECT zoom, x, y FROM {OUTPUTS[output]['table']}").fetchall())

    def nats_messages(self, output) -> list[dict]:
        return stream_messages(self.nats, OUTPUTS[output]["stream"], self.seq[output])

    def http_requests(self, output, ok_only=True) -> list[dict]:
        with self.receiver.lock:
            new = self.receiver.requests[self.requests:]
        return [r for r in new if r["path"] == OUTPUTS[output]["path"] and (not ok_only or r["status"] < 300)]

    def received(self, output) -> dict:
        """Per destination, the set of tiles received (every list parsed and checked)."""
        nats_tiles, http_tiles = set(), set()
        for m in self.nats_messages(output):
            nats_tiles.update(parse_list(m["body"], f"{output} NATS seq {m['seq']}"))
        for r in self.http_requests(output):
            http_tiles.update(parse_list(r["body"].decode(), f"{output} POST {r['headers'].get('idempotency-key')}"))
        return {"table": self.table(output), "NATS": nats_tiles, "HTTP": http_tiles}

    def check(self, output, ref: set, what: str) -> dict:
        """Each destination of `output` received exactly the reference tiles."""
        o = OUTPUTS[output]
        got = self.received(output)
        for dest, tiles in got.items():
            label = f"{what}: {output} {dest}"
            missing = ref - tiles
            assert not missing, f"{label}: {len(missing)} of {len(ref)} reference tiles missing, e.g. {sorted(missing)[:5]}"
            assert len(tiles) <= RATIO * len(ref), f"{label}: {len(tiles)} tiles for a reference of {len(ref)}"
            zooms = {t[0] for t in tiles}
            assert min(zooms) >= o["minzoom"] and max(zooms) <= o["maxzoom"], f"{label}: zooms {sorted(zooms)}"
            STATS.append((what, output, dest, len(tiles), len(ref)))
        return got


@pytest.fixture
def dest(relay, db, nats_server, receiver):
    return Destinations(relay, db, nats_server, receiver)


def check_edit(db, dest, what, event_type, old=None, new=None, properties_changed=False):
    for output in OUTPUTS:
        ref = expected(db, output, event_type, old, new, properties_changed)
        assert ref, f"{what}: an empty reference for {output}"
        dest.check(output, ref, what)


# --- 1. created, moved, updated, retired: points, lines, polygons ---------------------------------

POINTS = [wkt_point((13.40, 52.50)), wkt_point((13.43, 52.52)), wkt_point((13.47, 52.49))]
LINE0 = [(2.20, 48.80), (2.25, 48.83), (2.30, 48.81), (2.35, 48.86), (2.40, 48.84), (2.45, 48.88)]
LINE1 = LINE0[:3] + [(2.352, 48.875)] + LINE0[4:]  # one vertex moved
LINES = [wkt_line(LINE0), wkt_line(LINE1), wkt_line(moved(LINE1, 0.05, -0.03))]
HOLE = rect(-0.25, 51.48, -0.15, 51.54)
POLY0 = rect(-0.40, 51.40, 0.00, 51.62)
POLYGONS = [wkt_polygon(POLY0, HOLE), wkt_polygon(moved(POLY0, 0.02, 0.01), moved(HOLE, 0.02, 0.01)),
            wkt_polygon(moved(POLY0, 0.05, 0.0), moved(HOLE, 0.05, 0.0))]


@pytest.mark.parametrize("kind,fid,shapes", [("point", 101, POINTS), ("line", 102, LINES), ("polygon", 103, POLYGONS)],
                         ids=["point", "line", "polygon"])
def test_each_destination_receives_the_reference_tiles_of_each_edit(db, dest, kind, fid, shapes):
    a, b, c = shapes
    steps = [
        ("created", dict(new=a), lambda: edit(db, fid, "created", a, name="a")),
        ("moved (diff: the symmetric difference)", dict(old=a, new=b), lambda: edit(db, fid, "moved", b)),
        ("moved with its properties (both shapes)", dict(old=b, new=c, properties_changed=True),
         lambda: edit(db, fid, "moved", c, name="c")),
        ("updated (its shape)", dict(new=c), lambda: edit(db, fid, "updated", name="d")),
        ("retired (its old shape)", dict(old=c), lambda: edit(db, fid, "retired")),
    ]
    for what, shapes_of, run in steps:
        dest.mark()
        run()
        wait_drained(db, f"the tiles of {kind} {what}")
        check_edit(db, dest, f"{kind} {what}", what.split()[0], **shapes_of)
    if kind == "polygon":
        # The hole's inner tiles are not the polygon's (at zoom 14 the hole is about 4 tiles across).
        inner = reference(db, "tiles", wkt_polygon(rect(-0.24, 51.49, -0.16, 51.53)))
        created = expected(db, "tiles", "created", new=a)
        assert {t for t in inner if t[0] == 14} - created, "the hole has tiles of its own"
    if kind in ("line", "polygon"):
        # The diffed move expires fewer tiles than both shapes would: the diff is not a no-op.
        diffed = [t for t in expected(db, "tiles", "moved", a, b) if t[0] == 14]
        both = [t for t in reference(db, "tiles", a, b) if t[0] == 14]
        assert len(diffed) < 0.8 * len(both), (len(diffed), len(both))


def test_record_edit_expires_like_edit_feature(db, dest):
    """The application writes its row and calls record_edit in the same transaction."""
    fid = 151
    a = wkt_polygon(rect(4.85, 52.33, 4.95, 52.39))
    b = wkt_polygon([(4.85, 52.33), (4.95, 52.33), (4.96, 52.40), (4.85, 52.39), (4.85, 52.33)])  # one corner moved
    steps = [
        ("created", dict(new=a), [f"INSERT INTO public.shapes (id, geom, name) VALUES ({fid}, {geom(a)}, 'a')"]),
        ("moved", dict(old=a, new=b), [f"UPDATE public.shapes SET geom = {geom(b)} WHERE id = {fid}"]),
        # The layer has no retired column: record_edit deletes the row itself, after the application's write.
        ("retired", dict(old=b), [f"UPDATE public.shapes SET version = version WHERE id = {fid}"]),
    ]
    for event_type, shapes_of, statements in steps:
        dest.mark()
        with db.transaction():
            for sql in statements:
                db.execute(sql)
            db.execute("SELECT feature_outbox.record_edit('shapes', %s::bigint, %s)", (fid, event_type))
        wait_drained(db, f"the tiles of record_edit {event_type}")
        check_edit(db, dest, f"record_edit {event_type}", event_type, **shapes_of)


# --- 2. two quick edits relayed together ----------------------------------------------------------

def test_two_quick_moves_relayed_together_expire_both_differences(db, dest):
    fid = 201
    a = wkt_polygon(rect(10.00, 45.00, 10.05, 45.04))
    b = wkt_polygon(rect(10.30, 45.20, 10.35, 45.24))   # far away
    c = wkt_polygon(rect(10.01, 45.00, 10.06, 45.04))   # back, next to A
    edit(db, fid, "created", a, name="a")
    dest.mark()
    # Output tiles' URL answers 503: nothing of it is delivered until both moves wait in its queue.
    DOWN["/tiles"] = 503
    first = edit(db, fid, "moved", b)
    second = edit(db, fid, "moved", c)
    wait_for(lambda: dest.http_requests("tiles", ok_only=False), 20, "a refused tile list")
    assert backlog(db, "tiles")["waiting_edits"] == 2
    del DOWN["/tiles"]
    wait_drained(db)
    ref = {}
    for output in OUTPUTS:
        ref[output] = expected(db, output, "moved", a, b) | expected(db, output, "moved", b, c)
        dest.check(output, ref[output], "A -> B -> C")
    # One delivery carried both edits: the receiver took one list, for two edits.
    [ok] = dest.http_requests("tiles")
    assert ok["headers"]["idempotency-key"].endswith(f"/{first}-{second}-2/0"), ok["headers"]["idempotency-key"]
    # The test means something: B -> C expires tiles that A -> B does not, and A -> C alone would miss B.
    assert expected(db, "tiles", "moved", b, c) - expected(db, "tiles", "moved", a, b)
    assert ref["tiles"] - expected(db, "tiles", "moved", a, c)


def test_features_edited_before_their_layer_got_an_output_diff_their_first_move(db, dest):
    """expire_layer keeps the current shape of each feature with events: the first move after it
    expires the symmetric difference (no box stands in), as every later move does."""
    fid = 251
    a = wkt_polygon(rect(8.50, 47.30, 8.60, 47.40))
    b = wkt_polygon([(8.50, 47.30), (8.60, 47.30), (8.61, 47.41), (8.50, 47.40), (8.50, 47.30)])  # one corner moved
    rules = db.execute("SELECT output, buffer, diff FROM feature_outbox.expire_rules WHERE layer = 'shapes'").fetchall()
    for output, _, _ in rules:
        db.execute("SELECT feature_outbox.unexpire_layer('shapes', %s)", (output,))
    edit(db, fid, "created", a, name="a")
    assert db.execute("SELECT count(*) FROM feature_outbox.tile_shapes WHERE layer = 'shapes'").fetchone()[0] == 0
    for output, buffer, diff in rules:
        db.execute("SELECT feature_outbox.expire_layer('shapes', %s, buffer => %s, diff => %s)", (output, buffer, diff))
    # The shape kept is the row's, as the edit stored it.
    assert db.execute("""SELECT ST_Equals(ST_GeomFromWKB(k.shape, 4326), t.geom) FROM feature_outbox.tile_shapes k
                           JOIN public.shapes t ON t.id = k.feature_id WHERE k.layer = 'shapes' AND k.feature_id = %s""",
                      (fid,)).fetchone() == (True,)
    fallbacks = {o: backlog(db, o)["box_fallbacks"] for o in OUTPUTS}
    dest.mark()
    edit(db, fid, "moved", b)
    wait_drained(db, "the tiles of the first move after expire_layer")
    check_edit(db, dest, "first move after expire_layer", "moved", old=a, new=b)
    assert {o: backlog(db, o)["box_fallbacks"] for o in OUTPUTS} == fallbacks
    # The test means something: the two boxes would have expired more than the difference.
    both = [t for t in reference(db, "tiles", a, b) if t[0] == 14]
    assert len(both) > RATIO * len([t for t in expected(db, "tiles", "moved", a, b) if t[0] == 14])


# --- 3. one vertex of a county ---------------------------------------------------------------------

def tile_xy(lon, lat, zoom):
    n = 1 << zoom
    return (lon + 180) / 360 * n, (1 - math.asinh(math.tan(math.radians(lat))) / math.pi) / 2 * n


def test_one_moved_vertex_of_a_county_expires_only_tiles_near_it(db, dest):
    county = next(json.loads(line) for line in county_data().read_text().splitlines() if line.startswith('{"id":"30001"'))
    assert county["name"] == "Beaverhead" and county["geometry"]["type"] == "Polygon"
    ring = county["geometry"]["coordinates"][0]
    assert len(ring) > 100
    # The vertex whose neighbours are nearest (in zoom-14 tiles), so that "near" is tight.
    def reach(i):
        v = tile_xy(*ring[i], 14)
        return max(math.dist(v, tile_xy(*ring[j], 14)) for j in (i - 1, i + 1))
    i = min((i for i in range(1, len(ring) - 1) if ring[i - 1] != ring[i] != ring[i + 1]), key=reach)
    old = json.dumps(county["geometry"])
    new_ring = [list(p) for p in ring]
    new_ring[i] = [ring[i][0] + 0.006, ring[i][1] + 0.004]  # about a third of a zoom-14 tile
    new = json.dumps({"type": "Polygon", "coordinates": [new_ring]})
    assert db.execute(f"SELECT ST_IsValid({geom(new)}) AND ST_IsValid({geom(old)})").fetchone()[0]

    dest.mark()
    edit(db, 301, "created", old, name="Beaverhead")
    wait_drained(db, "the county's tiles")
    check_edit(db, dest, "county created", "created", new=old)
    full = {t for t in expected(db, "tiles", "created", new=old) if t[0] == 14}

    dest.mark()
    edit(db, 301, "moved", new)
    wait_drained(db, "the moved vertex's tiles")
    check_edit(db, dest, "county vertex moved", "moved", old=old, new=new)
    got = {t for t in dest.table("tiles") if t[0] == 14}
    vx, vy = tile_xy(*ring[i], 14)
    near = reach(i) + 1.5  # the two edges at the vertex reach its neighbours; a tile and a buffer more
    far = [t for t in got if abs(t[1] + 0.5 - vx) > near or abs(t[2] + 0.5 - vy) > near]
    assert got and not far, f"zoom-14 tiles away from the vertex ({vx:.1f}, {vy:.1f}): {far[:5]}"
    assert len(got) * 100 < len(full), f"{len(got)} tiles at zoom 14 for one vertex, of {len(full)} for the county"
    print(f"\none vertex of Beaverhead moved: {len(got)} zoom-14 tiles expired, the county covers {len(full)}")


# --- 4. osm2pgsql's formats -------------------------------------------------------------------------

def test_lists_and_table_are_osm2pgsqls(db, dest, relay):
    database_id = db.execute("SELECT identity::text FROM feature_outbox.database_identity").fetchone()[0]
    # osm2pgsql's table, both when the product made it and when osm2pgsql's DDL did.
    for output, o in OUTPUTS.items():
        cols = db.execute("""SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, pg_get_expr(d.adbin, d.adrelid)
                               FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                              WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum""",
                          (o["table"],)).fetchall()
        assert cols == [("zoom", "integer", True, None), ("x", "integer", True, None), ("y", "integer", True, None),
                        ("first", "timestamp with time zone", False, "CURRENT_TIMESTAMP(0)"),
                        ("last", "timestamp with time zone", False, "CURRENT_TIMESTAMP(0)")], output
        key = db.execute("""SELECT array_agg(a.attname::text ORDER BY k.n) FROM pg_index i, unnest(i.indkey) WITH ORDINALITY k(attnum, n),
                                   pg_attribute a
                             WHERE i.indrelid = %s::regclass AND i.indisprimary AND a.attrelid = i.indrelid AND a.attnum = k.attnum""",
                         (o["table"],)).fetchone()[0]
        assert key == ["zoom", "x", "y"], output

    dest.mark()
    a = wkt_polygon(rect(-3.75, 40.38, -3.65, 40.46))
    edit(db, 401, "created", a, name="a")
    wait_drained(db)
    for output, o in OUTPUTS.items():
        got = dest.check(output, expected(db, output, "created", new=a), "formats")
        msgs = dest.nats_messages(output)
        assert msgs
        by_delivery = {}
        for m in msgs:
            h = m["headers"]
            assert m["subject"] == o["subject"]
            assert h["Feature-Outbox-Expire-Output"] == output and h["Feature-Outbox-Database-Id"] == database_id
            delivery, n = h["Nats-Msg-Id"].rsplit("/", 1)
            by_delivery.setdefault(delivery, []).append((int(n), h["Feature-Outbox-Tiles"], parse_list(m["body"], "NATS")))
        for delivery, parts in by_delivery.items():
            assert sorted(p[0] for p in parts) == list(range(len(parts))), delivery
            assert {p[1] for p in parts} == {str(sum(len(p[2]) for p in parts))}, "Feature-Outbox-Tiles counts the delivery's tiles"
        check_http_lists(dest.http_requests(output), output, database_id)
        assert got["NATS"] == got["HTTP"] == got["table"]

    # Expired again: `last` moves, `first` stays (osm2pgsql's rule).
    before = dict(((z, x, y), (f, l)) for z, x, y, f, l in db.execute("SELECT zoom, x, y, first, last FROM public.expire_tiles"))
    assert before and all(f == l for f, l in before.values())
    wait_for(lambda: db.execute("SELECT CURRENT_TIMESTAMP(0) > max(last) FROM public.expire_tiles").fetchone()[0], 5,
             "the clock's next second")
    edit(db, 401, "updated", name="b")
    wait_drained(db)
    after = dict(((z, x, y), (f, l)) for z, x, y, f, l in db.execute("SELECT zoom, x, y, first, last FROM public.expire_tiles"))
    assert after.keys() == before.keys()
    for t, (f, l) in after.items():
        assert f == before[t][0] and l > before[t][1], (t, before[t], (f, l))

    # A list over feature_outbox.http_max_body (1 kB here) goes as several POSTs, each a list of
    # whole lines under the limit, together the delivery's tiles.
    reconfigure(relay, http_max_body="1kB")
    try:
        dest.mark()
        big = wkt_polygon(rect(-3.70, 40.30, -3.50, 40.50))
        edit(db, 402, "created", big, name="a")
        wait_drained(db)
        dest.check("tiles", expected(db, "tiles", "created", new=big), "split lists")
        requests = dest.http_requests("tiles")
        assert len(requests) > 1 and all(len(r["body"]) <= 1024 for r in requests), [len(r["body"]) for r in requests]
        check_http_lists(requests, "tiles", database_id)
    finally:
        reconfigure(relay, http_max_body=None)


def check_http_lists(requests, output, database_id):
    """POSTed lists: text/plain, the output's headers, Idempotency-Key `<delivery>/<n>` numbering a
    delivery's lists from 0, Feature-Outbox-Tiles the delivery's count of tiles."""
    assert requests
    by_delivery = {}
    for r in requests:
        h = r["headers"]
        assert h["content-type"].split(";")[0].strip() == "text/plain"
        assert h["feature-outbox-expire-output"] == output and h["feature-outbox-database-id"] == database_id
        delivery, n = h["idempotency-key"].rsplit("/", 1)
        by_delivery.setdefault(delivery, []).append((int(n), h["feature-outbox-tiles"], parse_list(r["body"].decode(), "HTTP")))
    for delivery, parts in by_delivery.items():
        assert sorted(p[0] for p in parts) == list(range(len(parts))), delivery
        assert {p[1] for p in parts} == {str(sum(len(p[2]) for p in parts))}, "Feature-Outbox-Tiles counts the delivery's tiles"
        tiles = [t for p in sorted(parts) for t in p[2]]
        assert len(tiles) == len(set(tiles)), f"{delivery}: a tile in two of its lists"


# --- 5. a destination down, then back -----------------------------------------------------------------

def backlog(db, output) -> dict:
    db.row_factory = psycopg.rows.dict_row
    try:
        return db.execute("SELECT * FROM feature_outbox.expire_backlog WHERE output = %s", (output,)).fetchone()
    finally:
        db.row_factory = psycopg.rows.tuple_row


def published(db, ids) -> bool:
    return db.execute("SELECT bool_and(published_at IS NOT NULL) FROM feature_outbox.outbox WHERE id = ANY(%s)", (ids,)).fetchone()[0]


def test_a_destination_down_then_back_loses_nothing_and_holds_back_no_event(db, dest, relay, nats_server):
    shapes = {501: wkt_point((-74.00, 40.71)), 502: wkt_line([(-74.05, 40.70), (-73.95, 40.78), (-73.90, 40.75)]),
              503: wkt_polygon(rect(-73.99, 40.74, -73.95, 40.77)), 504: wkt_point((-73.80, 40.60))}
    dest.mark()
    # expire_backlog keeps the last error after a success (test 2 had one): only a newer one counts.
    earlier_error_at = backlog(db, "tiles")["last_error_at"]
    # The receiver refuses output tiles' lists: 503.
    DOWN["/tiles"] = 503
    with db.transaction():
        for fid in (501, 502, 503):
            edit(db, fid, "created", shapes[fid])
    ids = [r[0] for r in db.execute("SELECT id FROM feature_outbox.outbox WHERE layer = 'shapes' AND feature_id IN (501, 502, 503)")]
    wait_for(lambda: backlog(db, "tiles")["last_error_at"] != earlier_error_at, 20, "expire_backlog to show the error")
    b = backlog(db, "tiles")
    assert b["last_error"].endswith("/tiles: HTTP 503"), b["last_error"]
    assert b["waiting_edits"] == 3 and b["oldest_waiting_age"] is not None
    # The output's destinations take a list together: the expire table, written in the delivery's
    # transaction, kept nothing of a delivery that failed (or every retry would move `last` again).
    assert not dest.table("tiles"), "the expire table kept the tiles of a failed delivery"
    # The events are not held back, nor is the other output.
    wait_for(lambda: published(db, ids), 20, "the events to be published while the tile URL is down")
    assert backlog(db, "tiles")["waiting_edits"] == 3, "the events went out while the tiles wait"
    event_ids = {str(r[0]) for r in db.execute("SELECT event_id FROM feature_outbox.outbox WHERE id = ANY(%s)", (ids,))}
    assert event_ids <= {m["event"]["event_id"] for m in nats_server.messages()}
    wait_for(lambda: backlog(db, "nodiff")["waiting_edits"] == 0, 20, "output nodiff to deliver meanwhile")
    nodiff_ref = set().union(*(expected(db, "nodiff", "created", new=shapes[f]) for f in (501, 502, 503)))
    dest.check("nodiff", nodiff_ref, "nodiff while tiles' URL is down")

    # Then nobody listens at the URL.
    dead = f"http://127.0.0.1:{free_port()}/tiles"
    first_error_at = b["last_error_at"]
    o = OUTPUTS["tiles"]
    with db.transaction():
        db.execute("SELECT feature_outbox.define_expire_output('tiles', %s, %s, %s, %s, %s)",
                   (o["maxzoom"], o["minzoom"], o["table"], o["subject"], dead))
        edit(db, 504, "created", shapes[504])
    wait_for(lambda: dead in (backlog(db, "tiles")["last_error"] or ""), 20, "the refused connection in expire_backlog")
    b = backlog(db, "tiles")
    assert b["waiting_edits"] == 4 and b["last_error_at"] > first_error_at and "HTTP 503" not in b["last_error"], b
    assert not dest.table("tiles"), "the expire table kept the tiles of a failed delivery"
    print(f"\nexpire_backlog.last_error, nobody listening: {b['last_error']}")
    ids.append(db.execute("SELECT max(id) FROM feature_outbox.outbox WHERE feature_id = 504").fetchone()[0])
    wait_for(lambda: published(db, ids), 20, "the event of the edit made while nobody listens")

    # Back: the URL answers again, and every tile arrives everywhere.
    del DOWN["/tiles"]
    db.execute("SELECT feature_outbox.define_expire_output('tiles', %s, %s, %s, %s, %s)",
               (o["maxzoom"], o["minzoom"], o["table"], o["subject"], relay.base_url + o["path"]))
    wait_drained(db, "the tiles waiting for the URL")
    ref = set().union(*(expected(db, "tiles", "created", new=s) for s in shapes.values()))
    dest.check("tiles", ref, "tiles after the URL came back")
    ids = [m["headers"]["Nats-Msg-Id"] for m in dest.nats_messages("tiles")]
    refused = [r for r in dest.http_requests("tiles", ok_only=False) if r["status"] >= 300]
    print(f"\noutput tiles through the outage: {len(refused)} refused POSTs, {len(dest.http_requests('tiles'))} taken; "
          f"{len(ids)} lists in its JetStream stream under {len(set(ids))} ids")
    b = backlog(db, "tiles")
    assert b["waiting_edits"] == 0 and b["oldest_waiting_age"] is None and b["last_sent_at"] > b["last_error_at"]


# --- 6. a worker killed between send and mark ------------------------------------------------------

def test_a_worker_killed_between_delivery_and_delete_loses_nothing(db, dest, relay):
    shape = wkt_polygon(rect(151.15, -33.90, 151.25, -33.84))
    pids = relay_pids(relay, DB)
    dest.mark()
    db.execute("SELECT public._test_crash_after_next_tiles()")
    edit(db, 601, "created", shape, name="a")
    wait_for(lambda: "fault injection: exiting after a tile delivery" in relay.log(), 20, "the injected exit")
    wait_for(lambda: relay_pids(relay, DB) and relay_pids(relay, DB) != pids, 30, "the launcher to restart the worker")
    wait_drained(db, "the restarted worker to deliver the tiles again")
    check_edit(db, dest, "after the worker's exit", "created", new=shape)
    # The output it exited in was sent its list twice under one key: JetStream kept one copy, the
    # receiver got the same Idempotency-Key twice.
    repeated = []
    for output in OUTPUTS:
        keys = [r["headers"]["idempotency-key"] for r in dest.http_requests(output)]
        ids = [m["headers"]["Nats-Msg-Id"] for m in dest.nats_messages(output)]
        assert len(ids) == len(set(ids)), f"{output}: a tile list stored twice in JetStream"
        if len(keys) > len(set(keys)):
            repeated.append(output)
            # The list's key is the same on both sides: a consumer of either can drop the copy.
            assert set(keys) == set(ids), (keys, ids)
    assert len(repeated) == 1, f"one output's delivery repeated, not {repeated}"


def test_the_expire_table_is_written_with_its_owners_rights_not_the_relays(db, dest):
    """The relay runs as a superuser; the expire table's triggers must run as the table's owner,
    in a restricted context, as the layers are read: an owner's trigger cannot act as superuser."""
    db.execute("CREATE ROLE regress_tiles_owner")
    try:
        db.execute("CREATE TABLE public.owned_tiles (zoom int4 NOT NULL, x int4 NOT NULL, y int4 NOT NULL,"
                   " first timestamptz DEFAULT CURRENT_TIMESTAMP(0), last timestamptz DEFAULT CURRENT_TIMESTAMP(0),"
                   " PRIMARY KEY (zoom, x, y))")
        db.execute("CREATE TABLE public.owned_tiles_log (who text, superuser boolean, escalated text)")
        db.execute("""CREATE FUNCTION public.owned_tiles_audit() RETURNS trigger LANGUAGE plpgsql AS $$
                      DECLARE escalated text := 'no';
                      BEGIN
                          BEGIN
                              EXECUTE 'ALTER ROLE regress_tiles_owner SUPERUSER';
                              escalated := 'yes';
                          EXCEPTION WHEN OTHERS THEN escalated := SQLSTATE;
                          END;
                          INSERT INTO public.owned_tiles_log VALUES (current_user, (SELECT rolsuper FROM pg_roles WHERE rolname = current_user), escalated);
                          RETURN NEW;
                      END $$""")
        db.execute("CREATE TRIGGER audit BEFORE INSERT ON public.owned_tiles FOR EACH ROW EXECUTE FUNCTION public.owned_tiles_audit()")
        for sql in ("ALTER TABLE public.owned_tiles OWNER TO regress_tiles_owner",
                    "ALTER TABLE public.owned_tiles_log OWNER TO regress_tiles_owner",
                    "ALTER FUNCTION public.owned_tiles_audit() OWNER TO regress_tiles_owner"):
            db.execute(sql)
        db.execute("""SELECT feature_outbox.define_expire_output('owned', 3, "table" => 'public.owned_tiles')""")
        db.execute("SELECT feature_outbox.expire_layer('shapes', 'owned')")
        dest.mark()
        edit(db, 701, "created", wkt_point((2.35, 48.86)))
        wait_drained(db)
        rows = db.execute("SELECT DISTINCT who, superuser, escalated FROM public.owned_tiles_log").fetchall()
        assert rows, "the relay wrote no tile into the owned expire table"
        assert rows == [("regress_tiles_owner", False, "42501")], rows
        assert not db.execute("SELECT rolsuper FROM pg_roles WHERE rolname = 'regress_tiles_owner'").fetchone()[0]
        got = set(db.execute("SELECT zoom, x, y FROM public.owned_tiles").fetchall())
        want = set(db.execute(f"SELECT zoom, x, y FROM public.ref_tiles({geom(wkt_point((2.35, 48.86)))}, 0, 3, 0.1)").fetchall())
        assert got == want, (sorted(got), sorted(want))
    finally:
        db.execute("SELECT feature_outbox.drop_expire_output('owned') WHERE EXISTS (SELECT FROM feature_outbox.expire_outputs WHERE name = 'owned')")
        db.execute("DROP TABLE IF EXISTS public.owned_tiles, public.owned_tiles_log")
        db.execute("DROP FUNCTION IF EXISTS public.owned_tiles_audit()")
        db.execute("DROP ROLE regress_tiles_owner")
