#!/usr/bin/env bash
# make bench: on this machine, against real components (PostgreSQL 15 clusters, nats-server -js, an
# HTTP receiver). Prints figures and rewrites bench/RESULTS.md; asserts nothing about speed.
#   1. bench/results.py: relay (1 and 2 workers, the guide's external relay, both floors), HTTP,
#      commit-to-subscriber latency, the write path (with bench/edit_bench.py), claim cost against
#      history, worker memory (BENCH_REPEATS, BENCH_BACKLOG, BENCH_LATENCY_SECONDS);
#   2. bench/pressure_bench.py: relay and backlog with and without a long transaction.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python bench/results.py
.venv/bin/python bench/pressure_bench.py
