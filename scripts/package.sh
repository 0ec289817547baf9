#!/usr/bin/env bash
# Builds the Debian binary package of the extension for the PostgreSQL of $PG_CONFIG:
#   dist/postgresql-N-feature-outbox_<version>-1_amd64.deb
# with scripts/stage.sh (cargo pgrx package plus the frozen install scripts of earlier releases, as
# for scripts/install.sh) and dpkg-deb; Depends: postgresql-N, postgresql-N-postgis-3 and what dpkg-shlibdeps
# finds the library links. Run it where that major's Debian is (`make package PG=N`: the host for
# 15, the root of 17 or 18 otherwise), so the dependencies are that release's.
#   package.sh                        this tree
#   package.sh --src DIR              the tree at DIR (another release's checkout), with its own
#                                     Cargo.toml version; the deb still goes into this repo's dist/
#   package.sh --release-commit SHA   a `git worktree add --detach` of SHA in a temporary directory,
#                                     built as --src, then removed (release commits: sql/released/RELEASES)
# Builds go under ${CARGO_TARGET_DIR:-target}: this tree's in the usual release directory (shared
# with scripts/install.sh), another tree's in its own subdirectory src-<version>.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
PG_CONFIG=${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}
say() { echo "package: $*" >&2; }
die() { say "error: $*"; exit 1; }

src="$REPO" commit=""
while [ $# -gt 0 ]; do
  case "$1" in
    --src) src="$(cd "${2:?--src DIR}" && pwd -P)"; shift 2 ;;
    --release-commit) commit="${2:?--release-commit SHA}"; shift 2 ;;
    *) die "unknown argument $1 (package.sh [--src DIR | --release-commit SHA])" ;;
  esac
done
for tool in dpkg-deb dpkg-shlibdeps cargo; do
  command -v "$tool" >/dev/null || die "$tool is missing (dpkg-dev, or make setup)"
done
[ -x "$PG_CONFIG" ] || die "no pg_config at $PG_CONFIG"
major="$("$PG_CONFIG" --version | sed -n 's/^PostgreSQL \([0-9][0-9]*\).*/\1/p')"
[ -n "$major" ] || die "cannot read the major of $("$PG_CONFIG" --version)"

work="$(mktemp -d "${TMPDIR:-/tmp}/feature_outbox_package.XXXXXX")"
worktree=""
cleanup() {
  if [ -n "$worktree" ]; then git -C "$REPO" worktree remove --force "$worktree" || say "warning: git worktree remove $worktree failed"; fi
  rm -rf "$work"
}
trap cleanup EXIT

if [ -n "$commit" ]; then
  worktree="$work/src"
  git -C "$REPO" worktree add --detach "$worktree" "$commit" >&2
  src="$worktree"
fi

# The [package] version of the tree's Cargo.toml.
version="$(awk '/^\[/ { p = ($0 == "[package]") } p && /^version *=/ { gsub(/^version *= *"|".*$/, ""); print; exit }' "$src/Cargo.toml")"
[ -n "$version" ] || die "no [package] version in $src/Cargo.toml"
pkg="postgresql-$major-feature-outbox"
debver="$version-1"
deb="$REPO/dist/${pkg}_${debver}_amd64.deb"

