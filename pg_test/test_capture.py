"""Capture (issue 49): writes made outside edit_feature and record_edit reach subscribers, through a
logical slot the capture worker reads. End to end, on a cluster of its own with wal_level = logical
relaying to a real nats-server, read by a durable JetStream consumer. The writers are clients no one
here wrote: psql (INSERT, UPDATE, DELETE, COPY), GDAL's ogr2ogr and ogrinfo (Debian's gdal-bin),
and GDAL's PostgreSQL driver editing features (SetFeature, DeleteFeature) through Debian's
python3-gdal. Each event is checked field by field against the row as committed, read back from the
table (capture_harness.check); what must not produce an event is counted after a fence write
(capture_harness.settle), not after a sleep. Mistakes are refused with their SQLSTATE and leave no
slot, no publication membership and no captured layer behind."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psycopg
import pytest

from capture_harness import (PUBLICATION, Layer, Subscriber, capture_pids, capture_state, check, logical_cluster, outbox_count,
                             psql, settle, slot_name, square, u_shape)
from conftest import PG_BIN, ROOT, RUN_DIR, tools
from relay_harness import nats_fixture, wait_for

DB = "capture"
nats_server = nats_fixture("nats_capture")

# GDAL's PostgreSQL driver editing one feature, as a GDAL-based editor does: `set` reads the
# feature, sets the given fields (and, with "dx", shifts every vertex), and writes it back with
# SetFeature (an UPDATE of every column, the geometry included); `delete` calls DeleteFeature.
# Run by Debian's python3, where python3-gdal (a dependency of gdal-bin) lives.
GDAL_EDIT = r"""
import json, sys
from osgeo import gdal, ogr
gdal.UseExceptions()
dsn, layer, op, fid, fields = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
ds = gdal.OpenEx(dsn, gdal.OF_VECTOR | gdal.OF_UPDATE)
lyr = ds.GetLayerByName(layer)
if op == "delete":
    lyr.DeleteFeature(fid)
else:
    f = lyr.GetFeature(fid)
    dx = fields.pop("dx", 0)
    for k, v in fields.items():
        f.SetField(k, v)
    if dx:
        ring = f.GetGeometryRef().GetGeometryRef(0)
        for i in range(ring.GetPointCount()):
            x, y = ring.GetPoint_2D(i)
            ring.SetPoint_2D(i, x + dx, y)
    lyr.SetFeature(f)
