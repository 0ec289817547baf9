"""Releases upgrade in place. For every frozen release V (sql/feature_outbox--V.sql): a database
created at V and holding data is upgraded with ALTER EXTENSION UPDATE, compared object by object
with a fresh CREATE EXTENSION of the current release, keeps every row, and is then relayed. The
relay worker, running the new library all along, waits while the schema is at V.

Also guarded here: every C symbol a frozen script declares is still exported; released scripts
(sql/released/) are never edited, by their checksums; every release listed in sql/released/RELEASES
has its frozen install script; every frozen release has an upgrade path to the current one."""

import difflib
import hashlib
import re
import subprocess
import tomllib
from collections import Counter

import pytest

from catalog import snapshot
from conftest import PG_BIN, ROOT, RUN_DIR, Cluster, free_port
from relay_harness import NatsServer, wait_for

SQL = ROOT / "sql" / "released"
CURRENT = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
FULL_SCRIPT = re.compile(r"^feature_outbox--([^-]+)\.sql$")
FROZEN = sorted((m[1] for p in SQL.glob("feature_outbox--*.sql") if (m := FULL_SCRIPT.match(p.name))),
                key=lambda v: tuple(map(int, v.split("."))))
OLDER = [v for v in FROZEN if v != CURRENT]
WAITING = "waiting for ALTER EXTENSION UPDATE"
DB = "upgraded"

# Written through the oldest public API, which every release keeps: edit_feature(bigint, text, text).
EDITS = [
    (1, '{"type":"Point","coordinates":[13.4,52.5]}', "created"),
    (2, '{"type":"Polygon","coordinates":[[[178,51],[-179,51],[-179,52],[178,52],[178,51]]]}', "created"),
    (3, '{"type":"LineString","coordinates":[[-122.42,37.77],[-122.27,37.80]]}', "created"),
    (4, '{"type":"Point","coordinates":[-74.0,40.7]}', "created"),
    (1, '{"type":"Point","coordinates":[2.35,48.86]}', "moved"),
    (3, None, "retired"),
    (4, '{"type":"Point","coordinates":[-74.1,40.8]}', "moved"),
    (5, '{"type":"Point","coordinates":[151.2,-33.9]}', "created"),
]
# What an event is; relay bookkeeping (published_at, attempts, ...) is compared for the rows the relay
# must not touch.
EVENT_COLUMNS = ("id, event_id, feature_id, feature_version, event_type, routing_key, previous_routing_key, "
                 "schema_version, created_at")
# Every column an outbox row had at 0.1.0, bookkeeping included.
ROW_COLUMNS = (EVENT_COLUMNS + ", published_at, attempts, row_failures, last_error, last_attempt_at, "
               "next_attempt_at, parked_at")
FEATURES = "SELECT id, ST_AsEWKB(geom), version, created_at, updated_at, retired_at FROM feature_outbox.features ORDER BY id"


def pg_config(flag: str) -> str:
    return subprocess.run([PG_BIN / "pg_config", flag], capture_output=True, text=True, check=True).stdout.strip()


def sql_text(script: str) -> list[str]:
    """A generated script without pgrx's bookkeeping: its source-location comments (column 0), the
    object-group markers and blank lines. Test builds add a comment for each `sql = false` function."""
    return [l for l in script.splitlines() if l.strip() and not l.startswith("--") and not l.startswith("/* <")]


def symbols_declared(script: str) -> set[str]:
    return set(re.findall(r"AS 'MODULE_PATHNAME', '(\w+)'", script))


