"""Nothing invented across a failover (issue 54): feature_outbox.standby_slots and
wait_for_synchronous_standbys hold a batch until the named standbys have its WAL, editors never
wait, an operator sees the wait, and standby_wait_timeout trades it for availability. The drill
(failover_drills.py) once with the gate and once without; make faults runs it 10 times."""

import os
import random
import re
import signal
import time

import psycopg
import pytest

from conftest import RUN_DIR, Cluster, free_port
from failover_drills import DB, SLOT, drill, point
from relay_harness import NatsServer, alter_system, nats_fixture, wait_for
from standby_harness import make_standby, walreceiver_pid

nats_server = nats_fixture("nats-failover")


def one(c: Cluster, sql: str, *args):
    with c.connect(DB) as conn:
        conn.row_factory = psycopg.rows.dict_row
        return conn.execute(sql, args).fetchone()


def sample(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(rf"{name}{{", line)]


def value(text: str, name: str) -> float:
    lines = sample(text, name)
    assert len(lines) == 1, (name, lines)
    return float(lines[0].rsplit(" ", 1)[1])


@pytest.fixture
def pair(nats_server):
    """A primary relaying to NATS with a standby streaming from slot replica1, named replica1."""
    made = []
    primary = Cluster(RUN_DIR / "gate-primary", free_port())
    primary.start(f"feature_outbox.database = '{DB}'", f"feature_outbox.endpoint = '{nats_server.url}'",
                  "feature_outbox.poll_interval = '500ms'", "feature_outbox.retry_backoff_max = '1s'",
                  "wal_level = logical")  # for a logical slot named by mistake
    made.append(primary)
    primary.create_db(DB)
    with primary.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (SLOT,))
    standby = make_standby(primary, RUN_DIR / "gate-standby", slot=SLOT, name=SLOT)
    made.append(standby)
    yield primary, standby
    for c in made:
        c.stop()


def received_ids(nats: NatsServer) -> set[str]:
    return {m["event"]["event_id"] for m in nats.messages()}


def edit(c: Cluster, feature: int, step: int) -> tuple[str, float]:
    """One edit in its own transaction: its event_id and how long the commit took (s)."""
    with c.connect(DB) as conn:
        started = time.monotonic()
        conn.execute("SELECT feature_outbox.edit_feature(%s, %s, 'created')", (feature, point(feature, step)))
        took = time.monotonic() - started
        event_id = conn.execute("SELECT event_id::text FROM feature_outbox.outbox WHERE feature_id = %s ORDER BY id DESC LIMIT 1",
                                (feature,)).fetchone()[0]
    return event_id, took


@pytest.mark.parametrize("mode", ["standby_slots", "wait_for_synchronous_standbys"])
def test_a_batch_waits_for_the_standby_and_editors_do_not(pair, nats_server, mode):
    primary, standby = pair
    if mode == "standby_slots":
        alter_system(primary, {"feature_outbox.standby_slots": SLOT})
        waits_on = f"slot {SLOT}"
    else:
        # Patroni's synchronous_mode with synchronous_commit = local: the relay waits, editors do not.
        alter_system(primary, {"synchronous_standby_names": f'"{SLOT}"', "synchronous_commit": "local",
                               "feature_outbox.wait_for_synchronous_standbys": "on"})
        waits_on = f"standby {SLOT}"
    first, _ = edit(primary, 1, 1)
    wait_for(lambda: first in received_ids(nats_server), 10, "the first event")

    receiver = walreceiver_pid(standby)
    os.kill(receiver, signal.SIGSTOP)
    try:
        held = [edit(primary, f, 2) for f in range(2, 7)]
        assert max(took for _, took in held) < 0.5, f"an editor waited: {held}"
        time.sleep(1.5)
        assert not {e for e, _ in held} & received_ids(nats_server), "an event went out before the standby had its edit"
        w = one(primary, "SELECT state, standby_waiting_on, standby_wait_bytes, standby_wait_seconds, standby_held_batches FROM feature_outbox.workers")
        assert (w["state"], w["standby_waiting_on"]) == ("waiting for standby", waits_on), w
        assert w["standby_wait_bytes"] > 0 and w["standby_wait_seconds"] >= 1.0 and w["standby_held_batches"] >= 1, w
        m = one(primary, "SELECT feature_outbox.metrics() AS m")["m"]
        assert value(m, "outbox_standby_wait_bytes") > 0 and value(m, "outbox_standby_wait_seconds") >= 1.0
        assert sample(m, "outbox_standby_waiting_on") == [f'outbox_standby_waiting_on{{database="{DB}",worker="0",standby="{waits_on}"}} 1']
    finally:
        os.kill(receiver, signal.SIGCONT)
    resumed = time.monotonic()
    wait_for(lambda: {e for e, _ in held} <= received_ids(nats_server), 10, "the held events after the standby's return")
    print(f"\nheld events out {time.monotonic() - resumed:.2f} s after the walreceiver resumed")
    w = one(primary, "SELECT state, standby_waiting_on, standby_unconfirmed_batches FROM feature_outbox.workers")
    assert w["standby_waiting_on"] is None and w["standby_unconfirmed_batches"] == 0, w
    m = one(primary, "SELECT feature_outbox.metrics() AS m")["m"]
    assert value(m, "outbox_standby_wait_bytes") == 0 and sample(m, "outbox_standby_waiting_on") == []


