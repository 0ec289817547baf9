"""The outbox under pressure from a long transaction (the guide's gotcha 3 through VACUUM): the
backlog names the session that holds back VACUUM of the outbox, so an operator can find it."""

import psycopg


def held(c, db):
    with c.connect(db) as conn:
        return conn.execute("SELECT vacuum_held_by_pid, vacuum_held_for FROM feature_outbox.backlog").fetchone()


def test_the_backlog_names_the_transaction_that_holds_back_vacuum(cluster):
    cluster.create_db("pressure")
    with cluster.connect("pressure") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
    assert held(cluster, "pressure") == (None, None)

    # A forgotten REPEATABLE READ transaction: its snapshot keeps every later dead row version.
    long = psycopg.connect(cluster.dsn("pressure"))
    try:
        long.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
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
            assert "\noutbox_vacuum_held_for_seconds " in conn.execute("SELECT feature_outbox.metrics()").fetchone()[0]
            conn.execute("RESET ROLE")
            conn.execute("DROP ROLE watcher")
        # A session in another database holds back only that database's VACUUM.
        cluster.create_db("pressure_other")
        with cluster.connect("pressure_other") as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        assert held(cluster, "pressure_other") == (None, None)
    finally:
        long.rollback()
        long.close()
    assert held(cluster, "pressure") == (None, None)
