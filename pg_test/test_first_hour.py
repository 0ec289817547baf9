"""The first hour of a new user: each stumble of a fresh-machine trial, as a test. Real clusters,
real nats-server, a real HTTP receiver; each test starts the cluster its settings need."""

import asyncio
import json
import re
import subprocess
import time
from collections import Counter

import nats
import psycopg
import pytest

from conftest import PG_BIN, ROOT, RUN_DIR, Cluster, free_port
from relay_harness import NatsServer, Receiver, get_object, wait_for

FAST_RETRY = ("feature_outbox.retry_backoff_min = '100ms'", "feature_outbox.retry_backoff_max = '1s'",
              "feature_outbox.publish_timeout = '2s'")


@pytest.fixture
def nats_server(request):
    server = NatsServer(RUN_DIR / f"nats-{request.node.name[:40]}")
    server.start()
    yield server
    server.stop()


def one(c, db, sql, *args):
    with c.connect(db) as conn:
        conn.row_factory = psycopg.rows.dict_row
        return conn.execute(sql, args).fetchone()


def edit(c, db, feature_id, event_type, geojson):
    with c.connect(db) as conn:
        return conn.execute("SELECT feature_outbox.edit_feature(%s, %s::text, %s)", (feature_id, geojson, event_type)).fetchone()[0]


def point(lon, lat):
    return json.dumps({"type": "Point", "coordinates": [lon, lat]})


def circle(lon, lat, vertices):
    """A polygon of `vertices` points, as GeoJSON: about 40 bytes a vertex."""
    import math
    ring = [[lon + math.cos(2 * math.pi * i / vertices) / 10, lat + math.sin(2 * math.pi * i / vertices) / 10]
            for i in range(vertices)]
    return json.dumps({"type": "Polygon", "coordinates": [ring + [ring[0]]]})


def configure(c, **settings):
    with c.connect() as conn:
        for name, value in settings.items():
            conn.execute(f"ALTER SYSTEM SET feature_outbox.{name} = '{value}'")
        conn.execute("SELECT pg_reload_conf()")


# 1 ------------------------------------------------------------------------------------------------

def test_a_forgotten_preload_is_named_by_create_extension_and_the_backlog(cluster_with):
    # The README's settings, without the preload: the feature_outbox.* lines become placeholders.
    c = cluster_with("shared_preload_libraries = ''", "feature_outbox.database = 'gis'",
                     "feature_outbox.relay_workers = 1", "feature_outbox.endpoint = 'nats://127.0.0.1:4222'")
    c.create_db("gis")
    notices = []
    with c.connect("gis") as conn:
        conn.add_notice_handler(lambda n: notices.append(f"{n.message_primary} {n.message_hint}"))
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        # The placeholder reads like a real setting; the library's own state does not.
        assert conn.execute("SHOW feature_outbox.relay_workers").fetchone() == ("1",)
    assert any("shared_preload_libraries" in n for n in notices), notices
    edit(c, "gis", 1, "created", point(1, 1))
    b = one(c, "gis", "SELECT * FROM feature_outbox.backlog")
    assert b["relay_workers_running"] == 0 and "shared_preload_libraries" in b["relay_last_error"]


# 2 ------------------------------------------------------------------------------------------------

