"""Per-feature order with many relay workers (issue 12): each worker owns a partition of the
features, a feature whose row waits for its retry holds back only its own later rows, and within a
batch a feature's rows go out one after the other. A real cluster with 4 workers, a real HTTP
receiver that refuses some events row-level, and a real nats-server."""

import json
import threading
import time
from collections import defaultdict

import pytest

from conftest import RUN_DIR, Cluster, free_port
from relay_harness import NatsServer, configure, receiver, reconfigure, wait_for  # noqa: F401 (receiver: a fixture)

DB = "order"
FEATURES, VERSIONS = 200, 25


@pytest.fixture(scope="module")
def nats_server():
    server = NatsServer(RUN_DIR / "nats_order")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def relay(receiver):
    c = Cluster(RUN_DIR / "order", free_port())
    c.start(f"feature_outbox.database = '{DB}'", "feature_outbox.relay_workers = 4",
            "feature_outbox.poll_interval = '60s'", "feature_outbox.batch_size = 50",
            "feature_outbox.retry_backoff_min = '50ms'", "feature_outbox.retry_backoff_max = '200ms'",
            "feature_outbox.max_attempts = 4", "feature_outbox.http_concurrency = 8",
            f"feature_outbox.endpoint = '{receiver.url}'")
    c.create_db(DB)
    with c.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
    yield c
    c.stop()


def edits(conn, first, versions, step=0.001):
    """Every feature first .. first + FEATURES - 1, `versions` times, interleaved: round v edits each
    feature once, in one transaction, so consecutive outbox rows belong to different features."""
    conn.execute("""SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[%%s,%%s]}',
                           (i %% 300) - 150, (i %% 80) - 40), 'created')
                      FROM generate_series(%s::bigint, %s::bigint) i""", (first, first + FEATURES - 1))
    for v in range(1, versions):
        conn.execute("""SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[%%s,%%s]}',
                               (i %% 300) - 150 + %s, (i %% 80) - 40), 'moved')
                          FROM generate_series(%s::bigint, %s::bigint) i""", (v * step, first, first + FEATURES - 1))


def settled(conn, first):
    return conn.execute("""SELECT count(*) FILTER (WHERE published_at IS NULL AND parked_at IS NULL)
                             FROM feature_outbox.outbox WHERE feature_id >= %s""", (first,)).fetchone()[0] == 0


def by_feature(events):
    seen = defaultdict(list)
    for e in events:
        seen[int(e["feature_id"])].append(e["event_version"])
    return seen


def test_four_workers_keep_each_features_order_through_row_level_failures(relay, receiver):
    first = 10_000
    refused = set()
    lock = threading.Lock()

    def respond(request):
        # Refuse the first attempt of every 7th event with 422 (row-level), then accept it.
        event = json.loads(request["body"])
        key = event["event_id"]
        with lock:
            if hash(key) % 7 == 0 and key not in refused:
                refused.add(key)
                return 422, {}
        return 200, {}
    receiver.respond = respond
    with relay.connect(DB) as conn:
        edits(conn, first, VERSIONS)
        wait_for(lambda: settled(conn, first), 90, "the relay to deliver 5,000 events")
        workers = conn.execute("SELECT count(*) FILTER (WHERE relayed_rows > 0) FROM feature_outbox.workers").fetchone()[0]
        parked = conn.execute("SELECT count(*) FROM feature_outbox.outbox WHERE parked_at IS NOT NULL").fetchone()[0]
    receiver.respond = lambda request: (200, {})
    assert len(refused) > 100, "the receiver must have refused some events, or the test proves nothing"
    assert parked == 0
    assert workers == 4, "every worker published its own share"
    # The deliveries (every POST but the refused first attempts), in arrival order, per feature.
    order, refusal_seen = defaultdict(list), set()
    for r in receiver.requests:
        body = json.loads(r["body"])
        if int(body["feature_id"]) < first:
            continue
        if body["event_id"] in refused and body["event_id"] not in refusal_seen:
            refusal_seen.add(body["event_id"])
            continue
        order[int(body["feature_id"])].append(body["event_version"])
    assert sum(len(v) for v in order.values()) == FEATURES * VERSIONS, "every event delivered exactly once"
    bad = [f for f, versions in order.items() if versions != list(range(1, VERSIONS + 1))]
    assert len(order) == FEATURES and bad == [], f"{len(bad)} features out of order, e.g. {bad[0]}: {order[bad[0]]}"


def test_nats_subscribers_see_each_feature_in_order_with_four_workers(relay, receiver, nats_server):
    first = 20_000
    configure(relay, endpoint=nats_server.url)
    try:
        with relay.connect(DB) as conn:
            edits(conn, first, VERSIONS)
            wait_for(lambda: settled(conn, first), 90, "the relay to publish 5,000 events")
        seen = by_feature(m["event"] for m in nats_server.messages() if int(m["event"]["feature_id"]) >= first)
        assert len(seen) == FEATURES
        bad = [f for f, versions in seen.items() if versions != list(range(1, VERSIONS + 1))]
        assert bad == [], f"{len(bad)} features out of order, e.g. {bad[0]}: {seen[bad[0]]}"
    finally:
        configure(relay, endpoint=receiver.url)


