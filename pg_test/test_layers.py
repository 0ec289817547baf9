"""Layers (issue 10): the user's own PostGIS tables, with attribute columns, through the same outbox.
A cluster whose relay publishes to a real nats-server; user tables in EPSG:2263 (NY State Plane, US
feet) and EPSG:5070 (CONUS Albers); a table owner's role for the relay's reads. What one connection
shows (registration mistakes, refused edits, record_edit, privileges, unregister) is in the SQL
regression files pg_test/sql/07_register_mistakes to 17_retired."""

import csv
import json

import psycopg
import pytest

from conftest import RUN_DIR, Cluster, county_data, free_port
from relay_harness import nats_fixture, subject, wait_for

DB = "layers"
SETTINGS = (
    f"feature_outbox.database = '{DB}'",
    "feature_outbox.poll_interval = '60s'",
    "feature_outbox.retry_backoff_min = '100ms'",
    "feature_outbox.retry_backoff_max = '200ms'",
    "feature_outbox.max_attempts = 2",
)
PARCELS = """CREATE TABLE public.parcels (
    id         bigint PRIMARY KEY,
    geom       geometry(Polygon, 2263) NOT NULL,
    version    integer NOT NULL DEFAULT 0,
    name       text,
    zoning     varchar(4),
    lots       integer,
    retired_at timestamptz,
    written_by name DEFAULT current_user)"""
# Two blocks in Manhattan, as GeoJSON in EPSG:4326.
BLOCK_A = '{"type":"Polygon","coordinates":[[[-73.99,40.75],[-73.98,40.75],[-73.98,40.76],[-73.99,40.76],[-73.99,40.75]]]}'
BLOCK_B = '{"type":"Polygon","coordinates":[[[-74.01,40.70],[-74.00,40.70],[-74.00,40.71],[-74.01,40.71],[-74.01,40.70]]]}'
BLOCK_C = 'POLYGON((-73.95 40.78,-73.94 40.78,-73.94 40.79,-73.95 40.79,-73.95 40.78))'


nats_server = nats_fixture("nats_layers")


@pytest.fixture(scope="module")
def relay(nats_server):
    c = Cluster(RUN_DIR / "layers", free_port())
    c.start(*SETTINGS, f"feature_outbox.endpoint = '{nats_server.url}'")
    c.create_db(DB)
    with c.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute(PARCELS)
        conn.execute("""SELECT feature_outbox.register_layer('parcels', 'public.parcels',
                               properties => '{name,zoning,lots}', retired_column => 'retired_at')""")
    yield c
    c.stop()


@pytest.fixture
def db(relay):
    with relay.connect(DB) as conn:
        yield conn


def relayed(conn):
    """No outbox row waits for the relay (parked rows wait for a person instead)."""
    return conn.execute("SELECT NOT EXISTS (SELECT 1 FROM feature_outbox.outbox WHERE published_at IS NULL AND parked_at IS NULL)").fetchone()[0]


def key_of(conn, geojson):
    """The routing key of a GeoJSON geometry in EPSG:4326, as routing_key() computes it."""
    return conn.execute("SELECT feature_outbox.routing_key(ST_SetSRID(ST_GeomFromGeoJSON(%s), 4326))",
                        (geojson,)).fetchone()[0]


def outbox(conn, layer, fid):
    return conn.execute("""SELECT feature_version, event_type, routing_key, previous_routing_key
                             FROM feature_outbox.outbox WHERE layer = %s AND feature_id = %s ORDER BY id""",
                        (layer, fid)).fetchall()


def events(server, layer, fid):
    return [m for m in server.messages() if m["event"]["layer"] == layer and m["event"]["feature_id"] == str(fid)]


def counts(conn):
    return conn.execute("""SELECT (SELECT count(*) FROM feature_outbox.outbox),
                                  (SELECT count(*) FROM feature_outbox.feature_state),
                                  (SELECT count(*) FROM feature_outbox.layer_registry)""").fetchone()


def fails(conn, sql, params=(), watch=None):
    """Runs a statement that must fail, in a savepoint when a transaction is open; returns (SQLSTATE,
    message, hint). Nothing may be written (counted through `watch`, by default `conn`)."""
    watch = watch or conn
    before = counts(watch)
    with pytest.raises(psycopg.Error) as e:
        with conn.transaction():
            conn.execute(sql, params)
    assert counts(watch) == before, "a failed call wrote rows"
    return e.value.sqlstate, e.value.diag.message_primary, e.value.diag.message_hint


