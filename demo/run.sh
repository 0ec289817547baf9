#!/usr/bin/env bash
# make demo: the main job on real input. Every US county goes through edit_feature into the
# application's own table (public.counties, EPSG:3857, with name and state as attributes) in a
# throwaway PostgreSQL cluster (15, or PG=N's); some are moved, renamed and retired; the relay worker inside PostgreSQL publishes each
# outbox row to a throwaway NATS JetStream server; the reference consumer (examples/consumer) reads
# them back with deduplication and per-feature ordering. Ends with a report, and fails unless the
# consumer received exactly one event per edit and the outbox backlog is empty. Then an area
# subscriber for Kansas (by subject filter alone) starts empty, backfills its area, and follows a
# county moving out, one moving inside and one retiring, next to the whole-country consumer. Last,
# Martin serves the counties behind Varnish, an expire output purges the tiles of a few Kansas edits,
# and every warmed tile through Varnish is compared with Martin's fresh render (demo/tiles_demo.py,
# which also draws the purged tiles).
#
# Environment:
#   DEMO_LIMIT=N          at most N counties (CI: 300); edit counts scale with it
#   DEMO_DATA=FILE        GeoJSONL input (default .cache/data/us-counties.geojsonl, as the tests: copied
#                         from ../shared, or rebuilt from npm us-atlas 3.0.1, by scripts/county_data.sh)
#   DEMO_SKIP_INSTALL=1   use the feature_outbox already installed instead of building a release one
#   DEMO_DIR=DIR          working directory (default /var/tmp/feature_outbox_demo), fresh each run
#   DEMO_PG_PORT, DEMO_NATS_PORT   ports (default: free ones)
#   DEMO_TIMEOUT=SECONDS  how long to wait for the relay to drain the outbox (default 120)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PG_BIN=/usr/lib/postgresql/${FEATURE_OUTBOX_PG:-15}/bin   # 15, or the major of the root (make demo PG=N)
PG_CONFIG=$PG_BIN/pg_config
PY=${FEATURE_OUTBOX_VENV:-$ROOT/.venv}/bin/python
CONSUMER=${CARGO_TARGET_DIR:-$ROOT/target}/consumer/release/feature_outbox_consumer
DEMO_DIR=${DEMO_DIR:-/var/tmp/feature_outbox_demo}
DEMO_TIMEOUT=${DEMO_TIMEOUT:-120}
STREAM=FEATURES          # feature_outbox.nats_stream's default; subjects features.<layer>.<action>.<cell>

