"""A sink that hangs without closing its connection (issue 54): nats-server or the Kafka broker
(tansu) SIGSTOPped, so TCP stays up and nothing answers. With no edits, an idle worker's look at
its sink, a request with a deadline, must show it down within 2 x feature_outbox.poll_interval:
outbox_sink_up 0, outbox_sink_last_success_timestamp_seconds no longer advancing, the error in
the workers view and in backlog.relay_last_error. After SIGCONT it is up again.

The same hang under load, and the broker killed and restarted, with the drain resuming within 2 s
of the sink's return, are fault drills (pg_test/sink_drills.py): pg_test/test_faults.py runs them
short in `make test`, `make faults` in full."""

import re
import signal
import time

import pytest

from conftest import RUN_DIR
from kafka_harness import Tansu
from relay_harness import NatsServer, relay_cluster, wait_for

DB = "sinkhang"
POLL = 1.0  # feature_outbox.poll_interval, seconds
SETTINGS = (f"feature_outbox.poll_interval = '{POLL:g}s'", "feature_outbox.relay_workers = 1")


def sink_series(c, db: str = DB) -> dict:
    """metrics()'s sink health series of worker 0."""
    with c.connect(db) as conn:
        text = conn.execute("SELECT feature_outbox.metrics()").fetchone()[0]
    out = {}
    for name in ("outbox_sink_up", "outbox_sink_errors_total", "outbox_sink_last_success_timestamp_seconds"):
        m = re.search(rf'^{name}{{database="{db}",worker="0"}} (\S+)$', text, re.M)
        assert m, (name, text)
        out[name] = float(m[1])
    return out


def worker_pid(c) -> int:
    with c.connect(DB) as conn:
        return conn.execute("SELECT pid FROM feature_outbox.workers WHERE worker = 0").fetchone()[0]


def errors_shown(c) -> tuple:
    """The worker's sink_up and last_error, and the backlog's relay_last_error."""
    with c.connect(DB) as conn:
        up, last = conn.execute("SELECT sink_up, last_error FROM feature_outbox.workers WHERE worker = 0").fetchone()
        current = conn.execute("SELECT relay_last_error FROM feature_outbox.backlog").fetchone()[0]
    return up, last, current


def hang_is_seen(c, pause, resume, sink: str) -> None:
    """Healthy and idle, then `pause()` (SIGSTOP): down within 2 x POLL, the last success frozen, the
    error shown; then `resume()` (SIGCONT): up again, the last success moving on."""
    up = wait_for(lambda: (s := sink_series(c)) and s["outbox_sink_up"] == 1 and s, 20, "the sink up")
    time.sleep(1.5 * POLL)
    before, pid = sink_series(c), worker_pid(c)
    assert before["outbox_sink_up"] == 1 and pid
    assert before["outbox_sink_last_success_timestamp_seconds"] > up["outbox_sink_last_success_timestamp_seconds"], \
        "an idle worker's look each poll interval counts as a success"
    pause()
    stopped = time.monotonic()
    try:
        # No WAIT_SCALE on the bound: it is the requirement, not a wait.
        down = wait_for(lambda: (s := sink_series(c)) and s["outbox_sink_up"] == 0 and s, 10, f"{sink} seen down",
                        interval=0.02)
        took = time.monotonic() - stopped
        print(f"\n{sink} hung (SIGSTOP), no edits: outbox_sink_up 0 after {took:.2f} s (poll_interval {POLL:g} s)")
        assert took <= 2 * POLL, f"{sink} hung: seen down after {took:.2f} s, over 2 x poll_interval"
        assert down["outbox_sink_errors_total"] > before["outbox_sink_errors_total"]
        frozen = down["outbox_sink_last_success_timestamp_seconds"]
        time.sleep(1.5 * POLL)
        still = sink_series(c)
        assert still["outbox_sink_up"] == 0
        assert still["outbox_sink_last_success_timestamp_seconds"] == frozen, "no success while the sink hangs"
        worker_up, last_error, relay_last_error = errors_shown(c)
        assert worker_up is False and last_error and sink in last_error, last_error
        assert relay_last_error and sink in relay_last_error, relay_last_error
        print(f"last_error: {last_error}")
    finally:
        resume()
    resumed = time.monotonic()
    back = wait_for(lambda: (s := sink_series(c)) and s["outbox_sink_up"] == 1 and s, 10, f"{sink} up again")
    print(f"{sink} up again {time.monotonic() - resumed:.2f} s after SIGCONT")
    assert back["outbox_sink_last_success_timestamp_seconds"] > frozen
    time.sleep(1.5 * POLL)
    assert sink_series(c)["outbox_sink_last_success_timestamp_seconds"] > back["outbox_sink_last_success_timestamp_seconds"]
    assert worker_pid(c) == pid, "the same worker throughout: it backed off, it did not die"


@pytest.fixture
def nats_relay():
    server = NatsServer(RUN_DIR / "sinkhang_nats")
    server.start()
    c = relay_cluster("sinkhang_nats_pg", DB, *SETTINGS, f"feature_outbox.endpoint = '{server.url}'")
    yield c, server
    server.proc.send_signal(signal.SIGCONT)
    c.stop()
    server.stop()


@pytest.fixture
def kafka_relay():
    broker = Tansu(RUN_DIR / "sinkhang_tansu")
    broker.start()
    c = relay_cluster("sinkhang_kafka_pg", DB, *SETTINGS, f"feature_outbox.endpoint = '{broker.url}'")
    yield c, broker
    broker.resume()
    c.stop()
    broker.stop()


def test_hung_nats_with_no_edits_is_seen_down_within_two_poll_intervals(nats_relay):
    c, server = nats_relay
    hang_is_seen(c, lambda: server.proc.send_signal(signal.SIGSTOP), lambda: server.proc.send_signal(signal.SIGCONT), "NATS")


def test_hung_kafka_broker_with_no_edits_is_seen_down_within_two_poll_intervals(kafka_relay):
    c, broker = kafka_relay
    hang_is_seen(c, broker.pause, broker.resume, "Kafka")


def test_a_sink_that_answers_and_refuses_keeps_its_backoff():
    """A wrong password: nats-server greets every probe, so no probe ever saw it not answering, and
    the backoff is never cut short. Failures come at the backoff's pace (retry_backoff_min 1 s,
    doubling, jitter down to half: the next ones 0.5, 1.5, 3.5 and 7.5 s after the first at the
    soonest, 1, 3 and 7 s at the latest), 2 or 3 in the 6 s after the first, where a backoff ended by
    each answering probe (every 0.5 s) would retry about 12 times."""
    server = NatsServer(RUN_DIR / "sinkhang_nats_auth", "--user", "relay", "--pass", "right")
    server.start()
    url = f"nats://relay:wrong@127.0.0.1:{server.port}"
    c = relay_cluster("sinkhang_refused_pg", DB, *SETTINGS, f"feature_outbox.endpoint = '{url}'")
    try:
        def errors() -> int:
            with c.connect(DB) as conn:
                return conn.execute("SELECT sink_errors FROM feature_outbox.workers WHERE worker = 0").fetchone()[0] or 0
        first = wait_for(errors, 20, "the first refused connect")
        time.sleep(6)
        retries = errors() - first
        print(f"\nwrong password: {retries} more failures in the 6 s after the first")
        assert 2 <= retries <= 3, f"{retries} failures in 6 s"
        _, last_error, _ = errors_shown(c)
        assert "authorization" in last_error.lower(), last_error
    finally:
        c.stop()
        server.stop()
