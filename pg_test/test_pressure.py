"""The outbox under pressure from a long transaction (the guide's gotcha 3 through VACUUM): the
backlog names the session that holds back VACUUM of the outbox, so an operator can find it."""

import time

import psycopg

from relay_harness import wait_for


def held(c, db):
    with c.connect(db) as conn:
        return conn.execute("SELECT vacuum_held_by_pid, vacuum_held_for FROM feature_outbox.backlog").fetchone()


def quiet(c, db):
    wait_for(lambda: held(c, db) == (None, None), 10, f"no session to hold back VACUUM in {db}")


def test_the_backlog_names_the_transaction_that_holds_back_vacuum(cluster):
    cluster.create_db("pressure")
    with cluster.connect("pressure") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
    # The relay worker the launcher starts here runs a few short transactions as it starts; once it
    # idles, nothing holds VACUUM back.
    quiet(cluster, "pressure")

    # A forgotten REPEATABLE READ transaction: its snapshot keeps every later dead row version.
    long = psycopg.connect(cluster.dsn("pressure"))
    long.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ  # psycopg opens the transaction itself
    try:
        long.execute("SELECT count(*) FROM feature_outbox.outbox")
        pid = long.info.backend_pid
        (held_by, held_for), = [held(cluster, "pressure")]
        assert held_by == pid and held_for.total_seconds() >= 0
        # A monitoring role (pg_monitor) sees it, and metrics() carries its age.
        with cluster.connect("pressure") as conn:
            conn.execute("DROP ROLE IF EXISTS watcher")
            conn.execute("CREATE ROLE watcher IN ROLE pg_monitor")
            conn.execute("SET ROLE watcher")
            assert conn.execute("SELECT vacuum_held_by_pid FROM feature_outbox.backlog").fetchone() == (pid,)
            assert '\noutbox_vacuum_held_for_seconds{database="pressure"} ' in conn.execute("SELECT feature_outbox.metrics()").fetchone()[0]
            conn.execute("RESET ROLE")
            conn.execute("DROP ROLE watcher")
        # A session in another database holds back only that database's VACUUM.
        cluster.create_db("pressure_other")
        with cluster.connect("pressure_other") as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        quiet(cluster, "pressure_other")
    finally:
        long.rollback()
        long.close()
    quiet(cluster, "pressure")


# --- The claim's low-water mark, with a real worker -----------------------------------------------

import json  # noqa: E402

import pytest  # noqa: E402

from conftest import RUN_DIR, Cluster, free_port  # noqa: E402
from relay_harness import CLAIM_FROM, NatsServer, all_published, point_edits  # noqa: E402

LW_DB = "pressure_relay"
@pytest.fixture(scope="module")
def relayed():
    nats = NatsServer(RUN_DIR / "nats-pressure")
    nats.start()
    c = Cluster(RUN_DIR / "pressure-relay", free_port())
    c.start(f"feature_outbox.database = '{LW_DB}'", f"feature_outbox.endpoint = '{nats.url}'",
            "feature_outbox.poll_interval = '60s'")
    c.create_db(LW_DB)
    with c.connect(LW_DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
    yield c, nats
    c.stop()
    nats.stop()


def edits(c, first, n):
    with c.connect(LW_DB) as conn:
        point_edits(conn, first, n)


def scalar(c, sql, params=()):
    with c.connect(LW_DB) as conn:
        return conn.execute(sql, params).fetchone()[0]


def drained(c):
    with c.connect(LW_DB) as conn:
        return all_published(conn)


def buffers(c, sql):
    """Shared buffers the statement's plan hit or read, from EXPLAIN (ANALYZE, BUFFERS)."""
    with c.connect(LW_DB) as conn:
        # The worker's own settings for its claim (src/relay/claim.rs): the partial index, in id order.
        conn.execute("SET enable_seqscan = off")
        conn.execute("SET enable_bitmapscan = off")
        plan = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}").fetchone()[0][0]["Plan"]
    return plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]


def test_out_of_order_commit_below_published_ids_is_relayed(relayed):
    c, nats = relayed
    late = psycopg.connect(c.dsn(LW_DB))
    # Draws an outbox id, then stays open while higher ids are committed and published.
    late.execute("SELECT feature_outbox.edit_feature(1, '{\"type\":\"Point\",\"coordinates\":[1,2]}', 'created')")
    late_id = late.execute("SELECT max(id) FROM feature_outbox.outbox").fetchone()[0]
    edits(c, 1000, 500)
    wait_for(lambda: drained(c), 30, "the 500 later edits to be relayed")
    time.sleep(0.5)  # several looks of worker 0 at the mark
    mark = scalar(c, "SELECT feature_outbox._relay_low_water()")
    assert mark <= late_id, f"the mark {mark} passed id {late_id}, which an open transaction holds"
    late.commit()
    late.close()
    wait_for(lambda: drained(c), 20, "the late event to be relayed")
    assert [m["event"]["feature_id"] for m in nats.messages()].count("1") == 1
    # With nothing open any more, the mark moves past everything.
    wait_for(lambda: scalar(c, "SELECT feature_outbox._relay_low_water()")
             > scalar(c, "SELECT max(id) FROM feature_outbox.outbox"), 10, "the mark to pass the last id")


