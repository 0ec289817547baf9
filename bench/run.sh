#!/usr/bin/env bash
# make bench: on this machine, against real components (PostgreSQL clusters of 15 or the root's major, nats-server -js, an
# HTTP receiver). Prints figures and rewrites bench/RESULTS.md (bench/RESULTS.pgN.md for PG=N); asserts nothing about speed.
#   1. bench/results.py: relay (1 and 2 workers, the guide's external relay, both floors), HTTP,
#      commit-to-subscriber latency, the write path (with bench/edit_bench.py), claim cost against
#      history, worker memory (BENCH_REPEATS, BENCH_BACKLOG, BENCH_LATENCY_SECONDS);
#   2. bench/pressure_bench.py: relay and backlog with and without a long transaction;
#   3. bench/backfill_bench.py: backfill() of 100,000 features beside two editors, appended to
#      bench/RESULTS.md as its section 7;
#   4. bench/databases_bench.py: 3 databases x 1 worker beside 1 database x 3 workers, section 8;
#   5. bench/bounds_bench.py: the relay and webhook drains again, with each process's CPU per event
#      and the cores busy (the ceiling of a ratio that misses its target), section 9;
#   6. bench/tiles_bench.py: tile expiry's cost on the edit path and the relay, and the cover rate,
#      section 10;
#   7. bench/kafka_bench.py: the Kafka sink beside a bare rdkafka producer on the same broker (tansu),
#      and commit-to-acknowledgement latency at 1,000 county edits/s, section 11;
#   8. bench/tile_cache_bench.py: commit to purge acknowledged at 200 edits/s, Varnish in front of
#      Martin, on the database's clock and by a polling client, section 12;
#   9. bench/standby_bench.py: the standby gate's latency and drain beside no gate and beside
#      synchronous_commit = on, section 13;
#  10. bench/capture_bench.py: capture of direct writes: commit to subscriber at 200 plain UPDATEs/s,
#      a captured bulk UPDATE of 100,000 rows beside record_edit, and edit_feature under
#      wal_level = replica and logical, section 14;
#  11. bench/edit_steps.py: callgrind instructions per edit_feature call, polygons and points, the
#      built-in table and a user layer, split by step beside the floor's; FEATURE_OUTBOX_STEPS_BINS
#      (label=bin_dir,...) adds other builds; here the last release's tree (bench/ab_setup.sh), section 15;
#  12. bench/ab_bench.py: this build against the last release in sql/released/RELEASES, side by side
#      (edit TPS, relay drains, callgrind instructions per edit), each figure's ratio to the
#      release's and a mark where this build is more than 3 % worse, section 16. The release's tree
#      is built first, once per commit (bench/ab_setup.sh), so that a failed build stops the run
#      before any figure is taken.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${FEATURE_OUTBOX_VENV:-.venv}/bin/python"
OUT=bench/RESULTS.md   # another major's figures: bench/RESULTS.pgN.md (bench/results.py names it too)
if [ "${FEATURE_OUTBOX_PG:-15}" != 15 ]; then OUT=bench/RESULTS.pg$FEATURE_OUTBOX_PG.md; fi
read -r LAST _ < <(bash scripts/releases.sh last)
LAST_BIN=$(bash bench/ab_setup.sh last)
# The tree's cache checks (stamp, recipe, library), now that the tree is there: seconds.
FEATURE_OUTBOX_RELEASE_TREE_BUILD=1 "$PY" -m pytest -p no:cacheprovider -q pg_test/test_release_trees.py
"$PY" bench/results.py
"$PY" bench/pressure_bench.py
{ printf '\n## 7. Backfill: 100,000 features while two editors move random ones\n\n'; "$PY" bench/backfill_bench.py; } | tee -a "$OUT"
{ printf '\n## 8. Many databases: 3 databases x 1 worker beside 1 database x 3 workers\n\n'; "$PY" bench/databases_bench.py; } | tee -a "$OUT"
{ printf '\n## 9. Where the relay is bounded: the CPU each drain costs, by process\n\n'; "$PY" bench/bounds_bench.py; } | tee -a "$OUT"
{ printf '\n## 10. Tile expiry: the edit path and the relay with an expire output, and the cover rate\n\n'; "$PY" bench/tiles_bench.py; } | tee -a "$OUT"
{ printf '\n## 11. Kafka: the relay beside a bare producer on one broker, and commit-to-acknowledgement latency\n\n'; "$PY" bench/kafka_bench.py; } | tee -a "$OUT"
{ printf '\n## 12. Tile caches: commit to purge at 200 edits/s\n\n'; "$PY" bench/tile_cache_bench.py; } | tee -a "$OUT"
{ printf '\n## 13. The standby gate: latency and drain with a local standby named in feature_outbox.standby_slots\n\n'; "$PY" bench/standby_bench.py; } | tee -a "$OUT"
{ printf '\n## 14. Capture of direct writes: latency, a bulk UPDATE beside record_edit, and wal_level = logical\n\n'; "$PY" bench/capture_bench.py; } | tee -a "$OUT"
# Beside the last release's steps, so that a step that grew shows which one.
{ printf '\n## 15. Where an edit'"'"'s instructions go: callgrind counts per edit, by step\n\n'
  FEATURE_OUTBOX_STEPS_BINS="$LAST=$LAST_BIN" "$PY" bench/edit_steps.py; } | tee -a "$OUT"
FEATURE_OUTBOX_AB_BIN=$LAST_BIN FEATURE_OUTBOX_AB_LABEL=$LAST "$PY" bench/ab_bench.py \
  "16. Against the last release ($LAST): every figure's ratio to it" | { echo; cat; } | tee -a "$OUT"
