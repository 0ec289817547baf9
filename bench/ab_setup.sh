#!/usr/bin/env bash
# A copy of the Debian PostgreSQL tree (15, or FEATURE_OUTBOX_PG's major) with the feature_outbox
# build of an earlier commit in it, for bench/ab_bench.py (make bench's section 16, make bench-ab)
# and bench/tiles_bench.py: the release build with the test-only discard:// sink, as make bench uses.
#   bench/ab_setup.sh REF           builds the tree when it is missing or stale, prints its bin directory
#   bench/ab_setup.sh status REF    prints "LABEL COMMIT fresh", "... missing" or "... stale: why"; builds nothing
# REF: a release listed in sql/released/RELEASES (0.3.0), `last` (the last one listed), or a commit.
#
# Built once per machine and commit, like scripts/tools.sh's tools: the tree is used only when the
# STAMP in it, written here after a build, names the same commit and recipe hash as today's (the
# commit, the features, the toolchain, cargo-pgrx, this checkout's scripts/stage.sh, and the
# PostgreSQL and PostGIS files copied) and its library's sha256 is the one the stamp recorded.
# Anything else (a tree copied in by hand, an older recipe, an upgraded PostgreSQL) is rebuilt.
# Trees live in $FEATURE_OUTBOX_AB_TREES (default: target/ab of this checkout), not in the tool
# cache: the postgres user runs them, and the tool cache sits under a private $HOME. The commits'
# sources (git archive) and cargo's build directory stay in $FEATURE_OUTBOX_AB_BUILD (default: the
# trees' build/), so a rebuild after a stale stamp only packages again; cargo's fingerprints, not
# the stamp, decide what of that is reused.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/scripts/stamp.sh"
TREES=${FEATURE_OUTBOX_AB_TREES:-$ROOT/target/ab}
BUILD=${FEATURE_OUTBOX_AB_BUILD:-$TREES/build}
MAJOR=${FEATURE_OUTBOX_PG:-15}
PG_CONFIG=/usr/lib/postgresql/$MAJOR/bin/pg_config
FEATURES=fault-injection
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo

say() { printf 'ab_setup: %s\n' "$*" >&2; }
die() { printf 'ab_setup: ERROR: %s\n' "$*" >&2; exit 1; }

status_only=0
if [ "${1:-}" = status ]; then status_only=1; shift; fi
ref=${1:?usage: ab_setup.sh [status] RELEASE|last|COMMIT}

# The commit and a label (the version for a release).
case "$ref" in
  last) read -r label commit < <(bash "$ROOT/scripts/releases.sh" last) ;;
  [0-9]*.*.*) label=$ref; commit=$(bash "$ROOT/scripts/releases.sh" commit "$ref") ;;
  *) commit=$(git -C "$ROOT" rev-parse --verify --quiet "$ref^{commit}") || die "$ref is neither a release in sql/released/RELEASES nor a commit"
     label=${commit:0:12} ;;
esac
tree=$TREES/pg$MAJOR-${commit:0:12}
lib=$tree/usr/lib/postgresql/$MAJOR/lib/feature_outbox.so
bin=$tree/usr/lib/postgresql/$MAJOR/bin

