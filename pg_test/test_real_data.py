"""Real data: all 3,231 US counties go through edit_feature, and every routing key must equal the
reference in fixtures/us_counties_routing_r8.csv, which scripts/make_routing_fixture.py computes
independently (PostGIS for the point, the h3 Python package for the cell) on PostgreSQL 15 with
PostGIS 3.3. On other majors (other PostGIS, GEOS and PROJ releases) ST_PointOnSurface and
ST_MakeValid may pick another point: there each key must be the cell of its own routing point, which
lies inside its county, and the counties whose cell differs from the fixture are listed with why in
$FEATURE_OUTBOX_TEST_DIR/routing_differences_pgN.txt."""

import csv
import json
from pathlib import Path

import h3
import pytest

from conftest import PG_MAJOR, RUN_DIR, county_data

FIXTURE = Path(__file__).parent / "fixtures" / "us_counties_routing_r8.csv"
COUNTY_COUNT = 3231
# A property of the data set: 40 county outlines fail ST_IsValid (self-intersections and the like).
# The default policy (accept) stores them as given and routes them from a made-valid copy.
INVALID_COUNT = 40
BATCH = 500


def read_counties() -> list[tuple[str, str]]:
    """(fips, geometry text exactly as the file has it) for each line of the GeoJSONL file."""
    counties = []
    for line in county_data().read_text().splitlines():
        if line.strip():
            start = line.index('"geometry":') + len('"geometry":')
            _, end = json.JSONDecoder().raw_decode(line, start)
            counties.append((json.loads(line)["id"], line[start:end].strip()))
    return counties


def load(conn, counties) -> None:
    """Creates every county through edit_feature, one transaction per BATCH rows."""
    for i in range(0, len(counties), BATCH):
        with conn.transaction(), conn.cursor() as cur:
            cur.executemany("SELECT feature_outbox.edit_feature(%s, %s, 'created')",
                            [(int(fips), text) for fips, text in counties[i:i + BATCH]])


def mismatches(rows, expected: dict[str, str]) -> list[str]:
    got = {f"{fid:05d}": key for fid, key in rows}
    return sorted(f for f in expected.keys() | got.keys() if expected.get(f) != got.get(f))


@pytest.fixture(scope="module")
def counties():
    rows = read_counties()
    assert len(rows) == COUNTY_COUNT
    return rows