target="${CARGO_TARGET_DIR:-$REPO/target}"
case "$target" in /*) ;; *) target="$REPO/$target" ;; esac
if [ "$src" != "$REPO" ]; then target="$target/src-$version"; fi   # never evicts this tree's build
out="$target/deb-pg$major"                                          # cargo pgrx package's output

t=$SECONDS
say "building feature_outbox $version for PostgreSQL $major ($PG_CONFIG) from $src"
CARGO_TARGET_DIR="$target" PG_CONFIG="$PG_CONFIG" bash "$REPO/scripts/stage.sh" "$src" "$out"
say "cargo pgrx package $((SECONDS - t)) s"

libdir="$("$PG_CONFIG" --pkglibdir)"          # /usr/lib/postgresql/N/lib
extdir="$("$PG_CONFIG" --sharedir)/extension"  # /usr/share/postgresql/N/extension
[ -f "$out$libdir/feature_outbox.so" ] || die "cargo pgrx package wrote no $libdir/feature_outbox.so"
[ -f "$out$extdir/feature_outbox.control" ] || die "cargo pgrx package wrote no $extdir/feature_outbox.control"

# The package tree, in the layout dpkg-shlibdeps expects (debian/control, debian/<package>/...).
root="$work/debian/$pkg"
install -d -m 0755 "$root$libdir" "$root$extdir" "$root/usr/share/doc/$pkg" "$root/DEBIAN"
install -m 0644 "$out$libdir/feature_outbox.so" "$root$libdir/feature_outbox.so"
# As dh_strip does for a shared library: the dynamic symbols stay, the rest goes.
if command -v strip >/dev/null; then
  strip --remove-section=.comment --remove-section=.note --strip-unneeded "$root$libdir/feature_outbox.so"
fi
# The staging tree has every install and upgrade script (scripts/stage.sh).
for f in "$out$extdir"/feature_outbox*; do install -m 0644 "$f" "$root$extdir/"; done
[ -e "$root$extdir/feature_outbox--$version.sql" ] || die "no install script feature_outbox--$version.sql"

cat >"$root/usr/share/doc/$pkg/copyright" <<EOF
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: feature_outbox
Comment: PostgreSQL extension feature_outbox $version, built for PostgreSQL $major with cargo-pgrx.

Files: *
Copyright: feature_outbox maintainers
License: Apache-2.0

License: Apache-2.0
 Licensed under the Apache License, Version 2.0 (the "License"); you may not use this
 file except in compliance with the License. You may obtain a copy of the License at
 http://www.apache.org/licenses/LICENSE-2.0
 .
 On Debian systems, the full text of the Apache License 2.0 is in
 /usr/share/common-licenses/Apache-2.0.
EOF
chmod 0644 "$root/usr/share/doc/$pkg/copyright"

# The shared libraries the .so links (libc, libgcc, PROJ, ...), as this release's package names.
# Symbols it takes from the postgres executable resolve in none of them: hence --warnings=0.
printf 'Source: feature-outbox\n\nPackage: %s\nArchitecture: amd64\n' "$pkg" >"$work/debian/control"
shlibs="$(cd "$work" && dpkg-shlibdeps -O --warnings=0 -e"debian/$pkg$libdir/feature_outbox.so" 2>"$work/shlibdeps.log")" \
  || { cat "$work/shlibdeps.log" >&2; die "dpkg-shlibdeps failed"; }
shlibs="${shlibs#shlibs:Depends=}"
[ -n "$shlibs" ] || die "dpkg-shlibdeps found no dependencies"
say "dpkg-shlibdeps: $shlibs"
rm -f "$work/debian/control"

cat >"$root/DEBIAN/control" <<EOF
Package: $pkg
Version: $debver
Architecture: amd64
Maintainer: feature_outbox maintainers <maintainers@users.noreply.a-seed-a9cdfa2f.example>
Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)
Depends: postgresql-$major, postgresql-$major-postgis-3, $shlibs
Section: database
Priority: optional
Description: transactional outbox for PostGIS feature edits, for PostgreSQL $major
 The PostgreSQL extension feature_outbox writes a map feature and a thin outbox
 row in one transaction (edit_feature, record_edit, on the built-in table or on
 the application's own layers), with an H3 routing key computed in the database.
 Background workers relay each committed row to NATS JetStream or an HTTP
 webhook and mark it sent once the sink acknowledged it.
 .
 Preload it (shared_preload_libraries = 'feature_outbox'), set
 feature_outbox.database and feature_outbox.endpoint, restart, then
 CREATE EXTENSION feature_outbox CASCADE. Upgrades: install the new package,
 restart PostgreSQL, ALTER EXTENSION feature_outbox UPDATE.
EOF
chmod 0644 "$root/DEBIAN/control"
find "$root" -type d -exec chmod 0755 {} +

mkdir -p "$REPO/dist"
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb.tmp" >/dev/null
mv -f "$deb.tmp" "$deb"
echo "$deb"
dpkg-deb -I "$deb" | sed -n '/^ Package:/,/^ Description:/p'
dpkg-deb -c "$deb" | awk '{ print "  " $1, $2, $6 }'
say "$(basename "$deb") in $((SECONDS - t)) s"
