#!/usr/bin/env bash
# A copy of the Debian PostgreSQL 15 tree with the feature_outbox build of an earlier commit in it,
# for bench/ab_bench.py (release build with the test-only discard:// sink, as make bench uses).
#   bench/ab_setup.sh COMMIT [DIR]   prints the copy's bin directory (default DIR: /opt/pg-<commit>)
set -euo pipefail
commit=${1:?usage: ab_setup.sh COMMIT [DIR]}
dir=${2:-/opt/pg-${commit:0:12}}
root=$(cd "$(dirname "$0")/.." && pwd)
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
work=$(mktemp -d)
git -C "$root" worktree add --detach "$work/src" "$commit" >&2
trap 'git -C "$root" worktree remove --force "$work/src"; rm -rf "$work"' EXIT
$SUDO rm -rf "$dir"
$SUDO mkdir -p "$dir/usr/lib/postgresql" "$dir/usr/share/postgresql"
$SUDO cp -a /usr/lib/postgresql/15 "$dir/usr/lib/postgresql/"
$SUDO cp -a /usr/share/postgresql/15 "$dir/usr/share/postgresql/"
$SUDO rm -f "$dir"/usr/share/postgresql/15/extension/feature_outbox* "$dir"/usr/lib/postgresql/15/lib/feature_outbox.so
# Its own target directory, kept: a second run builds nothing.
CARGO_TARGET_DIR="$root/target/ab-${commit:0:12}" PG_CONFIG=/usr/lib/postgresql/15/bin/pg_config \
  bash "$root/scripts/stage.sh" "$work/src" "$work/pkg" --features fault-injection >&2
$SUDO cp -a "$work/pkg/usr/." "$dir/usr/"
echo "$dir/usr/lib/postgresql/15/bin"
