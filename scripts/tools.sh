#!/usr/bin/env bash
# The servers some tests, the demo and the bench run against, installed once per machine:
#   tansu   0.6.0   Kafka-compatible broker, cargo install from crates.io, --features libsql (it
#                   enables everything the default features do, and SQLite storage)
#   martin  1.14.0  tile server, cargo install from crates.io, PostgreSQL sources only
#   varnish         Debian's varnish, varnish-modules (xkey) and hitch (TLS in front of Varnish)
#   prometheus      Debian's prometheus (with promtool) and prometheus-postgres-exporter, for the
#                   alert rules' tests and the monitoring page's exporter recipe
#   etcd    3.4.x   Debian's etcd-server, the DCS of the Patroni drills (pg_test/patroni_harness.py)
#   patroni 3.0.x   Debian's patroni (with python3-etcd, its etcd and etcd3 clients)
#   gdal    3.6.x   Debian's gdal-bin (ogr2ogr, ogrinfo): the capture tests' writer that no one here
#                   wrote (pg_test/test_capture.py)
#   patroni4 4.1.5  Patroni from PyPI in a virtualenv of its own, made from Debian's python3, every
#                   package pinned in pg_test/patroni-requirements.txt and installed with --no-deps
#
# Usage: scripts/tools.sh [NAME ...]          install what is missing or stale (default: all), then
#                                             print NAME=PATH of each binary on stdout
#        scripts/tools.sh status [NAME ...]   print NAME fresh|missing|stale: REASON; installs nothing
#
# The cargo-built tools live in the tool cache, $FEATURE_OUTBOX_TOOLS (default
# ~/.cache/feature_outbox), one folder per tool and version. A binary there is used only when the
# STAMP beside it, written by this script after a build, names the same tool, version, features and
# recipe hash as today's recipe, and the binary's sha256 is the one the stamp recorded. Anything
# else (a binary copied in by hand, an older recipe, another version) is rebuilt, the way a CI cache
# keyed by a lock file is. Builds hold a lock per tool, so a test that needs a tool waits for a
# build started earlier (CI starts them in the background). Cargo's build directory for each tool
# is kept in $FEATURE_OUTBOX_TOOLS_BUILD (default: the cache's .build): cargo's own fingerprints
# decide what in it is reused, so a rebuild after a stale stamp takes seconds, not minutes.
set -euo pipefail

TOOLS=${FEATURE_OUTBOX_TOOLS:-$HOME/.cache/feature_outbox}
BUILD=${FEATURE_OUTBOX_TOOLS_BUILD:-$TOOLS/.build}
ALL=(tansu martin varnish prometheus etcd patroni patroni4 gdal)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
. "$ROOT/scripts/stamp.sh"

say() { printf 'tools: %s\n' "$*" >&2; }
die() { printf 'tools: ERROR: %s\n' "$*" >&2; exit 1; }

# A cargo tool's recipe, as "crate version features": everything that decides what gets built.
recipe() {
  case "$1" in
    tansu) echo "tansu 0.6.0 libsql" ;;
    martin) echo "martin 1.14.0 postgres" ;;
    *) return 1 ;;
  esac
}

# The hash a stamp must carry: the recipe, the toolchain and the install command line below, so a
# change to any of them rebuilds on every machine.
recipe_hash() {
  local crate version features
  read -r crate version features < <(recipe "$1")
  { echo "$crate $version $features"; rustc --version; cargo_args "$1"; } | sha256sum | cut -c1-64
}

cargo_args() {
  local crate version features
  read -r crate version features < <(recipe "$1")
  echo install "$crate" --version "$version" --locked --no-default-features --features "$features"
}

dir_of() { local c v f; read -r c v f < <(recipe "$1"); echo "$TOOLS/$c-$v"; }
bin_of() { echo "$(dir_of "$1")/bin/$1"; }

