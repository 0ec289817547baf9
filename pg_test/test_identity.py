"""A copy of a database never speaks as the original (issue 38).

The trial's story: database gis relays under feature_outbox.database = '*'; it is dumped and
restored into gis_restored on the same server, the server restarts, and the same feature is edited
in each. The copy relays nothing until resolve_copy() says what it is; resolved as a new source its
events carry another database_id, and a consumer keyed as the book says (database_id, layer,
registration_id, feature_id) keeps gis's edit. Then CREATE DATABASE ... TEMPLATE resolved as
'moved' (same identity), a restore into another cluster, a promoted standby (goes on by itself),
sink health in metrics() with NATS stopped and no edits, and no "exited with exit code" line for the
relay workers in the server log.

The tests of this module run in order against one cluster."""

import asyncio
import importlib.util
import json
import os
import re
import subprocess
import time

import psycopg
import pytest

from conftest import PG_BIN, ROOT, RUN_DIR, Cluster, free_port
from relay_harness import WAIT_SCALE, NatsServer, nats_fixture, wait_for

POLL = 0.2  # feature_outbox.poll_interval below, in seconds
SETTINGS = ("feature_outbox.relay_workers = 1", f"feature_outbox.poll_interval = '{int(POLL * 1000)}ms'",
            "feature_outbox.retry_backoff_min = '100ms'", "feature_outbox.retry_backoff_max = '1s'")
TABLE = ("CREATE TABLE public.parcels (id bigint PRIMARY KEY, geom geometry(Point, 4326) NOT NULL, "
         "version integer NOT NULL DEFAULT 0, owner text)")
HELD = "held: copy of another database"

nats_server = nats_fixture("nats_identity")


def as_postgres(*cmd) -> list:
    return (["runuser", "-u", "postgres", "--"] if os.getuid() == 0 else []) + [str(a) for a in cmd]


def gis_with_parcels(c: Cluster) -> None:
    """Database gis on `c`, with the extension and the layer parcels."""
    c.create_db("gis")
    with c.connect("gis") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute(TABLE)
        conn.execute("SELECT feature_outbox.register_layer('parcels', 'public.parcels', properties => '{owner}')")


@pytest.fixture(scope="module")
def c(nats_server):
    c = Cluster(RUN_DIR / "identity", free_port())
    c.start(*SETTINGS, f"feature_outbox.endpoint = '{nats_server.url}'", "feature_outbox.database = '*'")
    gis_with_parcels(c)
    yield c
    c.stop()


def edit(c: Cluster, db: str, fid: int, x: float, owner: str, kind: str = "created") -> str:
    with c.connect(db) as conn:
        conn.execute("SELECT feature_outbox.edit_feature('parcels', %s, ST_SetSRID(ST_MakePoint(%s, 40), 4326), %s, %s::jsonb)",
                     (fid, x, kind, json.dumps({"owner": owner})))
        return conn.execute("SELECT event_id::text FROM feature_outbox.outbox ORDER BY id DESC LIMIT 1").fetchone()[0]


def identity(c: Cluster, db: str) -> str:
    with c.connect(db) as conn:
        rows = conn.execute("SELECT identity::text FROM feature_outbox.database_identity").fetchall()
    assert len(rows) == 1, rows
    return rows[0][0]


def relay_databases(c: Cluster, via: str = "gis") -> dict:
    """The relay_databases view, read in `via` (a database with the extension)."""
    with c.connect(via) as conn:
        conn.row_factory = psycopg.rows.dict_row
        return {r["database"]: r for r in conn.execute("SELECT * FROM feature_outbox.relay_databases")}


def published(c: Cluster, db: str, event_id: str) -> bool:
    with c.connect(db) as conn:
        return conn.execute("SELECT published_at IS NOT NULL FROM feature_outbox.outbox WHERE event_id = %s",
                            (event_id,)).fetchone()[0]