ds = None
"""


@pytest.fixture(scope="module")
def capture(nats_server):
    c = logical_cluster("capture", DB, f"feature_outbox.endpoint = '{nats_server.url}'")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def sub(nats_server):
    return Subscriber(nats_server.url, DB, "capture_tests")


@pytest.fixture
def db(capture):
    with capture.connect(DB) as conn:
        yield conn


@pytest.fixture(scope="module")
def sites(capture):
    with capture.connect(DB) as conn:
        return Layer("sites").create(conn)


def gdal_paths() -> tuple[str, str]:
    ogr2ogr = tools("gdal")["gdal"]
    return ogr2ogr, str(Path(ogr2ogr).with_name("ogrinfo"))


def pg_dsn(c) -> str:
    return f"PG:host=127.0.0.1 port={c.port} user=postgres dbname={DB}"


def run(*cmd) -> str:
    out = subprocess.run([str(a) for a in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert out.returncode == 0, f"{cmd[0]} failed ({out.returncode}): {out.stdout}"
    return out.stdout


def drop_db(c, name: str) -> None:
    """DROP DATABASE, after the logical slots a failed test may have left (a database with a slot
    cannot be dropped): the extension dropped first, then any slot still there."""
    try:
        with c.connect(name) as conn:
            conn.execute("DROP EXTENSION IF EXISTS feature_outbox CASCADE")
    except psycopg.Error:
        pass
    with c.connect() as conn:
        slots = lambda: conn.execute("SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s",  # noqa: E731
                                     (name,)).fetchall()
        for slot, pid in slots():
            if pid:
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            wait_for(lambda: not any(p for s, p in slots() if s == slot), 10, f"slot {slot} to be released")
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def fails(conn, sql):
    """(SQLSTATE, message, hint) of a statement that must fail."""
    with pytest.raises(psycopg.Error) as e:
        conn.execute(sql)
    return e.value.sqlstate, e.value.diag.message_primary, e.value.diag.message_hint


# ---- the tool ------------------------------------------------------------------------------------------

def test_gdal_is_debian_12s_and_complete():
    """tools.sh installs Debian 12's gdal-bin; ogr2ogr's libraries all resolve, and its PostgreSQL
    and GeoJSON drivers and the Python bindings the driver edits go through are there."""
    ogr2ogr, ogrinfo = gdal_paths()
    status = run("bash", ROOT / "scripts" / "tools.sh", "status", "gdal")
    assert status.strip() == "gdal fresh", status
    assert run(ogr2ogr, "--version").startswith("GDAL 3.6.")
    assert run(ogrinfo, "--version").startswith("GDAL 3.6.")
    ldd = run("ldd", ogr2ogr)
    assert "not found" not in ldd and "libgdal.so" in ldd, ldd
    formats = run(ogr2ogr, "--formats")
    assert "PostgreSQL -vector-" in formats and "GeoJSON -vector-" in formats, formats
    assert run("/usr/bin/python3", "-c", "from osgeo import gdal; print(gdal.__version__)").startswith("3.6.")


# ---- plain psql --------------------------------------------------------------------------------------------

def test_the_slot_and_publication_are_the_capture_workers(db, sites):
    state = capture_state(db, sites.table)
    assert state["slots"] == [(slot_name(db), "pgoutput")] and state["published"] and state["layers"] == ["sites"], state
    view = db.execute("SELECT slot_name, state, lag_bytes, retained_wal_bytes, last_error FROM feature_outbox.capture").fetchone()
    assert view[0] == slot_name(db) and view[4] is None, view
    assert db.execute("SELECT count(*) FROM pg_publication WHERE pubname = %s", (PUBLICATION,)).fetchone()[0] == 1


def test_psql_insert_move_update_retire(capture, db, sites, sub):
    fid = 1
    psql(capture, DB, f"INSERT INTO public.sites (id, geom, name, kind, note) VALUES ({fid}, '{square(-73.99, 40.75)}', 'Site one', 'a', 'n0')")
    [m] = sub.wait("sites", fid, 1)
    created = check(db, sites, m, "created", None)

    # The U's centroid lies outside it: the key must come from the point on surface, as routing_key() takes it.
    psql(capture, DB, f"UPDATE public.sites SET geom = '{u_shape(-72.5, 41.0)}' WHERE id = {fid}")
    moved = check(db, sites, sub.wait("sites", fid, 2)[1], "moved", created)
    assert moved["routing_key"] != created["routing_key"]
    assert db.execute(f"""SELECT feature_outbox.routing_key(ST_Centroid(geom)) <> feature_outbox.routing_key(geom)
                            FROM public.sites WHERE id = {fid}""").fetchone()[0]

    psql(capture, DB, f"UPDATE public.sites SET name = 'Site one, renamed' WHERE id = {fid}")
    updated = check(db, sites, sub.wait("sites", fid, 3)[2], "updated", moved)
    assert updated["routing_key"] == moved["routing_key"] and updated["properties"]["name"] == "Site one, renamed"

    # The geometry written again unchanged, with a property: what a client that writes every
    # column sends. Updated, not moved.
    psql(capture, DB, f"UPDATE public.sites SET geom = ST_GeomFromEWKT(ST_AsEWKT(geom)), kind = 'b' WHERE id = {fid}")
    updated2 = check(db, sites, sub.wait("sites", fid, 4)[3], "updated", updated)

    # A column that is not registered: no event, and the worker leaves the row's version alone.
    version = db.execute(f"SELECT version FROM public.sites WHERE id = {fid}").fetchone()[0]
    psql(capture, DB, f"UPDATE public.sites SET note = 'only a note' WHERE id = {fid}")
    settle(capture, DB, sub, sites)
    assert len(sub.of("sites", fid)) == 4 and outbox_count(db, "sites", fid) == 4
    assert db.execute(f"SELECT version, note FROM public.sites WHERE id = {fid}").fetchone() == (version, "only a note")

    # Geometry and a property at once: moved.
    psql(capture, DB, f"UPDATE public.sites SET geom = '{square(-71.0, 42.0)}', kind = 'c' WHERE id = {fid}")
    moved2 = check(db, sites, sub.wait("sites", fid, 5)[4], "moved", updated2)
    assert moved2["properties"]["kind"] == "c" and moved2["routing_key"] != updated2["routing_key"]

    psql(capture, DB, f"UPDATE public.sites SET retired_at = now() WHERE id = {fid}")
    check(db, sites, sub.wait("sites", fid, 6)[5], "retired", moved2)
    settle(capture, DB, sub, sites)
    assert len(sub.of("sites", fid)) == 6 and outbox_count(db, "sites", fid) == 6


def test_psql_delete(capture, db, sites, sub):
    fid = 2
    psql(capture, DB, f"INSERT INTO public.sites (id, geom, name, kind) VALUES ({fid}, '{square(-100.0, 35.0)}', 'Site two', 'a')")
    created = check(db, sites, sub.wait("sites", fid, 1)[0], "created", None)
    psql(capture, DB, f"DELETE FROM public.sites WHERE id = {fid}")
    check(db, sites, sub.wait("sites", fid, 2)[1], "retired", created)
    settle(capture, DB, sub, sites)
    assert len(sub.of("sites", fid)) == 2


def test_psql_copy(capture, db, sites, sub):
    """COPY FROM STDIN through psql's \\copy: one created event per row, in one transaction."""
    rows = {10 + i: (square(-90.0 + i, 30.0 + i), f"Copied {i}", "k" if i % 2 else None) for i in range(4)}
    data = "".join(f"{fid}\t{geom}\t{name}\t{kind or chr(92) + 'N'}\n" for fid, (geom, name, kind) in rows.items())
    psql(capture, DB, "", "-c", r"\copy public.sites (id, geom, name, kind) FROM pstdin", stdin=data)
    for fid in rows:
        check(db, sites, sub.wait("sites", fid, 1)[0], "created", None)
    settle(capture, DB, sub, sites)
    assert [len(sub.of("sites", fid)) for fid in rows] == [1] * len(rows)
    assert {fid: db.execute(f"SELECT name, kind FROM public.sites WHERE id = {fid}").fetchone() for fid in rows} == \
        {fid: (name, kind) for fid, (_, name, kind) in rows.items()}


