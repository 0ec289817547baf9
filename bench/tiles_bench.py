"""Tile expiry's cost, side by side in one run (issue 39; make bench, section 10). Prints figures only.
  1. edit path: `moved` of county polygons on a user layer, without an expire output and with one
     (zooms 0-14, osm2pgsql's expire table), on the same cluster: callgrind instructions per edit in a
     single-user backend (repeatable) and pgbench TPS. With FEATURE_OUTBOX_AB_BIN (a tree of an
     earlier release, bench/ab_setup.sh), that release's layer edit too, and each figure's ratio to it.
  2. relay: one worker draining a backlog into nats-server, timed until the outbox is drained and
     every queued edit's tiles are in the expire table: point features created, and counties each
     moved by one vertex, without the output and with it.
  3. cover rate: full county covers (zooms 0-14) through the relay, tiles/s, beside the same covers
     computed alone (tiles_touched over every county in one backend).
"""

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "pg_test"))
import ab_bench  # noqa: E402
import edit_bench  # noqa: E402
from conftest import PG_BIN, RUN_DIR, Cluster, county_data, free_port  # noqa: E402
from relay_harness import NatsServer, wait_for  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
POINTS = int(os.environ.get("BENCH_TILE_POINTS", "20000"))
OTHER_BIN = os.environ.get("FEATURE_OUTBOX_AB_BIN")
OTHER = os.environ.get("FEATURE_OUTBOX_AB_LABEL", "earlier")
LAYER_EDIT = 6  # edit_bench.ROWS: layer: edit_feature('bench', id, geometry)
OUTPUT = "SELECT feature_outbox.define_expire_output('bench', 14, \"table\" => 'bench.expire_tiles')"


def spread(values, fmt="{:,.0f}"):
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))} - {fmt.format(max(values))})"


def edit_part() -> None:
    """Instructions and TPS of the layer edit, without and with an output."""
    builds = {"this build": PG_BIN, **({OTHER: Path(OTHER_BIN)} if OTHER_BIN else {})}
    clusters = {b: ab_bench.edit_cluster("tiles-" + b.replace(" ", "-").replace(".", ""), bin) for b, bin in builds.items()}
    this, n = clusters["this build"]
    with this.connect(edit_bench.DB) as conn:
        conn.execute(OUTPUT)
    pick = edit_bench.PICK.format(n=n, base=0) + edit_bench.ROWS[LAYER_EDIT][1] + "\n"
    cases = [("this build, no output", "this build", False), ("this build, output z0-14", "this build", True)]
    cases += [(f"{OTHER}", OTHER, False)] if OTHER_BIN else []
    tps = {c: [] for c, _, _ in cases}
    ins = {}
    try:
        for _ in range(ROUNDS):
            for case, b, attached in cases:
                c, _ = clusters[b]
                if b == "this build":
                    with c.connect(edit_bench.DB) as conn:
                        conn.execute("SELECT feature_outbox.expire_layer('bench', 'bench')" if attached else
                                     "SELECT feature_outbox.unexpire_layer('bench', 'bench') FROM feature_outbox.expire_rules "
                                     "WHERE layer = 'bench'")
                tps[case].append(edit_bench.pgbench(c, pick))
        for case, b, attached in cases:
            c, _ = clusters[b]
            if b == "this build":
                with c.connect(edit_bench.DB) as conn:
                    conn.execute("SELECT feature_outbox.expire_layer('bench', 'bench')" if attached else
                                 "SELECT feature_outbox.unexpire_layer('bench', 'bench') FROM feature_outbox.expire_rules "
                                 "WHERE layer = 'bench'")
            c.stop()
            ins[case] = ab_bench.instructions_per_edit(c, n, 0, edit_bench.ROWS[LAYER_EDIT][1])
            c.start()
    finally:
        for c, _ in clusters.values():
            c.stop()
    print(f"Edit path: `moved` of county polygons on a user layer, {edit_bench.CLIENTS} clients, pgbench TPS (median of {ROUNDS}, "
          f"min - max), and callgrind instructions per edit (single-user backend, 500 edits).\n")
    base = OTHER if OTHER_BIN else "this build, no output"
    print(f"| case | TPS | TPS / {base} | instructions per edit | {base} / this (instructions) |")
    print("|---|---|---|---|---|")
    for case, _, _ in cases:
        r = statistics.median(tps[case]) / statistics.median(tps[base])
        print(f"| {case} | {spread(tps[case])} | {r:.3f} | {ins[case]:,.0f} | {ins[base] / ins[case]:.3f} |")