step() { printf '\n== %s\n' "$*"; }
fail() { printf '\nDEMO FAILED: %s\n' "$*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# ---------------------------------------------------------------------------------------------------
step "1. Install what is missing, build"
# The counties, before the clock starts: the checkout's cache (make demo's setup has filled it).
DEMO_DATA=${DEMO_DATA:-$(bash scripts/county_data.sh)}
if [ "${DEMO_SKIP_INSTALL:-}" = 1 ]; then
  echo "DEMO_SKIP_INSTALL=1: using the installed feature_outbox ($(stat -c '%y' "$($PG_CONFIG --pkglibdir)/feature_outbox.so" | cut -c1-19))"
else
  PG_CONFIG=$PG_CONFIG bash scripts/install.sh release
fi
cargo build --release --locked --quiet --manifest-path examples/consumer/Cargo.toml --target-dir "${CARGO_TARGET_DIR:-$ROOT/target}/consumer"
echo "consumer: $CONSUMER"
# Step 9's tile server and cache: Martin from crates.io (about 7 minutes, once per machine) and
# Debian's Varnish with varnish-modules.
bash scripts/tools.sh martin varnish
T0=$(now)   # the clock for "well under 5 minutes after the build"

# ---------------------------------------------------------------------------------------------------
step "2. Throwaway PostgreSQL $($PG_BIN/postgres --version | cut -d" " -f3) and NATS JetStream"
mkdir -p "$DEMO_DIR"
chmod 755 "$DEMO_DIR"   # the postgres user must reach $DEMO_DIR/pg
RUN=$DEMO_DIR/run; NATS_STORE=$DEMO_DIR/nats
rm -rf "$RUN" "$NATS_STORE"; mkdir -p "$RUN"
read -r free1 free2 < <("$PY" -c 'import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*(x.getsockname()[1] for x in s))')
PG_PORT=${DEMO_PG_PORT:-$free1}; NATS_PORT=${DEMO_NATS_PORT:-$free2}
NATS_URL=nats://127.0.0.1:$NATS_PORT

NATS_PID=""; CONSUMER_PID=""; AREA_PID=""; CLUSTER_STARTED=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  [ -n "$CONSUMER_PID" ] && kill "$CONSUMER_PID" 2>/dev/null || true
  [ -n "$AREA_PID" ] && kill "$AREA_PID" 2>/dev/null || true
  [ -n "$CLUSTER_STARTED" ] && scripts/cluster.sh stop "$DEMO_DIR/pg" || true
  if [ -n "$NATS_PID" ]; then kill "$NATS_PID" 2>/dev/null || true; wait "$NATS_PID" 2>/dev/null || true; fi
  [ "$rc" -eq 0 ] || echo "logs: $DEMO_DIR/pg/server.log, $DEMO_DIR/nats-server.log" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A fresh store every run: no stream, no durable consumer left over from the last one.
nats-server -js -a 127.0.0.1 -p "$NATS_PORT" -sd "$NATS_STORE" -l "$DEMO_DIR/nats-server.log" &
NATS_PID=$!
for _ in $(seq 100); do
  kill -0 "$NATS_PID" 2>/dev/null || fail "nats-server exited: $(tail -5 "$DEMO_DIR/nats-server.log")"
  (exec 3<>"/dev/tcp/127.0.0.1/$NATS_PORT") 2>/dev/null && break
  sleep 0.1
done
echo "nats-server $NATS_URL (store $NATS_STORE, pid $NATS_PID)"

CLUSTER_STARTED=1
scripts/cluster.sh start "$DEMO_DIR/pg" "$PG_PORT" \
  "feature_outbox.database = 'demo'" \
  "feature_outbox.endpoint = '$NATS_URL'"
echo "postgres 127.0.0.1:$PG_PORT (data $DEMO_DIR/pg/data, log $DEMO_DIR/pg/server.log)"
export PGHOST=127.0.0.1 PGPORT=$PG_PORT PGUSER=postgres PGDATABASE=demo
psql() { "$PG_BIN/psql" -X -v ON_ERROR_STOP=1 "$@"; }

# ---------------------------------------------------------------------------------------------------
step "3. Database demo with the extension"
psql -d postgres -qc "CREATE DATABASE demo"
psql -qc "CREATE EXTENSION feature_outbox CASCADE"
psql -Atc "SELECT 'extensions: ' || string_agg(extname || ' ' || extversion, ', ' ORDER BY extname) FROM pg_extension WHERE extname <> 'plpgsql'"

# The relay worker started with the server, before database demo existed: it waited for the
# database without connecting, and attaches about a second after CREATE DATABASE. Wait for it, so the load below runs against a live relay (the guide's gotcha 4: a relay that is
# not running is otherwise noticed only through the backlog).
echo "waiting for the relay worker to attach to database demo"
T_WAIT=$(now)
until [ "$(psql -Atc "SELECT relay_workers_running FROM feature_outbox.backlog")" -ge 1 ]; do
  if [ "$(awk -v s="$(since "$T_WAIT")" 'BEGIN { print (s > 30) }')" = 1 ]; then
    psql -xc "SELECT * FROM feature_outbox.workers"
    grep -E 'feature_outbox|FATAL|PANIC' "$DEMO_DIR/pg/server.log" | tail -10 || true
    fail "no relay worker is running for database demo after 30 s"
  fi
  sleep 0.2
done
echo "relay worker running after $(since "$T_WAIT") s:"
psql -c "SELECT worker, pid, state FROM feature_outbox.workers"

# ---------------------------------------------------------------------------------------------------
step "4. The counties"
echo "$DEMO_DATA: $(wc -l <"$DEMO_DATA") counties"
export DEMO_DATA

# The relay is paused during the load (an endpoint nobody listens on), so the backlog builds up and
# the drain below is the relay's own speed, not the editor's.
reload_endpoint() { psql -qc "ALTER SYSTEM SET feature_outbox.endpoint = '$1'" -c "SELECT pg_reload_conf()" >/dev/null; }
reload_endpoint "nats://127.0.0.1:1"
echo "relay paused (feature_outbox.endpoint -> nats://127.0.0.1:1) while the counties load"

# Steps 4 and 5 are one client program: it creates the counties, then edits them.
step "4-5. Load and edit through edit_feature (demo/load_counties.py)"
T_LOAD=$(now)
"$PY" demo/load_counties.py --summary "$RUN/load.json"
LOAD_SECONDS=$(since "$T_LOAD")
EDITS=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["edits"])' "$RUN/load.json")

