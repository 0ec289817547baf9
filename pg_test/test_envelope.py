"""Events in the ecosystem's envelopes (issue 23): binary-mode CloudEvents 1.0 on NATS and HTTP, read
back with the CloudEvents SDK's binary reader, and the writer's W3C trace context, from an
OpenTelemetry span of the Python SDK to a NATS consumer and an HTTP receiver. Real nats-server, real
receiver, no mocks."""

import json
import random

import psycopg
import pytest
from cloudevents.core.bindings.http import HTTPMessage, from_binary_event
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from standardwebhooks.webhooks import Webhook

from relay_harness import all_published, nats_fixture, receiver, relay_cluster, wait_for  # noqa: F401 (receiver: a fixture)
from relay_harness import reconfigure as configure

DB = "envelope"
SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SCHEMA = "urn:feature-outbox:event-schema:3"
# A text key that needs percent-encoding in a header: space, double quote, percent, non-ASCII.
ODD_KEY = 'Gate 7 "north" 100% Köln'

nats_server = nats_fixture("nats_envelope")


@pytest.fixture(scope="module")
def relay(nats_server):
    c = relay_cluster("envelope", DB, "feature_outbox.poll_interval = '60s'", f"feature_outbox.endpoint = '{nats_server.url}'",
                      setup=("CREATE SCHEMA app",
                             """CREATE TABLE app.gates (id text PRIMARY KEY, geom geometry(Point, 4326) NOT NULL,
                                                        version integer NOT NULL DEFAULT 0, name text)""",
                             "SELECT feature_outbox.register_layer('gates', 'app.gates', properties => '{name}')"))
    yield c
    c.stop()


def point(lon, lat):
    return json.dumps({"type": "Point", "coordinates": [lon, lat]})


def edit_every_kind(c, first: int) -> None:
    """created, moved (out of its cell: a departure notice too), updated and retired on a text-keyed
    layer and on the built-in one, then a backfill of the text-keyed layer (snapshots)."""
    k1, k2 = f"{ODD_KEY} {first}", f"g{first}"
    with c.connect(DB) as conn:
        e = "SELECT feature_outbox.edit_feature('gates', %s::text, %s::text, %s, %s)"
        conn.execute(e, (k1, point(13.4, 52.52), "created", json.dumps({"name": "north gate"})))
        conn.execute(e, (k2, point(13.5, 52.5), "created", json.dumps({"name": "south gate"})))
        conn.execute(e, (k1, point(2.35, 48.85), "moved", None))
        conn.execute(e, (k1, None, "updated", json.dumps({"name": "Porte du Nord"})))
        conn.execute(e, (k2, None, "retired", None))
        b = "SELECT feature_outbox.edit_feature(%s, %s::text, %s)"
        conn.execute(b, (first, point(-73.98, 40.75), "created"))
        conn.execute(b, (first, point(-0.12, 51.5), "moved"))
        conn.execute("CALL feature_outbox.backfill('gates')")


def rows_since(c, first_id: int) -> dict:
    with c.connect(DB) as conn:
        conn.row_factory = psycopg.rows.dict_row
        return {str(r["event_id"]): r for r in conn.execute(
            """SELECT o.*, coalesce(o.feature_key, o.feature_id::text) AS key,
                      (SELECT i.identity::text FROM feature_outbox.database_identity i) AS database_id
                 FROM feature_outbox.outbox o WHERE o.id > %s ORDER BY o.id""", (first_id,))}


def last_id(c) -> int:
    with c.connect(DB) as conn:
        return conn.execute("SELECT coalesce(max(id), 0) FROM feature_outbox.outbox").fetchone()[0]


def check_cloudevent(event, body: bytes, row: dict, departed: bool) -> None:
    """The attributes the README gives, each equal to the committed outbox row."""
    kind = "departed" if departed else row["event_type"]
    attrs = event.get_attributes()
    assert attrs["specversion"] == "1.0"
    assert attrs["id"] == str(row["event_id"]) + (":departed" if departed else "")
    # The database's identity, not its name (a rename keeps the source).
    assert attrs["source"] == f"/{row['database_id']}/{row['layer']}"
    assert attrs["type"] == f"features.{kind}"
    assert attrs["subject"] == row["key"]
    assert attrs["time"] == row["created_at"]
    assert attrs["datacontenttype"] == "application/json"
    assert attrs["dataschema"] == SCHEMA
    assert "traceparent" not in attrs and "tracestate" not in attrs, "an edit without trace context carries none"
    # The data is the event body as the native envelope sends it.
    data = event.get_data()
    assert data == json.loads(body)
    # An extension attribute of this project's: where the event comes from, as the body says.
    assert attrs["featureorigin"] == data["origin"] == row["origin"] == "application"
    assert (data["event_id"], data["action"], data["layer"], data["feature_id"], data["event_version"]) == (
        str(row["event_id"]), row["event_type"], row["layer"], row["key"], row["feature_version"])
    assert data["routing_key"] == row["routing_key"] and data["previous_routing_key"] == row["previous_routing_key"]


