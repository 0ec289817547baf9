"""A standby is a standby (issue 53): on a streaming standby made by pg_basebackup -R, as Patroni and
every HA manager make them, the relay reports `standby` everywhere and no series that reads as down;
pg_promote() starts the relay within one poll interval, with no restart, and it publishes the rows
the old primary left, each as its committed row; the old primary, rewound with pg_rewind and
started as a standby of the new one (Patroni's way back), reports `standby` again."""

import re
import time

import psycopg
import pytest

from conftest import RUN_DIR, Cluster, free_port
from relay_harness import nats_fixture, wait_for
from standby_harness import make_standby, rejoin_as_standby, wait_replayed

DB = "ha"
POLL = 2.0  # seconds: feature_outbox.poll_interval on both members


def one(c: Cluster, sql: str, *args):
    with c.connect(DB) as conn:
        conn.row_factory = psycopg.rows.dict_row
        return conn.execute(sql, args).fetchone()


def rows(c: Cluster, sql: str, *args) -> list[dict]:
    with c.connect(DB) as conn:
        conn.row_factory = psycopg.rows.dict_row
        return conn.execute(sql, args).fetchall()


def metrics(c: Cluster) -> str:
    return one(c, "SELECT feature_outbox.metrics() AS m")["m"]


def sample(text: str, name: str) -> list[str]:
    """The sample lines of series `name` in exposition text."""
    return [line for line in text.splitlines() if re.match(rf"{name}{{", line)]


def assert_standby(c: Cluster) -> None:
    """What a standby's monitoring says: standby everywhere, no error, no sink series."""
    assert one(c, "SELECT pg_is_in_recovery() AS r")["r"]
    # This database's workers as configured; another served database's are unknown on a standby
    # (its extension can be seen only connected to it); a named database that does not exist waits.
    dbs = {d["database"]: (d["state"], d["relay_workers"], d["workers_running"], d["worker_states"], d["last_error"])
           for d in rows(c, "SELECT * FROM feature_outbox.relay_databases")}
    assert dbs == {DB: ("standby", 1, 0, ["standby"], None), "other": ("standby", None, 0, [], None),
                   "absent": ("waiting for database", 0, 0, [], None)}, dbs
    workers = rows(c, "SELECT worker, pid, state, sink_up FROM feature_outbox.workers")
    assert workers == [{"worker": 0, "pid": None, "state": "standby", "sink_up": None}]
    b = one(c, "SELECT relay_workers_running, relay_workers_configured, relay_last_error, relay_held_reason FROM feature_outbox.backlog")
    assert (b["relay_workers_running"], b["relay_workers_configured"], b["relay_last_error"]) == (0, 1, None), b
    assert "standby" in b["relay_held_reason"] and "promoted" in b["relay_held_reason"], b
    m = metrics(c)
    assert sample(m, "outbox_server_in_recovery") == [f'outbox_server_in_recovery{{database="{DB}"}} 1']
    assert sample(m, "outbox_relay_held") == [f'outbox_relay_held{{database="{DB}"}} 0']
    assert sample(m, "outbox_relay_workers_configured") == [f'outbox_relay_workers_configured{{database="{DB}"}} 1']
    for series in ("outbox_sink_up", "outbox_sink_errors_total", "outbox_sink_last_success_timestamp_seconds"):
        assert sample(m, series) == [], (series, m)


nats_server = nats_fixture("nats-standby")


@pytest.fixture
def members():
    made: list[Cluster] = []
    yield made
    for c in made:
        c.stop()


