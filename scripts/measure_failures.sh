#!/usr/bin/env bash
# Measures how long a group takes to notice a killed process, with the real
# programs: `soak --external` trains as the master of two `worker`s started
# here (not its children), and one of them is killed with SIGKILL mid-run.
#
#   killed worker: from the kill until the master reports the failed step
#                  naming the worker (its calls fail when the connection drops)
#   killed master: from the kill until a worker reports that the master has
#                  not answered (workers ping it every second and give up
#                  after AgentOptions::master_timeout, 10 s)
#
#   scripts/measure_failures.sh [RUNS]     (default 5; prints each run and the median)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
RUNS=${1:-5}
source scripts/measure_common.sh  # BIN, WORK, PIDS, now, wait_for, median

# Starts the soak master and two workers; sets SOAK, W1, W2 and the logs.
start_group() {
  local port=$((20000 + RANDOM % 20000)) run=$1
  SOAK_LOG=$WORK/soak$run.log W1_LOG=$WORK/w1_$run.log W2_LOG=$WORK/w2_$run.log
  "$BIN/soak" --external --workers w1,w2 --listen "127.0.0.1:$port" --steps 100000000 \
    --progress 0 >"$SOAK_LOG" 2>&1 &
  SOAK=$!
  "$BIN/soak" worker --name w1 --master "127.0.0.1:$port" --threads 1 >"$W1_LOG" 2>&1 &
  W1=$!
  "$BIN/soak" worker --name w2 --master "127.0.0.1:$port" --threads 1 >"$W2_LOG" 2>&1 &
  W2=$!
  disown "$SOAK" "$W1" "$W2"  # no job notices when they are killed
  PIDS+=("$SOAK" "$W1" "$W2")
  wait_for "$SOAK_LOG" "master start:" 60 >/dev/null
  sleep 1  # training is under way
}

# Kills the given processes and waits until they are gone.
stop() {
  kill -9 "$@" 2>/dev/null || true
  for p in "$@"; do
    while kill -0 "$p" 2>/dev/null; do sleep 0.01; done
  done
}

# Kills process $1, waits for $3 in log $2; prints the seconds in between.
kill_and_time() {
  local t0 t1
  t0=$(now)
  kill -9 "$1"
  t1=$(wait_for "$2" "$3" 60)
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }'
}

worker_times=()
master_times=()
for run in $(seq 1 "$RUNS"); do
  start_group "w$run"
  d=$(kill_and_time "$W2" "$SOAK_LOG" "soak: step")
  worker_times+=("$d")
  echo "run $run killed worker: master reported it after $d s: $(grep -m1 "^soak: step" "$SOAK_LOG" | cut -c1-200)"
  stop "$SOAK" "$W1"

  start_group "m$run"
  d=$(kill_and_time "$SOAK" "$W1_LOG" "has not answered")
  master_times+=("$d")
  echo "run $run killed master: worker w1 gave up after $d s: $(grep -m1 "has not answered" "$W1_LOG" | cut -c1-200)"
  stop "$W1" "$W2"
done
echo "killed worker: median $(printf '%s\n' "${worker_times[@]}" | median) s over $RUNS runs (${worker_times[*]})"
echo "killed master: median $(printf '%s\n' "${master_times[@]}" | median) s over $RUNS runs (${master_times[*]})"