def test_every_message_of_both_sinks_is_a_cloudevent_equal_to_its_row(relay, nats_server, receiver):
    configure(relay, envelope="cloudevents", endpoint=nats_server.url, http_secret=None)
    try:
        before = last_id(relay)
        edit_every_kind(relay, 1000)
        with relay.connect(DB) as conn:
            wait_for(lambda: all_published(conn), 30, "the relay to publish every edit to NATS")
        rows = rows_since(relay, before)
        kinds = {r["event_type"] for r in rows.values()}
        assert kinds == {"created", "moved", "updated", "retired", "snapshot"}
        messages = [m for m in nats_server.messages(departed=True) if m["headers"]["Nats-Msg-Id"].split(":")[0] in rows]
        seen, departures = [], 0
        for m in messages:
            body = json.dumps(m["event"]).encode()
            event = from_binary_event(HTTPMessage(headers=m["headers"], body=body))
            departed = m["headers"]["Nats-Msg-Id"].endswith(":departed")
            row = rows[m["headers"]["Nats-Msg-Id"].split(":")[0]]
            check_cloudevent(event, body, row, departed)
            assert m["headers"]["Nats-Msg-Id"] == event.get_attributes()["id"]
            departures += departed
            if not departed:
                seen.append(str(row["event_id"]))
        assert sorted(seen) == sorted(rows), "every outbox row arrived once, as a CloudEvent"
        # Two moves left their cell (the gate to Paris, the feature to London).
        assert departures == 2
        # (source, id) is unique across events and departure notices.
        ids = [(e["headers"]["ce-source"], e["headers"]["ce-id"]) for e in messages]
        assert len(set(ids)) == len(ids)

        configure(relay, endpoint=receiver.url, http_secret=SECRET)
        before = last_id(relay)
        edit_every_kind(relay, 2000)
        with relay.connect(DB) as conn:
            wait_for(lambda: all_published(conn), 30, "the relay to publish every edit over HTTP")
        rows = rows_since(relay, before)
        with receiver.lock:
            requests = [r for r in receiver.requests if r["headers"].get("webhook-id") in rows]
        assert sorted(r["headers"]["webhook-id"] for r in requests) == sorted(rows)
        for r in requests:
            event = from_binary_event(HTTPMessage(headers=r["headers"], body=r["body"]))
            check_cloudevent(event, r["body"], rows[r["headers"]["webhook-id"]], departed=False)
            # The Standard Webhooks headers stay, and the signature still verifies.
            Webhook(SECRET).verify(r["body"], {k: r["headers"][k] for k in ("webhook-id", "webhook-timestamp", "webhook-signature")})
            assert r["headers"]["idempotency-key"] == event.get_attributes()["id"]
    finally:
        configure(relay, envelope=None, endpoint=nats_server.url, http_secret=None)


def traced_edit(c, tracer, feature_id: int, vendor: str):
    """An edit made under a span of the writer's, itself the child of a remote parent that carries a
    tracestate. The application hands the span's context to the database with SET LOCAL, as any
    driver can. Returns the span and the carrier it injected."""
    parent = SpanContext(trace_id=random.getrandbits(128), span_id=random.getrandbits(64), is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=TraceState([("acme", vendor)]))
    with tracer.start_as_current_span("edit gate", context=trace.set_span_in_context(NonRecordingSpan(parent))) as span:
        carrier = {}
        TraceContextTextMapPropagator().inject(carrier)
        with c.connect(DB) as conn:
            with conn.transaction():
                conn.execute("SELECT set_config('feature_outbox.traceparent', %s, true), "
                             "set_config('feature_outbox.tracestate', %s, true)", (carrier["traceparent"], carrier["tracestate"]))
                conn.execute("SELECT feature_outbox.edit_feature(%s, %s::text, 'created')", (feature_id, point(10, 50)))
            # The SET LOCAL ended with the transaction: the next edit has no trace.
            conn.execute("SELECT feature_outbox.edit_feature(%s, %s::text, 'created')", (feature_id + 1, point(10, 50)))
    return span, carrier


