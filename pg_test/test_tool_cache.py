"""The tool cache keyed by its recipe (scripts/tools.sh): a binary in the cache is used only when the
stamp beside it, written by tools.sh after its own build, names today's tool, version, features and
recipe hash and the binary's own sha256. A binary put there by hand, a stamp of another version or
recipe, or a binary swapped after stamping is rebuilt. The rebuild runs in a cache of its own and
shares cargo's build directory with the machine's, so it relinks in seconds; cargo's fingerprints,
not the stamp, decide what of that is reused."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, RUN_DIR, tools

TOOLS_SH = ROOT / "scripts" / "tools.sh"
REAL_CACHE = Path(os.environ.get("FEATURE_OUTBOX_TOOLS", Path.home() / ".cache" / "feature_outbox"))
REAL_BUILD = Path(os.environ.get("FEATURE_OUTBOX_TOOLS_BUILD", REAL_CACHE / ".build"))
TOOL = "tansu"


def run(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "FEATURE_OUTBOX_TOOLS": str(cache), "FEATURE_OUTBOX_TOOLS_BUILD": str(REAL_BUILD)}
    return subprocess.run(["bash", str(TOOLS_SH), *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def status(cache: Path) -> str:
    out = run(cache, "status", TOOL)
    assert out.returncode == 0, out.stderr
    name, _, state = out.stdout.strip().partition(" ")
    assert name == TOOL
    return state


@pytest.fixture
def real_tool() -> Path:
    """The machine's own build of the tool: its folder (bin/ and STAMP)."""
    return Path(tools(TOOL)[TOOL]).parents[1]


@pytest.fixture
def cache(real_tool: Path) -> Path:
    """A cache of the test's own holding a copy of the machine's stamped build."""
    c = RUN_DIR / "tool_cache"
    shutil.rmtree(c, ignore_errors=True)
    shutil.copytree(real_tool, c / real_tool.name, symlinks=True)
    return c


def test_a_stamped_build_is_used(cache):
    assert status(cache) == "fresh"


def test_an_empty_cache_is_missing(tmp_path):
    assert status(tmp_path) == "missing"


def test_a_hand_made_binary_is_rebuilt(cache, real_tool):
    folder = cache / real_tool.name
    (folder / "STAMP").unlink()
    binary = folder / "bin" / TOOL
    binary.write_text("#!/bin/sh\necho 'tansu 0.6.0 (made by hand)'\n")
    assert status(cache).startswith("stale: ") and "has no stamp" in status(cache)

    out = run(cache, TOOL)
    assert out.returncode == 0, out.stderr
    assert "has no stamp" in out.stderr and "building from crates.io" in out.stderr, out.stderr
    assert out.stdout.strip() == f"{TOOL}={binary}"
    assert status(cache) == "fresh"
    version = subprocess.run([binary, "--version"], stdout=subprocess.PIPE, text=True, check=True).stdout
    assert "0.6.0" in version and "by hand" not in version
    # The rebuilt binary is the machine's own build, relinked from the same cargo build directory.
    assert (binary.read_bytes() == (real_tool / "bin" / TOOL).read_bytes())


def edit_stamp(cache: Path, key: str, value: str) -> None:
    [folder] = [p for p in cache.iterdir() if p.name.startswith(TOOL + "-")]
    stamp = folder / "STAMP"
    lines = [f"{key}={value}" if line.startswith(key + "=") else line for line in stamp.read_text().splitlines()]
    stamp.write_text("\n".join(lines) + "\n")


def test_a_stamp_of_another_version_is_stale(cache):
    edit_stamp(cache, "version", "0.5.0")
    assert status(cache) == "stale: stamp has version=0.5.0, today's recipe version=0.6.0"


def test_a_stamp_of_other_features_is_stale(cache):
    edit_stamp(cache, "features", "")
    assert status(cache).startswith("stale: stamp has features=, today's recipe features=libsql")


def test_a_stamp_of_an_older_recipe_is_stale(cache):
    edit_stamp(cache, "recipe", "0" * 64)
    assert status(cache).startswith(f"stale: stamp has recipe={'0' * 64}")


def test_a_binary_swapped_after_stamping_is_stale(cache, real_tool):
    binary = cache / real_tool.name / "bin" / TOOL
    binary.write_bytes(binary.read_bytes() + b"\0")
    assert "is not the binary the stamp recorded" in status(cache)


def test_an_unknown_tool_is_refused(tmp_path):
    out = run(tmp_path, "status", "kafka")
    assert out.returncode != 0 and "unknown tool 'kafka'" in out.stderr
