#!/usr/bin/env bash
# Runs everything in pg_test/ (SQL regression files, real-data and relay end-to-end tests) against
# throwaway components that pytest's fixtures start: a PostgreSQL 15 cluster and nats-server.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -p no:cacheprovider pg_test "$@"