def test_a_changed_endpoint_ends_the_backoff_at_once_and_errors_clear(cluster_with, nats_server):
    dead = free_port()
    c = cluster_with("feature_outbox.database = 'gis'", "feature_outbox.poll_interval = '60s'",
                     "feature_outbox.publish_timeout = '1s'",
                     # Long backoff: the wait below would be 20 s or more without the SIGHUP check.
                     "feature_outbox.retry_backoff_min = '20s'", "feature_outbox.retry_backoff_max = '60s'",
                     f"feature_outbox.endpoint = 'nats://relay:s3cret@127.0.0.1:{dead}'")
    c.create_db("gis")
    with c.connect("gis") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
    edit(c, "gis", 1, "created", point(2, 2))
    wait_for(lambda: one(c, "gis", "SELECT state FROM feature_outbox.workers")["state"] == "backing off", 20, "the backoff")
    w = one(c, "gis", "SELECT last_error FROM feature_outbox.workers")
    assert f"127.0.0.1:{dead}" in w["last_error"] and "s3cret" not in w["last_error"], w
    assert one(c, "gis", "SELECT relay_last_error FROM feature_outbox.backlog")["relay_last_error"]

    started = time.monotonic()
    configure(c, endpoint=nats_server.url)
    wait_for(lambda: one(c, "gis", "SELECT published_at FROM feature_outbox.outbox")["published_at"], 10,
             "delivery after the endpoint changed")
    took = time.monotonic() - started
    print(f"delivered {took:.2f} s after the endpoint changed, inside a backoff of at least 20 s")
    assert took < 10, "the backoff was waited out"
    # The sink is back: the backlog shows no current error; the worker keeps the last one, dated.
    b = one(c, "gis", "SELECT relay_last_error FROM feature_outbox.backlog")
    w = one(c, "gis", "SELECT last_error, last_error_at FROM feature_outbox.workers")
    assert b["relay_last_error"] is None and w["last_error"] and w["last_error_at"]
    # published_at is the acknowledgement time, never before the event's relayed_at.
    [msg] = nats_server.messages()
    row = one(c, "gis", """SELECT to_char(published_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS at
                             FROM feature_outbox.outbox""")
    assert row["at"] >= msg["event"]["relayed_at"]


# 3 ------------------------------------------------------------------------------------------------

def readme_block(lang: str, after: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index(after):]
    return re.search(rf"```{lang}\n(.*?)```", section, re.S)[1]


