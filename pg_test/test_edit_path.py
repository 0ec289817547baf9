"""The rebuilt edit path (issue 9): polygons around a pole in a polar CRS, coordinates outside a CRS's
area of use, and previous_routing_key read from the per-feature state instead of recomputed."""

import psycopg
import pytest

DB = "edit_path"


@pytest.fixture(scope="module")
def db(cluster):
    cluster.create_db(DB)
    with cluster.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
    with cluster.connect(DB) as conn:
        yield conn


def written(conn):
    return conn.execute("""SELECT (SELECT count(*) FROM feature_outbox.features),
                                  (SELECT count(*) FROM feature_outbox.outbox),
                                  (SELECT count(*) FROM feature_outbox.feature_state)""").fetchone()


def fails(conn, sql, params=()):
    """Runs an edit that must fail; returns (SQLSTATE, message) and checks that nothing was written."""
    before = written(conn)
    with pytest.raises(psycopg.Error) as e:
        conn.execute(sql, params)
    assert written(conn) == before, "a failed edit wrote rows"
    return e.value.sqlstate, e.value.diag.message_primary


# A square of 2,000 km centred on the pole, in metres of the polar stereographic CRS.
POLAR_SQUARE = "POLYGON((-1000000 -1000000, 1000000 -1000000, 1000000 1000000, -1000000 1000000, -1000000 -1000000))"


@pytest.mark.parametrize("srid,pole_lat", [(3031, -90), (3413, 90)])
def test_polygon_around_a_pole_is_stored_valid_covering_it_and_routed_in_its_source_crs(db, srid, pole_lat):
    fid = 90_000 + srid
    square = f"SRID={srid};{POLAR_SQUARE}"
    # What a plain ST_Transform makes of it: a ring of zero area that does not cover the pole.
    naive_area, naive_covers = db.execute(
        "SELECT ST_Area(t), ST_Covers(t, ST_SetSRID(ST_MakePoint(0, %s), 4326)) FROM ST_Transform(%s::geometry, 4326) t",
        (pole_lat, square)).fetchone()
    assert naive_area < 1e-6 and not naive_covers

    db.execute("SELECT feature_outbox.edit_feature(%s, %s::geometry, 'created')", (fid, square))
    valid, covers, area, srid_stored, lat_min, lat_max = db.execute(
        """SELECT ST_IsValid(geom), ST_Covers(geom, ST_SetSRID(ST_MakePoint(0, %s), 4326)), ST_Area(geom), ST_SRID(geom),
                  ST_YMin(geom), ST_YMax(geom)
             FROM feature_outbox.features WHERE id = %s""", (pole_lat, fid)).fetchone()
    assert valid and covers and srid_stored == 4326
    # Its corners are 1,414 km from the pole: about 77° of latitude.
    assert area > 100 and (76 < min(abs(lat_min), abs(lat_max)) < 78) and max(abs(lat_min), abs(lat_max)) == 90
    # Routed on the point on surface in the source CRS (here the pole itself), not on the 4326 ring.
    key, expected, naive = db.execute(
        """SELECT o.routing_key,
                  feature_outbox._h3_cell(ST_X(p), ST_Y(p), 8),
                  feature_outbox.routing_key(ST_Transform(%s::geometry, 4326))
             FROM feature_outbox.outbox o, ST_Transform(ST_PointOnSurface(%s::geometry), 4326) p
            WHERE o.feature_id = %s""", (square, square, fid)).fetchone()
    assert key == expected and key != naive
    # The state's box says the same: all longitudes, down (or up) to the pole.
    bbox, = db.execute("SELECT bbox FROM feature_outbox.feature_state WHERE feature_id = %s", (fid,)).fetchone()
    assert bbox[0] == -180 and bbox[2] == 180 and pole_lat in (bbox[1], bbox[3])


def test_polygon_around_a_pole_with_the_pole_in_a_hole_is_refused(db):
    ring = "(-2000000 -2000000, 2000000 -2000000, 2000000 2000000, -2000000 2000000, -2000000 -2000000)"
    hole = "(-500000 -500000, -500000 500000, 500000 500000, 500000 -500000, -500000 -500000)"
    state, message = fails(db, "SELECT feature_outbox.edit_feature(1, %s::geometry, 'created')",
                           (f"SRID=3031;POLYGON({ring}, {hole})",))
    assert state == "22023" and "pole" in message, message


@pytest.mark.parametrize("ewkt,crs", [
    # UTM zone 33N (12°E to 18°E, north of the equator) given a point 2,000 km south of the equator.
    ("SRID=32633;POINT(500000 -2000000)", "EPSG:32633"),
    # Web Mercator beyond its world (85.06°S to 85.06°N): y = 30,000 km is about 89.9°N.
    ("SRID=3857;POINT(0 30000000)", "EPSG:3857"),
    # Antarctic Polar Stereographic (south of 60°S) far out: lands at 80°N.
    ("SRID=3031;POINT(100000000 100000000)", "EPSG:3031"),
    # A polygon: one vertex outside is enough.
    ("SRID=32633;POLYGON((500000 5000000, 510000 5000000, 510000 -300000, 500000 5000000))", "EPSG:32633"),
])
def test_coordinates_outside_the_area_of_use_are_refused(db, ewkt, crs):
    state, message = fails(db, "SELECT feature_outbox.edit_feature(2, %s::geometry, 'created')", (ewkt,))
    assert state == "22023", message
    assert f"outside the area of use of {crs}" in message and "longitude" in message, message


