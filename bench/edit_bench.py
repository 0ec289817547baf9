"""edit_feature against its physical floor, side by side in one run (make bench). Prints figures only.

pgbench, 2 clients, one `moved` per transaction with a translated copy of the feature's current shape
(two copies alternate, so every edit really changes the geometry). The cluster runs with fsync and
synchronous_commit off, so commit cost does not hide CPU cost. Rows, for real county polygons and
for points:
  bare UPDATE            UPDATE of geometry and version, no outbox
  UPDATE + outbox        the same plus an outbox INSERT, in one statement
  floor                  the same plus ST_IsValid and ST_PointOnSurface of the new shape: the least
                         work edit_feature must do
  edit_feature           edit_feature(id, geometry, 'moved')
and the GeoJSON text form: the floor parsing the text with ST_GeomFromGeoJSON, and
edit_feature(id, text, 'moved'). Then both forms against a user layer (a table of the user's own in
EPSG:4326, registered with register_layer), compared with the built-in table. Each row runs BENCH_SECONDS (default 5) per round, rounds interleaved
(BENCH_ROUNDS, default 3); the median TPS is printed with its ratio to the floor.
"""

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pg_test"))
from conftest import RUN_DIR, Cluster, county_data, free_port  # noqa: E402

DB = "bench"
SECONDS = int(os.environ.get("BENCH_SECONDS", "5"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
CLIENTS = int(os.environ.get("BENCH_CLIENTS", "2"))
POINT_BASE = 1_000_000  # point features have ids POINT_BASE + 1 .. POINT_BASE + n

SETUP = r"""
CREATE SCHEMA bench;
CREATE TABLE bench.raw (n serial, doc jsonb);
-- Two translated copies of every shape (k = 0, 1), as geometry and as GeoJSON text.
CREATE TABLE bench.shapes (id bigint, k int, g geometry(Geometry, 4326), j text, PRIMARY KEY (id, k));
CREATE TABLE bench.bare (id bigint PRIMARY KEY, geom geometry(Geometry, 4326) NOT NULL, version integer NOT NULL,
                         updated_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE bench.outbox (LIKE feature_outbox.outbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES);
-- A user layer: the application's own table, as register_layer requires it.
CREATE TABLE bench.layer (id bigint PRIMARY KEY, geom geometry(Geometry, 4326) NOT NULL, version integer NOT NULL DEFAULT 0);
SELECT feature_outbox.register_layer('bench', 'bench.layer');
"""

LOAD = r"""
INSERT INTO bench.shapes (id, k, g)
SELECT r.n, k, ST_Translate(ST_SetSRID(ST_GeomFromGeoJSON(r.doc->'geometry'), 4326), k * 0.001, 0)
  FROM bench.raw r, generate_series(0, 1) k;
-- Points: each county's point on surface.
INSERT INTO bench.shapes (id, k, g)
SELECT %(base)s + s.id, s.k, ST_PointOnSurface(s.g) FROM bench.shapes s WHERE s.id < %(base)s;
UPDATE bench.shapes SET j = ST_AsGeoJSON(g, 15);
INSERT INTO bench.bare (id, geom, version) SELECT id, g, 1 FROM bench.shapes WHERE k = 0;
SELECT feature_outbox.edit_feature(id, g, 'created') FROM bench.shapes WHERE k = 0 ORDER BY id;
SELECT feature_outbox.edit_feature('bench', id, g, 'created') FROM bench.shapes WHERE k = 0 ORDER BY id;
"""

# The shape for this transaction: feature :id, copy :k.
PICK = "\\set id random(1, {n}) + {base}\n\\set k random(0, 1)\n"
ROWS = [
    ("bare UPDATE", """UPDATE bench.bare b SET geom = s.g, version = b.version + 1, updated_at = now()
  FROM bench.shapes s WHERE b.id = :id AND s.id = :id AND s.k = :k;"""),
    ("UPDATE + outbox INSERT", """WITH u AS (UPDATE bench.bare b SET geom = s.g, version = b.version + 1, updated_at = now()
  FROM bench.shapes s WHERE b.id = :id AND s.id = :id AND s.k = :k RETURNING b.version)
INSERT INTO bench.outbox (feature_id, feature_version, event_type, routing_key, layer)
SELECT :id, u.version, 'moved', 'cell', 'features' FROM u;"""),
    ("floor: + ST_IsValid, ST_PointOnSurface", """WITH u AS (UPDATE bench.bare b SET geom = s.g, version = b.version + 1, updated_at = now()
  FROM bench.shapes s WHERE b.id = :id AND s.id = :id AND s.k = :k RETURNING b.version, b.geom)
INSERT INTO bench.outbox (feature_id, feature_version, event_type, routing_key, layer)
SELECT :id, u.version, 'moved', ST_IsValid(u.geom)::text || ST_AsText(ST_PointOnSurface(u.geom)), 'features' FROM u;"""),
    ("edit_feature(id, geometry, 'moved')", """SELECT feature_outbox.edit_feature(:id::bigint,
  (SELECT s.g FROM bench.shapes s WHERE s.id = :id AND s.k = :k), 'moved');"""),
    ("text floor: ST_GeomFromGeoJSON + floor", """WITH u AS (UPDATE bench.bare b SET geom = ST_GeomFromGeoJSON(s.j), version = b.version + 1, updated_at = now()
  FROM bench.shapes s WHERE b.id = :id AND s.id = :id AND s.k = :k RETURNING b.version, b.geom)
INSERT INTO bench.outbox (feature_id, feature_version, event_type, routing_key, layer)
SELECT :id, u.version, 'moved', ST_IsValid(u.geom)::text || ST_AsText(ST_PointOnSurface(u.geom)), 'features' FROM u;"""),
    ("edit_feature(id, GeoJSON text, 'moved')", """SELECT feature_outbox.edit_feature(:id::bigint,
  (SELECT s.j FROM bench.shapes s WHERE s.id = :id AND s.k = :k), 'moved');"""),
    ("layer: edit_feature('bench', id, geometry)", """SELECT feature_outbox.edit_feature('bench', :id::bigint,
  (SELECT s.g FROM bench.shapes s WHERE s.id = :id AND s.k = :k), 'moved');"""),
    ("layer: edit_feature('bench', id, GeoJSON)", """SELECT feature_outbox.edit_feature('bench', :id::bigint,
  (SELECT s.j FROM bench.shapes s WHERE s.id = :id AND s.k = :k), 'moved');"""),
]
# Each row's references: (index of the row it is compared with, label).
COMPARE = {
    "edit_feature(id, geometry, 'moved')": [(2, "floor")],
    "edit_feature(id, GeoJSON text, 'moved')": [(4, "text floor")],
    "layer: edit_feature('bench', id, geometry)": [(2, "floor"), (3, "built-in")],
    "layer: edit_feature('bench', id, GeoJSON)": [(4, "text floor"), (5, "built-in")],
}


def pgbench(c: Cluster, script: str, db: str = DB) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(script)
    os.chmod(f.name, 0o644)
    try:
        out = subprocess.run(["pgbench", "-n", "-h", "127.0.0.1", "-p", str(c.port), "-U", "postgres",
                              "-c", str(CLIENTS), "-j", str(CLIENTS), "-T", str(SECONDS), "-f", f.name, db],
                             capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        raise SystemExit(f"pgbench failed:\n{out.stdout}\n{out.stderr}")
    for line in out.stdout.splitlines():
        if line.startswith("tps ="):
            return float(line.split()[2])
    raise SystemExit(f"no tps in pgbench output:\n{out.stdout}")


def copy_counties(conn) -> None:
    """The county GeoJSON features, one per row, into bench.raw (doc): what each bench's LOAD reads."""
    with conn.cursor().copy("COPY bench.raw (doc) FROM STDIN") as copy:
        for line in county_data().read_text().splitlines():
            copy.write_row((line,))


def edit_cluster(directory: Path, bin: Path | None = None, *settings: str) -> tuple[Cluster, int]:
    """A cluster of `bin`'s build (the tree under test by default) loaded for the edit benches
    (SETUP, the county data, LOAD, VACUUM ANALYZE), and its number of counties. One relay worker,
    pointed at a closed port: edits pay the commit wake-up, the relay stays idle. Shared by
    bench/ab_bench.py and bench/edit_steps.py, so that every figure is taken on the same tables."""
    c = Cluster(directory, free_port(), *([bin] if bin else []))
    c.start(f"feature_outbox.database = '{DB}'", "feature_outbox.relay_workers = 1",
            f"feature_outbox.endpoint = 'http://127.0.0.1:{free_port()}/closed'",
            "feature_outbox.retry_backoff_min = '60s'", "feature_outbox.retry_backoff_max = '60s'",
            "shared_buffers = '256MB'", "max_wal_size = '4GB'", "autovacuum_naptime = '10s'", *settings)
    c.create_db(DB)
    c.restart()
    with c.connect(DB) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute(SETUP)
        copy_counties(conn)
        conn.execute(LOAD % {"base": POINT_BASE})
        n = conn.execute("SELECT count(*) FROM bench.raw").fetchone()[0]
        conn.execute("VACUUM ANALYZE")
    return c, n


def main() -> None:
    c, n = edit_cluster(RUN_DIR / "bench-edit")
    try:
        sets = [("county polygons", 0), ("points", POINT_BASE)]
        tps = {(s, r): [] for s, _ in sets for r, _ in ROWS}
        for _ in range(ROUNDS):
            for label, base in sets:
                for name, sql in ROWS:
                    tps[(label, name)].append(pgbench(c, PICK.format(n=n, base=base) + sql + "\n"))
        print(f"edit_feature against its floor: pgbench, {CLIENTS} clients, {os.cpu_count()} cores, "
              f"fsync and synchronous_commit off, median of {ROUNDS} x {SECONDS} s")
        for label, _ in sets:
            print(f"  {label} ({n} features, moved to a translated copy):")
            medians = [statistics.median(tps[(label, name)]) for name, _ in ROWS]
            for i, (name, _) in enumerate(ROWS):
                ratio = "".join(f"  {medians[i] / medians[j]:6.1%} of {what}" for j, what in COMPARE.get(name, []))
                spread = f"{min(tps[(label, name)]):>8,.0f} - {max(tps[(label, name)]):<8,.0f}"
                print(f"    {name:<42} {medians[i]:>8,.0f} TPS  ({spread}){ratio}")
    finally:
        c.stop()


if __name__ == "__main__":
    main()