def drop(c: Cluster, *dbs: str) -> None:
    """Drops databases a test made: each holds a relay worker, and the cluster has 8 slots."""
    with c.connect() as conn:
        for db in dbs:
            conn.execute(f'DROP DATABASE "{db}" WITH (FORCE)')


def worker_state(c: Cluster, db: str) -> str:
    with c.connect(db) as conn:
        return conn.execute("SELECT state FROM feature_outbox.workers").fetchone()[0]


def restore_while_served(c: Cluster, dump, db: str) -> None:
    """pg_restore of `dump` into a new database `db` of the running `c`, in two steps: the schema
    section creates the extension, which records db's own identity, and its worker serves db as
    itself (idle only once it passed the check); then the data section brings the source's rows."""
    c.create_db(db)
    restore = [PG_BIN / "pg_restore", "-h", "127.0.0.1", "-p", str(c.port), "-U", "postgres", "--exit-on-error", "-d", db]
    subprocess.run([*restore, "--section=pre-data", dump], check=True)
    wait_for(lambda: worker_state(c, db) == "idle", 10, f"{db}'s worker to serve it")
    assert len(identity(c, db)) == 36
    subprocess.run([*restore, "--section=data", "--section=post-data", dump], check=True)


def by_event_id(server) -> dict:
    return {m["event"]["event_id"]: m for m in server.messages()}