def test_standby_reports_standby_then_promotion_starts_the_relay(nats_server, members):
    primary = Cluster(RUN_DIR / "standby-primary", free_port())
    primary.start(f"feature_outbox.database = '{DB},other,absent'", f"feature_outbox.endpoint = '{nats_server.url}'",
                  f"feature_outbox.poll_interval = '{int(POLL * 1000)}ms'", "wal_log_hints = on",
                  "feature_outbox.retry_backoff_max = '1s'")
    members.append(primary)
    primary.create_db(DB)
    primary.create_db("other")  # served by the setting, without the extension
    with primary.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute("""SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[%s,52.5]}', 13 + i / 100.0), 'created')
                          FROM generate_series(1, 5) i""")
    wait_for(lambda: one(primary, "SELECT unpublished_rows FROM feature_outbox.backlog")["unpublished_rows"] == 0, 20, "the primary to relay")

    # The standby, as every HA manager makes one.
    standby = make_standby(primary, RUN_DIR / "standby-replica")
    members.append(standby)
    assert_standby(standby)
    # The primary, beside it: relaying, its sink up.
    m = metrics(primary)
    assert sample(m, "outbox_server_in_recovery") == [f'outbox_server_in_recovery{{database="{DB}"}} 0']
    assert sample(m, "outbox_sink_up") == [f'outbox_sink_up{{database="{DB}",worker="0"}} 1']
    assert len(sample(m, "outbox_sink_last_success_timestamp_seconds")) == 1

    # NATS goes away: the primary's relay cannot publish, and the edits wait in the outbox; the
    # standby replays them; the primary goes away too, and NATS comes back (the same store).
    nats_server.stop()
    with primary.connect(DB) as conn:
        conn.execute("""SELECT feature_outbox.edit_feature(i, format('{"type":"Point","coordinates":[%s,48.8]}', 2 + i / 100.0), 'moved')
                          FROM generate_series(1, 5) i""")
        conn.execute("SELECT feature_outbox.edit_feature(6, '{\"type\":\"Point\",\"coordinates\":[-74,40.7]}', 'created')")
    wait_replayed(primary, standby)
    waiting = one(standby, "SELECT unpublished_rows FROM feature_outbox.backlog")["unpublished_rows"]
    assert waiting == 6
    assert_standby(standby)
    primary.stop()
    nats_server.start()

    asked = time.monotonic()
    with standby.connect() as conn:
        assert conn.execute("SELECT pg_promote(true, 60)").fetchone() == (True,)
    promoted = time.monotonic()
    wait_for(lambda: one(standby, "SELECT unpublished_rows FROM feature_outbox.backlog")["unpublished_rows"] == 0, 30,
             "the promoted standby to relay")
    drained = time.monotonic()
    print(f"\npg_promote() took {promoted - asked:.2f} s; the backlog of {waiting} was empty {drained - promoted:.2f} s "
          f"after it returned, {drained - asked:.2f} s after it was called (poll interval {POLL} s)")
    assert drained - asked < POLL, f"the relay drained {drained - asked:.2f} s after pg_promote(), more than one poll interval"

    # What subscribers got from the new primary is what it committed.
    committed = {str(r["event_id"]): r for r in rows(standby, "SELECT * FROM feature_outbox.outbox WHERE event_type IN ('moved') OR feature_id = 6")}
    got = [msg for msg in nats_server.messages() if msg["event"]["event_id"] in committed]
    assert sorted(msg["event"]["event_id"] for msg in got) == sorted(committed)
    for msg in got:
        e, row = msg["event"], committed[msg["event"]["event_id"]]
        assert (e["feature_id"], e["event_version"], e["action"], e["routing_key"]) == \
            (str(row["feature_id"]), row["feature_version"], row["event_type"], row["routing_key"])
        lon = 2 + row["feature_id"] / 100.0 if row["feature_id"] <= 5 else -74
        assert e["geometry"]["coordinates"][0] == pytest.approx(lon)
    wait_for(lambda: {(d["database"], d["state"]) for d in rows(standby, "SELECT database, state FROM feature_outbox.relay_databases")}
             == {(DB, "relaying"), ("other", "no extension"), ("absent", "waiting for database")}, 10, "the launcher to probe")
    m = metrics(standby)
    assert sample(m, "outbox_server_in_recovery") == [f'outbox_server_in_recovery{{database="{DB}"}} 0']
    assert sample(m, "outbox_sink_up") == [f'outbox_sink_up{{database="{DB}",worker="0"}} 1']

    # The old primary comes back as a standby of the new one, rewound as Patroni does.
    assert_standby(rejoin_as_standby(primary, standby))