def test_a_refused_row_goes_alone_and_the_rows_written_with_it_keep_their_events(capture, db, sites, sub):
    """One INSERT of three rows, the middle one with an empty polygon, which the edit path refuses:
    the worker writes a chunk's rows in one subtransaction, and when one fails does them again one
    by one. The other two get their events; the refused one none, a WARNING naming it and the
    capture view's count; once repaired, its event follows."""
    refused = db.execute("SELECT refused FROM feature_outbox.capture").fetchone()[0]
    psql(capture, DB, f"""INSERT INTO public.sites (id, geom, name, kind) VALUES
                            (71, '{square(-85.0, 33.0)}', 'Before the bad one', 'a'),
                            (72, 'SRID=4326;POLYGON EMPTY', 'Empty', 'a'),
                            (73, '{square(-85.5, 33.5)}', 'After the bad one', 'a')""")
    check(db, sites, sub.wait("sites", 71, 1)[0], "created", None)
    check(db, sites, sub.wait("sites", 73, 1)[0], "created", None)
    settle(capture, DB, sub, sites)
    assert [len(sub.of("sites", fid)) for fid in (71, 72, 73)] == [1, 0, 1]
    assert [outbox_count(db, "sites", fid) for fid in (71, 72, 73)] == [1, 0, 1]
    assert db.execute("SELECT refused FROM feature_outbox.capture").fetchone()[0] == refused + 1
    log = capture.log()
    assert [log.count(f"the event of feature {fid} of layer sites was refused: ") for fid in (71, 72, 73)] == [0, 1, 0]

    psql(capture, DB, f"UPDATE public.sites SET geom = '{square(-86.0, 34.0)}' WHERE id = 72")
    check(db, sites, sub.wait("sites", 72, 1)[0], "created", None)


# ---- GDAL -----------------------------------------------------------------------------------------------

def feature_collection(features: dict) -> dict:
    return {"type": "FeatureCollection", "features": [
        {"type": "Feature", "id": fid, "properties": props,
         "geometry": {"type": "Polygon", "coordinates": [[[lon, lat], [lon + 0.01, lat], [lon + 0.01, lat + 0.01],
                                                          [lon, lat + 0.01], [lon, lat]]]}}
        for fid, ((lon, lat), props) in features.items()]}


