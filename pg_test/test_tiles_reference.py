"""The tile math (src/tiles/, tiles_touched and tiles_changed) against an independent reference that
PostGIS computes in the same database. The reference, for zoom z and buffer b: the shape in EPSG:3857
(latitudes clipped at Web Mercator's ±85.0511°; split at the antimeridian, in EPSG:3857 so that edges
stay straight there as everywhere else), candidate tiles
from the boxes of its parts (lines cut into pieces of at most a tile, so a long diagonal does not
enumerate its whole box), kept where ST_Intersects(shape, ST_TileEnvelope(z, x, y) grown by b of a
tile on every side): ST_TileEnvelope's own margin gives the same square, but the PostGIS beside
PostgreSQL 18 clips it at the world's edge, where the buffer must reach across.
Columns past the antimeridian wrap: a candidate column -1 is column 2^z - 1's envelope moved one world
west, so a buffer reaches across as it does in the tile math. boundary-only takes the polygons'
ST_Boundary; a move takes ST_SymDifference(old, new) in EPSG:3857.

Per case: every reference tile must be among ours (none missed), ours at most RATIO x the
reference's count, no duplicates, zoom/x/y in range. The largest ratio per kind of case is written to
$FEATURE_OUTBOX_TEST_DIR/tiles_reference_ratios.txt."""

import json
import math

import pytest

from conftest import RUN_DIR, county_data

DB = "tiles_reference"
ZOOMS = (0, 5, 10, 12, 14)
BUFFERS = (0.0, 0.1)
RATIO = 1.1
# Compare the math, not the fallback: no shape here falls back to its boundary.
NO_LIMIT = 1_000_000  # the cap (src/tiles/mod.rs, MAX_TILES_GEOMETRY)

# The county sample (FIPS): the largest, multipolygons, a few that fail ST_IsValid, and a seeded
# random sample of the rest.
BIG = ["06071", "32023", "04005",  # San Bernardino, Nye, Coconino: the largest in the lower 48
       "02290", "02150", "02261",  # Yukon-Koyukuk (the largest), Kodiak Island, Valdez-Cordova
       "02016"]                    # Aleutians West: a multipolygon with parts on both sides of 180°
MULTIPOLYGONS = ["53073", "60020", "13193", "44005", "08059", "25021", "55007", "48273"]
INVALID = ["02105", "56029", "51610"]  # Hoonah-Angoon (a multipolygon too), Park, Falls Church
RANDOM = ["06085", "55077", "45059", "29025", "26069", "48367", "42045", "29119", "40065", "16001", "48175",
          "39051", "19129", "13075", "49021", "17015", "13199", "06107", "48409", "20209", "12069", "30083"]
COUNTIES = BIG + MULTIPOLYGONS + INVALID + RANDOM
BOUNDARY_LINES = ["06071", "02016", "02150", "06085", "44005"]  # county outlines given as lines

