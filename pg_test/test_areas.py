"""Area subscriptions (issue 11): hierarchical H3 subjects, departure notices, bounding boxes, the
backlog by cell and backfills. The 3,231 US counties as a layer, a relay with two workers publishing
to a real nats-server (Debian's 2.9.10: one JetStream consumer per filter subject), and subscribers
that select their area by subject filter alone, never by reading a body."""

import json
import random
import threading
import time
from collections import Counter, defaultdict

import h3
import psycopg
import pytest

from conftest import RUN_DIR, Cluster, county_data, free_port
from relay_harness import consume, nats_fixture, subject, wait_for

DB = "areas"
SETTINGS = (
    f"feature_outbox.database = '{DB}'",
    "feature_outbox.relay_workers = 2",
    "feature_outbox.poll_interval = '60s'",
)
COLORADO, KANSAS, UTAH = "08", "20", "49"
ALEUTIANS_WEST = 2016

nats_server = nats_fixture("nats_areas")


@pytest.fixture(scope="module")
def relay(nats_server):
    from test_real_data import read_counties
    c = Cluster(RUN_DIR / "areas", free_port())
    c.start(*SETTINGS, f"feature_outbox.endpoint = '{nats_server.url}'")
    c.create_db(DB)
    with c.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute("""CREATE TABLE public.counties (fips integer PRIMARY KEY, geom geometry(Geometry, 4326) NOT NULL,
                                                     version integer NOT NULL DEFAULT 0, name text, state_fips text)""")
        conn.execute("SELECT feature_outbox.register_layer('counties', 'public.counties', 'fips', properties => '{name,state_fips}')")
        names = {json.loads(l)["id"]: json.loads(l)["name"] for l in county_data().read_text().splitlines() if l.strip()}
        counties = read_counties()
        for i in range(0, len(counties), 500):
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany("SELECT feature_outbox.edit_feature('counties', %s, %s, 'created', %s)",
                                [(int(f), g, json.dumps({"name": names[f], "state_fips": f[:2]})) for f, g in counties[i:i + 500]])
        wait_for(lambda: relayed(conn), 60, "the counties to be relayed")
    yield c
    c.stop()


@pytest.fixture
def db(relay):
    with relay.connect(DB) as conn:
        yield conn


def relayed(conn):
    return conn.execute("SELECT NOT EXISTS (SELECT 1 FROM feature_outbox.outbox WHERE published_at IS NULL AND parked_at IS NULL)").fetchone()[0]


def read(server, filters: list[str]) -> list[dict]:
    """What a subscriber selecting by `filters` alone receives (relay_harness.consume)."""
    return consume([server.url], filters)


def keys_of_state(conn, state):
    return [k for (k,) in conn.execute("""SELECT s.routing_key FROM feature_outbox.feature_state s
                                            JOIN counties c ON c.fips = s.feature_id
                                           WHERE s.layer = 'counties' AND c.state_fips = %s""", (state,))]


def area_filters(cells, resolution, resolutions=(3, 5, 7), layer="counties"):
    """The filter subject of each cell: `*` for the event type (departed included) and each level above."""
    above = sum(1 for r in resolutions if r < resolution)
    return [".".join(["features", layer, "*", *["*"] * above, c, ">"]) for c in cells]


def outbox_rows(conn, layer="counties"):
    return conn.execute("""SELECT event_id::text, event_type, routing_key, previous_routing_key
                             FROM feature_outbox.outbox WHERE layer = %s OR %s::text IS NULL""", (layer, layer)).fetchall()


@pytest.mark.parametrize("resolution", [3, 5])
def test_a_state_subscriber_receives_exactly_the_events_routed_inside_its_cells(db, nats_server, resolution):
    cells = sorted({h3.cell_to_parent(k, resolution) for k in keys_of_state(db, COLORADO)})
    got = read(nats_server, area_filters(cells, resolution))
    expected = {(eid, t) for eid, t, key, _ in outbox_rows(db) if h3.cell_to_parent(key, resolution) in cells}
    assert len(expected) >= 64  # Colorado's counties, and neighbours' counties sharing their cells
    assert {(m["id"], m["event"]["action"]) for m in got if not m["id"].endswith(":departed")} == expected
    # No body was needed: every subject names the routing key's parents, and the key.
    for m in got:
        e = m["event"]
        if not m["id"].endswith(":departed"):
            assert m["subject"] == subject("counties", e["action"], e["routing_key"])


