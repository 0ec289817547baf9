#!/usr/bin/env bash
# Makes and enters a Debian build-and-test root (a chroot) per PostgreSQL major, from Debian's own
# archive, so the extension can be built and tested against PostgreSQL 15, 17 and 18 on one machine.
#
#   scripts/pgroot.sh path N        ensure the root for major N exists; print its directory
#   scripts/pgroot.sh run N CMD...  ensure it, mount what is needed, run CMD inside it with the repo
#                                   at the same path and as the working directory; exit with CMD's status
#   scripts/pgroot.sh clean N       unmount and remove the root and its cached tarballs
#   N may be clean-N: the package-test root of major N (postgresql-N-postgis-3 and nats-server only),
#   extracted afresh for every run; see "clean roots" below.
# Majors: 15 -> bookworm, 17 -> trixie, 18 -> sid. Runs as root or via sudo, like scripts/setup.sh.
#
# A finished root is cached as /var/tmp/feature_outbox_roots/pgN-<hash12>.tar.zst (gzip without zstd),
# the hash being sha256 of the definition section below (suite, packages, how the root is made), and
# extracted at /var/tmp/feature_outbox_roots/pgN/ with a stamp file .pgroot-stamp naming the hash.
# A changed definition rebuilds. `run` enters a private mount namespace (unshare) where it can, so
# its mounts are never seen outside and vanish with it; it unmounts what it mounted on exit as well.
#
# Clean roots (clean-N, for scripts/package_test.sh): made the same way from the same definition,
# but holding only postgresql-N-postgis-3 (which brings postgresql-N), nats-server and what apt
# needs: no Rust, no compiler, no build tree. Cached as clean<N>-<hash12>.tar.zst, the hash also
# covering the CLEAN DEFINITION section; every `run` takes the root's lock exclusively and extracts
# it afresh from the tarball, so each run starts from a just-installed system. Mounted inside:
# /proc, /dev, the name servers and the repo's dist/ read-only at the same path (the working
# directory); nothing else of the host.
#
# Inside `run`: the host's $HOME/.cargo and $HOME/.rustup (the rustup toolchain and crate cache) at the
# same paths, ../shared read-only, the host's CA bundle (for pip and cargo behind a proxy), and per root CARGO_TARGET_DIR, PGRX_HOME and FEATURE_OUTBOX_VENV
# under /var/lib/feature_outbox, PG_CONFIG of major N, FEATURE_OUTBOX_PG=N. Debian's rustc is not
# installed: it is older than the toolchain the crate needs.
set -euo pipefail

SELF="$(readlink -f "${BASH_SOURCE[0]}")"
REPO="$(cd "$(dirname "$SELF")/.." && pwd -P)"
SHARED="$(dirname "$REPO")/shared"
ROOTS=/var/tmp/feature_outbox_roots
STAMP_NAME=.pgroot-stamp

say() { echo "pgroot: $*" >&2; }
die() { say "error: $*"; exit 1; }

#=== BEGIN DEFINITION ===
# Everything from here to END DEFINITION is hashed into the cache key: edit it and roots rebuild.
MIRROR=http://deb.debian.org/debian
SECURITY_MIRROR=http://deb.debian.org/debian-security

suite_for() {
  case "$1" in
    15) echo bookworm ;;
    17) echo trixie ;;
    18) echo sid ;;
    *) return 1 ;;
  esac
}

# Packages of the root; @N@ is the PostgreSQL major. No rustc: the host's rustup toolchain is bound in.
# libssl-dev and g++: the Kafka sink's bundled librdkafka is compiled with OpenSSL (TLS, SCRAM).
PACKAGES=(postgresql-@N@ postgresql-server-dev-@N@ postgresql-@N@-postgis-3
          clang libclang-dev pkg-config gcc g++ libc6-dev libssl-dev make git ca-certificates sudo nats-server
          python3 python3-venv dpkg-dev curl procps nginx)

packages_for() { local p; for p in "${PACKAGES[@]}"; do echo "${p//@N@/$1}"; done; }

# apt sources of the root, deb822. Stable suites also take their point and security updates.
sources_for() {
  local suite="$1" keyring="$2"
  case "$suite" in
    sid) printf 'Types: deb\nURIs: %s\nSuites: sid\nComponents: main\nSigned-By: %s\n' "$MIRROR" "$keyring" ;;
    *)   printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main\nSigned-By: %s\n\n' \
                "$MIRROR" "$suite" "$suite" "$keyring"
         printf 'Types: deb\nURIs: %s\nSuites: %s-security\nComponents: main\nSigned-By: %s\n' \
                "$SECURITY_MIRROR" "$suite" "$keyring" ;;
  esac
}