def test_ogr2ogr_append_then_gdal_updates(capture, db, sub):
    """ogr2ogr -append of a GeoJSON file into a registered table in NY State Plane (EPSG:2263,
    reprojected by GDAL), then the PostgreSQL driver's own edits of existing features: an SQL UPDATE
    through ogrinfo, SetFeature of a property and of the geometry (each an UPDATE of every column),
    and DeleteFeature. GDAL 3.6's -upsert is not implemented by its PostgreSQL driver."""
    ogr2ogr, ogrinfo = gdal_paths()
    parcels = Layer("parcels", srid=2263, retired=False, props=("name", "kind")).create(db)
    src = RUN_DIR / "capture" / "parcels.geojson"
    src.write_text(json.dumps(feature_collection({
        21: ((-73.99, 40.75), {"name": "Ogr 21", "kind": "R6", "note": "loaded"}),
        22: ((-74.01, 40.70), {"name": "Ogr 22", "kind": "C4"}),
        23: ((-73.95, 40.78), {"name": "Ogr 23", "kind": None}),
    })))
    run(ogr2ogr, "-append", "-preserve_fid", "-t_srs", "EPSG:2263", "-nln", "parcels", pg_dsn(capture), src)
    created = {fid: check(db, parcels, sub.wait("parcels", fid, 1)[0], "created", None) for fid in (21, 22, 23)}
    assert db.execute("SELECT note FROM public.parcels WHERE id = 21").fetchone()[0] == "loaded"

    # ogrinfo -sql hands a statement that is not a SELECT to the server as it is.
    run(ogrinfo, pg_dsn(capture), "-sql", "UPDATE public.parcels SET geom = ST_Translate(geom, 30000, 0) WHERE id = 21")
    moved = check(db, parcels, sub.wait("parcels", 21, 2)[1], "moved", created[21])
    assert moved["routing_key"] != created[21]["routing_key"]

    # SetFeature writes back every column as GDAL read it, the unchanged geometry and the version
    # included: updated, not moved.
    run("/usr/bin/python3", "-c", GDAL_EDIT, pg_dsn(capture), "parcels", "set", 22, json.dumps({"kind": "M1"}))
    updated = check(db, parcels, sub.wait("parcels", 22, 2)[1], "updated", created[22])
    assert updated["properties"] == {"name": "Ogr 22", "kind": "M1"}

    run("/usr/bin/python3", "-c", GDAL_EDIT, pg_dsn(capture), "parcels", "set", 23, json.dumps({"dx": 25000, "name": "Ogr 23 moved"}))
    moved23 = check(db, parcels, sub.wait("parcels", 23, 2)[1], "moved", created[23])
    assert moved23["routing_key"] != created[23]["routing_key"]

    run("/usr/bin/python3", "-c", GDAL_EDIT, pg_dsn(capture), "parcels", "delete", 21, "{}")
    check(db, parcels, sub.wait("parcels", 21, 3)[2], "retired", moved)

    settle(capture, DB, sub, parcels)
    assert [len(sub.of("parcels", fid)) for fid in (21, 22, 23)] == [3, 2, 2]
    assert [outbox_count(db, "parcels", fid) for fid in (21, 22, 23)] == [3, 2, 2]


# ---- the application's edits and plain writes in one transaction ----------------------------------------

