"""The Patroni failover drill (issue 54): what subscribers hold after Patroni promotes an asynchronous
replica, counted against the new leader's committed outbox.

One run:
 1. etcd, a 3-member Patroni cluster (pg_test/patroni_harness.py) and nats-server -js; every relay
    setting set once, in Patroni's dynamic configuration; the extension, a layer `drill` and 100
    point features created on the leader.
 2. Two editors move the features at a steady rate through a libpq multi-host connection string
    (target_session_attrs=read-write): they follow whichever member is the leader, as an application
    behind Patroni does. The relay on the leader publishes each edit within milliseconds.
 3. Streaming to every replica stops (the leader's walsenders SIGSTOPped) for 1 to 4 s of edits, then
    the leader's node is lost: Patroni and its whole PostgreSQL process tree SIGKILLed.
 4. Patroni promotes a replica once the leader key expires (ttl); the relay there starts by itself.
    The editors go on against the new leader, then stop; its outbox drains.
 5. The counts, against the new leader's outbox rows of the layer:
      invented  distinct events received whose event_id the new leader does not hold: the old
                leader published the edit, and it is not on the new timeline
      double    (layer, feature, version) received with two different contents: an invented
                version, and the new leader's own edit that took the same number
      lost      new-leader outbox rows never received (must be 0 in every variant)
    and the times: kill -> promotion, promotion -> the new leader's first publish (<= 30 s).
 6. Replica lost for good: the remaining replica's node killed with the leader staying; how long
    the leader's relay is held (0 without a gate; <= ttl + a few seconds with one), and when Patroni
    reacts (synchronous_standby_names rewritten, the lost member's slot dropped).

Gates (issue 54's settings; a gated variant is skipped on a build without its setting, where
`SHOW <setting>` fails):
    none    asynchronous replication, no gate: invented > 0 expected in most runs
    sync    Patroni synchronous_mode: true, synchronous_commit = local (editors never wait), and
            feature_outbox.wait_for_synchronous_standbys = on
(feature_outbox.standby_slots has no variant: one cluster-wide list would name each member's own
slot, which it does not have, and the gate waits for a missing slot rather than skip it; docs,
Failover.)

    .venv/bin/python pg_test/patroni_drills.py [--short] [--versions 3.0,4.1.5] [--gates none,sync]
                                               [--runs 10] [--out pg_test/PATRONI.md]
"""

from __future__ import annotations

import argparse
import functools
import platform
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import PG_BIN, RUN_DIR, Cluster, free_port  # noqa: E402
from drills import Nats, read_stream  # noqa: E402
from patroni_harness import VERSIONS, PatroniCluster, patroni_version, slot_name, wait_until  # noqa: E402

DB = "drills"
LAYER = "drill"
FEATURES = 100
TABLE = "CREATE TABLE public.drill (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0)"
MEMBERS = 3
RELAY = {
    "feature_outbox.database": DB,
    "feature_outbox.poll_interval": "1s",
    "feature_outbox.retry_backoff_min": "100ms",
    "feature_outbox.retry_backoff_max": "1s",
    "feature_outbox.publish_timeout": "2s",
}
FIRST_PUBLISH_LIMIT = 30.0    # s from promotion to the new leader's first publish
HOLD_SLACK = 10.0             # s over ttl that a lost replica may hold the relay, with a gate


@dataclass(frozen=True)
class Gate:
    name: str
    setting: str | None          # the relay setting that must exist (SHOW) for the variant to run
    parameters: dict             # cluster-wide, in the dynamic configuration
    dcs: dict                    # further dynamic configuration
    dcs_4x: dict = field(default_factory=dict)   # only where Patroni knows it (4.x)


GATES = {
    "none": Gate("none", None, {}, {}),
    "sync": Gate("sync", "feature_outbox.wait_for_synchronous_standbys",
                 {"synchronous_commit": "local", "feature_outbox.wait_for_synchronous_standbys": "on"},
                 {"synchronous_mode": True}),
}