def book_consumer():
    """examples/python_consumer.py, the book's consumer (docs/src/events.md includes it)."""
    spec = importlib.util.spec_from_file_location("python_consumer", ROOT / "examples" / "python_consumer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_event(c: Cluster, db: str, m: dict) -> None:
    """Every field of the event and its database headers against the committed rows of `db`."""
    e = m["event"]
    with c.connect(db) as conn:
        row = conn.execute(
            """SELECT o.layer, r.since_id, o.feature_id::text, o.feature_version, o.event_type, o.routing_key,
                      p.version, ST_X(p.geom), ST_Y(p.geom), p.owner, current_database(),
                      (SELECT identity::text FROM feature_outbox.database_identity)
                 FROM feature_outbox.outbox o JOIN feature_outbox.layer_registry r USING (layer)
                 JOIN public.parcels p ON p.id = o.feature_id
                WHERE o.event_id = %s""", (e["event_id"],)).fetchone()
    layer, registration, fid, version, kind, routing_key, current, x, y, owner, database, database_id = row
    assert (e["database"], e["database_id"]) == (database, database_id)
    assert (e["layer"], e["registration_id"], e["feature_id"]) == (layer, registration, fid)
    assert (e["event_version"], e["action"], e["routing_key"]) == (version, kind, routing_key)
    # The event carries the feature's row as it was when relayed: the committed one, if no later edit.
    assert e["geometry_version"] <= current
    if e["event_version"] == current:
        assert e["geometry_version"] == current and e["geometry"]["coordinates"] == [x, y]
        assert e["properties"] == {"owner": owner}
    assert e["schema_version"] == 3 and e["crs"] == "EPSG:4326"
    assert m["headers"]["Feature-Outbox-Database"] == database
    assert m["headers"]["Feature-Outbox-Database-Id"] == database_id


def test_a_restored_copy_waits_until_resolved_and_then_speaks_as_a_new_source(c, nats_server, tmp_path):
    gis_id = identity(c, "gis")
    first = edit(c, "gis", 1, -100.0, "gis")
    wait_for(lambda: published(c, "gis", first), 10, "gis's first edit")
    # The restore of the trial: pg_dump, pg_restore into another database of the same server.
    args = ["-h", "127.0.0.1", "-p", str(c.port), "-U", "postgres"]
    dump = tmp_path / "gis.pgdump"
    subprocess.run([PG_BIN / "pg_dump", *args, "-Fc", "-f", dump, "gis"], check=True)
    c.create_db("gis_restored")
    subprocess.run([PG_BIN / "pg_restore", *args, "--exit-on-error", "-d", "gis_restored", dump], check=True)
    c.restart()
    # The same feature edited in each: version 2 of feature 1 twice, in two databases.
    copy_edit = edit(c, "gis_restored", 1, -101.0, "copy", "moved")
    gis_edit = edit(c, "gis", 1, -102.0, "gis", "moved")
    wait_for(lambda: published(c, "gis", gis_edit), 10, "gis's second edit")
    d = wait_for(lambda: relay_databases(c).get("gis_restored", {}).get("state") == HELD and relay_databases(c)["gis_restored"],
                 10, "gis_restored to be held")
    assert "restored copy of database gis" in d["last_error"] and "resolve_copy('new')" in d["last_error"], d
    time.sleep(3 * POLL * WAIT_SCALE)
    assert not published(c, "gis_restored", copy_edit)
    assert copy_edit not in by_event_id(nats_server)
    with c.connect("gis_restored") as conn:
        conn.row_factory = psycopg.rows.dict_row
        b = conn.execute("SELECT * FROM feature_outbox.backlog").fetchone()
        metrics = conn.execute("SELECT feature_outbox.metrics() AS m").fetchone()["m"]
    # Held, not failing: one row waits, none failed, and the reason names the SQL that resolves it.
    assert (b["unpublished_rows"], b["failing_rows"], b["parked_rows"]) == (1, 0, 0), b
    assert "resolve_copy" in b["relay_held_reason"] and "resolve_copy" in b["relay_last_error"], b
    assert 'outbox_relay_held{database="gis_restored"} 1' in metrics
    # One line in the log for it per worker process (one before the restart, one after), not one per
    # wake-up, with the SQL that resolves it.
    lines = [l for l in c.log().splitlines() if '"gis_restored": database gis_restored is a restored copy' in l]
    pids = {re.search(r"\[(\d+)\]", l)[1] for l in lines}
    assert 1 <= len(lines) == len(pids) <= 2 and "SELECT feature_outbox.resolve_copy('moved')" in lines[-1], lines

    with c.connect("gis_restored") as conn:
        new_id = conn.execute("SELECT feature_outbox.resolve_copy('new')::text").fetchone()[0]
    assert new_id != gis_id and identity(c, "gis_restored") == new_id and identity(c, "gis") == gis_id
    wait_for(lambda: published(c, "gis_restored", copy_edit), 5, "the copy's edit once resolved")
    assert relay_databases(c)["gis_restored"]["state"] == "relaying"
    msgs = wait_for(lambda: (m := by_event_id(nats_server)) and copy_edit in m and m, 5, "the copy's event")
    for eid, db in ((first, "gis"), (gis_edit, "gis"), (copy_edit, "gis_restored")):
        check_event(c, db, msgs[eid])
    # Same layer, registration and feature id, and both version 2; the consumer keeps both apart.
    g, r = msgs[gis_edit]["event"], msgs[copy_edit]["event"]
    assert (g["layer"], g["registration_id"], g["feature_id"], g["event_version"]) == \
           (r["layer"], r["registration_id"], r["feature_id"], r["event_version"]) == ("parcels", g["registration_id"], "1", 2)
    # The book's consumer (durable, dedupe by event_id, highest version per the documented key)
    # keeps gis's version 2 and the copy's apart; keyed without database_id it would keep one.
    consumer = book_consumer()
    kept = asyncio.run(consumer.consume(nats_server.url, durable="identity-test", idle=1.0))
    assert kept[(gis_id, "parcels", g["registration_id"], "1")]["event_id"] == gis_edit
    assert kept[(new_id, "parcels", g["registration_id"], "1")]["event_id"] == copy_edit
    assert len({k[1:] for k in kept if k[1:] == ("parcels", g["registration_id"], "1")}) == 1
    # CloudEvents source names the identity.
    with c.connect() as conn:
        conn.execute("ALTER DATABASE gis_restored SET feature_outbox.envelope = 'cloudevents'")
    time.sleep(2.5)  # the launcher restarts the database's worker for its new settings
    ce = edit(c, "gis_restored", 2, -103.0, "copy")
    m = wait_for(lambda: by_event_id(nats_server).get(ce), 10, "a cloudevents event of the copy")
    assert m["headers"]["ce-source"] == f"/{new_id}/parcels" and m["event"]["database_id"] == new_id


def test_a_template_copy_resolved_as_moved_keeps_the_identity(c, nats_server):
    gis_id = identity(c, "gis")
    with c.connect() as conn:
        conn.execute("CREATE DATABASE gis_moved TEMPLATE gis")
    wait_for(lambda: relay_databases(c).get("gis_moved", {}).get("state") == HELD, 10, "gis_moved to be held")
    assert "CREATE DATABASE ... TEMPLATE" in relay_databases(c)["gis_moved"]["last_error"]
    waiting = edit(c, "gis_moved", 3, -104.0, "moved")
    time.sleep(3 * POLL * WAIT_SCALE)
    assert not published(c, "gis_moved", waiting)
    with c.connect("gis_moved") as conn:
        assert conn.execute("SELECT feature_outbox.resolve_copy('moved')::text").fetchone()[0] == gis_id
        # A second call finds nothing to resolve.
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):
            conn.execute("SELECT feature_outbox.resolve_copy('new')")
    wait_for(lambda: published(c, "gis_moved", waiting), 5, "gis_moved's edit once resolved")
    m = wait_for(lambda: by_event_id(nats_server).get(waiting), 5, "gis_moved's event")
    assert m["event"]["database_id"] == gis_id and m["event"]["database"] == "gis_moved"
    check_event(c, "gis_moved", m)


