"""Layers under a real team's use (issue 20): each numbered item of the issue, as it went wrong in
0.2.0, now goes right. A cluster whose relay publishes to a real nats-server; the county polygons of
the shared data; real roles for the privilege checks. Items 2 (one area-of-use rule) and 7 (the DDL
guard), and the SRID hint of item 9, are SQL regression files: pg_test/sql/18_layer_srid,
12_ddl_guard and 07_register_mistakes."""

import json
import re
import time

import psycopg
import pytest

from conftest import ROOT, county_data
from relay_harness import nats_fixture, relay_cluster, wait_for

DB = "integrity"

nats_server = nats_fixture("nats_integrity")


@pytest.fixture(scope="module")
def relay(nats_server):
    c = relay_cluster("integrity", DB, "feature_outbox.poll_interval = '60s'",
                      "feature_outbox.retry_backoff_min = '100ms'", "feature_outbox.retry_backoff_max = '60s'",
                      f"feature_outbox.endpoint = '{nats_server.url}'")
    yield c
    c.stop()


@pytest.fixture
def db(relay):
    with relay.connect(DB) as conn:
        yield conn


def fails(conn, sql, params=()):
    """(SQLSTATE, message, hint) of a statement that must fail; nothing it did stays."""
    with pytest.raises(psycopg.Error) as e:
        with conn.transaction():
            conn.execute(sql, params)
    return e.value.sqlstate, e.value.diag.message_primary, e.value.diag.message_hint


def counties(prefix: str, n: int) -> list[dict]:
    """The first n counties whose FIPS code starts with `prefix` (a state), as read from the county data."""
    out = []
    with open(county_data()) as f:
        for line in f:
            c = json.loads(line)
            if c["id"].startswith(prefix):
                out.append(c)
                if len(out) == n:
                    break
    return out


def published(conn) -> bool:
    return conn.execute("SELECT NOT EXISTS (SELECT 1 FROM feature_outbox.outbox WHERE published_at IS NULL AND parked_at IS NULL)").fetchone()[0]


# Item 3: lossless promotion.
def test_a_polygon_into_a_multipolygon_column_is_promoted(db, nats_server):
    db.execute("CREATE TABLE public.multi (id bigint PRIMARY KEY, geom geometry(MultiPolygon, 5070) NOT NULL, version int NOT NULL DEFAULT 0)")
    db.execute("SELECT feature_outbox.register_layer('multi', 'public.multi')")
    rows = counties("20", 200)  # Kansas: all single polygons
    singles = [c for c in rows if c["geometry"]["type"] == "Polygon"]
    assert len(singles) > 50
    for c in singles:
        db.execute("SELECT feature_outbox.edit_feature('multi', %s, %s::text, 'created')", (int(c["id"]), json.dumps(c["geometry"])))
    assert db.execute("SELECT DISTINCT GeometryType(geom) FROM public.multi").fetchall() == [("MULTIPOLYGON",)]
    # Same shape: ST_Multi adds nothing and loses nothing.
    assert db.execute("""SELECT bool_and(ST_Equals(ST_GeometryN(geom, 1),
                                 ST_Transform(ST_SetSRID(ST_GeomFromGeoJSON(%s), 4326), 5070)))
                           FROM public.multi WHERE id = %s""", (json.dumps(singles[0]["geometry"]), int(singles[0]["id"]))).fetchone()[0]
    wait_for(lambda: published(db), 20, "the relay to publish")
    events = [m["event"] for m in nats_server.messages() if m["event"]["layer"] == "multi"]
    assert len(events) == len(singles)
    assert {e["geometry"]["type"] for e in events} == {"MultiPolygon"}, "the event carries the geometry as stored"
    # A type that has no lossless promotion is still refused.
    state, message, _ = fails(db, "SELECT feature_outbox.edit_feature('multi', 1, '{\"type\":\"Point\",\"coordinates\":[-98,38]}', 'created')")
    assert state == "22023" and "MultiPolygon" in message


