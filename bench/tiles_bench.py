"""Tile expiry's cost, side by side in one run (issue 39; make bench, section 10). Prints figures only.
  1. edit path: `moved` of county polygons on a user layer, without an expire output and with one
     (zooms 0-14, osm2pgsql's expire table), on the same cluster: callgrind instructions per edit in a
     single-user backend (repeatable) and pgbench TPS. With FEATURE_OUTBOX_AB_BIN (a tree of an
     earlier release, bench/ab_setup.sh), that release's layer edit too, and each figure's ratio to it.
  2. relay: one worker draining a backlog into nats-server, timed from the backlog's commit until the
     outbox and the tile queue are empty: point features created, and counties each moved by one
     vertex; without an output, with an output whose tile lists go to a NATS subject, and with one
     that writes osm2pgsql's expire table.
  3. cover rate: full county covers (zooms 0-14) through the relay into the expire table, tiles/s,
     beside the same covers computed alone (tiles_touched over every county in one backend) and the
     same tiles upserted by one statement (the table's floor).
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
LAYER_EDIT = 6
VARIANTS = ("plain", "lists", "table")  # edit_bench.ROWS: layer: edit_feature('bench', id, geometry)
OUTPUT = "SELECT feature_outbox.define_expire_output('bench', 14, \"table\" => 'bench.expire_tiles')"
LISTS = "SELECT feature_outbox.define_expire_output('lists', 14, subject => 'tiles.bench')"


def spread(values, fmt="{:,.0f}"):
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))} - {fmt.format(max(values))})"


def attach(c: Cluster, build: str, attached: bool) -> None:
    """This build's layer `bench` attached to the output, or not (the earlier build has none)."""
    if build != "this build":
        return
    with c.connect(edit_bench.DB) as conn:
        rules = conn.execute("SELECT count(*) FROM feature_outbox.expire_rules WHERE layer = 'bench'").fetchone()[0]
        if attached and not rules:
            conn.execute("SELECT feature_outbox.expire_layer('bench', 'bench')")
        elif rules and not attached:
            conn.execute("SELECT feature_outbox.unexpire_layer('bench', 'bench')")


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
                attach(c, b, attached)
                tps[case].append(edit_bench.pgbench(c, pick))
        for case, b, attached in cases:
            c, _ = clusters[b]
            attach(c, b, attached)
            c.stop()
            ins[case] = ab_bench.instructions_per_edit(c, n, 0, edit_bench.ROWS[LAYER_EDIT][1])
            ab_bench.resume(c)
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
    """Layers of points and of counties, each three times: `<name>_plain` without an output,
    `<name>_lists` attached to an output with a NATS subject, `<name>_table` to one with osm2pgsql's
    expire table; attached from the start, so every feature's shape is kept before it is edited."""
    c = Cluster(RUN_DIR / f"tiles-relay-{name}", free_port())
    c.start("feature_outbox.database = 'tiles'", "feature_outbox.relay_workers = 1", "feature_outbox.endpoint = ''",
            "feature_outbox.invalid_geometry = 'accept'", "feature_outbox.retention = 0", "shared_buffers = '512MB'",
            "max_wal_size = '4GB'", "synchronous_commit = off")
    c.create_db("tiles")
    with c.connect("tiles") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute("CREATE SCHEMA bench")
        conn.execute("CREATE TABLE bench.raw (doc jsonb)")
        with conn.cursor().copy("COPY bench.raw (doc) FROM STDIN") as copy:
            for line in county_data().read_text().splitlines():
                copy.write_row((line,))
        conn.execute(OUTPUT)
        conn.execute(LISTS)
        for layer, kind in (("points", "Point"), ("counties", "Geometry"), ("covers", "Geometry")):
            for name in (f"{layer}_plain", f"{layer}_lists", f"{layer}_table"):
                conn.execute(f"CREATE TABLE bench.{name} (id bigint PRIMARY KEY, geom geometry({kind}, 4326) NOT NULL, "
                             "version integer NOT NULL DEFAULT 0)")
                conn.execute("SELECT feature_outbox.register_layer(%s, %s)", (name, f"bench.{name}"))
            conn.execute(f"SELECT feature_outbox.expire_layer('{layer}_lists', 'lists')")
            conn.execute(f"SELECT feature_outbox.expire_layer('{layer}_table', 'bench')")
    return c