def test_a_parked_row_holds_back_its_feature_until_parked_and_no_other(relay, receiver):
    first = 30_000
    with relay.connect(DB) as conn:
        conn.execute("""SELECT feature_outbox.edit_feature(i, '{"type":"Point","coordinates":[1,1]}', 'created')
                          FROM generate_series(%s::bigint, %s::bigint) i""", (first, first + 9))
        wait_for(lambda: settled(conn, first), 30, "the created events")
        stuck = first  # its next event is refused every time, until it parks (max_attempts = 4)
        receiver.respond = lambda request: (422, {}) if (json.loads(request["body"])["feature_id"] == str(stuck)
                                                         and json.loads(request["body"])["event_version"] == 2) else (200, {})
        try:
            for v in (2, 3):
                conn.execute("""SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[1,%%s]}', %s), 'moved')
                                  FROM generate_series(%s::bigint, %s::bigint) i""", (v, first, first + 9))
            # Other features are never held back: all their events arrive while the stuck one retries.
            others = lambda: {(e["feature_id"], e["event_version"]) for e in receiver.events() if first < int(e["feature_id"]) < first + 10}
            wait_for(lambda: len(others()) == 9 * 3, 30, "the other features' events")
            # The stuck feature's version 3 waits behind version 2 while that one is retried ...
            versions_now = [e["event_version"] for e in receiver.events() if e["feature_id"] == str(stuck)]
            parked_now = conn.execute("SELECT parked_at IS NOT NULL FROM feature_outbox.outbox WHERE feature_id = %s AND feature_version = 2",
                                      (stuck,)).fetchone()[0]
            if not parked_now:
                assert 3 not in versions_now
            # ... and flows once version 2 is parked (README, "Per-feature order").
            wait_for(lambda: conn.execute("SELECT parked_at IS NOT NULL FROM feature_outbox.outbox WHERE feature_id = %s AND feature_version = 2",
                                          (stuck,)).fetchone()[0], 30, "version 2 to park")
            wait_for(lambda: 3 in [e["event_version"] for e in receiver.events() if e["feature_id"] == str(stuck)], 30,
                     "version 3 after the park")
        finally:
            receiver.respond = lambda request: (200, {})


def test_a_row_sent_ahead_but_locked_elsewhere_stays_unpublished_and_holds_back_its_feature(relay, receiver, nats_server):
    """JetStream: a worker reads its next batch ahead without locks and sends it as soon as the batch
    before is acknowledged, before marking that one; it locks the rows read ahead only then. A row
    another transaction holds meanwhile has been sent but cannot be marked: it stays unpublished,
    its feature's later rows wait behind it, and it goes out again once free, where JetStream drops
    the copy by its Nats-Msg-Id (a duplicate PubAck). Every event arrives once, in its feature's
    order, and equals its committed outbox row."""
    first, n = 40_000, 1000
    move = """SELECT feature_outbox.edit_feature(o.feature_id, format('{"type":"Point","coordinates":[%%s,2]}', %s::int), 'moved')
                FROM feature_outbox.outbox o WHERE o.id = ANY(%s)"""
    reconfigure(relay, endpoint="")
    try:
        with relay.connect(DB) as conn, relay.connect(DB) as locker:
            conn.execute("""SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[%%s,%%s]}',
                                   (i %% 300) - 150, (i %% 80) - 40), 'created')
                              FROM generate_series(%s::bigint, %s::bigint) i""", (first, first + n - 1))
            unpublished = lambda: {r[0] for r in conn.execute(
                "SELECT event_id::text FROM feature_outbox.outbox WHERE feature_id >= %s AND published_at IS NULL", (first,)).fetchall()}
            # Rows in the middle of every worker's share, held by another transaction. (FOR UPDATE
            # under an OFFSET would lock the rows the OFFSET skips as well.)
            with locker.transaction():
                locked = dict(locker.execute("""SELECT id, event_id::text FROM feature_outbox.outbox WHERE id IN (
                                                   SELECT id FROM feature_outbox.outbox WHERE feature_id >= %s ORDER BY id OFFSET 400 LIMIT 200)
                                                 FOR UPDATE""", (first,)).fetchall())
                # Their features' next versions, behind them in the backlog.
                conn.execute(move, (2, list(locked)))
                behind = unpublished() - set(locked.values()) - {r[0] for r in conn.execute(
                    "SELECT event_id::text FROM feature_outbox.outbox WHERE feature_id >= %s AND feature_version = 1", (first,))}
                assert len(behind) == len(locked)
                configure(relay, endpoint=nats_server.url)
                wait_for(lambda: unpublished() == set(locked.values()) | behind, 60, "every row but the locked ones and those behind them")
                in_stream = {m["event"]["event_id"] for m in nats_server.messages() if int(m["event"]["feature_id"]) >= first}
                sent_ahead = set(locked.values()) & in_stream
                # The test exercises the path: rows read ahead and sent before the lock stopped them ...
                assert sent_ahead, "no locked row was sent ahead"
                # ... and none of the rows behind them went out before them.
                assert not behind & in_stream, f"{len(behind & in_stream)} events overtook a row held by another transaction"
                duplicates = conn.execute("SELECT sum(duplicate_acks) FROM feature_outbox.workers").fetchone()[0]
            # Free again: one more edit of each feature wakes its worker, which sends its rows in order.
            conn.execute(move, (3, list(locked)))
            wait_for(lambda: not unpublished(), 60, "the freed rows and those behind them to be published")
            # Each sent-ahead row went out again, and JetStream said it had it already.
            assert conn.execute("SELECT sum(duplicate_acks) FROM feature_outbox.workers").fetchone()[0] - duplicates >= len(sent_ahead)
            committed = {r[0]: r[1:] for r in conn.execute(
                """SELECT event_id::text, feature_id::text, feature_version, event_type, routing_key
                     FROM feature_outbox.outbox WHERE feature_id >= %s""", (first,)).fetchall()}
        events = [m["event"] for m in nats_server.messages() if int(m["event"]["feature_id"]) >= first]
        assert sorted(e["event_id"] for e in events) == sorted(committed), "each committed event once, and no other"
        for e in events:
            assert (e["feature_id"], e["event_version"], e["action"], e["routing_key"]) == committed[e["event_id"]]
        seen = by_feature(events)
        moved = {int(committed[i][0]) for i in locked.values()}
        assert len(seen) == n
        assert all(v == ([1, 2, 3] if f in moved else [1]) for f, v in seen.items()), "a feature's events out of order"
    finally:
        configure(relay, endpoint=receiver.url)


