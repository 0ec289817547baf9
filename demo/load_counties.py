#!/usr/bin/env python3
"""The demo's writer: a real client of feature_outbox.

1. Creates the application's own table, public.counties (Web Mercator, EPSG:3857, with the county
   name and state as attribute columns), and registers it as the layer `counties`.
2. Creates one feature per US county (feature id = FIPS code) through edit_feature('counties', ...),
   passing the GeoJSON geometry text exactly as the file has it and the name and state as properties,
   in transactions of BATCH edits. The routing key comes from the input in EPSG:4326; the row stores
   the shape in EPSG:3857, whose area of use covers every county (CONUS Albers,
   EPSG:5070, would refuse Alaska's and Hawaii's, as a later edit in it would).
3. Reports the shapes that fail ST_IsValid and what feature_outbox.invalid_geometry did with them.
4. Edits: moves some counties (ST_Translate or ST_SimplifyPreserveTopology through the geometry
   overload), edits a few twice in one transaction (the guide's gotcha 1: the relay publishes the
   current row, so the first event carries the second shape), renames some (updated events, properties
   only), renames a few more the way an ORM would (its own UPDATE, then record_edit), and retires a few.
   Counts scale with the number of counties loaded.

Connects with libpq's environment (PGHOST, PGPORT, PGUSER, PGDATABASE) unless --dsn is given.
Environment: DEMO_DATA (GeoJSONL, default the checkout's .cache/data/us-counties.geojsonl, which
scripts/county_data.sh fills),
DEMO_LIMIT (at most this many counties). --summary FILE writes the figures as JSON for run.sh.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
BATCH = 300          # edits per transaction
TRANSLATE = (0.02, 0.01)  # degrees east, north: ~2 km, enough to leave a resolution-8 H3 cell
SIMPLIFY = 0.01      # ST_SimplifyPreserveTopology tolerance, degrees

# The application's table: it owns it and its columns; feature_outbox writes events for its rows.
TABLE = """
    CREATE TABLE public.counties (
        fips       integer PRIMARY KEY,
        geom       geometry(Geometry, 3857) NOT NULL,  -- Web Mercator, metres
        version    integer NOT NULL DEFAULT 0,
        name       text NOT NULL,
        state_fips char(2) NOT NULL,
        retired_at timestamptz)"""
REGISTER = """SELECT feature_outbox.register_layer('counties', 'public.counties', id_column => 'fips',
                     properties => '{name,state_fips}', retired_column => 'retired_at')"""
CREATE = "SELECT feature_outbox.edit_feature('counties', %s, %s, 'created', %s)"
# Server-side geometry edits through the geometry overload, in EPSG:4326. Westward near the
# antimeridian, so a shape never leaves [-180, 180] (edit_feature would reject it).
TRANSLATE_SQL = """
    SELECT feature_outbox.edit_feature('counties', c.fips,
             ST_Translate(g, CASE WHEN ST_XMax(g) > 179 THEN -%(dx)s ELSE %(dx)s END, %(dy)s), 'moved')
      FROM public.counties c, ST_Transform(c.geom, 4326) g WHERE c.fips = %(id)s"""
SIMPLIFY_SQL = """
    SELECT feature_outbox.edit_feature('counties', c.fips, ST_SimplifyPreserveTopology(ST_Transform(c.geom, 4326), %(tol)s), 'moved')
      FROM public.counties c WHERE c.fips = %(id)s"""
RENAME = """SELECT feature_outbox.edit_feature('counties', %s, NULL::text, 'updated',
                                               jsonb_build_object('name', %s::text))"""
RETIRE = "SELECT feature_outbox.edit_feature('counties', %s, NULL::text, 'retired')"


def say(*parts) -> None:
    print(*parts, flush=True)


def read_counties(path: Path, limit: int | None) -> list[tuple[int, str, str]]:
    """(FIPS as int, county name, geometry JSON text as in the file) per line, at most `limit`."""
    counties = []
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            if limit is not None and len(counties) >= limit:
                break
            record = json.loads(line)
            # Keep the geometry's own text: no float re-printing between the file and PostGIS.
            start = line.index('"geometry":') + len('"geometry":')
            start += len(line[start:]) - len(line[start:].lstrip())  # raw_decode wants no blanks
            _, end = decoder.raw_decode(line, start)
            counties.append((int(record["id"]), record.get("name", ""), line[start:end].strip()))
    return counties


def run_batches(conn, sql: str, params: list, label: str, total: int, done: int = 0) -> tuple[int, list]:
    """executemany in transactions of BATCH. A batch that fails with a data error (class 22, e.g.
    invalid_geometry = reject) is redone one savepoint per edit, so only the bad edits are lost.
    Returns (edits made, [(params, error)] of rejected edits)."""
    made, rejected = 0, []
    started = time.monotonic()
    for i in range(0, len(params), BATCH):
        chunk = params[i:i + BATCH]
        try:
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(sql, chunk)
            made += len(chunk)
        except psycopg.DataError:
            with conn.transaction(), conn.cursor() as cur:
                for p in chunk:
                    try:
                        with conn.transaction():  # a savepoint
                            cur.execute(sql, p)
                        made += 1
                    except psycopg.DataError as e:
                        rejected.append((p, str(e).splitlines()[0]))
        n = done + i + len(chunk)
        rate = (i + len(chunk)) / max(time.monotonic() - started, 1e-6)
        say(f"  {label} {n:>5}/{total} ({rate:,.0f}/s)")
    return made, rejected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default="", help="libpq connection string (default: PG* environment)")
    parser.add_argument("--summary", type=Path, help="write the figures as JSON to this file")
    args = parser.parse_args()

    data = Path(os.environ.get("DEMO_DATA") or subprocess.run(
        ["bash", ROOT / "scripts" / "county_data.sh"], check=True, stdout=subprocess.PIPE, text=True).stdout.strip())
    limit = int(os.environ["DEMO_LIMIT"]) if os.environ.get("DEMO_LIMIT") else None
    counties = read_counties(data, limit)
    if len(counties) < 3:
        say(f"load: need at least 3 counties, {data} gave {len(counties)}")
        return 1
    names = {fips: name for fips, name, _ in counties}
    s: dict = {"counties_read": len(counties), "data": str(data)}

    with psycopg.connect(args.dsn, autocommit=True) as conn:
        policy = conn.execute("SHOW feature_outbox.invalid_geometry").fetchone()[0]
        s["invalid_policy"] = policy

        conn.execute(TABLE)
        conn.execute(REGISTER)
        say("layer: public.counties (geometry(Geometry, 3857), name, state_fips) registered as layer 'counties'")

        # 1. Create every county: one edit_feature call per county, BATCH per transaction.
        say(f"load: {len(counties)} counties from {data} (invalid_geometry = {policy})")
        t0 = time.monotonic()
        creates = [(f, g, json.dumps({"name": names[f], "state_fips": f"{f:05d}"[:2]})) for f, _, g in counties]
        s["created"], rejected = run_batches(conn, CREATE, creates, "created", len(counties))
        s["load_seconds"] = round(time.monotonic() - t0, 2)
        s["rejected"] = len(rejected)
        say(f"load: {s['created']} created in {s['load_seconds']} s"
            f" ({s['created'] / max(s['load_seconds'], 1e-6):,.0f} edits/s)")

        # 2. Invalid shapes: judged on the input text by PostGIS itself, and on what was stored.
        invalid = conn.execute("""
            SELECT u.id, (ST_IsValidDetail(ST_GeomFromGeoJSON(u.g))).reason
              FROM unnest(%s::bigint[], %s::text[]) AS u(id, g)
             WHERE NOT (ST_IsValidDetail(ST_GeomFromGeoJSON(u.g))).valid ORDER BY u.id""",
            ([f for f, _, _ in counties], [g for _, _, g in counties])).fetchall()
        s["invalid_input"] = len(invalid)
        s["invalid_stored"] = conn.execute(
            "SELECT count(*) FROM public.counties WHERE NOT (ST_IsValidDetail(geom)).valid").fetchone()[0]
        say(f"invalid: {len(invalid)} of {len(counties)} shapes fail ST_IsValid, e.g.")
        for fips, reason in invalid[:3]:
            say(f"  {fips:05d} {names[fips]}: {reason}")
        effect = {
            "accept": f"stored as given ({s['invalid_stored']} invalid shapes stored), "
                      "each routed from a made-valid copy (ST_MakeValid)",
            "repair": f"stored after ST_MakeValid ({s['invalid_stored']} invalid shapes stored)",
            "reject": f"refused: {len(rejected)} edits rejected, not created",
        }[policy]
        say(f"invalid: policy {policy}: {effect}")
        for (fips, _), error in rejected[:3]:
            say(f"  rejected {fips:05d}: {error}")

        # 3. Edits on the counties that exist, in disjoint random sets (seeded: the same each run).
        ids = [i for (i,) in conn.execute(
            "SELECT fips FROM public.counties WHERE fips = ANY(%s) ORDER BY fips",
            ([f for f, _, _ in counties],)).fetchall()]
        rng = random.Random(4471)
        rng.shuffle(ids)
        n = len(ids)
        n_move, n_twice, n_retire, n_rename, n_orm = (max(1, n // 10), max(1, n // 200), max(1, n // 100),
                                                      max(1, n // 20), max(1, n // 100))
        move, twice = ids[:n_move], ids[n_move:n_move + n_twice]
        retire = ids[n_move + n_twice:n_move + n_twice + n_retire]
        rest = ids[n_move + n_twice + n_retire:]
        rename, orm = rest[:n_rename], rest[n_rename:n_rename + n_orm]
        dx, dy = TRANSLATE
        half = len(move) // 2

        t0 = time.monotonic()
        say(f"edit: moving {len(move)} counties (half translated by {dx}°E {dy}°N, half simplified)")
        moved, _ = run_batches(conn, TRANSLATE_SQL, [{"id": i, "dx": dx, "dy": dy} for i in move[:half]],
                               "moved", len(move))
        m, _ = run_batches(conn, SIMPLIFY_SQL, [{"id": i, "tol": SIMPLIFY} for i in move[half:]],
                           "moved", len(move), half)
        moved += m

        # Two edits of one feature in one transaction: both outbox rows become visible together, so
        # the relay publishes the first (event_version v) with the second's geometry (v + 1).
        say(f"edit: moving {len(twice)} counties twice in one transaction (a later geometry for the first event)")
        with conn.transaction(), conn.cursor() as cur:
            for i in twice:
                cur.execute(TRANSLATE_SQL, {"id": i, "dx": dx, "dy": dy})
                cur.execute(TRANSLATE_SQL, {"id": i, "dx": -dx, "dy": -dy})
        moved += 2 * len(twice)

        say(f"edit: renaming {len(rename)} counties (updated events: properties only, the geometry and cell stay)")
        updated, _ = run_batches(conn, RENAME, [(i, f"{names[i]} (renamed)") for i in rename], "updated", len(rename))

        # An ORM writes the row itself; record_edit, in the same transaction, records the event.
        say(f"edit: {len(orm)} more renamed by the application's own UPDATE, each followed by record_edit")
        with conn.transaction(), conn.cursor() as cur:
            for i in orm:
                cur.execute("UPDATE public.counties SET name = upper(name) WHERE fips = %s", (i,))
                cur.execute("SELECT feature_outbox.record_edit('counties', %s, 'updated')", (i,))
        updated += len(orm)

        say(f"edit: retiring {len(retire)} counties (geometry NULL keeps the last one; retired_at is set)")
        retired, _ = run_batches(conn, RETIRE, [(i,) for i in retire], "retired", len(retire))
        s["edit_seconds"] = round(time.monotonic() - t0, 2)

        s.update(moved=moved, moved_twice_features=len(twice), updated=updated, retired=retired,
                 edits=s["created"] + moved + updated + retired)
        s["moved_cells_changed"] = conn.execute("""
            SELECT count(*) FROM feature_outbox.outbox
             WHERE event_type = 'moved' AND routing_key IS DISTINCT FROM previous_routing_key""").fetchone()[0]
        s["outbox_rows"] = conn.execute("SELECT count(*) FROM feature_outbox.outbox").fetchone()[0]

    say(f"edit: {s['moved']} moved ({s['moved_cells_changed']} into another H3 cell), {s['updated']} updated,"
        f" {s['retired']} retired in {s['edit_seconds']} s")
    say(f"load: {s['edits']} edits made in total ({s['created']} created + {s['moved']} moved + {s['updated']} updated"
        f" + {s['retired']} retired); outbox rows: {s['outbox_rows']}")
    if args.summary:
        args.summary.write_text(json.dumps(s) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