def relay_settings(c: Cluster, **settings) -> None:
    with c.connect() as conn:
        for k, v in settings.items():
            conn.execute(f"ALTER SYSTEM SET feature_outbox.{k} = '{v}'")
        conn.execute("SELECT pg_reload_conf()")


def drained(conn) -> bool:
    return conn.execute("""SELECT NOT EXISTS (SELECT 1 FROM feature_outbox.outbox WHERE published_at IS NULL)
                              AND NOT EXISTS (SELECT 1 FROM feature_outbox.tile_queue)""").fetchone()[0]


def drain(c: Cluster, run: str, fill) -> tuple[float, int, int]:
    """Events/s of the worker from the commit of a backlog written in one transaction until the
    outbox and the tile queue are empty; the events, and the tiles in the expire table."""
    with c.connect("tiles") as conn:
        wait_for(lambda: drained(conn), 600, "the previous run to drain")
        conn.execute("TRUNCATE bench.expire_tiles")
        conn.execute("VACUUM ANALYZE")
        with conn.transaction():
            fill(conn)
            events = conn.execute("SELECT count(*) FROM feature_outbox.outbox WHERE published_at IS NULL").fetchone()[0]
            # The statistics autovacuum would give the relay within a minute: planned from those of the
            # empty outbox VACUUM left, its claim probes every waiting row for each (829 ev/s, not 29,795).
            conn.execute("ANALYZE feature_outbox.outbox, feature_outbox.tile_queue")
        t = time.monotonic()
        # Polled every 5 ms: a county backlog drains in about 0.2 s.
        wait_for(lambda: drained(conn), 600, "the outbox and the tile queue to drain", interval=0.005)
        took = time.monotonic() - t
        tiles = conn.execute("SELECT count(*) FROM bench.expire_tiles").fetchone()[0]
    return events / took, events, tiles


def points(layer: str):
    def fill(conn):
        base = conn.execute(f"SELECT coalesce(max(id), 0) FROM bench.{layer}").fetchone()[0]
        conn.execute(f"""SELECT feature_outbox.edit_feature('{layer}', %s + g, ST_SetSRID(ST_MakePoint(-120 + (g %% 1000) * 0.05,
                                30 + (g / 1000) * 0.05), 4326), 'created') FROM generate_series(1, %s) g""", (base, POINTS))
    return fill


def vertex_moves(layer: str, times: int = 4):
    """The second vertex of each single-ring county nudged by about 1 m, `times` over, recorded as the
    application would (its own UPDATE, then record_edit): about 12,000 events, so that a drain lasts
    long enough (0.5 s) for its rate to mean something."""
    def fill(conn):
        single = "GeometryType(geom) = 'POLYGON' AND ST_NumInteriorRings(geom) = 0"
        for _ in range(times):
            conn.execute(f"""UPDATE bench.{layer} SET geom = ST_MakePolygon(ST_SetPoint(ST_ExteriorRing(geom), 1,
                                    ST_Translate(ST_PointN(ST_ExteriorRing(geom), 2), 0.00001, 0.00001))) WHERE {single}""")
            conn.execute(f"SELECT feature_outbox.record_edit('{layer}', id, 'moved') FROM bench.{layer} WHERE {single}")
    return fill


def created_counties(layer: str):
    """Every county created: each expires its whole cover."""
    def fill(conn):
        conn.execute(f"DELETE FROM bench.{layer}")
        conn.execute(f"DELETE FROM feature_outbox.feature_state WHERE layer = '{layer}'")
        conn.execute(f"DELETE FROM feature_outbox.tile_shapes WHERE layer = '{layer}'")
        conn.execute(f"""SELECT feature_outbox.edit_feature('{layer}', (doc->>'id')::bigint,
                                CASE WHEN ST_NumGeometries(g) = 1 THEN ST_GeometryN(g, 1) ELSE g END, 'created')
                           FROM (SELECT doc, ST_SetSRID(ST_GeomFromGeoJSON(doc->'geometry'), 4326) g FROM bench.raw) r""")
    return fill


