#!/usr/bin/env bash
# The GPU checks in one go, for a CUDA machine that reaches no package archive
# (docs/cuda-and-libtorch2.md, "Running the GPU tests on a GPU machine").
#
# On a machine that reaches Debian's archive first: `./run gpu-prep` puts
# Debian 12's gRPC, protobuf, Abseil, GoogleTest and OpenSSL packages in
# .debs/ (about 20 MB; nothing is installed). Bring .debs/ along with the
# source tree, then on the GPU machine, from the repository root:
#
#   scripts/gpu_check.sh [OUTDIR] [STEPS]
#
# STEPS (default all, in this order; a later call may resume with the rest,
# since build-gpu/ stays):
#   build   unpacks .debs/ into .deps-root/, configures build-gpu/ against
#           the CUDA LibTorch of `python3 -c 'import torch'` with
#           REMORA_CUDA=ON, builds everything
#   gpu     ctest -R 'Cuda|Device' but the dp step's (CudaGpu.*: the
#           channels on the GPU)
#   bench   rpc_bench --device cuda (CUDA IPC: bulk_gbps, d2d_gbps), with
#           --peer-device cuda:1 too (NCCL) when there are two GPUs, and the
#           CPU rpc_bench for comparison
#   demo    the ResNet50 demo with two `worker --device cuda:0` processes
#           (--splits 1,2,4,8, 2 batches), and --local on cuda:0
#   protocol  the step protocol's cost on one GPU: ResNet50 (batch 128 at
#           128x128, torchvision's two-part cut) over two `worker --device
#           cuda:0` at --splits 1 and 8, 20 batches, against `master --local
#           --device cuda:0` at the same splits (steady_batch_s side by side;
#           three interleaved rounds: protocol_report[-2,-3].json and
#           protocol_local[-2,-3].json; each pipeline report's
#           steady_data_wait_seconds is how much of its steady batch the
#           master waited for its random batch), once each the same with the IPC
#           receives waiting on the GPU instead of the host
#           (REMORA_CUDA_STREAM_RECEIVES=1), with the workers' passes on
#           their pool's threads instead of one lane thread (REMORA_LANE=0:
#           how it ran before the lane) and the master-centred protocol
#           (REMORA_STEP_PROTOCOL=master), and one GPU worker holding the
#           whole model (protocol_one_worker_report.json: the worker's own
#           path without a stage boundary or a second process on the GPU);
#           Perfetto traces of --splits 1 (OUTDIR/protocol_trace.json, and
#           protocol_one_worker_trace.json, protocol_local_trace.json: with
#           the workers' copies and waits and the master's own slices); the
#           rounds' ratios against the bounds go to OUTDIR/summary.txt
#   lm      a GPT on the GPU (6 layers, d-model 256, 4 heads, seq-len 256,
#           batch 32, on the repository's docs as text): over two `worker
#           --device cuda:0` at --splits 4 against `master --local --device
#           cuda:0`, in fp32 and --precision bf16; tokens/s and model FLOPs
#           utilisation against --peak-tflops 989 (the H200's dense bf16) in
#           lm_{fp32,bf16}.json and lm_local_{fp32,bf16}.json
#   dp      data parallelism on the GPU: CudaProcessGroup.* and
#           CudaDataParallel.* with REMORA_DEBUG=channels, then ResNet50
#           (64x64) as --replicas 2 over two `worker --device cuda:0`
#   zb      issue 58's benchmark: the built-in GPT (8 layers, d-model 256,
#           windows of 256, batches of 32) over two `worker --device
#           cuda:0` at --splits 4 under 1f1b, zb1p and zbv, three rounds
#           (each in another order); zb_<schedule>[-2,-3].json, and in
#           summary.txt each schedule's steady batch against 1F1B's (the
#           issue's bound: 0.90x) and its measured bubble beside the
#           schedule's own
#   elastic  master --max-restarts with `worker --device cuda:0`s: one is
#           SIGKILLed after a checkpoint and a spare takes its place, then
#           (a new process, its CUDA channel set up anew) the same name
#           comes back (scripts/measure_elastic.sh, ResNet50 at 64x64)
#   all-tests  the whole ctest suite against this LibTorch (CPU paths too)
#
# Every step's output goes to OUTDIR/<step>.log (default build-gpu/check),
# and a line per step, with its exit code and seconds, to OUTDIR/summary.txt.
# Exits non-zero when a step failed (the later ones still run, except after
# a failed build).
# REMORA_GPU_CHECK_DEVICE (default cuda:0) is the device of the workers and
# one-process runs of the steps that train (cpu: to try a step's script
# where there is no GPU, against any build/bin linked as build-gpu/bin).
# REMORA_GPU_TORCH_DIR names LibTorch's CMake directory instead of asking
# Python (REMORA_GPU_PYTHON, default python3, else /opt/torch/.venv's);
# REMORA_GPU_JOBS the build's parallelism (default: all cores);
# REMORA_GPU_TARGETS, when set, the only targets `build` builds: names, or
# `gpu` for what the gpu, bench and demo steps use (on a short lease: the
# build then takes about half as long). Run the
# steps in two calls where one command may take at most 10 minutes:
# `build gpu bench`, then `demo all-tests`.
set -uo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
out=${1:-build-gpu/check}
steps=${2:-build gpu bench demo protocol lm zb dp elastic all-tests}
device=${REMORA_GPU_CHECK_DEVICE:-cuda:0}
mkdir -p "$out"
out=$(cd "$out" && pwd)
jobs=${REMORA_GPU_JOBS:-$(nproc)}
build=build-gpu
bin=$build/bin
failed=0
dp_tests='CudaDataParallel|CudaProcessGroup'  # the dp step's, not gpu's

