"""One server, many databases (issue 22): with the default feature_outbox.database = '*' the relay
serves every database that has the extension, each with its own settings (ALTER DATABASE ... SET),
and DROP DATABASE, ALTER DATABASE ... RENAME and CREATE DATABASE ... TEMPLATE of a served database
succeed without FORCE while its worker relays.

The tests of this module run in order against one cluster: databases a, b and c, each with its own
subject prefix and stream, then b dropped, a renamed to a2, d copied from c, e at 0.2.0."""

import asyncio
import json
import threading
import time

import nats
import psycopg
import pytest

from conftest import RUN_DIR, Cluster, free_port
from drills import LAYER, TABLE, Editors, Ledger, backlog, relay_pids, tally
from relay_harness import WAIT_SCALE, nats_fixture, wait_for

HEADER = "Feature-Outbox-Database"
SETTINGS = ("feature_outbox.relay_workers = 1", "feature_outbox.poll_interval = '200ms'",
            "feature_outbox.retry_backoff_min = '100ms'", "feature_outbox.retry_backoff_max = '1s'")

nats_server = nats_fixture("nats_databases")


def install(c: Cluster, db: str, version: str | None = None) -> None:
    """The extension and the drill layer in `db`."""
    with c.connect(db) as conn:
        conn.execute("CREATE EXTENSION feature_outbox " + (f"VERSION '{version}' " if version else "") + "CASCADE")
        conn.execute(TABLE)
        conn.execute(f"SELECT feature_outbox.register_layer('{LAYER}', 'public.drill')")


def keep_apart(c: Cluster, db: str, prefix: str | None = None) -> None:
    """The first layout of the docs: a stream of the database's own, over a prefix of its own."""
    prefix = prefix or db
    with c.connect() as conn:
        conn.execute(f"ALTER DATABASE {db} SET feature_outbox.nats_subject_prefix = '{prefix}'")
        conn.execute(f"ALTER DATABASE {db} SET feature_outbox.nats_stream = '{prefix.upper()}'")


def databases(c: Cluster, via: str = "ops") -> dict:
    """relay_databases, read in `via`: by default ops, a database of its own for monitoring, served like the others."""
    with c.connect(via) as conn:
        conn.row_factory = psycopg.rows.dict_row
        return {r["database"]: r for r in conn.execute("SELECT * FROM feature_outbox.relay_databases")}


def edit(c: Cluster, db: str, fid: int, kind: str = "created", x: float = -100.0, y: float = 40.0) -> str:
    """One committed edit of the drill layer; its event_id, recorded in db's ledger."""
    with c.connect(db) as conn:
        conn.execute(f"SELECT feature_outbox.edit_feature('{LAYER}', %s, ST_SetSRID(ST_MakePoint(%s, %s), 4326), %s)",
                     (fid, x, y, kind))
        eid, version = conn.execute("SELECT event_id::text, feature_version FROM feature_outbox.outbox WHERE feature_id = %s "
                                    "ORDER BY id DESC LIMIT 1", (fid,)).fetchone()
    LEDGERS.setdefault(db, Ledger()).committed[eid] = (LAYER, fid, version)
    return eid


class Watcher:
    """A core NATS subscription on every subject, in a thread: each event as it is published, with
    its subject and headers (the stream is read only for the exactly-once counts)."""

    def __init__(self, url: str):
        self.url, self.seen, self.ready, self.stopping = url, {}, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    async def _run(self):
        nc = await nats.connect(self.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)

        async def on(m):
            if HEADER in (m.headers or {}) and not m.headers.get("Nats-Msg-Id", "").endswith(":departed"):
                event = json.loads(m.data)
                self.seen[event["event_id"]] = {"subject": m.subject, "headers": dict(m.headers), "event": event}
        await nc.subscribe(">", cb=on)
        await nc.flush()
        self.ready.set()
        while not self.stopping.is_set():
            await asyncio.sleep(0.05)
        await nc.drain()

    def stop(self):
        self.stopping.set()
        self.thread.join(10)


def delivered(watcher: Watcher, event_id: str) -> dict | None:
    return watcher.seen.get(event_id)


