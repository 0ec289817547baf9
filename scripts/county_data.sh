#!/usr/bin/env bash
# The US county data (one GeoJSON object a line) that the tests, the demo, the benchmarks and
# scripts/make_routing_fixture.py read: makes sure .cache/data/us-counties.geojsonl exists in the
# checkout (git ignores .cache), then prints its path. Filled once, by one of:
#   - a copy of $FEATURE_OUTBOX_SHARED/data/us-counties.geojsonl (default: ../shared beside the
#     checkout), when there is one: no network needed;
#   - a rebuild, as that copy was made: demo/build_counties.js over the npm packages us-atlas 3.0.1
#     and topojson-client 3.1.0. Needs node and npm, which scripts/setup.sh installs when this
#     path will be taken. It gives the shared copy byte for byte, so both paths give the same tests.
# The file is written under a temporary name and renamed into place, under a lock, so a reader
# never sees a partial file and two callers at once build it once.
#   scripts/county_data.sh              ensure the file, print its path
#   scripts/county_data.sh --needs-npm  exit 0 if ensuring it would take the npm path
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=$ROOT/.cache/data
OUT=$CACHE/us-counties.geojsonl
SHARED=${FEATURE_OUTBOX_SHARED:-$(dirname "$ROOT")/shared}/data/us-counties.geojsonl
NPM_PACKAGES=(us-atlas@3.0.1 topojson-client@3.1.0)

if [ "${1:-}" = --needs-npm ]; then
  [ ! -s "$OUT" ] && [ ! -s "$SHARED" ]
  exit
fi

if [ ! -s "$OUT" ]; then
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.lock"
  flock 9
fi
# Checked again under the lock: another caller may have filled it meanwhile.
if [ ! -s "$OUT" ]; then
  started=$(date +%s.%N)
  tmp=$(mktemp -d "$CACHE/.build.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  if [ -s "$SHARED" ]; then
    cp "$SHARED" "$tmp/out"
    how="copied from $SHARED"
  else
    for tool in node npm; do
      command -v "$tool" >/dev/null 2>&1 \
        || { echo "county_data: $SHARED is missing and rebuilding it needs $tool: run scripts/setup.sh" >&2; exit 1; }
    done
    echo "county_data: $SHARED is missing: rebuilding it from npm ${NPM_PACKAGES[*]}" >&2
    npm install --no-save --no-audit --no-fund --loglevel=error --prefix "$tmp/npm" "${NPM_PACKAGES[@]}" >&2
    node "$ROOT/demo/build_counties.js" "$tmp/npm/node_modules" >"$tmp/out"
    how="rebuilt from npm"
  fi
  [ -s "$tmp/out" ] || { echo "county_data: the county data came out empty" >&2; exit 1; }
  chmod 644 "$tmp/out"   # readable by all whatever the umask, as the shared copy is
  mv -f "$tmp/out" "$OUT"
  echo "county_data: $OUT $how, $(wc -l <"$OUT") lines, in $(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s" >&2
fi
echo "$OUT"