def test_a_fresh_claim_leaves_a_later_row_behind_an_earlier_one_held_elsewhere(relay, receiver):
    """The claim locks its rows FOR UPDATE ... SKIP LOCKED, so a row another transaction holds is
    skipped. Before issue 37 the claim then took the same feature's next row, and it went out ahead
    of the one held. Now no row is claimed while an earlier unpublished row of its feature is not
    claimed with it: the later row waits until the earlier one is free, then both go out, in order,
    each as committed. A batch that is not full is claimed fresh (nothing is read ahead), so this is
    the claim's own path; the worker looks at the held row again every poll_interval."""
    first = 50_000
    move = """SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[%%s,%%s]}', %s::int, i %% 80 - 40), 'moved')
                FROM unnest(%s::bigint[]) i"""
    reconfigure(relay, endpoint="", poll_interval="1s")
    try:
        with relay.connect(DB) as conn, relay.connect(DB) as locker:
            # The held feature and others of the same worker's partition, which show that it ran.
            same = conn.execute("""SELECT array_agg(i ORDER BY i) FROM generate_series(%s::bigint, %s::bigint) i
                                    WHERE (hashint8(i) & 2147483647) %% 4 = (hashint8(%s::bigint) & 2147483647) %% 4""",
                                (first, first + 99, first)).fetchone()[0][:8]
            held_feature, others = same[0], same[1:]
            conn.execute("""SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[1,%%s]}', i %% 80 - 40), 'created')
                              FROM unnest(%s::bigint[]) i""", (same,))
            versions = lambda f: [e["event_version"] for e in receiver.events() if e["feature_id"] == str(f)]
            with locker.transaction():
                [(held,)] = locker.execute("""SELECT id FROM feature_outbox.outbox WHERE feature_id = %s AND feature_version = 1
                                               FOR UPDATE""", (held_feature,)).fetchall()
                conn.execute(move, (2, same))
                configure(relay, endpoint=receiver.url)
                wait_for(lambda: all(versions(f) == [1, 2] for f in others), 30, "the other features' events")
                # Several claims of the worker that owns it (one per poll_interval at least).
                deadline = time.monotonic() + 3
                while time.monotonic() < deadline:
                    assert versions(held_feature) == [], "a later row of a feature went out ahead of its held row"
                    time.sleep(0.1)
                unpublished = conn.execute("""SELECT array_agg(feature_version ORDER BY id) FROM feature_outbox.outbox
                                               WHERE feature_id = %s AND published_at IS NULL""", (held_feature,)).fetchone()[0]
                assert unpublished == [1, 2]
            wait_for(lambda: versions(held_feature) == [1, 2], 30, "the held row, then the one behind it")
            committed = {r[0]: r[1:] for r in conn.execute(
                """SELECT event_id::text, feature_id::text, feature_version, event_type, routing_key, published_at IS NOT NULL
                     FROM feature_outbox.outbox WHERE feature_id = ANY(%s)""", (same,)).fetchall()}
        events = [e for e in receiver.events() if int(e["feature_id"]) in same]
        assert sorted(e["event_id"] for e in events) == sorted(committed), "each committed event once, and no other"
        for e in events:
            assert (e["feature_id"], e["event_version"], e["action"], e["routing_key"], True) == committed[e["event_id"]]
        # Both read the feature's row as committed last: version 2, at [2, y].
        for e in (e for e in events if e["feature_id"] == str(held_feature)):
            assert (e["geometry"]["coordinates"], e["geometry_version"]) == ([2, held_feature % 80 - 40], 2)
    finally:
        configure(relay, endpoint=receiver.url, poll_interval="60s")