def test_claim_and_backlog_do_not_walk_dead_entries_held_by_a_long_transaction(relayed):
    c, _ = relayed
    long = psycopg.connect(c.dsn(LW_DB))
    long.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    try:
        long.execute("SELECT count(*) FROM feature_outbox.features")  # takes the snapshot, and keeps it
        edits(c, 10_000, 3000)
        wait_for(lambda: drained(c), 60, "3000 edits to be relayed")
        last = scalar(c, "SELECT max(id) FROM feature_outbox.outbox")
        wait_for(lambda: scalar(c, "SELECT feature_outbox._relay_low_water()") > last, 10, "the mark to pass the last id")
        with c.connect(LW_DB) as conn:
            conn.execute("VACUUM feature_outbox.outbox")  # removes nothing the long snapshot may see
        # From the start, the scan walks every dead entry of the 3000 published rows...
        from_start = buffers(c, CLAIM_FROM.format(low=0))
        # ...from the mark, none of them.
        from_mark = buffers(c, CLAIM_FROM.format(low="feature_outbox._relay_low_water()"))
        backlog = buffers(c, "SELECT * FROM feature_outbox.backlog")
        # 3000 dead entries fill over 10 index leaf pages and point into over 20 heap pages.
        assert from_start > 40, f"the test needs dead entries to walk; the scan from 0 read only {from_start}"
        assert from_mark <= 10, f"the claim read {from_mark} buffers (from 0: {from_start})"
        assert backlog <= 30, f"the backlog view read {backlog} buffers (the claim from 0: {from_start})"
    finally:
        long.close()


def test_retry_parked_lowers_the_mark_so_requeued_rows_are_claimed(relayed):
    c, nats = relayed
    edits(c, 20_000, 10)
    wait_for(lambda: drained(c), 20, "10 edits to be relayed")
    # Park one relayed row by hand (as max_attempts would), then let the mark pass it.
    with c.connect(LW_DB) as conn:
        parked = conn.execute("""UPDATE feature_outbox.outbox SET published_at = NULL, parked_at = now()
                                  WHERE feature_id = 20005 RETURNING id""").fetchone()[0]
    edits(c, 20_100, 5)
    last = scalar(c, "SELECT max(id) FROM feature_outbox.outbox")
    wait_for(lambda: scalar(c, "SELECT feature_outbox._relay_low_water()") > last, 10,
             f"the mark to pass the parked row {parked} and the last id {last}: "
             + str(scalar(c, "SELECT (feature_outbox._relay_low_water(), (SELECT min(id) FROM feature_outbox.outbox "
                             "WHERE published_at IS NULL AND parked_at IS NULL), (SELECT array_agg(virtualtransaction || ' ' || pid) FROM pg_locks "
                             "WHERE relation = 'feature_outbox.outbox'::regclass))::text")))
    assert scalar(c, "SELECT parked_rows FROM feature_outbox.backlog") == 1
    before = [m["event"]["feature_id"] for m in nats.messages()].count("20005")
    assert scalar(c, "SELECT feature_outbox.retry_parked()") == 1
    wait_for(lambda: drained(c), 20, "the requeued row to be relayed")
    assert [m["event"]["feature_id"] for m in nats.messages()].count("20005") >= before
    assert scalar(c, "SELECT published_at IS NOT NULL FROM feature_outbox.outbox WHERE id = %s", (parked,))


def test_retention_keeps_deleting_while_a_long_transaction_holds_vacuum_back(relayed):
    c, _ = relayed
    with c.connect() as conn:
        conn.execute("ALTER SYSTEM SET feature_outbox.retention = '2s'")
        conn.execute("SELECT pg_reload_conf()")
    long = psycopg.connect(c.dsn(LW_DB))
    long.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    wakers = iter(range(100_000, 200_000))
    try:
        long.execute("SELECT count(*) FROM feature_outbox.features")
        for k in range(3):
            edits(c, 30_000 + k * 1000, 1000)
            wait_for(lambda: drained(c), 30, "1000 edits to be relayed")
            first = 30_000 + k * 1000

            def old_rows_gone():
                edits(c, next(wakers), 1)  # a commit wakes the worker, which runs retention when idle
                return scalar(c, "SELECT count(*) FROM feature_outbox.outbox WHERE feature_id BETWEEN %s AND %s",
                              (first, first + 999)) == 0
            wait_for(old_rows_gone, 20, f"retention to delete round {k}", interval=0.5)
    finally:
        long.close()
        with c.connect() as conn:
            conn.execute("ALTER SYSTEM RESET feature_outbox.retention")
            conn.execute("SELECT pg_reload_conf()")