# fresh, missing or "stale: why" for a cargo tool, from its stamp and binary alone.
cargo_status() {
  local name=$1 dir bin stamp want have
  dir=$(dir_of "$name"); bin=$(bin_of "$name"); stamp=$dir/STAMP
  if [ ! -e "$bin" ] && [ ! -e "$stamp" ]; then echo missing; return; fi
  [ -f "$stamp" ] || { echo "stale: $bin has no stamp (not built by scripts/tools.sh)"; return; }
  [ -x "$bin" ] || { echo "stale: the stamp's binary $bin is missing"; return; }
  local crate version features
  read -r crate version features < <(recipe "$name")
  stamp_mismatch "$stamp" "tool=$name" "version=$version" "features=$features" "recipe=$(recipe_hash "$name")" && return
  want=$(sed -n 's/^sha256=//p' "$stamp")
  have=$(sha256sum "$bin" | cut -c1-64)
  [ "$want" = "$have" ] || { echo "stale: $bin is not the binary the stamp recorded (sha256 $have, stamp $want)"; return; }
  echo fresh
}

# ---- a PyPI tool in a virtualenv of its own ----------------------------------------------------

# "name version requirements-file" of a venv tool.
venv_recipe() {
  case "$1" in
    patroni4) echo "patroni 4.1.5 pg_test/patroni-requirements.txt" ;;
    *) return 1 ;;
  esac
}
is_venv() { venv_recipe "$1" >/dev/null 2>&1; }
VENV_PYTHON=/usr/bin/python3

venv_pip_args() {
  local pkg version reqs
  read -r pkg version reqs < <(venv_recipe "$1")
  echo install --no-deps --no-cache-dir --disable-pip-version-check -r "$reqs"
}

venv_hash() {
  local pkg version reqs
  read -r pkg version reqs < <(venv_recipe "$1")
  { echo "$pkg $version"; cat "$ROOT/$reqs"; "$VENV_PYTHON" --version 2>&1; venv_pip_args "$1"; } | sha256sum | cut -c1-64
}

venv_dir() { local p v r; read -r p v r < <(venv_recipe "$1"); echo "$TOOLS/$p-$v"; }
venv_freeze() { "$1/bin/python" -m pip freeze --all --disable-pip-version-check 2>/dev/null | sha256sum | cut -c1-64; }

venv_status() {
  local name=$1 dir stamp pkg version reqs want have
  read -r pkg version reqs < <(venv_recipe "$name")
  dir=$(venv_dir "$name"); stamp=$dir/STAMP
  if [ ! -e "$dir" ]; then echo missing; return; fi
  [ -f "$stamp" ] || { echo "stale: $dir has no stamp (not made by scripts/tools.sh, or interrupted)"; return; }
  [ -x "$dir/bin/$pkg" ] || { echo "stale: the stamp's $dir/bin/$pkg is missing"; return; }
  stamp_mismatch "$stamp" "tool=$name" "version=$version" "recipe=$(venv_hash "$name")" && return
  want=$(sed -n 's/^freeze=//p' "$stamp")
  have=$(venv_freeze "$dir")
  [ "$want" = "$have" ] || { echo "stale: $dir holds other packages than the stamp recorded (pip freeze sha256 $have, stamp $want)"; return; }
  echo fresh
}