# Synthetic shapes: name -> (SQL expression of the geometry, split at the antimeridian, kind).
SHAPES = {
    "long diagonal line": ("'SRID=4326;LINESTRING(-120 30, -70 48)'", False, "line"),
    "zigzag line": ("'SRID=4326;LINESTRING(2.0 48.0, 2.3 48.4, 2.31 48.0, 2.7 48.41, 2.71 48.02)'", False, "line"),
    "line along the equator": ("'SRID=4326;LINESTRING(-10 0, 10 0)'", False, "line"),
    "vertical line into the pole": ("'SRID=4326;LINESTRING(10 80, 10 89)'", False, "line"),
    "point": ("'SRID=4326;POINT(13.4 52.5)'", False, "point"),
    "point on tile corners": ("'SRID=4326;POINT(0 0)'", False, "point"),
    "point on the antimeridian": ("'SRID=4326;POINT(-180 10)'", False, "point"),
    "point just west of 180": ("'SRID=4326;POINT(179.999 -10)'", False, "point"),
    "multipoint": ("'SRID=4326;MULTIPOINT((-73.98 40.75), (2.35 48.85), (139.7 35.7))'", False, "multi-part"),
    "multilinestring": ("'SRID=4326;MULTILINESTRING((-3 40, -2 41, -1 40.5), (5 45, 5.5 45.2))'", False, "multi-part"),
    "polygon with a hole": ("'SRID=4326;POLYGON((10 50, 12 50, 12 52, 10 52, 10 50), (10.5 50.5, 11.5 50.5, 11.5 51.5, 10.5 51.5, 10.5 50.5))'",
                            False, "multi-part"),
    "multipolygon": ("'SRID=4326;MULTIPOLYGON(((20 60, 21 60, 20.5 61, 20 60)), ((22 60, 23 60.5, 22 61, 22 60)))'", False, "multi-part"),
    "collection": ("'SRID=4326;GEOMETRYCOLLECTION(POLYGON((-100 40, -99 40, -99 41, -100 40)), LINESTRING(-98 40, -97 41), POINT(-96 40))'",
                   False, "multi-part"),
    "line across the antimeridian": ("'SRID=4326;LINESTRING(179 -17, -179 -16)'", True, "antimeridian"),
    "long line across the antimeridian": ("'SRID=4326;LINESTRING(170 -20, 175 -18, -170 -10)'", True, "antimeridian"),
    "Fiji-like polygon across the antimeridian": ("'SRID=4326;POLYGON((177 -19, -178 -19, -178 -15, 177 -15, 177 -19))'", True, "antimeridian"),
    "Fiji-like multipolygon split at 180": (
        "'SRID=4326;MULTIPOLYGON(((177 -19, 180 -19, 180 -15, 177 -15, 177 -19)), ((-180 -19, -178 -19, -178 -15, -180 -15, -180 -19)))'",
        False, "antimeridian"),
    "tile-aligned square in EPSG:3857": ("ST_TileEnvelope(10, 530, 340)", False, "other SRID"),
    "triangle in EPSG:32633": ("'SRID=32633;POLYGON((500000 5300000, 560000 5320000, 510000 5370000, 500000 5300000))'", False, "other SRID"),
}