def relay_cluster(name: str) -> Cluster:
    c = Cluster(RUN_DIR / f"tiles-relay-{name}", free_port())
    c.start("feature_outbox.database = 'tiles'", "feature_outbox.relay_workers = 1", "feature_outbox.endpoint = ''",
            "feature_outbox.invalid_geometry = 'accept'",
            "feature_outbox.retention = 0", "shared_buffers = '512MB'", "max_wal_size = '4GB'", "synchronous_commit = off")
    c.create_db("tiles")
    with c.connect("tiles") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute("CREATE SCHEMA bench")
        conn.execute("CREATE TABLE bench.raw (doc jsonb)")
        with conn.cursor().copy("COPY bench.raw (doc) FROM STDIN") as copy:
            for line in county_data().read_text().splitlines():
                copy.write_row((line,))
        conn.execute("""CREATE TABLE bench.counties (id bigint PRIMARY KEY, geom geometry(Geometry, 4326) NOT NULL,
                                                     version integer NOT NULL DEFAULT 0)""")
        conn.execute("CREATE TABLE bench.points (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, version integer NOT NULL DEFAULT 0)")
        conn.execute("SELECT feature_outbox.register_layer('counties', 'bench.counties')")
        conn.execute("SELECT feature_outbox.register_layer('points', 'bench.points')")
        conn.execute(OUTPUT)
    return c


def relay_settings(c: Cluster, **settings) -> None:
    with c.connect() as conn:
        for k, v in settings.items():
            conn.execute(f"ALTER SYSTEM SET feature_outbox.{k} = '{v}'")
        conn.execute("SELECT pg_reload_conf()")


def drained(conn) -> bool:
    return conn.execute("""SELECT NOT EXISTS (SELECT 1 FROM feature_outbox.outbox WHERE published_at IS NULL)
                              AND NOT EXISTS (SELECT 1 FROM feature_outbox.tile_queue)""").fetchone()[0]


def drain(c: Cluster, server: NatsServer, run: str, fill) -> tuple[float, int, int]:
    """Events/s of one worker from the commit of a backlog written in one transaction until the
    outbox and the tile queue are empty; the events and the tiles in the expire table."""
    relay_settings(c, endpoint=server.url, nats_stream=f"T{run}", nats_subject_prefix=f"t{run}")
    with c.connect("tiles") as conn:
        wait_for(lambda: drained(conn), 120, "the previous run to drain")
        conn.execute("TRUNCATE bench.expire_tiles")
        conn.execute("VACUUM ANALYZE")
        with conn.transaction():
            fill(conn)
            events = conn.execute("SELECT count(*) FROM feature_outbox.outbox WHERE published_at IS NULL").fetchone()[0]
        t = time.monotonic()
        wait_for(lambda: drained(conn), 600, "the outbox and the tile queue to drain")
        took = time.monotonic() - t
        tiles = conn.execute("SELECT count(*) FROM bench.expire_tiles").fetchone()[0]
    return events / took, events, tiles