def test_edit_feature_lifecycle_in_a_state_plane_table(db, nats_server):
    fid = 1
    key_a, key_b = key_of(db, BLOCK_A), key_of(db, BLOCK_B)
    assert key_a != key_b
    assert db.execute("""SELECT feature_outbox.edit_feature('parcels', %s, %s, 'created',
                                '{"name": "Lot A", "zoning": "R6", "lots": "3"}')""", (fid, BLOCK_A)).fetchone()[0] == 1
    srid, version, name, zoning, lots, same = db.execute(
        """SELECT ST_SRID(geom), version, name, zoning, lots,
                  ST_Equals(ST_SnapToGrid(ST_Transform(geom, 4326), 1e-9),
                            ST_SnapToGrid(ST_SetSRID(ST_GeomFromGeoJSON(%s), 4326), 1e-9))
             FROM parcels WHERE id = %s""", (BLOCK_A, fid)).fetchone()
    assert (srid, version, name, zoning, lots, same) == (2263, 1, "Lot A", "R6", 3, True)

    # updated: attributes only; the geometry and the cell stay.
    assert db.execute("""SELECT feature_outbox.edit_feature('parcels', %s, NULL::text, 'updated', '{"name": "Lot B"}')""",
                      (fid,)).fetchone()[0] == 2
    assert db.execute("SELECT feature_outbox.edit_feature('parcels', %s, %s, 'moved')", (fid, BLOCK_B)).fetchone()[0] == 3
    assert db.execute("SELECT feature_outbox.edit_feature('parcels', %s, NULL::text, 'retired')", (fid,)).fetchone()[0] == 4
    assert db.execute("SELECT version, name, zoning, retired_at IS NOT NULL FROM parcels WHERE id = %s",
                      (fid,)).fetchone() == (4, "Lot B", "R6", True)
    assert outbox(db, "parcels", fid) == [
        (1, "created", key_a, None),
        (2, "updated", key_a, key_a),
        (3, "moved", key_b, key_a),
        (4, "retired", key_b, key_b),
    ]

    wait_for(lambda: relayed(db), 20, "the relay to publish the parcels events")
    got = events(nats_server, "parcels", fid)
    assert [m["subject"] for m in got] == [
        subject("parcels", "created", key_a), subject("parcels", "updated", key_a),
        subject("parcels", "moved", key_b), subject("parcels", "retired", key_b)]
    # The move left key_a: a departure notice on its cells, with the moved event's body.
    gone = [m for m in nats_server.messages(departed=True) if m["headers"]["Nats-Msg-Id"].endswith(":departed")
            and m["event"]["layer"] == "parcels" and m["event"]["feature_id"] == str(fid)]
    assert [m["subject"] for m in gone] == [subject("parcels", "departed", key_a)]
    assert gone[0]["event"] == got[2]["event"] and gone[0]["headers"]["Nats-Msg-Id"] == got[2]["event"]["event_id"] + ":departed"
    for m in got:
        e = m["event"]
        assert e["schema_version"] == 3 and e["layer"] == "parcels" and e["crs"] == "EPSG:4326"
        # Read at relay time: the row as it is then, at this event's version or later.
        assert set(e["properties"]) == {"name", "zoning", "lots"} and e["properties"]["zoning"] == "R6"
        assert e["geometry_version"] >= e["event_version"] and e["geometry"]["type"] == "Polygon"
        # The geometry is published in EPSG:4326 degrees, not State Plane feet.
        assert all(-74.02 < x < -73.97 and 40.69 < y < 40.77 for x, y in e["geometry"]["coordinates"][0])
    assert got[-1]["event"]["properties"] == {"name": "Lot B", "zoning": "R6", "lots": 3}
    assert got[-1]["event"]["geometry_version"] == 4
    assert [m["event"]["previous_routing_key"] for m in got] == [None, key_a, key_a, key_b]