# Reference functions, in a schema of the test database.
REFERENCE_SQL = r"""
CREATE SCHEMA reference;

-- The shape in EPSG:3857, latitudes clipped at ±85.0511°. With wrap (a shape across the
-- antimeridian) its negative longitudes are shifted by 360°, and it is projected on past x = 180°
-- (PROJ's +over) to be split there by reference.split: in EPSG:3857, so that the cut edge stays the
-- straight line in EPSG:3857 that ST_Transform makes of every other edge (ST_WrapX in degrees would
-- bend it at 180°). A shape given in EPSG:3857 is taken as it is, without a round trip.
CREATE FUNCTION reference.mercator(g geometry, wrap boolean) RETURNS geometry
LANGUAGE sql IMMUTABLE AS $$
    WITH lonlat AS (SELECT CASE WHEN ST_SRID(g) = 4326 THEN g ELSE ST_Transform(g, 4326) END AS g),
         shifted AS (SELECT CASE WHEN wrap THEN ST_ShiftLongitude(g) ELSE g END AS g FROM lonlat),
         clipped AS (SELECT CASE WHEN ST_YMax(g) > 85.0511287798066 OR ST_YMin(g) < -85.0511287798066
                                 THEN ST_ClipByBox2D(g, ST_MakeEnvelope(-180, -85.0511287798066, 360, 85.0511287798066, 4326))
                                 ELSE g END AS g FROM shifted)
    SELECT CASE WHEN ST_SRID(g) = 3857 AND NOT wrap THEN g
                WHEN wrap THEN ST_SetSRID(ST_Transform(clipped.g, '+proj=merc +a=6378137 +b=6378137 +lat_ts=0 +lon_0=0 +x_0=0 '
                                                      '+y_0=0 +k=1 +units=m +nadgrids=@null +wktext +no_defs +over'), 3857)
                ELSE ST_Transform(clipped.g, 3857) END
      FROM clipped
$$;

-- The parts of a shape past x = 180° moved one world west.
CREATE FUNCTION reference.split(g geometry) RETURNS geometry
LANGUAGE sql IMMUTABLE AS $$
    SELECT ST_WrapX(g, 20037508.342789244, -2 * 20037508.342789244)
$$;

-- The shape with each polygon replaced by its rings (boundary-only); lines and points as they are.
CREATE FUNCTION reference.rings(g geometry) RETURNS geometry
LANGUAGE sql IMMUTABLE AS $$
    SELECT ST_Collect(ARRAY(SELECT CASE WHEN ST_Dimension(d.geom) = 2 THEN ST_Boundary(d.geom) ELSE d.geom END FROM ST_Dump(g) d))
$$;

-- The tiles (x, y) at zoom whose envelope grown by buffer x its width intersects m (EPSG:3857).
CREATE FUNCTION reference.tiles(m geometry, zoom integer, buffer float8)
RETURNS TABLE (x integer, y integer)
LANGUAGE sql STABLE AS $$
    WITH world AS (SELECT 20037508.342789244::float8 AS h, 1 << zoom AS n, 2 * 20037508.342789244::float8 / (1 << zoom) AS tw),
    -- m once (a CTE is computed once; m itself may be an expression the planner would repeat per row).
    target AS MATERIALIZED (SELECT m AS g),
    parts AS (SELECT d.geom FROM target, ST_Dump(target.g) d),
    -- Boxes to draw candidates from: polygons and points whole, lines in pieces of at most a tile,
    -- and each line's first point (a ring collapsed to one point, as one of Hoonah-Angoon's, has no
    -- segment to dump).
    pieces AS (
        SELECT p.geom FROM parts p WHERE ST_Dimension(p.geom) <> 1
        UNION ALL
        SELECT s.geom FROM parts p, world, ST_DumpSegments(ST_Segmentize(p.geom, world.tw)) s WHERE ST_Dimension(p.geom) = 1
        UNION ALL
        SELECT ST_StartPoint(p.geom) FROM parts p WHERE ST_Dimension(p.geom) = 1),
    -- Tile index ranges of each box grown by the buffer, one more tile each side; columns unwrapped.
    candidates AS (
        SELECT DISTINCT tx, ty
          FROM pieces, world,
               generate_series(floor((ST_XMin(pieces.geom) + h) / tw - buffer)::int - 1,
                               floor((ST_XMax(pieces.geom) + h) / tw + buffer)::int + 1) tx,
               generate_series(greatest(floor((h - ST_YMax(pieces.geom)) / tw - buffer)::int - 1, 0),
                               least(floor((h - ST_YMin(pieces.geom)) / tw + buffer)::int + 1, n - 1)) ty)
    SELECT DISTINCT ((tx % n) + n) % n, ty
      FROM candidates, world, target
     WHERE ST_Intersects(target.g, ST_Translate(ST_Expand(ST_TileEnvelope(zoom, ((tx % n) + n) % n, ty), buffer * tw),
                                             floor(tx::float8 / n) * 2 * h, 0))
$$;
"""


@pytest.fixture(scope="module")
def counties() -> dict[str, dict]:
    """The sample's GeoJSON features by FIPS."""
    wanted = set(COUNTIES)
    features = {}
    for line in county_data().read_text().splitlines():
        if line.strip() and (f := json.loads(line))["id"] in wanted:
            features[f["id"]] = f
    assert features.keys() == wanted
    return features


@pytest.fixture(scope="module")
def db(cluster, counties):
    cluster.create_db(DB)
    with cluster.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        # The reference's row estimates (generate_series) are large enough to set JIT compiling
        # each query, which costs more than the query.
        conn.execute("SET jit = off")
        conn.execute(REFERENCE_SQL)
        conn.execute("CREATE TABLE shapes (name text PRIMARY KEY, geom geometry NOT NULL, wrap boolean NOT NULL DEFAULT false)")
        for fips, f in counties.items():
            add_shape(conn, fips, json.dumps(f["geometry"]))
        for fips in BOUNDARY_LINES:
            conn.execute("INSERT INTO shapes SELECT %s, ST_Boundary(geom), false FROM shapes WHERE name = %s", (f"{fips} outline", fips))
        for name, (sql, wrap, _) in SHAPES.items():
            conn.execute(f"INSERT INTO shapes VALUES (%s, {sql}, %s)", (name, wrap))
        yield conn


@pytest.fixture(scope="module")
def ratios():
    """The largest ratio ours / reference seen per kind of case, written out at the end."""
    seen: dict[str, tuple[float, str]] = {}
    yield seen
    lines = [f"{kind:28} {ratio:.4f}  {case}" for kind, (ratio, case) in sorted(seen.items())]
    (RUN_DIR / "tiles_reference_ratios.txt").write_text("\n".join(lines) + "\n")
    print("\nlargest ratio ours / reference per kind:\n" + "\n".join(lines))


