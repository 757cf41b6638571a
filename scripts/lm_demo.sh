#!/usr/bin/env bash
# A language model as a pipeline on one machine: starts two local workers,
# trains the built-in byte-level GPT on a text every Debian machine has (the
# GNU GPL's, from base-files; REMORA_LM_TEXT names another) for 16 epochs
# (Adam at 0.002 after 20 warm-up steps, then a cosine down to 0.0002),
# reporting the held-out perplexity after each, then samples 200 bytes from
# the last checkpoint with `generate`. Writes build/lm-demo/{report.json,
# curves.svg,ckpt/}. Workers are stopped on success, failure and Ctrl-C.
# Extra arguments go to the master (e.g. --epochs 8 --layers 6).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
BIN=${REMORA_BUILD_DIR:-build}/bin
OUT=${REMORA_LM_DEMO_DIR:-${REMORA_BUILD_DIR:-build}/lm-demo}
PORT=${MASTER_PORT:-29510}
TEXT=${REMORA_LM_TEXT:-/usr/share/common-licenses/GPL-3}
# (A fresh run each time: the checkpoints of the last are replaced.)
rm -rf "$OUT/ckpt"
mkdir -p "$OUT"

source scripts/local_workers.sh
"$BIN/master" --workers worker1,worker2 --listen "127.0.0.1:$PORT" --dataset "text:$TEXT" \
  --layers 4 --d-model 128 --heads 4 --seq-len 64 --epochs 16 --splits 4 \
  --lr 0.002 --lr-schedule cosine --warmup-steps 20 \
  --checkpoint-dir "$OUT/ckpt" --report "$OUT/report.json" --curves "$OUT/curves.svg" "$@"
echo "--- a sample of the trained model (generate --checkpoint-dir $OUT/ckpt --prompt 'The licensee '):"
"$BIN/generate" --checkpoint-dir "$OUT/ckpt" --prompt "The licensee " --tokens 200 --top-k 40 --seed 1
echo
