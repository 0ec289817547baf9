#!/usr/bin/env python3
"""Writes the open release's upgrade script A--B from the install script the build generated for B.

The upgrade script is build output, never source: a function body lives once, in its sql/ file.
In order (TimescaleDB builds its update scripts the same way):
  1. sql/updates/A--B.sql: migration only (table changes, data fixes, drops of what depends on a
     changed signature, column defaults put back);
  2. every block of B's install script in the order pgrx put them, less the bootstrap (the tables,
     which step 1 changes instead): pgrx's declarations of the Rust functions as CREATE OR REPLACE,
     then each body file, which is written to run again (CREATE OR REPLACE; an event trigger is
     dropped if it exists and created again; a table of its own is CREATE TABLE IF NOT EXISTS), then finalize.sql (grants, search_path pins, wake-up).

A body block with a statement that cannot run twice is refused here, so the mistake shows at build
time and not as a failed ALTER EXTENSION UPDATE.

  upgrade_script.py --install feature_outbox--B.sql --migration sql/updates/A--B.sql --out FILE
"""

import argparse
import re
import sys

BEGIN, END = "/* <begin connected objects> */", "/* </end connected objects> */"
# pgrx writes `CREATE  FUNCTION` (two spaces) for a #[pg_extern].
PGRX_CREATE = re.compile(r"^CREATE\s+FUNCTION\b", re.M)
# At column 0 in a body file: a statement. Indented text is inside a function body.
# `CREATE TABLE IF NOT EXISTS` is how a body file adds a table of its own (a re-run skips it); a
# later change to that table is the migration's.
ONCE_ONLY = re.compile(r"^CREATE\s+(?!OR\s+REPLACE\b)(?!EVENT\s+TRIGGER\b)(?!(?:TABLE|INDEX|SEQUENCE)\s+IF\s+NOT\s+EXISTS\b)"
                       r"(\w+(?:\s+\w+)?)", re.M)
EVENT_TRIGGER = re.compile(r"^CREATE\s+EVENT\s+TRIGGER\s+(\w+)", re.M)


def blocks(script: str) -> list[str]:
    """The install script's object groups, each as pgrx wrote it (markers included)."""
    out, rest = [], script
    while (start := rest.find(BEGIN)) >= 0:
        stop = rest.find(END, start)
        if stop < 0:
            raise ValueError("unterminated object group in the install script")
        out.append(rest[start:stop + len(END)])
        rest = rest[stop + len(END):]
    return out


def is_rust_declaration(block: str) -> bool:
    # pgrx names a #[pg_extern] block by its Rust path on the third line: `-- feature_outbox::...`.
    lines = block.splitlines()
    return len(lines) > 2 and lines[2].startswith("-- feature_outbox::")


def is_bootstrap(block: str) -> bool:
    lines = block.splitlines()
    return len(lines) > 2 and lines[2].strip() == "-- bootstrap"


def rerunnable(block: str) -> str:
    if is_rust_declaration(block):
        return PGRX_CREATE.sub("CREATE OR REPLACE FUNCTION", block)
    problems = [m.group(0) for m in ONCE_ONLY.finditer(block)]
    for trigger in EVENT_TRIGGER.findall(block):
        if not re.search(rf"^DROP\s+EVENT\s+TRIGGER\s+IF\s+EXISTS\s+{trigger}\b", block, re.M):
            problems.append(f"CREATE EVENT TRIGGER {trigger} (no DROP EVENT TRIGGER IF EXISTS before it)")
    if problems:
        where = block.splitlines()[1] if len(block.splitlines()) > 1 else "?"
        raise ValueError(f"{where}: a body file must run again on update, but has: {'; '.join(problems)}. "
                         "Write CREATE OR REPLACE, or move the statement to sql/updates/.")
    return block


def generate(install: str, migration: str, source: str, target: str) -> str:
    groups = blocks(install)
    if sum(map(is_bootstrap, groups)) != 1:
        raise ValueError("expected exactly one bootstrap block (sql/schema.sql) in the install script")
    body = "\n\n".join(rerunnable(b) for b in groups if not is_bootstrap(b))
    return (f"-- feature_outbox {source} -> {target}. Generated at build time by scripts/upgrade_script.py from\n"
            f"-- sql/updates/{source}--{target}.sql and the {target} install script; never edit it.\n\n"
            f"{migration.rstrip()}\n\n{body}\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--install", required=True, help="the generated install script of the target release")
    p.add_argument("--migration", required=True, help="sql/updates/A--B.sql")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    m = re.search(r"(?:^|/)([0-9.]+)--([0-9.]+)\.sql$", a.migration)
    if not m:
        print(f"upgrade_script: {a.migration} is not named A--B.sql", file=sys.stderr)
        return 2
    with open(a.install) as f:
        install = f.read()
    with open(a.migration) as f:
        migration = f.read()
    try:
        text = generate(install, migration, m[1], m[2])
    except ValueError as e:
        print(f"upgrade_script: {e}", file=sys.stderr)
        return 1
    with open(a.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