# ---------------------------------------------------------------------------------------------------
step "6. Consume, and wait for the relay to drain the outbox"
psql -xc "SELECT * FROM feature_outbox.backlog" >"$RUN/backlog_before.txt"
PEAK=$(psql -Atc "SELECT unpublished_rows FROM feature_outbox.backlog")
echo "backlog with the relay paused: $PEAK unpublished rows"
# Unpausing ends the worker's backoff at once: a changed sink setting does.
reload_endpoint "$NATS_URL"
T_DRAIN=$(now)
echo "relay resumed (feature_outbox.endpoint -> $NATS_URL)"

# Durable name: the NATS store is new each run, so a fixed name starts from the stream's beginning.
"$CONSUMER" --server "$NATS_URL" --stream "$STREAM" --durable demo-consumer \
  --expect "$EDITS" --idle-timeout 30 >"$RUN/consumer.json" &
CONSUMER_PID=$!

deadline=$(( $(date +%s) + DEMO_TIMEOUT ))
while :; do
  backlog=$(psql -Atc "SELECT unpublished_rows FROM feature_outbox.backlog")
  [ "$backlog" = 0 ] && break
  kill -0 "$NATS_PID" 2>/dev/null || fail "nats-server exited: $(tail -3 "$DEMO_DIR/nats-server.log")"
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "backlog still $backlog after ${DEMO_TIMEOUT}s. Relay state:"
    psql -xc "SELECT * FROM feature_outbox.backlog" -c "SELECT * FROM feature_outbox.workers"
    psql -c "SELECT last_error, count(*) FROM feature_outbox.outbox WHERE published_at IS NULL GROUP BY 1"
    grep -E 'feature_outbox|ERROR|WARNING|PANIC|FATAL' "$DEMO_DIR/pg/server.log" | tail -20 || true
    fail "the relay did not publish the outbox (unpublished_rows = $backlog)"
  fi
  sleep 0.5
done
echo "backlog: 0 unpublished rows, $(since "$T_DRAIN") s after the relay resumed"
set +e; wait "$CONSUMER_PID"; consumer_rc=$?; set -e
CONSUMER_PID=""
[ "$consumer_rc" -eq 0 ] || fail "the consumer exited with status $consumer_rc"

# ---------------------------------------------------------------------------------------------------
step "7. An area subscriber for Kansas, next to the whole-country one"
# The area: Kansas's counties (of those loaded), as one GeoJSON MultiPolygon in degrees.
AREA_STATE=20
psql -Atc "SELECT ST_AsGeoJSON(ST_Multi(ST_Union(ST_Transform(geom, 4326))))
             FROM public.counties WHERE state_fips = '$AREA_STATE' AND retired_at IS NULL" >"$RUN/kansas.geojson"
