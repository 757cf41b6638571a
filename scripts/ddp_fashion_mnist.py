#!/usr/bin/env python3
"""PyTorch DDP's side of remora's data-parallel comparison (docs/measurements.md).

Trains the small CNN of `master --dataset fashion-mnist` (shards/cnn.cc: conv
32, pool, conv 64, pool, linear 128, linear 10) with DistributedDataParallel
over Gloo, 2 ranks of one intra-op thread each, on the same recipe as

    master --workers w1,w2 --replicas 2 --dataset fashion-mnist --epochs 1

(batches of 64 rows in all, each rank its contiguous half, SGD lr 0.01 with
momentum 0.9, cross-entropy, images normalised with the training set's mean
and std), and prints `epoch=E train_loss=L seconds=S images_per_second=I`
per epoch: the training loop only, as remora's epoch line.

Needs Debian's python3-torch and dataset-fashion-mnist:
    /usr/bin/python3 scripts/ddp_fashion_mnist.py [--epochs 1] [--ranks 2]
"""
import argparse
import gzip
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

DATA = "/usr/share/datasets/fashion-mnist"


def read_idx(name):
    with gzip.open(os.path.join(DATA, name), "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def model():
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 5 * 5, 128), nn.ReLU(), nn.Linear(128, 10))


def run(rank, args):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    images = torch.from_numpy(read_idx("train-images-idx3-ubyte.gz").copy()).float().div_(255)
    labels = torch.from_numpy(read_idx("train-labels-idx1-ubyte.gz").astype(np.int64))
    images = ((images - images.mean()) / images.std()).unsqueeze(1)
    torch.manual_seed(args.seed)
    net = DistributedDataParallel(model())
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    n = images.shape[0] // args.batch_size * args.batch_size
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(args.seed + epoch))
        dist.barrier()
        start = time.perf_counter()
        total, batches = 0.0, 0
        for b in range(0, n, args.batch_size):
            rows = order[b:b + args.batch_size]
            share = rows.chunk(args.ranks)[rank]
            opt.zero_grad()
            loss = loss_fn(net(images[share]), labels[share])
            loss.backward()
            opt.step()
            total += loss.item()
            batches += 1
        dist.barrier()
        seconds = time.perf_counter() - start
        if rank == 0:
            print(f"epoch={epoch} train_loss={total / batches:.4f} seconds={seconds:.1f} "
                  f"images_per_second={n / seconds:.0f}", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="rows per batch over all ranks")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--port", type=int, default=29650)
    args = p.parse_args()
    mp.spawn(run, args=(args,), nprocs=args.ranks)


if __name__ == "__main__":
    main()
