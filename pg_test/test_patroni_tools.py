"""The Patroni drills' tools in the tool cache (scripts/tools.sh): Debian 12's etcd-server 3.4 and
patroni 3.0, and PyPI's Patroni 4.1.5 in a virtualenv stamped like the cargo-built tools. The venv is
used only while its stamp names today's recipe (the requirements file, the interpreter, the pip
command line) and `pip freeze` of the venv is what the stamp recorded: a package added by hand, a
stamp of another recipe or an interrupted install (no stamp) is made again."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, RUN_DIR, tools

TOOLS_SH = ROOT / "scripts" / "tools.sh"


def run(cache: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(TOOLS_SH), *args], env={**os.environ, "FEATURE_OUTBOX_TOOLS": str(cache)},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def status(cache: Path, tool: str = "patroni4") -> str:
    out = run(cache, "status", tool)
    assert out.returncode == 0, out.stderr
    name, _, state = out.stdout.strip().partition(" ")
    assert name == tool
    return state


@pytest.fixture
def cache() -> Path:
    """A cache of the test's own holding a copy of the machine's stamped venv. A venv's bin/python
    finds its packages through the pyvenv.cfg beside it, so the copy answers `pip freeze` as the
    original does."""
    venv = Path(tools("patroni4")["patroni4"]).parents[1]
    c = RUN_DIR / "tool_cache_patroni"
    shutil.rmtree(c, ignore_errors=True)
    shutil.copytree(venv, c / venv.name, symlinks=True)
    return c


def test_debian_tools_are_debian_12s():
    paths = tools("etcd", "patroni")
    etcd = subprocess.run([paths["etcd"], "--version"], stdout=subprocess.PIPE, text=True, check=True).stdout
    patroni = subprocess.run([paths["patroni"], "--version"], stdout=subprocess.PIPE, text=True, check=True).stdout
    assert "etcd Version: 3.4." in etcd and patroni.startswith("patroni 3.0."), (etcd, patroni)
    assert status(Path("/nonexistent"), "etcd") == "fresh" and status(Path("/nonexistent"), "patroni") == "fresh"


def test_the_stamped_venv_is_used(cache):
    assert status(cache) == "fresh"
    venv = next(cache.iterdir())
    version = subprocess.run([venv / "bin" / "python", "-c", "import patroni.version as v; print(v.__version__)"],
                             stdout=subprocess.PIPE, text=True, check=True).stdout
    assert version.strip() == "4.1.5"


def test_an_empty_cache_is_missing(tmp_path):
    assert status(tmp_path) == "missing"


def test_a_package_added_by_hand_is_stale(cache):
    [site] = next(cache.iterdir()).glob("lib/python3*/site-packages")
    info = site / "added_by_hand-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: added-by-hand\nVersion: 1.0\n")
    assert "holds other packages than the stamp recorded" in status(cache)


def test_a_stamp_of_another_recipe_is_stale(cache):
    stamp = next(cache.iterdir()) / "STAMP"
    stamp.write_text("".join(("recipe=" + "0" * 64 + "\n") if line.startswith("recipe=") else line
                             for line in stamp.read_text().splitlines(keepends=True)))
    assert status(cache).startswith(f"stale: stamp has recipe={'0' * 64}")


def test_an_interrupted_install_is_made_again(cache):
    venv = next(cache.iterdir())
    (venv / "STAMP").unlink()
    assert "has no stamp" in status(cache)
    out = run(cache, "patroni4")
    assert out.returncode == 0, out.stderr
    assert "installing pg_test/patroni-requirements.txt from PyPI" in out.stderr, out.stderr
    assert out.stdout.strip() == f"patroni4={venv}/bin/patroni"
    assert status(cache) == "fresh"