# Every committed edit of each database, across this module's tests: its stream must hold them all.
LEDGERS: dict[str, Ledger] = {}


def record(db: str, ledger: Ledger) -> Ledger:
    whole = LEDGERS.setdefault(db, Ledger())
    whole.committed.update(ledger.committed)
    whole.rolled_back |= ledger.rolled_back
    whole.uncertain |= ledger.uncertain
    return whole


def check_stream(c: Cluster, server, db: str, ledger: Ledger, shown_as: str | None = None):
    """Every committed edit of `db` is in its stream exactly once, from `db`, with its row's content."""
    stream, shown_as = db.upper(), shown_as or db
    msgs = server.messages(stream)
    row = tally(db, ledger, [(m["headers"]["Nats-Msg-Id"], m["event"]) for m in msgs], 0.0)
    assert (row.lost, row.invented, row.duplicates) == (0, 0, 0), row.line()
    assert row.committed > 0
    wrong = [m for m in msgs if not m["subject"].startswith(f"{db}.") or m["headers"].get(HEADER) != shown_as]
    assert not wrong, f"{len(wrong)} of {len(msgs)} messages of {stream} not from {shown_as}: {wrong[:2]}"
    # Content: each feature's newest event carries the row as committed in this database.
    newest = {}
    for m in msgs:
        e = m["event"]
        if e["feature_id"] not in newest or e["event_version"] > newest[e["feature_id"]]["event_version"]:
            newest[e["feature_id"]] = e
    with c.connect(db) as conn:
        rows = {str(r[0]): (r[1], json.loads(r[2])) for r in conn.execute(
            "SELECT id, version, ST_AsGeoJSON(geom, 15) FROM public.drill")}
    for fid, e in newest.items():
        version, geometry = rows[fid]
        assert e["event_version"] == version, (db, fid, e["event_version"], version)
        assert [round(v, 9) for v in e["geometry"]["coordinates"]] == [round(v, 9) for v in geometry["coordinates"]], (db, fid)
    return row


@pytest.fixture(scope="module")
def watcher(nats_server):
    w = Watcher(nats_server.url)
    yield w
    w.stop()


@pytest.fixture(scope="module")
def c(nats_server):
    c = Cluster(RUN_DIR / "databases", free_port())
    c.start(*SETTINGS, "max_prepared_transactions = 2",
            f"feature_outbox.endpoint = '{nats_server.url}'")  # feature_outbox.database: the default, '*'
    for db in ("ops", "a", "b", "c"):
        c.create_db(db)
        keep_apart(c, db)
    install(c, "ops")
    install(c, "a")
    install(c, "b")
    yield c
    c.stop()


def test_every_database_with_the_extension_is_served_with_its_own_prefix_exactly_once(c, nats_server, watcher):
    with c.connect() as conn:
        assert conn.execute("SHOW feature_outbox.database").fetchone()[0] == "*"
    wait_for(lambda: {d: r["state"] for d, r in databases(c).items() if d in ("a", "b", "c")} ==
             {"a": "relaying", "b": "relaying", "c": "no extension"}, 10, "a and b served, c probed and left")
    with c.connect() as conn:  # c holds no worker, and neither does postgres
        assert conn.execute("SELECT array_agg(datname ORDER BY datname) FROM pg_stat_activity "
                            "WHERE backend_type = 'feature_outbox relay'").fetchone()[0] == ["a", "b", "ops"]
    editors = {db: Editors(c, n=2, rate=50, dsn=c.dsn(db)).start() for db in ("a", "b")}
    time.sleep(1)
    install(c, "c")
    created = time.monotonic()
    first = edit(c, "c", 1)
    wait_for(lambda: delivered(watcher, first), 2, "c's first event within 2 s of CREATE EXTENSION")
    print(f"\nCREATE EXTENSION to c's first event: {time.monotonic() - created:.2f} s, a and b under load")
    editors["c"] = Editors(c, n=2, rate=50, dsn=c.dsn("c")).start()
    time.sleep(2)
    ledgers = {db: record(db, e.stop()) for db, e in editors.items()}
    for db, ledger in ledgers.items():
        wait_for(lambda: backlog(c, db) == 0, 30, f"{db} to drain")
        row = check_stream(c, nats_server, db, ledger)
        print(row.line())
    wait_for(lambda: all(r["workers_running"] == 1 and r["unpublished"] == 0 for d, r in databases(c).items() if d in ("a", "b", "c")),
             5, "relay_databases to count each backlog")


