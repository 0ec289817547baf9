"""Fault drills 19 and 20 (issue 54): the sink taken away under load and given back, where the relay
must resume the drain within RESUME_LIMIT seconds of the sink's return, whatever the outage's
length. Each drill runs two outages with editors writing throughout:

- hung: the server SIGSTOPped (its connections stay open, nothing answers: a hung broker, or a
  proxy that accepts TCP and forwards nothing), then SIGCONT;
- killed: the server killed (kill -9), then started again on the same port and storage.

The backoff runs with its defaults (1 s doubling up to 1 min; the other drills cap it at 1 s, which
hides a backoff that sleeps past the sink's return). Each sink comes back at the moment that tests
the backoff: after at least 3 failures, just after a fresh one, so a backoff that only sleeps would
still have 2 s or more to go. Every event is checked against its committed outbox row and the point
its editor wrote; lost and invented must be 0. Registered in faults.DRILLS: `make test` runs them
short (outages of 10 and 5 s), `make faults` in full (30 s each)."""

from __future__ import annotations

import signal
import time

from conftest import RUN_DIR
from drills import (DB, Editors, Nats, Row, drain, nats_binary, parked, read_stream, start_cluster, tally,
                    workers)
from kafka_drills import check_messages
from kafka_harness import Tansu
from relay_harness import wait_for

RESUME_LIMIT = 2.0
SETTINGS = (
    "feature_outbox.relay_workers = 1",
    # The defaults again, after drills.BASE_SETTINGS (a later line of postgresql.auto.conf wins).
    "feature_outbox.retry_backoff_min = '1s'",
    "feature_outbox.retry_backoff_max = '1min'",
)


def sink_errors(c) -> int:
    return workers(c, "sink_errors")[0][0] or 0


def first_publish_after(c, t: float) -> float | None:
    """Seconds from wall-clock time `t` to the first row marked published after it (the relay
    marks with clock_timestamp() once the sink acknowledged), or None while there is none."""
    with c.connect(DB) as conn:
        first = conn.execute("SELECT extract(epoch FROM min(published_at))::float8 FROM feature_outbox.outbox"
                             " WHERE published_at > to_timestamp(%s)", (t,)).fetchone()[0]
    return None if first is None else first - t


def outage(c, down, up, seconds: float) -> tuple[float, int]:
    """`down()`, at least `seconds` with the editors writing, then `up()` once the worker failed 3
    times or more and has just failed again. Returns the seconds from the sink's return to the
    first row published after it, and the sink failures the outage counted."""
    before = sink_errors(c)
    down()
    try:
        time.sleep(seconds)
        wait_for(lambda: sink_errors(c) >= before + 3, 60, "3 sink failures")
        seen = sink_errors(c)
        wait_for(lambda: sink_errors(c) > seen, 60, "a fresh sink failure", interval=0.02)
    finally:
        up()
    back = time.time()
    resumed = wait_for(lambda: first_publish_after(c, back), 60, "the drain to resume", interval=0.05)
    return resumed, sink_errors(c) - before


def content_checks(c, ledger, deliveries: list[tuple[str, dict]]) -> dict:
    """Each delivered event against its committed outbox row (action, layer, feature, version) and,
    where it carries its own version's geometry, against the point its editor wrote."""
    with c.connect(DB) as conn:
        rows = {eid: (layer, fid, version, action) for eid, layer, fid, version, action in conn.execute(
            "SELECT event_id::text, layer, feature_id, feature_version, event_type FROM feature_outbox.outbox")}
    wrong = []
    for eid, body in deliveries:
        row = rows.get(eid)
        if row is None:
            continue  # tally counts it as invented
        if (body["layer"], int(body["feature_id"]), body["event_version"], body["action"]) != row:
            wrong.append((eid, "not its outbox row"))
        written = ledger.positions.get(eid)
        if eid in ledger.committed and written and body.get("geometry_version") == body["event_version"]:
            (lon, lat), _ = written
            got = body["geometry"]["coordinates"]
            if abs(got[0] - lon) > 1e-9 or abs(got[1] - lat) > 1e-9:
                wrong.append((eid, f"point {got}, committed {(lon, lat)}"))
    return {"every event is its committed outbox row": not wrong, **({f"first wrong: {wrong[0]}": False} if wrong else {})}


def run(name: str, label: str, c, hang, unhang, kill, restart, short: bool, read) -> Row:
    """Editors write throughout both outages; then the outbox drains and every delivery is checked."""
    hung_s, killed_s = (10, 5) if short else (30, 30)
    editors = Editors(c, n=2, rate=50).start()
    time.sleep(1)
    hung_resume, hung_failures = outage(c, hang, unhang, hung_s)
    time.sleep(1)
    killed_resume, killed_failures = outage(c, kill, restart, killed_s)
    recovered = time.time()
    time.sleep(1)
    ledger = editors.stop()
    drain_s = drain(c, recovered)
    deliveries, checks = read(ledger)
    row = tally(f"{name}: hung {hung_s} s (SIGSTOP), then killed {killed_s} s (kill -9) and restarted", ledger,
                deliveries, drain_s,
                note=(f"drain resumed {hung_resume:.2f} s after SIGCONT ({hung_failures} sink failures in the hang), "
                      f"{killed_resume:.2f} s after the restart ({killed_failures} failures); {parked(c)} parked"))
    row.checks = {**checks, **content_checks(c, ledger, deliveries),
                  f"drain resumed within {RESUME_LIMIT:g} s of SIGCONT": hung_resume <= RESUME_LIMIT,
                  f"drain resumed within {RESUME_LIMIT:g} s of the restart": killed_resume <= RESUME_LIMIT,
                  "nothing parked": parked(c) == 0}
    print(f"{label}: {row.note}", flush=True)
    return row


def nats_hang(short: bool, nats_version: str = "debian") -> Row:
    server = Nats(RUN_DIR / "drills" / "nats_hang", nats_binary(nats_version))
    server.start()
    c = start_cluster("nats_hang", *SETTINGS, endpoint=server.url)
    try:
        return run("19. NATS", "nats_hang", c,
                   lambda: server.proc.send_signal(signal.SIGSTOP), lambda: server.proc.send_signal(signal.SIGCONT),
                   server.kill, server.start, short,
                   lambda ledger: (read_stream([server.url]), {}))
    finally:
        if server.proc:
            server.proc.send_signal(signal.SIGCONT)
        c.stop()
        server.stop()


def kafka_hang(short: bool, nats_version: str = "debian") -> Row:
    broker = Tansu(RUN_DIR / "drills" / "tansu_hang")
    broker.start()
    c = start_cluster("kafka_hang", *SETTINGS, "feature_outbox.kafka_partitions = 8", endpoint=broker.url)
    try:
        return run("20. Kafka", "kafka_hang", c, broker.pause, broker.resume, broker.kill, broker.start, short,
                   lambda ledger: check_messages(broker, ledger))
    finally:
        if broker.proc:
            broker.resume()
        c.stop()
        broker.stop()

