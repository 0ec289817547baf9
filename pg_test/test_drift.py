"""Routing follows the geometry, and drift is shown and repaired (issue 20, items 5 and 6). A team
role owns its own table and writes it both through the product and behind it (plain UPDATE,
INSERT, DELETE); a real nats-server receives what the relay publishes, and every event is checked
against the row as committed."""

import json
import threading
import time

import psycopg
import pytest

from relay_harness import all_published, consume, nats_fixture, relay_cluster, subject, wait_for

DB = "drift"

nats_server = nats_fixture("nats_drift")

TEAM = ("DROP ROLE IF EXISTS team",
        "CREATE ROLE team IN ROLE pg_monitor",
        "CREATE SCHEMA app AUTHORIZATION team",
        "GRANT EXECUTE ON FUNCTION feature_outbox.register_layer(text, regclass, name, name, name, name[], name), "
        "feature_outbox.edit_feature(text, bigint, text, text, jsonb), feature_outbox.edit_feature(text, bigint, geometry, text, jsonb), "
        "feature_outbox.record_edit(text, bigint, text), feature_outbox.drift(text) TO team",
        "GRANT EXECUTE ON PROCEDURE feature_outbox.resync(text, integer, bigint, bigint), feature_outbox.backfill(text, geometry, bigint) TO team")


@pytest.fixture(scope="module")
def relay(nats_server):
    c = relay_cluster("drift", DB, "feature_outbox.poll_interval = '100ms'", "feature_outbox.wake_at_commit = on",
                      f"feature_outbox.endpoint = '{nats_server.url}'", setup=TEAM)
    yield c
    c.stop()


def team(relay, autocommit=True):
    conn = relay.connect(DB)
    conn.autocommit = autocommit
    conn.execute("SET ROLE team")
    return conn


def layer(conn, name: str, retired: bool = False):
    """A team table of points in EPSG:4326 with two properties, registered as layer `name`."""
    conn.execute(f"""CREATE TABLE app.{name} (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL,
                                              version integer NOT NULL DEFAULT 0, name text, seen timestamptz,
                                              area float8{', retired_at timestamptz' if retired else ''})""")
    conn.execute("SELECT feature_outbox.register_layer(%s, %s, properties => '{name,seen,area}', retired_column => %s)",
                 (name, f"app.{name}", "retired_at" if retired else None))


def create(conn, name: str, fid: int, lon: float, lat: float, label: str):
    conn.execute("SELECT feature_outbox.edit_feature(%s, %s, %s::text, 'created', %s)",
                 (name, fid, json.dumps({"type": "Point", "coordinates": [lon, lat]}),
                  json.dumps({"name": label, "seen": "2026-12-01T10:00:00.123456+00:00", "area": 0.1})))


def fails(conn, sql, params=()):
    with pytest.raises(psycopg.Error) as e:
        with conn.transaction():
            conn.execute(sql, params)
    return e.value.sqlstate, e.value.diag.message_primary, e.value.diag.message_hint


def key_of(conn, lon, lat) -> str:
    return conn.execute("SELECT feature_outbox.routing_key(ST_SetSRID(ST_MakePoint(%s, %s), 4326))", (lon, lat)).fetchone()[0]


def events_of(relay, nats_server, name: str) -> list[dict]:
    """Every message published for layer `name`, once the outbox is drained: subject and event."""
    with relay.connect(DB) as conn:
        wait_for(lambda: all_published(conn), 60, "the relay to publish every event")
    return [m for m in consume([nats_server.url], [f"features.{name}.*.>"]) if m["subject"].split(".")[2] != "departed"]


def row(conn, name: str, fid: int):
    return conn.execute(f"""SELECT version, ST_X(geom), ST_Y(geom), name, to_char(seen AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US'),
                                   area FROM app.{name} WHERE id = %s""", (fid,)).fetchone()


def drift(conn, name: str) -> dict:
    """{feature id: change} of a bigint-keyed layer (drift gives every key as text)."""
    return {int(k): v for k, v in conn.execute("SELECT feature_id, change FROM feature_outbox.drift(%s)", (name,)).fetchall()}