def test_drop_database_without_force_while_its_worker_relays(c, nats_server, watcher):
    others = {db: Editors(c, n=1, rate=100, dsn=c.dsn(db)).start() for db in ("a", "c")}
    with c.connect("b") as conn:  # a backlog that keeps b's worker publishing
        conn.execute(f"""SELECT feature_outbox.edit_feature('{LAYER}', 9000000 + g, ST_SetSRID(ST_MakePoint(-90, 30 + g / 1e5), 4326), 'created')
                           FROM generate_series(1, 30000) g""")
    b = wait_for(lambda: (lambda b: b["worker_states"] == ["publishing"] and b["unpublished"] and b)(databases(c)["b"]),
                 10, "b's worker to publish, with a backlog")
    started = time.monotonic()
    with c.connect() as conn:
        conn.execute("DROP DATABASE b")
    took = time.monotonic() - started
    print(f"\nDROP DATABASE b (no FORCE) took {took:.2f} s while b's worker was publishing "
          f"({b['unpublished']} unpublished at {b['unpublished_at']})")
    assert took < 2.0 * WAIT_SCALE, took
    assert "did not leave within" not in c.log()
    time.sleep(1)
    ledgers = {db: record(db, e.stop()) for db, e in others.items()}
    wait_for(lambda: "b" not in databases(c), 5, "b to leave relay_databases")
    for db, ledger in ledgers.items():
        wait_for(lambda: backlog(c, db) == 0, 30, f"{db} to drain")
        check_stream(c, nats_server, db, ledger)
        with c.connect(db) as conn:  # nothing of a's or c's waited out the drop
            late = conn.execute("""SELECT max(extract(epoch FROM published_at - created_at)) FROM feature_outbox.outbox
                                    WHERE created_at >= now() - interval '10 s'""").fetchone()[0]
        print(f"{db}: slowest event around the drop {late:.2f} s")
        assert late < 2.0, (db, late)


def test_rename_and_template_succeed_and_the_databases_are_served_again(c, watcher):
    with c.connect("a") as conn:
        conn.execute(f"SELECT feature_outbox.edit_feature('{LAYER}', 8000000 + g, ST_SetSRID(ST_MakePoint(-80, 30), 4326), 'created') "
                     "FROM generate_series(1, 5000) g")
    with c.connect() as conn:
        started = time.monotonic()
        conn.execute("ALTER DATABASE a RENAME TO a2")
        renamed = time.monotonic() - started
        # A rename keeps the database's own settings (they follow its oid): a2 still publishes on a.> to A.
        started = time.monotonic()
        conn.execute("CREATE DATABASE d TEMPLATE c")
        copied = time.monotonic() - started
    print(f"\nALTER DATABASE RENAME took {renamed:.2f} s, CREATE DATABASE TEMPLATE {copied:.2f} s")
    wait_for(lambda: databases(c).get("a2", {}).get("state") == "relaying", 5, "a2 to be served")
    wait_for(lambda: backlog(c, "a2") == 0, 30, "a2 to drain what a left")
    eid = edit(c, "a2", 42)
    m = wait_for(lambda: delivered(watcher, eid), 2, "a2's edit")
    assert m["headers"][HEADER] == "a2" and m["subject"].startswith("a.")
    assert "a" not in databases(c)
    # d is a copy of c: held until resolve_copy says what it is (issue 38), then served under '*'
    # once its settings say where its events go.
    keep_apart(c, "d")
    wait_for(lambda: databases(c).get("d", {}).get("state") == "held: copy of another database", 5, "d to be held")
    assert "resolve_copy" in databases(c)["d"]["last_error"]
    with c.connect("d") as conn:
        d_id = conn.execute("SELECT feature_outbox.resolve_copy('new')::text").fetchone()[0]
    wait_for(lambda: databases(c).get("d", {}).get("state") == "relaying", 5, "d to be served")
    time.sleep(2)  # the settings restart d's worker within 2 s of the commit
    eid = edit(c, "d", 43)
    m = wait_for(lambda: delivered(watcher, eid), 2, "d's edit")
    assert m["headers"][HEADER] == "d" and m["subject"].startswith("d.") and m["event"]["feature_id"] == "43"
    assert m["event"]["database_id"] == d_id
    eid = edit(c, "c", 44)
    m = wait_for(lambda: delivered(watcher, eid), 2, "c's edit")
    assert m["headers"][HEADER] == "c" and m["subject"].startswith("c.") and m["event"]["database_id"] != d_id