def test_one_event_per_row_when_edits_and_plain_writes_share_a_transaction(capture, db, sites, sub):
    """The application's edit_feature and record_edit and plain writes, to the same rows and to
    others, in one transaction: every row exactly one event, the application's where it edited the
    row (before or after a plain write to it), a captured one elsewhere."""
    before = {}
    for fid in (31, 32, 33):
        psql(capture, DB, f"INSERT INTO public.sites (id, geom, name, kind) VALUES ({fid}, '{square(-80.0, 25.0 + fid / 10)}', 'Pre {fid}', 'a')")
        before[fid] = check(db, sites, sub.wait("sites", fid, 1)[0], "created", None)
    edit34 = json.dumps({"type": "Polygon", "coordinates": [[[-81, 26], [-80.99, 26], [-80.99, 26.01], [-81, 26.01], [-81, 26]]]})
    edit33 = json.dumps({"type": "Polygon", "coordinates": [[[-60, 10], [-59.99, 10], [-59.99, 10.01], [-60, 10.01], [-60, 10]]]})
    edit36 = json.dumps({"type": "Polygon", "coordinates": [[[-70, 20], [-69.99, 20], [-69.99, 20.01], [-70, 20.01], [-70, 20]]]})
    psql(capture, DB, stdin=f"""
        BEGIN;
        UPDATE public.sites SET kind = 'plain then record_edit' WHERE id = 31;
        SELECT feature_outbox.record_edit('sites', 31::bigint, 'updated');
        SELECT feature_outbox.edit_feature('sites', 34::bigint, '{edit34}', 'created', '{{"name": "Edit 34", "kind": "e"}}');
        UPDATE public.sites SET name = 'Edit 34, then a plain write' WHERE id = 34;
        UPDATE public.sites SET name = 'plain only' WHERE id = 32;
        INSERT INTO public.sites (id, geom, name, kind) VALUES (35, '{square(-82.0, 27.0)}', 'plain insert', 'p');
        UPDATE public.sites SET name = 'plain, then edit_feature' WHERE id = 33;
        SELECT feature_outbox.edit_feature('sites', 33::bigint, '{edit33}', 'moved');
        SELECT feature_outbox.edit_feature('sites', 36::bigint, '{edit36}', 'created', '{{"name": "Edit 36", "kind": "e"}}');
        UPDATE public.sites SET geom = '{square(-83.0, 28.0)}' WHERE id = 36;
        COMMIT;""")
    settle(capture, DB, sub, sites)
    # Row 36: created by edit_feature, then moved by a plain write in the same transaction: the
    # edit's event and a captured moved, which carries the routing key the move gave it.
    sub.wait("sites", 36, 2)
    got = {fid: sub.of("sites", fid) for fid in (31, 32, 33, 34, 35, 36)}
    assert {fid: len(ms) for fid, ms in got.items()} == {31: 2, 32: 2, 33: 2, 34: 1, 35: 1, 36: 2}, got
    assert {fid: outbox_count(db, "sites", fid) for fid in got} == {31: 2, 32: 2, 33: 2, 34: 1, 35: 1, 36: 2}
    assert got[36][0]["event"]["origin"] == "application" and got[36][0]["event"]["action"] == "created"
    # The edit's event went out after the move, so its body shows the moved row (the relay reads the
    # row as it publishes); what it recorded is its routing key and the box it wrote, edit36's.
    check(db, sites, got[36][1], "moved", dict(got[36][0]["event"], bbox=[-70.0, 20.0, -69.99, 20.01]))
    check(db, sites, got[31][1], "updated", before[31], origin="application")
    check(db, sites, got[32][1], "updated", before[32])
    check(db, sites, got[33][1], "moved", before[33], origin="application")
    assert got[33][1]["event"]["properties"]["name"] == "plain, then edit_feature"
    check(db, sites, got[34][0], "created", None, origin="application")
    assert got[34][0]["event"]["properties"]["name"] == "Edit 34, then a plain write"
    check(db, sites, got[35][0], "created", None)


def test_the_workers_own_version_bump_is_not_captured_again(capture, db, sites, sub):
    """The worker sets the row's version in its own transaction; that write is decoded too, and
    must not come back as a second event, however long one waits."""
    fid = 41
    psql(capture, DB, f"INSERT INTO public.sites (id, geom, name, kind) VALUES ({fid}, '{square(-95.0, 40.0)}', 'Bumped', 'a')")
    check(db, sites, sub.wait("sites", fid, 1)[0], "created", None)
    assert db.execute(f"SELECT version FROM public.sites WHERE id = {fid}").fetchone()[0] == 1
    for _ in range(3):  # three fences, each after several of the worker's reads of the slot
        settle(capture, DB, sub, sites)
    assert len(sub.of("sites", fid)) == 1 and outbox_count(db, "sites", fid) == 1
    assert db.execute(f"SELECT version FROM public.sites WHERE id = {fid}").fetchone()[0] == 1


# ---- the worker's reads -----------------------------------------------------------------------------------