def add_shape(conn, name: str, geojson: str, wrap: bool = False) -> None:
    conn.execute("INSERT INTO shapes VALUES (%s, ST_SetSRID(ST_GeomFromGeoJSON(%s), 4326), %s)", (name, geojson, wrap))


def reference(db, name: str, zoom: int, buffer: float, boundary: bool = False, moved_to: str | None = None) -> set[tuple[int, int]]:
    """The reference tiles (x, y) of shape `name` at `zoom`, of its polygons' rings only with
    `boundary`; with `moved_to`, of the symmetric difference in EPSG:3857 between shape `name` and
    shape `moved_to` (its rings with `boundary`). Rings and differences are taken before the split
    at the antimeridian, which is no edge of the shape."""
    shape = "reference.mercator(a.geom, a.wrap)"
    if moved_to is not None:
        shape = f"ST_SymDifference({shape}, reference.mercator(b.geom, b.wrap))"
    if boundary:
        shape = f"reference.rings({shape})"
    rows = db.execute(f"""SELECT r.x, r.y FROM shapes a, shapes b, reference.tiles(reference.split({shape}), %(z)s, %(buffer)s) r
                           WHERE a.name = %(a)s AND b.name = %(b)s""",
                      {"a": name, "b": moved_to or name, "z": zoom, "buffer": buffer}).fetchall()
    return set(rows)


def touched(db, name: str, zoom: int, buffer: float, mode: str) -> list[tuple[int, int]]:
    """Our tiles (x, y) of shape `name` at `zoom` alone, duplicates kept to be counted."""
    rows = db.execute("""SELECT t.zoom, t.x, t.y FROM shapes s,
                                feature_outbox.tiles_touched(s.geom, %s, %s, %s, %s, max_tiles_geometry => %s) t
                          WHERE s.name = %s""", (zoom, zoom, buffer, mode, NO_LIMIT, name)).fetchall()
    assert all(z == zoom for z, _, _ in rows), f"{name}: tiles outside zoom {zoom}"
    return [(x, y) for _, x, y in rows]


def changed(db, old: str, new: str, maxzoom: int, minzoom: int, buffer: float, mode: str, diff: bool = True) -> list[tuple[int, int, int]]:
    """Our tiles (zoom, x, y) of a move from shape `old` to shape `new`."""
    return db.execute("""SELECT t.zoom, t.x, t.y FROM shapes a, shapes b,
                                feature_outbox.tiles_changed(a.geom, b.geom, %s, %s, %s, %s, diff => %s, max_tiles_geometry => %s) t
                          WHERE a.name = %s AND b.name = %s""", (maxzoom, minzoom, buffer, mode, diff, NO_LIMIT, old, new)).fetchall()


def compare(ratios, kind: str, case: str, ours: list[tuple[int, int]], ref: set[tuple[int, int]]) -> list[str]:
    """What is wrong with `ours` against `ref` (nothing: an empty list); the ratio is recorded."""
    problems = []
    got = set(ours)
    if len(got) != len(ours):
        problems.append(f"{case}: {len(ours) - len(got)} duplicate tiles")
    ratio = len(got) / len(ref) if ref else (1.0 if not got else math.inf)
    if ratio > ratios.get(kind, (0.0, ""))[0]:
        ratios[kind] = (ratio, case)
    if missed := sorted(ref - got):
        problems.append(f"{case}: missed {len(missed)} of the reference's {len(ref)} tiles, first {missed[:5]} (ratio {ratio:.3f})")
    if ratio > RATIO:
        problems.append(f"{case}: {len(got)} tiles, {ratio:.3f} x the reference's {len(ref)} (over {RATIO}); "
                        f"extra, first {sorted(got - ref)[:5]}")
    return problems


def against_reference(db, ratios, kind: str, name: str, modes=("full-area",), zooms=ZOOMS, buffers=BUFFERS) -> list[str]:
    problems = []
    for mode in modes:
        for buffer in buffers:
            for zoom in zooms:
                ref = reference(db, name, zoom, buffer, boundary=mode == "boundary-only")
                ours = touched(db, name, zoom, buffer, mode)
                problems += compare(ratios, kind, f"{name} {mode} buffer {buffer} zoom {zoom}", ours, ref)
    return problems