def test_orm_writes_plus_record_edit_inside_a_savepoint(db, nats_server):
    fid = 2
    key_c = db.execute("SELECT feature_outbox.routing_key(ST_GeomFromText(%s, 4326))", (BLOCK_C,)).fetchone()[0]
    key_a = key_of(db, BLOCK_A)
    with db.transaction():
        db.execute("INSERT INTO parcels (id, geom, name, zoning) VALUES (%s, ST_Transform(ST_GeomFromText(%s, 4326), 2263), 'ORM lot', 'C1')",
                   (fid, BLOCK_C))
        with db.transaction():  # a savepoint
            assert db.execute("SELECT feature_outbox.record_edit('parcels', %s, 'created')", (fid,)).fetchone()[0] == 1
    with db.transaction():
        db.execute("UPDATE parcels SET lots = 7 WHERE id = %s", (fid,))
        assert db.execute("SELECT feature_outbox.record_edit('parcels', %s, 'updated')", (fid,)).fetchone()[0] == 2
    with db.transaction():
        db.execute("UPDATE parcels SET geom = ST_Transform(ST_SetSRID(ST_GeomFromGeoJSON(%s), 4326), 2263) WHERE id = %s",
                   (BLOCK_A, fid))
        with db.transaction():
            assert db.execute("SELECT feature_outbox.record_edit('parcels', %s, 'moved')", (fid,)).fetchone()[0] == 3
    with db.transaction():
        db.execute("UPDATE parcels SET retired_at = now() WHERE id = %s", (fid,))
        assert db.execute("SELECT feature_outbox.record_edit('parcels', %s, 'retired')", (fid,)).fetchone()[0] == 4
    assert db.execute("SELECT version, lots FROM parcels WHERE id = %s", (fid,)).fetchone() == (4, 7)
    rows = outbox(db, "parcels", fid)
    # record_edit routes on the stored geometry transformed back to 4326: the same cell here.
    assert rows == [(1, "created", key_c, None), (2, "updated", key_c, key_c),
                    (3, "moved", key_a, key_c), (4, "retired", key_a, key_a)]
    wait_for(lambda: relayed(db), 20, "the relay to publish the ORM events")
    got = events(nats_server, "parcels", fid)
    assert [m["subject"].split(".")[2] for m in got] == ["created", "updated", "moved", "retired"]
    assert got[-1]["event"]["properties"] == {"name": "ORM lot", "zoning": "C1", "lots": 7}


def test_subject_format_0_1_keeps_the_built_in_subjects(relay, db, nats_server):
    with relay.connect() as su:
        su.execute("ALTER SYSTEM SET feature_outbox.subject_format = '0.1'")
        su.execute("SELECT pg_reload_conf()")
    try:
        wait_for(lambda: db.execute("SELECT 1 FROM pg_settings WHERE name = 'feature_outbox.subject_format' AND setting = '0.1'").fetchone(), 5)
        import time
        time.sleep(0.5)  # the worker takes the reload at its next wake-up, before the batch
        point = '{"type":"Point","coordinates":[2.35,48.86]}'
        db.execute("SELECT feature_outbox.edit_feature(501, %s, 'created')", (point,))
        db.execute("SELECT feature_outbox.edit_feature('parcels', 501, %s, 'created')", (BLOCK_A,))
        wait_for(lambda: relayed(db), 20, "the relay to publish")
        subjects = {m["event"]["layer"]: m["subject"] for m in nats_server.messages() if m["event"]["feature_id"] == "501"}
        assert subjects["features"] == f"features.created.{key_of(db, point)}"
        assert subjects["parcels"] == subject("parcels", "created", key_of(db, BLOCK_A))
    finally:
        with relay.connect() as su:
            su.execute("ALTER SYSTEM RESET feature_outbox.subject_format")
            su.execute("SELECT pg_reload_conf()")