def relay_part() -> None:
    server = NatsServer(RUN_DIR / "tiles-nats")
    server.start()
    c = relay_cluster("a")
    rates = {}
    covers = []
    try:
        with c.connect("tiles") as conn:
            # Single polygons as they are, so that a one-vertex edit keeps the shape's other parts.
            conn.execute("""SELECT feature_outbox.edit_feature('counties', (doc->>'id')::bigint,
                                   CASE WHEN ST_NumGeometries(g) = 1 THEN ST_GeometryN(g, 1) ELSE g END, 'created')
                              FROM (SELECT doc, ST_SetSRID(ST_GeomFromGeoJSON(doc->'geometry'), 4326) g FROM bench.raw) r""")
        def points(conn):
            base = conn.execute("SELECT coalesce(max(id), 0) FROM bench.points").fetchone()[0]
            conn.execute("""SELECT feature_outbox.edit_feature('points', %s + g, ST_SetSRID(ST_MakePoint(-120 + (g %% 1000) * 0.05,
                                   30 + (g / 1000) * 0.05), 4326), 'created') FROM generate_series(1, %s) g""", (base, POINTS))
        def vertex_moves(conn):
            # The second vertex of each single-ring county nudged by about 1 m, then recorded.
            conn.execute("""UPDATE bench.counties SET geom = ST_MakePolygon(ST_SetPoint(ST_ExteriorRing(geom), 1,
                                   ST_Translate(ST_PointN(ST_ExteriorRing(geom), 2), 0.00001, 0.00001)))
                             WHERE GeometryType(geom) = 'POLYGON' AND ST_NumInteriorRings(geom) = 0""")
            conn.execute("""SELECT feature_outbox.record_edit('counties', id, 'moved') FROM bench.counties
                             WHERE GeometryType(geom) = 'POLYGON' AND ST_NumInteriorRings(geom) = 0""")
        def full_covers(conn):
            conn.execute("UPDATE bench.counties SET geom = ST_Translate(geom, 0.01, 0)")
            conn.execute("SELECT feature_outbox.record_edit('counties', id, 'moved') FROM bench.counties")
        run = 0
        for _ in range(ROUNDS):
            for name, layer, fill in (("points, created", "points", points), ("counties, one vertex moved", "counties", vertex_moves)):
                for attached in (False, True):
                    with c.connect("tiles") as conn:
                        conn.execute("SELECT feature_outbox.unexpire_layer(layer, output) FROM feature_outbox.expire_rules")
                        if attached:
                            conn.execute("SELECT feature_outbox.expire_layer(%s, 'bench', diff => true)", (layer,))
                    run += 1
                    rate, events, tiles = drain(c, server, str(run), fill)
                    rates.setdefault((name, attached), []).append(rate)
        # Full covers: every county's whole shape at zooms 0-14 (diff off), tiles/s through the relay.
        for _ in range(ROUNDS):
            with c.connect("tiles") as conn:
                conn.execute("SELECT feature_outbox.unexpire_layer(layer, output) FROM feature_outbox.expire_rules")
                conn.execute("SELECT feature_outbox.expire_layer('counties', 'bench', diff => false)")
            run += 1
            rate, events, tiles = drain(c, server, str(run), full_covers)
            covers.append((rate, events, tiles))
        with c.connect("tiles") as conn:
            t = time.monotonic()
            alone = conn.execute("SELECT count(*) FROM bench.counties, feature_outbox.tiles_touched(geom, 14)").fetchone()[0]
            alone_s = time.monotonic() - t
    finally:
        c.stop()
        server.stop()
    print(f"\nRelay: one worker into nats-server, events/s until the outbox and the tile queue are empty "
          f"(median of {ROUNDS}, min - max); output: zooms 0-14, osm2pgsql's expire table.\n")
    print("| backlog | no output | one output | with / without |")
    print("|---|---|---|---|")
    for name in ("points, created", "counties, one vertex moved"):
        a, b = rates[(name, False)], rates[(name, True)]
        print(f"| {name} | {spread(a)} | {spread(b)} | {statistics.median(b) / statistics.median(a):.3f} |")
    rate, events, tiles = sorted(covers)[len(covers) // 2]
    print(f"\nFull county covers (each county moved, diff off: old and new shape, zooms 0-14): {events:,} events in "
          f"{events / rate:.1f} s through the relay, {tiles:,} distinct tiles in the table; the same {alone:,} tiles of "
          f"the counties' shapes computed alone by tiles_touched() in {alone_s:.1f} s ({alone / alone_s:,.0f} tiles/s).")


def main() -> None:
    if os.environ.get("BENCH_TILES_PARTS", "edit,relay").find("edit") >= 0:
        edit_part()
    if os.environ.get("BENCH_TILES_PARTS", "edit,relay").find("relay") >= 0:
        relay_part()


if __name__ == "__main__":
    main()