# apt options of the root. Sid's Release file may carry an expired Valid-Until: accept it there.
apt_conf_for() {
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\nAcquire::Retries "3";\n'
  if [ "$1" = sid ]; then printf 'Acquire::Check-Valid-Until "false";\n'; fi
}

# Builds the root of major $1 from nothing into $2 (an empty or absent directory).
build_root() {
  local major="$1" root="$2" suite t keyring
  suite="$(suite_for "$major")"
  t=$SECONDS
  debootstrap --variant=minbase --components=main \
    --keyring=/usr/share/keyrings/debian-archive-keyring.gpg \
    "$suite" "$root" "$MIRROR" >>"$BUILD_LOG" 2>&1
  say "debootstrap $suite $((SECONDS - t)) s"

  # No service starts by itself, and Debian creates no N/main cluster when postgresql is installed.
  printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
  chmod 0755 "$root/usr/sbin/policy-rc.d"
  mkdir -p "$root/etc/postgresql-common/createcluster.d"
  echo "create_main_cluster = false" >"$root/etc/postgresql-common/createcluster.d/no-main.conf"
  # No manuals, documentation or translations (the copyright files stay).
  printf '%s\n' 'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' \
    'path-exclude /usr/share/locale/*' 'path-exclude /usr/share/doc/*' \
    'path-include /usr/share/doc/*/copyright' >"$root/etc/dpkg/dpkg.cfg.d/01-pgroot-nodoc"

  keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  [ -e "$root$keyring" ] || keyring=/usr/share/keyrings/debian-archive-keyring.pgp
  rm -f "$root/etc/apt/sources.list"
  sources_for "$suite" "$keyring" >"$root/etc/apt/sources.list.d/debian.sources"
  apt_conf_for "$suite" >"$root/etc/apt/apt.conf.d/90pgroot"

  t=$SECONDS
  mount_root "$root"
  local -a pkgs
  mapfile -t pkgs < <(packages_for "$major")
  chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 sh -c 'apt-get update && apt-get install -y "$@" && apt-get clean' sh "${pkgs[@]}" \
    >>"$BUILD_LOG" 2>&1
  chroot "$root" id postgres >>"$BUILD_LOG" 2>&1 || die "no postgres user in the root"
  [ -x "$root/usr/lib/postgresql/$major/bin/pg_config" ] || die "no pg_config $major in the root"
  unmount_ours
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/apt/* \
         "$root"/tmp/* "$root"/var/tmp/*
  mkdir -p "$root/var/lib/feature_outbox/target" "$root/var/lib/feature_outbox/pgrx"
  say "apt install pg$major ($suite, ${#pkgs[@]} packages) $((SECONDS - t)) s"
}
#=== END DEFINITION ===

#=== BEGIN CLEAN DEFINITION ===
# The clean package-test roots. Hashed after the DEFINITION above (which they reuse); editing this
# section rebuilds the clean roots only.
CLEAN_PACKAGES=(postgresql-@N@-postgis-3 nats-server)

build_clean_root() {
  local -a PACKAGES=("${CLEAN_PACKAGES[@]}")   # build_root reads PACKAGES (through packages_for)
  build_root "$1" "$2"
  rm -rf "$2/var/lib/feature_outbox"
}
#=== END CLEAN DEFINITION ===

definition_hash() {
  local major="$1"
  {
    echo "suite=$(suite_for "$major")"
    echo "packages=$(packages_for "$major" | tr '\n' ' ')"
    sed -n '/^#=== BEGIN DEFINITION ===$/,/^#=== END DEFINITION ===$/p' "$SELF"
  } | sha256sum | cut -d' ' -f1
}

# The cache key of this run's root: definition_hash for a build root (unchanged by clean roots),
# that and the CLEAN DEFINITION section for a clean one.
root_hash() {
  if [ "$KIND" = build ]; then definition_hash "$MAJOR"; return; fi
  {
    echo "kind=clean"
    echo "packages=$(PACKAGES=("${CLEAN_PACKAGES[@]}"); packages_for "$MAJOR" | tr '\n' ' ')"
    definition_hash "$MAJOR"
    sed -n '/^#=== BEGIN CLEAN DEFINITION ===$/,/^#=== END CLEAN DEFINITION ===$/p' "$SELF"
  } | sha256sum | cut -d' ' -f1
}

# --- mounts -------------------------------------------------------------------------------------
MOUNTED=()   # mount points this process made, in order; unmounted in reverse on exit

# bind SRC DST [ro]: bind-mounts SRC on DST unless DST is a mount point already (nested or re-entered).
bind_mount() {
  local src="$1" dst="$2" ro="${3:-}"
  if [ -d "$src" ]; then mkdir -p "$dst"; else [ -e "$dst" ] || : >"$dst"; fi
  mountpoint -q "$dst" && return 0
  mount --bind "$src" "$dst"
  MOUNTED+=("$dst")
  mount --make-rslave "$dst"   # no mount or unmount under it reaches the host's copy
  if [ "$ro" = ro ]; then mount -o remount,bind,ro "$dst"; fi
}

fs_mount() {   # fs_mount TYPE DST [OPTIONS]
  local type="$1" dst="$2" opts="${3:-defaults}"
  mkdir -p "$dst"
  mountpoint -q "$dst" && return 0
  mount -t "$type" -o "$opts" "$type" "$dst"
  MOUNTED+=("$dst")
}

# What apt needs in the root: /proc, /dev, /dev/pts, /dev/shm, and the host's name servers.
mount_root() {
  local root="$1"
  fs_mount proc "$root/proc" nosuid,nodev,noexec
  bind_mount /dev "$root/dev"
  bind_mount /dev/pts "$root/dev/pts"
  fs_mount tmpfs "$root/dev/shm" nosuid,nodev,mode=1777
  rm -f "$root/etc/resolv.conf"
  cp -L /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || : >"$root/etc/resolv.conf"
}

unmount_ours() {
  local i
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
    umount "${MOUNTED[$i]}" 2>/dev/null || umount -l "${MOUNTED[$i]}" \
      || say "warning: could not unmount ${MOUNTED[$i]}"
  done
  MOUNTED=()
}

mounts_under() {   # mount points at or under $1 in this mount namespace, deepest first
  awk -v r="$1" '$5 == r || index($5, r "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r
}

# Removes a root, after unmounting whatever is still mounted in it (a crashed run, say). It never
# descends into a mount: a bind of the repo or of ~/.cargo inside would otherwise be emptied.
remove_root() {
  local root="$1" m
  [ -e "$root" ] || return 0
  for m in $(mounts_under "$root"); do umount "$m" 2>/dev/null || umount -l "$m" || true; done
  [ -z "$(mounts_under "$root")" ] || die "still mounted under $root: $(mounts_under "$root" | tr '\n' ' ')"
  rm -rf --one-file-system "$root"
}

BUILD_LOG=""
on_exit() {
  local rc=$?
  unmount_ours
  if [ "$rc" -ne 0 ] && [ -n "$BUILD_LOG" ] && [ -s "$BUILD_LOG" ]; then
    say "failed; the end of $BUILD_LOG:"
    tail -n 30 "$BUILD_LOG" >&2
  fi
  return "$rc"
}
trap on_exit EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 143' TERM

# --- the cache ----------------------------------------------------------------------------------
ensure_host_tools() {
  command -v debootstrap >/dev/null 2>&1 && return 0
  say "installing debootstrap on the host"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >&2
}

# Makes $ROOT match the definition of major $MAJOR: keeps it, extracts the cached tarball, or builds
# it and writes the tarball. Called with the root's lock held exclusively. `ensure_root fresh`
# never keeps the extracted root: it starts again from the tarball (a clean root's every run).
ensure_root() {
  local hash tarball ext t size f
  hash="$(root_hash)"
  if [ "${1:-}" != fresh ] && [ "$(cat "$ROOT/$STAMP_NAME" 2>/dev/null)" = "$hash" ]; then return 0; fi

  remove_root "$ROOT"
  tarball=""
  for ext in tar.zst tar.gz; do
    if [ "$ext" = tar.zst ] && ! command -v zstd >/dev/null 2>&1; then continue; fi
    f="$ROOTS/$NAME-${hash:0:12}.$ext"
    if [ -s "$f" ]; then tarball="$f"; break; fi
  done
  mkdir -p "$ROOT"
  if [ -n "$tarball" ]; then
    t=$SECONDS
    case "$tarball" in
      *.zst) zstd -q -dc "$tarball" | tar -C "$ROOT" --numeric-owner --xattrs --xattrs-include='*' -xpf - ;;
      *) tar -C "$ROOT" --numeric-owner --xattrs --xattrs-include='*' -xzpf "$tarball" ;;
    esac
    say "extract $(basename "$tarball") $((SECONDS - t)) s"
  else
    ensure_host_tools
    BUILD_LOG="$ROOTS/$NAME-build.log"
    : >"$BUILD_LOG"
    say "building the $NAME root ($(suite_for "$MAJOR"), definition ${hash:0:12}); log: $BUILD_LOG"
    if [ "$KIND" = clean ]; then build_clean_root "$MAJOR" "$ROOT"; else build_root "$MAJOR" "$ROOT"; fi
    [ -z "$(mounts_under "$ROOT")" ] || die "still mounted under $ROOT; not packing it"
    t=$SECONDS
    if command -v zstd >/dev/null 2>&1; then
      tarball="$ROOTS/$NAME-${hash:0:12}.tar.zst"
      tar -C "$ROOT" --numeric-owner --xattrs --xattrs-include='*' -cf - . \
        | zstd -q -T1 -3 -o "$tarball.tmp" -f
    else
      tarball="$ROOTS/$NAME-${hash:0:12}.tar.gz"
      tar -C "$ROOT" --numeric-owner --xattrs --xattrs-include='*' -czf "$tarball.tmp" .
    fi
    mv -f "$tarball.tmp" "$tarball"
    size=$(du -m "$tarball" | cut -f1)
    say "tarball $(basename "$tarball") ${size} MB $((SECONDS - t)) s"
    BUILD_LOG=""
  fi
  # Tarballs of older definitions of this major are of no further use.
  for f in "$ROOTS/$NAME"-*.tar.*; do
    if [ -e "$f" ] && [ "$f" != "$tarball" ]; then rm -f "$f"; fi
  done
  echo "$hash" >"$ROOT/$STAMP_NAME"
}

# Ensures the root and leaves its lock held shared: runs share a root, clean and rebuilds wait for them.
ensure_root_shared() {
  flock -s 9
  if [ "$(cat "$ROOT/$STAMP_NAME" 2>/dev/null)" != "$(root_hash)" ]; then
    flock -u 9
    flock -x 9
    ensure_root
    flock -s 9
  fi
}

# --- commands -----------------------------------------------------------------------------------
usage() {
  sed -n '2,12p' "$SELF" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

[ $# -ge 2 ] || usage
CMD="$1" WHICH="$2"
shift 2
# WHICH is N (the build root of major N, named pgN) or clean-N (its clean root, named cleanN).
case "$WHICH" in
  clean-*) KIND=clean MAJOR="${WHICH#clean-}" NAME="clean${WHICH#clean-}" ;;
  *) KIND=build MAJOR="$WHICH" NAME="pg$WHICH" ;;
esac
suite_for "$MAJOR" >/dev/null || die "no root for PostgreSQL $MAJOR (majors: 15, 17, 18; clean-15, clean-17, clean-18)"
case "$CMD" in path | run | clean) ;; *) usage ;; esac
[ "$CMD" != run ] || [ $# -gt 0 ] || usage
[ "$(id -u)" -eq 0 ] || exec sudo -E -- bash "$SELF" "$CMD" "$WHICH" "$@"

# path and run mount things (building, running): do it in a private mount namespace where one can
# be had, so that nothing is ever left mounted on the host, whatever becomes of this process.
if [ "$CMD" != clean ] && [ -z "${PGROOT_IN_NS:-}" ] \
   && unshare --mount --propagation private true 2>/dev/null; then
  PGROOT_IN_NS=1 exec unshare --mount --propagation private -- bash "$SELF" "$CMD" "$WHICH" "$@"
fi

ROOT="$ROOTS/$NAME"
mkdir -p "$ROOTS"
exec 9>"$ROOTS/$NAME.lock"

case "$CMD" in
  path)
    ensure_root_shared
    echo "$ROOT"
    ;;

  clean)
    flock -x -w 60 9 || die "the $NAME root is in use (a run holds $ROOTS/$NAME.lock)"
    rm -f "$ROOT/$STAMP_NAME" 2>/dev/null || true
    remove_root "$ROOT"
    rm -f "$ROOTS/$NAME"-*.tar.* "$ROOTS/$NAME-build.log"
    say "removed $ROOT and its cache"
    ;;

  run)
    if [ "$KIND" = clean ]; then
      # A clean root is this run's alone (the lock held exclusively for as long as CMD runs) and
      # starts from its tarball: what a previous run installed or left is gone.
      flock -x 9
      ensure_root fresh
      mount_root "$ROOT"
      mkdir -p "$REPO/dist"
      bind_mount "$REPO/dist" "$ROOT$REPO/dist" ro
      envs=(
        "HOME=/root" "USER=root" "LOGNAME=root" "LANG=C.UTF-8" "TERM=${TERM:-dumb}"
        "PATH=/usr/lib/postgresql/$MAJOR/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        "FEATURE_OUTBOX_PG=$MAJOR" "DEBIAN_FRONTEND=noninteractive"
      )
    else
      ensure_root_shared   # held for as long as CMD runs
      mount_root "$ROOT"
      bind_mount "$REPO" "$ROOT$REPO"
      for d in "$HOME/.cargo" "$HOME/.rustup"; do
        if [ -d "$d" ]; then bind_mount "$d" "$ROOT$d"; else say "warning: no $d on the host"; fi
      done
      mkdir -p "$ROOT$HOME"
      if [ -d "$SHARED" ]; then bind_mount "$SHARED" "$ROOT$SHARED" ro; fi
      envs=(
        "HOME=$HOME" "USER=root" "LOGNAME=root" "LANG=C.UTF-8" "TERM=${TERM:-dumb}"
        "PATH=$HOME/.cargo/bin:/usr/lib/postgresql/$MAJOR/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        "CARGO_TARGET_DIR=/var/lib/feature_outbox/target"
        "PGRX_HOME=/var/lib/feature_outbox/pgrx"
        "FEATURE_OUTBOX_VENV=/var/lib/feature_outbox/venv"
        "PG_CONFIG=/usr/lib/postgresql/$MAJOR/bin/pg_config"
        "FEATURE_OUTBOX_PG=$MAJOR"
      )
      for v in CI RUST_BACKTRACE RUST_LOG CARGO_BUILD_JOBS CARGO_INCREMENTAL CARGO_TERM_COLOR NO_COLOR \
               http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY PIP_INDEX_URL PIP_DEFAULT_TIMEOUT; do
        if [ -n "${!v+set}" ]; then envs+=("$v=${!v}"); fi
      done
      # The host's CA bundle, which may trust a proxy's CA that the root's ca-certificates does not:
      # pip (PyPI) and cargo (crates.io) in the root use it.
      host_ca=/etc/ssl/certs/ca-certificates.crt
      if [ -s "$host_ca" ]; then
        bind_mount "$host_ca" "$ROOT/etc/ssl/host-ca-certificates.crt" ro
        for v in SSL_CERT_FILE PIP_CERT REQUESTS_CA_BUNDLE CURL_CA_BUNDLE CARGO_HTTP_CAINFO GIT_SSL_CAINFO; do
          envs+=("$v=/etc/ssl/host-ca-certificates.crt")
        done
      fi
    fi
    # CMD runs as a child this shell waits for, so that a signal to this script reaches CMD (SIGINT
    # as SIGTERM: an asynchronous child ignores SIGINT) and the mounts go once CMD has ended.
    chroot "$ROOT" /usr/bin/env -i -C "$REPO" "${envs[@]}" "$@" 0<&0 9>&- &
    child=$!
    trap 'kill -TERM "$child" 2>/dev/null || true' INT TERM
    trap 'kill -HUP "$child" 2>/dev/null || true' HUP
    while kill -0 "$child" 2>/dev/null; do
      wait "$child" || true   # returns early when a trapped signal arrives
    done
    rc=0
    wait "$child" || rc=$?    # CMD's status, which bash keeps
    for p in /proc/[0-9]*; do   # a server CMD started and left behind keeps the root busy
      if [ "$(readlink "$p/root" 2>/dev/null)" = "$ROOT" ]; then
        say "warning: running in the root after CMD: ${p#/proc/} $(tr '\0' ' ' <"$p/cmdline" 2>/dev/null | cut -c1-80)"
      fi
    done
    exit "$rc"
    ;;
esac