def test_a_layer_whose_table_is_gone_holds_its_rows_until_it_is_released(relay, db, nats_server):
    db.execute("CREATE TABLE public.doomed (id bigint PRIMARY KEY, geom geometry(Point, 4326), version integer NOT NULL DEFAULT 0, note text)")
    db.execute("SELECT feature_outbox.register_layer('doomed', 'public.doomed', properties => '{note}')")
    db.execute("CREATE TABLE public.renamed (id bigint PRIMARY KEY, geom geometry(Point, 4326), version integer NOT NULL DEFAULT 0, note text)")
    db.execute("SELECT feature_outbox.register_layer('renamed', 'public.renamed', properties => '{note}')")
    # Paused, so the rows wait while their tables change.
    with relay.connect() as su:
        su.execute("ALTER SYSTEM SET feature_outbox.endpoint = ''")
        su.execute("SELECT pg_reload_conf()")
    try:
        import time
        time.sleep(0.5)
        point = '{"type":"Point","coordinates":[-73.98,40.75]}'
        with db.transaction():
            for fid in (1, 2):
                db.execute("SELECT feature_outbox.edit_feature('doomed', %s, %s, 'created')", (fid, point))
                db.execute("SELECT feature_outbox.edit_feature('renamed', %s, %s, 'created')", (fid, point))
                db.execute("SELECT feature_outbox.edit_feature(%s, %s, 'created')", (700 + fid, point))
                db.execute("SELECT feature_outbox.edit_feature('parcels', %s, %s, 'created')", (700 + fid, BLOCK_A))
        # The DDL guard refuses both. With it off (a superuser's repair; single-user mode, where event
        # triggers do not fire) they go through, and the relay must cope.
        assert fails(db, "DROP TABLE public.doomed")[0] == "2BP01"
        db.execute("SET feature_outbox.ddl_guard = off")
        db.execute("DROP TABLE public.doomed")
        db.execute("ALTER TABLE public.renamed RENAME COLUMN note TO remark")
        db.execute("RESET feature_outbox.ddl_guard")
    finally:
        with relay.connect() as su:
            su.execute(f"ALTER SYSTEM SET feature_outbox.endpoint = '{nats_server.url}'")
            su.execute("SELECT pg_reload_conf()")
    # Both layers are held: their rows wait, unpublished and never parked, and backlog_by_layer says why.
    held = lambda: dict(db.execute("""SELECT layer, held_reason FROM feature_outbox.backlog_by_layer
                                        WHERE layer IN ('doomed', 'renamed') AND held_since IS NOT NULL""").fetchall())
    reasons = wait_for(lambda: len(held()) == 2 and held(), 20, "the two layers to be held")
    assert "was dropped" in reasons["doomed"] and "release_layer('doomed')" in reasons["doomed"], reasons
    assert "note" in reasons["renamed"] and "release_layer('renamed')" in reasons["renamed"], reasons
    # The other layers kept flowing.
    ok = db.execute("""SELECT count(*) FROM feature_outbox.outbox WHERE feature_id IN (701, 702)
                        AND layer IN ('features', 'parcels') AND published_at IS NOT NULL""").fetchone()[0]
    assert ok == 4
    db.execute("SELECT feature_outbox.edit_feature('parcels', 703, %s, 'created')", (BLOCK_A,))
    wait_for(lambda: db.execute("SELECT published_at IS NOT NULL FROM feature_outbox.outbox WHERE layer = 'parcels' "
                                "AND feature_id = 703").fetchone()[0], 20, "a later edit of another layer to publish")
    waiting = db.execute("""SELECT layer, count(*), sum(row_failures), count(parked_at), count(published_at) FROM feature_outbox.outbox
                             WHERE layer IN ('doomed', 'renamed') GROUP BY layer ORDER BY layer""").fetchall()
    assert waiting == [("doomed", 2, 0, 0, 0), ("renamed", 2, 0, 0, 0)], "held rows are neither failed nor parked"
    by_layer = {r[0]: r[1:] for r in db.execute("""SELECT layer, unpublished_rows, failing_rows, parked_rows
                                                     FROM feature_outbox.backlog_by_layer""").fetchall()}
    assert by_layer["doomed"] == (2, 0, 0) and by_layer["renamed"] == (2, 0, 0)
    # unregister_layer refuses while they wait; the events are the only copy.
    assert fails(db, "SELECT feature_outbox.unregister_layer('doomed')")[0] == "55006"
    # A release before the table is right again is refused and changes nothing.
    state, _, hint = fails(db, "SELECT feature_outbox.release_layer('doomed')")
    assert state == "42P01" and "release_layer('doomed', 'schema.table')" in hint, hint
    assert fails(db, "SELECT feature_outbox.release_layer('renamed')")[0] == "42804"
    # The recovery the README gives: put the column back, or restore the table, then release.
    db.execute("ALTER TABLE public.renamed RENAME COLUMN remark TO note")
    db.execute("UPDATE public.renamed SET note = 'kept' WHERE id = 1")
    assert db.execute("SELECT feature_outbox.release_layer('renamed')").fetchone()[0] == 2
    db.execute("CREATE TABLE public.doomed (id bigint PRIMARY KEY, geom geometry(Point, 4326), version integer NOT NULL DEFAULT 0, note text)")
    db.execute("INSERT INTO public.doomed VALUES (1, ST_SetSRID(ST_MakePoint(-73.98, 40.75), 4326), 1, 'restored')")
    assert db.execute("SELECT feature_outbox.release_layer('doomed', 'public.doomed')").fetchone()[0] == 2
    wait_for(lambda: db.execute("SELECT count(*) FROM feature_outbox.outbox WHERE layer IN ('doomed', 'renamed') "
                                "AND published_at IS NOT NULL").fetchone()[0] == 4, 20, "the released rows to publish")
    assert not held()
    [r1] = events(nats_server, "renamed", 1)
    assert r1["event"]["properties"] == {"note": "kept"} and r1["event"]["geometry"]["coordinates"] == [-73.98, 40.75]
    [d1] = events(nats_server, "doomed", 1)
    assert d1["event"]["properties"] == {"note": "restored"} and d1["event"]["geometry_version"] == 1
    [d2] = events(nats_server, "doomed", 2)
    assert d2["event"]["geometry"] is None and d2["event"]["properties"] is None, "a feature the restored table lacks"
    # Published, the layer may go.
    db.execute("SELECT feature_outbox.unregister_layer('doomed')")