# Item 5: an updated whose geometry changed behind it is refused; moved routes on the new cell.
def test_an_updated_event_after_a_plain_update_of_the_geometry_is_refused(relay, nats_server):
    with team(relay) as conn:
        layer(conn, "moves")
        create(conn, "moves", 1, 13.4, 52.5, "Berlin")
        old_key = key_of(conn, 13.4, 52.5)
        # A plain UPDATE moves it 300 km west, to Hanover's longitude.
        conn.execute("UPDATE app.moves SET geom = ST_SetSRID(ST_MakePoint(9.0, 52.5), 4326) WHERE id = 1")
        state, message, hint = fails(conn, "SELECT feature_outbox.edit_feature('moves', 1, NULL::text, 'updated', '{\"name\": \"x\"}')")
        assert state == "22023" and "changed since its last event" in message, message
        assert "moved" in hint and "resync" in hint, hint
        assert row(conn, "moves", 1)[3] == "Berlin", "the refused edit wrote nothing"
        # The ORM path: the application writes the row itself, then records an updated event.
        with pytest.raises(psycopg.Error) as e:
            with conn.transaction():
                conn.execute("UPDATE app.moves SET name = 'Hanover', geom = ST_SetSRID(ST_MakePoint(9.7, 52.4), 4326) WHERE id = 1")
                conn.execute("SELECT feature_outbox.record_edit('moves', 1, 'updated')")
        assert e.value.sqlstate == "22023" and "record_edit('moves', 1, 'moved')" in e.value.diag.message_hint
        # Recorded as moved, it is accepted and routed on the geometry the row holds.
        with conn.transaction():
            conn.execute("UPDATE app.moves SET name = 'Hanover', geom = ST_SetSRID(ST_MakePoint(9.7, 52.4), 4326) WHERE id = 1")
            conn.execute("SELECT feature_outbox.record_edit('moves', 1, 'moved')")
        new_key = key_of(conn, 9.7, 52.4)
        assert new_key != old_key
        # A later updated, with the geometry unchanged since, is accepted.
        conn.execute("SELECT feature_outbox.edit_feature('moves', 1, NULL::text, 'updated', '{\"name\": \"Hannover\"}')")
    got = events_of(relay, nats_server, "moves")
    assert [(m["event"]["action"], m["event"]["routing_key"], m["event"]["previous_routing_key"]) for m in got] == [
        ("created", old_key, None), ("moved", new_key, old_key), ("updated", new_key, new_key)]
    for m in got:
        assert m["subject"] == subject("moves", m["event"]["action"], m["event"]["routing_key"])
    # A subscriber of Hanover's cell hears of the feature when it arrives there, with its content.
    moved = got[1]["event"]
    assert moved["geometry"] == {"type": "Point", "coordinates": [9.7, 52.4]}
    assert moved["properties"]["name"] in ("Hanover", "Hannover") and moved["geometry_version"] >= moved["event_version"]
    # backfill routes on the geometry too, also for a row moved behind the product since.
    with team(relay) as conn:
        conn.execute("UPDATE app.moves SET geom = ST_SetSRID(ST_MakePoint(8.7, 50.1), 4326) WHERE id = 1")
        conn.execute("CALL feature_outbox.backfill('moves')")
        frankfurt = key_of(conn, 8.7, 50.1)
    [snapshot] = [m for m in events_of(relay, nats_server, "moves") if m["event"]["action"] == "snapshot"]
    assert snapshot["event"]["routing_key"] == frankfurt and snapshot["subject"] == subject("moves", "snapshot", frankfurt)
    assert snapshot["event"]["geometry"] == {"type": "Point", "coordinates": [8.7, 50.1]}


