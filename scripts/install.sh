#!/usr/bin/env bash
# Installs the extension into the Debian PostgreSQL of $PG_CONFIG (15 by default) without disturbing a running server:
# scripts/stage.sh builds the files (cargo pgrx package and the frozen install scripts of earlier
# releases), then each is written under a temporary name and renamed over the old one. A server that mapped
# the old library keeps its copy; writing the .so in place (as an install can) crashes it.
#   install.sh release|debug [cargo features]
set -euo pipefail
cd "$(dirname "$0")/.."
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
profile=${1:?release or debug}; shift
features="$*"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo

out="${CARGO_TARGET_DIR:-target}/package-$profile"
case "$out" in /*) ;; *) out="$PWD/$out" ;; esac
args=()
[ "$profile" = debug ] && args+=(--debug)
[ -n "$features" ] && args+=(--features "$features")
PG_CONFIG=$PG_CONFIG bash scripts/stage.sh "$PWD" "$out" "${args[@]}"

find "$out" -type f | while read -r file; do
  dest="/${file#"$out"/}"
  $SUDO install -D -m 0644 "$file" "$dest.new.$$"
  $SUDO mv -f "$dest.new.$$" "$dest"
done
echo "installed feature_outbox ($profile${features:+, $features}) into $("$PG_CONFIG" --pkglibdir)"
