"""uuid and text keys (issue 20, item 8). Two application tables, one keyed by uuid and one by
text, go through every path: edit_feature, the ORM's own write followed by record_edit, backfill,
drift and resync, with four relay workers. Events carry the key exactly as the application stores
it, each feature's events arrive in version order, and their content is the row."""

import json
import threading
import uuid

import psycopg
import pytest

from relay_harness import all_published, nats_fixture, relay_cluster, wait_for

DB = "keys"

nats_server = nats_fixture("nats_keys")

TABLES = ("CREATE SCHEMA app",
          """CREATE TABLE app.sites (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), geom geometry(Point, 4326) NOT NULL,
                                     version integer NOT NULL DEFAULT 0, name text)""",
          """CREATE TABLE app.stops (code varchar(32) PRIMARY KEY, geom geometry(Point, 4326) NOT NULL,
                                     version integer NOT NULL DEFAULT 0, name text, retired_at timestamptz)""",
          "SELECT feature_outbox.register_layer('sites', 'app.sites', properties => '{name}')",
          "SELECT feature_outbox.register_layer('stops', 'app.stops', id_column => 'code', properties => '{name}', retired_column => 'retired_at')")


@pytest.fixture(scope="module")
def relay(nats_server):
    c = relay_cluster("keys", DB, "feature_outbox.relay_workers = 4", "feature_outbox.wake_at_commit = on",
                      "feature_outbox.poll_interval = '100ms'", f"feature_outbox.endpoint = '{nats_server.url}'", setup=TABLES)
    yield c
    c.stop()


def point(lon, lat) -> str:
    return json.dumps({"type": "Point", "coordinates": [lon, lat]})


def events(relay, nats_server, layer: str) -> list[dict]:
    with relay.connect(DB) as conn:
        wait_for(lambda: all_published(conn), 60, "the relay to publish every event")
    return [m for m in nats_server.messages() if m["event"]["layer"] == layer]


def rows(conn, table: str, key: str) -> dict:
    return {str(k): (v, [x, y], n) for k, v, x, y, n in conn.execute(
        f"SELECT {key}, version, ST_X(geom), ST_Y(geom), name FROM app.{table}")}


def test_a_uuid_keyed_layer_through_every_path(relay, nats_server):
    ids = [uuid.uuid4() for _ in range(3)]
    with relay.connect(DB) as conn:
        # edit_feature: a uuid given as uuid, and as text in capitals (one key, however it is spelt).
        conn.execute("SELECT feature_outbox.edit_feature('sites', %s, %s::text, 'created', '{\"name\": \"a\"}')", (ids[0], point(10, 50)))
        conn.execute("SELECT feature_outbox.edit_feature('sites', %s::text, %s::text, 'moved')", (str(ids[0]).upper(), point(11, 50)))
        conn.execute("SELECT feature_outbox.edit_feature('sites', %s, NULL::text, 'updated', '{\"name\": \"a2\"}')", (ids[0],))
        # The ORM writes the row itself (its default draws the uuid), then records the event.
        with conn.transaction():
            [(orm_id,)] = conn.execute("INSERT INTO app.sites (geom, name) VALUES ('SRID=4326;POINT(12 51)', 'orm') RETURNING id").fetchall()
            assert conn.execute("SELECT feature_outbox.record_edit('sites', %s, 'created')", (orm_id,)).fetchone()[0] == 1
        with conn.transaction():
            conn.execute("UPDATE app.sites SET geom = 'SRID=4326;POINT(12.5 51)' WHERE id = %s", (orm_id,))
            assert conn.execute("SELECT feature_outbox.record_edit('sites', %s, 'moved')", (orm_id,)).fetchone()[0] == 2
        # A key that is not a uuid: 22P02, nothing written.
        before = conn.execute("SELECT count(*) FROM feature_outbox.outbox").fetchone()[0]
        with pytest.raises(psycopg.Error) as e:
            conn.execute("SELECT feature_outbox.edit_feature('sites', 'parcel-7', %s::text, 'created')", (point(1, 1),))
        assert e.value.sqlstate == "22P02"
        assert conn.execute("SELECT count(*) FROM feature_outbox.outbox").fetchone()[0] == before
        # Rows written before: backfill snapshots them, under their own keys.
        conn.execute("INSERT INTO app.sites (id, geom, name) VALUES (%s, 'SRID=4326;POINT(13 52)', 'old'), (%s, 'SRID=4326;POINT(14 52)', 'old2')",
                     (ids[1], ids[2]))
        conn.execute("CALL feature_outbox.backfill('sites')")
        # drift and resync: a plain UPDATE moves one, and drift names it by its key.
        conn.execute("UPDATE app.sites SET geom = 'SRID=4326;POINT(-3.7 40.4)' WHERE id = %s", (ids[0],))
        assert dict(conn.execute("SELECT feature_id, change FROM feature_outbox.drift('sites')").fetchall()) == {str(ids[0]): "geometry"}
        assert conn.execute("CALL feature_outbox.resync('sites')").fetchone() == (1, 0)
        assert conn.execute("SELECT count(*) FROM feature_outbox.drift('sites')").fetchone()[0] == 0
        committed = rows(conn, "sites", "id")
    got = events(relay, nats_server, "sites")
    by_key = {}
    for m in got:
        e = m["event"]
        by_key.setdefault(e["feature_id"], []).append(e)
        assert m["headers"]["Feature-Id"] == e["feature_id"]
    assert set(by_key) == {str(i) for i in ids} | {str(orm_id)}, "events carry the uuid as the table stores it"
    assert [(e["action"], e["event_version"]) for e in by_key[str(ids[0])]] == [
        ("created", 1), ("moved", 2), ("updated", 3), ("snapshot", 3), ("moved", 4)]
    assert [e["action"] for e in by_key[str(orm_id)]] == ["created", "moved", "snapshot"]
    for key, evs in by_key.items():
        last = evs[-1]
        version, xy, name = committed[key]
        assert (last["geometry_version"], last["geometry"]["coordinates"], last["properties"]["name"]) == (version, xy, name)
    resynced = by_key[str(ids[0])][-1]
    assert resynced["previous_routing_key"] == by_key[str(ids[0])][1]["routing_key"]


