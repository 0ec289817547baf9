"""The failover drill of issue 54: a primary relaying to NATS and an asynchronous standby streaming
from a physical slot; editors write at a steady rate; the standby's replication is paused (its
walreceiver stopped with SIGSTOP) while edits go on; the primary's whole process tree is killed at a
random point of the pause; the standby is promoted and relays. Counted against the new primary's
committed outbox rows:

- invented: events received whose event the new primary does not have;
- double versions: a (layer, feature, version) received with two different events;
- lost: committed outbox rows of the new primary never received.

With feature_outbox.standby_slots naming the standby's slot all three are 0; without it, the events
of the edits the standby never got are invented. `python pg_test/failover_drills.py [runs]` runs the
full drill (make faults); pg_test/test_failover.py runs one of each in make test."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import RUN_DIR, Cluster, free_port  # noqa: E402
from relay_harness import NatsServer, wait_for  # noqa: E402
from standby_harness import kill_tree, make_standby, walreceiver_pid  # noqa: E402

DB = "drill"
FEATURES = 100
SLOT = "replica1"


@dataclass
class Outcome:
    gated: bool
    paused_s: float
    edits_before_kill: int
    received: int
    invented: int
    double_versions: int
    lost: int
    content_mismatches: int
    promoted_to_published_s: float

    def line(self) -> str:
        return (f"{'standby_slots' if self.gated else 'no gate':>13}: paused {self.paused_s:.1f} s, "
                f"{self.edits_before_kill} edits on the old primary, {self.received} events received; "
                f"invented {self.invented}, double versions {self.double_versions}, lost {self.lost}, "
                f"content mismatches {self.content_mismatches}; first publish {self.promoted_to_published_s:.2f} s after promotion")


def point(feature: int, step: int) -> str:
    return f'{{"type":"Point","coordinates":[{(feature % 340) - 170 + (step % 1000) / 1000.0},{(feature % 160) - 80}]}}'


class Editors:
    """Moves the features one edit per transaction at `rate` edits/s until stopped or the server is
    gone; counts the commits it saw."""

    def __init__(self, c: Cluster, rate: float, step0: int = 1):
        self.c, self.rate, self.step = c, rate, step0
        self.committed = 0
        self.error: Exception | None = None
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        try:
            with self.c.connect(DB) as conn:
                next_at = time.monotonic()
                while not self.stop_flag.is_set():
                    feature = self.step % FEATURES + 1
                    conn.execute("SELECT feature_outbox.edit_feature(%s, %s, 'moved')", (feature, point(feature, self.step)))
                    self.committed += 1
                    self.step += 1
                    next_at += 1.0 / self.rate
                    time.sleep(max(0.0, next_at - time.monotonic()))
        except psycopg.Error as e:
            self.error = e  # the server went away: the drill's kill

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_flag.set()
        self.thread.join(30)


def count(received: list[dict], committed: dict[str, dict]) -> tuple[int, int, int, int]:
    """invented, double versions, lost and content mismatches of `received` (NATS messages) against
    the new primary's outbox rows by event_id."""
    events = [m["event"] for m in received]
    invented = sum(1 for e in events if e["event_id"] not in committed)
    by_version: dict[tuple, set] = {}
    for e in events:
        by_version.setdefault((e.get("layer", "features"), e["feature_id"], e["event_version"]), set()).add(e["event_id"])
    double = sum(1 for ids in by_version.values() if len(ids) > 1)
    got = {e["event_id"] for e in events}
    lost = sum(1 for event_id in committed if event_id not in got)
    mismatches = 0
    for e in events:
        row = committed.get(e["event_id"])
        if row and (e["feature_id"], e["event_version"], e["action"], e["routing_key"]) != \
                (str(row["feature_id"]), row["feature_version"], row["event_type"], row["routing_key"]):
            mismatches += 1
    return invented, double, lost, mismatches


