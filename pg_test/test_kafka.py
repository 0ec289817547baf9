"""The Kafka sink (issue 41) against a real Kafka-compatible broker (tansu): every committed edit
arrives as one message whose value is the event of the committed row, keyed by the feature so
that its events share a partition in order, in the partition Java's murmur2 gives; headers as
documented; a broker that is down delays the events and loses none."""

import json
import os
import shutil

import h3
import pytest

from conftest import RUN_DIR
from kafka_harness import Tansu, TlsProxy, java_partition
from relay_harness import make_tls, reconfigure, relay_cluster, wait_for

DB = "kafka"
PARTITIONS = 8
FEATURES, MOVES = 60, 3


@pytest.fixture(scope="module")
def broker():
    b = Tansu(RUN_DIR / "kafka_tansu")
    b.start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def relay(broker):
    c = relay_cluster("kafka", DB, "feature_outbox.relay_workers = 2", f"feature_outbox.endpoint = '{broker.url}'",
                      f"feature_outbox.kafka_partitions = {PARTITIONS}", "feature_outbox.publish_timeout = '3s'",
                      "feature_outbox.retry_backoff_max = '1s'",
                      setup=("""CREATE TABLE public.parcels (id bigint PRIMARY KEY, geom geometry(Polygon, 4326) NOT NULL,
                                                           version integer NOT NULL DEFAULT 0, name text)""",
                             "SELECT feature_outbox.register_layer('parcels', 'public.parcels', properties => '{name}')"))
    yield c
    c.stop()


def same_shape(a, b, tol=1e-9) -> bool:
    """GeoJSON geometries equal up to the rounding of ST_AsGeoJSON's decimal digits."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_shape(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_shape(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= tol
    return a == b


def published(conn) -> bool:
    return conn.execute("SELECT NOT EXISTS (SELECT FROM feature_outbox.outbox WHERE published_at IS NULL)").fetchone()[0]


def edit(conn, fid: int, step: int, event_type: str) -> dict:
    """One edit in its own transaction; what it committed: the event's id, version and content."""
    x = 2.0 + fid * 0.01 + step * 0.001
    conn.execute("""SELECT feature_outbox.edit_feature('parcels', %s::bigint, ST_MakeEnvelope(%s, 48.8, %s, 48.805, 4326),
                                                      %s, jsonb_build_object('name', %s::text))""",
                 (fid, x, x + 0.005, event_type, f"parcel {fid} v{step}"))
    row = conn.execute("""SELECT o.event_id::text, o.feature_version, ST_AsGeoJSON(p.geom)::jsonb, o.routing_key
                            FROM feature_outbox.outbox o JOIN public.parcels p ON p.id = o.feature_id
                           WHERE o.layer = 'parcels' AND o.feature_id = %s ORDER BY o.id DESC LIMIT 1""", (fid,)).fetchone()
    return {"event_id": row[0], "version": row[1], "geometry": row[2], "routing_key": row[3], "name": f"parcel {fid} v{step}",
            "action": event_type}


