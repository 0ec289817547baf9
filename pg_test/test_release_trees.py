"""The last release's tree that make bench compares against (bench/ab_setup.sh), cached like the tool
cache: a tree is used only when the STAMP in it, written by ab_setup.sh after its own build, names
today's commit, features and recipe hash and the library's own sha256. A tree put there by hand, a
stamp of another commit or recipe, or a library swapped after stamping is rebuilt. The rebuild runs
into trees of the test's own and shares the commit's sources and cargo's build directory with the
machine's, so it packages again without compiling the release anew.

make bench builds the tree and then runs this file (bench/run.sh), before it takes any figure. In
make test it runs where that tree is fresh already: compiling a release from scratch would add 10
minutes or more to a test run on a new machine, for a cache only make bench uses."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import PG_MAJOR, ROOT, RUN_DIR

AB_SETUP = ROOT / "bench" / "ab_setup.sh"
REAL_TREES = Path(os.environ.get("FEATURE_OUTBOX_AB_TREES", ROOT / "target" / "ab"))
REAL_BUILD = Path(os.environ.get("FEATURE_OUTBOX_AB_BUILD", REAL_TREES / "build"))
LAST, COMMIT = subprocess.run(["bash", ROOT / "scripts" / "releases.sh", "last"], check=True, stdout=subprocess.PIPE,
                              text=True).stdout.split()
TREE = f"pg{PG_MAJOR}-{COMMIT[:12]}"


def run(trees: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FEATURE_OUTBOX_AB_TREES": str(trees), "FEATURE_OUTBOX_AB_BUILD": str(REAL_BUILD)}
    return subprocess.run(["bash", str(AB_SETUP), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def status(trees: Path) -> str:
    out = run(trees, "status", "last")
    assert out.returncode == 0, out.stderr
    label, commit, state = out.stdout.strip().split(" ", 2)
    assert (label, commit) == (LAST, COMMIT[:12])
    return state


@pytest.fixture(scope="module")
def real_tree() -> Path:
    """The machine's own tree of the last release, as make bench built it (bench/ab_setup.sh);
    skipped where there is none, or a stale one (FEATURE_OUTBOX_RELEASE_TREE_BUILD=1 builds it)."""
    env = {**os.environ, "FEATURE_OUTBOX_AB_TREES": str(REAL_TREES), "FEATURE_OUTBOX_AB_BUILD": str(REAL_BUILD)}
    if os.environ.get("FEATURE_OUTBOX_RELEASE_TREE_BUILD") != "1":
        state = status(REAL_TREES)
        if state != "fresh":
            pytest.skip(f"the last release's tree is {state}: make bench builds it (bench/ab_setup.sh last)")
    out = subprocess.run(["bash", str(AB_SETUP), "last"], check=True, stdout=subprocess.PIPE, text=True, env=env)
    return Path(out.stdout.strip()).parents[4]


@pytest.fixture
def trees(real_tree: Path) -> Path:
    """Trees of the test's own holding a copy of the machine's stamped tree."""
    t = RUN_DIR / "release_trees"
    shutil.rmtree(t, ignore_errors=True)
    t.mkdir(parents=True)
    shutil.copytree(real_tree, t / TREE, symlinks=True)
    return t


def library(trees: Path) -> Path:
    return trees / TREE / "usr" / "lib" / "postgresql" / str(PG_MAJOR) / "lib" / "feature_outbox.so"


def edit_stamp(trees: Path, key: str, value: str) -> None:
    stamp = trees / TREE / "STAMP"
    lines = [f"{key}={value}" if line.startswith(key + "=") else line for line in stamp.read_text().splitlines()]
    stamp.write_text("\n".join(lines) + "\n")


def test_a_stamped_tree_is_used_as_it_is(trees):
    assert status(trees) == "fresh"
    before = library(trees).stat().st_mtime_ns
    out = run(trees, "last")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(trees / TREE / "usr" / "lib" / "postgresql" / str(PG_MAJOR) / "bin")
    assert f"{LAST} ({COMMIT[:12]}): fresh" in out.stderr and "building" not in out.stderr
    assert library(trees).stat().st_mtime_ns == before


def test_no_tree_is_missing(tmp_path):
    assert status(tmp_path) == "missing"


def test_a_tree_without_a_stamp_is_rebuilt(trees):
    (trees / TREE / "STAMP").unlink()
    library(trees).write_bytes(b"not a library")
    assert status(trees).startswith("stale: ") and "has no stamp" in status(trees)

    out = run(trees, "last")
    assert out.returncode == 0, out.stderr
    assert "has no stamp" in out.stderr and "building it into" in out.stderr, out.stderr
    assert status(trees) == "fresh"
    assert library(trees).read_bytes()[:4] == b"\x7fELF"
    control = trees / TREE / "usr" / "share" / "postgresql" / str(PG_MAJOR) / "extension" / "feature_outbox.control"
    assert f"default_version = '{LAST}'" in control.read_text()
    assert not (trees / f"{TREE}.new").exists()


def test_a_stamp_of_another_commit_is_stale(trees):
    edit_stamp(trees, "commit", "0" * 40)
    assert status(trees) == f"stale: stamp has commit={'0' * 40}, today's recipe commit={COMMIT}"


def test_a_stamp_of_other_features_is_stale(trees):
    edit_stamp(trees, "features", "")
    assert status(trees) == "stale: stamp has features=, today's recipe features=fault-injection"


def test_a_stamp_of_an_older_recipe_is_stale(trees):
    edit_stamp(trees, "recipe", "0" * 64)
    assert status(trees).startswith(f"stale: stamp has recipe={'0' * 64}, today's recipe recipe=")


def test_a_library_swapped_after_stamping_is_stale(trees):
    lib = library(trees)
    lib.write_bytes(lib.read_bytes() + b"\0")
    assert "is not the library the stamp recorded" in status(trees)


def test_a_reference_that_is_no_release_nor_commit_is_refused(tmp_path):
    out = run(tmp_path, "status", "9.9.9")
    assert out.returncode != 0 and "9.9.9 is not a release in" in out.stderr
    out = run(tmp_path, "status", "no-such-ref")
    assert out.returncode != 0 and "no-such-ref is neither a release in sql/released/RELEASES nor a commit" in out.stderr
