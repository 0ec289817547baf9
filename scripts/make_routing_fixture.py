#!/usr/bin/env python3
"""Writes pg_test/fixtures/us_counties_routing_r8.csv: the reference routing key of every US county.

An independent reimplementation of feature_outbox's routing rule, so the real-data test can compare
the extension against it. It never calls the extension; PostGIS picks the point, the h3 Python
package (4.x, Uber's C library) picks the cell:

  1. geometry = ST_GeomFromGeoJSON(county geometry), SRID 4326;
  2. if not ST_IsValid, take ST_MakeValid of it;
  3. if a ring or line has an edge spanning more than 180 degrees of longitude (judged here, in
     Python, from the GeoJSON coordinates), take ST_ShiftLongitude of it;
  4. point = ST_PointOnSurface; a longitude above 180 (from the shift) is wrapped back by -360;
  5. routing key = h3.latlng_to_cell(lat, lon, 8).

Output columns: fips (the county's 5-digit FIPS code, also its feature id), routing_key, valid
(ST_IsValid of the geometry as given).

Usage (any PostgreSQL with PostGIS 3.3; the script runs CREATE EXTENSION IF NOT EXISTS postgis
in the database it is given, so use a scratch one):

    scripts/cluster.sh start /var/tmp/fo_fixture 54329
    .venv/bin/python scripts/make_routing_fixture.py \\
        "host=127.0.0.1 port=54329 user=postgres dbname=postgres"
    scripts/cluster.sh stop /var/tmp/fo_fixture

The DSN may also come from $ROUTING_FIXTURE_DSN. Optional arguments: --counties PATH (default: the
checkout's .cache/data/us-counties.geojsonl, which scripts/county_data.sh fills, as for the tests)
and --out PATH.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import h3
import psycopg

ROOT = Path(__file__).resolve().parents[1]
RESOLUTION = 8
DEFAULT_OUT = ROOT / "pg_test" / "fixtures" / f"us_counties_routing_r{RESOLUTION}.csv"

# One statement for all counties. ST_IsValidDetail rather than ST_IsValid: the latter logs a NOTICE
# per invalid geometry.
QUERY = """
WITH input AS (
    SELECT ord, ST_SetSRID(ST_GeomFromGeoJSON(gj), 4326) AS g, shift
      FROM unnest(%s::text[], %s::boolean[]) WITH ORDINALITY AS t(gj, shift, ord)
), base AS (
    SELECT ord, shift, (ST_IsValidDetail(g)).valid AS valid, g FROM input
), fixed AS (
    SELECT ord, shift, valid, CASE WHEN valid THEN g ELSE ST_MakeValid(g) END AS g FROM base
), point AS (
    SELECT ord, valid,
           ST_PointOnSurface(CASE WHEN shift THEN ST_ShiftLongitude(g) ELSE g END) AS p
      FROM fixed
)
SELECT valid, ST_X(p), ST_Y(p) FROM point ORDER BY ord
"""


def read_counties(path: Path) -> list[tuple[str, str, dict]]:
    """(fips, geometry text exactly as in the file, parsed geometry) per line of the GeoJSONL file."""
    counties = []
    for line in path.read_text().splitlines():
        if line.strip():
            start = line.index('"geometry":') + len('"geometry":')
            geometry, end = json.JSONDecoder().raw_decode(line, start)
            counties.append((json.loads(line)["id"], line[start:end].strip(), geometry))
    return counties


def lines(geometry: dict):
    """Every ring or line of a GeoJSON geometry, as a list of [lon, lat] positions."""
    kind, coords = geometry["type"], geometry.get("coordinates")
    if kind == "LineString":
        yield coords
    elif kind in ("Polygon", "MultiLineString"):
        yield from coords
    elif kind == "MultiPolygon":
        for polygon in coords:
            yield from polygon
    elif kind == "GeometryCollection":
        for member in geometry["geometries"]:
            yield from lines(member)


def crosses_antimeridian(geometry: dict) -> bool:
    # An edge over 180 degrees was drawn across the antimeridian, not the long way round.
    return any(abs(b[0] - a[0]) > 180 for line in lines(geometry) for a, b in zip(line, line[1:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dsn", nargs="?", default=os.environ.get("ROUTING_FIXTURE_DSN"),
                    help="libpq connection string of a PostGIS-capable database")
    ap.add_argument("--counties", type=Path)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    if not args.dsn:
        ap.error("give a DSN or set ROUTING_FIXTURE_DSN")

    if args.counties is None:  # the tests' own data, so the fixture matches what they load
        args.counties = Path(subprocess.run(["bash", ROOT / "scripts" / "county_data.sh"], check=True,
                                            stdout=subprocess.PIPE, text=True).stdout.strip())
    counties = read_counties(args.counties)
    # The geometry text goes to PostGIS as-is, just as the real-data test passes it to edit_feature.
    texts = [text for _, text, _ in counties]
    shifts = [crosses_antimeridian(geometry) for _, _, geometry in counties]

    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS postgis")
        rows = conn.execute(QUERY, (texts, shifts)).fetchall()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(["fips", "routing_key", "valid"])
        for (fips, _, _), (valid, x, y) in zip(counties, rows):
            lon = x - 360 if x > 180 else x
            out.writerow([fips, h3.latlng_to_cell(y, lon, RESOLUTION), str(valid).lower()])

    print(f"{args.out}: {len(rows)} counties, {sum(not r[0] for r in rows)} invalid, "
          f"{sum(shifts)} across the antimeridian", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