def test_each_committed_edit_arrives_once_as_its_row_keyed_in_javas_partition_in_order(relay, broker):
    committed = {}
    with relay.connect(DB) as conn:
        for step in range(MOVES + 1):
            for fid in range(1, FEATURES + 1):
                e = edit(conn, fid, step, "created" if step == 0 else "moved")
                committed[e["event_id"]] = (fid, e)
        wait_for(lambda: published(conn), 60, "the outbox to be published")
    assert "features.parcels" in broker.topics()
    messages = broker.messages("features.parcels")
    assert len(messages) == len(committed), f"{len(messages)} messages for {len(committed)} committed edits"
    seen, versions = set(), {}
    for m in messages:
        event = json.loads(m.value)
        fid, e = committed[event["event_id"]]
        assert event["event_id"] not in seen
        seen.add(event["event_id"])
        # The value is the event of the committed row; the key is the feature, in Java's partition.
        assert m.key == str(fid).encode()
        assert m.partition == java_partition(m.key, PARTITIONS), (m.key, m.partition)
        assert event["action"] == e["action"] and event["event_version"] == e["version"]
        assert event["layer"] == "parcels" and event["feature_id"] == str(fid)
        assert event["properties"] == {"name": e["name"]} or event["geometry_version"] > e["version"]
        if event["geometry_version"] == e["version"]:
            assert same_shape(event["geometry"], e["geometry"]), (event["geometry"], e["geometry"])
        headers = {k: v.decode() for k, v in m.headers}
        assert headers["id"] == event["event_id"] == headers["Feature-Event-Id"]
        assert headers["Feature-Schema-Version"] == str(event["schema_version"])
        assert headers["Feature-Layer"] == "parcels" and headers["Feature-Id"] == str(fid)
        assert headers["Feature-Version"] == str(e["version"]) and headers["Routing-Key"] == e["routing_key"]
        assert headers["Feature-Origin"] == event["origin"] == "application"
        # The parent cells a NATS subject carries (subject_resolutions 3,5,7 by default), by resolution.
        own = h3.get_resolution(e["routing_key"])
        parents = {f"Parent-Cell-{r}": h3.cell_to_parent(e["routing_key"], r) for r in (3, 5, 7) if r < own}
        assert {k: v for k, v in headers.items() if k.startswith("Parent-Cell-")} == parents
        if event["previous_routing_key"]:
            assert headers["Previous-Routing-Key"] == event["previous_routing_key"]
        else:
            assert "Previous-Routing-Key" not in headers
        assert headers["Feature-Outbox-Database-Id"] == event["database_id"]
        assert headers["Feature-Outbox-Database"] == event["database"] == DB
        versions.setdefault(fid, []).append((m.partition, m.offset, e["version"]))
    # Per feature, one partition, and its versions in offset order.
    for fid, v in versions.items():
        assert len({p for p, _, _ in v}) == 1, (fid, v)
        assert [ver for _, _, ver in sorted(v)] == sorted(ver for _, _, ver in v), (fid, v)


def test_a_broker_that_is_down_delays_events_and_loses_none(relay, broker):
    broker.stop()
    try:
        with relay.connect(DB) as conn:
            ids = [edit(conn, fid, 10, "moved")["event_id"] for fid in range(1, 11)]
            wait_for(lambda: conn.execute("SELECT bool_or(state = 'backing off') FROM feature_outbox.workers").fetchone()[0],
                     30, "a worker to back off")
            row = conn.execute("""SELECT count(*) FILTER (WHERE published_at IS NULL), max(row_failures),
                                         count(*) FILTER (WHERE parked_at IS NOT NULL)
                                    FROM feature_outbox.outbox WHERE event_id::text = ANY(%s)""", (ids,)).fetchone()
            assert row == (10, 0, 0), f"waiting, row failures, parked: {row}"
    finally:
        broker.start()
    with relay.connect(DB) as conn:
        wait_for(lambda: published(conn), 60, "the outbox to be published after the broker came back")
    got = [json.loads(m.value)["event_id"] for m in broker.messages("features.parcels")]
    assert set(ids) <= set(got), set(ids) - set(got)


