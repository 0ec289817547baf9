#!/usr/bin/env bash
# make bench: on this machine, against real components (PostgreSQL 15 clusters, nats-server -js, an
# HTTP receiver). Prints figures; asserts nothing about speed.
#   1. edit_feature side by side with its floor (bench/edit_bench.py; BENCH_SECONDS, BENCH_ROUNDS);
#   2. relay and backlog with and without a long transaction (bench/pressure_bench.py; BENCH_SINGLES);
#   3. edit_feature and relay throughput (bench/relay_bench.py; BENCH_EVENTS, default 50000).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python bench/edit_bench.py
.venv/bin/python bench/pressure_bench.py
exec .venv/bin/python bench/relay_bench.py "$@"
