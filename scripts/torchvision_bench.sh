#!/usr/bin/env bash
# torchvision's resnet18 as a PyTorch user saves it (torch.jit.script, its
# first convolution taking Fashion-MNIST's one channel), cut by the master
# over two one-thread workers at --splits 4, against master --local (its
# own thread choice) on the same rows: one epoch of ROWS images in batches
# of 64 each, PAIRS pairs in alternating order; prints each run's epoch
# seconds (the epoch line's, training only) and each pair's ratio. Needs
# Debian's python3-torchvision and dataset-fashion-mnist.
#
#   scripts/torchvision_bench.sh [ROWS] [PAIRS]   (defaults: 2048 4)
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-2048}
pairs=${2:-4}
bin=${REMORA_BUILD_DIR:-build}/bin
model=$(mktemp -d)/resnet18_1ch.pt
/usr/bin/python3 - "$model" <<'PY'
import sys, torch, torchvision
torch.manual_seed(0)
m = torchvision.models.resnet18(num_classes=10)
m.conv1 = torch.nn.Conv2d(1, 64, 7, 2, 3, bias=False)
torch.jit.script(m).save(sys.argv[1])
PY
common=(--model "$model" --dataset fashion-mnist --train-rows "$rows" --epochs 1 --batch-size 64 --splits 4 --seed 1)
# One run's epoch seconds.
run() {
  local line
  if [ "$1" = pipe ]; then
    local port=$((29800 + RANDOM % 100)) w
    for w in w1 w2; do "$bin/worker" --name "$w" --master "127.0.0.1:$port" --threads 1 >/dev/null 2>&1 & done
    line=$("$bin/master" --workers w1,w2 --listen "127.0.0.1:$port" "${common[@]}" | grep '^epoch=')
    wait
  else
    line=$("$bin/master" --local "${common[@]}" | grep '^epoch=')
  fi
  sed 's/.*seconds=\([0-9.]*\).*/\1/' <<<"$line"
}
echo "pair pipeline_s local_s ratio"
for ((i = 1; i <= pairs; i++)); do
  if ((i % 2)); then p=$(run pipe); l=$(run local); else l=$(run local); p=$(run pipe); fi
  echo "$i $p $l $(awk -v p="$p" -v l="$l" 'BEGIN { printf "%.2fx", p / l }')"
done
rm -rf "$(dirname "$model")"
