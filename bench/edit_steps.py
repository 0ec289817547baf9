"""Where an edit's instructions go: callgrind counts per edit_feature call, split by step, beside
the floor's (make bench; issue 51). Prints figures only.

For each build (this one, and each FEATURE_OUTBOX_STEPS_BINS entry `label=bin_dir`, e.g. a tree
bench/ab_setup.sh made of a release), a cluster is loaded as bench/edit_bench.py loads it and
stopped. Then each path runs one fixed sequence of `moved` edits in a single-user backend under
callgrind, 100 edits and 600 (BENCH_STEPS_SMALL, BENCH_STEPS_LARGE), and every figure is the
difference over 500: what one more edit costs, without the backend's start or its first calls
(plans, caches). The same build and sequence give the same counts on any machine, however busy.
Paths (BENCH_STEPS_PATHS), for county polygons and for points (BENCH_STEPS_SETS):
  floor             edit_bench.py's floor: UPDATE + outbox INSERT + ST_IsValid + ST_PointOnSurface
  built-in          edit_feature(id, geometry, 'moved')
  user layer        edit_feature('bench', id, geometry, 'moved')
  prepared floor, prepared floor + state   the floor as a prepared statement (generic plan), alone
                    and after the UPDATE of the feature's state row that an edit makes, prepared too:
                    their difference is the state row's step, a statement of its own as in an edit

A step's figure is the inclusive count of the functions that do it (callgrind_annotate
--inclusive=yes) per edit, but the state row's. The steps are apart from each other, and their sum
is not the total: what is left is the PL/pgSQL statements' own work and the rows written.
"""

import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "pg_test"))
import edit_bench  # noqa: E402
from conftest import PG_BIN, RUN_DIR, Cluster  # noqa: E402

SMALL, LARGE = int(os.environ.get("BENCH_STEPS_SMALL", "100")), int(os.environ.get("BENCH_STEPS_LARGE", "600"))
PATHS = {"floor": 2, "built-in": 3, "user layer": 6, "prepared floor": "floor", "prepared floor + state": "state"}
# The prepared paths give the state row's step. BENCH_STEPS_PATHS picks paths (comma-separated).
SETS = [("polygons", 0), ("points", edit_bench.POINT_BASE)]

# The built-in layer's state row update of an edit, as sql/edit.sql's _edit makes it (a statement of
# its own there too), less what it computes from the edit (new key, point, box, digest) and its
# RETURNING (a single-user backend prints what a statement returns).
STATE = """UPDATE feature_outbox.feature_state s
   SET previous_routing_key = s.routing_key, previous_h3_resolution = s.h3_resolution,
       previous_routing_point = s.routing_point, previous_bbox = s.bbox, routing_key = s.routing_key,
       routing_point = s.routing_point, bbox = s.bbox, version = s.version + 1, last_event = 'moved'
 WHERE s.layer = 'features' AND s.feature_id = :id AND s.version IS NOT NULL"""

