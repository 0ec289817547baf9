#!/usr/bin/env bash
# The released versions and their commits, read from sql/released/RELEASES (the one list of them).
#   releases.sh last          "VERSION COMMIT" of the last release (the file's last line)
#   releases.sh commit VER    the commit VER was released from; an error when VER is not listed
#   releases.sh list          every "VERSION COMMIT", oldest first
set -euo pipefail
file="$(cd "$(dirname "$0")/.." && pwd)/sql/released/RELEASES"
entries() { grep -v '^[[:space:]]*\(#\|$\)' "$file"; }
case "${1:-}" in
  last) entries | tail -n 1 ;;
  list) entries ;;
  commit)
    ver=${2:?usage: releases.sh commit VERSION}
    entries | awk -v v="$ver" '$1 == v { print $2; found = 1 } END { exit !found }' \
      || { echo "releases.sh: $ver is not a release in $file (releases: $(entries | awk '{ print $1 }' | paste -sd' '))" >&2; exit 1; } ;;
  *) echo "usage: releases.sh last | list | commit VERSION" >&2; exit 2 ;;
esac