# Everything that decides what the tree holds. PostgreSQL's and PostGIS's files are copied, so
# theirs count (a Debian upgrade of either makes the tree stale); the system's own feature_outbox
# library is left out (make install changes it, the tree never has it).
recipe_hash() {
  {
    echo "commit=$commit major=$MAJOR features=$FEATURES"
    rustc --version; cargo pgrx --version
    sha256sum "$ROOT/scripts/stage.sh" | cut -c1-64
    find "/usr/lib/postgresql/$MAJOR" -type f \( -name postgres -o -name '*.so' \) ! -name 'feature_outbox*' -print0 \
      | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-64
}

status() {
  local stamp=$tree/STAMP want have
  if [ ! -e "$tree" ]; then echo missing; return; fi
  [ -f "$stamp" ] || { echo "stale: $tree has no stamp (not built by bench/ab_setup.sh, or interrupted)"; return; }
  [ -f "$lib" ] || { echo "stale: the stamp's library $lib is missing"; return; }
  stamp_mismatch "$stamp" "commit=$commit" "major=$MAJOR" "features=$FEATURES" "recipe=$(recipe_hash)" && return
  want=$(sed -n 's/^sha256=//p' "$stamp")
  have=$(sha256sum "$lib" | cut -c1-64)
  [ "$want" = "$have" ] || { echo "stale: $lib is not the library the stamp recorded (sha256 $have, stamp $want)"; return; }
  echo fresh
}

if [ "$status_only" = 1 ]; then echo "$label ${commit:0:12} $(status)"; exit 0; fi

mkdir -p "$TREES" "$BUILD"
exec {lock}>"$BUILD/.${commit:0:12}.lock"
flock -n "$lock" || { say "another build of ${commit:0:12} holds $BUILD/.${commit:0:12}.lock; waiting"; flock "$lock"; }
why=$(status)
if [ "$why" = fresh ]; then
  say "$label (${commit:0:12}): fresh, $(sed -n 's/^built=//p' "$tree/STAMP")"
  echo "$bin"; exit 0
fi
t=$SECONDS
say "$label (${commit:0:12}): $why; building it into $tree (minutes the first time)"
# The sources of a commit never change: extracted once, at a fixed path, so cargo's fingerprints
# hold across rebuilds.
src=$BUILD/src-${commit:0:12}
if [ ! -f "$src/.extracted" ]; then
  rm -rf "$src"; mkdir -p "$src"
  git -C "$ROOT" archive "$commit" | tar -x -C "$src"
  touch "$src/.extracted"
fi
# Into a new folder, stamped last, then moved into place: an interrupted build leaves no tree that
# looks finished.
new=$tree.new
pkg=$BUILD/pkg-${commit:0:12}
$SUDO rm -rf "$new" "$pkg"
$SUDO mkdir -p "$new/usr/lib/postgresql" "$new/usr/share/postgresql"
$SUDO cp -a "/usr/lib/postgresql/$MAJOR" "$new/usr/lib/postgresql/"
$SUDO cp -a "/usr/share/postgresql/$MAJOR" "$new/usr/share/postgresql/"
$SUDO rm -f "$new"/usr/share/postgresql/"$MAJOR"/extension/feature_outbox* "$new/usr/lib/postgresql/$MAJOR/lib/feature_outbox.so"
# A cargo build directory per commit: the library's file name carries no hash, so a second commit
# built in the same directory overwrites the first one's library while cargo still calls it fresh.
CARGO_TARGET_DIR="$BUILD/target-${commit:0:12}" PG_CONFIG=$PG_CONFIG \
  bash "$ROOT/scripts/stage.sh" "$src" "$pkg" --features "$FEATURES" >&2
$SUDO cp -a "$pkg/usr/." "$new/usr/"
$SUDO rm -rf "$pkg"
version=$(sed -n "s/^default_version = '\(.*\)'/\1/p" "$new/usr/share/postgresql/$MAJOR/extension/feature_outbox.control")
case "$ref" in [0-9]*.*.*) [ "$version" = "$ref" ] || die "the build of $commit says it is $version, sql/released/RELEASES says $ref" ;; esac
{
  echo "label=$label"
  echo "version=$version"
  echo "commit=$commit"
  echo "major=$MAJOR"
  echo "features=$FEATURES"
  echo "recipe=$(recipe_hash)"
  echo "sha256=$(sha256sum "$new/usr/lib/postgresql/$MAJOR/lib/feature_outbox.so" | cut -c1-64)"
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ) by bench/ab_setup.sh: scripts/stage.sh --features $FEATURES, $(rustc --version)"
} | $SUDO tee "$new/STAMP" >/dev/null
$SUDO rm -rf "$tree"
$SUDO mv "$new" "$tree"
why=$(status)
[ "$why" = fresh ] || die "$label: the new tree does not check out: $why"
say "$label (${commit:0:12}) built in $((SECONDS - t)) s"
echo "$bin"