# Each step: the functions (callgrind's names, each a regular expression matched in full) whose
# inclusive counts add up to it. Names of 0.3.0 and 0.4.0 too, so that their trees compare.
STEPS = [
    ("client statement: parse, plan", [r"pg_parse_query", r"pg_analyze_and_rewrite_fixedparams", r"pg_plan_queries"]),
    # The Rust steps by their own function (not inlined), which the SQL wrappers and the built-in
    # move's Rust path (src/edit/moved.rs) both call.
    ("Rust pass (_inspect_geometry)", [r"feature_outbox::edit::inspect_edit"]),
    ("H3 (_h3_cell)", [r"feature_outbox::edit::_h3_cell"]),
    ("validity (GEOS)", [r"isvaliddetail", r"isvalid"]),
    ("made-valid copy of invalid shapes", [r"ST_MakeValid"]),
    ("point on surface", [r"pointonsurface"]),
    ("state row (prepared floor + state - prepared floor)", None),
    ("digests (md5 of the EWKB)", [r"md5_bytea", r"WKBFromLWGEOM", r"feature_outbox::edit::digest::md5_bytes"]),
    ("outbox CHECKs", [r"ExecConstraints"]),
    ("SECURITY DEFINER, pinned search_path", [r"ProcessGUCArray", r"AtEOXact_GUC", r"NewGUCNestLevel"]),
    ("identity (calling role)", [r"feature_outbox::roles::.*", r"feature_outbox::edit::layers::as_caller"]),
    ("user layer's row write (_layer_write_row)", [r"_layer_write_row(_composite)?_wrapper"]),
    ("trace capture (_traceparent, _tracestate)", [r"_traceparent_wrapper", r"_tracestate_wrapper"]),
    ("origin (_event_origin)", [r"feature_outbox_event_origin"]),
    ("wake-up (_wake_relay_for, at commit)", [r"feature_outbox::relay_state::_wake_relay_for", r"feature_outbox::relay_state::wake_at_end",
                                              r"pgrx::callbacks::register_xact_callback::callback"]),
    ("PL/pgSQL expressions, set up per transaction", [r"ExecInitExprWithParams"]),
    ("executor start and end, every statement", [r"ExecutorStart", r"ExecutorEnd"]),
]
# The tile-output check has no function of its own: the built-in layer's outbox INSERT returns it,
# a user layer's registry read (in `executor start and end` and the rest) reads it.




def build_cluster(name: str, bin: Path) -> tuple[Cluster, int]:
    """edit_bench's cluster, stopped: callgrind runs single-user backends on its data directory."""
    c, n = edit_bench.edit_cluster(RUN_DIR / f"steps-{name}", bin, "jit = off")
    c.stop()
    return c, n


LINE = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(?:\S*?:)?(.+?)(?:\s+\[.*\])?$")


def profile(c: Cluster, n: int, base: int, sql: str, count: int, keep: Path | None = None,
            prepared: bool = False) -> tuple[int, dict[str, int]]:
    """Callgrind of `count` edits of `sql` in a single-user backend: total instructions, and each
    function's inclusive count."""
    rnd = random.Random(7)
    if prepared:
        # Generic plans, prepared once (in both runs, so it cancels out), then run: the floor's
        # statement, after the state row's when `state`.
        floor = edit_bench.ROWS[2][1]
        lines = ["SET plan_cache_mode = force_generic_plan",
                 f"PREPARE edit(bigint, int) AS {floor.replace(':id', '$1').replace(':k', '$2')}",
                 f"PREPARE state(bigint) AS {STATE.replace(':id', '$1')}"]
        for i in range(count):
            id = base + rnd.randint(1, n)
            lines.append(f"EXECUTE state({id}); EXECUTE edit({id}, {i % 2})" if sql == STATE else f"EXECUTE edit({id}, {i % 2})")
    else:
        lines = [sql.replace("\n", " ").replace(":id", str(base + rnd.randint(1, n))).replace(":k", str(i % 2))
                 for i in range(count)]
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)
        script, out = Path(tmp) / "edits.sql", Path(tmp) / "callgrind.out"
        script.write_text("\n".join(" ".join(l.split()) for l in lines) + "\n")
        as_pg = ["runuser", "-u", "postgres", "--"] if os.getuid() == 0 else ["sudo", "-u", "postgres"]
        with script.open() as stdin:
            done = subprocess.run([*as_pg, "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                                   str(c.bin / "postgres"), "--single", "-D", str(c.dir / "data"), edit_bench.DB],
                                  stdin=stdin, capture_output=True, text=True)
        if "ERROR:" in done.stdout + done.stderr:
            raise SystemExit(f"an edit failed under callgrind:\n{(done.stdout + done.stderr)[-2000:]}")
        if keep:
            shutil.copy(out, keep)
        annotated = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(out)],
                                   capture_output=True, text=True, check=True).stdout
    total = 0
    functions: dict[str, int] = {}
    for l in annotated.splitlines():
        if "PROGRAM TOTALS" in l:
            total = int(l.split()[0].replace(",", ""))
            continue
        m = LINE.match(l)
        if m:
            name = m.group(2).strip()
            functions[name] = functions.get(name, 0) + int(m.group(1).replace(",", ""))
    return total, functions