def relay_part() -> None:
    server = NatsServer(RUN_DIR / "tiles-nats")
    server.start()
    c = relay_cluster("a")
    rates, covers = {}, []
    try:
        relay_settings(c, endpoint=server.url)
        run = 0
        for layer in ("counties_plain", "counties_lists", "counties_table"):  # every county once, so that moves have shapes
            run += 1
            drain(c, str(run), created_counties(layer))
        for _ in range(ROUNDS):
            for name, fill in (("points, created", points), ("counties, one vertex moved", vertex_moves)):
                layer = "points" if name.startswith("points") else "counties"
                for variant in VARIANTS:
                    run += 1
                    rate, _, _ = drain(c, str(run), fill(f"{layer}_{variant}"))
                    rates.setdefault((name, variant), []).append(rate)
            run += 1
            covers.append(drain(c, str(run), created_counties("covers_table")))
        with c.connect("tiles") as conn:
            t = time.monotonic()
            alone = conn.execute("SELECT count(*) FROM bench.covers_table, feature_outbox.tiles_touched(geom, 14)").fetchone()[0]
            alone_s = time.monotonic() - t
            # The table's floor: the same distinct tiles upserted by one statement of osm2pgsql's rule
            # into an empty copy of the expire table, as a client would write them.
            conn.execute("""CREATE TEMP TABLE covered AS SELECT DISTINCT zoom, x, y
                              FROM bench.covers_table, feature_outbox.tiles_touched(geom, 14)""")
            conn.execute("CREATE TABLE bench.floor_tiles (LIKE bench.expire_tiles INCLUDING ALL)")
            t = time.monotonic()
            upserted = conn.execute("""INSERT INTO bench.floor_tiles AS t (zoom, x, y) SELECT * FROM covered ORDER BY 1, 2, 3
                                       ON CONFLICT (zoom, x, y) DO UPDATE SET last = CURRENT_TIMESTAMP(0)
                                        WHERE t.last IS DISTINCT FROM CURRENT_TIMESTAMP(0)""").rowcount
            upsert_s = time.monotonic() - t
    finally:
        c.stop()
        server.stop()
    print(f"\nRelay: one worker into nats-server, events/s from the commit of a backlog until the outbox and the tile "
          f"queue are empty (median of {ROUNDS}, min - max); the output: zooms 0-14, its tile lists on a NATS subject, or "
          f"osm2pgsql's expire table.\n")
    print("| backlog | no output | output: NATS lists | / no output | output: expire table | / no output |")
    print("|---|---|---|---|---|---|")
    for name in ("points, created", "counties, one vertex moved"):
        a, l, t = (rates[(name, v)] for v in VARIANTS)
        m = statistics.median
        print(f"| {name} | {spread(a)} | {spread(l)} | {m(l) / m(a):.3f} | {spread(t)} | {m(t) / m(a):.3f} |")
    rate, events, tiles = sorted(covers)[len(covers) // 2]
    print(f"\nFull county covers (every county created, zooms 0-14): {events:,} events and {tiles:,} distinct tiles in "
          f"{events / rate:.1f} s through the relay ({tiles * rate / events:,.0f} tiles/s); the same covers computed alone by "
          f"tiles_touched() in one backend: {alone:,} tiles in {alone_s:.1f} s ({alone / alone_s:,.0f} tiles/s); the same "
          f"{upserted:,} distinct tiles upserted into an empty expire table by one INSERT ... ON CONFLICT: "
          f"{upsert_s:.1f} s ({upserted / upsert_s:,.0f} tiles/s), the table's floor.")


def main() -> None:
    if os.environ.get("BENCH_TILES_PARTS", "edit,relay").find("edit") >= 0:
        edit_part()
    if os.environ.get("BENCH_TILES_PARTS", "edit,relay").find("relay") >= 0:
        relay_part()


if __name__ == "__main__":
    main()