@functools.cache
def gate_missing(gate: str) -> str | None:
    """Why the gate cannot run on this build (None when it can): its setting must be one the
    extension defines. A throwaway server preloading feature_outbox answers SHOW."""
    setting = GATES[gate].setting
    if setting is None:
        return None
    c = Cluster(RUN_DIR / "patroni-probe", free_port())
    c.start()
    try:
        with c.connect() as conn:
            conn.execute(f"SHOW {setting}")
        return None
    except psycopg.errors.UndefinedObject as e:
        return (f"the gate of issue 54 is not in this build: SHOW {setting} fails ({str(e).strip()}); "
                f"the '{gate}' variant runs once the relay defines it")
    finally:
        c.stop()
        subprocess.run(["rm", "-rf", str(c.dir)], check=False)


# ---- editors ---------------------------------------------------------------------------------------

@dataclass
class Ledger:
    # event_id -> (feature_id, version, (lon, lat), wall time the COMMIT returned, the server's port)
    committed: dict = field(default_factory=dict)
    uncertain: dict = field(default_factory=dict)    # event_id -> port, of COMMITs cut off
    errors: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Editors:
    """`n` connections moving their share of features 1..FEATURES, `rate` commits a second each,
    through a multi-host DSN: after a failover they reconnect to whichever member is the leader."""

    def __init__(self, dsn: str, n: int = 2, rate: float = 25.0, seed: int = 0):
        self.dsn, self.n, self.rate, self.seed = dsn, n, rate, seed
        self.ledger = Ledger()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(n)]

    def start(self) -> "Editors":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> Ledger:
        self.stopping.set()
        for t in self.threads:
            t.join(60)
        return self.ledger

    def run(self, index: int) -> None:
        rng = random.Random(self.seed * 100 + index)
        mine = [f for f in range(1, FEATURES + 1) if f % self.n == index]
        conn = None
        while not self.stopping.is_set():
            if conn is None:
                try:
                    conn = psycopg.connect(self.dsn)
                except psycopg.Error:
                    self.ledger.errors["connect"] += 1
                    time.sleep(0.2)
                    continue
            fid = rng.choice(mine)
            lon, lat = rng.uniform(-120, -70), rng.uniform(25, 49)
            try:
                conn.execute(f"SELECT feature_outbox.edit_feature('{LAYER}', %s, ST_SetSRID(ST_MakePoint(%s, %s), 4326), 'moved')",
                             (fid, lon, lat))
                eid, version = conn.execute("SELECT event_id::text, feature_version FROM feature_outbox.outbox WHERE layer = %s "
                                            "AND feature_id = %s ORDER BY id DESC LIMIT 1", (LAYER, fid)).fetchone()
            except psycopg.Error as e:
                self.ledger.errors[type(e).__name__] += 1
                conn = self._reset(conn)
                continue
            port = conn.info.port
            try:
                conn.commit()
            except psycopg.Error:
                with self.ledger.lock:
                    self.ledger.uncertain[eid] = port
                conn = self._reset(conn)
                continue
            with self.ledger.lock:
                self.ledger.committed[eid] = (fid, version, (lon, lat), time.time(), port)
            time.sleep(1.0 / self.rate)
        if conn is not None:
            conn.close()

    @staticmethod
    def _reset(conn):
        try:
            conn.close()
        except Exception:
            pass
        time.sleep(0.05)
        return None


# ---- the row ---------------------------------------------------------------------------------------

@dataclass
class Row:
    version: str
    gate: str
    run: int
    pause_s: float = 0.0
    committed: int = 0              # acknowledged edits (COMMIT returned), on either leader
    received: int = 0               # distinct events in the stream
    duplicates: int = 0             # deliveries beyond the first of an event_id
    invented: int = 0
    double: int = 0
    lost: int = 0
    acked_missing: int = 0          # acknowledged edits the new leader does not hold
    promotion_s: float = 0.0        # kill -> the new leader accepts writes
    first_publish_s: float = 0.0    # promotion -> the new leader's first publish
    hold_s: float | None = None     # replica lost: longest commit-to-publish on the leader after the kill
    note: str = ""
    checks: dict = field(default_factory=dict)

    def line(self) -> str:
        hold = "" if self.hold_s is None else f"{self.hold_s:.1f}"
        return (f"| {self.version} | {self.gate} | {self.run} | {self.pause_s:.1f} | {self.committed:,} | {self.received:,} | "
                f"{self.duplicates:,} | {self.invented:,} | {self.double:,} | {self.lost:,} | {self.acked_missing:,} | "
                f"{self.promotion_s:.1f} | {self.first_publish_s:.1f} | {hold} |")