def per_edit(c: Cluster, n: int, base: int, sql: str, prepared: bool = False) -> tuple[float, dict[str, float]]:
    t1, f1 = profile(c, n, base, sql, SMALL, prepared=prepared)
    t2, f2 = profile(c, n, base, sql, LARGE, prepared=prepared)
    k = LARGE - SMALL
    return (t2 - t1) / k, {name: (f2.get(name, 0) - f1.get(name, 0)) / k for name in set(f1) | set(f2)}


def step_count(functions: dict[str, float], patterns: list[str]) -> float:
    return sum(v for name, v in functions.items() if any(re.fullmatch(p, name) for p in patterns))


def main() -> None:
    builds = {"this build": PG_BIN}
    for entry in filter(None, os.environ.get("FEATURE_OUTBOX_STEPS_BINS", "").split(",")):
        label, _, bin = entry.partition("=")
        builds[label] = Path(bin)
    only = os.environ.get("BENCH_STEPS_PATHS")
    paths = {k: v for k, v in PATHS.items() if not only or k in only.split(",")}
    sets = [s for s in SETS if s[0] in os.environ.get("BENCH_STEPS_SETS", "polygons,points").split(",")]
    dump = os.environ.get("BENCH_STEPS_DUMP")  # a directory: every function's per-edit count, per run
    results = {}
    for b, bin in builds.items():
        c, n = build_cluster(b.replace(" ", "-").replace(".", ""), bin)
        for shapes, base in sets:
            for path, row in paths.items():
                if isinstance(row, str):
                    total, functions = per_edit(c, n, base, STATE if row == "state" else "", prepared=True)
                else:
                    total, functions = per_edit(c, n, base, edit_bench.ROWS[row][1])
                results[(b, shapes, path)] = (total, functions)
                if dump:
                    Path(dump).mkdir(parents=True, exist_ok=True)
                    name = f"{b}-{shapes}-{path}".replace(" ", "_")
                    Path(dump, name + ".txt").write_text(
                        "".join(f"{v:14,.0f}  {k}\n" for k, v in sorted(functions.items(), key=lambda kv: -kv[1])))
    print(f"Instructions per edit (callgrind, single-user backend, ({LARGE} - {SMALL} edits) / {LARGE - SMALL}), by step; "
          f"ratio: the floor's count over the path's (higher is faster)\n")
    cols = [(sh, p) for sh, _ in sets for p in paths]
    for b in builds:
        total = {col: results[(b, *col)][0] for col in cols}
        print(f"{b}:\n")
        print("| step | " + " | ".join(f"{sh}, {p}" for sh, p in cols) + " |")
        print("|---|" + "---|" * len(cols))
        print("| total | " + " | ".join(f"{total[col]:,.0f}" for col in cols) + " |")
        if "floor" in paths:
            print("| ratio to the floor | " + " | ".join("" if p.startswith("prepared") else f"{total[(sh, 'floor')] / total[(sh, p)]:.3f}"
                                                     for sh, p in cols) + " |")
        for step, patterns in STEPS:
            if patterns is None:
                if "prepared floor" not in paths or "prepared floor + state" not in paths:
                    continue
                cells = [f"{total[(sh, 'prepared floor + state')] - total[(sh, 'prepared floor')]:,.0f}"
                         if p in ("built-in", "user layer") else "" for sh, p in cols]
            else:
                cells = [f"{step_count(results[(b, sh, p)][1], patterns):,.0f}" for sh, p in cols]
            print(f"| {step} | " + " | ".join(cells) + " |")
        print()
    if len(builds) > 1:
        first = next(iter(builds))
        print(f"Total instructions per edit, each build over {first} (below 1: {first} runs fewer):\n")
        print("| build | " + " | ".join(f"{sh}, {p}" for sh, p in cols) + " |")
        print("|---|" + "---|" * len(cols))
        for b in builds:
            print(f"| {b} | " + " | ".join(f"{results[(b, *col)][0]:,.0f} ({results[(b, *col)][0] / results[(first, *col)][0]:.3f})"
                                           for col in cols) + " |")


if __name__ == "__main__":
    main()
