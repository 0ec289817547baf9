"""Webhooks at their speed (issue 24): requests in flight per worker (feature_outbox.http_concurrency)
over pooled keep-alive connections, and batched requests (feature_outbox.http_batch): one signed JSON
array per request, acknowledged as a whole, a 500 redelivering all of it and a 400 parking only the
event the receiver refuses. A real cluster, a real receiver, every event checked against its row."""

import json

import psycopg
import pytest
from cloudevents.core.formats.json import JSONFormat
from standardwebhooks.webhooks import Webhook

from relay_harness import point_edits, receiver, relay_cluster, wait_for  # noqa: F401 (receiver: a fixture)
from relay_harness import reconfigure as configure

DB = "webhooks"
SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@pytest.fixture(scope="module")
def relay(receiver):
    c = relay_cluster("webhooks", DB, "feature_outbox.poll_interval = '60s'", "feature_outbox.max_attempts = 3",
                      "feature_outbox.retry_backoff_min = '50ms'", "feature_outbox.retry_backoff_max = '200ms'",
                      f"feature_outbox.endpoint = '{receiver.url}'", f"feature_outbox.http_secret = '{SECRET}'")
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def fresh_receiver(receiver):
    receiver.respond = lambda request: (200, {})
    receiver.delay = 0.0
    with receiver.lock:
        receiver.requests.clear()
        receiver.max_in_flight = 0
    yield


def outbox(c, first, n) -> dict:
    with c.connect(DB) as conn:
        conn.row_factory = psycopg.rows.dict_row
        return {str(r["event_id"]): r for r in conn.execute(
            "SELECT o.*, (SELECT i.identity::text FROM feature_outbox.database_identity i) AS database_id"
            "  FROM feature_outbox.outbox o WHERE feature_id BETWEEN %s AND %s ORDER BY id", (first, first + n - 1))}


def settle(c, first, n):
    with c.connect(DB) as conn:
        wait_for(lambda: conn.execute("""SELECT count(*) FROM feature_outbox.outbox WHERE feature_id BETWEEN %s AND %s
                                            AND published_at IS NULL AND parked_at IS NULL""", (first, first + n - 1)).fetchone()[0] == 0,
                 60, "the relay to settle every event")


def events_of(request) -> list[dict]:
    body = json.loads(request["body"])
    return body if isinstance(body, list) else [body]


def check_event(event: dict, row: dict) -> None:
    """The event as point_edits committed its row."""
    i = row["feature_id"]
    assert (event["event_id"], event["action"], event["feature_id"], event["event_version"]) == (
        str(row["event_id"]), row["event_type"], str(i), row["feature_version"])
    assert event["routing_key"] == row["routing_key"]
    assert (event["database"], event["database_id"]) == (DB, row["database_id"])
    assert event["geometry"] == {"type": "Point", "coordinates": [(i % 340) - 170, (i % 160) - 80]}
    assert event["origin"] == row["origin"]


def delivered(receiver, rows) -> dict:
    """event_id -> the events of every 2xx request that carried it."""
    got = {}
    for r in receiver.requests:
        if r.get("status", 200) >= 300:
            continue
        for e in events_of(r):
            if e["event_id"] in rows:
                got.setdefault(e["event_id"], []).append(e)
    return got


def refuse(receiver, status: int, feature_id: str, once: bool) -> list[list[str]]:
    """The receiver answers `status` to the requests that carry `feature_id`'s event (with `once`, to
    the first of them only) and 200 to the rest. Returns each refused request's event ids, in order."""
    refused = []

    def respond(request):
        events = events_of(request)
        if any(e["feature_id"] == feature_id for e in events) and not (once and refused):
            refused.append([e["event_id"] for e in events])
            request["status"] = status
            return status, {}
        return 200, {}
    receiver.respond = respond
    return refused


def edit_and_settle(c, first: int, n: int) -> dict:
    with c.connect(DB) as conn:
        point_edits(conn, first, n)
    settle(c, first, n)
    return outbox(c, first, n)