def test_a_restore_into_a_database_the_relay_already_serves_waits_too(c, nats_server, tmp_path):
    """No restart: pg_restore's schema section creates the extension, which records this database's
    own identity, and the relay serves it as itself; then the data section brings the source's
    identity row and its waiting outbox rows. The relay must hold the database from then on (CI
    found a worker that had kept the first identity for good and relayed the copy as a new source)."""
    args = ["-h", "127.0.0.1", "-p", str(c.port), "-U", "postgres"]
    dump = tmp_path / "gis_src.pgdump"
    # The source's relay publishes nothing (no endpoint for that database): its row waits in the dump.
    c.create_db("gis_src")
    with c.connect() as conn:
        conn.execute("ALTER DATABASE gis_src SET feature_outbox.endpoint = ''")
    with c.connect("gis_src") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        conn.execute(TABLE)
        conn.execute("SELECT feature_outbox.register_layer('parcels', 'public.parcels', properties => '{owner}')")
    waiting = edit(c, "gis_src", 4, -106.0, "waits in the dump")
    subprocess.run([PG_BIN / "pg_dump", *args, "-Fc", "-f", dump, "gis_src"], check=True)
    assert not published(c, "gis_src", waiting)
    restore_while_served(c, dump, "gis_live")
    copy_edit = edit(c, "gis_live", 5, -107.0, "copy")
    d = wait_for(lambda: relay_databases(c).get("gis_live", {}).get("state") == HELD and relay_databases(c)["gis_live"],
                 10, "gis_live to be held once the source's rows arrived")
    assert "restored copy of database gis_src" in d["last_error"], d
    time.sleep(3 * POLL * WAIT_SCALE)
    assert not published(c, "gis_live", waiting) and not published(c, "gis_live", copy_edit)
    assert not [m for m in nats_server.messages() if m["event"]["database"] == "gis_live"]
    with c.connect("gis_live") as conn:
        conn.row_factory = psycopg.rows.dict_row
        b = conn.execute("SELECT unpublished_rows, relay_held_reason FROM feature_outbox.backlog").fetchone()
        assert b["unpublished_rows"] == 2 and "resolve_copy" in b["relay_held_reason"], b
        new_id = conn.execute("SELECT feature_outbox.resolve_copy('new')::text AS id").fetchone()["id"]
    # Resolved, both go out under the new identity (the sink reconnects with it), field by field.
    assert new_id not in (identity(c, "gis"), identity(c, "gis_src"))
    for eid in (waiting, copy_edit):
        wait_for(lambda: published(c, "gis_live", eid), 10, "gis_live's rows once resolved")
    msgs = wait_for(lambda: (m := {i: x for i, x in by_event_id(nats_server).items() if x["event"]["database"] == "gis_live"})
                    and len(m) == 2 and m, 10, "gis_live's two events")
    assert set(msgs) == {waiting, copy_edit}
    for m in msgs.values():
        assert m["event"]["database_id"] == new_id
        check_event(c, "gis_live", m)
    drop(c, "gis_live", "gis_src")


