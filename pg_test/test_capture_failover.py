"""Capture across a promotion (issue 49). On PostgreSQL 17 and later the capture slot is a failover
slot: a standby with sync_replication_slots keeps a copy in step, and once promoted its capture
worker goes on from there, so plain writes the old primary never captured get their event on the
new one, once each. On 15 and 16 a promoted standby has no slot, and its capture view says so until
capture_layer is called again."""

import time

import psycopg
import pytest

from conftest import PG_BIN, RUN_DIR, Cluster, free_port
from relay_harness import wait_for
from standby_harness import as_postgres, kill_tree, make_standby, wait_replayed

DB = "capfail"
SLOT = "replica1"


def rows(c: Cluster, sql: str, *args) -> list[tuple]:
    with c.connect(DB) as conn:
        return conn.execute(sql, args).fetchall()


def one(c: Cluster, sql: str, *args):
    return rows(c, sql, *args)[0][0]


def square(i: int) -> str:
    x, y = -100 + (i % 50) * 0.1, 40 + (i // 50) * 0.1
    return f"SRID=4326;POLYGON(({x} {y},{x + 0.05} {y},{x + 0.05} {y + 0.05},{x} {y + 0.05},{x} {y}))"


def captured(c: Cluster) -> dict[int, list[tuple]]:
    """Each feature's captured events: (version, type)."""
    out: dict[int, list[tuple]] = {}
    for feature, version, kind in rows(c, "SELECT feature_id, feature_version, event_type FROM feature_outbox.outbox "
                                          "WHERE layer = 'plots' AND origin = 'captured' ORDER BY id"):
        out.setdefault(feature, []).append((version, kind))
    return out


@pytest.fixture
def pair():
    made = []
    primary = Cluster(RUN_DIR / "capfail-primary", free_port())
    # No sink: the outbox rows are what this test reads.
    primary.start(f"feature_outbox.database = '{DB}'", "wal_level = logical", "hot_standby_feedback = on",
                  "feature_outbox.poll_interval = '500ms'")
    made.append(primary)
    primary.create_db(DB)
    with primary.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (SLOT,))
        conn.execute("CREATE TABLE plots (id bigint PRIMARY KEY, geom geometry(Polygon, 4326) NOT NULL, "
                     "version integer NOT NULL DEFAULT 0, owner text)")
        conn.execute("SELECT feature_outbox.register_layer('plots', 'plots', properties => '{owner}')")
    version = one(primary, "SELECT current_setting('server_version_num')::int")
    standby = make_standby(primary, RUN_DIR / "capfail-standby", slot=SLOT, name=SLOT)
    made.append(standby)
    if version >= 170000:
        # PostgreSQL's recipe for failover slots: the logical slot may not run ahead of the standby,
        # which syncs it over a connection naming a database. Set after the base backup: a promoted
        # standby that named its own missing slot there would hold every logical read (the wait
        # event WaitForStandbyConfirmation), as an HA manager that forgets to update it would.
        with primary.connect(DB) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronized_standby_slots = '{SLOT}'")
            conn.execute("SELECT pg_reload_conf()")
        with open(standby.dir / "data" / "postgresql.auto.conf", "a") as conf:
            conf.write(f"\nsync_replication_slots = on\nhot_standby_feedback = on\n"
                       f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user=postgres dbname={DB}'\n")
        standby.restart()
    yield primary, standby, version
    for c in made:
        try:
            c.stop()
        except Exception:
            pass


def test_capture_goes_on_after_a_promotion(pair):
    primary, standby, version = pair
    with primary.connect(DB) as conn:
        conn.execute("CALL feature_outbox.capture_layer('plots')")
    slot = rows(primary, "SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'logical'")[0][0]
    if version >= 170000:
        assert one(primary, "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", slot) is True
    # Captured on the primary, with the standby in step.
    with primary.connect(DB) as conn:
        for i in range(1, 21):
            conn.execute("INSERT INTO plots (id, geom, owner) VALUES (%s, %s, 'a')", (i, square(i)))
    wait_for(lambda: len(captured(primary)) == 20, what="the first 20 rows captured on the primary")
    if version >= 170000:
        # Synced and persistent ("sync-ready"): a synced slot still temporary is dropped at promotion.
        wait_for(lambda: rows(standby, "SELECT synced AND NOT temporary FROM pg_replication_slots WHERE slot_name = %s",
                              slot) == [(True,)],
                 timeout=60, what="the capture slot synced to the standby")
    # Plain writes, then the primary lost before its worker is sure to have seen them all.
    with primary.connect(DB) as conn:
        conn.execute("UPDATE plots SET owner = 'b' WHERE id <= 10")
        for i in range(21, 41):
            conn.execute("INSERT INTO plots (id, geom, owner) VALUES (%s, %s, 'a')", (i, square(i)))
    wait_replayed(primary, standby)
    kill_tree(primary)
    with standby.connect(DB) as conn:
        conn.execute("SELECT pg_promote()")
    if version < 170000:
        wait_for(lambda: one(standby, "SELECT state FROM feature_outbox.capture") == "no slot", timeout=30,
                 what="the promoted standby saying it has no capture slot")
        return
    # Every row's final state reached, once: 40 created, and one updated for each of rows 1-10.
    def complete():
        events = captured(standby)
        return len(events) == 40 and all(len(events[i]) == (2 if i <= 10 else 1) for i in events)
    try:
        wait_for(complete, timeout=60, what="every plain write captured once on the promoted standby")
    except AssertionError:
        state = rows(standby, "SELECT state, pid, lag_bytes, events, last_error FROM feature_outbox.capture")
        waits = rows(standby, "SELECT wait_event FROM pg_stat_activity WHERE backend_type = 'feature_outbox capture'")
        slots = rows(standby, "SELECT slot_name, synced, temporary, confirmed_flush_lsn::text FROM pg_replication_slots")
        raise AssertionError(f"capture {state}, waiting on {waits}, slots {slots}, events {captured(standby)}")
    time.sleep(1)  # a second look: nothing more comes
    events = captured(standby)
    for i in range(1, 41):
        assert events[i][0] == (1, "created"), (i, events[i])
        if i <= 10:
            assert events[i][1] == (2, "updated"), (i, events[i])
    # The rows carry the versions their events say.
    assert rows(standby, "SELECT count(*) FROM plots WHERE version = CASE WHEN id <= 10 THEN 2 ELSE 1 END") == [(40,)]
    assert one(standby, "SELECT state FROM feature_outbox.capture") in ("idle", "reading", "writing")


def test_a_standby_down_holds_capture_but_no_editor_and_no_shutdown(pair):
    """With the standby named in synchronized_standby_slots down, the worker reads nothing past what
    it has (PostgreSQL would otherwise let a promoted standby skip those changes): plain writes
    and edit_feature commit, their capture waits, and a fast shutdown of the primary still stops
    the worker, which waits where SIGTERM is heard rather than inside the slot's read. With the
    standby back, every write is captured once."""
    primary, standby, version = pair
    if version < 170000:
        pytest.skip("failover slots and synchronized_standby_slots are PostgreSQL 17's")
    with primary.connect(DB) as conn:
        conn.execute("CALL feature_outbox.capture_layer('plots')")
        for i in range(1, 6):
            conn.execute("INSERT INTO plots (id, geom, owner) VALUES (%s, %s, 'a')", (i, square(i)))
    wait_for(lambda: len(captured(primary)) == 5, what="the first 5 rows captured")
    # The worker moves the slot on, and goes idle, once the standby has those events too.
    wait_for(lambda: one(primary, "SELECT state FROM feature_outbox.capture") == "idle", what="the worker idle")
    standby.stop()
    with primary.connect(DB) as conn:
        for i in range(6, 11):
            conn.execute("INSERT INTO plots (id, geom, owner) VALUES (%s, %s, 'a')", (i, square(i)))
        # An editor of the built-in layer, whose commit waits for no standby either.
        conn.execute("SELECT feature_outbox.edit_feature(1001, 'SRID=4326;POINT(-99 41)'::geometry, 'created')")
    time.sleep(3)
    assert sorted(captured(primary)) == [1, 2, 3, 4, 5]
    assert one(primary, "SELECT state FROM feature_outbox.capture") == "reading"
    assert one(primary, "SELECT lag_bytes > 0 FROM feature_outbox.capture") is True
    started = time.monotonic()
    primary.stop()  # fails when the server has not stopped within 60 s
    assert time.monotonic() - started < 30
    for c in (standby, primary):
        as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(c.dir / "data"), "-l", str(c.dir / "server.log"), "-w", "start")
    wait_for(lambda: len(captured(primary)) == 10, timeout=60, what="rows 6 to 10 captured with the standby back")
    time.sleep(1)
    events = captured(primary)
    assert all(events[i] == [(1, "created")] for i in range(1, 11)), events