def origin_commits(c, start: str, end: str) -> int:
    """Commit records between two WAL positions that carry a replication origin: only the capture
    worker's session has one (slot.rs origin_session)."""
    out = subprocess.run([PG_BIN / "pg_waldump", "-p", c.dir / "data" / "pg_wal", "-s", start, "-e", end],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
    assert "rmgr:" in out or start == end, out[-2000:]
    return sum(1 for line in out.splitlines() if "COMMIT" in line and "origin: node" in line)


def test_an_idle_worker_commits_nothing(capture, db, sites, sub):
    """Between writes the worker only looks: its reads take no transaction id, so it writes and
    flushes no commit record, and with no new WAL it does not read the slot at all. pgrx's
    Spi::get_one and Spi::run assign one: before, an idle worker committed 18 times a second,
    each commit new WAL for its next round to decode."""
    settle(capture, DB, sub, sites)
    start = db.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0]
    time.sleep(3)
    end = db.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0]
    assert origin_commits(capture, start, end) == 0


def test_a_half_flushed_wal_tail_holds_neither_the_worker_nor_a_fast_shutdown(capture, db, sites, sub):
    """A transaction left open after writing WAL (a long load, a session idle in transaction) whose
    last record crosses the flushed end: PostgreSQL's read of the slot goes to the flushed end and
    waited on that record, deaf to SIGTERM, until some commit flushed it. In a fast shutdown none
    comes (the writers and the WAL writer stop first): the server never stopped (CI, drill 21).
    Here the WAL writer is stopped (SIGSTOP) and the open transaction writes past the end of a
    WAL segment, which it flushes itself, mid-record (the worker so far read to there and waited
    forever); the worker now reads to the last record inserted, flushed first: it stays idle, the
    server restarts fast, and capture goes on. Its flush is never refused either (a position just
    past a page's header once was: the worker's log must not say so)."""
    db.execute("CREATE TABLE IF NOT EXISTS public.unrelated (i int, t text)")
    walwriter = db.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'").fetchone()[0]
    open_tx = psycopg.connect(capture.dsn(DB))
    os.kill(walwriter, signal.SIGSTOP)
    try:
        before = db.execute("SELECT pg_current_wal_flush_lsn()").fetchone()[0]
        open_tx.execute("INSERT INTO public.unrelated SELECT i, repeat('x', 50) FROM generate_series(1, 250000) i")
        inserted = db.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        assert db.execute("SELECT pg_current_wal_flush_lsn() > %s", (before,)).fetchone()[0], \
            "the open transaction's WAL was not flushed past a segment's end"
        wait_for(lambda: capture_worker_state(db) == "idle" and
                 db.execute("SELECT pg_current_wal_flush_lsn() >= %s::pg_lsn", (inserted,)).fetchone()[0], 5,
                 "the worker to read the half-flushed tail and be idle")
    finally:
        os.kill(walwriter, signal.SIGCONT)
    assert "is not satisfied" not in capture.log()
    try:
        t = time.time()
        capture.restart()  # fast: the open transaction is terminated
        restart_s = time.time() - t
    finally:
        open_tx.close()  # no commit: the server ended it
    assert restart_s < 30, f"the fast restart took {restart_s:.1f} s"
    wait_for(lambda: capture_pids(capture, DB), 30, "the capture worker after the restart")
    fid = 81
    psql(capture, DB, f"INSERT INTO public.sites (id, geom, name, kind) VALUES ({fid}, '{square(-84.0, 31.0)}', 'After the restart', 'a')")
    with capture.connect(DB) as conn:
        check(conn, sites, sub.wait("sites", fid, 1)[0], "created", None)


def test_a_read_waiting_inside_postgresql_ends_at_sigterm(capture, sites, sub):
    """A read of the slot that waits inside PostgreSQL (for WAL, or on 17 and later for the standbys
    in synchronized_standby_slots), here the test build's fault point sleeping in pg_sleep before
    the read: pgrx's SIGTERM handler only sets a flag, which nothing there looks at; during its
    reads the worker has PostgreSQL's own handler, so pg_terminate_backend (or a shutdown) ends it
    as it ends a backend's query, and the change it was reading is captured, once, by the next."""
    with capture.connect(DB) as conn:
        conn.execute("""CREATE OR REPLACE FUNCTION public._test_stall_next_capture_read() RETURNS void
                        LANGUAGE c VOLATILE AS 'feature_outbox', '_test_stall_next_capture_read_wrapper'""")
        logged = capture.log().count("the read waits inside PostgreSQL")
        conn.execute("SELECT public._test_stall_next_capture_read()")
        fid = 82
        psql(capture, DB, f"INSERT INTO public.sites (id, geom, name, kind) VALUES ({fid}, '{square(-83.0, 32.0)}', 'Read late', 'a')")
        wait_for(lambda: capture.log().count("the read waits inside PostgreSQL") > logged, 10, "the stalled read")
        [pid] = capture_pids(capture, DB)
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        wait_for(lambda: pid not in capture_pids(capture, DB), 10, "the stalled worker to end at SIGTERM")
        assert f"terminating background worker \"feature_outbox capture\" due to administrator command" in capture.log()
        check(conn, sites, sub.wait("sites", fid, 1)[0], "created", None)
        settle(capture, DB, sub, sites)
        assert len(sub.of("sites", fid)) == 1 and outbox_count(conn, "sites", fid) == 1


