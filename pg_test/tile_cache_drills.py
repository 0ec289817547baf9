"""Fault drill 18 (issue 40): the tile cache stopped (SIGSTOP: it keeps its tiles, answers nothing)
for 30 s while county edits go on, and the relay worker killed with kill -9 meanwhile. At the end,
with the events and the tile queue drained, every warmed tile fetched through Varnish must equal
Martin's own render (pg_test/tile_cache_run.py). Registered in faults.DRILLS."""

from __future__ import annotations

import subprocess
import threading
import time

from drills import Row
from relay_harness import NatsServer, wait_for
from conftest import RUN_DIR
from tile_cache_run import DB, OUTPUT, run, stack_for


def relay_pid(c) -> int | None:
    with c.connect(DB) as conn:
        row = conn.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'feature_outbox relay' AND datname = %s",
                           (DB,)).fetchone()
    return row[0] if row else None


def tile_cache_faults(short: bool, nats_version: str = "debian") -> Row:
    seconds, edits, sample = (5, 100, 200) if short else (30, 1000, 2000)
    server = NatsServer(RUN_DIR / "drills" / "tile_cache_nats")
    server.start()
    try:
        with stack_for("drills/tile_cache", server.url, "feature_outbox.publish_timeout = '2s'") as stack:
            seen = {}

            def fault():
                stack.varnish.pause()
                try:
                    time.sleep(1)
                    pid = relay_pid(stack.c)
                    if pid:
                        subprocess.run(["kill", "-9", str(pid)], check=False)
                    time.sleep(seconds - 1)
                    with stack.c.connect(DB) as conn:
                        seen["waiting"], seen["error"] = conn.execute(
                            f"SELECT waiting_edits, last_error FROM feature_outbox.expire_backlog WHERE output = '{OUTPUT}'").fetchone()
                finally:
                    stack.varnish.resume()
                seen["resumed"] = time.time()

            thread = threading.Thread(target=fault)
            r = run(stack, edits=edits, sample=sample, seed=31, rate=50, during=thread.start, timeout=300)
            thread.join()
            drain_s = max(0.0, time.time() - seen["resumed"])
            row = Row(f"18. tile cache stopped {seconds} s (SIGSTOP) and the relay worker killed (kill -9)",
                      edits, r.checked - len(r.stale), 0, len(r.stale), 0, drain_s,
                      note=f"{r.checked:,} warmed tiles compared with Martin's render, {r.expired:,} of them expired, "
                           f"{len(r.stale)} stale; {r.kept_hits:,} of {r.kept:,} unexpired tiles still cache hits; "
                           f"{r.purge_requests} purge requests; during the outage {seen.get('waiting')} edits waited "
                           f"({(seen.get('error') or '')[:80]}); {r.parked} parked")
            row.checks = {"zero stale tiles": not r.stale, "at least 99 % of unexpired tiles still cached": r.kept_hits >= 0.99 * r.kept,
                          "edits waited during the outage": (seen.get("waiting") or 0) > 0, "nothing parked": r.parked == 0}
            return row
    finally:
        server.stop()