HEADER = ("| Patroni | gate | run | paused s | committed | received | duplicates | invented | double | lost | "
          "acked, not on new leader | kill to promotion s | promotion to first publish s | replica lost: relay held s |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def content(body: dict) -> tuple:
    """What a subscriber acts on: the action, the point and the routing key."""
    coords = tuple(round(float(c), 9) for c in (body.get("geometry") or {}).get("coordinates", ()))
    return body.get("action"), coords, body.get("routing_key")


def count(row: Row, ledger: Ledger, deliveries: list[tuple[str, dict]], held: dict) -> set:
    """Fills the row's counts; returns the invented event_ids. `held`: event_id -> (feature_id,
    version) of every outbox row of the layer on the new leader."""
    ids = Counter(mid for mid, _ in deliveries)
    row.received = len(ids)
    row.duplicates = sum(ids.values()) - len(ids)
    invented = {mid for mid in ids if mid not in held}
    row.invented = len(invented)
    versions = defaultdict(set)
    for _, body in deliveries:
        versions[(body["layer"], int(body["feature_id"]), body["event_version"])].add(content(body))
    row.double = sum(1 for v in versions.values() if len(v) > 1)
    row.lost = len(set(held) - set(ids))
    row.committed = len(ledger.committed)
    row.acked_missing = len(set(ledger.committed) - set(held))
    return invented


def promotion_time(member, after: float) -> float | None:
    """Wall time of the new leader's end of recovery, from its server log (Patroni's log holds it):
    the 'selected new timeline ID' line, written at promotion."""
    stamp = None
    for line in member.log.read_text(errors="replace").splitlines():
        if "selected new timeline ID" in line:
            m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) UTC", line)
            if m:
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
                if t >= after - 1:
                    stamp = t
    return stamp


def settings_everywhere(pc: PatroniCluster, names: dict) -> dict:
    """What each live member shows for each setting: proves the one dynamic configuration reached all."""
    out = {}
    for m in pc.live():
        out[m.name] = {}
        with m.connect() as conn:
            for k in names:
                try:
                    out[m.name][k] = conn.execute(f"SHOW {k}").fetchone()[0]
                except psycopg.errors.UndefinedObject:
                    out[m.name][k] = None   # a gate's setting on a build without it: dropped at start
    return out


# ---- the drill ---------------------------------------------------------------------------------------

def setup_database(pc: PatroniCluster, leader: str) -> None:
    lm = pc.member(leader)
    with lm.connect() as conn:
        conn.execute(f"CREATE DATABASE {DB}")
    with lm.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute(TABLE)
        conn.execute(f"SELECT feature_outbox.register_layer('{LAYER}', 'public.drill')")
        conn.execute(f"""SELECT feature_outbox.edit_feature('{LAYER}', i, ST_SetSRID(ST_MakePoint(-100 + i / 10.0, 40), 4326), 'created')
                           FROM generate_series(1, {FEATURES}) i""")


def unpublished(m) -> int:
    return m.query("SELECT count(*) FROM feature_outbox.outbox WHERE published_at IS NULL", db=DB)[0][0]


