"""The README and the docs book, checked against the product: every sql and sh example runs, in order
within its page, against a cluster with the extension, a relay worker and nats-server; the SQL
reference and the settings table equal the catalog; every internal link and anchor resolves; and
each heading of the README as it was before the book holds its place in the book.

docs_examples.py says how a block is marked. Each page gets a fresh database (named `docs`, the
one the relay serves), and the roles and ALTER SYSTEM settings a page makes are undone after it."""

import os
import queue
import re
import subprocess
import threading
from pathlib import Path

import psycopg
from psycopg.sql import SQL, Literal
import pytest

from conftest import PG_BIN, RUN_DIR, Cluster, free_port
from docs_examples import DOCS, README, ROOT, anchor, anchors, blocks, expand, outside_fences, pages
from relay_harness import nats_fixture

nats_server = nats_fixture("nats_docs")
DB = "docs"
END = "@@feature_outbox docs block end@@"


@pytest.fixture(scope="module")
def docs_cluster(nats_server):
    c = Cluster(RUN_DIR / "pg_docs", free_port())
    # wal_level = logical: the Direct writes page captures a layer (it needs a restart otherwise).
    c.start(f"feature_outbox.database = '{DB}'", "feature_outbox.relay_workers = 1",
            f"feature_outbox.endpoint = '{nats_server.url}'", "wal_level = logical")
    yield c
    c.stop()


class Session:
    """One psql session per page, fed block by block; stdout and stderr are read up to a marker
    that each block ends with, so the output of each block stays apart."""

    def __init__(self, c: Cluster):
        self.proc = subprocess.Popen(
            [PG_BIN / "psql", "-X", "-q", "-h", "127.0.0.1", "-p", str(c.port), "-U", "postgres", "-d", DB,
             "-v", "ON_ERROR_STOP=0", "-v", "VERBOSITY=verbose", "-P", "pager=off"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.out, self.err = queue.Queue(), queue.Queue()
        for stream, q in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, q), daemon=True).start()

    @staticmethod
    def _pump(stream, q: queue.Queue) -> None:
        for line in stream:
            q.put(line)

    def run(self, sql: str, timeout: float = 120) -> tuple[str, str]:
        self.proc.stdin.write(f"{sql}\n\\echo {END}\n\\warn {END}\n")
        self.proc.stdin.flush()
        return self._until(self.out, timeout), self._until(self.err, timeout)

    @staticmethod
    def _until(q: queue.Queue, timeout: float) -> str:
        lines = []
        while (line := q.get(timeout=timeout)).rstrip("\n") != END:
            lines.append(line)
        return "".join(lines)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


def same_output(got: str, shown: str) -> bool:
    def norm(s):
        return "\n".join(line.rstrip() for line in s.strip("\n").split("\n"))
    return norm(got) == norm(shown)


def ends_complete(sql: str) -> bool:
    """The block's last statement is terminated: else psql would join it to the next block."""
    code = [l for l in (re.sub(r"--.*$", "", l).rstrip() for l in sql.split("\n")) if l.strip()]
    return not code or code[-1].endswith(";") or code[-1].lstrip().startswith("\\")


def auto_conf(admin) -> dict[str, str]:
    """postgresql.auto.conf as it is on disk: the cluster's own settings (cluster.sh writes them
    there, the endpoint among them) and any ALTER SYSTEM since."""
    return {name: value for name, value in admin.execute(
        "SELECT name, setting FROM pg_file_settings WHERE sourcefile LIKE '%/postgresql.auto.conf' ORDER BY seqno")}


def restore_auto_conf(admin, before: dict[str, str]) -> None:
    """Undoes the page's ALTER SYSTEM: not RESET ALL, which would drop the cluster's own settings
    too and leave the pages after it without a relay endpoint."""
    after = auto_conf(admin)
    for name in sorted(after.keys() - before.keys()):
        admin.execute(f"ALTER SYSTEM RESET {guc_name(name)}")
    for name, value in before.items():
        if after.get(name) != value:
            admin.execute(SQL("ALTER SYSTEM SET {} = {}").format(SQL(guc_name(name)), Literal(value)))
    admin.execute("SELECT pg_reload_conf()")
    assert auto_conf(admin) == before, "postgresql.auto.conf was not restored"


def guc_name(name: str) -> str:
    assert re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)?", name), name
    return name


