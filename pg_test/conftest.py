"""Fixtures shared by the end-to-end tests: a throwaway PostgreSQL cluster that preloads
feature_outbox (run as the postgres user, own port and data directory), and helpers to reach it."""

import functools
import os
import socket
import subprocess
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[1]
# The PostgreSQL major under test: 15 on the host; scripts/pgroot.sh sets FEATURE_OUTBOX_PG in the
# root of 17 or 18 (make test PG=N).
PG_MAJOR = int(os.environ.get("FEATURE_OUTBOX_PG", "15"))
# FEATURE_OUTBOX_TEST_PG_BIN: run the tests against another tree (bench/ab_setup.sh makes one of an
# earlier release), e.g. to show a test fails on the code before its fix.
PG_BIN = Path(os.environ.get("FEATURE_OUTBOX_TEST_PG_BIN", f"/usr/lib/postgresql/{PG_MAJOR}/bin"))
# The project's virtualenv: .venv on the host, the root's own in a root (its Python differs).
VENV = Path(os.environ.get("FEATURE_OUTBOX_VENV", ROOT / ".venv"))
RUN_DIR = Path(os.environ.get("FEATURE_OUTBOX_TEST_DIR", "/var/tmp/feature_outbox_test"))


@functools.cache
def county_data() -> Path:
    """The 3,231 US counties as GeoJSONL, in the checkout's cache. scripts/county_data.sh fills it on
    first use, from ../shared (or $FEATURE_OUTBOX_SHARED) or rebuilt from npm as make demo does; a
    failure there fails the test rather than skipping it."""
    out = subprocess.run(["bash", ROOT / "scripts" / "county_data.sh"], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip())


def tools(*names: str) -> dict[str, str]:
    """The servers scripts/tools.sh installs once per machine (tansu, martin, varnish), by name to the
    binary's path: built now when missing or when the tool cache's stamp is not today's recipe, or
    waited for while a build started earlier (CI starts them in the background) still runs."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "tools.sh"), *names], check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, directory: Path, port: int, bin: Path = PG_BIN):
        self.dir, self.port, self.bin = directory, port, bin
        self.env = {**os.environ, "FEATURE_OUTBOX_PG_BIN": str(bin)}

    def start(self, *settings: str) -> None:
        subprocess.run([ROOT / "scripts/cluster.sh", "start", self.dir, str(self.port), *settings], check=True, env=self.env)

    def stop(self) -> None:
        subprocess.run([ROOT / "scripts/cluster.sh", "stop", self.dir], check=True, env=self.env)

    def restart(self) -> None:
        as_pg = [] if os.getuid() != 0 else ["runuser", "-u", "postgres", "--"]
        subprocess.run([*as_pg, self.bin / "pg_ctl", "-D", self.dir / "data", "-l", self.dir / "server.log",
                        "-w", "-m", "fast", "restart"], check=True, stdout=subprocess.DEVNULL)

    def dsn(self, db: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={db}"

    def connect(self, db: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(self.dsn(db), autocommit=True)

    def create_db(self, db: str) -> None:
        with self.connect() as c:
            c.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            c.execute(f'CREATE DATABASE "{db}"')

    def psql(self, db: str, *args: str, stdin: str | None = None) -> str:
        out = subprocess.run([PG_BIN / "psql", "-X", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                              "-d", db, *args], input=stdin, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        return out.stdout

    def log(self) -> str:
        return (self.dir / "server.log").read_text(errors="replace")


def create_fault_point(conn: psycopg.Connection) -> None:
    """Declares the debug build's fault-injection switch, public._test_crash_after_next_publish(). The
    install script never declares it, so test and release builds generate the same SQL; only a
    superuser can declare a C function."""
    conn.execute("""CREATE OR REPLACE FUNCTION public._test_crash_after_next_publish() RETURNS void
                    LANGUAGE c VOLATILE AS 'feature_outbox', '_test_crash_after_next_publish_wrapper'""")
    conn.execute("REVOKE ALL ON FUNCTION public._test_crash_after_next_publish() FROM PUBLIC")


@pytest.fixture(scope="session")
def cluster():
    c = Cluster(RUN_DIR / "pg", free_port())
    c.start()
    yield c
    c.stop()


@pytest.fixture
def cluster_with(request):
    """Starts clusters of the test's own with the given settings; stops them at the end of the test."""
    started = []

    def start(*settings):
        c = Cluster(RUN_DIR / f"{request.node.name[:40]}-{len(started)}", free_port())
        c.start(*settings)
        started.append(c)
        return c
    yield start
    for c in started:
        c.stop()
