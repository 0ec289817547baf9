#!/usr/bin/env bash
# Installs the extension into the Debian PostgreSQL of $PG_CONFIG (15 by default) without disturbing a running server:
# `cargo pgrx package` builds the files, the frozen install scripts of earlier releases join them,
# then each is written under a temporary name and renamed over the old one. A server that mapped
# the old library keeps its copy; writing the .so in place (as an install can) crashes it.
#   install.sh release|debug [cargo features]
set -euo pipefail
cd "$(dirname "$0")/.."
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
profile=${1:?release or debug}; shift
features="$*"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo

out="${CARGO_TARGET_DIR:-target}/package-$profile"
rm -rf "$out"
args=(--pg-config "$PG_CONFIG" --out-dir "$out")
[ "$profile" = debug ] && args+=(--debug)
[ -n "$features" ] && args+=(--features "$features")
cargo pgrx package "${args[@]}"

# cargo-pgrx writes the current version's install script and copies the upgrade scripts
# (sql/feature_outbox--A--B.sql). The frozen install scripts of earlier releases must be installed
# too, so that `CREATE EXTENSION feature_outbox VERSION 'A'` and every upgrade path keep working.
extdir="$out$("$PG_CONFIG" --sharedir)/extension"
for frozen in sql/feature_outbox--*.sql; do
  name=$(basename "$frozen")
  case "$name" in *--*--*) continue ;; esac       # an upgrade script: cargo-pgrx copied it
  [ -e "$extdir/$name" ] || cp "$frozen" "$extdir/$name"  # never over the generated current script
done

find "$out" -type f | while read -r file; do
  dest="/${file#"$out"/}"
  $SUDO install -D -m 0644 "$file" "$dest.new.$$"
  $SUDO mv -f "$dest.new.$$" "$dest"
done
echo "installed feature_outbox ($profile${features:+, $features}) into $("$PG_CONFIG" --pkglibdir)"
