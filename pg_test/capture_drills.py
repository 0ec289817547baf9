"""Capture fault drills (issue 49): one plain UPDATE of every row of a captured layer, which the
capture worker decodes and turns into events in chunks, and in the middle of it (21) the worker
SIGKILLed, again and again, then stopped by the test builds' fault point right after the events of
the whole UPDATE committed and before the slot advanced (the re-read must write nothing), or (22)
the postmaster and every process it started SIGKILLed at once, then started. Durable commits
(fsync and synchronous_commit on). Afterwards each changed row must have exactly one captured
`moved` event, for its final state (version 2, the key of its committed geometry), in the outbox
and in the stream:

    committed   rows the UPDATE changed
    delivered   of those, rows whose moved event the stream holds
    duplicates  deliveries beyond the first of an event_id
    lost        changed rows with no moved event in the outbox or none in the stream
    invented    events beyond one per row (a change written twice under two event_ids), or one that
                does not describe the row's final state

Registered in faults.DRILLS: `make faults` runs them full, make test short (pg_test/test_faults.py)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

from capture_harness import capture_pids
from drills import DB, LAYER, Nats, Row, drain, kill_tree, nats_binary, pg_ctl, read_stream, start_cluster
from conftest import RUN_DIR
from relay_harness import wait_for

FENCE = 0  # a row outside the drill's ids, written after the fault to know the worker is past it


def moved_done(c) -> int:
    with c.connect(DB) as conn:
        return conn.execute(f"SELECT count(*) FROM feature_outbox.outbox WHERE layer = '{LAYER}' AND event_type = 'moved'"
                            " AND feature_id <> %s", (FENCE,)).fetchone()[0]


def capture_drill(name: str, label: str, fault, short: bool, nats_version: str) -> Row:
    n = 5_000 if short else 100_000
    server = Nats(RUN_DIR / "drills" / f"nats_{name}", nats_binary(nats_version))
    server.start()
    c = start_cluster(name, "wal_level = logical", endpoint=server.url)
    try:
        with c.connect(DB) as conn:
            conn.execute(f"CALL feature_outbox.capture_layer('{LAYER}')")
            t = time.time()
            conn.execute("""INSERT INTO public.drill (id, geom)
                            SELECT i, ST_SetSRID(ST_MakePoint((i %% 300) * 0.5 - 150, (i %% 120) - 60), 4326)
                              FROM generate_series(0, %s) i""", (n,))
            wait_for(lambda: conn.execute(f"SELECT count(*) FROM feature_outbox.outbox WHERE layer = '{LAYER}'").fetchone()[0]
                     == n + 1, 300, f"the {n + 1:,} created events")
            seed_s = time.time() - t
            drain(c, time.time(), 300)
            # One statement, one transaction: every drill row moves 0.01 degrees east.
            t = time.time()
            conn.execute("UPDATE public.drill SET geom = ST_SetSRID(ST_MakePoint(ST_X(geom) + 0.01, ST_Y(geom)), 4326) WHERE id <> %s",
                         (FENCE,))
        note = fault(c, n, short)
        recovered = time.time()
        wait_for(lambda: capture_pids(c, DB), 60, "the capture worker to run again")
        wait_for(lambda: moved_done(c) >= n, 600, f"the {n:,} moved events", interval=0.2)
        with c.connect(DB) as conn:
            conn.execute("UPDATE public.drill SET geom = ST_SetSRID(ST_MakePoint(1, 1), 4326) WHERE id = %s", (FENCE,))
            fenced = lambda: conn.execute(  # noqa: E731
                "SELECT count(*) FROM feature_outbox.outbox WHERE layer = %s AND feature_id = %s AND event_type = 'moved'",
                (LAYER, FENCE)).fetchone()[0]
            wait_for(lambda: fenced() >= 1, 120, "the fence's event")
        capture_s = time.time() - t
        drain_s = drain(c, recovered, 300)
        row = tally_capture(f"{label} ({note.split(';')[0]})", c, n, read_stream([server.url]), drain_s,
                            f"{note}; {n:,} rows seeded in {seed_s:.1f} s, the UPDATE captured in {capture_s:.1f} s")
        if "fault point" in note:
            row.checks["the fault point stopped the worker before the slot advanced"] = FAULT_LOG in c.log()
        return row
    finally:
        try:
            c.stop()
        finally:
            server.stop()


def tally_capture(label: str, c, n: int, deliveries: list[tuple[str, dict]], drain_s: float, note: str) -> Row:
    with c.connect(DB) as conn:
        final = {fid: (version, key) for fid, version, key in conn.execute(
            "SELECT id, version, feature_outbox.routing_key(geom) FROM public.drill WHERE id <> %s", (FENCE,))}
        events = conn.execute("""SELECT event_id::text, feature_id, feature_version, routing_key, origin
                                   FROM feature_outbox.outbox WHERE layer = %s AND event_type = 'moved' AND feature_id <> %s""",
                              (LAYER, FENCE)).fetchall()
        versions = Counter(conn.execute("SELECT version FROM public.drill WHERE id <> %s", (FENCE,)).fetchall())
    per_row = Counter(fid for _, fid, _, _, _ in events)
    wrong = {eid for eid, fid, version, key, origin in events
             if fid not in final or (version, key) != final[fid] or origin != "captured"}
    stream = [(mid, e) for mid, e in deliveries if e["layer"] == LAYER and e["action"] == "moved" and e["feature_id"] != str(FENCE)]
    counts = Counter(mid for mid, _ in stream)
    in_stream = {int(e["feature_id"]) for _, e in stream}
    lost = {fid for fid in final if per_row[fid] == 0 or fid not in in_stream}
    invented = sum(k - 1 for k in per_row.values() if k > 1) + len(wrong) + len(set(counts) - {eid for eid, *_ in events})
    row = Row(label, len(final), len(in_stream & set(final)), sum(counts.values()) - len(counts), len(lost), invented,
              drain_s, note=note, lost_ids=lost, invented_ids=wrong)
    row.checks = {
        "the fault landed mid-capture": "; mid-capture" in note,
        f"all {n:,} rows at version 2": versions == Counter({(2,): n}),
        "every event captured (origin)": not any(o != "captured" for *_, o in events),
    }
    return row


FAULT_POINT = """CREATE OR REPLACE FUNCTION public._test_crash_after_next_capture() RETURNS void
                 LANGUAGE c VOLATILE AS 'feature_outbox', '_test_crash_after_next_capture_wrapper'"""
FAULT_LOG = "fault injection: exiting after writing events, before advancing the slot"


def kill_worker_mid_capture(c, n: int, short: bool) -> str:
    """SIGKILL of the capture worker `times` over, each while the moved events are part written and
    once the worker runs again: the first at once (the chunk is being read), each next one after
    another chunk committed. Then the fault point: the worker exits after the transaction that
    completes the UPDATE's events commits, before it advances the slot."""
    times = 2 if short else 5
    seen = []
    for i in range(times):
        wait_for(lambda: capture_pids(c, DB), 60, "the capture worker to run")
        done = moved_done(c)
        if i:
            wait_for(lambda: moved_done(c) > done, 120, "the next chunk", interval=0.02)
            done = moved_done(c)
        if done >= n:
            break
        for pid in capture_pids(c, DB):
            os.kill(pid, signal.SIGKILL)
        seen.append(done)
        time.sleep(0.3)
    wait_for(lambda: capture_pids(c, DB), 60, "the capture worker to run")  # and so the server, out of recovery
    with c.connect(DB) as conn:
        conn.execute(FAULT_POINT)
        armed_at = moved_done(c)
        conn.execute("SELECT public._test_crash_after_next_capture()")
    mid = any(0 < d < n for d in seen) and armed_at < n
    return (f"capture worker killed x{len(seen)} (kill -9) at {', '.join(f'{d:,}' for d in seen)} of {n:,} events, "
            f"then the fault point armed at {armed_at:,}" + ("; mid-capture" if mid else "; no kill landed mid-capture"))


def crash_mid_capture(c, n: int, short: bool) -> str:
    """SIGKILL of the postmaster tree once part of the moved events are written, then a start."""
    wait_for(lambda: moved_done(c) > 0, 120, "the first chunk of moved events", interval=0.02)
    done = moved_done(c)
    kill_tree(c)
    pg_ctl(c, "-l", c.dir / "server.log", "-w", "start")
    return (f"postmaster tree killed (kill -9) at {done:,} of {n:,} events, then started"
            + ("; mid-capture" if done < n else "; no crash landed mid-capture"))


def capture_worker_kill(short: bool, nats_version: str = "debian") -> Row:
    return capture_drill("capture_kill", "21. capture: bulk UPDATE, capture worker killed mid-chunk, then stopped before "
                         "the slot advanced", kill_worker_mid_capture, short, nats_version)


def capture_postmaster_crash(short: bool, nats_version: str = "debian") -> Row:
    return capture_drill("capture_crash", "22. capture: bulk UPDATE, postmaster crash mid-chunk", crash_mid_capture,
                         short, nats_version)
