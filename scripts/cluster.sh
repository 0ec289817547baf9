#!/usr/bin/env bash
# A throwaway PostgreSQL cluster (15, or FEATURE_OUTBOX_PG's major in its root), run as the postgres user on its own port and data directory,
# never the system cluster. Used by the test harness and the demo.
#   cluster.sh start DIR PORT ["setting = value" ...]   fresh initdb, preloads feature_outbox, starts
#   cluster.sh restart DIR
#   cluster.sh stop DIR
set -euo pipefail
# FEATURE_OUTBOX_PG_BIN: another PostgreSQL tree's bin (bench/ab_bench.py runs an older build beside this one).
BIN=${FEATURE_OUTBOX_PG_BIN:-/usr/lib/postgresql/${FEATURE_OUTBOX_PG:-15}/bin}
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo

as_postgres() {
  if [ "$(id -un)" = postgres ]; then "$@"; elif [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else sudo -u postgres "$@"; fi
}

cmd=${1:?usage: cluster.sh start DIR PORT [settings...] | stop DIR}
dir=${2:?data directory parent}
case "$cmd" in
  start)
    port=${3:?port}; shift 3
    if [ -f "$dir/data/postmaster.pid" ]; then as_postgres "$BIN/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true; fi
    $SUDO rm -rf "$dir"
    $SUDO install -d -o postgres -g postgres -m 0700 "$dir"
    as_postgres "$BIN/initdb" -D "$dir/data" -A trust -U postgres -E UTF8 --no-sync >"/tmp/initdb.$$.log" 2>&1 \
      || { cat "/tmp/initdb.$$.log"; exit 1; }
    rm -f "/tmp/initdb.$$.log"
    {
      echo "port = $port"
      echo "listen_addresses = '127.0.0.1'"
      echo "unix_socket_directories = '$dir'"
      echo "shared_preload_libraries = 'feature_outbox'"
      echo "fsync = off"
      echo "synchronous_commit = off"
      for setting in "$@"; do echo "$setting"; done
    } | as_postgres tee -a "$dir/data/postgresql.auto.conf" >/dev/null
    as_postgres "$BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null
    ;;
  restart)
    as_postgres "$BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" -m fast -w -t 60 restart >/dev/null
    ;;
  stop)
    # A postmaster killed outright (a failover drill) leaves its pid file: nothing to stop. A zombie
    # counts as gone: where no init reaps orphans, a killed postmaster stays one.
    state=""
    if [ -f "$dir/data/postmaster.pid" ]; then
      state=$(awk '/^State:/ { print $2 }' "/proc/$(head -1 "$dir/data/postmaster.pid")/status" 2>/dev/null || true)
    fi
    if [ -f "$dir/data/postmaster.pid" ] && { [ -z "$state" ] || [ "$state" = Z ]; }; then
      $SUDO rm -f "$dir/data/postmaster.pid"
    fi
    if [ -f "$dir/data/postmaster.pid" ]; then
      if ! as_postgres "$BIN/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >/dev/null; then
        # A server that does not stop: say which of its processes remain and where they wait, then
        # stop it anyway, and fail.
        pm=$(head -1 "$dir/data/postmaster.pid")
        echo "cluster.sh: $dir did not stop in 60 s; its remaining processes:" >&2
        for pid in $(pgrep -P "$pm"); do
          echo "--- $pid $(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null) wchan=$(cat /proc/$pid/wchan 2>/dev/null)" >&2
          if command -v gdb >/dev/null; then
            timeout 20 gdb -p "$pid" -batch -ex "thread 1" -ex "bt 40" 2>/dev/null | grep -E '^#' >&2 || true
          fi
        done
        as_postgres "$BIN/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null || true
        exit 1
      fi
    fi
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
