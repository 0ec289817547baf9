"""SQL regression tests, as PostgreSQL extensions keep them: pg_test/sql/NAME.sql is run by psql
in a fresh database and its output must equal pg_test/expected/NAME.out, or on PostgreSQL N other
than 15, pg_test/expected/NAME.pgN.out where that major (or its PostGIS) words the same outcome
otherwise. Set UPDATE_EXPECTED=1 to write the expected files after reviewing a change (on another
major, only the .pgN.out files that differ from NAME.out)."""

import difflib
import os
from pathlib import Path

import pytest

from conftest import PG_MAJOR

HERE = Path(__file__).parent
CASES = sorted(p.stem for p in (HERE / "sql").glob("*.sql"))


@pytest.mark.parametrize("name", CASES)
def test_regression(cluster, name):
    db = f"regress_{name}"
    cluster.create_db(db)
    setup = cluster.psql(db, "-q", "-v", "ON_ERROR_STOP=1", "-f", str(HERE / "helpers.sql"))
    assert "ERROR" not in setup, setup
    sql = (HERE / "sql" / f"{name}.sql").read_text()
    actual = cluster.psql(db, "-a", "-q", stdin=sql)
    base = HERE / "expected" / f"{name}.out"
    own = HERE / "expected" / f"{name}.pg{PG_MAJOR}.out"
    if os.environ.get("UPDATE_EXPECTED") == "1":
        if PG_MAJOR == 15 or not base.exists():
            base.write_text(actual)
        elif actual != base.read_text():
            own.write_text(actual)
        else:
            own.unlink(missing_ok=True)
    expected_file = own if PG_MAJOR != 15 and own.exists() else base
    expected = expected_file.read_text() if expected_file.exists() else ""
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            f"expected/{expected_file.name}", f"actual/{name}.out"))
        pytest.fail(f"output differs from expected/{expected_file.name}:\n{diff}", pytrace=False)