# Three edits for it: one county moved out of the state (onto the shape of the county farthest
# away), one moved a little inside it, one retired.
read -r OUT_FIPS FAR_FIPS IN_FIPS GONE_FIPS < <(psql -AtF' ' -c "
  WITH k AS (SELECT fips, geom FROM public.counties WHERE state_fips = '$AREA_STATE' AND retired_at IS NULL ORDER BY fips)
  SELECT (SELECT fips FROM k LIMIT 1),
         (SELECT c.fips FROM public.counties c WHERE c.state_fips <> '$AREA_STATE' AND c.retired_at IS NULL
           ORDER BY ST_Distance(c.geom, (SELECT geom FROM k LIMIT 1)) DESC LIMIT 1),
         (SELECT fips FROM k OFFSET 1 LIMIT 1), (SELECT fips FROM k OFFSET 2 LIMIT 1)")
# Both consumers run at once. The whole-country one resumes its durable consumer; the area one is
# new, so it subscribes from now on and asks for a backfill of its area (EXECUTE on backfill: the
# demo connects as the superuser).
"$CONSUMER" --server "$NATS_URL" --stream "$STREAM" --durable demo-consumer --idle-timeout 10 >"$RUN/consumer2.json" &
CONSUMER_PID=$!
"$CONSUMER" --server "$NATS_URL" --stream "$STREAM" --durable demo-kansas --area "$RUN/kansas.geojson" --layer counties \
  --backfill-dsn "host=127.0.0.1 port=$PG_PORT user=postgres dbname=demo" --idle-timeout 10 >"$RUN/area.json" &
AREA_PID=$!
# The snapshots go out first; then the edits, each after its feature's snapshot.
until [ "$(psql -Atc "SELECT count(*) FROM feature_outbox.outbox WHERE event_type = 'snapshot'")" -gt 0 ]; do
  kill -0 "$AREA_PID" 2>/dev/null || fail "the area consumer exited before its backfill"
  sleep 0.2
done
psql -q <<SQL
SELECT feature_outbox.edit_feature('counties', $OUT_FIPS, (SELECT ST_Transform(geom, 4326) FROM public.counties WHERE fips = $FAR_FIPS), 'moved');
SELECT feature_outbox.edit_feature('counties', $IN_FIPS, (SELECT ST_Translate(ST_Transform(geom, 4326), 0.02, 0.01) FROM public.counties WHERE fips = $IN_FIPS), 'moved');
SELECT feature_outbox.edit_feature('counties', $GONE_FIPS, NULL::text, 'retired');
SQL
SNAPSHOTS=$(psql -Atc "SELECT count(*) FROM feature_outbox.outbox WHERE event_type = 'snapshot'")
echo "backfill: $SNAPSHOTS snapshot events; then county $OUT_FIPS moved out of the state, $IN_FIPS moved inside it, $GONE_FIPS retired"
set +e; wait "$AREA_PID"; area_rc=$?; wait "$CONSUMER_PID"; consumer_rc=$?; set -e
CONSUMER_PID=""; AREA_PID=""
[ "$area_rc" -eq 0 ] && [ "$consumer_rc" -eq 0 ] || fail "a consumer exited with status $area_rc / $consumer_rc"

# ---------------------------------------------------------------------------------------------------
step "8. Report"
psql -xc "SELECT * FROM feature_outbox.backlog" >"$RUN/backlog_after.txt"
BACKLOG_AFTER=$(psql -Atc "SELECT unpublished_rows FROM feature_outbox.backlog")
psql -Atc "SELECT json_build_object(
             'rows', count(*),
             'seconds', extract(epoch FROM max(published_at) - min(published_at)))
           FROM feature_outbox.outbox" >"$RUN/relay.json"

"$PY" - "$RUN" "$LOAD_SECONDS" "$(since "$T0")" "$BACKLOG_AFTER" "$PEAK" "$SNAPSHOTS" <<'EOF'
import json, sys
run, load_s, total_s, backlog, peak = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
snapshots = int(sys.argv[6])
whole = json.load(open(f"{run}/consumer2.json"))  # the whole-country consumer, resumed for step 7
area = json.load(open(f"{run}/area.json"))        # the Kansas consumer
load = json.load(open(f"{run}/load.json"))
got = json.load(open(f"{run}/consumer.json"))   # the consumer's one-line summary
relay = json.load(open(f"{run}/relay.json"))    # from the outbox: created_at and published_at
relay_rate = relay["rows"] / relay["seconds"] if relay["seconds"] else 0