def test_a_county_moved_between_states_reaches_one_as_moved_and_the_other_as_departed(db, nats_server):
    res = 5
    co = set(h3.cell_to_parent(k, res) for k in keys_of_state(db, COLORADO))
    ks = set(h3.cell_to_parent(k, res) for k in keys_of_state(db, KANSAS))
    # A Colorado county whose cell no Kansas county shares, moved onto the shape of one in Kansas.
    mover, target = db.execute("""SELECT c.fips, k.fips FROM counties c, counties k
                                   WHERE c.state_fips = %s AND k.state_fips = %s
                                     AND NOT feature_outbox._h3_parent((SELECT routing_key FROM feature_outbox.feature_state
                                                                         WHERE layer = 'counties' AND feature_id = c.fips), 5) = ANY(%s)
                                     AND NOT feature_outbox._h3_parent((SELECT routing_key FROM feature_outbox.feature_state
                                                                         WHERE layer = 'counties' AND feature_id = k.fips), 5) = ANY(%s)
                                   ORDER BY c.fips, k.fips LIMIT 1""", (COLORADO, KANSAS, list(ks), list(co))).fetchone()
    before = db.execute("SELECT routing_key FROM feature_outbox.feature_state WHERE layer = 'counties' AND feature_id = %s",
                        (mover,)).fetchone()[0]
    db.execute("""SELECT feature_outbox.edit_feature('counties', %s, (SELECT geom FROM counties WHERE fips = %s), 'moved')""",
               (mover, target))
    event_id, key = db.execute("""SELECT event_id::text, routing_key FROM feature_outbox.outbox
                                   WHERE layer = 'counties' AND feature_id = %s AND event_type = 'moved'""", (mover,)).fetchone()
    assert h3.cell_to_parent(key, res) in ks and h3.cell_to_parent(before, res) in co
    wait_for(lambda: relayed(db), 20, "the move to be relayed")
    to_colorado = [m for m in read(nats_server, area_filters(sorted(co), res)) if m["event"]["event_id"] == event_id]
    to_kansas = [m for m in read(nats_server, area_filters(sorted(ks), res)) if m["event"]["event_id"] == event_id]
    assert [(m["id"], m["subject"]) for m in to_colorado] == [(f"{event_id}:departed", subject("counties", "departed", before))]
    assert [(m["id"], m["subject"]) for m in to_kansas] == [(event_id, subject("counties", "moved", key))]
    # The same body both ways: the departed subscriber checks routing_key before dropping the feature.
    assert to_colorado[0]["event"] == to_kansas[0]["event"]
    assert to_colorado[0]["event"]["routing_key"] == key and to_colorado[0]["event"]["previous_routing_key"] == before
    # Bounding boxes: the new shape's, and the one before it, recorded at write time.
    target_box, mover_box = (db.execute("SELECT ARRAY[ST_XMin(geom), ST_YMin(geom), ST_XMax(geom), ST_YMax(geom)] FROM counties WHERE fips = %s",
                                        (f,)).fetchone()[0] for f in (target, mover))
    e = to_kansas[0]["event"]
    assert e["bbox"] == pytest.approx(target_box) and e["previous_bbox"] is not None
    created = [m for m in nats_server.messages() if m["event"]["feature_id"] == str(mover) and m["event"]["action"] == "created"]
    assert e["previous_bbox"] == created[0]["event"]["bbox"] and created[0]["event"]["previous_bbox"] is None
    assert created[0]["event"]["bbox"] != pytest.approx(target_box) and mover_box == pytest.approx(target_box)


def test_the_whole_world_sees_each_event_once_and_each_departure_once(db, nats_server):
    db.execute("SELECT feature_outbox.edit_feature('counties', 1001, (SELECT geom FROM counties WHERE fips = 6037), 'moved')")
    db.execute("SELECT feature_outbox.edit_feature('counties', 1003, NULL::text, 'updated', '{\"name\": \"Renamed\"}')")
    db.execute("SELECT feature_outbox.edit_feature('counties', 1005, NULL::text, 'retired')")
    wait_for(lambda: relayed(db), 20, "the edits to be relayed")
    got = Counter(m["id"] for m in read(nats_server, ["features.>"]))
    rows = outbox_rows(db, None)
    departures = [eid for eid, t, key, prev in rows if t in ("moved", "retired") and prev is not None and prev != key]
    assert departures, "the test needs a move out of a cell"
    assert got == Counter([eid for eid, *_ in rows] + [f"{eid}:departed" for eid in departures])
    # updated and a retirement in place depart nothing.
    by_id = {eid: (t, key, prev) for eid, t, key, prev in rows}
    assert all(by_id[eid][0] in ("moved", "retired") for eid in departures)


