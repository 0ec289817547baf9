#!/usr/bin/env bash
# Builds the extension's files for the PostgreSQL of $PG_CONFIG into a staging tree, as they are to
# be installed: `cargo pgrx package` (the library, the control file, the current install script and
# the upgrade scripts), plus the frozen install scripts of earlier releases, which cargo-pgrx does
# not copy, so that `CREATE EXTENSION feature_outbox VERSION 'A'` and every upgrade path work.
# Shared by scripts/install.sh (then into the server's directories) and scripts/package.sh (the .deb).
#   stage.sh SRC OUT [cargo pgrx package options...]   SRC: the source tree; OUT: emptied first
set -euo pipefail
src=${1:?source tree}; out=${2:?staging directory}; shift 2
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
rm -rf "$out"
(cd "$src" && cargo pgrx package --pg-config "$PG_CONFIG" --out-dir "$out" "$@")

extdir="$out$("$PG_CONFIG" --sharedir)/extension"
for script in "$src"/sql/feature_outbox--*.sql; do
  name=$(basename "$script")
  case "$name" in
    *--*--*) [ -e "$extdir/$name" ] || { echo "stage: cargo pgrx package did not copy the upgrade script $name" >&2; exit 1; } ;;
    *) [ -e "$extdir/$name" ] || cp "$script" "$extdir/$name" ;;   # never over the generated current script
  esac
done