# Item 4: a re-registered layer name.
def test_a_re_registered_layer_is_told_apart_by_its_registration_id(db, nats_server):
    point = '{"type":"Point","coordinates":[-98.5,38.5]}'
    db.execute("CREATE TABLE public.old_sites (id int PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version int NOT NULL DEFAULT 0)")
    db.execute("CREATE TABLE public.new_sites (id int PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version int NOT NULL DEFAULT 0)")
    db.execute("SELECT feature_outbox.register_layer('sites', 'public.old_sites')")
    [(first,)] = db.execute("SELECT registration_id FROM feature_outbox.layers WHERE layer = 'sites'").fetchall()
    for v in range(3):
        db.execute(f"SELECT feature_outbox.edit_feature('sites', 1, %s, '{'created' if v == 0 else 'moved'}')", (point,))
    wait_for(lambda: published(db), 20, "the old table's events")
    db.execute("SELECT feature_outbox.unregister_layer('sites')")
    db.execute("SELECT feature_outbox.register_layer('sites', 'public.new_sites')")
    [(second,)] = db.execute("SELECT registration_id FROM feature_outbox.layers WHERE layer = 'sites'").fetchall()
    assert second > first
    db.execute("SELECT feature_outbox.edit_feature('sites', 1, %s, 'created')", (point,))
    wait_for(lambda: published(db), 20, "the new table's event")
    events = [m["event"] for m in nats_server.messages() if m["event"]["layer"] == "sites"]
    assert [(e["registration_id"], e["event_version"]) for e in events] == [(first, 1), (first, 2), (first, 3), (second, 1)]
    # The README's version rule, keyed as it says: the new table's created is not stale.
    highest = {}
    kept = []
    for e in events:
        key = (e["layer"], e["registration_id"], e["feature_id"])
        if e["event_version"] > highest.get(key, 0):
            highest[key] = e["event_version"]
            kept.append(e)
    assert kept == events


# Item 9: failing_rows counts row-level failures only, and the drain starts within 2 s of NATS.
def test_a_nats_outage_is_no_row_failure_and_the_drain_starts_within_two_seconds(relay, db, nats_server):
    nats_server.stop()
    try:
        point = '{"type":"Point","coordinates":[-97,39]}'
        db.execute("SELECT feature_outbox.edit_feature(900001, %s, 'created')", (point,))
        # Long enough for the backoff to grow well past 2 s (100 ms floor, doubling, 60 s cap).
        wait_for(lambda: db.execute("SELECT sum(failed_attempts) FROM feature_outbox.workers").fetchone()[0] >= 7,
                 60, "the worker to fail and back off")
        [(failing, error)] = db.execute("SELECT failing_rows, relay_last_error FROM feature_outbox.backlog").fetchall()
        assert failing == 0, "a sink outage is not a row failure"
        assert error, "the outage shows as the relay's error"
        assert db.execute("SELECT state FROM feature_outbox.workers").fetchone()[0] == "backing off"
    finally:
        nats_server.start()
    back = time.monotonic()
    wait_for(lambda: published(db), 10, "the drain after NATS came back", interval=0.02)
    assert time.monotonic() - back < 2.0, f"drained {time.monotonic() - back:.2f} s after NATS answered"


# Item 9: PUBLIC's EXECUTE grants, as the README lists them.
def test_public_may_execute_exactly_what_the_readme_lists(db):
    readme = (ROOT / "README.md").read_text()
    listed = re.search(r"<!-- public-functions -->\n(.*?)<!-- /public-functions -->", readme, re.S)[1]
    documented = set(re.findall(r"`([a-z][a-z_]*\([^`]*\))`", listed))
    granted = {r[0] for r in db.execute("""
        SELECT p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')'
          FROM pg_proc p
         WHERE p.pronamespace = 'feature_outbox'::regnamespace AND p.proname !~ '^_'
           AND (p.proacl IS NULL OR EXISTS (SELECT 1 FROM aclexplode(p.proacl) a
                                             WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'))""")}
    normalized = {re.sub(r"\w+ (\w+)", r"\1", g) for g in granted}  # "g geometry" -> "geometry"
    assert normalized == documented, f"PUBLIC may execute {sorted(normalized)}; the README lists {sorted(documented)}"
    with db.transaction():
        db.execute("DROP ROLE IF EXISTS nobody_special")
        db.execute("CREATE ROLE nobody_special")
        for f in ("register_layer(text, regclass, name, name, name, name[], name)", "unregister_layer(text)", "metrics()"):
            assert not db.execute("SELECT has_function_privilege('nobody_special', %s, 'EXECUTE')",
                                  (f"feature_outbox.{f}",)).fetchone()[0], f
        assert db.execute("SELECT has_function_privilege('pg_monitor', 'feature_outbox.metrics()', 'EXECUTE')").fetchone()[0]
        assert db.execute("SELECT has_function_privilege('nobody_special', 'feature_outbox.routing_key(geometry)', 'EXECUTE')").fetchone()[0]
        db.execute("DROP ROLE nobody_special")