def test_an_event_across_the_antimeridian_has_an_rfc_7946_bbox(db, nats_server):
    e = [m["event"] for m in nats_server.messages() if m["event"]["feature_id"] == str(ALEUTIANS_WEST)][0]
    west, south, east, north = e["bbox"]
    # Islands on both sides of the antimeridian: west > east (RFC 7946 §5.2), a box some 20 degrees
    # wide across it, not one 340 degrees wide around the rest of the world.
    assert west > east and 170 < west < 180 and -180 < east < -160 and south < north
    assert (east + 360) - west < 30
    lons = [x for ring in (p[0] for p in e["geometry"]["coordinates"]) for x, _ in ring]
    assert min(x for x in lons if x > 0) == pytest.approx(west) and max(x for x in lons if x < 0) == pytest.approx(east)


def test_subject_resolutions_take_effect_at_reload(relay, db, nats_server):
    # The values refused when set are pg_test/sql/22_settings.
    with relay.connect(DB) as su:
        su.execute("ALTER SYSTEM SET feature_outbox.subject_resolutions = '2, 9'")  # 9: finer than the keys, left out
        su.execute("SELECT pg_reload_conf()")
        try:
            wait_for(lambda: db.execute("SHOW feature_outbox.subject_resolutions").fetchone()[0] == "2, 9", 5)
            time.sleep(0.5)  # the workers read it at their next wake-up
            db.execute("SELECT feature_outbox.edit_feature('counties', 1007, NULL::text, 'updated', '{\"name\": \"Again\"}')")
            wait_for(lambda: relayed(db), 20, "the edit to be relayed")
            m = [m for m in nats_server.messages() if m["event"]["feature_id"] == "1007" and m["event"]["action"] == "updated"][-1]
            key = m["event"]["routing_key"]
            assert m["subject"] == f"features.counties.updated.{h3.cell_to_parent(key, 2)}.{key}"
        finally:
            su.execute("ALTER SYSTEM RESET feature_outbox.subject_resolutions")
            su.execute("SELECT pg_reload_conf()")
            wait_for(lambda: db.execute("SHOW feature_outbox.subject_resolutions").fetchone()[0] == "3,5,7", 5)
            time.sleep(0.5)


def test_backlog_by_cell_counts_waiting_rows_per_parent_cell(relay, db, nats_server):
    with relay.connect(DB) as su:
        # No relay while the rows wait: the sink is off for the test's span.
        su.execute("ALTER SYSTEM SET feature_outbox.endpoint = ''")
        su.execute("SELECT pg_reload_conf()")
        try:
            time.sleep(1)
            db.execute("""SELECT feature_outbox.edit_feature('counties', fips, NULL::text, 'updated', '{"name": "Waiting"}')
                            FROM counties WHERE state_fips = %s""", (COLORADO,))
            keys = keys_of_state(db, COLORADO)
            for res in (3, 5):
                got = {(cell, n) for layer, cell, n, at in db.execute("SELECT * FROM feature_outbox.backlog_by_cell(%s)", (res,))}
                assert got == set(Counter(h3.cell_to_parent(k, res) for k in keys).items())
            assert db.execute("SELECT sum(unpublished_rows) FROM feature_outbox.backlog_by_cell()").fetchone()[0] == 64
        finally:
            su.execute(f"ALTER SYSTEM SET feature_outbox.endpoint = '{nats_server.url}'")  # as the cluster started
            su.execute("SELECT pg_reload_conf()")
    wait_for(lambda: relayed(db), 30, "the waiting rows to be relayed")
    assert db.execute("SELECT count(*) FROM feature_outbox.backlog_by_cell()").fetchone()[0] == 0


