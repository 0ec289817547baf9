"""End-to-end relay tests against real components: a PostgreSQL 15 cluster preloading the extension,
nats-server -js, and an HTTP receiver in this process. No mocks.

The cluster's poll interval is 60 s, so deliveries within seconds show the commit-time wake-up."""

import asyncio
import json
import os
import re
import time
import uuid
from collections import Counter

import nats as nats_client
import psycopg
import pytest
from standardwebhooks.webhooks import Webhook

from conftest import RUN_DIR, Cluster, create_fault_point, free_port
from drills import relay_pids
from relay_harness import NatsServer, Receiver, get_object, make_tls, receiver, subject, wait_for  # noqa: F401 (receiver: a fixture)
from relay_harness import reconfigure as configure

DB = "relay"
SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SETTINGS = (
    f"feature_outbox.database = '{DB}'",
    "feature_outbox.poll_interval = '60s'",
    "feature_outbox.retry_backoff_min = '100ms'",
    "feature_outbox.retry_backoff_max = '1s'",
    "feature_outbox.publish_timeout = '2s'",
    "feature_outbox.max_attempts = 3",
)
EVENT_FIELDS = {"schema_version", "event_id", "database", "database_id", "layer", "registration_id", "properties", "action", "feature_id", "event_version", "geometry_version",
                "routing_key", "previous_routing_key", "crs", "geometry", "bbox", "previous_bbox", "occurred_at", "relayed_at", "origin"}
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


