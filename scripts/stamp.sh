# Sourced by scripts/tools.sh and bench/ab_setup.sh: the check both make of a cache's STAMP against
# today's recipe, before each checks the stamped file's own hash.

# stamp_mismatch STAMP KEY=VALUE...: for the first KEY=VALUE line STAMP lacks, prints
# "stale: stamp has KEY=<its value>, today's recipe KEY=VALUE" and succeeds; fails, printing
# nothing, when STAMP has every line.
stamp_mismatch() {
  local stamp=$1 kv have
  shift
  for kv in "$@"; do
    grep -qxF "$kv" "$stamp" && continue
    have=$(grep -m1 "^${kv%%=*}=" "$stamp" || echo "${kv%%=*}=(none)")
    echo "stale: stamp has $have, today's recipe ${kv}"
    return 0
  done
  return 1
}
