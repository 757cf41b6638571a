# Sourced by the measure_*.sh scripts (from the repository root, after
# `set -euo pipefail`): BIN (the built programs), WORK (a scratch folder),
# PIDS (processes to kill on exit; the folder goes too), and
#
#   now                              seconds since the epoch, nanoseconds
#   wait_for FILE TEXT SECS [AFTER]  waits until FILE holds TEXT (after its
#                                    first line holding AFTER, when given);
#                                    prints the time; fails after SECS
#   median                           the median of numbers on stdin
BIN=${REMORA_BUILD_DIR:-build}/bin
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

now() { date +%s.%N; }

wait_for() {
  local deadline
  deadline=$(awk -v t="$(now)" -v s="$3" 'BEGIN { printf "%.3f", t + s }')
  until awk -v p="$2" -v m="${4:-}" 'm == "" || index($0, m) { seen = 1 } seen && index($0, p) { found = 1 }
                                     END { exit !found }' "$1" 2>/dev/null; do
    if awk -v t="$(now)" -v d="$deadline" 'BEGIN { exit !(t > d) }'; then
      echo "$(basename "$0"): '$2' did not appear in $1 within $3 s" >&2
      tail -20 "$1" >&2
      return 1
    fi
    sleep 0.005
  done
  now
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
