#!/usr/bin/env bash
# Measures checkpoints with the real programs on two local workers: the
# time and size of each save, the load on --resume, and what saving every
# N steps costs a run (total time; the batch times exclude the saves).
#
#   ResNet50 (64x64 images, batch 32, 4 micro-batches, Adam: parameters and
#   two moments), 6 batches: no checkpoint / one at the end / one every
#   batch, then a resume from step 3;
#   the small CNN on Fashion-MNIST (6,400 images: 100 batches of 64, SGD
#   with momentum): no checkpoint / one every 10 steps.
#
#   scripts/measure_checkpoints.sh        (build/bin; REMORA_BUILD_DIR to change)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
source scripts/measure_common.sh  # BIN, WORK, PIDS

# Runs the master over two fresh workers with "$@"; prints its key lines
# and the wall time.
run() {
  local label=$1 port
  shift
  port=$((29600 + RANDOM % 1000))
  "$BIN/worker" --name w1 --master "127.0.0.1:$port" >"$WORK/w1.log" 2>&1 & PIDS+=($!)
  "$BIN/worker" --name w2 --master "127.0.0.1:$port" >"$WORK/w2.log" 2>&1 & PIDS+=($!)
  local t0 t1
  t0=$(date +%s.%N)
  "$BIN/master" --workers w1,w2 --listen "127.0.0.1:$port" "$@" >"$WORK/master.log" 2>&1
  t1=$(date +%s.%N)
  wait
  echo "== $label: $(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }') s wall"
  grep -E '^(checkpoint|resumed)|^ +[0-9]+ +[a-z0-9]+ +[0-9.]+ +[0-9.]+' "$WORK/master.log" | sed 's/^/   /' || true
}

resnet=(--batches 6 --batch-size 32 --image-size 64 --splits 4 --optimizer adam --lr 0.001)
run "ResNet50, no checkpoint" "${resnet[@]}"
run "ResNet50, one at the end" "${resnet[@]}" --checkpoint-dir "$WORK/r1"
run "ResNet50, every batch" "${resnet[@]}" --checkpoint-dir "$WORK/r2" --checkpoint-every 1 --keep 6
echo "   one checkpoint on disk: $(du -sh "$WORK/r2/step-00000003" | cut -f1)"
run "ResNet50, resumed from step 3" "${resnet[@]}" --resume "$WORK/r2/step-00000003" --checkpoint-dir "$WORK/r3"

cnn=(--dataset fashion-mnist --train-rows 6400 --epochs 1 --splits 2)
run "CNN, no checkpoint" "${cnn[@]}"
run "CNN, every 10 steps" "${cnn[@]}" --checkpoint-dir "$WORK/c1" --checkpoint-every 10