def capture_worker_state(conn) -> str:
    return conn.execute("SELECT state FROM feature_outbox.capture").fetchone()[0]


# ---- uncapture ----------------------------------------------------------------------------------------------

def test_uncapture_layer_stops_its_events_and_keeps_the_others(capture, db, sites, sub):
    blocks = Layer("blocks").create(db)
    psql(capture, DB, f"INSERT INTO public.blocks (id, geom, name) VALUES (51, '{square(-110.0, 40.0)}', 'Block 51')")
    created = check(db, blocks, sub.wait("blocks", 51, 1)[0], "created", None)
    db.execute("CALL feature_outbox.uncapture_layer('blocks')")
    state = capture_state(db, blocks.table)
    assert state["slots"] == [(slot_name(db), "pgoutput")] and not state["published"], state
    assert "blocks" not in state["layers"] and "sites" in state["layers"], state
    psql(capture, DB, "UPDATE public.blocks SET name = 'not captured' WHERE id = 51")
    psql(capture, DB, f"INSERT INTO public.blocks (id, geom, name) VALUES (52, '{square(-111.0, 40.0)}', 'Block 52')")
    psql(capture, DB, "DELETE FROM public.blocks WHERE id = 51")
    settle(capture, DB, sub, sites)  # sites is still captured: its fence passes every write above
    assert (len(sub.of("blocks", 51)), len(sub.of("blocks", 52)), outbox_count(db, "blocks")) == (1, 0, 1)
    # Captured again, it picks up from then on, not the writes made while it was not.
    db.execute("CALL feature_outbox.capture_layer('blocks')")
    psql(capture, DB, "UPDATE public.blocks SET name = 'captured again' WHERE id = 52")
    settle(capture, DB, sub, sites)
    assert (outbox_count(db, "blocks", 51), outbox_count(db, "blocks", 52)) == (1, 1)
    assert created["event_version"] == 1


def test_the_slot_goes_with_the_last_layer_and_with_drop_extension(capture):
    """uncapture_layer of the last layer drops the slot, at once or (while the worker reads it) at
    the worker's next round; DROP EXTENSION likewise, with the publications and the replication
    origin. Nothing of capture's is left to hold WAL."""
    other = "capture_last"
    capture.create_db(other)
    with capture.connect(other) as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        a, b = Layer("a").create(conn), Layer("b").create(conn)
        slot = slot_name(conn)

        def leftovers():
            return conn.execute("""SELECT (SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s),
                                          (SELECT count(*) FROM pg_publication WHERE pubname LIKE 'feature_outbox_capture%%'),
                                          (SELECT count(*) FROM pg_replication_origin WHERE roname = %s)""",
                                (slot, slot)).fetchone()
        assert capture_state(conn, a.table)["slots"] == [(slot, "pgoutput")]
        conn.execute("CALL feature_outbox.uncapture_layer('a')")
        assert capture_state(conn, a.table) == {"slots": [(slot, "pgoutput")], "published": False, "layers": ["b"]}
        conn.execute("CALL feature_outbox.uncapture_layer('b')")
        wait_for(lambda: capture_state(conn, b.table) == {"slots": [], "published": False, "layers": []}, 10,
                 "the slot to go with the last captured layer")
        # Not captured: a write gives no event (nothing reads a slot; none exists to hold WAL).
        psql(capture, other, f"INSERT INTO public.a (id, geom) VALUES (1, '{square(0.0, 0.0)}')")
        conn.execute("CALL feature_outbox.capture_layer('a')")
        assert capture_state(conn, a.table)["slots"] == [(slot, "pgoutput")]
        # The database's capture worker reads the slot: DROP EXTENSION must still drop it.
        wait_for(lambda: capture_pids(capture, other), 20, "the capture worker of the database")
        psql(capture, other, "UPDATE public.a SET name = 'captured' WHERE id = 1")
        conn.execute("DROP EXTENSION feature_outbox CASCADE")
        wait_for(lambda: leftovers() == (0, 0, 0), 10, "DROP EXTENSION to take the slot, publications and origin")
        psql(capture, other, "UPDATE public.a SET name = 'after DROP EXTENSION' WHERE id = 1")
        # The launcher may have started the worker again while the DROP had not committed: that one
        # finds no extension at its next look and leaves.
        wait_for(lambda: capture_pids(capture, other) == [], 10, "the capture worker to leave for good")
    drop_db(capture, other)