@pytest.mark.parametrize("mode", ["full-area", "boundary-only"])
@pytest.mark.parametrize("fips", COUNTIES)
def test_county_matches_reference(db, ratios, fips, mode):
    problems = against_reference(db, ratios, f"county {mode}", fips, modes=(mode,))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("fips", BOUNDARY_LINES)
def test_county_outline_as_lines_matches_reference(db, ratios, fips):
    problems = against_reference(db, ratios, "county outline as lines", f"{fips} outline")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", SHAPES)
def test_shape_matches_reference(db, ratios, name):
    _, _, kind = SHAPES[name]
    modes = ("full-area", "boundary-only") if kind in ("multi-part", "antimeridian", "other SRID") else ("full-area",)
    problems = against_reference(db, ratios, kind, name, modes=modes)
    assert not problems, "\n".join(problems)


def test_hybrid_is_full_area_below_the_limit_and_boundary_above(db, ratios):
    # Newport (RI) is about 40 km wide and high in EPSG:3857 metres, San Bernardino about 500 km.
    problems = []
    for fips in ("44005", "06071"):
        box = db.execute("SELECT greatest(ST_XMax(m) - ST_XMin(m), ST_YMax(m) - ST_YMin(m)) FROM shapes s,"
                         " reference.mercator(s.geom, s.wrap) m WHERE s.name = %s", (fips,)).fetchone()[0]
        ours = [(x, y) for _, x, y in db.execute(
            "SELECT t.* FROM shapes s, feature_outbox.tiles_touched(s.geom, 12, 12, 0.1, 'hybrid', 100000) t WHERE s.name = %s",
            (fips,)).fetchall()]
        full = box <= 100000
        problems += compare(ratios, "hybrid", f"{fips} hybrid 100 km ({'full area' if full else 'boundary'}) zoom 12",
                            ours, reference(db, fips, 12, 0.1, boundary=not full))
    assert not problems, "\n".join(problems)


# Moves ------------------------------------------------------------------------------------------

def tile_of(lon: float, lat: float, zoom: int) -> tuple[float, float]:
    """The fractional tile position of a point (x, y from the north)."""
    n = 1 << zoom
    return (lon + 180) / 360 * n, (1 - math.asinh(math.tan(math.radians(lat))) / math.pi) / 2 * n


def move_vertex(geometry: dict, index: int, dlon: float, dlat: float) -> tuple[dict, list[float]]:
    """A copy of a Polygon's GeoJSON with vertex `index` of its outer ring moved; and the old vertex."""
    assert geometry["type"] == "Polygon" and 0 < index < len(geometry["coordinates"][0]) - 1
    moved = json.loads(json.dumps(geometry))
    vertex = list(moved["coordinates"][0][index])
    moved["coordinates"][0][index] = [vertex[0] + dlon, vertex[1] + dlat]
    return moved, vertex


# San Bernardino's vertex 4 lies 0.036° (about 1.6 tiles at zoom 14) from both its neighbours, the
# closest pair of neighbours of any vertex of the county; it moves by about a fifth of a tile.
MOVED_COUNTY, MOVED_INDEX, MOVE = "06071", 4, (0.005, -0.003)


@pytest.fixture(scope="module")
def moved(db, counties) -> list[float]:
    """Adds the moved county (and its outline moved) to the shapes; returns the old vertex."""
    geometry, vertex = move_vertex(counties[MOVED_COUNTY]["geometry"], MOVED_INDEX, *MOVE)
    add_shape(db, f"{MOVED_COUNTY} moved", json.dumps(geometry))
    db.execute("INSERT INTO shapes SELECT %s, ST_Boundary(geom), false FROM shapes WHERE name = %s",
               (f"{MOVED_COUNTY} outline moved", f"{MOVED_COUNTY} moved"))
    assert db.execute("SELECT bool_and(ST_IsValid(geom)) FROM shapes WHERE name IN (%s, %s)",
                      (MOVED_COUNTY, f"{MOVED_COUNTY} moved")).fetchone()[0]
    db.execute("INSERT INTO shapes VALUES ('point moved', 'SRID=4326;POINT(13.45 52.49)'::geometry, false)")
    fiji, _ = move_vertex({"type": "Polygon", "coordinates": [[[177, -19], [-178, -19], [-178, -15], [177, -15], [177, -19]]]},
                          2, 0.1, -0.1)
    add_shape(db, "Fiji-like polygon across the antimeridian moved", json.dumps(fiji), wrap=True)
    return vertex