def test_requests_in_flight_per_worker_over_pooled_connections(relay, receiver):
    receiver.delay = 0.02  # a receiver that takes 20 ms per request
    for concurrency, first, n in [(1, 1000, 60), (8, 2000, 400)]:
        configure(relay, http_concurrency=concurrency)
        with receiver.lock:
            receiver.requests.clear()
            receiver.max_in_flight = 0
        rows = edit_and_settle(relay, first, n)
        got = delivered(receiver, rows)
        assert sorted(got) == sorted(rows) and all(len(v) == 1 for v in got.values()), "every event once"
        for event_id, [event] in got.items():
            check_event(event, rows[event_id])
        peers = {r["peer"] for r in receiver.requests}
        if concurrency == 1:
            assert receiver.max_in_flight == 1
            assert len(peers) == 1, "one keep-alive connection"
        else:
            assert receiver.max_in_flight >= 4, f"at most {receiver.max_in_flight} requests in flight"
            assert receiver.max_in_flight <= concurrency
            assert len(peers) <= 2 * concurrency, f"{len(peers)} connections for {n} requests: the pool keeps them"
    configure(relay, http_concurrency=None)


def test_a_batch_is_one_signed_json_array_of_events_equal_to_their_rows(relay, receiver):
    configure(relay, http_batch=100)
    try:
        rows = edit_and_settle(relay, 3000, 250)
        requests = [r for r in receiver.requests if any(e["event_id"] in rows for e in events_of(r))]
        assert all(isinstance(json.loads(r["body"]), list) for r in requests)
        assert max(len(events_of(r)) for r in requests) == 100 and len(requests) <= 5
        verifier = Webhook(SECRET)
        for r in requests:
            h = r["headers"]
            assert h["content-type"] == "application/json" and h["webhook-id"].startswith("batch_")
            assert h["idempotency-key"] == h["webhook-id"]
            assert h["feature-origin"] == "application"  # every event of the batch is the application's
            # Signed as one message: the whole array.
            assert verifier.verify(r["body"], {k: h[k] for k in ("webhook-id", "webhook-timestamp", "webhook-signature")}) == json.loads(r["body"])
        got = delivered(receiver, rows)
        assert sorted(got) == sorted(rows) and all(len(v) == 1 for v in got.values())
        for event_id, [event] in got.items():
            check_event(event, rows[event_id])
    finally:
        configure(relay, http_batch=None)


def test_a_batch_says_its_origin_only_when_its_events_share_it(relay, receiver):
    """Feature-Origin names the request's events' origin when they have one; each event's body says
    its own. The relay's one worker sends the four events, held until all are written, in one batch."""
    configure(relay, http_batch=100)
    held = [True]

    def respond(request):
        if held[0]:
            request["status"] = 503
            return 503, {}
        return 200, {}
    receiver.respond = respond
    try:
        first, n = 7000, 4
        with relay.connect(DB) as conn:
            point_edits(conn, first, n)
            # One event as the capture worker (issue 49) writes it, through the superuser here.
            conn.execute("UPDATE feature_outbox.outbox SET origin = 'captured' WHERE feature_id = %s", (first + 1,))
        held[0] = False
        settle(relay, first, n)
        rows = outbox(relay, first, n)
        sent = [r for r in receiver.requests if r.get("status", 200) < 300 and any(e["event_id"] in rows for e in events_of(r))]
        assert [sorted(e["event_id"] for e in events_of(r)) for r in sent] == [sorted(rows)], "one batch of the four"
        assert "feature-origin" not in sent[0]["headers"]
        for event in events_of(sent[0]):
            check_event(event, rows[event["event_id"]])
        assert sorted(e["origin"] for e in events_of(sent[0])) == ["application"] * 3 + ["captured"]
    finally:
        configure(relay, http_batch=None)


