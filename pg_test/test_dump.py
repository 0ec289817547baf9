"""pg_dump and pg_restore keep a feature_outbox database: the extension's tables and the outbox id
sequence are registered with pg_extension_config_dump, so their rows and position are dumped even
though CREATE EXTENSION (not the dump) creates the objects themselves."""

import subprocess

from conftest import PG_BIN

EDITS = [
    (1, '{"type":"Point","coordinates":[13.4,52.5]}', "created"),
    (2, '{"type":"Polygon","coordinates":[[[178,51],[-179,51],[-179,52],[178,52],[178,51]]]}', "created"),
    (3, '{"type":"LineString","coordinates":[[-122.42,37.77],[-122.27,37.80]]}', "created"),
    (1, '{"type":"Point","coordinates":[2.35,48.86]}', "moved"),
    (1, '{"type":"Point","coordinates":[2.36,48.87]}', "moved"),
    (3, None, "retired"),
]
FEATURES = """SELECT id, ST_AsEWKT(geom), ST_AsEWKB(geom), version, created_at, updated_at, retired_at
                FROM feature_outbox.features ORDER BY id"""
OUTBOX = "SELECT * FROM feature_outbox.outbox ORDER BY id"
LAYERS = "SELECT layer, tbl::text, id_column, geometry_column, version_column, properties, retired_column, srid FROM feature_outbox.layer_registry ORDER BY layer"
STATE = "SELECT layer, feature_id, routing_key FROM feature_outbox.feature_state ORDER BY layer, feature_id"


def rows(conn):
    return conn.execute(FEATURES).fetchall(), conn.execute(OUTBOX).fetchall()


def test_dump_and_restore(cluster, tmp_path):
    cluster.create_db("dump_src")
    with cluster.connect("dump_src") as src:
        src.execute("CREATE EXTENSION feature_outbox CASCADE")
        for edit in EDITS:
            src.execute("SELECT feature_outbox.edit_feature(%s, %s, %s)", edit)
        # A user layer: its registry row and its features' state survive; the built-in row is not doubled.
        src.execute("CREATE TABLE public.sites (id integer PRIMARY KEY, geom geometry(Point, 3857) NOT NULL,"
                    " version integer NOT NULL DEFAULT 0, label text)")
        src.execute("SELECT feature_outbox.register_layer('sites', 'public.sites', properties => '{label}')")
        src.execute("""SELECT feature_outbox.edit_feature('sites', 1, '{"type":"Point","coordinates":[13.4,52.5]}', 'created',
                                                          '{"label": "Berlin"}')""")
        layers_before = src.execute(LAYERS).fetchall()
        state_before = src.execute(STATE).fetchall()
        # Relay bookkeeping columns must survive too.
        src.execute("UPDATE feature_outbox.outbox SET published_at = now(), attempts = 1 WHERE id = 1")
        before = rows(src)
    assert len(before[0]) == 3 and len(before[1]) == len(EDITS) + 1

    conn_args = ["-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres"]
    dump = tmp_path / "dump_src.pgdump"
    subprocess.run([PG_BIN / "pg_dump", *conn_args, "-Fc", "-f", dump, "dump_src"], check=True)
    cluster.create_db("dump_dst")  # empty: the restore runs CREATE EXTENSION for postgis and ours
    restore = subprocess.run([PG_BIN / "pg_restore", *conn_args, "--exit-on-error", "-d", "dump_dst", dump],
                             capture_output=True, text=True)
    assert restore.returncode == 0 and restore.stderr == "", restore.stderr

    with cluster.connect("dump_dst") as dst:
        assert dst.execute("SELECT extname FROM pg_extension WHERE extname = 'feature_outbox'").fetchone()
        after = rows(dst)
        assert after[0] == before[0], "features differ after restore"
        assert after[1] == before[1], "outbox rows differ after restore"
        assert dst.execute(LAYERS).fetchall() == layers_before and [l[0] for l in layers_before] == ["features", "sites"]
        assert dst.execute(STATE).fetchall() == state_before
        # The restored layer takes edits, with its previous key from the restored state.
        dst.execute("""SELECT feature_outbox.edit_feature('sites', 1, '{"type":"Point","coordinates":[2.35,48.86]}', 'moved')""")
        assert dst.execute("SELECT previous_routing_key FROM feature_outbox.outbox WHERE layer = 'sites' ORDER BY id DESC LIMIT 1"
                           ).fetchone()[0] == state_before[-1][2]

        # The sequence position came back too: a new edit does not collide with a restored id.
        dst.execute("SELECT feature_outbox.edit_feature(4, '{\"type\":\"Point\",\"coordinates\":[0,0]}', 'created')")
        new_id, restored_max = dst.execute(
            "SELECT max(id) FILTER (WHERE feature_id = 4), max(id) FILTER (WHERE feature_id <> 4)"
            "  FROM feature_outbox.outbox").fetchone()
        assert new_id > restored_max