def test_a_restore_with_nothing_waiting_shows_held_without_an_edit(c, tmp_path):
    """The same restore of a source whose rows were all published: no batch finds a row, yet the
    views say held within a poll interval, before any edit."""
    args = ["-h", "127.0.0.1", "-p", str(c.port), "-U", "postgres"]
    with c.connect("gis") as conn:
        wait_for(lambda: conn.execute("SELECT unpublished_rows FROM feature_outbox.backlog").fetchone()[0] == 0, 10,
                 "gis to have nothing waiting")
    dump = tmp_path / "gis.pgdump"
    subprocess.run([PG_BIN / "pg_dump", *args, "-Fc", "-f", dump, "gis"], check=True)
    restore_while_served(c, dump, "gis_idle")
    wait_for(lambda: worker_state(c, "gis_idle") == HELD, 5 * POLL + 2, "gis_idle's worker to hold it with no edit")
    with c.connect("gis_idle") as conn:
        b = conn.execute("SELECT unpublished_rows, relay_held_reason FROM feature_outbox.backlog").fetchone()
    assert b[0] == 0 and "restored copy of database gis" in b[1], b
    drop(c, "gis_idle")


def test_a_restore_into_another_cluster_waits_too(c, nats_server, tmp_path):
    other = Cluster(RUN_DIR / "identity_other", free_port())
    other.start(*SETTINGS, f"feature_outbox.endpoint = '{nats_server.url}'", "feature_outbox.database = '*'")
    try:
        dump = tmp_path / "gis.pgdump"
        subprocess.run([PG_BIN / "pg_dump", "-h", "127.0.0.1", "-p", str(c.port), "-U", "postgres", "-Fc", "-f", dump, "gis"],
                       check=True)
        other.create_db("gis")
        subprocess.run([PG_BIN / "pg_restore", "-h", "127.0.0.1", "-p", str(other.port), "-U", "postgres",
                        "--exit-on-error", "-d", "gis", dump], check=True)
        other.restart()
        waiting = edit(other, "gis", 1, -105.0, "elsewhere", "moved")
        d = wait_for(lambda: relay_databases(other).get("gis", {}).get("state") == HELD and relay_databases(other)["gis"],
                     10, "the other cluster's gis to be held")
        assert "restored copy of database gis" in d["last_error"]
        time.sleep(3 * POLL * WAIT_SCALE)
        assert not published(other, "gis", waiting)
        with other.connect("gis") as conn:
            new_id = conn.execute("SELECT feature_outbox.resolve_copy('new')::text").fetchone()[0]
        assert new_id != identity(c, "gis")
        wait_for(lambda: published(other, "gis", waiting), 5, "the other cluster's edit once resolved")
        m = wait_for(lambda: by_event_id(nats_server).get(waiting), 5, "its event")
        assert m["event"]["database_id"] == new_id
        check_event(other, "gis", m)
    finally:
        other.stop()