build_venv() {
  local name=$1 dir log pkg version reqs t=$SECONDS why
  read -r pkg version reqs < <(venv_recipe "$name")
  dir=$(venv_dir "$name")
  why=$(venv_status "$name")
  if [ "$why" = fresh ]; then
    say "$name $version: fresh, $(sed -n 's/^built=//p' "$dir/STAMP")"
    return 0
  fi
  log=$TOOLS/logs/$name-$version.log
  mkdir -p "$TOOLS/logs"
  : >"$log"
  say "$name $version: $why; installing $reqs from PyPI into $dir (log: $log)"
  # A venv cannot be moved (its scripts name their interpreter by path): made in place, stamped
  # last, so an interrupted install leaves a folder without a stamp, which is stale.
  rm -rf "$dir"
  run_logged "$name $version" "$VENV_PYTHON -m venv" "$log" "$VENV_PYTHON" -m venv "$dir"
  run_logged "$name $version" "pip $(venv_pip_args "$name")" "$log" \
    env -C "$ROOT" "$dir/bin/python" -m pip $(venv_pip_args "$name")
  run_logged "$name $version" "pip check" "$log" "$dir/bin/python" -m pip check --disable-pip-version-check
  run_logged "$name $version" "$pkg --version" "$log" "$dir/bin/$pkg" --version
  grep -q " $version\$" <("$dir/bin/$pkg" --version) || die "$name: $dir/bin/$pkg --version is not $version (log: $log)"
  {
    echo "tool=$name"
    echo "version=$version"
    echo "recipe=$(venv_hash "$name")"
    echo "freeze=$(venv_freeze "$dir")"
    echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ) by scripts/tools.sh: $("$VENV_PYTHON" --version 2>&1) -m venv, pip $(venv_pip_args "$name")"
  } >"$dir/STAMP"
  [ "$(venv_status "$name")" = fresh ] || die "$name $version: the new venv does not check out: $(venv_status "$name")"
  say "$name $version installed in $((SECONDS - t)) s"
}

# ---- Debian's packages ----------------------------------------------------------------------------

# The Debian packages of an apt-installed tool.
apt_packages() {
  case "$1" in
    varnish) echo varnish varnish-modules hitch ;;
    prometheus) echo prometheus prometheus-postgres-exporter ;;
    etcd) echo etcd-server ;;
    patroni) echo patroni python3-etcd ;;
    gdal) echo gdal-bin ;;
  esac
}

# The upstream version a tool's first package must have (Debian 12's), where the drills depend on it:
# a later Debian release or a backport is another tool, and the status says so.
apt_version() {
  case "$1" in
    etcd) echo 3.4. ;;
    patroni) echo 3.0. ;;
    gdal) echo 3.6. ;;
  esac
}

apt_status() {
  local p missing=() want have
  for p in $(apt_packages "$1"); do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -ne 0 ]; then echo "missing: ${missing[*]}"; return; fi
  want=$(apt_version "$1")
  if [ -n "$want" ]; then
    read -r p _ < <(apt_packages "$1")
    have=$(dpkg-query -W -f='${Version}' "$p")
    case "$have" in
      "$want"*) ;;
      *) echo "stale: Debian's $p is $have, the drills expect ${want}x"; return ;;
    esac
  fi
  echo fresh
}

is_apt() { [ -n "$(apt_packages "$1")" ]; }

status() { if is_apt "$1"; then apt_status "$1"; elif is_venv "$1"; then venv_status "$1"; else cargo_status "$1"; fi; }

# Runs "$@" with its output in $log; on failure, names the tool and step and shows the log's end.
run_logged() {
  local tool=$1 step=$2 log=$3; shift 3
  if ! "$@" >>"$log" 2>&1; then
    printf 'tools: ERROR: %s: %s failed; the last lines of %s:\n' "$tool" "$step" "$log" >&2
    tail -n 40 "$log" | sed 's/^/  | /' >&2
    exit 1
  fi
}

build_cargo() {
  local name=$1 dir bin log crate version features t=$SECONDS why
  read -r crate version features < <(recipe "$name")
  dir=$(dir_of "$name"); bin=$(bin_of "$name")
  why=$(cargo_status "$name")
  if [ "$why" = fresh ]; then
    say "$name $version: fresh, $(sed -n 's/^built=//p' "$dir/STAMP")"
    return 0
  fi
  log=$TOOLS/logs/$name-$version.log
  mkdir -p "$TOOLS/logs" "$BUILD"
  : >"$log"
  say "$name $version ($features): $why; building from crates.io (log: $log)"
  # Into a new folder, stamped last, then moved into place: an interrupted build leaves no binary
  # that looks finished.
  rm -rf "$dir.new"
  run_logged "$name $version" "cargo $(cargo_args "$name")" "$log" \
    env CARGO_TARGET_DIR="$BUILD/$crate-$version" cargo $(cargo_args "$name") --root "$dir.new"
  [ -x "$dir.new/bin/$name" ] || die "$name $version: cargo install left no bin/$name in $dir.new (log: $log)"
  run_logged "$name $version" "$name --version" "$log" "$dir.new/bin/$name" --version
  {
    echo "tool=$name"
    echo "version=$version"
    echo "features=$features"
    echo "recipe=$(recipe_hash "$name")"
    echo "sha256=$(sha256sum "$dir.new/bin/$name" | cut -c1-64)"
    echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ) by scripts/tools.sh: cargo $(cargo_args "$name")"
  } >"$dir.new/STAMP"
  rm -rf "$dir"
  mv "$dir.new" "$dir"
  [ "$(cargo_status "$name")" = fresh ] || die "$name $version: the new build does not check out: $(cargo_status "$name")"
  say "$name $version built in $((SECONDS - t)) s"
}