def test_cloudevents_messages_parse_with_the_sdks_kafka_binding(relay, broker):
    """Under feature_outbox.envelope = cloudevents: binary mode of the CloudEvents Kafka protocol
    binding (ce_ headers, content-type), read by the CloudEvents SDK's own Kafka conversion."""
    from cloudevents.v1.kafka.conversion import KafkaMessage, from_binary
    from relay_harness import configure
    configure(relay, envelope="cloudevents")
    try:
        import time
        time.sleep(1)  # the workers take the reload
        with relay.connect(DB) as conn:
            e = edit(conn, 900, 0, "created")
            wait_for(lambda: published(conn), 30, "the outbox to be published")
        m = next(m for m in broker.messages("features.parcels") if json.loads(m.value)["event_id"] == e["event_id"])
        headers = {k: v for k, v in m.headers}
        ce = from_binary(KafkaMessage(headers=headers, key=m.key, value=m.value))
        event = json.loads(m.value)
        assert ce["id"] == e["event_id"] and ce["specversion"] == "1.0"
        assert ce["source"] == f"/{event['database_id']}/parcels"
        assert ce["type"] == "features.created" and ce["subject"] == "900"
        assert ce["datacontenttype"] == "application/json"
        assert headers["ce_partitionkey"] == b"900" and ce["partitionkey"] == b"900"
        assert ce["featureorigin"] == event["origin"] == "application"
        assert ce.data == event
        assert headers["id"].decode() == e["event_id"]  # the native headers stay beside the ce_ ones
    finally:
        configure(relay, envelope=None)


def relay_through(relay, broker, first_fid: int, **settings) -> list[str]:
    """Points the relay at `broker` with `settings`, makes three edits and returns their event ids."""
    reconfigure(relay, endpoint=broker_url(broker), **settings)
    with relay.connect(DB) as conn:
        return [edit(conn, fid, 0, "created")["event_id"] for fid in range(first_fid, first_fid + 3)]


def broker_url(broker) -> str:
    return broker if isinstance(broker, str) else broker.url


def worker_error(relay, since) -> str:
    """The workers' last errors recorded after `since` (the database's clock)."""
    with relay.connect(DB) as conn:
        return " ".join(e or "" for (e,) in conn.execute("SELECT last_error FROM feature_outbox.workers WHERE last_error_at > %s",
                                                        (since,)).fetchall())


def db_now(relay):
    with relay.connect(DB) as conn:
        return conn.execute("SELECT clock_timestamp()").fetchone()[0]


def wait_published(relay, ids, what: str) -> None:
    with relay.connect(DB) as conn:
        wait_for(lambda: not conn.execute("""SELECT count(*) FROM feature_outbox.outbox
                                              WHERE event_id::text = ANY(%s) AND published_at IS NULL""", (ids,)).fetchone()[0],
                 60, what)


def password_file(name: str, password: str) -> str:
    path = RUN_DIR / "kafka_secrets" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(password + "\n")
    shutil.chown(path, "postgres") if os.getuid() == 0 else None
    path.chmod(0o600)
    return str(path)


# The cluster's endpoint is in postgresql.auto.conf (relay_cluster): a test that changes it puts the
# module's broker back rather than RESET it.
RESET = dict(kafka_security_protocol=None, kafka_sasl_mechanism=None, kafka_sasl_username=None,
             kafka_sasl_password_file=None, tls_ca_file=None)


def test_sasl_scram_with_the_password_read_from_a_file(relay, broker):
    """SCRAM-SHA-512 against a broker that requires it: a wrong password is a sink that is down
    (nothing counted against the rows, the reason in the workers view); the right one delivers."""
    secure = Tansu(RUN_DIR / "kafka_tansu_sasl", authentication=True)
    secure.start()
    try:
        secure.add_user("relay", "correct horse")
        sasl = dict(kafka_security_protocol="sasl_plaintext", kafka_sasl_mechanism="SCRAM-SHA-512", kafka_sasl_username="relay")
        since = db_now(relay)
        ids = relay_through(relay, secure, 2000, kafka_sasl_password_file=password_file("wrong", "battery staple"), **sasl)
        wait_for(lambda: "Kafka" in worker_error(relay, since), 30, "the workers to report the refused login")
        assert "authentication" in worker_error(relay, since).lower(), worker_error(relay, since)
        with relay.connect(DB) as conn:
            row = conn.execute("""SELECT count(*) FILTER (WHERE published_at IS NULL), max(row_failures)
                                    FROM feature_outbox.outbox WHERE event_id::text = ANY(%s)""", (ids,)).fetchone()
        assert row == (3, 0), row
        # The password's content is nowhere in SQL: only the file's path is a setting.
        with relay.connect(DB) as conn:
            shown = " ".join(v for (v,) in conn.execute("SELECT setting FROM pg_settings WHERE name LIKE 'feature_outbox.%'"))
        assert "battery" not in shown and "correct horse" not in shown
        reconfigure(relay, kafka_sasl_password_file=password_file("right", "correct horse"))
        wait_published(relay, ids, "delivery once the password is right")
        got = {json.loads(m.value)["event_id"] for m in secure.messages("features.parcels")}
        assert set(ids) <= got
    finally:
        reconfigure(relay, endpoint=broker.url, **RESET)
        secure.stop()