def failover(version: str = "4.1.5", gate: str = "none", run: int = 1, short: bool = True,
             replica_lost: bool = True, gated: bool = True, log=print) -> Row:
    """One run of the drill (module docstring). Raises on a harness failure; the row's checks say
    whether the relay behaved. gated=False runs a gate's Patroni configuration on a build without
    the gate's setting (the server drops the unknown feature_outbox.* name with a warning): what
    Patroni does, with the relay ungated, and no check of the gate."""
    rng = random.Random(run * 7919 + (0 if short else 1))
    g = GATES[gate]
    steady = 3.0 if short else rng.uniform(2, 8)
    pause = 2.0 if short else rng.uniform(1, 4)
    row = Row(version, gate if gated or gate == "none" else f"{gate} (not in this build)", run, pause)
    gated = gated and gate != "none"
    base = RUN_DIR / "patroni" / f"{version}-{gate}-{run}"
    nats = Nats(base / "nats")
    nats.start()
    dcs = {**g.dcs, **(g.dcs_4x if version != "3.0" else {})}
    pc = PatroniCluster(base / "cluster", version, MEMBERS, parameters={**RELAY, "feature_outbox.endpoint": nats.url, **g.parameters},
                        dcs=dcs)
    notes = []
    editors = None
    try:
        t0 = time.monotonic()
        pc.start()
        leader = pc.wait_for_leader(60)
        setup_database(pc, leader)
        lm = pc.member(leader)
        wait_until(lambda: unpublished(lm) == 0, 60, "the leader's relay to publish the created features")
        pc.wait_replayed(leader)
        shown = settings_everywhere(pc, {k: v for k, v in pc.parameters.items() if k.startswith("feature_outbox.")})
        row.checks["the dynamic configuration's relay settings reached every member"] = all(
            v["feature_outbox.endpoint"] == nats.url and v["feature_outbox.database"] == DB for v in shown.values())
        log(f"  cluster up in {time.monotonic() - t0:.1f} s: leader {leader}, replicas {pc.replicas()}; "
            f"synchronous_standby_names {lm.query('SHOW synchronous_standby_names')[0][0]!r}")

        editors = Editors(pc.multi_host_dsn(DB), seed=run).start()
        time.sleep(steady)
        for r in pc.replicas():
            pc.pause_replication(r)
        paused_at = time.time()
        paused_states = Counter()
        while time.time() < paused_at + pause:
            try:
                paused_states.update(s for (s,) in lm.query("SELECT state FROM feature_outbox.workers", db=DB))
            except psycopg.Error:
                pass
            time.sleep(0.2)
        if gated:
            row.checks["the relay waited for the standbys while replication was paused"] = paused_states["waiting for standby"] > 0
        lag = lm.query("SELECT pg_current_wal_insert_lsn() - min(replay_lsn) FROM pg_stat_replication")[0][0]
        killed_at = time.time()
        killed_mono = time.monotonic()
        pc.kill_node(leader)
        new = pc.wait_for_leader(120, exclude={leader})
        promoted_mono = time.monotonic()
        nm = pc.member(new)
        promoted_at = promotion_time(nm, killed_at) or (time.time() - (time.monotonic() - promoted_mono))
        row.promotion_s = promoted_at - killed_at
        slots_at_promotion = [f"{n} {'active' if a else 'inactive'} {lsn or 'no restart_lsn'}" for n, a, lsn in
                              nm.query("SELECT slot_name, active, restart_lsn::text FROM pg_replication_slots ORDER BY 1")]
        notes.append(f"slots on {new} at its promotion: {', '.join(slots_at_promotion) or 'none'}")
        log(f"  replication paused {pause:.1f} s ({lag} bytes behind; relay states {dict(paused_states)}), {leader} killed; "
            f"{new} promoted {row.promotion_s:.1f} s after the kill")

        time.sleep(3 if short else 8)
        first = wait_until(lambda: nm.query("SELECT extract(epoch FROM min(published_at)) FROM feature_outbox.outbox "
                                            "WHERE published_at > to_timestamp(%s)", killed_at, db=DB)[0][0],
                           FIRST_PUBLISH_LIMIT * 2, "the new leader to publish")
        row.first_publish_s = float(first) - promoted_at
        row.checks[f"the new leader published within {FIRST_PUBLISH_LIMIT:g} s of its promotion"] = row.first_publish_s <= FIRST_PUBLISH_LIMIT

        if replica_lost:
            hold, lost_notes = lose_replica(pc, new, version, short)
            row.hold_s = hold
            notes += lost_notes
            if gated:
                ttl = pc.dcs["ttl"]
                row.checks[f"a lost replica holds the relay at most ttl + {HOLD_SLACK:g} s"] = hold <= ttl + HOLD_SLACK

        ledger = editors.stop()
        editors = None
        wait_until(lambda: unpublished(nm) == 0, 120, "the new leader's outbox to drain")
        held = {eid: (fid, v) for eid, fid, v in nm.query(
            "SELECT event_id::text, feature_id, feature_version FROM feature_outbox.outbox WHERE layer = %s", LAYER, db=DB)}
        deliveries = read_stream([nats.url])
        invented = count(row, ledger, deliveries, held)
        old_port = pc.member(leader).pg_port
        edited_on_old = ({eid for eid, (*_, port) in ledger.committed.items() if port == old_port}
                         | {eid for eid, port in ledger.uncertain.items() if port == old_port})
        row.checks["every invented event is of an edit the old leader committed"] = invented <= edited_on_old
        row.checks["no new-leader outbox row is lost"] = row.lost == 0
        if gated:
            row.checks["no invented events"] = row.invented == 0
            row.checks["no double versions"] = row.double == 0
        during = sum(1 for *_, at, port in ledger.committed.values() if port == old_port and at >= paused_at)
        notes.insert(0, f"{during} edits acknowledged while replication was paused; editor errors "
                        f"{dict(ledger.errors)}; {len(ledger.uncertain)} commits cut off")
        row.note = "; ".join(notes)
        return row
    finally:
        if editors is not None:
            editors.stop()
        pc.stop_all()
        nats.stop()
        subprocess.run(["rm", "-rf", str(base / "nats" / "store")], check=False)


