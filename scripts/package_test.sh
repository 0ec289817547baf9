#!/usr/bin/env bash
# The package tests of PostgreSQL major N (make package-test PG=N), on the host as root: the debs in
# dist/ installed in clean roots of N's Debian release (scripts/pgroot.sh run clean-N), driven by
# pg_test/package_check.py with the host's venv. See that file for the parts:
#   15: quick start + dpkg -r, 0.2.0 -> current upgrade
#   17: quick start + dpkg -r, 0.2.0 -> current upgrade, pg_dump of a host PostgreSQL 15 restored
#   18: quick start + dpkg -r, pg_dump of a host PostgreSQL 15 restored
#   package_test.sh N [quickstart|upgrade|dump ...]   only those parts
# It needs dist/postgresql-N-feature-outbox_<version>-1_amd64.deb (and the 0.2.0 one for 15 and 17),
# and for the dump part the host's PostgreSQL 15 with the extension installed (make install).
# FEATURE_OUTBOX_PACKAGE_BUILD=1 builds the missing debs first instead of failing.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO"
major="${1:?usage: package_test.sh 15|17|18 [part ...]}"
shift
case "$major" in 15 | 17 | 18) ;; *) echo "package_test.sh: majors 15, 17, 18" >&2; exit 2 ;; esac
[ "$(id -u)" -eq 0 ] || exec sudo -E -- bash "$0" "$major" "$@"

RELEASE_020=$(awk '$1 == "0.2.0" { print $2 }' sql/released/RELEASES)   # its release commit
version="$(awk '/^\[/ { p = ($0 == "[package]") } p && /^version *=/ { gsub(/^version *= *"|".*$/, ""); print; exit }' Cargo.toml)"
VENV="$REPO/.venv"
[ -x "$VENV/bin/python" ] || { echo "package_test.sh: no $VENV: run make setup (or make test) first" >&2; exit 1; }

# build_cmd VERSION: the command that builds that deb for this major.
build_cmd() {
  local args=""
  [ "$1" = "$version" ] || args=" --release-commit $RELEASE_020"
  if [ "$major" = 15 ] && [ -z "$args" ]; then echo "make package PG=15"
  elif [ "$major" = 15 ]; then echo "PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config bash scripts/package.sh$args"
  elif [ -z "$args" ]; then echo "make package PG=$major"
  else echo "bash scripts/pgroot.sh run $major bash scripts/package.sh$args"
  fi
}

needed=("$version")   # the 0.2.0 deb only for the upgrade part (15 and 17 run it by default)
if [ $# -eq 0 ]; then case "$major" in 15 | 17) needed+=(0.2.0) ;; esac
else for part in "$@"; do [ "$part" != upgrade ] || needed+=(0.2.0); done
fi
missing=0
for v in "${needed[@]}"; do
  deb="dist/postgresql-$major-feature-outbox_${v}-1_amd64.deb"
  [ -s "$deb" ] && continue
  if [ "${FEATURE_OUTBOX_PACKAGE_BUILD:-}" = 1 ]; then
    echo "package_test.sh: building $deb: $(build_cmd "$v")"
    bash -c "$(build_cmd "$v")"
  else
    echo "package_test.sh: $deb is missing; build it with: $(build_cmd "$v")" >&2
    missing=1
  fi
done
[ "$missing" = 0 ] || { echo "package_test.sh: (or run with FEATURE_OUTBOX_PACKAGE_BUILD=1 to build what is missing)" >&2; exit 1; }

exec "$VENV/bin/python" pg_test/package_check.py "$major" "$@"
