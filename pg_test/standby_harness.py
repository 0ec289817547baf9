"""Streaming standbys for the tests, made as every HA manager makes them: pg_basebackup -R from a
running primary (a standby.signal and primary_conninfo in postgresql.auto.conf), or pg_rewind -R of
a stopped former primary; each started with pg_ctl on a port of its own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from conftest import PG_BIN, Cluster, free_port
from relay_harness import wait_for

AS_PG = [] if os.getuid() != 0 else ["runuser", "-u", "postgres", "--"]


def as_postgres(*cmd: str) -> None:
    subprocess.run([*AS_PG, *cmd], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def start_standby(directory: Path, port: int) -> Cluster:
    """pg_ctl start of a data directory that pg_basebackup -R or pg_rewind -R made, on its own port."""
    c = Cluster(directory, port)
    with open(directory / "data" / "postgresql.auto.conf", "a") as conf:
        conf.write(f"\nport = {port}\nunix_socket_directories = '{directory}'\n")
    as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(directory / "data"), "-l", str(directory / "server.log"), "-w", "start")
    return c


def make_standby(primary: Cluster, directory: Path, slot: str | None = None, name: str | None = None) -> Cluster:
    """A streaming standby of `primary` in `directory`, started and caught up; streaming from the
    physical replication `slot` (which must exist) when given, and connecting as `name`
    (cluster_name, its walreceiver's application_name, as synchronous_standby_names names it)."""
    shutil.rmtree(directory, ignore_errors=True)
    subprocess.run(["install", "-d", "-o", "postgres", "-g", "postgres", "-m", "0700", str(directory)], check=True)
    as_postgres(str(PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
                "-D", str(directory / "data"), "-R", "-X", "stream", "--checkpoint=fast", *(["-S", slot] if slot else []))
    if name:
        with open(directory / "data" / "postgresql.auto.conf", "a") as conf:
            conf.write(f"\ncluster_name = '{name}'\n")
    standby = start_standby(directory, free_port())
    wait_replayed(primary, standby)
    return standby


def rejoin_as_standby(old_primary: Cluster, new_primary: Cluster) -> Cluster:
    """The stopped former primary rewound onto the new one's timeline and started as its standby, as
    Patroni brings a demoted leader back (pg_rewind needs wal_log_hints or data checksums)."""
    as_postgres(str(PG_BIN / "pg_rewind"), "-D", str(old_primary.dir / "data"), "-R",
                f"--source-server=host=127.0.0.1 port={new_primary.port} user=postgres dbname=postgres")
    rejoined = start_standby(old_primary.dir, free_port())
    wait_replayed(new_primary, rejoined)
    return rejoined


def wait_replayed(primary: Cluster, standby: Cluster) -> None:
    """Until the standby has replayed everything the primary has committed so far. The insert
    position, not the write position: with synchronous_commit off (the test clusters') a commit
    record can still sit in the WAL buffers, beyond pg_current_wal_lsn()."""
    with primary.connect() as conn:
        lsn = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]

    def replayed() -> bool:
        with standby.connect() as conn:
            return conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (lsn,)).fetchone()[0]
    wait_for(replayed, 20, "the standby to replay")


def walreceiver_pid(standby: Cluster) -> int:
    """The standby's walreceiver process, once it streams."""
    def pid():
        with standby.connect() as conn:
            row = conn.execute("SELECT pid FROM pg_stat_wal_receiver WHERE status = 'streaming'").fetchone()
        return row and row[0]
    return wait_for(pid, 20, "the walreceiver to stream")


def kill_tree(c: Cluster) -> None:
    """Kills the cluster's postmaster and every process of it with SIGKILL at once: a lost node."""
    postmaster = int((c.dir / "data" / "postmaster.pid").read_text().split()[0])
    children = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True, text=True).stdout.split()
    os.kill(postmaster, signal.SIGKILL)
    for child in children:
        try:
            os.kill(int(child), signal.SIGKILL)
        except ProcessLookupError:
            pass