def lose_replica(pc: PatroniCluster, leader: str, version: str, short: bool) -> tuple[float, list[str]]:
    """The remaining replica's node killed while editors write on `leader`: returns the longest
    commit-to-publish time of the edits committed in the window after the kill (how long the relay
    was held), and what Patroni did meanwhile."""
    lm = pc.member(leader)
    [replica] = [r for r in pc.replicas() if r != leader]
    slot = pc.member(replica).slot
    if pc.dcs.get("synchronous_mode"):
        # Patroni names a synchronous standby a few seconds after the promotion, then waits 2 s to
        # see it in pg_stat_replication before writing it to the DCS. A member lost within those 2 s
        # stays in synchronous_standby_names for good on Patroni 3.0.2 (the DCS never knew it, so
        # Patroni sees nothing to change). The drill loses the replica once Patroni has settled.
        wait_until(lambda: any(x["name"] == replica and x.get("role") in ("sync_standby", "quorum_standby")
                               for x in pc.cluster_view()["members"]), 60, f"Patroni to report {replica} synchronous")
    ssn0 = lm.query("SHOW synchronous_standby_names")[0][0]
    slots0 = {s for (s,) in lm.query("SELECT slot_name FROM pg_replication_slots")}
    killed_at = time.time()
    pc.kill_node(replica)
    ttl = pc.dcs["ttl"]
    # Short: until an edit committed after the kill is published, and 2 s more, and at least three
    # Patroni loops (for synchronous_standby_names to be rewritten). Full: ttl + 15 s
    # whatever happens, to see when Patroni drops the slot or rewrites synchronous_standby_names.
    observe = None if short else ttl + 15
    waited, ssn_changed, slot_dropped, states = None, None, None, Counter()
    deadline = time.monotonic() + ttl + 30
    while time.monotonic() < deadline:
        now = time.time() - killed_at
        with lm.connect(DB) as conn:
            states.update(s for (s,) in conn.execute("SELECT state FROM feature_outbox.workers"))
            ssn = conn.execute("SHOW synchronous_standby_names").fetchone()[0]
            slots = {s for (s,) in conn.execute("SELECT slot_name FROM pg_replication_slots")}
            late = conn.execute("SELECT extract(epoch FROM min(published_at)) FROM feature_outbox.outbox "
                                "WHERE created_at > to_timestamp(%s) AND published_at IS NOT NULL", (killed_at,)).fetchone()[0]
        if ssn_changed is None and ssn != ssn0:
            ssn_changed = (now, ssn)
        if slot_dropped is None and slot in slots0 and slot not in slots:
            slot_dropped = now
        if late is not None and waited is None:
            waited = now
        if observe is None and waited is not None and now >= max(waited + 2, 3 * pc.dcs["loop_wait"]):
            break
        if observe is not None and now >= observe:
            break
        time.sleep(0.1)
    with lm.connect(DB) as conn:
        hold = conn.execute("""SELECT coalesce(max(extract(epoch FROM coalesce(published_at, now()) - created_at)), 0)
                                 FROM feature_outbox.outbox WHERE created_at > to_timestamp(%s)""", (killed_at,)).fetchone()[0]
    notes = [f"replica {replica} lost: relay held {float(hold):.1f} s; worker states seen {dict(states)}"]
    if ssn0 or ssn_changed:
        notes.append(f"synchronous_standby_names {ssn0!r}" + (f" became {ssn_changed[1]!r} {ssn_changed[0]:.1f} s after the kill"
                                                             if ssn_changed else " unchanged"))
    if slot in slots0:
        notes.append(f"slot {slot} " + (f"dropped {slot_dropped:.1f} s after the kill" if slot_dropped is not None
                                        else f"still there {time.time() - killed_at:.0f} s after the kill"))
    return float(hold), notes