def run_page(c: Cluster, page: Path) -> dict:
    """Runs the page's examples; returns counts, and raises at the first example that is wrong."""
    bs = blocks(page)
    runnable = [b for b in bs if b.lang in ("sql", "sh") and b.norun is None]
    for b in bs:
        if b.lang in ("sql", "sh") and b.flags and b.norun is None:
            raise AssertionError(f"{b.where()}: unknown marker {b.flags!r} (only 'norun: <why>')")
        if b.norun == "":
            raise AssertionError(f"{b.where()}: norun needs a reason")
    with c.connect() as admin:
        roles = {r[0] for r in admin.execute("SELECT rolname FROM pg_roles")}
        dbs = {r[0] for r in admin.execute("SELECT datname FROM pg_database")}
        settings = auto_conf(admin)
        admin.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {DB}")
    first_sql = next((b.body for b in runnable if b.lang == "sql"), "")
    if runnable and "CREATE EXTENSION feature_outbox" not in first_sql:
        with c.connect(DB) as conn:
            conn.execute("CREATE EXTENSION feature_outbox CASCADE")
    session = Session(c)
    ran = compared = 0
    try:
        last = None
        for b in bs:
            if b.is_output:
                assert last is not None, f"{b.where()}: output without a run block right before it"
                assert same_output(last, b.body), (
                    f"{b.where()}: the output shown differs from what ran.\n--- shown\n{b.body}\n--- got\n{last}")
                compared += 1
                last = None
                continue
            last = None
            if b.lang not in ("sql", "sh") or b.norun is not None:
                continue
            ran += 1
            if b.lang == "sql":
                assert ends_complete(b.body), f"{b.where()}: the last statement has no semicolon"
                out, err = session.run(b.body)
                got = re.findall(r"ERROR:\s+([0-9A-Z]{5}):", err)
                want = b.expected_errors()
                assert got == want, (f"{b.where()}: errors {got}, the block marks {want}.\n{b.body}\n--- stderr\n{err}")
                last = out
            else:
                env = {**os.environ, "PGHOST": "127.0.0.1", "PGPORT": str(c.port), "PGUSER": "postgres",
                       "PGDATABASE": DB, "PATH": f"{PG_BIN}:{os.environ['PATH']}"}
                r = subprocess.run(["bash", "-euo", "pipefail", "-c", b.body], cwd=ROOT, env=env,
                                   capture_output=True, text=True, timeout=300)
                assert r.returncode == 0, f"{b.where()}: exit {r.returncode}\n{b.body}\n{r.stdout}{r.stderr}"
                last = r.stdout
    finally:
        session.close()
        with c.connect() as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {DB} WITH (FORCE)")
            for db in {r[0] for r in admin.execute("SELECT datname FROM pg_database")} - dbs:
                admin.execute(f'DROP DATABASE "{db}" WITH (FORCE)')
            for role in {r[0] for r in admin.execute("SELECT rolname FROM pg_roles")} - roles:
                admin.execute(f'DROP ROLE "{role}"')
            restore_auto_conf(admin, settings)
    return {"ran": ran, "compared": compared, "norun": sum(b.norun is not None for b in bs)}


PAGES = pages()


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_examples_of_each_page_run_as_shown(docs_cluster, page):
    counts = run_page(docs_cluster, page)
    print(f"{page.relative_to(ROOT)}: {counts}")


def test_every_page_of_the_book_is_in_its_summary():
    listed = {p.name for p in PAGES[1:]}
    on_disk = {p.name for p in DOCS.glob("*.md")} - {"SUMMARY.md"}
    assert on_disk == listed, f"not in SUMMARY.md: {sorted(on_disk - listed)}; missing: {sorted(listed - on_disk)}"


def test_the_readme_stays_short():
    assert len(README.read_bytes()) <= 20_000, f"README.md is {len(README.read_bytes()):,} bytes (at most 20 KB)"


# Links -------------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced blocks and code spans, where a link is a link."""
    return "\n".join(re.sub(r"`[^`]*`", "", line) for line in outside_fences(text))