def test_a_500_for_a_batch_redelivers_all_of_it(relay, receiver):
    configure(relay, http_batch=50)
    first, n = 4000, 120
    # The requests of one claim are in flight together, so which arrives first is open: refuse the
    # one that carries the first feature's event, a batch of 50.
    refused = refuse(receiver, 500, str(first), once=True)
    try:
        rows = edit_and_settle(relay, first, n)
        [batch] = refused
        assert len(batch) == 50 and set(batch) <= set(rows)
        got = delivered(receiver, rows)
        assert sorted(got) == sorted(rows) and all(len(v) == 1 for v in got.values()), "each event once in a 2xx"
        for event_id in batch:
            check_event(got[event_id][0], rows[event_id])
            # A sink-level failure: counted, never towards parking.
            assert (rows[event_id]["attempts"], rows[event_id]["row_failures"], rows[event_id]["parked_at"]) == (1, 0, None)
        assert all(r["parked_at"] is None and r["published_at"] for r in rows.values())
    finally:
        configure(relay, http_batch=None)


def test_a_400_for_a_batch_parks_only_the_event_the_receiver_refuses(relay, receiver):
    configure(relay, http_batch=50)
    first, n = 5000, 120
    bad = str(first + 10)  # the receiver refuses every request that carries this feature's event
    batches_with_bad = refuse(receiver, 400, bad, once=False)
    try:
        rows = edit_and_settle(relay, first, n)
        [bad_id] = [k for k, r in rows.items() if str(r["feature_id"]) == bad]
        first_batch = batches_with_bad[0]
        assert len(first_batch) == 50 and bad_id in first_batch
        # Then alone, until parked after max_attempts (3).
        assert batches_with_bad[1:] == [[bad_id], [bad_id]]
        parked = {k for k, r in rows.items() if r["parked_at"] is not None}
        assert parked == {bad_id}, "only the refused event parks"
        assert (rows[bad_id]["attempts"], rows[bad_id]["row_failures"]) == (3, 3)
        assert rows[bad_id]["last_error"].startswith("HTTP 400 (a batch of 1 event)")
        got = delivered(receiver, rows)
        assert sorted(got) == sorted(set(rows) - {bad_id}) and all(len(v) == 1 for v in got.values())
        for event_id, [event] in got.items():
            check_event(event, rows[event_id])
            # The refused batch's other events failed once with it, then went through alone.
            expected = 1 if event_id in first_batch else 0
            assert (rows[event_id]["row_failures"], rows[event_id]["attempts"]) == (expected, expected), event_id
    finally:
        configure(relay, http_batch=None)
        with relay.connect(DB) as conn:
            conn.execute("DELETE FROM feature_outbox.outbox WHERE parked_at IS NOT NULL")


def test_cloudevents_batches_are_the_json_batch_format(relay, receiver):
    configure(relay, http_batch=20, envelope="cloudevents")
    try:
        rows = edit_and_settle(relay, 6000, 50)
        requests = [r for r in receiver.requests if any(e.get("id") in rows for e in json.loads(r["body"]))]
        assert requests and all(r["headers"]["content-type"] == "application/cloudevents-batch+json" for r in requests)
        seen = []
        for r in requests:
            Webhook(SECRET).verify(r["body"], {k: r["headers"][k] for k in ("webhook-id", "webhook-timestamp", "webhook-signature")})
            for member in json.loads(r["body"]):
                event = JSONFormat().read(None, json.dumps(member))
                attrs = event.get_attributes()
                row = rows[attrs["id"]]
                assert (attrs["specversion"], attrs["source"], attrs["type"], attrs["subject"], attrs["time"], attrs["datacontenttype"],
                        attrs["dataschema"]) == ("1.0", f"/{row['database_id']}/features", f"features.{row['event_type']}", str(row["feature_id"]),
                                                 row["created_at"], "application/json", "urn:feature-outbox:event-schema:3")
                check_event(event.get_data(), row)
                assert attrs["featureorigin"] == "application"
                seen.append(attrs["id"])
        assert sorted(seen) == sorted(rows)
    finally:
        configure(relay, http_batch=None, envelope=None)
