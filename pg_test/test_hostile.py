"""Hostile input at the SQL level (issue 13): the saved corpus (fixtures/hostile_corpus.jsonl) replayed
through edit_feature, a 1,000,000-vertex polygon, feature ids at the bigint limits and a 1 MB property
through NATS, and eight connections creating the same id. Each input either writes a complete edit
(feature, state and one outbox row) or raises a class-22 error and writes nothing; the backend never
crashes. Values that must never reach a NATS subject (event types, layer names, subject prefixes)
and what an ordinary role may not do are SQL regression files: pg_test/sql/07_register_mistakes,
22_settings, 15_privileges_layers, 24_backfill, 25_retry_parked, 26_monitoring and 27_secrets."""

import json
import threading
from pathlib import Path

import psycopg
import pytest

from relay_harness import nats_fixture, relay_cluster, wait_for

DB = "hostile"
CORPUS = Path(__file__).parent / "fixtures" / "hostile_corpus.jsonl"


nats_server = nats_fixture("nats_hostile")


@pytest.fixture(scope="module")
def relay(nats_server):
    c = relay_cluster("hostile", DB, f"feature_outbox.endpoint = '{nats_server.url}'", setup=(
        "CREATE TABLE public.notes (id bigint PRIMARY KEY, geom geometry(Geometry, 4326), version integer NOT NULL DEFAULT 0, body text)",
        "SELECT feature_outbox.register_layer('notes', 'public.notes', properties => '{body}')"))
    yield c
    c.stop()


@pytest.fixture
def db(relay):
    with relay.connect(DB) as conn:
        yield conn


def counts(conn):
    return conn.execute("""SELECT (SELECT count(*) FROM feature_outbox.outbox), (SELECT count(*) FROM feature_outbox.features),
                                  (SELECT count(*) FROM feature_outbox.feature_state), (SELECT count(*) FROM public.notes)""").fetchone()


def attempt(conn, sql, params):
    """Runs one edit in a savepoint: ('ok', rows written) or (SQLSTATE, message)."""
    before = counts(conn)
    try:
        with conn.transaction():
            conn.execute(sql, params)
    except psycopg.Error as e:
        assert counts(conn) == before, f"a failed edit wrote rows: {e.sqlstate} {e}"
        return e.sqlstate, str(e)
    after = counts(conn)
    return "ok", tuple(a - b for a, b in zip(after, before))


def test_the_saved_corpus_writes_whole_edits_or_class_22_errors(relay, db):
    lines = [json.loads(l) for l in CORPUS.read_text().splitlines()]
    outcomes = {"ok": 0, "22": 0}
    for i, case in enumerate(lines):
        fid = 10_000 + i
        if case["kind"] == "geojson":
            got = attempt(db, "SELECT feature_outbox.edit_feature(%s, %s, 'created')", (fid, case["input"]))
        else:
            wkb = bytes.fromhex(case["input"])
            try:
                db.execute("SELECT ST_GeomFromEWKB(%s)", (wkb,))
            except psycopg.Error:
                continue  # PostGIS itself refuses to build it: it never reaches edit_feature
            got = attempt(db, "SELECT feature_outbox.edit_feature(%s, ST_GeomFromEWKB(%s), 'created')", (fid, wkb))
        if got[0] == "ok":
            assert got[1] == (1, 1, 1, 0), (case, got)  # one outbox row, the feature, its state
            outcomes["ok"] += 1
        else:
            assert got[0].startswith("22"), (case, got)
            outcomes["22"] += 1
    assert outcomes["ok"] > 100 and outcomes["22"] > 300, outcomes
    # The backend that took all of it is the one that answers now, and no backend crashed.
    assert db.execute("SELECT 1").fetchone()[0] == 1
    assert "terminated by signal" not in relay.log() and "PANIC" not in relay.log()


def test_a_million_vertex_polygon_through_both_forms(db):
    ring = """SELECT ST_MakePolygon(ST_AddPoint(l, ST_StartPoint(l))) FROM (
                SELECT ST_MakeLine(ST_SetSRID(ST_MakePoint(10 + cos(a), 50 + sin(a)), 4326) ORDER BY i) l
                  FROM (SELECT i, i * 2 * pi() / 1000000 a FROM generate_series(0, 999999) i) s) r"""
    got = attempt(db, f"SELECT feature_outbox.edit_feature(1, ({ring}), 'created')", ())
    assert got == ("ok", (1, 1, 1, 0))
    got = attempt(db, f"SELECT feature_outbox.edit_feature(2, ST_AsGeoJSON(({ring}), 15), 'created')", ())
    assert got == ("ok", (1, 1, 1, 0))
    assert db.execute("SELECT ST_NPoints(geom) FROM feature_outbox.features WHERE id = 2").fetchone()[0] == 1_000_001


def test_bigint_limits_and_a_megabyte_property_reach_nats(relay, db, nats_server):
    for fid in (9223372036854775807, -9223372036854775808, 0):
        assert attempt(db, "SELECT feature_outbox.edit_feature(%s, '{\"type\":\"Point\",\"coordinates\":[1,2]}', 'created')", (fid,))[0] == "ok"
    # A 1 MB property: written, and relayed (its event is over max_payload, so its geometry goes by
    # reference and the event itself is refused by the server: parked, visible, never lost).
    body = "é" * 500_000
    assert attempt(db, "SELECT feature_outbox.edit_feature('notes', 1, '{\"type\":\"Point\",\"coordinates\":[1,2]}', 'created', %s)",
                   (json.dumps({"body": body}),))[0] == "ok"
    wait_for(lambda: db.execute("SELECT count(*) FROM feature_outbox.outbox WHERE published_at IS NULL AND parked_at IS NULL").fetchone()[0] == 0,
             60, "the relay to publish or park everything")
    got = {m["event"]["feature_id"] for m in nats_server.messages()}
    assert {"9223372036854775807", "-9223372036854775808", "0"} <= got
    big = db.execute("SELECT published_at IS NOT NULL, parked_at IS NOT NULL, last_error FROM feature_outbox.outbox WHERE layer = 'notes' AND feature_id = 1").fetchone()
    assert big[0] or (big[1] and "max_payload" in big[2]), big


def test_eight_connections_creating_one_id_one_wins(relay):
    results, barrier = [], threading.Barrier(8)

    def create(i):
        with psycopg.connect(relay.dsn(DB)) as conn:
            barrier.wait()
            try:
                conn.execute("SELECT feature_outbox.edit_feature('notes', 777, %s, 'created')",
                             (f'{{"type":"Point","coordinates":[{i},{i}]}}',))
                conn.commit()
                results.append("ok")
            except psycopg.Error as e:
                results.append(e.sqlstate)
    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["23505"] * 7 + ["ok"]
    with relay.connect(DB) as conn:
        assert conn.execute("SELECT count(*) FROM feature_outbox.outbox WHERE layer = 'notes' AND feature_id = 777").fetchone()[0] == 1