def test_one_moved_vertex_expires_tiles_near_it_only(db, ratios, moved):
    old, new = MOVED_COUNTY, f"{MOVED_COUNTY} moved"
    ours = [(x, y) for _, x, y in changed(db, old, new, 14, 14, 0.1, "full-area")]
    problems = compare(ratios, "move of one vertex", f"{old} vertex {MOVED_INDEX} moved, full-area buffer 0.1 zoom 14",
                       ours, reference(db, old, 14, 0.1, moved_to=new))
    assert not problems, "\n".join(problems)
    vx, vy = tile_of(*moved, 14)
    far = [(x, y) for x, y in ours if max(abs(x + 0.5 - vx), abs(y + 0.5 - vy)) > 3]
    assert ours and not far, f"tiles more than 3 tiles from the moved vertex ({vx:.1f}, {vy:.1f}): {far[:5]}"
    whole = len(touched(db, old, 14, 0.1, "full-area"))
    assert len(ours) * 100 < whole, f"{len(ours)} tiles changed against {whole} tiles of the county"


@pytest.mark.parametrize("old, new, boundary", [
    (MOVED_COUNTY, f"{MOVED_COUNTY} moved", False),
    (MOVED_COUNTY, f"{MOVED_COUNTY} moved", True),
    (f"{MOVED_COUNTY} outline", f"{MOVED_COUNTY} outline moved", False),
    ("point", "point moved", False),
    ("Fiji-like polygon across the antimeridian", "Fiji-like polygon across the antimeridian moved", False),
    ("Fiji-like polygon across the antimeridian", "Fiji-like polygon across the antimeridian moved", True),
], ids=lambda v: v if isinstance(v, str) else ("boundary-only" if v else "full-area"))
def test_move_matches_the_symmetric_difference(db, ratios, moved, old, new, boundary):
    mode = "boundary-only" if boundary else "full-area"
    problems = []
    for buffer in BUFFERS:
        ours = changed(db, old, new, 14, 10, buffer, mode)
        for zoom in (10, 12, 14):
            problems += compare(ratios, "move of one vertex", f"{old} -> {new} {mode} buffer {buffer} zoom {zoom}",
                                [(x, y) for z, x, y in ours if z == zoom],
                                reference(db, old, zoom, buffer, boundary=boundary, moved_to=new))
        assert all(z in (10, 11, 12, 13, 14) for z, _, _ in ours)
    assert not problems, "\n".join(problems)


def test_a_move_without_diff_expires_both_shapes(db, moved):
    old, new = MOVED_COUNTY, f"{MOVED_COUNTY} moved"
    ours = changed(db, old, new, 12, 12, 0.1, "full-area", diff=False)
    both = {(12, x, y) for name in (old, new) for x, y in touched(db, name, 12, 0.1, "full-area")}
    assert len(ours) == len(set(ours)) and set(ours) == both


# Invariants -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [*SHAPES, "06071", "02016", "53073"])
def test_tiles_are_distinct_and_in_range(db, name):
    for minzoom, maxzoom in ((0, 14), (3, 9)):
        rows = db.execute("""SELECT t.zoom, t.x, t.y FROM shapes s, feature_outbox.tiles_touched(s.geom, %s, %s, 0.1) t
                              WHERE s.name = %s""", (maxzoom, minzoom, name)).fetchall()
        assert rows, name
        assert len(rows) == len(set(rows)), f"{name} zooms {minzoom}-{maxzoom}: {len(rows) - len(set(rows))} duplicates"
        bad = [(z, x, y) for z, x, y in rows if not (minzoom <= z <= maxzoom and 0 <= x < 1 << z and 0 <= y < 1 << z)]
        assert not bad, f"{name} zooms {minzoom}-{maxzoom}: out of range, first {bad[:5]}"