def test_backfill_of_an_area_writes_one_snapshot_per_live_feature_inside_it(relay, db, nats_server):
    utah = db.execute("SELECT ST_AsText(ST_Union(geom)) FROM counties WHERE state_fips = %s", (UTAH,)).fetchone()[0]
    before = db.execute("SELECT coalesce(max(id), 0) FROM feature_outbox.outbox").fetchone()[0]
    # Any SRID: the area in CONUS Albers metres.
    written = db.execute("CALL feature_outbox.backfill('counties', ST_Transform(ST_GeomFromText(%s, 4326), 5070), NULL)",
                         (utah,)).fetchone()[0]
    snaps = db.execute("""SELECT o.feature_id, o.feature_version, c.state_fips, c.version, o.event_type FROM feature_outbox.outbox o
                            JOIN counties c ON c.fips = o.feature_id WHERE o.id > %s""", (before,)).fetchall()
    # Each county's routing point lies inside it, so inside the state: exactly Utah's 29.
    assert written == len(snaps) == 29
    assert {s for _, _, s, _, _ in snaps} == {UTAH} and {t for *_, t in snaps} == {"snapshot"}
    assert all(v == cv for _, v, _, cv, _ in snaps)
    wait_for(lambda: relayed(db), 20, "the snapshots to be relayed")
    got = read(nats_server, ["features.counties.snapshot.>"])
    assert sorted(int(m["event"]["feature_id"]) for m in got) == sorted(f for f, *_ in snaps)
    for m in got:
        assert m["subject"] == subject("counties", "snapshot", m["event"]["routing_key"])
        assert m["event"]["previous_bbox"] is None and m["event"]["properties"]["state_fips"] == UTAH
    # The whole layer: one per live feature (retired counties are deleted from this table).
    db.execute("SELECT feature_outbox.edit_feature('counties', 8001, NULL::text, 'retired')")
    live = db.execute("SELECT count(*) FROM counties").fetchone()[0]
    assert db.execute("CALL feature_outbox.backfill('counties')").fetchone()[0] == live


def test_a_backfill_racing_with_edits_keeps_each_features_order(relay, db, nats_server):
    """Snapshots of 3,000 points while four editors move them: each snapshot carries a version its
    feature really had, and in the stream each feature's events run in version order, the snapshot
    right after the edit it shows."""
    db.execute("CREATE TABLE public.racers (id bigint PRIMARY KEY, geom geometry(Point, 4326), version integer NOT NULL DEFAULT 0)")
    db.execute("SELECT feature_outbox.register_layer('racers', 'public.racers')")
    n = 3000
    db.execute("""SELECT feature_outbox.edit_feature('racers', i, ST_SetSRID(ST_MakePoint(-100 + i * 0.001, 40), 4326), 'created')
                    FROM generate_series(1, %s) i""", (n,))
    committed = defaultdict(set)  # feature -> versions committed
    for i in range(1, n + 1):
        committed[i].add(1)
    lock, stop = threading.Lock(), threading.Event()

    def editor(seed):
        rng = random.Random(seed)
        with psycopg.connect(relay.dsn(DB)) as conn:
            while not stop.is_set():
                fid = rng.randint(1, n)
                v = conn.execute("SELECT feature_outbox.edit_feature('racers', %s, ST_SetSRID(ST_MakePoint(%s, %s), 4326), 'moved')",
                                 (fid, rng.uniform(-120, -80), rng.uniform(30, 45))).fetchone()[0]
                if rng.random() < 0.2:
                    conn.rollback()  # its version is never published, and is reused by a later edit
                else:
                    conn.commit()
                    with lock:
                        committed[fid].add(v)

    threads = [threading.Thread(target=editor, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        written = db.execute("CALL feature_outbox.backfill('racers')").fetchone()[0]
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert written == n
    wait_for(lambda: relayed(db), 60, "the race to be relayed")
    stream = defaultdict(list)  # feature -> (action, version) in stream order, duplicates dropped
    seen = set()
    for m in read(nats_server, ["features.racers.>"]):
        if m["id"] in seen or m["id"].endswith(":departed"):
            continue
        seen.add(m["id"])
        stream[int(m["event"]["feature_id"])].append((m["event"]["action"], m["event"]["event_version"]))
    raced = 0
    for fid, events in stream.items():
        versions = [v for _, v in events]
        assert versions == sorted(versions), (fid, events)
        snaps = [i for i, (a, _) in enumerate(events) if a == "snapshot"]
        assert len(snaps) == 1, (fid, events)
        i = snaps[0]
        assert events[i][1] in committed[fid], (fid, events)
        # The snapshot shows the edit just before it, and every edit after it is newer.
        assert events[i][1] == events[i - 1][1] and all(v > events[i][1] for _, v in events[i + 1:]), (fid, events)
        raced += i + 1 < len(events)
    assert {a for e in stream.values() for a, _ in e} == {"created", "moved", "snapshot"}
    assert raced > 0, "no edit came after a snapshot: the race did not happen"