def test_a_promoted_standby_relays_on_with_the_same_identity(nats_server):
    primary = Cluster(RUN_DIR / "identity_primary", free_port())
    primary.start(*SETTINGS, f"feature_outbox.endpoint = '{nats_server.url}'", "feature_outbox.database = 'gis'",
                  "wal_level = replica")
    standby = RUN_DIR / "identity_standby"
    port = free_port()
    try:
        gis_with_parcels(primary)
        before = identity(primary, "gis")
        first = edit(primary, "gis", 1, -106.0, "primary")
        wait_for(lambda: published(primary, "gis", first), 10, "the primary's edit")
        subprocess.run(["rm", "-rf", standby], check=True)
        owner = ["-o", "postgres", "-g", "postgres"] if os.getuid() == 0 else []
        subprocess.run(["install", "-d", *owner, "-m", "0700", standby], check=True)
        subprocess.run(as_postgres(PG_BIN / "pg_basebackup", "-h", "127.0.0.1", "-p", primary.port, "-U", "postgres",
                                   "-D", standby / "data", "-R", "-X", "stream", "-c", "fast", "--no-sync"), check=True)
        with open(standby / "data" / "postgresql.auto.conf", "a") as f:
            f.write(f"port = {port}\nunix_socket_directories = '{standby}'\n")
        subprocess.run(as_postgres(PG_BIN / "pg_ctl", "-D", standby / "data", "-l", standby / "server.log", "-w", "start"),
                       check=True, stdout=subprocess.DEVNULL)
        promoted = Cluster(standby, port)
        # Failover: the primary goes away, the standby is promoted.
        primary.stop()
        subprocess.run(as_postgres(PG_BIN / "pg_ctl", "-D", standby / "data", "-w", "promote"), check=True,
                       stdout=subprocess.DEVNULL)
        after = edit(promoted, "gis", 1, -107.0, "promoted", "moved")
        wait_for(lambda: published(promoted, "gis", after), 15, "the promoted standby's edit, with no operator step")
        assert identity(promoted, "gis") == before
        with promoted.connect("gis") as conn:
            timeline = conn.execute("SELECT timeline FROM feature_outbox.database_identity").fetchone()[0]
        assert timeline == 2
        m = wait_for(lambda: by_event_id(nats_server).get(after), 5, "its event")
        assert m["event"]["database_id"] == before and m["event"]["event_version"] == 2
        check_event(promoted, "gis", m)
    finally:
        subprocess.run(as_postgres(PG_BIN / "pg_ctl", "-D", standby / "data", "-m", "fast", "-w", "stop"),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        primary.stop()


def test_a_pg_upgraded_cluster_relays_on_with_the_same_identity(nats_server):
    """pg_upgrade into a new cluster (a new system identifier and data directory, the database's oid
    kept, as PostgreSQL 15+ keeps it) is the same database: it relays on with no operator step. The
    upgrade runs within this major: the machine's roots hold one major each (15 -> 17 would need 15's
    binaries in 17's root), and what identity looks at changes the same way."""
    settings = (*SETTINGS, f"feature_outbox.endpoint = '{nats_server.url}'", "feature_outbox.database = 'gis'")
    old = Cluster(RUN_DIR / "identity_upgrade_old", free_port())
    new = Cluster(RUN_DIR / "identity_upgrade_new", free_port())
    old.start(*settings)
    try:
        gis_with_parcels(old)
        with old.connect("gis") as conn:
            system_before = conn.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0]
        before = identity(old, "gis")
        first = edit(old, "gis", 1, -105.0, "before")
        wait_for(lambda: published(old, "gis", first), 10, "the old cluster's edit")
        old.stop()
        new.start(*settings)  # initdb'd with the same options, then stopped for pg_upgrade
        new.stop()
        subprocess.run(as_postgres(PG_BIN / "pg_upgrade", "-b", PG_BIN, "-B", PG_BIN, "-d", old.dir / "data",
                                   "-D", new.dir / "data", "-p", free_port(), "-P", free_port(), "--no-sync"),
                       check=True, cwd=new.dir, stdout=subprocess.DEVNULL)
        subprocess.run(as_postgres(PG_BIN / "pg_ctl", "-D", new.dir / "data", "-l", new.dir / "server.log", "-w", "start"),
                       check=True, stdout=subprocess.DEVNULL)
        after = edit(new, "gis", 1, -104.0, "after", "moved")
        wait_for(lambda: published(new, "gis", after), 15, "the upgraded cluster's edit, with no operator step")
        assert identity(new, "gis") == before
        with new.connect("gis") as conn:
            system_after = conn.execute("SELECT system_identifier FROM pg_control_system()").fetchone()[0]
            recorded = conn.execute("SELECT system_identifier, data_directory FROM feature_outbox.database_identity").fetchone()
        assert system_after != system_before, "pg_upgrade made a new cluster"
        assert recorded == (system_after, str(new.dir / "data")), recorded
        m = wait_for(lambda: by_event_id(nats_server).get(after), 5, "its event")
        assert m["event"]["database_id"] == before and m["event"]["event_version"] == 2
        check_event(new, "gis", m)
    finally:
        new.stop()
        old.stop()