def test_a_slot_that_cannot_confirm_is_waited_for_and_said(pair, nats_server):
    primary, _ = pair
    alter_system(primary, {"feature_outbox.standby_slots": f"{SLOT}, nosuch"})
    event, _ = edit(primary, 1, 1)
    wait_for(lambda: one(primary, "SELECT standby_waiting_on FROM feature_outbox.workers")["standby_waiting_on"] == "slot nosuch",
             10, "the worker to wait on the missing slot")
    b = one(primary, "SELECT relay_last_error FROM feature_outbox.backlog")
    assert b["relay_last_error"] == 'waiting for standby: replication slot "nosuch" does not exist', b
    assert event not in received_ids(nats_server)
    m = one(primary, "SELECT feature_outbox.metrics() AS m")["m"]
    assert value(m, "outbox_standby_wait_bytes") == -1
    assert 'replication slot "nosuch" does not exist' in primary.log()

    # A logical slot is not a standby's.
    with primary.connect(DB) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('nosuch', 'pgoutput')")
    wait_for(lambda: "logical slot" in (one(primary, "SELECT relay_last_error FROM feature_outbox.backlog")["relay_last_error"] or ""),
             10, "the logical slot to be named")
    assert event not in received_ids(nats_server)

    # Availability chosen: past standby_wait_timeout the batch goes out, with a WARNING, counted;
    # and every batch after it goes out at once while the standby still cannot confirm (one
    # WARNING for the whole wait), rather than one batch per timeout.
    alter_system(primary, {"feature_outbox.standby_wait_timeout": "2s"})
    wait_for(lambda: event in received_ids(nats_server), 10, "the event published unconfirmed")
    later, _ = edit(primary, 3, 1)
    asked = time.monotonic()
    wait_for(lambda: later in received_ids(nats_server), 10, "the next event, unconfirmed too")
    assert time.monotonic() - asked < 1.0, "a batch after the timeout waited for the timeout again"
    w = one(primary, "SELECT standby_unconfirmed_batches, standby_waiting_on FROM feature_outbox.workers")
    assert w["standby_unconfirmed_batches"] >= 2 and w["standby_waiting_on"] == "slot nosuch", w
    assert primary.log().count("unconfirmed by slot nosuch") == 1, "one WARNING per wait, not per batch"
    m = one(primary, "SELECT feature_outbox.metrics() AS m")["m"]
    assert value(m, "outbox_standby_unconfirmed_batches_total") >= 2

    # Taken out of the list: confirmed again at once.
    with primary.connect(DB) as conn:
        conn.execute("SELECT pg_drop_replication_slot('nosuch')")
    alter_system(primary, {"feature_outbox.standby_slots": SLOT, "feature_outbox.standby_wait_timeout": None})
    second, _ = edit(primary, 2, 1)
    wait_for(lambda: second in received_ids(nats_server), 10, "the next event")