def test_every_internal_link_and_anchor_resolves():
    files = [README, *sorted(DOCS.glob("*.md"))]
    broken = []
    for f in files:
        for target in LINK.findall(prose(expand(f))):
            if re.match(r"[a-z]+:", target):          # http:, https:, mailto: are not fetched
                continue
            path, _, frag = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                broken.append(f"{f.relative_to(ROOT)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(expand(dest)):
                broken.append(f"{f.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# The README before the book, and where each of its headings went ---------------------------------

def test_each_heading_of_the_old_readme_has_its_page():
    """docs/src/readme-map.md lists every heading the README had before the book (0.3.0-dev), with
    the page that holds it now; that page must have the heading."""
    rows = re.findall(r"^\| (.+?) \| \[[^\]]*\]\(([^)#]+)(?:#([^)]*))?\) \|$", (DOCS / "readme-map.md").read_text(), re.M)
    assert len(rows) >= 25, rows
    missing = []
    for title, page, frag in rows:
        text = expand((DOCS / page).resolve())
        if anchor_of(title) not in anchors(text):
            missing.append(f"{title!r} is not a heading of {page}")
        if frag and frag != anchor_of(title):
            missing.append(f"{title!r}: the link's anchor {frag!r} is not the heading's")
    assert not missing, "\n".join(missing)


def anchor_of(title: str) -> str:
    return anchor(title.replace("\\|", "|"))


# The reference and the settings table against the catalog -----------------------------------------

REFERENCE = DOCS / "sql-reference.md"
SIGNATURE = re.compile(r"^- `(function|procedure|view|table) (\w+)\((.*?)\)(?: → (.+?))?`", re.M)


def catalog_signatures(conn) -> set[str]:
    """Every function, procedure, view and table of the extension but the `_` ones, as the
    reference writes them: arguments as pg_get_function_arguments gives them, without casts."""
    rows = conn.execute(r"""
        SELECT CASE p.prokind WHEN 'p' THEN 'procedure' ELSE 'function' END, p.proname,
               regexp_replace(pg_get_function_arguments(p.oid), '::[a-z_ ]+(\[\])?', '', 'g'),
               CASE WHEN p.prokind = 'p' THEN NULL ELSE pg_get_function_result(p.oid) END
          FROM pg_proc p JOIN pg_depend d ON d.classid = 'pg_proc'::regclass AND d.objid = p.oid AND d.deptype = 'e'
         WHERE d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'feature_outbox') AND p.proname !~ '^_'
        UNION ALL
        SELECT CASE c.relkind WHEN 'v' THEN 'view' ELSE 'table' END, c.relname,
               string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod), ', ' ORDER BY a.attnum), NULL
          FROM pg_class c JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype = 'e'
          JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
         WHERE d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'feature_outbox')
           AND c.relkind IN ('r', 'p', 'v') AND c.relname !~ '^_'
         GROUP BY c.relkind, c.relname""").fetchall()
    return {f"{kind} {name}({args})" + (f" → {result}" if result else "") for kind, name, args, result in rows}


def documented_signatures() -> set[str]:
    return {f"{kind} {name}({args})" + (f" → {result}" if result else "")
            for kind, name, args, result in SIGNATURE.findall(REFERENCE.read_text())}


def test_the_sql_reference_lists_exactly_the_catalog(docs_cluster):
    docs_cluster.create_db("docs_reference")
    with docs_cluster.connect("docs_reference") as conn:
        conn.execute("CREATE EXTENSION feature_outbox CASCADE")
        catalog = catalog_signatures(conn)
    documented = documented_signatures()
    assert catalog == documented, ("\nnot in docs/src/sql-reference.md:\n  " + "\n  ".join(sorted(catalog - documented))
                                   + "\ndocumented but not in the catalog:\n  " + "\n  ".join(sorted(documented - catalog)))


SETTING_ROW = re.compile(r"^\| `(feature_outbox\.\w+)` \| (.*?) \| (.*?) \| .* \|$", re.M)
CONTEXTS = {"postmaster": "postmaster", "sighup": "sighup", "superuser": "superuser", "user": "user"}
UNITS = {"ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000,
         "B": 1, "kB": 1024, "MB": 1024 ** 2, "GB": 1024 ** 3}


def in_base_unit(value: str, unit: str | None) -> str:
    """'1min' with unit 's' -> '60'; what pg_settings.boot_val holds for the shown default."""
    m = re.fullmatch(r"(\d+)\s*(ms|s|min|h|d|B|kB|MB|GB)", value)
    if not m or not unit:
        return value
    base = re.fullmatch(r"(\d*)(\w+)", unit)
    per = int(base[1] or 1) * UNITS[base[2]]
    return str(int(m[1]) * UNITS[m[2]] // per)


def test_the_settings_table_lists_every_guc_with_its_default_and_context(docs_cluster):
    rows = {name: (default.strip(), context.strip()) for name, default, context in
            SETTING_ROW.findall((DOCS / "settings.md").read_text())}
    with docs_cluster.connect() as conn:
        gucs = {r[0]: r[1:] for r in conn.execute(
            "SELECT name, boot_val, context, unit FROM pg_settings WHERE name LIKE 'feature_outbox.%'")}
    assert set(rows) == set(gucs), (f"registered, not in the table: {sorted(set(gucs) - set(rows))}; "
                                    f"in the table, not registered: {sorted(set(rows) - set(gucs))}")
    wrong = []
    for name, (boot, context, unit) in gucs.items():
        default, shown_context = rows[name]
        shown_default = "" if default == "(none)" else default
        if in_base_unit(shown_default, unit) != (boot or ""):
            wrong.append(f"{name}: default {default!r}, registered {boot!r} {unit or ''}")
        if shown_context.split()[0].rstrip(",") != CONTEXTS[context]:
            wrong.append(f"{name}: context {shown_context!r}, registered {context!r}")
    assert not wrong, "\n".join(wrong)