def test_tls_through_a_proxy_with_a_private_ca_and_no_insecure_fallback(relay, broker):
    """security.protocol ssl through nginx's stream module in front of the broker: without the
    private CA the certificate is refused and nothing is sent; with it, the events arrive."""
    ca, cert, key = make_tls(RUN_DIR / "kafka_tls")
    proxy = TlsProxy(RUN_DIR / "kafka_tls_proxy", cert, key)
    behind = Tansu(RUN_DIR / "kafka_tansu_tls", advertise=proxy.address)
    behind.start()
    proxy.start(behind.address)
    try:
        url = f"kafka://{proxy.address}"
        since = db_now(relay)
        ids = relay_through(relay, url, 3000, kafka_security_protocol="ssl")
        wait_for(lambda: "Kafka" in worker_error(relay, since), 30, "the workers to refuse the unknown CA")
        assert "certificate" in worker_error(relay, since).lower(), worker_error(relay, since)
        with relay.connect(DB) as conn:
            waiting = conn.execute("""SELECT count(*) FROM feature_outbox.outbox
                                       WHERE event_id::text = ANY(%s) AND published_at IS NULL""", (ids,)).fetchone()[0]
        assert waiting == 3
        reconfigure(relay, tls_ca_file=str(ca))
        wait_published(relay, ids, "delivery through the TLS proxy")
        # Read back through the proxy too: the broker advertises only the proxy's address.
        behind.client = {"security_protocol": "SSL", "ssl_cafile": str(ca)}
        behind.port, plain = proxy.port, behind.port
        try:
            got = {json.loads(m.value)["event_id"] for m in behind.messages("features.parcels")}
        finally:
            behind.port = plain
        assert set(ids) <= got
    finally:
        reconfigure(relay, endpoint=broker.url, **RESET)
        proxy.stop()
        behind.stop()


def test_an_event_over_the_message_limit_parks_at_once_naming_size_and_limit(relay, broker):
    """Kafka has no object store for a large geometry: an event over message.max.bytes parks at its
    first try, its error naming its size and the limit; the relay goes on with the next events."""
    with relay.connect(DB) as conn:
        # About 80,000 vertices: a GeoJSON body of about 3 MB.
        conn.execute("""SELECT feature_outbox.edit_feature('parcels', 4000::bigint,
                               ST_Buffer(ST_SetSRID(ST_MakePoint(2.35, 48.85), 4326), 0.01, 20000), 'created')""")
        small = edit(conn, 4001, 0, "created")["event_id"]
        wait_for(lambda: conn.execute("""SELECT parked_at IS NOT NULL FROM feature_outbox.outbox
                                          WHERE layer = 'parcels' AND feature_id = 4000""").fetchone()[0], 30, "the large event to park")
        attempts, error = conn.execute("""SELECT row_failures, last_error FROM feature_outbox.outbox
                                           WHERE layer = 'parcels' AND feature_id = 4000""").fetchone()
        wait_published(relay, [small], "the small event after it")
    assert "1000000" in error and "bytes" in error, error
    size = int(error.split(" bytes")[0].split()[-1])
    assert size > 1_000_000, error
    with relay.connect(DB) as conn:
        conn.execute("DELETE FROM feature_outbox.outbox WHERE layer = 'parcels' AND feature_id = 4000")