def test_a_value_that_names_no_slots_holds_publishing(pair, nats_server):
    """A typo must never turn the gate off: postgresql.conf (where Patroni writes) would drop a value
    the setting refused and fall back to none. Any value is taken; one that is no list of slot names
    holds publishing and says why."""
    primary, _ = pair
    alter_system(primary, {"feature_outbox.standby_slots": "Replica-1"})
    event, _ = edit(primary, 1, 1)
    time.sleep(1.5)
    assert event not in received_ids(nats_server)
    b = one(primary, "SELECT relay_last_error FROM feature_outbox.backlog")
    assert "feature_outbox.standby_slots is not a list of slot names" in (b["relay_last_error"] or ""), b
    assert '"Replica-1" is not a replication slot name' in b["relay_last_error"], b
    alter_system(primary, {"feature_outbox.standby_slots": SLOT})
    wait_for(lambda: event in received_ids(nats_server), 10, "the event once the value is corrected")
    assert one(primary, "SELECT relay_last_error FROM feature_outbox.backlog")["relay_last_error"] is None


@pytest.mark.parametrize("gated", [True, False], ids=["standby_slots", "no_gate"])
def test_failover_drill(gated):
    """One run of the drill: with the gate nothing invented, doubled or lost; without it, the events
    of the edits the standby never got are invented (what the gate prevents)."""
    name = "gated" if gated else "open"
    nats = NatsServer(RUN_DIR / f"drill-nats-{name}")  # a stream of its own: every message counts
    nats.start()
    try:
        outcome = drill(nats, RUN_DIR / f"drill-{name}", gated, random.Random(54))
    finally:
        nats.stop()
    print("\n" + outcome.line())
    assert outcome.edits_before_kill > 200 and outcome.lost == 0 and outcome.content_mismatches == 0, outcome
    assert outcome.promoted_to_published_s < 30, outcome
    if gated:
        assert (outcome.invented, outcome.double_versions) == (0, 0), outcome
    else:
        assert outcome.invented > 0, f"the ungated drill invented nothing: the pause did not bite ({outcome})"


def test_tiles_wait_like_events_even_for_a_slot_made_since(nats_server):
    """An expire output's tiles wait for the standbys as events do, and a slot dropped and made
    again (reserved: its restart_lsn the last checkpoint's) confirms neither an event nor tiles read
    before it (the hostile review found tiles delivered on a chunk's old position)."""
    c = Cluster(RUN_DIR / "gate-tiles", free_port())
    c.start(f"feature_outbox.database = '{DB}'", f"feature_outbox.endpoint = '{nats_server.url}'",
            "feature_outbox.poll_interval = '500ms'", f"feature_outbox.standby_slots = '{SLOT}'")
    try:
        c.create_db(DB)
        with c.connect(DB) as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
            conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (SLOT,))
            conn.execute("SELECT feature_outbox.define_expire_output('tiles', 10, \"table\" => 'public.expire_tiles')")
            conn.execute("CREATE TABLE public.parcels (id bigint PRIMARY KEY, geom geometry(Polygon, 4326) NOT NULL, "
                         "version integer NOT NULL DEFAULT 0, name text)")
            conn.execute("SELECT feature_outbox.register_layer('parcels', 'public.parcels', properties => '{name}')")
            conn.execute("SELECT feature_outbox.expire_layer('parcels', 'tiles')")
            conn.execute("""SELECT feature_outbox.edit_feature('parcels', 1, ST_MakeEnvelope(13.60, 52.50, 13.61, 52.51, 4326),
                                                              'created', '{"name": "a"}')""")
            time.sleep(1.5)
            tiles = lambda: conn.execute("SELECT count(*) FROM public.expire_tiles").fetchone()[0]
            assert tiles() == 0, "tiles went out unconfirmed"
            conn.execute("CHECKPOINT")
            conn.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))
            conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (SLOT,))
            time.sleep(2.0)
            event = conn.execute("SELECT event_id::text FROM feature_outbox.outbox WHERE layer = 'parcels'").fetchone()[0]
            assert tiles() == 0, "tiles went out on a slot no standby has streamed from since their edit"
            assert event not in received_ids(nats_server)
            # The gate off: both go out.
            alter_system(c, {"feature_outbox.standby_slots": None})
            wait_for(lambda: tiles() > 0 and event in received_ids(nats_server), 10, "tiles and the event once the gate is off")
    finally:
        c.stop()