# ---- mistakes ------------------------------------------------------------------------------------------------

@pytest.fixture
def bad(capture):
    """A database of its own in the logical cluster, for a mistake that must leave nothing behind."""
    capture.create_db("capture_bad")
    with capture.connect("capture_bad") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        yield conn
    drop_db(capture, "capture_bad")


NOTHING = {"slots": [], "published": False, "layers": []}


def test_wal_level_replica_is_refused_with_the_setting_and_the_restart(cluster):
    """The shared cluster runs at wal_level = replica, as a default install does."""
    cluster.create_db("capture_replica")
    with cluster.connect("capture_replica") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        assert conn.execute("SHOW wal_level").fetchone()[0] == "replica"
        lay = Layer("sites").create(conn, capture=False)
        state, message, hint = fails(conn, "CALL feature_outbox.capture_layer('sites')")
        assert state == "55000" and "wal_level" in message, (state, message, hint)
        assert hint and "wal_level" in hint and "logical" in hint and "restart" in hint.lower(), hint
        assert capture_state(conn, lay.table) == NOTHING
    drop_db(cluster, "capture_replica")


def test_a_table_without_a_key_is_refused_by_name(bad):
    """register_layer takes a unique NOT NULL id column; logical decoding needs a replica identity,
    which a unique index gives only once the table says so."""
    lay = Layer("nokey").create(bad, capture=False, key="NOT NULL UNIQUE")
    state, message, hint = fails(bad, "CALL feature_outbox.capture_layer('nokey')")
    assert state == "55000" and "nokey" in message and "id" in hint, (state, message, hint)
    assert capture_state(bad, lay.table) == NOTHING
    bad.execute("ALTER TABLE public.nokey REPLICA IDENTITY USING INDEX nokey_id_key")
    bad.execute("CALL feature_outbox.capture_layer('nokey')")
    assert capture_state(bad, lay.table) == {"slots": [(slot_name(bad), "pgoutput")], "published": True, "layers": ["nokey"]}


def test_an_unregistered_layer_is_refused(bad):
    assert fails(bad, "CALL feature_outbox.capture_layer('nowhere')")[0] == "42704"
    assert fails(bad, "CALL feature_outbox.uncapture_layer('nowhere')")[0] == "42704"
    assert capture_state(bad, "feature_outbox.outbox") == NOTHING


def test_a_second_capture_is_refused_and_the_first_stays(bad):
    lay = Layer("twice").create(bad)
    first = capture_state(bad, lay.table)
    assert first == {"slots": [(slot_name(bad), "pgoutput")], "published": True, "layers": ["twice"]}
    assert fails(bad, "CALL feature_outbox.capture_layer('twice')")[0] == "42710"
    assert capture_state(bad, lay.table) == first
    bad.execute("CALL feature_outbox.uncapture_layer('twice')")
    # The slot goes at once, or at the worker's next round when it was reading it.
    wait_for(lambda: capture_state(bad, lay.table) == NOTHING, 10, "the slot to go with the last captured layer")


def test_a_slot_another_tool_owns_is_refused_and_kept(bad):
    lay = Layer("taken").create(bad, capture=False)
    slot = slot_name(bad)
    bad.execute("SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", (slot,))
    state, message, hint = fails(bad, "CALL feature_outbox.capture_layer('taken')")
    assert state == "42710" and slot in message, (state, message, hint)
    assert capture_state(bad, lay.table) == {"slots": [(slot, "test_decoding")], "published": False, "layers": []}
    bad.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    bad.execute("CALL feature_outbox.capture_layer('taken')")
    assert capture_state(bad, lay.table) == {"slots": [(slot, "pgoutput")], "published": True, "layers": ["taken"]}
