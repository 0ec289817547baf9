"""Fault drills with an expire output on (issue 39): a relay worker killed mid-batch, and a postmaster
crash, while editors move points. Each committed edit's tiles, computed here from the positions the
editors wrote (slippy-map math, independent of src/tiles/), must be in both destinations afterwards:
osm2pgsql's expire table and the NATS tile lists. A tile no committed edit explains (a rolled-back
edit's, say) counts as invented. Registered in faults.DRILLS."""

from __future__ import annotations

import asyncio
import math
import time

import nats
import psycopg

from drills import DB, LAYER, PIPELINED, Editors, Ledger, Row, crash_and_restart, drain, kill_workers, nats_and_cluster, running
from relay_harness import wait_for

OUTPUT = "drill"
STREAM = "TILES_DRILL"   # the relay's stream for an output's lists (src/relay/expire.rs, tile_stream)
ZOOMS = (0, 8, 14)
MAXZOOM = 14
BUFFER = 0.1
SETUP = (f"SELECT feature_outbox.define_expire_output('{OUTPUT}', {MAXZOOM}, \"table\" => 'public.drill_tiles', "
         f"subject => 'tiles.drill')",
         f"SELECT feature_outbox.expire_layer('{LAYER}', '{OUTPUT}', buffer => {BUFFER})")


def point_tiles(lon: float, lat: float, zoom: int) -> set[tuple[int, int, int]]:
    """The tiles at `zoom` whose square grown by BUFFER of a tile on every side holds the point."""
    n = 2 ** zoom
    u = (lon + 180.0) / 360.0 * n
    v = (1.0 - math.asinh(math.tan(math.radians(lat))) / math.pi) / 2.0 * n
    span = lambda t: range(max(0, math.ceil(t - 1 - BUFFER)), min(n - 1, math.floor(t + BUFFER)) + 1)
    return {(zoom, x, y) for x in span(u) for y in span(v)}


def table_tiles(c) -> set[tuple[int, int, int]]:
    with c.connect(DB) as conn:
        return set(conn.execute("SELECT zoom, x, y FROM public.drill_tiles").fetchall())


def list_tiles(url: str) -> tuple[set[tuple[int, int, int]], int]:
    """Every tile of the output's lists in its stream, and how many messages repeat an earlier one's
    Nats-Msg-Id (JetStream's duplicate window should have dropped those)."""
    async def read():
        nc = await nats.connect(url, connect_timeout=5)
        js = nc.jetstream()
        info = await js.stream_info(STREAM)
        tiles, ids, repeats = set(), set(), 0
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            m = await js.get_msg(STREAM, seq)
            mid = (m.headers or {}).get("Nats-Msg-Id")
            repeats += mid in ids
            ids.add(mid)
            for line in m.data.decode().splitlines():
                z, x, y = (int(p) for p in line.split("/"))
                tiles.add((z, x, y))
        await nc.close()
        return tiles, repeats
    return asyncio.run(read())


def tiles_drained(c) -> bool:
    try:
        with c.connect(DB) as conn:
            return conn.execute("SELECT NOT EXISTS (SELECT 1 FROM feature_outbox.tile_queue)").fetchone()[0]
    except psycopg.Error:
        return False


def tally_tiles(name: str, ledger: Ledger, table: set, lists: set, repeats: int, drain_s: float, note: str) -> Row:
    """Per committed edit: its new position's tiles and, for a move whose old position is known, the
    old one's, at ZOOMS, in both destinations. Invented: a zoom-14 tile in either destination that no
    committed or cut-off edit's position explains."""
    lost, delivered = set(), 0
    for eid in ledger.committed:
        new, old = ledger.positions[eid]
        want = set().union(*(point_tiles(*p, z) for p in (new, old) if p for z in ZOOMS))
        if want <= table and want <= lists:
            delivered += 1
        elif eid not in ledger.uncertain:
            lost.add(eid)
    explained = set().union(*(point_tiles(*new, MAXZOOM) for eid, (new, _) in ledger.positions.items()))
    invented = {t for t in table | lists if t[0] == MAXZOOM} - explained
    return Row(name, len(ledger.committed), delivered, repeats, len(lost), len(invented), drain_s, len(ledger.uncertain),
               note, lost_ids=lost, invented_ids=invented)


def with_tiles(name: str, label: str, fault, short: bool, nats_version: str, *settings: str, workers: int = 1) -> Row:
    """Editors on a layer with an expire output (table and NATS lists), `fault(c, short)` mid-run (it
    returns what it did), then the editors go on, stop, and the outbox and the tile queue drain.
    With `workers` relay workers, which share the tile queue by outbox id (src/relay/expire.rs)."""
    with nats_and_cluster(name, nats_version, *settings, f"feature_outbox.relay_workers = {workers}") as (server, c):
        with c.connect(DB) as conn:
            for sql in SETUP:
                conn.execute(sql)
        editors = Editors(c, n=3, rate=100).start()
        note = fault(c, short)
        recovered = time.time()
        wait_for(lambda: running(c, workers), 30, "the relay workers to run")
        time.sleep(1 if short else 3)
        ledger = editors.stop()
        drain_s = drain(c, recovered)
        stopped = time.time()
        wait_for(lambda: tiles_drained(c), 120, "the tile queue to drain", interval=0.1)
        note += f"; tiles drained {time.time() - stopped:.1f} s after the editors stopped"
        lists, repeats = list_tiles(server.url)
        row = tally_tiles(f"{label} ({note.split(';')[0]})", ledger, table_tiles(c), lists, repeats, drain_s, note)
        with c.connect(DB) as conn:
            row.checks = {"the output delivered lists": conn.execute(
                "SELECT lists_sent > 0 FROM feature_outbox.expire_backlog WHERE output = %s", (OUTPUT,)).fetchone()[0]}
        return row


def kill_one_of_two(c, short: bool) -> str:
    times = 4 if short else 10
    kill_workers(c, times, 2)
    return f"one of 2 workers killed x{times}"


def crash_postmaster(c, short: bool) -> str:
    time.sleep(2 if short else 5)
    crash_and_restart(c)
    return "postmaster stopped -m immediate and started"


def tiles_worker_kill(short: bool, nats_version: str = "debian") -> Row:
    return with_tiles("tiles_kill", "12. tiles: relay worker killed mid-batch, expire output on", kill_one_of_two, short,
                      nats_version, PIPELINED, workers=2)


def tiles_postmaster_crash(short: bool, nats_version: str = "debian") -> Row:
    return with_tiles("tiles_crash", "13. tiles: postmaster crash, expire output on", crash_postmaster, short, nats_version,
                      PIPELINED, "feature_outbox.wake_at_commit = off")