install_apt() {
  local name=$1 t=$SECONDS why log=$TOOLS/logs/$1-apt.log sudo="" pkgs
  read -r -a pkgs < <(apt_packages "$name")
  why=$(apt_status "$name")
  if [ "$why" = fresh ]; then
    say "$name: fresh, Debian's $(dpkg-query -W -f='${Package} ${Version}, ' "${pkgs[@]}" | sed 's/, $//')"
    return 0
  fi
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  mkdir -p "$TOOLS/logs"; : >"$log"
  say "$name: ${why}; installing Debian's ${pkgs[*]}"
  # The packages' services would start on their ports (Varnish 6081, hitch 443, Prometheus 9090,
  # etcd 2379); the tests start their own.
  local policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee /usr/sbin/policy-rc.d >/dev/null
    $sudo chmod +x /usr/sbin/policy-rc.d
    policy=/usr/sbin/policy-rc.d
  fi
  # apt's own lock: setup.sh may be installing at the same moment.
  run_logged "$name" "apt-get update" "$log" $sudo apt-get -o DPkg::Lock::Timeout=600 update -qq
  run_logged "$name" "apt-get install ${pkgs[*]}" "$log" env DEBIAN_FRONTEND=noninteractive \
    $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${pkgs[@]}"
  [ -z "$policy" ] || $sudo rm -f "$policy"
  [ "$(apt_status "$name")" = fresh ] || die "$name: $(apt_status "$name") after apt-get install (log: $log)"
  say "$name: installed in $((SECONDS - t)) s"
}

# One tool, under its own lock (a build started elsewhere is waited for, then found fresh).
ensure() {
  local name=$1
  mkdir -p "$TOOLS"
  exec {fd}>"$TOOLS/.$name.lock"
  if ! flock -n "$fd"; then
    say "$name: another build holds $TOOLS/.$name.lock; waiting"
    flock "$fd"
  fi
  if is_apt "$name"; then install_apt "$name"; elif is_venv "$name"; then build_venv "$name"; else build_cargo "$name"; fi
  exec {fd}>&-
}

path_of() {
  case "$1" in
    varnish) command -v varnishd || echo /usr/sbin/varnishd ;;
    prometheus) command -v prometheus || echo /usr/bin/prometheus ;;
    etcd) echo /usr/bin/etcd ;;
    patroni) echo /usr/bin/patroni ;;
    patroni4) echo "$(venv_dir patroni4)/bin/patroni" ;;
    gdal) echo /usr/bin/ogr2ogr ;;
    *) bin_of "$1" ;;
  esac
}

check_name() { case " ${ALL[*]} " in *" $1 "*) ;; *) die "unknown tool '$1' (known: ${ALL[*]})" ;; esac; }

if [ "${1:-}" = status ]; then
  shift
  [ $# -gt 0 ] || set -- "${ALL[@]}"
  for n in "$@"; do check_name "$n"; printf '%s %s\n' "$n" "$(status "$n")"; done
  exit 0
fi
[ $# -gt 0 ] || set -- "${ALL[@]}"
for n in "$@"; do check_name "$n"; done
for n in "$@"; do ensure "$n"; done
for n in "$@"; do printf '%s=%s\n' "$n" "$(path_of "$n")"; done