# ---- the full form ---------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--versions", default=",".join(VERSIONS))
    ap.add_argument("--gates", default=",".join(GATES))
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "PATRONI.md"))
    ap.add_argument("--without-gate", action="store_true",
                    help="run a gated variant on a build without its setting: Patroni's side of it, the relay ungated")
    args = ap.parse_args()
    rows, skipped = [], []
    for version in args.versions.split(","):
        for gate in args.gates.split(","):
            why = gate_missing(gate)
            if why and args.without_gate:
                print(f"{version}/{gate}: {why}; running Patroni's side only (--without-gate)", flush=True)
            elif why:
                print(f"skipped {version}/{gate}: {why}", flush=True)
                skipped.append(f"{version} / {gate}: {why}")
                continue
            for run in range(1, args.runs + 1):
                print(f"drill Patroni {version}, gate {gate}, run {run} ...", flush=True)
                row = failover(version, gate, run, short=args.short, gated=not why)
                print(row.line(), row.note, flush=True)
                rows.append(row)
    machine = f"{platform.node()}: {platform.machine()}, {subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores"
    pg = subprocess.run([PG_BIN / "postgres", "--version"], capture_output=True, text=True).stdout.strip()
    text = ["# Patroni failover drills", "",
            f"`make faults` ({'short' if args.short else 'full'}: {args.runs} runs a variant), {time.strftime('%Y-%m-%d')}.", "",
            f"- machine: {machine}", f"- {pg}; " + ", ".join(patroni_version(v) for v in args.versions.split(",")),
            "", "Counted against the new leader's outbox rows of the layer. invented: events received whose event_id the new",
            "leader does not hold; double: (feature, version) received with two different contents; lost: new-leader rows",
            "never received.", "", HEADER, *[r.line() for r in rows], "", "Notes, by row:", "",
            *[f"- {r.version} {r.gate} {r.run}: {r.note}" for r in rows], ""]
    if skipped:
        text += ["Skipped:", "", *[f"- {s}" for s in skipped], ""]
    Path(args.out).write_text("\n".join(text))
    print(f"wrote {args.out}")
    bad = [r for r in rows if not all(r.checks.values())]
    for r in bad:
        print(f"FAILED: {r.version} {r.gate} {r.run}: {[k for k, v in r.checks.items() if not v]}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