@pytest.fixture(scope="module")
def nats_server():
    server = NatsServer(RUN_DIR / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def relay(nats_server):
    """A cluster whose relay serves database `relay`. It starts before that database exists, as on a
    real server, so the worker's missing-database path runs first."""
    c = Cluster(RUN_DIR / "relay", free_port())
    c.start(*SETTINGS, f"feature_outbox.endpoint = '{nats_server.url}'")
    wait_for(lambda: 'database "relay" does not exist (see feature_outbox.database)' in c.log(), 15,
             "the worker to report the missing database")
    c.missing_db_log = c.log()
    c.create_db(DB)
    with c.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        create_fault_point(conn)
    wait_for(lambda: worker_states(c) == ["idle"], 20, "the relay worker to become idle")
    yield c
    c.stop()


def worker_states(c):
    with c.connect(DB) as conn:
        return [r[0] for r in conn.execute("SELECT state FROM feature_outbox.workers ORDER BY worker")]


def edit(c, feature_id, event_type, geojson=None):
    with c.connect(DB) as conn:
        return conn.execute("SELECT feature_outbox.edit_feature(%s, %s::text, %s)",
                            (feature_id, geojson, event_type)).fetchone()[0]


def point(lon, lat):
    return json.dumps({"type": "Point", "coordinates": [lon, lat]})


def outbox(c, ids):
    with c.connect(DB) as conn:
        conn.row_factory = psycopg.rows.dict_row
        return conn.execute("SELECT * FROM feature_outbox.outbox WHERE feature_id = ANY(%s) ORDER BY id", (list(ids),)).fetchall()


def unpublished(c, ids):
    return [r for r in outbox(c, ids) if r["published_at"] is None]


def backlog(c):
    with c.connect(DB) as conn:
        conn.row_factory = psycopg.rows.dict_row
        return conn.execute("SELECT * FROM feature_outbox.backlog").fetchone()


def use_http(c, receiver, secret=None):
    configure(c, endpoint=receiver.url, http_secret=secret)


def use_nats(c, nats_server):
    configure(c, endpoint=nats_server.url, http_secret=None)


def pause_relay(c):
    """An endpoint nobody listens on: the relay backs off and publishes nothing."""
    configure(c, endpoint=f"http://127.0.0.1:{free_port()}/down")


# --- NATS -----------------------------------------------------------------------------------------

def test_missing_database_is_logged_and_retried_slowly(relay):
    log = relay.missing_db_log
    assert 'feature_outbox launcher: database "relay" does not exist (see feature_outbox.database); it is served once it is created' in log
    # The launcher reads pg_database: no worker tries to connect to a database that is not there.
    assert 'FATAL:  database "relay" does not exist' not in log


def test_worker_is_visible_in_pg_stat_activity(relay):
    with relay.connect(DB) as conn:
        rows = conn.execute("SELECT backend_type, datname FROM pg_stat_activity WHERE backend_type = 'feature_outbox relay'").fetchall()
    assert rows == [("feature_outbox relay", DB)]


def test_nats_every_edit_once_with_format_and_headers(relay, nats_server):
    use_nats(relay, nats_server)
    ids = [1001, 1002, 1003]
    started = time.monotonic()
    for i in ids:
        edit(relay, i, "created", point(13.4 + i / 1000, 52.5))
    edit(relay, 1001, "moved", point(2.35, 48.85))
    edit(relay, 1002, "retired")
    wait_for(lambda: not unpublished(relay, ids), 10, "the relay to publish")
    # Woken at commit: the 60 s poll interval never elapsed.
    assert time.monotonic() - started < 10
    rows = {str(r["event_id"]): r for r in outbox(relay, ids)}
    msgs = [m for m in nats_server.messages() if m["event"]["event_id"] in rows]
    assert Counter(m["event"]["event_id"] for m in msgs) == Counter({e: 1 for e in rows})
    with relay.connect(DB) as conn:
        database_id = conn.execute("SELECT identity::text FROM feature_outbox.database_identity").fetchone()[0]
    for m in msgs:
        e, row = m["event"], rows[m["event"]["event_id"]]
        assert set(e) == EVENT_FIELDS
        assert (e["database"], e["database_id"]) == (DB, database_id)
        assert m["headers"]["Feature-Outbox-Database-Id"] == database_id
        assert m["subject"] == subject("features", row["event_type"], row["routing_key"])
        assert e["layer"] == "features" and e["properties"] == {}
        assert m["headers"]["Nats-Msg-Id"] == e["event_id"]
        assert m["headers"]["Feature-Id"] == str(row["feature_id"]) == e["feature_id"]
        assert m["headers"]["Feature-Version"] == str(row["feature_version"]) == str(e["event_version"])
        assert m["headers"]["Feature-Outbox-Database"] == DB
        # edit_feature's events are the application's, in the body and beside it.
        assert e["origin"] == row["origin"] == m["headers"]["Feature-Origin"] == "application"
        assert m["headers"].get("Previous-Routing-Key") == row["previous_routing_key"] == e["previous_routing_key"]
        assert (e["action"], e["routing_key"], e["schema_version"], e["crs"]) == (row["event_type"], row["routing_key"], 3, "EPSG:4326")
        assert RFC3339_UTC.match(e["occurred_at"]) and RFC3339_UTC.match(e["relayed_at"])
        assert e["occurred_at"] <= e["relayed_at"]
    created = next(m["event"] for m in msgs if m["event"]["feature_id"] == "1003")
    assert created["geometry"] == {"type": "Point", "coordinates": [14.403, 52.5]}
    b = backlog(relay)
    assert b["unpublished_rows"] == 0 and b["relay_workers_running"] == 1 and b["last_published_at"] is not None


def test_occurred_at_is_the_edit_time_and_geometry_is_current(relay, nats_server):
    pause_relay(relay)
    edit(relay, 1101, "created", point(1, 1))
    edit(relay, 1101, "moved", point(1.5, 1.5))
    time.sleep(1.5)
    use_nats(relay, nats_server)
    wait_for(lambda: not unpublished(relay, [1101]), 10, "the relay to publish")
    row, moved = outbox(relay, [1101])
    [msg] = [m for m in nats_server.messages() if m["event"]["event_id"] == str(row["event_id"])]
    with relay.connect(DB) as conn:
        occurred = conn.execute("SELECT to_char(%s::timestamptz AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
                                (row["created_at"],)).fetchone()[0]
    assert msg["event"]["occurred_at"] == occurred
    assert msg["event"]["relayed_at"] > msg["event"]["occurred_at"]
    # Gotcha 1: the relay sends the current geometry; event_version < geometry_version says so.
    assert (msg["event"]["event_version"], msg["event"]["geometry_version"]) == (1, 2)
    assert msg["event"]["geometry"]["coordinates"] == [1.5, 1.5]


def test_crash_between_publish_and_mark_republishes_same_event_id_on_nats(relay, nats_server):
    use_nats(relay, nats_server)
    dup_before = sum(w[0] for w in workers(relay, "duplicate_acks"))
    with relay.connect(DB) as conn:
        conn.execute("SELECT public._test_crash_after_next_publish()")
    edit(relay, 1201, "created", point(3, 3))
    wait_for(lambda: "fault injection: exiting after publish" in relay.log(), 10, "the injected crash")
    wait_for(lambda: not unpublished(relay, [1201]), 15, "the restarted worker to republish")
    [row] = outbox(relay, [1201])
    # JetStream stored it once (Nats-Msg-Id dedup) and answered the republish with a duplicate PubAck.
    assert [m["event"]["event_id"] for m in nats_server.messages()].count(str(row["event_id"])) == 1
    assert sum(w[0] for w in workers(relay, "duplicate_acks")) == dup_before + 1


def workers(c, *columns):
    with c.connect(DB) as conn:
        return conn.execute(f"SELECT {', '.join(columns)} FROM feature_outbox.workers ORDER BY worker").fetchall()


def test_terminated_worker_comes_back_and_loses_nothing(relay, nats_server):
    use_nats(relay, nats_server)
    [(pid,)] = workers(relay, "pid")
    with relay.connect(DB) as conn:
        assert conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
    ids = list(range(1301, 1311))
    for i in ids:
        edit(relay, i, "created", point(4, 4 + i / 10000))
    new_pid = wait_for(lambda: (p := workers(relay, "pid")[0][0]) and p != pid and p, 15, "a new worker pid")
    assert new_pid != pid
    wait_for(lambda: not unpublished(relay, ids), 15, "the new worker to publish")
    assert {str(r["event_id"]) for r in outbox(relay, ids)} <= {m["event"]["event_id"] for m in nats_server.messages()}


def test_nats_outage_longer_than_backoff_cap_drains_without_parking(relay, nats_server):
    use_nats(relay, nats_server)
    nats_server.stop()
    try:
        ids = list(range(1401, 1421))
        for i in ids:
            edit(relay, i, "created", point(5, 5 + i / 10000))
        time.sleep(3)  # three times the backoff cap
        b1 = backlog(relay)
        time.sleep(1)
        b2 = backlog(relay)
        assert b1["unpublished_rows"] >= len(ids) and b2["oldest_unpublished_age"] > b1["oldest_unpublished_age"]
        assert b2["parked_rows"] == 0 and b2["relay_last_error"]
        assert [r["parked_at"] for r in outbox(relay, ids)] == [None] * len(ids)
        assert worker_states(relay) == ["backing off"]
    finally:
        nats_server.start()
    wait_for(lambda: not unpublished(relay, ids), 20, "the backlog to drain after NATS came back")
    assert backlog(relay)["unpublished_rows"] == 0
    got = Counter(m["event"]["event_id"] for m in nats_server.messages())
    assert all(got[str(r["event_id"])] == 1 for r in outbox(relay, ids))
    assert "sink down" in relay.log() and "sink back" in relay.log()


def delivered_via(c, server, feature_id):
    """Makes one edit and waits until it is in `server`'s stream; returns the outbox row."""
    edit(c, feature_id, "created", point(15, 15 + feature_id / 100000))
    wait_for(lambda: not unpublished(c, [feature_id]), 15, f"delivery through {server.url}")
    [row] = outbox(c, [feature_id])
    assert str(row["event_id"]) in {m["event"]["event_id"] for m in server.messages()}
    return row


@pytest.mark.parametrize("auth", ["user:password", "token"])
def test_nats_credentials_in_the_endpoint_url(relay, auth, nats_server):
    args, userinfo, client = {
        "user:password": (("--user", "relay", "--pass", "s3cret"), "relay:s3cret@", {}),
        "token": (("--auth", "t0ken"), "t0ken@", {}),
    }[auth]
    server = NatsServer(RUN_DIR / f"nats-{auth.replace(':', '-')}", *args, userinfo=userinfo, **client)
    server.start()
    try:
        configure(relay, endpoint=server.url)
        delivered_via(relay, server, 1501 if auth == "token" else 1502)
    finally:
        use_nats(relay, nats_server)
        server.stop()


def test_nats_several_servers_one_down(relay, nats_server):
    configure(relay, endpoint=f"nats://127.0.0.1:{free_port()}, {nats_server.url}")
    try:
        delivered_via(relay, nats_server, 1503)
    finally:
        use_nats(relay, nats_server)


def test_nats_tls_with_private_ca_and_no_insecure_fallback(relay, nats_server):
    import ssl
    ca, cert, key = make_tls(RUN_DIR / "tls")
    context = ssl.create_default_context(cafile=str(ca))
    server = NatsServer(RUN_DIR / "nats-tls", "--tls", "--tlscert", str(cert), "--tlskey", str(key), scheme="tls", tls=context)
    server.start()
    try:
        # Without the CA the certificate is unknown: the relay reports it and publishes nothing.
        configure(relay, endpoint=server.url, tls_ca_file=None)
        edit(relay, 1504, "created", point(16, 16))
        wait_for(lambda: (backlog(relay)["relay_last_error"] or "").lower().count("certificate"), 15, "a certificate error")
        assert unpublished(relay, [1504])
        configure(relay, tls_ca_file=str(ca))
        wait_for(lambda: not unpublished(relay, [1504]), 15, "delivery over TLS once the CA is trusted")
        assert {str(r["event_id"]) for r in outbox(relay, [1504])} <= {m["event"]["event_id"] for m in server.messages()}
    finally:
        configure(relay, tls_ca_file=None)
        use_nats(relay, nats_server)
        server.stop()


def test_event_over_a_tiny_nats_max_payload_goes_by_reference_in_many_chunks(relay, nats_server):
    server = NatsServer(RUN_DIR / "nats-small", max_payload=1024)
    server.start()
    try:
        pause_relay(relay)
        ring = [[20 + i / 100, 20] for i in range(100)] + [[21, 21], [20, 20]]
        geometry = {"type": "Polygon", "coordinates": [ring]}
        edit(relay, 1601, "created", json.dumps(geometry))  # ~4 KB event: several object chunks
        edit(relay, 1602, "created", point(17, 17))
        configure(relay, endpoint=server.url)
        wait_for(lambda: not unpublished(relay, [1601, 1602]), 15, "both events")
        [big] = [m["event"] for m in server.messages() if m["event"]["feature_id"] == "1601"]
        assert big["geometry"] is None and big["geometry_ref"]["name"] == big["event_id"]
        assert json.loads(get_object(server, "FEATURES_GEOMETRY", big["event_id"])) == geometry
    finally:
        use_nats(relay, nats_server)
        server.stop()


# --- HTTP -----------------------------------------------------------------------------------------

def requests_for(receiver, event_id, path="/hook"):
    with receiver.lock:
        return [r for r in receiver.requests if r["headers"].get("webhook-id") == event_id and r["path"] == path]


def test_http_every_edit_once_signed_with_standard_webhooks(relay, receiver):
    receiver.respond = lambda r: (200, {})
    use_http(relay, receiver, SECRET)
    ids = [2001, 2002]
    for i in ids:
        edit(relay, i, "created", point(6, 6 + i / 10000))
    edit(relay, 2001, "moved", point(6.5, 6.5))
    wait_for(lambda: not unpublished(relay, ids), 10, "the relay to POST")
    verifier = Webhook(SECRET)
    for row in outbox(relay, ids):
        [req] = requests_for(receiver, str(row["event_id"]))
        h = req["headers"]
        assert h["content-type"] == "application/json"
        assert h["idempotency-key"] == h["webhook-id"] == str(row["event_id"])
        assert abs(int(h["webhook-timestamp"]) - time.time()) < 60
        assert h["feature-outbox-database"] == DB  # the database that wrote it (many databases, one receiver)
        assert h["webhook-signature"].startswith("v1,")
        # The standardwebhooks library's verifier accepts it (and so checks the HMAC-SHA256).
        event = verifier.verify(req["body"], {k: h[k] for k in ("webhook-id", "webhook-timestamp", "webhook-signature")})
        assert set(event) == EVENT_FIELDS and event["event_id"] == str(row["event_id"])
        assert event["origin"] == row["origin"] == h["feature-origin"] == "application"
        tampered = req["body"].replace(b"EPSG:4326", b"EPSG:3857")
        with pytest.raises(Exception):
            verifier.verify(tampered, {k: h[k] for k in ("webhook-id", "webhook-timestamp", "webhook-signature")})


def test_https_with_private_ca_and_no_insecure_fallback(relay):
    import ssl
    ca, cert, key = make_tls(RUN_DIR / "tls-http")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    secure = Receiver(tls=context)
    try:
        configure(relay, endpoint=secure.url, tls_ca_file=None)
        edit(relay, 2051, "created", point(6, 7))
        wait_for(lambda: "certificate" in (backlog(relay)["relay_last_error"] or "").lower(), 15, "a certificate error")
        assert unpublished(relay, [2051]) and not secure.requests
        configure(relay, tls_ca_file=str(ca))
        wait_for(lambda: not unpublished(relay, [2051]), 15, "delivery over HTTPS once the CA is trusted")
        assert len(secure.requests) == 1
    finally:
        configure(relay, tls_ca_file=None)
        secure.close()


def test_http_crash_between_publish_and_mark_delivers_event_id_twice(relay, receiver):
    receiver.respond = lambda r: (200, {})
    use_http(relay, receiver)
    with relay.connect(DB) as conn:
        conn.execute("SELECT public._test_crash_after_next_publish()")
    edit(relay, 2101, "created", point(7, 7))
    wait_for(lambda: not unpublished(relay, [2101]), 15, "the restarted worker to republish")
    [row] = outbox(relay, [2101])
    assert len(requests_for(receiver, str(row["event_id"]))) == 2


def scripted(statuses_by_call):
    """Answers the n-th request for an event with statuses_by_call[n] (the last one repeats)."""
    seen = Counter()

    def respond(request):
        n = seen[request["headers"].get("webhook-id")]
        seen[request["headers"].get("webhook-id")] += 1
        return statuses_by_call[min(n, len(statuses_by_call) - 1)]
    return respond


def test_http_500_500_200_is_delivered_once_with_two_attempts(relay, receiver):
    receiver.respond = scripted([(500, {}), (500, {}), (200, {})])
    use_http(relay, receiver)
    edit(relay, 2201, "created", point(8, 8))
    wait_for(lambda: not unpublished(relay, [2201]), 15, "delivery after two 500s")
    [row] = outbox(relay, [2201])
    assert row["attempts"] == 2 and row["parked_at"] is None and "HTTP 500" in row["last_error"]
    assert [r["path"] for r in requests_for(receiver, str(row["event_id"]))] == ["/hook"] * 3


def test_http_429_retry_after_is_honoured(relay, receiver):
    configure(relay, retry_backoff_max="5s")
    try:
        receiver.respond = scripted([(429, {"Retry-After": "2"}), (200, {})])
        use_http(relay, receiver)
        edit(relay, 2301, "created", point(9, 9))
        wait_for(lambda: not unpublished(relay, [2301]), 15, "delivery after 429")
        [row] = outbox(relay, [2301])
        first, second = requests_for(receiver, str(row["event_id"]))
        assert second["at"] - first["at"] >= 2.0
    finally:
        configure(relay, retry_backoff_max="1s")


def test_http_400_parks_after_max_attempts_while_later_events_flow(relay, receiver):
    bad = {"2401"}

    def respond(request):
        return (400, {}) if json.loads(request["body"])["feature_id"] in bad else (200, {})
    receiver.respond = respond
    use_http(relay, receiver)
    for i in range(2401, 2406):
        edit(relay, i, "created", point(10, 10 + i / 10000))
    wait_for(lambda: not unpublished(relay, range(2402, 2406)), 10, "the events behind the bad one")
    try:
        wait_for(lambda: outbox(relay, [2401])[0]["parked_at"], 15, "the bad row to be parked")
    except AssertionError:
        print(outbox(relay, [2401]), backlog(relay), workers(relay, "*"))
        raise
    [row] = outbox(relay, [2401])
    assert row["attempts"] == row["row_failures"] == 3
    assert row["published_at"] is None and "HTTP 400" in row["last_error"]
    assert len(requests_for(receiver, str(row["event_id"]))) == 3
    b = backlog(relay)
    assert b["parked_rows"] == 1 and b["oldest_parked_at"] is not None
    assert b["oldest_unpublished_at"] is None  # a parked row does not hold the age alert on
    assert "parked after feature_outbox.max_attempts" in relay.log()
    # retry_parked() requeues it; once the receiver accepts, it is delivered.
    bad.clear()
    with relay.connect(DB) as conn:
        assert conn.execute("SELECT feature_outbox.retry_parked()").fetchone()[0] == 1
    wait_for(lambda: not unpublished(relay, [2401]), 10, "the requeued row")
    assert backlog(relay)["parked_rows"] == 0


def test_http_301_is_never_followed_nor_delivered(relay, receiver):
    moved = {}

    def respond(request):
        if request["path"] == "/hook" and request["headers"].get("webhook-id") in moved:
            return 301, {"Location": "/elsewhere"}
        return 200, {}
    receiver.respond = respond
    pause_relay(relay)
    edit(relay, 2501, "created", point(11, 11))
    [row] = outbox(relay, [2501])
    moved[str(row["event_id"])] = True
    use_http(relay, receiver)
    wait_for(lambda: len(requests_for(receiver, str(row["event_id"]))) >= 2, 10, "two tries")
    assert unpublished(relay, [2501]) and outbox(relay, [2501])[0]["parked_at"] is None
    assert not [r for r in receiver.requests if r["path"] == "/elsewhere"]
    assert "301" in backlog(relay)["relay_last_error"]
    moved.clear()
    wait_for(lambda: not unpublished(relay, [2501]), 10, "delivery once the endpoint answers 200")


def test_hard_deleted_feature_is_published_with_null_geometry(relay, receiver):
    receiver.respond = lambda r: (200, {})
    pause_relay(relay)
    edit(relay, 2601, "created", point(12, 12))
    with relay.connect(DB) as conn:
        conn.execute("DELETE FROM feature_outbox.features WHERE id = 2601")
    use_http(relay, receiver)
    wait_for(lambda: not unpublished(relay, [2601]), 10, "the orphaned event")
    [row] = outbox(relay, [2601])
    [req] = requests_for(receiver, str(row["event_id"]))
    event = json.loads(req["body"])
    assert event["geometry"] is None and event["geometry_version"] is None and event["event_version"] == 1


def test_a_geometry_geojson_cannot_carry_fails_alone(relay, receiver):
    """A NaN written straight into the table (bypassing edit_feature) cannot be encoded: that event
    is parked after max_attempts, and the events around it, a nested collection among them, flow."""
    receiver.respond = lambda r: (200, {})
    pause_relay(relay)
    edit(relay, 2801, "created", point(14, 14))
    edit(relay, 2802, "created", json.dumps({"type": "GeometryCollection", "geometries": [
        {"type": "GeometryCollection", "geometries": [{"type": "Point", "coordinates": [1, 2]}]}]}))
    edit(relay, 2803, "created", point(14, 14.5))
    with relay.connect(DB) as conn:
        conn.execute("UPDATE feature_outbox.features SET geom = ST_SetSRID(ST_MakePoint('NaN'::float8, 1), 4326) WHERE id = 2801")
    use_http(relay, receiver)
    wait_for(lambda: not unpublished(relay, [2802, 2803]), 10, "the events around the broken one")
    wait_for(lambda: outbox(relay, [2801])[0]["parked_at"], 15, "the unencodable event to be parked")
    [bad] = outbox(relay, [2801])
    assert "non-finite" in bad["last_error"] and bad["row_failures"] == 3
    [nested] = [json.loads(r["body"]) for r in receiver.requests if json.loads(r["body"])["feature_id"] == "2802"]
    assert nested["geometry"]["geometries"][0]["type"] == "GeometryCollection"
    with relay.connect(DB) as conn:
        conn.execute("DELETE FROM feature_outbox.outbox WHERE feature_id = 2801")


def test_metrics_are_prometheus_text(relay):
    with relay.connect(DB) as conn:
        text = conn.execute("SELECT feature_outbox.metrics()").fetchone()[0]
        relayed = conn.execute("SELECT sum(relayed_rows) FROM feature_outbox.workers").fetchone()[0]
    assert text.endswith("\n")
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    db = f'database="{DB}"'  # every series names its database: one scrape job serves many
    assert sum(int(samples[f'outbox_rows_relayed_total{{{db},event_type="{t}"}}']) for t in ("created", "moved", "retired")) == relayed > 0
    assert f"outbox_unpublished_rows{{{db}}}" in samples and f"outbox_oldest_unpublished_age_seconds{{{db}}}" in samples
    assert all("{" + db in name for name in samples), samples
    assert "# TYPE outbox_rows_relayed_total counter" in text


def test_create_extension_elsewhere_says_no_relay_serves_it(relay):
    relay.create_db("elsewhere")
    notices = []
    with relay.connect("elsewhere") as conn:
        conn.add_notice_handler(lambda n: notices.append(n.message_primary))
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
    assert any('no feature_outbox relay serves database "elsewhere"' in n for n in notices), notices


def test_retention_deletes_old_published_rows(relay, receiver):
    receiver.respond = lambda r: (200, {})
    use_http(relay, receiver)
    edit(relay, 2701, "created", point(13, 13))
    wait_for(lambda: not unpublished(relay, [2701]), 10, "publication")
    configure(relay, retention="1s")
    time.sleep(1.5)
    try:
        edit(relay, 2702, "created", point(13, 13.1))  # wakes the worker, which then runs retention
        wait_for(lambda: not outbox(relay, [2701]), 10, "retention to delete the published row")
    finally:
        configure(relay, retention=None)


def test_batch_larger_than_the_nats_client_in_flight_limit(relay, nats_server):
    """async-nats keeps at most 5,000 PubAcks in flight; a batch of 6,000 must still go out."""
    configure(relay, batch_size=6000)
    pause_relay(relay)
    ids = list(range(5001, 11001))
    with relay.connect(DB) as conn:
        conn.execute("SELECT feature_outbox.edit_feature(i, format('{\"type\":\"Point\",\"coordinates\":[%%s,30]}', i %% 170), 'created') FROM unnest(%s::bigint[]) i", (ids,))
    try:
        use_nats(relay, nats_server)
        wait_for(lambda: not unpublished(relay, ids), 60, "a 6,000-row batch to be published")
    finally:
        configure(relay, batch_size=None)


def test_two_workers_share_the_work_and_publish_nothing_twice(relay, receiver):
    receiver.respond = lambda r: (200, {})
    configure(relay, relay_workers=2, batch_size=50)
    relay.restart()
    wait_for(lambda: worker_states(relay) == ["idle", "idle"], 20, "two idle workers")
    pause_relay(relay)
    ids = list(range(3001, 4001))
    with relay.connect(DB) as conn:
        conn.execute("SELECT feature_outbox.edit_feature(i, format('{\"type\":\"Point\",\"coordinates\":[%%s,20]}', i %% 170), 'created') FROM unnest(%s::bigint[]) i", (ids,))
    with receiver.lock:
        receiver.requests.clear()
    use_http(relay, receiver)
    wait_for(lambda: not unpublished(relay, ids), 60, "two workers to drain 1000 rows")
    per_worker = [w[0] for w in workers(relay, "relayed_rows")]
    assert len(per_worker) == 2 and all(n > 0 for n in per_worker), per_worker
    got = Counter(r["headers"]["webhook-id"] for r in receiver.requests)
    assert set(got) == {str(r["event_id"]) for r in outbox(relay, ids)} and max(got.values()) == 1
    configure(relay, relay_workers=None, batch_size=None)


def test_replay_published_sends_again_what_a_sink_lost(relay, nats_server):
    """A stream that lost acknowledged messages (deleted here, and so its duplicate tracking too)
    gets them back from the retained outbox rows, with the same event_ids; an ordinary role may not
    replay. A purge would not do: JetStream keeps the purged messages' ids for its duplicate window
    and would drop the replay as duplicates."""
    use_nats(relay, nats_server)
    ids = [880101, 880102, 880103]
    since = relay.connect(DB).execute("SELECT now()").fetchone()[0]
    for i in ids:
        edit(relay, i, "created", point(12 + i / 10000, 45))
    wait_for(lambda: not unpublished(relay, ids), 10, "the relay to publish")
    events = {str(r["event_id"]) for r in outbox(relay, ids)}

    async def delete():
        nc = await nats_client.connect(nats_server.url)
        await nc.jetstream().delete_stream("FEATURES")
        await nc.close()
    asyncio.run(delete())
    assert not {m["event"]["event_id"] for m in nats_server.messages()} & events
    with relay.connect(DB) as conn:
        assert conn.execute("SELECT feature_outbox.replay_published(%s, 'features')", (since,)).fetchone()[0] >= len(ids)
    # The first publish finds no stream; the worker reconnects, creates it again and publishes.
    wait_for(lambda: not unpublished(relay, ids), 20, "the replay to be published")
    assert events <= {m["event"]["event_id"] for m in nats_server.messages()}
    with relay.connect(DB) as su:
        su.execute("DROP ROLE IF EXISTS replayer")
        su.execute("CREATE ROLE replayer LOGIN")
    with psycopg.connect(relay.dsn(DB).replace("user=postgres", "user=replayer"), autocommit=True) as plain:
        with pytest.raises(psycopg.Error) as e:
            plain.execute("SELECT feature_outbox.replay_published(now())")
        assert e.value.sqlstate == "42501"


def test_drop_extension_sends_the_workers_away_and_create_brings_them_back(relay, receiver):
    """Runs last in this module: it drops the extension (and so every outbox row) in the relay's database.
    A database without the extension holds no worker (no session that would block DROP DATABASE), and
    CREATE EXTENSION's commit brings them back within 2 s, without a restart."""
    receiver.respond = lambda r: (200, {})
    use_http(relay, receiver)
    configure(relay, poll_interval="60s")  # only the commits wake anything
    running = len(workers(relay, "pid"))
    assert running and len(relay_pids(relay, DB)) == running
    with relay.connect(DB) as conn:
        conn.execute("DROP EXTENSION feature_outbox")
    wait_for(lambda: len(relay_pids(relay, DB)) == 0, 2, "the workers to leave at DROP EXTENSION's commit")
    assert "extension feature_outbox dropped; its relay workers leave this database" in relay.log()
    for _ in range(10):  # no probe comes back to look meanwhile
        time.sleep(0.2)
        assert len(relay_pids(relay, DB)) == 0
    with relay.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox")
    created = time.monotonic()
    wait_for(lambda: worker_states(relay) == ["idle"] * running, 2, "the workers to come back at CREATE EXTENSION's commit")
    print(f"workers back {time.monotonic() - created:.2f} s after CREATE EXTENSION")
    edit(relay, 9001, "created", point(18, 18))
    wait_for(lambda: not unpublished(relay, [9001]), 10, "delivery after the extension came back")