def test_a_per_database_setting_takes_effect_within_2_s(c, watcher):
    with c.connect() as conn:
        conn.execute("ALTER DATABASE d SET feature_outbox.nats_subject_prefix = 'dd'")
        conn.execute("ALTER DATABASE d SET feature_outbox.nats_stream = 'DD'")
    changed = time.monotonic()
    wait_for(lambda: databases(c)["d"]["state"] == "relaying" and databases(c)["d"]["workers_running"] == 1, 2, "d's worker back")
    time.sleep(max(0.0, 2 - (time.monotonic() - changed)))
    eid = edit(c, "d", 45)
    m = wait_for(lambda: delivered(watcher, eid), 2, "d's edit on its new prefix")
    assert m["subject"].startswith("dd.") and m["headers"][HEADER] == "d"


def relay_pid(c: Cluster, db: str) -> int:
    [pid] = relay_pids(c, db)
    return pid


def test_a_refused_command_leaves_the_workers_alone(c, watcher):
    """The hook stops a database's workers only for a command that can succeed: not for a role that
    does not own the database, not in a transaction block, and PREPARE TRANSACTION is refused."""
    pid = relay_pid(c, "c")
    with c.connect() as conn:
        conn.execute("DROP ROLE IF EXISTS intruder")
        conn.execute("CREATE ROLE intruder LOGIN CREATEDB")
    with psycopg.connect(c.dsn().replace("user=postgres", "user=intruder"), autocommit=True) as conn:
        for sql in ("DROP DATABASE c", "ALTER DATABASE c RENAME TO c9", "ALTER DATABASE c SET TABLESPACE pg_default"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(sql)
    assert relay_pid(c, "c") == pid, "a refused command stopped c's worker"
    with c.connect() as conn:
        with pytest.raises(psycopg.errors.ActiveSqlTransaction):
            with conn.transaction():
                conn.execute("DROP DATABASE c")
        assert relay_pid(c, "c") == pid, "DROP DATABASE in a transaction block stopped c's worker"
        conn.autocommit = False
        conn.execute("ALTER DATABASE c RENAME TO c9")  # stops c's workers, in a transaction that then fails
        with pytest.raises(psycopg.errors.FeatureNotSupported):
            conn.execute("PREPARE TRANSACTION 'rename'")
        conn.rollback()
        conn.autocommit = True
        conn.execute("DROP ROLE intruder")
    wait_for(lambda: databases(c)["c"]["state"] == "relaying" and databases(c)["c"]["workers_running"] == 1, 5, "c served again")
    assert "c9" not in databases(c)
    eid = edit(c, "c", 47)
    assert wait_for(lambda: delivered(watcher, eid), 2, "c's edit")["headers"][HEADER] == "c"
    assert pid != relay_pid(c, "c"), "the rename in the transaction did stop the workers (and they came back)"


def test_relay_databases_is_for_monitoring_roles(c):
    with c.connect() as conn:
        conn.execute("DROP ROLE IF EXISTS watcher")
        conn.execute("DROP ROLE IF EXISTS nobody")
        conn.execute("CREATE ROLE watcher LOGIN IN ROLE pg_monitor")
        conn.execute("CREATE ROLE nobody LOGIN")
    try:
        with psycopg.connect(c.dsn("c").replace("user=postgres", "user=watcher"), autocommit=True) as conn:
            rows = {r[0]: r[1:] for r in conn.execute(
                "SELECT database, state, relay_workers, workers_running, last_error FROM feature_outbox.relay_databases")}
        for db in ("a2", "c", "d"):
            assert rows[db] == ("relaying", 1, 1, None), (db, rows[db])
        assert rows["postgres"][0] == "no extension"
        with psycopg.connect(c.dsn("c").replace("user=postgres", "user=nobody"), autocommit=True) as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT * FROM feature_outbox.relay_databases")
        with c.connect("d") as conn:
            text = conn.execute("SELECT feature_outbox.metrics()").fetchone()[0]
        assert 'outbox_relay_workers_running{database="d"} 1' in text
    finally:
        with c.connect() as conn:
            conn.execute("DROP ROLE watcher")
            conn.execute("DROP ROLE nobody")


def test_a_database_at_0_2_0_waits_while_the_others_relay(c, nats_server, watcher):
    c.create_db("e")
    keep_apart(c, "e")
    with c.connect("e") as conn:
        conn.execute("CREATE EXTENSION feature_outbox VERSION '0.2.0' CASCADE")
        conn.execute("SELECT feature_outbox.edit_feature(7, '{\"type\":\"Point\",\"coordinates\":[1,2]}'::text, 'created')")
    wait_for(lambda: databases(c).get("e", {}).get("state") == "waiting for ALTER EXTENSION UPDATE", 5, "e to wait")
    assert databases(c)["c"]["state"] == "relaying"
    eid = edit(c, "c", 46)
    assert wait_for(lambda: delivered(watcher, eid), 2, "c relays meanwhile")
    assert backlog(c, "e") == 1
    with c.connect("e") as conn:
        conn.execute("ALTER EXTENSION feature_outbox UPDATE")
    wait_for(lambda: backlog(c, "e") == 0, 5, "e to relay after its update")
    [m] = nats_server.messages("E")
    assert m["headers"][HEADER] == "e" and m["event"]["feature_id"] == "7"


def test_too_few_worker_processes_name_the_unserved_database_until_raised(nats_server, watcher):
    # 4 processes: the logical replication launcher, the feature_outbox launcher and two relay
    # workers, for three databases with the extension.
    c = Cluster(RUN_DIR / "databases_few", free_port())
    c.start(*SETTINGS, "max_worker_processes = 4", f"feature_outbox.endpoint = '{nats_server.url}'")
    try:
        for db in ("x", "y", "z"):
            c.create_db(db)
            keep_apart(c, db, f"few{db}")
            install(c, db)

        def unserved():
            rows = databases(c, "x")
            left = [d for d in "xyz" if rows.get(d, {}).get("state") == "no worker slot"]
            ok = len(left) == 1 and all(rows[d]["state"] == "relaying" for d in "xyz" if d not in left)
            return ok and left[0]
        name = wait_for(unserved, 15, "two databases served and one named unserved")
        error = databases(c, "x")[name]["last_error"]
        assert f'could not start relay worker 0 of database "{name}"' in error and "max_worker_processes = 4" in error, error
        assert f'WARNING:  feature_outbox launcher: could not start relay worker 0 of database "{name}"' in c.log()
        with c.connect(name) as conn:
            assert conn.execute("SELECT relay_last_error FROM feature_outbox.backlog").fetchone()[0] == error
        with c.connect() as conn:
            conn.execute("ALTER SYSTEM SET max_worker_processes = 8")
        c.restart()
        wait_for(lambda: all(databases(c, "x").get(d, {}).get("state") == "relaying" for d in "xyz"), 15, "all three served")
        eid = edit(c, name, 1)
        m = wait_for(lambda: delivered(watcher, eid), 5, "the once unserved database relays")
        assert m["subject"].startswith(f"few{name}.") and m["headers"][HEADER] == name
        assert all(r["last_error"] is None for d, r in databases(c, "x").items() if d in "xyz")
    finally:
        c.stop()
