#!/usr/bin/env bash
# The ResNet50 pipeline demo on one machine: starts two local workers, sweeps
# --splits 1,2,4,8, and trains the same batches in one process (--local,
# splits 1) for comparison, batch by batch between the last split count's. Writes build/demo/{report.json,trace.json,
# timeline.svg}. Workers are stopped on success, failure and Ctrl-C.
# Extra arguments go to the master (e.g. --batches 1 --image-size 64).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
BIN=${REMORA_BUILD_DIR:-build}/bin
OUT=${REMORA_DEMO_DIR:-${REMORA_BUILD_DIR:-build}/demo}
PORT=${MASTER_PORT:-29500}
mkdir -p "$OUT"

source scripts/local_workers.sh
"$BIN/master" --workers worker1,worker2 --listen "127.0.0.1:$PORT" --splits 1,2,4,8 \
  --report "$OUT/report.json" --trace "$OUT/trace.json" --timeline "$OUT/timeline.svg" \
  --compare-local "$@"
