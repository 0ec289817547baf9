#!/usr/bin/env bash
# Builds the extension's files for the PostgreSQL of $PG_CONFIG into a staging tree, as they are to
# be installed: `cargo pgrx package` (the library, the control file, the current install script),
# the frozen scripts of released versions (sql/released/, checked against their checksums), and the
# open release's upgrade script generated from sql/updates/ and the install script, so that
# `CREATE EXTENSION feature_outbox VERSION 'A'` and every upgrade path work.
# Shared by scripts/install.sh (then into the server's directories) and scripts/package.sh (the .deb).
#   stage.sh SRC OUT [cargo pgrx package options...]   SRC: the source tree; OUT: emptied first
set -euo pipefail
src=${1:?source tree}; out=${2:?staging directory}; shift 2
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
rm -rf "$out"
(cd "$src" && cargo pgrx package --pg-config "$PG_CONFIG" --out-dir "$out" "$@")

extdir="$out$("$PG_CONFIG" --sharedir)/extension"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$src/Cargo.toml" | head -n 1)
[ -e "$extdir/feature_outbox--$version.sql" ] || { echo "stage: no generated install script for $version" >&2; exit 1; }

if [ ! -d "$src/sql/released" ]; then
  # A tree from before 0.4.0 (package.sh --release-commit): its frozen install scripts sit in sql/,
  # and cargo pgrx package copied its checked-in upgrade scripts.
  for script in "$src"/sql/feature_outbox--*.sql; do
    name=$(basename "$script")
    case "$name" in *--*--*) ;; *) [ -e "$extdir/$name" ] || cp "$script" "$extdir/$name" ;; esac
  done
  exit 0
fi

# Released scripts are frozen: refuse to ship one that changed (sql/released/SHA256SUMS).
(cd "$src/sql/released" && sha256sum --check --quiet --strict SHA256SUMS) \
  || { echo "stage: a released script in sql/released/ differs from SHA256SUMS; released scripts are never edited" >&2; exit 1; }
for script in "$src"/sql/released/feature_outbox--*.sql; do
  name=$(basename "$script")
  [ "$name" != "feature_outbox--$version.sql" ] || { echo "stage: $version is released; bump the version in Cargo.toml" >&2; exit 1; }
  cp "$script" "$extdir/$name"
done

# The open release's upgrade scripts are build output (scripts/upgrade_script.py).
for migration in "$src"/sql/updates/*--"$version".sql; do
  [ -e "$migration" ] || continue
  python3 "$src/scripts/upgrade_script.py" --install "$extdir/feature_outbox--$version.sql" \
    --migration "$migration" --out "$extdir/feature_outbox--$(basename "$migration")"
done