def test_counties_into_conus_albers_route_as_the_reference(relay):
    from test_real_data import FIXTURE, read_counties
    counties = read_counties()
    with open(FIXTURE, newline="") as f:
        reference = {r["fips"]: r["routing_key"] for r in csv.DictReader(f)}
    relay.create_db("layers_counties")
    with relay.connect("layers_counties") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute("CREATE TABLE counties (fips integer PRIMARY KEY, geom geometry(Geometry, 5070) NOT NULL,"
                     " version integer NOT NULL DEFAULT 0, name text)")
        conn.execute("SELECT feature_outbox.register_layer('counties', 'counties', 'fips', properties => '{name}')")
        names = {json.loads(l)["id"]: json.loads(l)["name"] for l in county_data().read_text().splitlines() if l.strip()}
        # CONUS Albers covers the 48 contiguous states. Alaska (02), Hawaii (15) and the territories
        # (60, 66, 69, 72, 78) lie outside its area of use, so a later edit given in EPSG:5070 would be refused: they are
        # refused at create too (issue 20, item 2), one by one, with nothing written.
        outside = {"02", "15", "60", "66", "69", "72", "78"}
        conus = [(f, t) for f, t in counties if f[:2] not in outside]
        for i in range(0, len(conus), 500):
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany("SELECT feature_outbox.edit_feature('counties', %s, %s, 'created', %s)",
                                [(int(fips), text, json.dumps({"name": names[fips]})) for fips, text in conus[i:i + 500]])
        refused = {}
        for fips, text in counties:
            if fips[:2] in outside:
                with pytest.raises(psycopg.Error) as e, conn.transaction():
                    conn.execute("SELECT feature_outbox.edit_feature('counties', %s, %s, 'created')", (int(fips), text))
                refused[fips] = (e.value.sqlstate, "EPSG:5070" in e.value.diag.message_primary)
        assert len(refused) > 30 and set(refused.values()) == {("22023", True)}
        got = dict(conn.execute("SELECT lpad(feature_id::text, 5, '0'), routing_key FROM feature_outbox.outbox WHERE layer = 'counties'").fetchall())
        assert len(got) == len(conus) and len(counties) == len(reference)
        assert sorted(f for f, _ in conus if reference[f] != got.get(f)) == []
        srid, named = conn.execute("SELECT min(ST_SRID(geom)), count(*) FILTER (WHERE name IS NOT NULL) FROM counties").fetchone()
        assert srid == 5070 and named == len(conus)


