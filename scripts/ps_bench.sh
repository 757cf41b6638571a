#!/usr/bin/env bash
# Parameter server (master --mode ps) against data parallelism (--replicas
# n) on the small CNN and Fashion-MNIST, with the same workers on the same
# cores, and a deliberately slowed worker with and without --backup-workers;
# or (WHICH=partitions) the server in the master against --ps-partitions 2, with two
# compute workers each. Each configuration runs REPS times, the
# configurations alternating, so that all meet the same minutes of a
# machine whose speed drifts.
#
#   scripts/ps_bench.sh [ROWS] [REPS] [SLOW_MS] [WHICH]  (defaults 6400 2 50 all)
#
# Prints one line per run: the configuration, the epoch's images per second
# and, for --mode ps, the median step time and the bytes pulled and pushed
# per step (the master's "ps:" line).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
BIN=${REMORA_BUILD_DIR:-build}/bin
ROWS=${1:-6400}
REPS=${2:-2}
SLOW=${3:-50}
WHICH=${4:-all}
WORK=$(mktemp -d)
PORT=$((30000 + RANDOM % 20000))
trap 'rm -rf "$WORK"' EXIT
COMMON=(--dataset fashion-mnist --train-rows "$ROWS" --epochs 1 --batch-size 64 --shuffle=false)

# run LABEL N "WORKER FLAGS PER WORKER (| separated)" MASTER FLAGS...
run() {
  local label=$1 n=$2 slow=$3
  shift 3
  local names=() i
  for i in $(seq 1 "$n"); do names+=("w$i"); done
  PORT=$((PORT + 1))
  for i in $(seq 1 "$n"); do
    local extra=()
    [ "$i" -eq "$n" ] && [ "$slow" -gt 0 ] && extra=(--slow-ms "$slow")
    "$BIN/worker" --name "w$i" --master "127.0.0.1:$PORT" "${extra[@]}" >"$WORK/w$i.log" 2>&1 &
  done
  local out="$WORK/master.log"
  "$BIN/master" --workers "$(IFS=,; echo "${names[*]}")" --listen "127.0.0.1:$PORT" "${COMMON[@]}" "$@" >"$out" 2>&1
  wait
  local ips ps
  ips=$(grep -o 'images_per_second=[0-9.]*' "$out" | head -1 | cut -d= -f2)
  ps=$(grep '^ps: ' "$out" | sed 's/ dropped:.*//; s/^ps: //' || true)
  printf '%-32s images_per_second=%-8s %s\n' "$label" "$ips" "$ps"
}

for rep in $(seq 1 "$REPS"); do
  echo "# repetition $rep"
  if [ "$WHICH" = partitions ] || [ "$WHICH" = shards ]; then
    run "ps K=1 (master), 2 compute" 2 0 --mode ps
    run "ps K=2 (w1,w2), 2 compute" 4 0 --mode ps --ps-partitions 2
    continue
  fi
  for n in 1 2 4; do
    run "ps n=$n" "$n" 0 --mode ps
    run "data-parallel n=$n" "$n" 0 --replicas "$n" --splits 1
  done
  run "ps n=3, w3 --slow-ms $SLOW" 3 "$SLOW" --mode ps
  run "ps n=3, w3 slow, backup 1" 3 "$SLOW" --mode ps --backup-workers 1
done
