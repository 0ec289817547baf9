"""SQL regression tests, as PostgreSQL extensions keep them: pg_test/sql/NAME.sql is run by psql
in a fresh database and its output must equal pg_test/expected/NAME.out.
Set UPDATE_EXPECTED=1 to write the expected files after reviewing a change."""

import difflib
import os
from pathlib import Path

import pytest

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
    expected_file = HERE / "expected" / f"{name}.out"
    if os.environ.get("UPDATE_EXPECTED") == "1":
        expected_file.write_text(actual)
    expected = expected_file.read_text() if expected_file.exists() else ""
    if actual != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                            f"expected/{name}.out", f"actual/{name}.out"))
        pytest.fail(f"output differs from expected/{name}.out:\n{diff}", pytrace=False)
