"""make demo, step 9: tiles that never go stale. Martin serves the demo's counties (a view of the live
ones) behind Varnish running the VCL of docs/src/tile-caches.md; an expire output purges exactly the
tiles each committed edit changed. The cache is warmed over Kansas, a few Kansas counties are edited
through edit_feature (one-vertex moves, a move, renames, a retirement), and once the relay has
drained, every warmed tile is fetched through Varnish and from Martin directly. The report shows,
for a sample of tiles, what the cache would have served without the purge against what it serves
now; the purged tiles by zoom; and writes a picture of the purged tiles at zoom 10 over the county
outlines.

    python demo/tiles_demo.py <dsn> <run directory>

Exits 1 when a tile through Varnish differs from Martin's render, when no warmed tile changed, or
when fewer than 99 % of the unexpired tiles are still served from the cache.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pg_test"))
from tile_cache_harness import SECRET, Martin, Varnish, decoded, fetch, lon_lat_to_tile  # noqa: E402

SOURCE = "live_counties"
OUTPUT = "demo-cache"
# Kansas's extent (lon/lat): the demo's earlier steps move some counties far, so the state's
# counties' own extent can span the country.
KANSAS = (-102.06, 36.99, -94.58, 40.01)
PICTURE_ZOOM = 10


def lon_lat(x: float, y: float) -> tuple[float, float]:
    """EPSG:3857 metres to degrees."""
    r = 6378137.0
    return math.degrees(x / r), math.degrees(2 * math.atan(math.exp(y / r)) - math.pi / 2)


def tile_bounds(z: int, x: int, y: int) -> tuple[float, float, float, float]:
    n = 2 ** z
    lat = lambda t: math.degrees(math.atan(math.sinh(math.pi * (1 - 2 * t / n))))
    return x / n * 360 - 180, lat(y + 1), (x + 1) / n * 360 - 180, lat(y)


def get_all(base: str, tiles: list) -> dict:
    with ThreadPoolExecutor(8) as pool:
        return dict(zip(tiles, pool.map(lambda t: fetch(base, SOURCE, *t), tiles)))


def changes(before: bytes, after: bytes) -> str:
    """What differs between two renders of a tile, by county name."""
    def features(tile):
        import mapbox_vector_tile
        if not tile:
            return {}
        layer = mapbox_vector_tile.decode(tile).get(SOURCE, {"features": []})
        return {f["id"]: f for f in layer["features"]}
    a, b = features(before), features(after)
    out = []
    for fid in sorted(set(a) | set(b)):
        if fid not in b:
            out.append(f"{a[fid]['properties'].get('name')} gone")
        elif fid not in a:
            out.append(f"{b[fid]['properties'].get('name')} new")
        elif a[fid]["properties"] != b[fid]["properties"]:
            out.append(f"{a[fid]['properties'].get('name')} -> {b[fid]['properties'].get('name')}")
        elif a[fid]["geometry"] != b[fid]["geometry"]:
            out.append(f"{b[fid]['properties'].get('name')} reshaped")
    return ", ".join(out) or "encoding only"


def main() -> int:
    dsn, run = sys.argv[1], Path(sys.argv[2])
    rng = random.Random(40)
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute(f"CREATE OR REPLACE VIEW public.{SOURCE} AS SELECT fips, geom, name, state_fips FROM public.counties WHERE retired_at IS NULL")
    bbox = KANSAS
    inside = "ST_Within(ST_Transform(geom, 4326), ST_MakeEnvelope(%s, %s, %s, %s, 4326))"
    if not conn.execute(f"SELECT EXISTS (SELECT FROM public.counties WHERE retired_at IS NULL AND {inside})", bbox).fetchone()[0]:
        print("tiles: no county inside Kansas in this run (DEMO_LIMIT); step 9 skipped")
        return 0
    t0 = time.monotonic()
    martin = Martin(run / "martin", dsn_url(dsn), SOURCE, {"name": "text", "state_fips": "text"}, srid=3857, id_column="fips")
    martin.start()
    varnish = Varnish(run / "varnish", martin.port)
    varnish.start()
    cached, direct = f"http://127.0.0.1:{varnish.port}", f"http://127.0.0.1:{martin.port}"
    try:
        # The purges' secret, as the VCL checks it (Authorization: Bearer), from a file SQL never shows.
        secret = run / "cache-secret"
        secret.write_text(SECRET + "\n")
        conn.execute(f"ALTER SYSTEM SET feature_outbox.cache_secret_file = '{secret}'")
        conn.execute("SELECT pg_reload_conf()")
        conn.execute("""SELECT feature_outbox.define_expire_output(%s, 14, cache_url => %s, "table" => 'public.demo_expired_tiles')""",
                     (OUTPUT, varnish.url(SOURCE)))
        conn.execute(f"SELECT feature_outbox.expire_layer('counties', '{OUTPUT}')")
        print(f"Martin on :{martin.port} (tile cache off), Varnish on :{varnish.port} (docs/src/tile-caches.md's VCL), "
              f"expire output {OUTPUT} at zooms 0-14 purging Varnish by xkey; {time.monotonic() - t0:.1f} s")

        # The edits, planned first so that the tiles around each moved vertex can be warmed too.
        # Shapes in the table's own SRID (EPSG:3857, metres), at full precision: a round trip through
        # degrees would move every vertex a little, and the edit would expire whole shapes.
        kansas = [r for r in conn.execute(f"""SELECT fips, name, ST_AsGeoJSON(geom, 15)::jsonb
                                                 FROM public.counties WHERE retired_at IS NULL AND {inside}
                                                ORDER BY fips""", bbox)]
        picked = rng.sample(kansas, min(len(kansas), 16))
        edits, vertices = [], []
        for i, (fid, name, g) in enumerate(picked):
            ring = g["coordinates"][0] if g["type"] == "Polygon" else g["coordinates"][0][0]
            if i < 10:
                k = rng.randrange(1, len(ring) - 1)
                vertices.append(lon_lat(*ring[k]))
                ring[k] = [ring[k][0] + rng.uniform(-800, 800), ring[k][1] + rng.uniform(-800, 800)]
                vertices.append(lon_lat(*ring[k]))
                edits.append(("one vertex moved", fid, name, g, None))
            elif i < 11:
                shift = lambda c: [shift(x) for x in c] if isinstance(c[0], list) else [c[0] + 4000, c[1] + 3000]
                edits.append(("moved", fid, name, {"type": g["type"], "coordinates": shift(g["coordinates"])}, None))
            elif i < 15:
                edits.append(("renamed", fid, name, None, f"{name} (renamed)"))
            else:
                edits.append(("retired", fid, name, None, None))
        warm = [(z, x, y) for z in range(5, 11)
                for x in range(lon_lat_to_tile(bbox[0], 0, z)[0], lon_lat_to_tile(bbox[2], 0, z)[0] + 1)
                for y in range(lon_lat_to_tile(0, bbox[3], z)[1], lon_lat_to_tile(0, bbox[1], z)[1] + 1)]
        for lon, lat in vertices:
            for z in (12, 14):
                x, y = lon_lat_to_tile(lon, lat, z)
                warm += [(z, x + dx, y + dy) for dx in (-1, 0, 1) for dy in (-1, 0, 1)]
        warm = sorted(set(warm))
        before = get_all(cached, warm)
        print(f"cache warmed: {len(warm)} tiles over Kansas (zooms 5-10, and 12 and 14 around each vertex to move)")

        t1 = time.monotonic()
        for kind, fid, name, g, new_name in edits:
            if kind == "retired":
                conn.execute("SELECT feature_outbox.edit_feature('counties', %s, NULL::text, 'retired')", (fid,))
            elif kind == "renamed":
                conn.execute("SELECT feature_outbox.edit_feature('counties', %s, NULL::text, 'updated', jsonb_build_object('name', %s::text))",
                             (fid, new_name))
            else:
                conn.execute("SELECT feature_outbox.edit_feature('counties', %s, ST_SetSRID(ST_GeomFromGeoJSON(%s), 3857), 'moved')",
                             (fid, json.dumps(g)))
        deadline = time.monotonic() + 60
        while conn.execute("""SELECT EXISTS (SELECT FROM feature_outbox.tile_queue WHERE output = %s)
                                  OR EXISTS (SELECT FROM feature_outbox.outbox WHERE published_at IS NULL)""", (OUTPUT,)).fetchone()[0]:
            if time.monotonic() > deadline:
                print("DEMO FAILED: the expire output did not drain in 60 s", file=sys.stderr)
                return 1
            time.sleep(0.05)
        print(f"{len(edits)} edits committed and their tiles purged in {time.monotonic() - t1:.2f} s: "
              + ", ".join(f"{sum(1 for e in edits if e[0] == k)} {k}" for k in ("one vertex moved", "moved", "renamed", "retired")))

        after = get_all(cached, warm)
        fresh = get_all(direct, warm)
        stale = [t for t in warm if decoded(after[t][0]) != decoded(fresh[t][0])]
        changed = [t for t in warm if decoded(before[t][0]) != decoded(fresh[t][0])]
        expired = set(conn.execute("SELECT zoom, x, y FROM public.demo_expired_tiles").fetchall())
        kept = [t for t in warm if t not in expired]
        hits = sum(1 for t in kept if after[t][1] == "HIT")
        by_zoom = conn.execute("SELECT tiles_by_zoom, purge_requests FROM feature_outbox.expire_backlog WHERE output = %s",
                               (OUTPUT,)).fetchone()
        print(f"\ntiles purged by zoom (expire_backlog.tiles_by_zoom), {by_zoom[1]} purge requests:")
        print("  " + "  ".join(f"z{z}:{n}" for z, n in enumerate(by_zoom[0][:15]) if n))
        print(f"\nwarmed tiles whose content changed: {len(changed)} of {len(warm)}; each of them, without the purge, "
              "the cache would still serve as before the edits. A sample, as Varnish served it before and serves it now:")
        for t in rng.sample(changed, min(6, len(changed))):
            print(f"  {t[0]}/{t[1]}/{t[2]:<6} before: {len(before[t][0]):>6} bytes   now: {len(after[t][0]):>6} bytes ({after[t][1]})   {changes(before[t][0], after[t][0])}")
        print(f"\nthrough Varnish now: {len(warm) - len(stale)} of {len(warm)} warmed tiles equal Martin's fresh render "
              f"(stale: {len(stale)}); {hits} of {len(kept)} tiles the edits did not expire are still cache hits")

        picture = draw(conn, run / f"tiles-z{PICTURE_ZOOM}.png", edits)
        print(f"picture of the purged tiles at zoom {PICTURE_ZOOM} over the county outlines: {picture}")
        problems = []
        if stale:
            problems.append(f"{len(stale)} tiles stale through Varnish, e.g. {stale[:3]}")
        if not changed:
            problems.append("no warmed tile changed")
        if hits < 0.99 * len(kept):
            problems.append(f"only {hits} of {len(kept)} unexpired tiles still cached")
        if problems:
            print("DEMO FAILED (tiles): " + "; ".join(problems), file=sys.stderr)
            return 1
        print("OK: every warmed tile through Varnish is Martin's fresh render")
        return 0
    finally:
        varnish.stop()
        martin.stop()


def dsn_url(dsn: str) -> str:
    parts = dict(p.split("=", 1) for p in dsn.split())
    return f"postgres://{parts.get('user', 'postgres')}@{parts.get('host', '127.0.0.1')}:{parts['port']}/{parts['dbname']}"


def draw(conn, path: Path, edits) -> Path:
    """The purged tiles at PICTURE_ZOOM (red) over Kansas's county outlines, the edited counties filled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    edited = {e[1] for e in edits}
    fig, ax = plt.subplots(figsize=(11, 6), dpi=110)
    for fid, g in conn.execute("""SELECT fips, ST_AsGeoJSON(ST_Transform(geom, 4326), 5)::jsonb FROM public.counties
                                   WHERE ST_Intersects(ST_Transform(geom, 4326), ST_MakeEnvelope(%s, %s, %s, %s, 4326))""", KANSAS):
        polys = [g["coordinates"]] if g["type"] == "Polygon" else g["coordinates"]
        for poly in polys:
            xs, ys = zip(*poly[0])
            ax.plot(xs, ys, color="0.35", linewidth=0.6)
            if fid in edited:
                ax.fill(xs, ys, color="#4c72b0", alpha=0.35)
    for z, x, y in conn.execute("SELECT zoom, x, y FROM public.demo_expired_tiles WHERE zoom = %s", (PICTURE_ZOOM,)):
        w, s, e, n = tile_bounds(z, x, y)
        ax.add_patch(Rectangle((w, s), e - w, n - s, facecolor="#dd3333", alpha=0.35, edgecolor="#aa0000", linewidth=0.4))
    ax.set_aspect(1 / math.cos(math.radians(38.5)))
    ax.set_title(f"Tiles purged from Varnish at zoom {PICTURE_ZOOM} (red) after {len(edits)} edits of Kansas counties (blue)")
    ax.set_xlabel("longitude")
    ax.set_ylabel("latitude")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
