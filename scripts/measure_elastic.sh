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
# and the median per case.
#
#   scripts/measure_elastic.sh [RUNS] [CASES]   (default 3; "cnn-spare cnn-restart resnet-spare resnet-restart")
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
BIN=${REMORA_BUILD_DIR:-build}/bin
RUNS=${1:-3}
CASES=${2:-"cnn-spare cnn-restart resnet-spare resnet-restart"}
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

now() { date +%s.%N; }

# Waits until file $1 has a line matching $2 after its first line matching
# $3 (or anywhere when $3 is empty), at most $4 seconds; prints the time.
wait_for() {
  local deadline
  deadline=$(awk -v t="$(now)" -v s="$4" 'BEGIN { printf "%.3f", t + s }')
  until awk -v p="$2" -v m="$3" 'm == "" || index($0, m) { seen = 1 } seen && index($0, p) { found = 1 }
                                 END { exit !found }' "$1" 2>/dev/null; do
    if awk -v t="$(now)" -v d="$deadline" 'BEGIN { exit !(t > d) }'; then
      echo "measure_elastic: '$2' did not appear in $1 within $4 s" >&2
      tail -20 "$1" >&2
      return 1
    fi
    sleep 0.005
  done
  now
}

worker() {  # name port log
  "$BIN/worker" --name "$1" --master "127.0.0.1:$2" --threads 1 >"$3" 2>&1 &
  local pid=$!
  disown "$pid"
  PIDS+=("$pid")
  echo "$pid"
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# One run of case $1 (model-how), number $2: prints "seconds redone".
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
  local w1 w2
  w1=$(worker w1 "$port" "$dir/w1.log")
  w2=$(worker w2 "$port" "$dir/w2.log")
  [ "$how" = spare ] && worker s1 "$port" "$dir/s1.log" >/dev/null
  "$BIN/master" "${args[@]}" >"$log" 2>&1 &
  local master=$!
  PIDS+=("$master")
  wait_for "$log" "$saved" "" 600 >/dev/null
  local t0 t1
  t0=$(now)
  kill -9 "$w2"
  if [ "$how" = restart ]; then
    while kill -0 "$w2" 2>/dev/null; do sleep 0.005; done
    worker w2 "$port" "$dir/w2_again.log" >/dev/null
  fi
  t1=$(wait_for "$log" "$step_line" "resumed from" 600)
  wait "$master" || { echo "measure_elastic: the master failed" >&2; tail -20 "$log" >&2; return 1; }
  local redone
  redone=$(grep -o '"steps_redone": [0-9]*' "$dir/report.json" | head -1 | awk '{ print $2 }')
  awk -v a="$t0" -v b="$t1" -v r="$redone" 'BEGIN { printf "%.3f %s\n", b - a, r }'
}

for c in $CASES; do
  times=()
  for run in $(seq 1 "$RUNS"); do
    result=$(run_case "$c" "$run")
    echo "$c run $run: $(echo "$result" | awk '{ print $1 }') s from the kill to the next step," \
         "$(echo "$result" | awk '{ print $2 }') steps trained again"
    times+=("$(echo "$result" | awk '{ print $1 }')")
  done
  echo "$c: median $(printf '%s\n' "${times[@]}" | median) s of ${RUNS} (${times[*]})"
done