@pytest.fixture(scope="module")
def reference() -> dict[str, dict]:
    with FIXTURE.open(newline="") as f:
        return {r["fips"]: r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def db(cluster, counties):
    cluster.create_db("real_data")
    with cluster.connect("real_data") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        # The source text too, so tests can compare with PostGIS's own reading of it.
        conn.execute("CREATE TABLE county_source (id bigint PRIMARY KEY, geojson text NOT NULL)")
        with conn.cursor() as cur, cur.copy("COPY county_source FROM STDIN") as copy:
            for fips, text in counties:
                copy.write_row((int(fips), text))
        load(conn, counties)
        yield conn


def test_every_county_created_once(db):
    features = db.execute("SELECT count(*), count(*) FILTER (WHERE version = 1 AND retired_at IS NULL)"
                          " FROM feature_outbox.features").fetchone()
    assert features == (COUNTY_COUNT, COUNTY_COUNT)
    outbox = db.execute("""
        SELECT count(*), count(DISTINCT feature_id),
               count(*) FILTER (WHERE feature_version = 1 AND event_type = 'created'
                                  AND previous_routing_key IS NULL)
          FROM feature_outbox.outbox""").fetchone()
    assert outbox == (COUNTY_COUNT, COUNTY_COUNT, COUNTY_COUNT)


def test_stored_geometry_is_postgis_reading_of_the_text(db):
    # The extension parses GeoJSON in Rust; the reference reads it with ST_GeomFromGeoJSON. Both
    # must give the same doubles, or the comparison of routing keys would compare different shapes.
    differ = db.execute("""
        SELECT s.id FROM county_source s JOIN feature_outbox.features f USING (id)
         WHERE ST_AsBinary(f.geom) <> ST_AsBinary(ST_GeomFromGeoJSON(s.geojson)) ORDER BY 1""").fetchall()
    bad = [f"{i:05d}" for (i,) in differ]
    assert bad == [], (f"{len(bad)} counties are stored with other coordinates than PostGIS reads from the "
                       f"same GeoJSON text (a decimal not parsed to its nearest double?): FIPS {', '.join(bad[:20])} ...")


def test_routing_keys_are_cells_of_their_routing_points(db):
    # The h3 Python package (Uber's C library) on the extension's own point: h3o must agree on every
    # county, whatever point this PostGIS picks.
    rows = db.execute("""
        SELECT o.feature_id, o.routing_key, ST_Y(p), ST_X(p)
          FROM feature_outbox.outbox o JOIN feature_outbox.features f ON f.id = o.feature_id,
               feature_outbox._routing_point(f.geom) p""").fetchall()
    assert len(rows) == COUNTY_COUNT
    bad = [f"{fid:05d}" for fid, key, lat, lng in rows if key != h3.latlng_to_cell(lat, lng, 8)]
    assert bad == [], f"{len(bad)} routing keys are not the H3 cell of their routing point: {bad[:20]}"


def test_routing_keys_equal_reference(db, reference):
    assert len(reference) == COUNTY_COUNT
    rows = db.execute("SELECT feature_id, routing_key FROM feature_outbox.outbox").fetchall()
    bad = mismatches(rows, {f: r["routing_key"] for f, r in reference.items()})
    if PG_MAJOR != 15:
        # The fixture is PostGIS 3.3's reading; list what this release picks otherwise, and why.
        report = RUN_DIR / f"routing_differences_pg{PG_MAJOR}.txt"
        lines = [f"{len(bad)} of {COUNTY_COUNT} counties route to another cell than {FIXTURE.name} on "
                 + db.execute("SELECT version() || ', PostGIS ' || postgis_full_version()").fetchone()[0]]
        keys = {f"{i:05d}": k for i, k in rows}
        for f in bad:
            valid, linework_null, point = db.execute("""
                SELECT ST_IsValid(geom), NOT ST_IsValid(geom) AND ST_MakeValid(geom) IS NULL,
                       ST_AsText(feature_outbox._routing_point(geom), 6)
                  FROM feature_outbox.features WHERE id = %s""", (int(f),)).fetchone()
            why = ("valid outline: ST_PointOnSurface picks another interior point" if valid
                   else "invalid outline: ST_MakeValid's default method gives NULL, repaired with method=structure"
                   if linework_null else "invalid outline: ST_MakeValid repairs it to another shape")
            lines.append(f"{f}: fixture {reference[f]['routing_key']}, here {keys[f]} at {point}; {why}")
        report.write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    if bad:
        # Diagnosis: does the extension's own rule agree with the reference on PostGIS's parse of the text?
        same_on_postgis_parse = db.execute("""
            SELECT count(*) FROM county_source s, unnest(%s::text[], %s::text[]) AS r(id, key)
             WHERE s.id = r.id::bigint AND feature_outbox.routing_key(ST_GeomFromGeoJSON(s.geojson)) = r.key""",
            (bad, [reference[f]["routing_key"] for f in bad])).fetchone()[0]
        pytest.fail(f"{len(bad)} routing keys differ from {FIXTURE.name}: FIPS {', '.join(bad)}; "
                    f"routing_key(ST_GeomFromGeoJSON(text)) matches the reference for {same_on_postgis_parse} of them")


def test_routing_point_lies_inside_every_county(db, reference):
    outside = db.execute("""
        SELECT id FROM feature_outbox.features
         WHERE NOT ST_Intersects(ST_MakeValid(geom), feature_outbox._routing_point(geom)) ORDER BY id""").fetchall()
    assert [f"{i:05d}" for (i,) in outside] == []

    invalid = {f"{i:05d}" for (i,) in db.execute(
        "SELECT id FROM feature_outbox.features WHERE NOT (ST_IsValidDetail(geom)).valid").fetchall()}
    assert len(invalid) == INVALID_COUNT
    assert invalid == {f for f, r in reference.items() if r["valid"] == "false"}


def test_aleutians_west_across_the_antimeridian(db, reference):
    # 02016 has islands on both sides of 180°, but no edge across it: routed unshifted, inside a part.
    key, inside, west, east = db.execute("""
        SELECT o.routing_key, ST_Intersects(f.geom, feature_outbox._routing_point(f.geom)),
               ST_XMin(f.geom), ST_XMax(f.geom)
          FROM feature_outbox.features f JOIN feature_outbox.outbox o ON o.feature_id = f.id
         WHERE f.id = 2016""").fetchone()
    assert west < -179 and east > 179
    assert key == reference["02016"]["routing_key"]
    assert inside


def test_moved_rows_carry_previous_key(db):
    # 50 counties moved by 0.01° in one transaction through the geometry overload; rolled back
    # afterwards so the module's other tests see only the created rows.
    with db.transaction(force_rollback=True):
        moved = db.execute("""
            SELECT feature_outbox.edit_feature(id, ST_Translate(geom, 0.01, 0.01), 'moved')
              FROM (SELECT id, geom FROM feature_outbox.features ORDER BY id LIMIT 50) s""").fetchall()
        assert moved == [(2,)] * 50
        rows = db.execute("""
            SELECT m.feature_id, m.feature_version, m.previous_routing_key = c.routing_key,
                   m.routing_key = feature_outbox.routing_key(f.geom)
              FROM feature_outbox.outbox m
              JOIN feature_outbox.outbox c ON c.feature_id = m.feature_id AND c.event_type = 'created'
              JOIN feature_outbox.features f ON f.id = m.feature_id
             WHERE m.event_type = 'moved'""").fetchall()
        assert len(rows) == 50
        assert [r for r in rows if r[1:] != (2, True, True)] == []


def test_repair_policy_routes_like_accept(cluster, counties, reference):
    # Under invalid_geometry = repair the stored shape is ST_MakeValid's; the routing point was
    # already taken from a made-valid copy, so the keys stay those of the reference.
    invalid = [(f, t) for f, t in counties if reference[f]["valid"] == "false"]
    cluster.create_db("real_data_repair")
    with cluster.connect("real_data_repair") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute("SET feature_outbox.invalid_geometry = repair")
        load(conn, invalid)
        stored_invalid = conn.execute(
            "SELECT count(*) FROM feature_outbox.features WHERE NOT (ST_IsValidDetail(geom)).valid").fetchone()[0]
        assert stored_invalid == 0
        rows = conn.execute("SELECT feature_id, routing_key FROM feature_outbox.outbox").fetchall()
        assert mismatches(rows, {f: reference[f]["routing_key"] for f, _ in invalid}) == []
