"""No empty step: a tracked script, test, harness or source file that is empty runs and succeeds
while doing nothing (scripts/tools.sh was committed with 0 bytes and CI stayed green for weeks,
because a warm tool cache did its job). Every tracked file under the folders below has content,
unless it is listed here as empty on purpose."""

import subprocess

from conftest import ROOT

FOLDERS = ["scripts", "demo", ".ci", "pg_test", "bench", "src", "sql"]
# Files that are empty on purpose, each with its reason. None today.
EMPTY_ON_PURPOSE: dict[str, str] = {}


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", *FOLDERS], check=True,
                         stdout=subprocess.PIPE).stdout
    return [f for f in out.decode().split("\0") if f]


def test_folders_have_tracked_files():
    files = tracked_files()
    for folder in FOLDERS:
        assert any(f.startswith(folder + "/") for f in files), f"git tracks nothing under {folder}/"


def test_no_tracked_file_is_empty():
    empty = [f for f in tracked_files() if (ROOT / f).is_file() and (ROOT / f).stat().st_size == 0
             and f not in EMPTY_ON_PURPOSE]
    assert not empty, ("tracked files are empty (fill them, remove them, or list them in "
                       f"EMPTY_ON_PURPOSE of {__file__} with the reason): {', '.join(empty)}")


def test_listed_files_are_still_empty():
    """A file listed as empty on purpose that gained content is listed no more."""
    for f, why in EMPTY_ON_PURPOSE.items():
        assert (ROOT / f).is_file() and (ROOT / f).stat().st_size == 0, f"{f} is listed as empty ({why}) but is not"
