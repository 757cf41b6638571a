#!/usr/bin/env bash
# Image-folder reading, remora's loader against torchvision's, on the same
# files: writes DIR/train/<4 classes>/ with N photo-sized JPEGs (500x375,
# quality 90, smooth content with noise, as PIL saves them), then times
# the training recipe (random resized crop to 224, flip, normalise) with
# build/bin/data_bench at 1 and 2 threads and with torchvision's
# ImageFolder + DataLoader at num_workers 0 and 2 (one intra-op thread
# each). Needs Debian's python3-torchvision (and python3-pil).
#
#   scripts/imagefolder_bench.sh [DIR] [N] [BATCHES]   (defaults: /tmp/remora-imagefolder-bench 512 12)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-/tmp/remora-imagefolder-bench}
n=${2:-512}
batches=${3:-12}
py=/usr/bin/python3
if [ ! -f "$dir/train/.complete-$n" ]; then
  rm -rf "$dir"
  "$py" - "$dir" "$n" <<'PY'
import os, sys, numpy as np
from PIL import Image
root, n = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
yy, xx = np.mgrid[0:375, 0:500]
for i in range(n):
    d = os.path.join(root, "train", f"class{i % 4}")
    os.makedirs(d, exist_ok=True)
    a, b, c = rng.uniform(0.005, 0.03, 3)
    img = np.stack([127 + 100 * np.sin(a * xx + b * yy + k) for k in range(3)], -1)
    img += rng.normal(0, 12, img.shape)
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(os.path.join(d, f"{i:05d}.jpg"), quality=90)
open(os.path.join(root, "train", f".complete-{n}"), "w").close()
PY
fi
echo "remora (build/bin/data_bench):"
build/bin/data_bench --dataset "imagefolder:$dir" --data-threads 1,2 --batches "$batches" --batch-size 64
echo "torchvision ImageFolder + DataLoader:"
"$py" - "$dir" "$batches" <<'PY'
import sys, time, torch, torchvision.transforms as T
from torchvision.datasets import ImageFolder
torch.set_num_threads(1)
t = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
               T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
ds = ImageFolder(sys.argv[1] + "/train", transform=t)
for workers in (0, 2):
    dl = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=False, num_workers=workers)
    it = iter(dl)
    next(it)  # warm-up: workers started, files in the page cache
    t0, images = time.time(), 0
    for _ in range(int(sys.argv[2])):
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(dl); x, y = next(it)
        images += x.shape[0]
    s = time.time() - t0
    per = max(workers, 1)
    print(f"num_workers={workers} images={images} seconds={s:.3f} images_per_second={images / s:.1f} "
          f"per_process={images / s / per:.1f}")
PY
