#!/usr/bin/env bash
# Runs everything in pg_test/ (SQL regression files, real-data and relay end-to-end tests) against
# throwaway components that pytest's fixtures start: a PostgreSQL cluster (15, or the major of the
# root it runs in) and nats-server.
set -euo pipefail
cd "$(dirname "$0")/.."
# Arguments go to pytest: files of pg_test/ to run only those (make pg-test PYTEST_ARGS='pg_test/test_relay.py'),
# or options such as -k. Without a file, all of pg_test/.
paths=(pg_test)
for a in "$@"; do case "$a" in pg_test/*) paths=() ;; esac; done
exec "${FEATURE_OUTBOX_VENV:-.venv}/bin/python" -m pytest -p no:cacheprovider "${paths[@]}" "$@"