def drill(nats: NatsServer, directory: Path, gated: bool, rng: random.Random, rate: float = 200.0) -> Outcome:
    """One run; the clusters are stopped (or were killed) when it returns."""
    primary = Cluster(directory / "primary", free_port())
    gate = [f"feature_outbox.standby_slots = '{SLOT}'"] if gated else []
    primary.start(f"feature_outbox.database = '{DB}'", f"feature_outbox.endpoint = '{nats.url}'",
                  "feature_outbox.poll_interval = '500ms'", "feature_outbox.retry_backoff_max = '1s'",
                  "wal_log_hints = on", *gate)
    standby = None
    try:
        primary.create_db(DB)
        with primary.connect(DB) as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
            conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", (SLOT,))
            conn.execute("SELECT feature_outbox.edit_feature(i, %s::text, 'created') FROM generate_series(1, %s) i",
                         (point(0, 0), FEATURES))
        standby = make_standby(primary, directory / "standby", slot=SLOT)
        receiver = walreceiver_pid(standby)
        with Editors(primary, rate) as editors:
            time.sleep(1.0)  # streaming as usual
            paused = rng.uniform(1.0, 4.0)
            os.kill(receiver, signal.SIGSTOP)
            try:
                time.sleep(paused)  # the kill comes at a random point of a 1-4 s pause
                kill_tree(primary)
                # What the stopped walreceiver's socket still holds is lost with the connection, as
                # WAL in flight is at a real crash: it ends (SIGTERM) before it reads on.
                os.kill(receiver, signal.SIGTERM)
            finally:
                os.kill(receiver, signal.SIGCONT)
            editors.stop_flag.set()
        before_kill = editors.committed
        with standby.connect() as conn:
            assert conn.execute("SELECT pg_promote(true, 60)").fetchone() == (True,)
        promoted = time.time()
        # The new primary has no standby yet: its gate names none. (Patroni's members get theirs from
        # the cluster-wide setting, docs: Failover.)
        with standby.connect() as conn:
            conn.execute("ALTER SYSTEM RESET feature_outbox.standby_slots")
            conn.execute("SELECT pg_reload_conf()")
        # Editors go on on the new primary: its versions of the features follow the ones it has.
        with Editors(standby, rate, step0=10_000_000) as after:
            time.sleep(1.0)
        assert after.committed > 50 and after.error is None, f"editing the new primary failed: {after.error}"
        with standby.connect(DB) as conn:
            wait_for(lambda: conn.execute("SELECT count(*) = 0 FROM feature_outbox.outbox WHERE published_at IS NULL").fetchone()[0],
                     60, "the new primary to relay its backlog")
            conn.row_factory = psycopg.rows.dict_row
            committed = {str(r["event_id"]): r for r in conn.execute("SELECT * FROM feature_outbox.outbox").fetchall()}
            # Only the new primary publishes after the kill: its first mark after promotion.
            first = conn.execute("SELECT extract(epoch FROM min(published_at)) AS t FROM feature_outbox.outbox "
                                 "WHERE published_at >= to_timestamp(%s)", (promoted,)).fetchone()["t"]
        received = nats.messages()
        invented, double, lost, mismatches = count(received, committed)
        return Outcome(gated, paused, before_kill, len(received), invented, double, lost, mismatches, float(first or 0) - promoted)
    finally:
        for c in (standby, primary):
            if c is not None:
                c.stop()


def main(runs: int) -> int:
    """The full drill for make faults: `runs` gated runs, each with the kill at a random point, and
    as many without the gate to show what it prevents."""
    rng = random.Random(int(os.environ.get("FEATURE_OUTBOX_DRILL_SEED", time.time())))
    failed = 0
    for gated in (True, False):
        for run in range(runs):
            nats = NatsServer(RUN_DIR / "failover-nats")
            nats.start()
            try:
                outcome = drill(nats, RUN_DIR / f"failover-{run}", gated, rng)
            finally:
                nats.stop()
            print(f"run {run + 1}/{runs} {outcome.line()}", flush=True)
            if gated and (outcome.invented or outcome.double_versions or outcome.lost or outcome.content_mismatches):
                failed += 1
    print(f"failover drill: {failed} of {runs} gated runs invented, doubled, lost or changed an event")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10))