def test_the_quick_start_runs_as_written(cluster_with, nats_server):
    settings = []
    for line in readme_block("ini", "## Quick start").splitlines():
        line = line.split("#")[0].strip() if not line.lstrip().startswith("#") else ""
        if line.startswith("feature_outbox.endpoint"):
            line = f"feature_outbox.endpoint = '{nats_server.url}'"  # the test's own NATS port
        if line:
            settings.append(line)
    assert any(s.startswith("shared_preload_libraries") for s in settings)
    c = cluster_with(*settings)
    c.create_db("gis")
    script = readme_block("sql", "## Quick start")
    out = subprocess.run([PG_BIN / "psql", "-X", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", str(c.port),
                          "-U", "postgres", "-d", "gis"], input=script, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "permission denied" not in out.stderr
    # Four events of the layer parcels and three of the built-in layer.
    got = wait_for(lambda: len(nats_server.messages()) == 7 and nats_server.messages(), 15, "the quick start's seven events")
    by_layer = Counter(m["event"]["layer"] for m in got)
    assert by_layer == {"parcels": 4, "features": 3}
    parcels = [m["event"] for m in got if m["event"]["layer"] == "parcels"]
    assert [e["action"] for e in parcels] == ["created", "updated", "updated", "retired"]
    assert parcels[-1]["properties"] == {"name": "Block 4471 North", "zoning": "C4"}


# 4 ------------------------------------------------------------------------------------------------

def test_an_event_over_max_payload_carries_its_geometry_in_the_object_store(cluster_with):
    server = NatsServer(RUN_DIR / "nats-small-payload", max_payload=65536)
    server.start()
    try:
        c = cluster_with("feature_outbox.database = 'gis'", *FAST_RETRY, f"feature_outbox.endpoint = '{server.url}'")
        c.create_db("gis")
        with c.connect("gis") as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        big = circle(10, 50, 5000)  # ~200 kB of GeoJSON: three times max_payload
        edit(c, "gis", 1, "created", big)
        edit(c, "gis", 2, "created", point(10, 50))
        wait_for(lambda: one(c, "gis", "SELECT count(*) AS n FROM feature_outbox.outbox WHERE published_at IS NULL")["n"] == 0,
                 20, "both events to be relayed")
        events = {m["event"]["feature_id"]: m["event"] for m in server.messages()}
        large, small = events["1"], events["2"]
        assert small["geometry"] == {"type": "Point", "coordinates": [10, 50]} and "geometry_ref" not in small
        assert large["geometry"] is None
        assert large["geometry_ref"]["bucket"] == "FEATURES_GEOMETRY" and large["geometry_ref"]["name"] == large["event_id"]
        stored = get_object(server, "FEATURES_GEOMETRY", large["geometry_ref"]["name"])
        assert len(stored) == large["geometry_ref"]["size"]
        # The object is the geometry, at full precision, exactly as an inline event would carry it.
        assert json.loads(stored) == json.loads(big)

        # A republish after the feature changed (a crash between publish and mark leaves the row
        # unpublished) must not rewrite the object the first publish named: the stream keeps that
        # event (the copy is a duplicate), so its geometry_ref must still hold geometry_version 1.
        configure(c, endpoint=f"nats://127.0.0.1:{free_port()}")
        edit(c, "gis", 1, "moved", circle(-70, -30, 6000))
        with c.connect("gis") as conn:
            with conn.transaction():
                conn.execute("UPDATE feature_outbox.outbox SET published_at = NULL WHERE feature_id = 1 AND event_type = 'created'")
                # The row is below the claim's low-water mark by now: reset it, as retry_parked() does.
                conn.execute("SELECT feature_outbox._relay_low_water_reset(), feature_outbox._wake_relay_at_commit()")
        configure(c, endpoint=server.url)
        wait_for(lambda: one(c, "gis", "SELECT count(*) AS n FROM feature_outbox.outbox WHERE published_at IS NULL")["n"] == 0,
                 20, "the republish and the move")
        assert one(c, "gis", "SELECT sum(duplicate_acks) AS n FROM feature_outbox.workers")["n"] == 1
        assert get_object(server, "FEATURES_GEOMETRY", large["event_id"]) == stored
        moved = [m["event"] for m in server.messages() if m["event"]["action"] == "moved"]
        assert len(moved) == 1 and moved[0]["geometry_version"] == 2
        assert json.loads(get_object(server, "FEATURES_GEOMETRY", moved[0]["event_id"])) == json.loads(circle(-70, -30, 6000))
    finally:
        server.stop()


def test_an_event_over_http_max_body_parks_at_once_and_the_backlog_says_so(cluster_with):
    receiver = Receiver()
    try:
        c = cluster_with("feature_outbox.database = 'gis'", *FAST_RETRY, "feature_outbox.max_attempts = 10",
                         "feature_outbox.http_max_body = '4kB'", f"feature_outbox.endpoint = '{receiver.url}'")
        c.create_db("gis")
        with c.connect("gis") as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        edit(c, "gis", 1, "created", circle(10, 50, 500))  # ~20 kB
        edit(c, "gis", 2, "created", point(10, 50))
        wait_for(lambda: one(c, "gis", "SELECT parked_at FROM feature_outbox.outbox WHERE feature_id = 1")["parked_at"],
                 15, "the oversized event to park")
        row = one(c, "gis", "SELECT * FROM feature_outbox.outbox WHERE feature_id = 1")
        # Parked after one try, not max_attempts, and nothing suggests another attempt is coming.
        assert row["row_failures"] == 1 and row["next_attempt_at"] is None
        assert "feature_outbox.http_max_body" in row["last_error"]
        wait_for(lambda: receiver.events(), 10, "the small event")
        assert [e["feature_id"] for e in receiver.events()] == ["2"]
        time.sleep(1.1)
        b = one(c, "gis", "SELECT * FROM feature_outbox.backlog")
        assert b["parked_rows"] == 1 and b["oldest_parked_age"].total_seconds() >= 1
        metrics = one(c, "gis", "SELECT feature_outbox.metrics() AS m")["m"]
        age = float(re.search(r"^outbox_oldest_parked_age_seconds\{database=\"gis\"\} (\S+)$", metrics, re.M)[1])
        assert age >= 1
    finally:
        receiver.close()


# 5 ------------------------------------------------------------------------------------------------

def stream_config(server):
    async def read():
        nc = await nats.connect(server.url)
        info = await nc.jetstream().stream_info("FEATURES")
        await nc.close()
        return info.config
    return asyncio.run(read())


def test_the_stream_gets_a_max_age_and_an_existing_one_is_left_alone(cluster_with, nats_server):
    c = cluster_with("feature_outbox.database = 'gis'", *FAST_RETRY, f"feature_outbox.endpoint = '{nats_server.url}'")
    c.create_db("gis")
    with c.connect("gis") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
    edit(c, "gis", 1, "created", point(3, 3))
    wait_for(lambda: nats_server.messages(), 15, "the first event")
    assert stream_config(nats_server).max_age == 7 * 86400  # nats-py reports seconds

    # A stream made by 0.1.0 (no max_age) stays as it is; the worker says so once.
    async def recreate():
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await js.delete_stream("FEATURES")
        await js.add_stream(name="FEATURES", subjects=["features.>"], duplicate_window=600)
        await nc.close()
    asyncio.run(recreate())
    configure(c, nats_duplicate_window="601s")  # a changed sink setting: the worker reconnects
    edit(c, "gis", 2, "created", point(4, 4))
    wait_for(lambda: "exists with other limits" in c.log(), 15, "the limits notice")
    configure(c, nats_duplicate_window="602s")
    edit(c, "gis", 3, "created", point(5, 5))
    wait_for(lambda: len(nats_server.messages()) == 2, 15, "events after the reconnects")
    assert stream_config(nats_server).max_age in (0, None)
    assert c.log().count("exists with other limits") == 2, "once per distinct difference"
    # max_age below the duplicate window: an existing stream is used as it is...
    configure(c, nats_max_age="60s")
    edit(c, "gis", 4, "created", point(6, 6))
    wait_for(lambda: len(nats_server.messages()) == 3, 15, "delivery to the existing stream")

    # ...and creating one is refused with a message that names both settings.
    async def drop():
        nc = await nats.connect(nats_server.url)
        await nc.jetstream().delete_stream("FEATURES")
        await nc.close()
    asyncio.run(drop())
    configure(c, nats_max_age="61s")  # reconnect
    edit(c, "gis", 5, "created", point(7, 7))
    wait_for(lambda: "must be at least feature_outbox.nats_duplicate_window" in
             (one(c, "gis", "SELECT last_error FROM feature_outbox.workers")["last_error"] or ""), 15, "the refusal")
    # A bucket name NATS would refuse is refused when set: pg_test/sql/22_settings.


# 7 ------------------------------------------------------------------------------------------------

def test_the_worker_waits_for_its_database_without_fatal_and_starts_at_once(cluster_with, nats_server):
    c = cluster_with("feature_outbox.database = 'later'", "feature_outbox.poll_interval = '60s'",
                     f"feature_outbox.endpoint = '{nats_server.url}'")
    wait_for(lambda: 'database "later" does not exist (see feature_outbox.database)' in c.log(), 15, "the wait")
    time.sleep(4)
    fatal = c.log().count("FATAL:")
    assert fatal <= 1, f"{fatal} FATALs while waiting"
    with c.connect() as conn:
        conn.execute("CREATE DATABASE later")
    with c.connect("later") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        created = time.monotonic()
        conn.execute("SELECT feature_outbox.edit_feature(1, %s::text, 'created')", (point(7, 7),))
    wait_for(lambda: nats_server.messages(), 10, "the first event")
    took = time.monotonic() - created
    print(f"first event relayed {took:.2f} s after CREATE EXTENSION")
    assert took < 4, took
    assert c.log().count("FATAL:") == fatal