def test_the_relay_reads_a_layer_as_its_owner_with_its_own_search_path(relay, db, nats_server):
    """Code a table's owner controls (here a cast to json, which to_jsonb uses) runs as that owner in
    the relay, never as the relay's superuser; and a schema named after the relay's role cannot
    shadow PostGIS."""
    with relay.connect(DB) as su:
        if su.execute("SELECT 1 FROM pg_roles WHERE rolname = 'moody'").fetchone():
            su.execute("DROP OWNED BY moody")
            su.execute("DROP ROLE moody")
        su.execute("CREATE ROLE moody LOGIN")
        su.execute("GRANT CREATE ON SCHEMA public TO moody")
        su.execute("GRANT EXECUTE ON FUNCTION feature_outbox.register_layer(text, regclass, name, name, name, name[], name), feature_outbox.unregister_layer(text) TO moody")
        su.execute("GRANT EXECUTE ON FUNCTION feature_outbox.edit_feature(text, bigint, text, text, jsonb) TO moody")
        # A trap for the relay's search_path ("$user" comes first): it would null every geometry.
        su.execute("DROP SCHEMA IF EXISTS postgres CASCADE")
        su.execute("CREATE SCHEMA postgres")
        su.execute("CREATE FUNCTION postgres.st_transform(geometry, integer) RETURNS geometry LANGUAGE sql AS 'SELECT NULL::geometry'")
        su.execute("CREATE FUNCTION postgres.st_asbinary(geometry) RETURNS bytea LANGUAGE sql AS 'SELECT NULL::bytea'")
    try:
        with psycopg.connect(relay.dsn(DB).replace("user=postgres", "user=moody"), autocommit=True) as m:
            m.execute("CREATE TYPE public.mood AS ENUM ('calm', 'cross')")
            m.execute("CREATE TABLE public.moods_seen (who name)")
            m.execute("""CREATE FUNCTION public.mood_json(public.mood) RETURNS json LANGUAGE plpgsql AS
                         $$ BEGIN INSERT INTO public.moods_seen VALUES (current_user); RETURN to_json($1::text); END $$""")
            m.execute("CREATE CAST (public.mood AS json) WITH FUNCTION public.mood_json(public.mood)")
            m.execute("CREATE TABLE public.moody_places (id int PRIMARY KEY, geom geometry(Point, 4326) NOT NULL,"
                      " version int NOT NULL DEFAULT 0, mood public.mood)")
            m.execute("SELECT feature_outbox.register_layer('moody', 'public.moody_places', properties => '{mood}')")
            m.execute("""SELECT feature_outbox.edit_feature('moody', 1, '{"type":"Point","coordinates":[3,4]}', 'created', '{"mood": "calm"}')""")
        wait_for(lambda: relayed(db), 20, "the relay to publish the moody event")
        [event] = [m["event"] for m in nats_server.messages() if m["event"]["layer"] == "moody"]
        assert event["properties"] == {"mood": "calm"}
        assert event["geometry"] == {"type": "Point", "coordinates": [3, 4]}
        seen = {w for (w,) in db.execute("SELECT who FROM public.moods_seen").fetchall()}
        assert seen == {"moody"}, seen
    finally:
        db.execute("DROP SCHEMA IF EXISTS postgres CASCADE")


def test_a_reused_layer_name_never_publishes_an_older_layers_rows(relay, db, nats_server):
    point = '{"type":"Point","coordinates":[5,6]}'
    db.execute("CREATE TABLE public.first_home (id int PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version int NOT NULL DEFAULT 0)")
    db.execute("CREATE TABLE public.second_home (id int PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version int NOT NULL DEFAULT 0, tag text)")
    db.execute("SELECT feature_outbox.register_layer('homes', 'public.first_home')")
    db.execute("SELECT feature_outbox.edit_feature('homes', 1, %s, 'created')", (point,))
    wait_for(lambda: relayed(db), 20, "the first home's event")
    # Its row is republished by hand (as a parked row requeued by retry_parked() would be), after the
    # name moved to another table.
    db.execute("SELECT feature_outbox.unregister_layer('homes')")
    db.execute("SELECT feature_outbox.register_layer('homes', 'public.second_home', properties => '{tag}')")
    db.execute("INSERT INTO public.second_home VALUES (1, 'SRID=4326;POINT(50 60)', 77, 'unrelated')")
    with db.transaction():
        db.execute("UPDATE feature_outbox.outbox SET published_at = NULL WHERE layer = 'homes'")
        # As retry_parked() does: the row is below the claim's low-water mark, and the relay sleeps.
        db.execute("SELECT feature_outbox._relay_low_water_reset(), feature_outbox._wake_relay_at_commit()")
    parked = wait_for(lambda: db.execute("SELECT last_error FROM feature_outbox.outbox WHERE layer = 'homes' AND parked_at IS NOT NULL").fetchone(),
                      20, "the older layer's row to park")
    assert "earlier layer" in parked[0]
    assert not [m for m in nats_server.messages() if m["event"]["layer"] == "homes" and m["event"]["geometry_version"] == 77]