@pytest.fixture
def nats_server():
    # One per upgraded release: each test asserts what its own relay sent, from an empty stream.
    server = NatsServer(RUN_DIR / "nats-upgrade")
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("version", OLDER)
def test_upgrade_equals_fresh_install_and_keeps_and_relays_every_row(version, nats_server):
    c = Cluster(RUN_DIR / f"upgrade-{version}", free_port())
    c.start(f"feature_outbox.database = '{DB}'", "feature_outbox.poll_interval = '60s'",
            f"feature_outbox.endpoint = '{nats_server.url}'")
    try:
        c.create_db(DB)
        with c.connect(DB) as conn:
            # The current library serves the old release's SQL, which binds it by symbol.
            conn.execute(f"CREATE EXTENSION feature_outbox VERSION '{version}' CASCADE")
            for edit in EDITS:
                conn.execute("SELECT feature_outbox.edit_feature(%s, %s::text, %s)", edit)
            ids = [r[0] for r in conn.execute("SELECT id FROM feature_outbox.outbox ORDER BY id")]
            published, parked, pending = ids[:3], ids[3], ids[4:]
            conn.execute("UPDATE feature_outbox.outbox SET published_at = now() - interval '1 minute' WHERE id = ANY(%s)",
                         (published,))
            conn.execute("""UPDATE feature_outbox.outbox SET attempts = 3, row_failures = 3, last_error = 'HTTP 400',
                                   last_attempt_at = now(), parked_at = now() WHERE id = %s""", (parked,))
            # The old schema's views and functions work on the new library.
            assert conn.execute("SELECT unpublished_rows, parked_rows FROM feature_outbox.backlog").fetchone() == (len(pending) + 1, 1)
            # 0.3.0 labels each series with its database.
            assert re.search(r"^outbox_parked_rows(\{[^}]*\})? 1$", conn.execute("SELECT feature_outbox.metrics()").fetchone()[0], re.M)

            # The worker runs the new library against the old schema: it waits, visibly, and logs it once.
            wait_for(lambda: conn.execute("SELECT state FROM feature_outbox.workers").fetchall() == [(WAITING,)],
                     30, "the worker to wait for the update")
            [(error,)] = conn.execute("SELECT relay_last_error FROM feature_outbox.backlog").fetchall()
            assert f"schema is at version {version} and the library at {CURRENT}" in error
            before_features = conn.execute(FEATURES).fetchall()
            before_events = conn.execute(f"SELECT {EVENT_COLUMNS} FROM feature_outbox.outbox ORDER BY id").fetchall()
            untouched = conn.execute(f"SELECT {ROW_COLUMNS} FROM feature_outbox.outbox WHERE id <> ALL(%s) ORDER BY id",
                                     (pending,)).fetchall()
        marker = f"schema is at version {version} and the library at {CURRENT}; waiting for ALTER EXTENSION"
        assert c.log().count(marker) == 1, "logged once, not once per wake-up"
        assert nats_server.messages() == [], "nothing relayed from the old schema"

        c.create_db("fresh")
        with c.connect("fresh") as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
            fresh = snapshot(conn)
        with c.connect(DB) as conn:
            conn.execute("ALTER EXTENSION feature_outbox UPDATE")
            upgraded = snapshot(conn)
        diff = "".join(difflib.unified_diff([l + "\n" for l in fresh], [l + "\n" for l in upgraded],
                                            f"fresh {CURRENT}", f"upgraded from {version}"))
        assert not diff, f"the upgraded schema differs from a fresh install:\n{diff}"
        assert any(l.startswith(f"extension feature_outbox: version {CURRENT} ") for l in upgraded)

        with c.connect(DB) as conn:
            # The update's commit woke the worker: 60 s poll interval, yet relayed within seconds.
            wait_for(lambda: not conn.execute("SELECT 1 FROM feature_outbox.outbox WHERE id = ANY(%s) "
                                              "AND published_at IS NULL", (pending,)).fetchall(),
                     15, "the pending rows to be relayed after the update")
            assert conn.execute(FEATURES).fetchall() == before_features
            assert conn.execute(f"SELECT {EVENT_COLUMNS} FROM feature_outbox.outbox ORDER BY id").fetchall() == before_events
            assert conn.execute(f"SELECT {ROW_COLUMNS} FROM feature_outbox.outbox WHERE id <> ALL(%s) ORDER BY id",
                                (pending,)).fetchall() == untouched
            # Rows written before 0.2.0 are the built-in layer's; every row from before 0.5.0 the application's.
            assert conn.execute("SELECT DISTINCT layer FROM feature_outbox.outbox").fetchall() == [("features",)]
            assert conn.execute("SELECT origin, count(*) FROM feature_outbox.outbox GROUP BY origin").fetchall() == [
                ("application", len(ids))]
            # The outbox sequence continues above the old ids.
            conn.execute("SELECT feature_outbox.edit_feature(6, '{\"type\":\"Point\",\"coordinates\":[0,1]}', 'created')")
            [(new_id,)] = conn.execute("SELECT id FROM feature_outbox.outbox WHERE feature_id = 6").fetchall()
            assert new_id > max(ids)
            wait_for(lambda: conn.execute("SELECT published_at IS NOT NULL FROM feature_outbox.outbox WHERE id = %s",
                                          (new_id,)).fetchone()[0], 10, "the first edit after the update to be relayed")
            assert conn.execute("SELECT state FROM feature_outbox.workers").fetchall() == [("idle",)]
            event_ids = {r[0]: str(r[1]) for r in conn.execute("SELECT id, event_id FROM feature_outbox.outbox")}
        messages = nats_server.messages()
        delivered = Counter(m["event"]["event_id"] for m in messages)
        # Each pending row exactly once; rows published before, and the parked one, never.
        assert delivered == Counter({event_ids[i]: 1 for i in pending} | {event_ids[new_id]: 1})
        # The rows that waited through the update, and the first edit after it, say where they came from.
        assert {(m["event"]["origin"], m["headers"]["Feature-Origin"]) for m in messages} == {("application", "application")}
    finally:
        c.stop()