log() { echo "gpu_check: $*" | tee -a "$out/summary.txt" >&2; }

# Unpacks .debs/ (no dpkg database, no root) and points CMake, the loader
# and PATH there.
use_debs() {
  local prefix=$PWD/.deps-root lib
  [ -d .debs ] || { echo "gpu_check: no .debs/: run ./run gpu-prep where Debian's archive is reachable" >&2; return 1; }
  if [ ! -f "$prefix/.unpacked" ]; then
    mkdir -p "$prefix"
    for f in .debs/*.deb; do dpkg-deb -x "$f" "$prefix" || return 1; done
    # Debian's -dev symlinks can be absolute: point them into the prefix.
    find "$prefix" -type l | while read -r l; do
      t=$(readlink "$l")
      case "$t" in /*) [ -e "$prefix$t" ] && ln -sfn "$prefix$t" "$l" ;; esac
    done
    touch "$prefix/.unpacked"
  fi
  lib=$prefix/usr/lib/x86_64-linux-gnu
  export CMAKE_PREFIX_PATH="$prefix/usr:$lib/cmake${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PATH="$prefix/usr/bin:$PATH"
  # The unpacked openssl (the tests make certificates with it) would read
  # its configuration from /usr/lib/ssl/openssl.cnf, which may not exist
  # here.
  export OPENSSL_CONF=$prefix/etc/ssl/openssl.cnf
}

# The Python that holds PyTorch, asked without the unpacked Debian
# libraries on the loader's path (they could shadow the image's own).
py() {
  env -u LD_LIBRARY_PATH "$python" "$@"
}

step_build() {
  local torch_dir=${REMORA_GPU_TORCH_DIR:-}
  nvidia-smi || true
  if [ -z "$torch_dir" ]; then
    py -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
           "devices", torch.cuda.device_count())' || return 1
    torch_dir=$(py -c 'import torch; print(torch.utils.cmake_prefix_path)')/Torch
    # NCCL: the wheel's own (nvidia-nccl-*, beside torch/), unless NCCL_ROOT
    # says otherwise (cmake/RemoraCuda.cmake also looks in the toolkit).
    if [ -z "${NCCL_ROOT:-}" ]; then
      local nccl
      nccl=$(py -c 'import os, torch; print(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "nccl"))')
      [ -f "$nccl/include/nccl.h" ] && export NCCL_ROOT=$nccl
    fi
  fi
  echo "LibTorch: $torch_dir"
  echo "NCCL_ROOT: ${NCCL_ROOT:-unset}"
  command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
  g++ --version | head -1
  nvcc --version | tail -1 || true
  # What decides whether processes can share the GPU (Exclusive_Process
  # would fail every multi-process step) and whether its memory can be
  # exported (expandable segments cannot: such tensors are staged).
  nvidia-smi -q -d COMPUTE 2>/dev/null | grep -i 'compute mode' || true
  echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-unset}"
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DREMORA_CUDA="${REMORA_GPU_CUDA:-ON}" \
    -DTorch_DIR="$torch_dir" || return 1
  local targets=${REMORA_GPU_TARGETS:-}
  [ "$targets" = gpu ] &&
    targets="worker master rpc_bench collective_bench channel_tests cuda_gpu_test parallel_tests"
  # shellcheck disable=SC2086  # a list of target names
  cmake --build "$build" -j "$jobs" ${targets:+--target $targets} || return 1
  # Which CUDA runtime, NCCL, LibTorch and protobuf the programs load (one
  # of each per process: the toolkit's and the wheel's share sonames).
  ldd "$bin/worker" | grep -E 'cudart|nccl|torch|c10|protobuf' || true
}

step_gpu() {
  # (a test that hangs must not spend the lease: 180 s each at most)
  (cd "$build" && ctest --output-on-failure --no-tests=error --timeout 180 -R 'Cuda|Device' \
    -E "$dp_tests")
}

step_bench() {
  local rc=0 gpus
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  timeout -k 10 240 "$bin/rpc_bench" --device cuda || rc=1
  if [ "${gpus:-0}" -ge 2 ]; then
    timeout -k 10 240 "$bin/rpc_bench" --device cuda --peer-device cuda:1 || rc=1
  else
    echo "one GPU: no NCCL run (NCCL needs two GPUs)"
  fi
  timeout -k 10 120 "$bin/rpc_bench" || rc=1
  return $rc
}

# N GPU workers (`worker --device cuda:0`, named worker1 ... workerN) and
# a master on this machine, the master run with SECONDS and the rest of the
# arguments; the workers are killed if the master fails, so that nothing
# holds the port or the GPU afterwards.
gpu_workers() {
  local port=29671 rc=0 n=$1 seconds=$2 i names= pids=()
  shift 2
  for i in $(seq 1 "$n"); do
    "$bin/worker" --name "worker$i" --device "$device" --master "127.0.0.1:$port" --connect-timeout 30 & pids+=($!)
    names=${names:+$names,}worker$i
  done
  timeout -k 10 "$seconds" "$bin/master" --workers "$names" --listen "127.0.0.1:$port" \
    --connect-timeout 30 "$@" || {
    rc=1
    kill "${pids[@]}" 2>/dev/null
  }
  for i in "${pids[@]}"; do wait "$i" || rc=1; done
  return $rc
}

two_gpu_workers() { gpu_workers 2 "$@"; }

step_demo() {
  local rc=0
  two_gpu_workers 300 --splits 1,2,4,8 --batches 2 --report "$out/demo_report.json" || rc=1
  timeout -k 10 120 "$bin/master" --local --device "$device" --splits 1,8 --batches 2 || rc=1
  return $rc
}

step_protocol() {
  local rc=0 n=20  # batches: on an H200 six were not enough to reach the steady batch
  # Three interleaved rounds of the two-worker protocol and one process
  # (protocol_report.json, protocol_local.json, then -2 and -3): this
  # host's speed moves between minutes.
  for round in 1 2 3; do
    local tag=
    [ "$round" -gt 1 ] && tag=-$round
    echo "== the step protocol (round $round of 3)"
    two_gpu_workers 300 --partition tutorial --splits 1,8 --batches $n \
      --report "$out/protocol_report$tag.json" || rc=1
    echo "== one process (round $round of 3)"
    timeout -k 10 180 "$bin/master" --local --device "$device" --splits 1,8 --batches $n \
      --report "$out/protocol_local$tag.json" || rc=1
  done
  echo "== the step protocol at --splits 1, traced (open in https://ui.perfetto.dev)"
  two_gpu_workers 120 --partition tutorial --splits 1 --batches 8 \
    --trace "$out/protocol_trace.json" || rc=1
  echo "== the step protocol, IPC receives waiting on the GPU (REMORA_CUDA_STREAM_RECEIVES=1)"
  REMORA_CUDA_STREAM_RECEIVES=1 two_gpu_workers 300 --partition tutorial --splits 1,8 --batches $n \
    --report "$out/protocol_stream_wait_report.json" || rc=1
  echo "== the step protocol, the workers' passes on their pool's threads (REMORA_LANE=0), for comparison"
  REMORA_LANE=0 two_gpu_workers 300 --partition tutorial --splits 1,8 --batches $n \
    --report "$out/protocol_pool_report.json" || rc=1
  echo "== one GPU worker holding the whole model (no stage boundary, one process on the GPU)"
  gpu_workers 1 240 --splits 1,8 --batches $n --report "$out/protocol_one_worker_report.json" || rc=1
  echo "== one GPU worker at --splits 1, traced"
  gpu_workers 1 120 --splits 1 --batches 8 --trace "$out/protocol_one_worker_trace.json" || rc=1
  echo "== the master-centred protocol (REMORA_STEP_PROTOCOL=master), for comparison"
  REMORA_STEP_PROTOCOL=master two_gpu_workers 300 --partition tutorial --splits 1,8 --batches $n \
    --report "$out/protocol_master_report.json" || rc=1
  echo "== one process at --splits 1, traced"
  timeout -k 10 120 "$bin/master" --local --device "$device" --splits 1 --batches 8 \
    --trace "$out/protocol_local_trace.json" || rc=1
  protocol_summary | while IFS= read -r line; do log "protocol: $line"; done
  return $rc
}

# The three rounds side by side: each split count's steady batch over two
# GPU workers against one process, the ratio against the issue's bound,
# and how much of the pipeline's batch the master waited for its data.
protocol_summary() {
  py - "$out" <<'PY'
import json, sys
out = sys.argv[1]
bound = {1: 1.3, 8: 1.1}
print("round splits pipeline_s local_s ratio bound verdict data_wait_s")
for n, tag in enumerate(["", "-2", "-3"], 1):
    try:
        runs = [{r["splits"]: r for r in json.load(open(f"{out}/protocol_{kind}{tag}.json"))["runs"]}
                for kind in ("report", "local")]
    except (OSError, ValueError, KeyError) as e:
        print(f"{n} no figures: {e}")
        continue
    for s in sorted(set(runs[0]) & set(runs[1])):
        p, l = runs[0][s]["steady_batch_seconds"], runs[1][s]["steady_batch_seconds"]
        ratio = p / l if l else float("nan")
        wait = runs[0][s].get("steady_data_wait_seconds")
        verdict = "-" if s not in bound else ("met" if ratio <= bound[s] else "MISSED")
        print(f"{n} {s} {p:.4f} {l:.4f} {ratio:.2f}x {bound.get(s, '-')} {verdict} "
              f"{'-' if wait is None else f'{wait:.4f}'}")
PY
}

# The language model on the GPU: the pipeline against one process, fp32
# and bf16, the same windows (issue 55's benchmark).
step_lm() {
  local rc=0 text=$out/lm_text.txt p
  cat docs/*.md README.md >"$text"
  local common=(--dataset "text:$text" --layers 6 --d-model 256 --heads 4 --seq-len 256 --batch-size 32
                --epochs 1 --train-rows 2048 --peak-tflops 989 --splits 4)
  for p in fp32 bf16; do
    echo "== two GPU workers, $p"
    two_gpu_workers 600 "${common[@]}" --precision "$p" --report "$out/lm_$p.json" || rc=1
    echo "== one process, $p"
    timeout -k 10 600 "$bin/master" --local --device "$device" "${common[@]}" --precision "$p" \
      --report "$out/lm_local_$p.json" || rc=1
  done
  return $rc
}

# Issue 58's benchmark on the GPU: the built-in GPT, whose stages balance,
# over two GPU workers at --splits 4 under 1F1B, zb1p and zbv (four stages
# in a V), three rounds each in another order (this host's speed moves
# between minutes); zb_summary sets them side by side.
step_zb() {
  local rc=0 text=$out/zb_text.txt round tag s
  local orders=("1f1b zb1p zbv" "zb1p zbv 1f1b" "zbv 1f1b zb1p")
  cat docs/*.md README.md >"$text"
  local common=(--dataset "text:$text" --layers 8 --d-model 256 --heads 4 --seq-len 256 --batch-size 32
                --epochs 1 --train-rows 1024 --seed 5 --splits 4)
  for round in 1 2 3; do
    tag=
    [ "$round" -gt 1 ] && tag=-$round
    for s in ${orders[$((round - 1))]}; do
      echo "== $s (round $round of 3)"
      two_gpu_workers 300 "${common[@]}" --schedule "$s" --report "$out/zb_$s$tag.json" || rc=1
    done
  done
  zb_summary | while IFS= read -r line; do log "zb: $line"; done
  return $rc
}

# Each round's schedules side by side: the steady batch, its ratio to
# 1F1B's in the same round against the issue's bound (0.90x for zb1p and
# zbv), and the measured bubble beside what the schedule alone leaves.
zb_summary() {
  py - "$out" <<'PY'
import json, sys
out = sys.argv[1]
print("round schedule steady_batch_s vs_1f1b bound verdict bubble schedule_bubble")
for n, tag in enumerate(["", "-2", "-3"], 1):
    runs = {}
    for s in ("1f1b", "zb1p", "zbv"):
        try:
            runs[s] = json.load(open(f"{out}/zb_{s}{tag}.json"))["runs"][0]
        except (OSError, ValueError, KeyError, IndexError) as e:
            print(f"{n} {s} no figures: {e}")
    base = runs.get("1f1b", {}).get("steady_batch_seconds")
    for s, r in runs.items():
        t, b = r["steady_batch_seconds"], r.get("bubble", {})
        ratio = t / base if base else float("nan")
        verdict = "-" if s == "1f1b" or not base else ("met" if ratio <= 0.90 else "MISSED")
        print(f"{n} {s} {t:.4f} {ratio:.2f}x {'-' if s == '1f1b' else '0.90'} {verdict} "
              f"{b.get('fraction', float('nan')):.1%} {b.get('schedule_fraction', float('nan')):.1%}")
PY
}

# Data parallelism on the GPU: the c10d groups and the CUDA replica test,
# their channels traced, then ResNet50 as two replicas on the two GPU
# workers.
step_dp() {
  local rc=0
  (cd "$build" && REMORA_DEBUG=channels ctest -V --no-tests=error --timeout 180 \
    -R "$dp_tests") || rc=1
  two_gpu_workers 240 --replicas 2 --splits 1,2 --batches 2 --image-size 64 \
    --report "$out/dp_report.json" || rc=1
  return $rc
}

# Elastic recovery with the stages on the GPU: a spare, then a restart
# under the lost name (whose process is new: its CUDA channel too).
step_elastic() {
  REMORA_BUILD_DIR=$build REMORA_ELASTIC_DEVICE=$device timeout -k 10 300 \
    scripts/measure_elastic.sh 1 "resnet-spare resnet-restart"
}

# (on 16 cores, ctest -j 10 ran the suite in 62 s)
step_all-tests() {
  (cd "$build" && ctest --output-on-failure -j "$(( (jobs + 1) / 2 ))" --timeout 300)
}

# python3 holds PyTorch on the GPU machines; the image's venv otherwise.
python=${REMORA_GPU_PYTHON:-python3}
if ! env -u LD_LIBRARY_PATH "$python" -c 'import torch' 2>/dev/null &&
   [ -x /opt/torch/.venv/bin/python3 ]; then
  python=/opt/torch/.venv/bin/python3
fi
trap 'kill $(jobs -p) 2>/dev/null' EXIT
[ -d .debs ] && { use_debs || exit 1; }
for s in $steps; do
  if ! declare -F "step_$s" >/dev/null; then
    echo "gpu_check: unknown step '$s' (build gpu bench demo protocol lm zb dp elastic all-tests)" >&2
    exit 2
  fi
  t0=$(date +%s)
  echo "gpu_check: step $s (log: $out/$s.log)" >&2
  "step_$s" >"$out/$s.log" 2>&1
  rc=$?
  log "$s rc=$rc seconds=$(( $(date +%s) - t0 ))"
  if [ $rc -ne 0 ]; then
    failed=1
    tail -30 "$out/$s.log" >&2
    [ "$s" = build ] && exit 1
  fi
done
exit $failed