print(f"""edits made             {load['edits']:>7}   ({load['created']} created, {load['moved']} moved, {load['updated']} updated, {load['retired']} retired)
unique events received {got['unique_events']:>7}   {json.dumps(got['by_action'], sort_keys=True)}
departure notices      {got['departures']:>7}   (moves out of a cell, published again on the cell left)
duplicates seen        {got['duplicates']:>7}   (messages redelivered by JetStream: {got['redelivered']})
stale events dropped   {got['stale_dropped']:>7}   (geometry_version older than one already applied)
later geometry seen    {got['later_geometry_seen']:>7}   (event_version < geometry_version; counties edited twice in one transaction: {load['moved_twice_features']})
envelope mismatches    {got['header_mismatches']:>7}   (subject or headers disagreeing with the body; malformed: {got['malformed']})
invalid shapes         {load['invalid_input']:>7}   (policy {load['invalid_policy']}: {load['invalid_stored']} stored invalid, {load['rejected']} rejected)
consumer events/s      {got['events_per_second']:>7.0f}   (draining the stream: {got['unique_events']} in {got['receive_seconds']} s, stopped by {got['stopped_by']})
relay events/s         {relay_rate:>7.0f}   (draining the {relay['rows']}-row backlog built while paused, in {relay['seconds']:.2f} s, 1 worker; make bench measures more)
load + edits           {load_s:>7.1f} s (creates {load['load_seconds']} s, edits {load['edit_seconds']} s)
total after the build  {total_s:>7.1f} s
""")
print("backlog at its peak, relay paused:\n" + open(f"{run}/backlog_before.txt").read())
print("backlog after consuming:\n" + open(f"{run}/backlog_after.txt").read())
if got["sample_event"]:
    print("one event, as the consumer received it (geometry on one line):")
    event = dict(got["sample_event"])
    inline = {k: event[k] for k in ("geometry", "bbox", "previous_bbox") if k in event}
    for k in inline:
        event[k] = f"@{k}@"
    text = json.dumps(event, indent=2)
    for k, v in inline.items():
        text = text.replace(f'"@{k}@"', json.dumps(v))
    print(text)
print("\nthe 5 busiest routing cells (H3 resolution 8, unique events):")
for c in got["busiest_cells"]:
    print(f"  {c['routing_key']}  {c['events']}")

a = area["area"]
print(f"""
step 7, side by side           whole country   Kansas (by subject: {a['cells']} res-{a['resolution']} cells)
  unique events received       {whole['unique_events']:>13}   {area['unique_events']:>7}   {json.dumps(area['by_action'], sort_keys=True)}
  departure notices            {whole['departures']:>13}   {area['departures']:>7}
  features entering the area                   {a['entered']:>7}   (the backfill's snapshots)
  features leaving it                          {a['left']:>7}   (moved out: departed; retired)
  moves inside it (departed, kept)             {a['departed_within']:>7}
  live features in the area at the end         {a['live_features']:>7}
""")

# The report's claims, asserted.
problems = []
if whole["unique_events"] != snapshots + 3:
    problems.append(f"the whole-country consumer got {whole['unique_events']} new events, not {snapshots} snapshots + 3 edits")
if area["by_action"].get("snapshot") != snapshots or a["entered"] != snapshots:
    problems.append(f"the Kansas consumer got {area['by_action'].get('snapshot')} snapshots of {snapshots}, {a['entered']} entered")
if a["left"] != 2 or a["live_features"] != snapshots - 2:
    problems.append(f"the Kansas consumer saw {a['left']} features leave (expected 2) and keeps {a['live_features']} (expected {snapshots - 2})")
if whole["header_mismatches"] or area["header_mismatches"]:
    problems.append("step 7: events disagree with their envelope")
if got["unique_events"] != load["edits"]:
    problems.append(f"unique events received {got['unique_events']} != edits made {load['edits']}")
if peak != load["edits"]:
    problems.append(f"the paused relay's backlog peaked at {peak} rows, not one per edit ({load['edits']})")
if backlog != 0:
    problems.append(f"backlog after is {backlog} unpublished rows, not 0")
if got["header_mismatches"] or got["malformed"]:
    problems.append(f"{got['header_mismatches']} events disagree with their envelope, {got['malformed']} malformed")
if problems:
    print("\nDEMO FAILED: " + "; ".join(problems), file=sys.stderr)
    sys.exit(1)
print(f"\nOK: {got['unique_events']} unique events received for {load['edits']} edits; backlog 0")
EOF

# ---------------------------------------------------------------------------------------------------
step "9. Tiles that never go stale: Martin behind Varnish, purged by an expire output"
"$PY" demo/tiles_demo.py "host=127.0.0.1 port=$PG_PORT user=postgres dbname=demo" "$RUN" || fail "the tiles step failed"
