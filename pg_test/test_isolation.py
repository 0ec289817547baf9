"""Lock interleavings, tested as PostgreSQL tests its own: isolation specs run by pg_isolation_regress
(PostgreSQL's src/test/isolation, as pgmq's specs are). pg_test/specs/NAME.spec declares its setup,
its sessions and their steps, and the permutations to run; isolationtester runs each permutation's
steps in that order, each in its session's own connection, shows a step that blocks as <waiting ...>
and where it completes, and its output must equal pg_test/specs/expected/NAME.out.

Each spec runs in a fresh database with the extension, in a cluster of its own with no relay worker
(feature_outbox.relay_workers = 0), so nothing but the spec's sessions takes a lock. Set
UPDATE_EXPECTED=1 to write the expected files after reviewing a change."""

import os
import shutil
import subprocess
from pathlib import Path

import psycopg
import pytest

from conftest import PG_BIN, RUN_DIR, Cluster, free_port

HERE = Path(__file__).parent
SPECS = HERE / "specs"
NAMES = sorted(p.stem for p in SPECS.glob("*.spec"))
# Debian's postgresql-client-N ships the driver in the major's PGXS tree, isolationtester beside it.
REGRESS = PG_BIN.parent / "lib/pgxs/src/test/isolation/pg_isolation_regress"
OUT = RUN_DIR / "isolation_results"
# How long isolationtester lets a step wait before it cancels it (PostgreSQL's default is 300 s): a
# step blocked for good fails in seconds, its output showing where.
STEP_TIMEOUT_S = 30
# Specs that call a C function of the test build (cargo feature fault-injection) that the spec
# declares itself: its symbol. Such a spec is skipped, saying why, while the installed library does
# not export it.
NEEDS = {"relay-claim": "_test_claim_wrapper"}


def exports(conn: psycopg.Connection, symbol: str) -> bool:
    try:
        with conn.transaction(force_rollback=True):
            conn.execute(f"CREATE FUNCTION pg_temp.probe() RETURNS void LANGUAGE c AS 'feature_outbox', '{symbol}'")
        return True
    except psycopg.errors.UndefinedFunction:
        return False


@pytest.fixture(scope="module")
def spec_cluster():
    c = Cluster(RUN_DIR / "isolation", free_port())
    c.start("feature_outbox.relay_workers = 0")
    yield c
    c.stop()


@pytest.mark.parametrize("name", NAMES)
def test_isolation(spec_cluster, name):
    assert REGRESS.exists(), f"{REGRESS} is missing: it comes with postgresql-client-{PG_BIN.parent.name}"
    db = f"isolation_{name.replace('-', '_')}"
    spec_cluster.create_db(db)
    with spec_cluster.connect(db) as conn:
        conn.execute("SET client_min_messages = warning")
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        if name in NEEDS and not exports(conn, NEEDS[name]):
            pytest.skip(f"the installed feature_outbox exports no {NEEDS[name]} (a test build with the relay's claim entry point)")
    # pg_isolation_regress reads INPUTDIR/specs/NAME.spec and INPUTDIR/expected/NAME.out, and writes
    # OUTPUTDIR/results/NAME.out and OUTPUTDIR/regression.diffs: an input directory of two links
    # keeps the expected files beside the specs.
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    (out / "input").mkdir(parents=True)
    (out / "input" / "specs").symlink_to(SPECS.resolve())
    (out / "input" / "expected").symlink_to((SPECS / "expected").resolve())
    expected = SPECS / "expected" / f"{name}.out"
    run = subprocess.run([REGRESS, f"--bindir={PG_BIN}", f"--inputdir={out / 'input'}", f"--outputdir={out}",
                          "--host=127.0.0.1", f"--port={spec_cluster.port}", "--user=postgres", "--use-existing",
                          f"--dbname={db}", name],
                         env={**os.environ, "PGISOLATIONTIMEOUT": str(STEP_TIMEOUT_S)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=10 * STEP_TIMEOUT_S)
    result = out / "results" / f"{name}.out"
    if os.environ.get("UPDATE_EXPECTED") == "1" and result.exists():
        shutil.copyfile(result, expected)
        return
    if run.returncode != 0:
        diffs = out / "regression.diffs"
        detail = diffs.read_text(errors="replace") if diffs.exists() else ""
        if not expected.exists():
            detail += f"\nno {expected.relative_to(HERE.parent)}: review results/{name}.out, then UPDATE_EXPECTED=1 writes it"
        pytest.fail(f"pg_isolation_regress {name} failed (exit {run.returncode}):\n{run.stdout}\n{detail}", pytrace=False)
