#!/usr/bin/env bash
# make bench: throughput of edit_feature and of the relay to NATS JetStream and to HTTP, on this
# machine, against real components (PostgreSQL 15 cluster, nats-server -js, an HTTP receiver).
# Prints its figures; asserts nothing about speed. BENCH_EVENTS (default 50000) sets the size.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python bench/relay_bench.py "$@"