def test_a_text_keyed_layer_keeps_each_features_order_across_four_workers(relay, nats_server):
    codes = [f"STOP-{i:03d}/Ü" for i in range(24)]  # text as the application stores it, slash and umlaut included
    moves = 12

    def editor(part):
        with relay.connect(DB) as conn:
            for step in range(moves):
                for code in part:
                    event = "created" if step == 0 else "moved"
                    conn.execute("SELECT feature_outbox.edit_feature('stops', %s, %s::text, %s, %s)",
                                 (code, point(step, codes.index(code)), event, json.dumps({"name": f"{code} {step}"})))

    threads = [threading.Thread(target=editor, args=(codes[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with relay.connect(DB) as conn:
        # The ORM path and retired, by text key.
        with conn.transaction():
            conn.execute("UPDATE app.stops SET name = 'renamed' WHERE code = %s", (codes[0],))
            conn.execute("SELECT feature_outbox.record_edit('stops', %s, 'updated')", (codes[0],))
        conn.execute("SELECT feature_outbox.edit_feature('stops', %s, NULL::text, 'retired')", (codes[1],))
        # drift/resync by text key: a plain DELETE and a row inserted by hand.
        conn.execute("DELETE FROM app.stops WHERE code = %s", (codes[2],))
        conn.execute("INSERT INTO app.stops VALUES ('HAND-1', 'SRID=4326;POINT(5 5)', 0, 'by hand')")
        assert dict(conn.execute("SELECT feature_id, change FROM feature_outbox.drift('stops')").fetchall()) == {
            codes[2]: "gone", "HAND-1": "no_event"}
        assert conn.execute("CALL feature_outbox.resync('stops')").fetchone() == (2, 0)
        conn.execute("CALL feature_outbox.backfill('stops')")
        committed = rows(conn, "stops", "code")
    got = events(relay, nats_server, "stops")
    by_key = {}
    for m in got:  # stream order
        by_key.setdefault(m["event"]["feature_id"], []).append(m["event"])
    assert set(by_key) == set(codes) | {"HAND-1"}
    for code in codes:
        versions = [e["event_version"] for e in by_key[code] if e["action"] != "snapshot"]
        assert versions == sorted(versions) and len(set(versions)) == len(versions), f"{code}: {versions} out of order"
    assert [e["action"] for e in by_key[codes[0]]][-2:] == ["updated", "snapshot"]
    assert by_key[codes[0]][-1]["properties"]["name"] == "renamed"
    assert by_key[codes[1]][-1]["action"] == "retired"
    assert by_key[codes[2]][-1]["action"] == "retired" and by_key[codes[2]][-1]["geometry"] is None
    assert [e["action"] for e in by_key["HAND-1"]] == ["created", "snapshot"]
    for code in codes[3:]:
        last = by_key[code][-1]
        version, xy, name = committed[code]
        assert (last["geometry_version"], last["geometry"]["coordinates"], last["properties"]["name"]) == (version, xy, name)