@pytest.mark.parametrize("envelope", ["native", "cloudevents"])
def test_an_edit_under_an_opentelemetry_span_continues_its_trace_at_both_sinks(relay, nats_server, receiver, envelope):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("feature_outbox test writer")
    base = 10_000 if envelope == "native" else 20_000
    propagator = TraceContextTextMapPropagator()
    written_traces = []
    try:
        for n, (sink, endpoint) in enumerate([("nats", nats_server.url), ("http", receiver.url)]):
            configure(relay, envelope=envelope, endpoint=endpoint)
            fid = base + 10 * n
            span, carrier = traced_edit(relay, tracer, fid, f"{sink}-{envelope}")
            written_traces.append(span.get_span_context().trace_id)
            with relay.connect(DB) as conn:
                wait_for(lambda: all_published(conn), 30, f"the relay to publish to {sink}")
                stored = conn.execute("SELECT feature_id, traceparent, tracestate FROM feature_outbox.outbox "
                                      "WHERE feature_id IN (%s, %s) AND layer = 'features' ORDER BY feature_id", (fid, fid + 1)).fetchall()
            assert stored == [(fid, carrier["traceparent"], carrier["tracestate"]), (fid + 1, None, None)]
            if sink == "nats":
                got = {int(m["event"]["feature_id"]): m["headers"] for m in nats_server.messages()
                       if m["event"]["feature_id"] in (str(fid), str(fid + 1))}
            else:
                with receiver.lock:
                    got = {int(json.loads(r["body"])["feature_id"]): r["headers"] for r in receiver.requests
                           if json.loads(r["body"])["feature_id"] in (str(fid), str(fid + 1))}
            assert set(got) == {fid, fid + 1}
            # The consumer's propagator finds the writer's span as the parent of what it does next.
            context = trace.get_current_span(propagator.extract(carrier=got[fid])).get_span_context()
            written = span.get_span_context()
            assert (context.trace_id, context.span_id, context.is_remote) == (written.trace_id, written.span_id, True)
            assert context.trace_state.get("acme") == f"{sink}-{envelope}"
            if envelope == "cloudevents":
                assert got[fid]["ce-traceparent"] == carrier["traceparent"]
                assert got[fid]["ce-tracestate"] == carrier["tracestate"]
            else:
                assert not any(h.lower().startswith("ce-") for h in got[fid])
            untraced = {h.lower() for h in got[fid + 1]}
            assert not untraced & {"traceparent", "tracestate", "ce-traceparent", "ce-tracestate"}
        # The spans were real ones, recorded by the SDK's provider: the two whose trace the consumers saw.
        assert sorted(s.context.trace_id for s in exporter.get_finished_spans()) == sorted(written_traces)
    finally:
        configure(relay, envelope=None, endpoint=nats_server.url)


def test_backfill_reads_the_trace_context_once_at_call_for_every_chunk(relay, nats_server):
    """backfill commits every 500 features, which ends a SET LOCAL: its snapshots past the first chunk
    carry the trace in effect at CALL all the same."""
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with relay.connect(DB) as conn:
        conn.autocommit = True
        # Rows the application loaded itself, with no events yet: backfill's usual case.
        conn.execute("""INSERT INTO app.gates (id, geom, version, name)
                        SELECT 'bulk-' || i, ST_SetSRID(ST_MakePoint(i % 100, 40 + i % 10), 4326), 0, 'bulk'
                          FROM generate_series(1, 1200) i""")
        before = last_id(relay)
        # A DO block at top level may run a procedure that commits; its set_config is a SET LOCAL.
        conn.execute(f"""DO $$ DECLARE written bigint; BEGIN
                             PERFORM set_config('feature_outbox.traceparent', '{traceparent}', true);
                             PERFORM set_config('feature_outbox.tracestate', 'acme=bulk', true);
                             CALL feature_outbox.backfill('gates', NULL, written);
                         END $$""")
        snapshots = conn.execute("SELECT traceparent, tracestate, count(*) FROM feature_outbox.outbox WHERE id > %s GROUP BY 1, 2",
                                 (before,)).fetchall()
        live = conn.execute("SELECT count(*) FROM app.gates").fetchone()[0]
        assert snapshots == [(traceparent, "acme=bulk", live)] and live > 1000
        assert conn.execute("SHOW feature_outbox.traceparent").fetchone()[0] == "", "the session's own setting is untouched"
        wait_for(lambda: all_published(conn), 30, "the relay to publish the snapshots")
    traced = [m for m in nats_server.messages() if m["event"]["action"] == "snapshot" and m["headers"].get("traceparent") == traceparent]
    assert len(traced) == live