def sink_series(c: Cluster, db: str = "gis") -> dict:
    """metrics()'s sink health series of worker 0 of `db`."""
    with c.connect(db) as conn:
        text = conn.execute("SELECT feature_outbox.metrics()").fetchone()[0]
    out = {}
    for name in ("outbox_sink_up", "outbox_sink_errors_total", "outbox_sink_last_success_timestamp_seconds"):
        m = re.search(rf'^{name}{{database="{db}",worker="0"}} (\S+)$', text, re.M)
        assert m, (name, text)
        assert f"# TYPE {name} " in text
        out[name] = float(m[1])
    return out


def test_nats_down_with_no_edits_shows_in_metrics_within_a_poll_interval(c, nats_server):
    up = wait_for(lambda: (s := sink_series(c)) and s["outbox_sink_up"] == 1 and s, 5, "the sink up")
    assert up["outbox_sink_last_success_timestamp_seconds"] > time.time() - 5
    time.sleep(2 * POLL)
    assert sink_series(c)["outbox_sink_last_success_timestamp_seconds"] > up["outbox_sink_last_success_timestamp_seconds"], \
        "an idle worker's look each poll interval counts as a success"
    nats_server.stop()
    stopped = time.monotonic()
    try:
        down = wait_for(lambda: (s := sink_series(c)) and s["outbox_sink_up"] == 0 and s, 5, "the sink down")
        took = time.monotonic() - stopped
        print(f"\nsink_up went to 0 {took:.2f} s after NATS stopped (poll interval {POLL} s)")
        assert took < POLL * WAIT_SCALE + 0.5
        assert down["outbox_sink_errors_total"] > up["outbox_sink_errors_total"]
        with c.connect("gis") as conn:
            w = conn.execute("SELECT sink_up, sink_errors, last_error FROM feature_outbox.workers").fetchone()
        assert w[0] is False and w[1] >= 1 and "NATS" in w[2], w
    finally:
        nats_server.start()
    back = wait_for(lambda: (s := sink_series(c)) and s["outbox_sink_up"] == 1 and s, 10, "the sink up again")
    assert back["outbox_sink_last_success_timestamp_seconds"] > down["outbox_sink_last_success_timestamp_seconds"]
    eid = edit(c, "gis", 9, -108.0, "after the outage")
    wait_for(lambda: published(c, "gis", eid), 10, "an edit after the outage")


def test_no_exit_code_line_for_a_designed_end(c):
    # Probes that find no extension (the new database), workers stopped for CREATE DATABASE ...
    # TEMPLATE and for new settings, and restarts: all designed ends.
    with c.connect() as conn:
        conn.execute("CREATE DATABASE plain")
    wait_for(lambda: relay_databases(c).get("plain", {}).get("state") == "no extension", 10, "the probe of plain")
    lines = [l for l in c.log().splitlines() if "exited with exit code" in l and "feature_outbox relay" in l]
    assert not lines, lines[:5]