# Item 6: drift lists what changed behind the product, and resync writes the missing events.
def test_drift_shows_every_write_outside_the_product_and_resync_sends_its_events(relay, nats_server):
    with team(relay) as conn:
        layer(conn, "plots", retired=True)
        for fid in range(1, 8):
            create(conn, "plots", fid, 2.0 + fid / 10, 48.0, f"plot {fid}")
        keys = {fid: key_of(conn, 2.0 + fid / 10, 48.0) for fid in range(1, 8)}
        assert drift(conn, "plots") == {}
        # Digests do not depend on the session's settings: the same rows, printed another way.
        conn.execute("SET TimeZone = 'Asia/Kolkata'; SET extra_float_digits = -3; SET DateStyle = 'German'")
        assert drift(conn, "plots") == {}
        conn.execute("RESET TimeZone; RESET extra_float_digits; RESET DateStyle")
        # Writes behind the product, one of each kind.
        conn.execute("UPDATE app.plots SET geom = ST_SetSRID(ST_MakePoint(-3.7, 40.4), 4326) WHERE id = 1")  # geometry
        conn.execute("UPDATE app.plots SET name = 'renamed' WHERE id = 2")                                   # properties
        conn.execute("UPDATE app.plots SET seen = seen + interval '1 second', geom = ST_SetSRID(ST_MakePoint(12.5, 41.9), 4326) WHERE id = 3")
        conn.execute("DELETE FROM app.plots WHERE id = 4")
        conn.execute("UPDATE app.plots SET retired_at = now() WHERE id = 5")
        conn.execute("INSERT INTO app.plots (id, geom, version, name, area) VALUES (8, ST_SetSRID(ST_MakePoint(4.9, 52.4), 4326), 0, 'new', 2.5)")
        conn.execute("UPDATE app.plots SET version = version WHERE id = 6")  # a write that changes nothing an event carries
        assert drift(conn, "plots") == {1: "geometry", 2: "properties", 3: "both", 4: "gone", 5: "gone", 8: "no_event"}
        assert conn.execute("SELECT drifted_rows, drift_checked_at > now() - interval '1 minute' FROM feature_outbox.backlog_by_layer "
                            "WHERE layer = 'plots'").fetchone() == (6, True)
        expected_rows = {fid: row(conn, "plots", fid) for fid in (1, 2, 3, 8)}
        written, left = conn.execute("CALL feature_outbox.resync('plots')").fetchone()
        assert (written, left) == (6, 0)
        assert drift(conn, "plots") == {}
        assert conn.execute("SELECT drifted_rows FROM feature_outbox.backlog_by_layer WHERE layer = 'plots'").fetchone()[0] == 0
        current = {fid: row(conn, "plots", fid) for fid in (1, 2, 3, 8)}
        assert conn.execute("CALL feature_outbox.resync('plots')").fetchone() == (0, 0), "a second run writes nothing"
        spain, rome, amsterdam = key_of(conn, -3.7, 40.4), key_of(conn, 12.5, 41.9), key_of(conn, 4.9, 52.4)
    messages = events_of(relay, nats_server, "plots")
    got = {(m["event"]["feature_id"], m["event"]["action"]): m["event"] for m in messages}
    # resync's events say so, in the body and beside it; the edits before it were the application's.
    origins = {(m["event"]["feature_id"], m["event"]["action"]): (m["event"]["origin"], m["headers"]["Feature-Origin"]) for m in messages}
    assert origins == {**{(str(fid), "created"): ("application",) * 2 for fid in range(1, 8)},
                       **{k: ("resync",) * 2 for k in [("1", "moved"), ("2", "updated"), ("3", "moved"), ("4", "retired"),
                                                      ("5", "retired"), ("8", "created")]}}
    e = got[("1", "moved")]
    assert (e["routing_key"], e["previous_routing_key"]) == (spain, keys[1])
    assert e["geometry"] == {"type": "Point", "coordinates": [-3.7, 40.4]} and e["event_version"] == current[1][0] == 2
    e = got[("2", "updated")]
    assert (e["routing_key"], e["previous_routing_key"], e["properties"]["name"]) == (keys[2], keys[2], "renamed")
    e = got[("3", "moved")]
    assert (e["routing_key"], e["previous_routing_key"]) == (rome, keys[3])
    assert e["properties"]["seen"].startswith("2026-12-01T10:00:01.123456"), e["properties"]
    for fid in (4, 5):
        e = got[(str(fid), "retired")]
        assert (e["routing_key"], e["event_version"]) == (keys[fid], 2)
    assert got[("4", "retired")]["geometry"] is None, "a deleted row's event has no content"
    e = got[("8", "created")]
    assert (e["routing_key"], e["previous_routing_key"], e["event_version"]) == (amsterdam, None, 1)
    assert e["geometry"] == {"type": "Point", "coordinates": [4.9, 52.4]} and e["properties"]["area"] == 2.5
    assert ("6", "updated") not in got and ("7", "updated") not in got
    for fid, r in current.items():
        assert r[1:] == expected_rows[fid][1:], "resync changes only the version column"


def test_resync_works_in_chunks_an_editor_does_not_wait_out(relay):
    """3,000 drifted rows: an edit of the last one, started with resync, commits long before resync
    ends, because each chunk commits within max_hold_ms."""
    with team(relay) as conn:
        layer(conn, "bulk")
        conn.execute("""SELECT feature_outbox.edit_feature('bulk', i, ST_SetSRID(ST_MakePoint(i % 300 - 150, i % 140 - 70), 4326),
                                                          'created', jsonb_build_object('name', 'b' || i))
                          FROM generate_series(1, 3000) i""")
        conn.execute("UPDATE app.bulk SET name = name || '?'")
        assert len(drift(conn, "bulk")) == 3000
        done = {}

        def run():
            with team(relay) as c:
                done["resync"] = c.execute("CALL feature_outbox.resync('bulk', 50)").fetchone()
                done["resync_at"] = time.monotonic()

        t = threading.Thread(target=run)
        t.start()
        waits = []
        with team(relay) as editor:
            while t.is_alive():
                started = time.monotonic()
                editor.execute("SELECT feature_outbox.edit_feature('bulk', 3000, NULL::text, 'updated', '{\"name\": \"edited\"}')")
                waits.append(time.monotonic() - started)
                time.sleep(0.02)
        t.join()
        print(f"resync of 3,000 rows: {len(waits)} edits of a drifted row meanwhile, longest {max(waits) * 1000:.0f} ms")
        written, left = done["resync"]
        assert written + left in (3000, 2999) and left <= 1
        assert len(waits) > 1, "the edit went through while resync ran"
        assert drift(conn, "bulk") == {}
