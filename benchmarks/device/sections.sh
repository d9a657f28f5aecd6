# Sourced by benchmarks/runbook.sh and the lent machine's call scripts (common.sh): one log under $OUT,
# named sections with their own time limits that never end the run, and a summary line per section.
#   source benchmarks/device/sections.sh NAME
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
LOG="$OUT/$1.log"
START=$(date +%s)
SUMMARY=()

say() { echo "$*" | tee -a "$LOG"; }

# section NAME SECONDS CMD...: run CMD with a time limit, its output into the log (and stdout)
# SKIP="name ..." skips those sections (a re-run of a call that already has them).
section() {
  local name=$1 limit=$2 t0 rc
  shift 2
  if [[ " ${SKIP:-} " == *" $name "* ]]; then
    say "=== $name: skipped (SKIP)"
    SUMMARY+=("$name: skipped")
    LAST_RC=0
    return 0
  fi
  t0=$(date +%s)
  say "=== $name (limit ${limit}s, at +$((t0 - START))s): $*"
  set -o pipefail
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=$?
  set +o pipefail
  SUMMARY+=("$name: rc=$rc in $(( $(date +%s) - t0 ))s")
  LAST_RC=$rc
  return 0
}

# OUT_FILES_BACK (common.sh sets it: at most 8 files under $OUT come back from the lent machine, benchmarks/DEVICE.md):
# where a call wrote more, every file but the log goes into one $OUT/files.tar.gz (unpacked with `tar xzf`), so no
# table is left behind. Unset (the runbook on one's own machine), the files stay as they are.
summary() {
  say "=== summary (+$(( $(date +%s) - START ))s)"
  for line in "${SUMMARY[@]}"; do say "$line"; done
  local n
  n=$(find "$OUT" -type f | wc -l)
  if [ -n "${OUT_FILES_BACK:-}" ] && [ "$n" -gt "$OUT_FILES_BACK" ]; then
    say "$n files under \$OUT, more than the $OUT_FILES_BACK that come back: all but $(basename "$LOG") packed into files.tar.gz"
    (cd "$OUT" && find . -type f ! -path "./$(basename "$LOG")" ! -path ./files.tar.gz -print0 \
      | tar czf files.tar.gz --null --verbatim-files-from -T - --remove-files \
      && find . -mindepth 1 -type d -empty -delete) || say "packing \$OUT failed (tar says why above): what it left is there"
    local size
    size=$(stat -c %s "$OUT/files.tar.gz" 2>/dev/null || echo 0)
    if [ "$size" -gt $((16 << 20)) ]; then  # a file over 16 MiB does not come back
      say "files.tar.gz is $size bytes, over the 16 MiB a file may be to come back: write less under \$OUT"
    fi
  fi
}
