#!/usr/bin/env bash
# Measures elastic recovery with the real programs (master --max-restarts):
# a job of two `worker`s is SIGKILLed in one of them mid-run, and the time
# from the kill to the first step completed after the restore is taken from
# the master's output (polled every 5 ms), with
#
#   spare    a third worker standing by (--spares s1) takes the place
#   restart  the killed worker is started again at once under its name
#            (as a supervisor with no delay would: remora-launch
#            --restart-delay 0)
#
# for the small CNN (Fashion-MNIST, 640 training rows: a line per step)
# and ResNet50 (the demo's random batches, 64x64 images, batches of 32).
# Prints each run (seconds from the kill to the step, steps trained again)
# and the median per case. REMORA_ELASTIC_DEVICE (e.g. cuda:0) puts every
# worker's stages on that device (scripts/gpu_check.sh's elastic step);
# REMORA_BUILD_DIR names the build (default build).
#
#   scripts/measure_elastic.sh [RUNS] [CASES]   (default 3; "cnn-spare cnn-restart resnet-spare resnet-restart")
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
RUNS=${1:-3}
CASES=${2:-"cnn-spare cnn-restart resnet-spare resnet-restart"}
source scripts/measure_common.sh  # BIN, WORK, PIDS, now, wait_for, median

# Starts worker $1 for the master at port $2, logging to $3; its pid in
# LAST_PID (and PIDS, for the cleanup).
worker() {
  local device=()
  [ -n "${REMORA_ELASTIC_DEVICE:-}" ] && device=(--device "$REMORA_ELASTIC_DEVICE")
  "$BIN/worker" --name "$1" --master "127.0.0.1:$2" --threads 1 "${device[@]}" >"$3" 2>&1 &
  LAST_PID=$!
  disown "$LAST_PID"
  PIDS+=("$LAST_PID")
}

# One run of case $1 (model-how), number $2: sets TOOK (seconds from the
# kill to the next step) and REDONE (steps trained again). Not in a
# subshell, so that PIDS reaches the cleanup.
run_case() {
  local model=${1%-*} how=${1#*-} run=$2
  local port=$((20000 + RANDOM % 20000)) dir=$WORK/$1_$run
  local log=$dir/master.log step_line saved
  mkdir -p "$dir"
  local args=(--workers w1,w2 --listen "127.0.0.1:$port" --threads 1 --max-restarts 1
              --checkpoint-dir "$dir/ckpt" --report "$dir/report.json")
  [ "$how" = spare ] && args+=(--spares s1)
  if [ "$model" = cnn ]; then
    args+=(--dataset fashion-mnist --train-rows 640 --epochs 3 --batch-size 64 --splits 2 --checkpoint-every 5)
    step_line="batches  loss="
    saved="checkpoint: step 5 "
  else
    args+=(--batches 8 --image-size 64 --batch-size 32 --splits 2 --checkpoint-every 3)
    step_line="batch="
    saved="checkpoint: step 3 "
  fi
  local w2
  worker w1 "$port" "$dir/w1.log"
  worker w2 "$port" "$dir/w2.log"
  w2=$LAST_PID
  if [ "$how" = spare ]; then worker s1 "$port" "$dir/s1.log"; fi
  "$BIN/master" "${args[@]}" >"$log" 2>&1 &
  local master=$!
  PIDS+=("$master")
  wait_for "$log" "$saved" 600 >/dev/null
  local t0 t1
  t0=$(now)
  kill -9 "$w2"
  if [ "$how" = restart ]; then
    while kill -0 "$w2" 2>/dev/null; do sleep 0.005; done
    worker w2 "$port" "$dir/w2_again.log"
  fi
  t1=$(wait_for "$log" "$step_line" 600 "resumed from")
  wait "$master" || { echo "measure_elastic: the master failed" >&2; tail -20 "$log" >&2; return 1; }
  REDONE=$(grep -o '"steps_redone": [0-9]*' "$dir/report.json" | head -1 | awk '{ print $2 }')
  TOOK=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }')
}

for c in $CASES; do
  times=()
  for run in $(seq 1 "$RUNS"); do
    run_case "$c" "$run"
    echo "$c run $run: $TOOK s from the kill to the next step, $REDONE steps trained again"
    times+=("$TOOK")
  done
  echo "$c: median $(printf '%s\n' "${times[@]}" | median) s of ${RUNS} (${times[*]})"
done