def test_every_frozen_release_has_an_upgrade_path_to_the_current_one(cluster):
    assert "0.1.0" in FROZEN
    with cluster.connect() as conn:
        available = {r[0] for r in conn.execute(
            "SELECT version FROM pg_available_extension_versions WHERE name = 'feature_outbox'")}
        paths = dict(conn.execute("SELECT source, path FROM pg_extension_update_paths('feature_outbox') "
                                  "WHERE target = %s", (CURRENT,)).fetchall())
    assert set(FROZEN) | {CURRENT} <= available, "a frozen install script is not installed"
    missing = [v for v in OLDER if paths.get(v) is None]
    assert not missing, f"no upgrade path to {CURRENT} from {missing}: add sql/feature_outbox--A--B.sql"


def test_every_symbol_a_frozen_script_declares_is_exported():
    library = f"{pg_config('--pkglibdir')}/feature_outbox.so"
    nm = subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in nm.splitlines()}
    for version in FROZEN:
        declared = symbols_declared((SQL / f"feature_outbox--{version}.sql").read_text())
        assert declared, f"no C functions found in the {version} script"
        missing = sorted(s for s in declared if s not in exported or f"pg_finfo_{s}" not in exported)
        assert not missing, f"{library} no longer exports what release {version} binds: {missing}"


def test_released_scripts_are_never_edited():
    """A released script is frozen: sql/released/SHA256SUMS covers each one, and each release listed in
    RELEASES has its install script there. The open release has none: its scripts are generated."""
    sums = dict(reversed(line.split()) for line in (SQL / "SHA256SUMS").read_text().splitlines() if line.strip())
    scripts = {p.name for p in SQL.glob("feature_outbox--*.sql")}
    assert set(sums) == scripts, f"SHA256SUMS and sql/released/ disagree: {sorted(set(sums) ^ scripts)}"
    for name, digest in sums.items():
        actual = hashlib.sha256((SQL / name).read_bytes()).hexdigest()
        assert actual == digest, f"sql/released/{name} was edited after its release"
    releases = [line.split()[0] for line in (SQL / "RELEASES").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert releases == FROZEN, f"RELEASES lists {releases}, sql/released/ has install scripts of {FROZEN}"
    assert CURRENT not in FROZEN, f"{CURRENT} is released: bump the version in Cargo.toml"


def test_the_open_release_upgrade_script_is_generated_from_its_migration():
    """The installed upgrade script into the current release starts with its migration file and holds
    the install script's functions as CREATE OR REPLACE (scripts/upgrade_script.py)."""
    extension = pg_config("--sharedir") + "/extension"
    [migration] = (ROOT / "sql" / "updates").glob(f"*--{CURRENT}.sql")
    source = migration.name.split("--")[0]
    generated = open(f"{extension}/feature_outbox--{source}--{CURRENT}.sql").read()
    assert migration.read_text().rstrip() in generated
    install = open(f"{extension}/feature_outbox--{CURRENT}.sql").read()
    assert symbols_declared(generated) == symbols_declared(install)
    assert not re.search(r"^CREATE\s+(FUNCTION|VIEW|PROCEDURE)\b", generated, re.M), \
        "every object of the upgrade script is created or replaced"