def test_area_of_use_margin_allows_real_data_just_outside_a_utm_zone(db):
    # 11.6°E, 52°N: 0.4° west of UTM zone 33N.
    just_outside = db.execute(
        "SELECT ST_AsEWKT(ST_Transform(ST_SetSRID(ST_MakePoint(11.6, 52), 4326), 32633))").fetchone()[0]
    db.execute("SELECT feature_outbox.edit_feature(3, %s::geometry, 'created')", (just_outside,))
    db.execute("SET feature_outbox.area_of_use_margin = 0")
    try:
        state, message = fails(db, "SELECT feature_outbox.edit_feature(4, %s::geometry, 'created')", (just_outside,))
        assert state == "22023" and "EPSG:32633" in message
    finally:
        db.execute("RESET feature_outbox.area_of_use_margin")
    # The GeoJSON form checks the same.
    state, _ = fails(db, "SELECT feature_outbox.edit_feature(5, %s, 'created')",
                     ('{"type":"Point","coordinates":[500000,-2000000],"crs":{"type":"name","properties":{"name":"EPSG:32633"}}}',))
    assert state == "22023"


def test_a_crs_without_an_authority_entry_skips_the_area_test(db):
    db.execute("""INSERT INTO spatial_ref_sys (srid, auth_name, auth_srid, proj4text)
                  VALUES (990001, NULL, NULL, '+proj=utm +zone=33 +datum=WGS84 +units=m +no_defs')
                  ON CONFLICT DO NOTHING""")
    # Outside zone 33's area, yet a sound transform: stored, the round trip being the only check.
    db.execute("SELECT feature_outbox.edit_feature(6, 'SRID=990001;POINT(-200000 5700000)'::geometry, 'created')")
    assert db.execute("SELECT ST_X(geom) < 12 FROM feature_outbox.features WHERE id = 6").fetchone()[0]


def square(lon, lat, d=0.01):
    return (f"SRID=4326;POLYGON(({lon} {lat}, {lon + d} {lat}, {lon + d} {lat + d}, {lon} {lat + d}, {lon} {lat}))")


def check_previous_keys(conn, fid, shapes):
    """Each outbox row's previous_routing_key is routing_key() of the shape before it, at the resolution
    its row was written at, and its routing_key that of its own shape."""
    rows = conn.execute("""SELECT feature_version, event_type, routing_key, previous_routing_key, length(routing_key)
                             FROM feature_outbox.outbox WHERE feature_id = %s ORDER BY id""", (fid,)).fetchall()
    assert len(rows) == len(shapes)
    for i, ((version, event, key, previous, _), (shape, resolution)) in enumerate(zip(rows, shapes)):
        conn.execute(f"SET feature_outbox.h3_resolution = {resolution}")
        assert version == i + 1
        assert key == conn.execute("SELECT feature_outbox.routing_key(%s::geometry)", (shape,)).fetchone()[0], (i, event)
        expected = None if i == 0 else conn.execute("SELECT feature_outbox.routing_key(%s::geometry)",
                                                    (shapes[i - 1][0],)).fetchone()[0]
        assert previous == expected, (i, event)
    conn.execute("RESET feature_outbox.h3_resolution")
    return rows


def test_previous_routing_key_through_created_moved_moved_retired_and_a_resolution_change(db):
    fid, a, b, c = 7, square(13.40, 52.52), square(13.50, 52.52), square(13.60, 52.60)
    db.execute("SELECT feature_outbox.edit_feature(%s, %s::geometry, 'created')", (fid, a))
    db.execute("SELECT feature_outbox.edit_feature(%s, %s::geometry, 'moved')", (fid, b))
    db.execute("SET feature_outbox.h3_resolution = 10")  # the state's key was taken at 8
    db.execute("SELECT feature_outbox.edit_feature(%s, %s::geometry, 'moved')", (fid, c))
    db.execute("RESET feature_outbox.h3_resolution")     # and back, without a geometry
    db.execute("SELECT feature_outbox.edit_feature(%s, NULL::geometry, 'retired')", (fid,))
    rows = check_previous_keys(db, fid, [(a, 8), (b, 8), (c, 10), (c, 8)])
    assert [r[4] for r in rows] == [15, 15, 15, 15] and rows[2][2][1] == "a"  # resolution 10 cells begin 8a
    state = db.execute("""SELECT routing_key, h3_resolution, previous_routing_key FROM feature_outbox.feature_state
                           WHERE layer = 'features' AND feature_id = %s""", (fid,)).fetchone()
    assert state == (rows[2][2], 10, rows[2][2])  # the retired event kept the last shape's state


def test_a_feature_without_state_fills_it_from_its_stored_geometry(db):
    # As after ALTER EXTENSION UPDATE from 0.1.0: the feature exists, its state does not.
    fid, a, b = 8, square(2.35, 48.85), square(2.45, 48.85)
    db.execute("SELECT feature_outbox.edit_feature(%s, %s::geometry, 'created')", (fid, a))
    db.execute("DELETE FROM feature_outbox.feature_state WHERE feature_id = %s", (fid,))
    db.execute("SELECT feature_outbox.edit_feature(%s, %s::geometry, 'moved')", (fid, b))
    check_previous_keys(db, fid, [(a, 8), (b, 8)])
    assert db.execute("SELECT count(*) FROM feature_outbox.feature_state WHERE feature_id = %s", (fid,)).fetchone()[0] == 1
