#!/usr/bin/env bash
# Rehearses scripts/gpu_check.sh here, where it can be fixed at leisure,
# before a GPU machine's short lease depends on it (`./run gpu-rehearse`).
#
# A GPU machine has LibTorch, the CUDA toolkit and NCCL, but no gRPC,
# protobuf or Abseil, and no package archive: gpu_check.sh brings Debian
# 12's packages of those along in .debs/ (./run gpu-prep) and unpacks them
# into .deps-root/. This makes such a machine without the GPU: a Debian 12
# root under build-bookworm/ with only the compiler, CMake and LibTorch
# (Debian's 1.13, CPU) installed, this machine's CUDA toolkit at
# /usr/local/cuda mounted read-only when there is one, and a copy of the
# source tree as the device gets it (tracked and untracked files that git
# does not ignore, plus .debs/). There it runs
#
#   scripts/gpu_check.sh OUT "build gpu all-tests"
#
# (bench and demo need a GPU), with no network inside the check. The logs
# and summary land in build-bookworm/check/. Fails when gpu_check.sh does.
# Needs root (debootstrap, chroot, mount); the root is made once (about
# 1.5 GB with LibTorch) and kept across clones (see debian_root_path).
#
# usage: scripts/gpu_rehearse.sh [STEPS]   (default "build gpu all-tests")
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
src=$PWD
steps=${1:-build gpu all-tests}
. scripts/debian_root.sh
root=$(debian_root_path bookworm "$src/build-bookworm/root")

debian_root_unshare "$@"
[ -d .debs ] || ./run gpu-prep
debian_root_make bookworm "$root"
debian_root_mount "$root"

# What a GPU machine has besides the GPU: a compiler, CMake, LibTorch
# (the wheel's there; Debian's here), Python. Never gRPC, protobuf, Abseil.
# And ccache, which a GPU machine may lack (the build then goes without it):
# here it keeps the rehearsal's builds in the kept root's cache.
want=(cmake make g++ libtorch-dev libgloo-dev libopenblas0-pthread python3 ccache)
if ! debian_root_run "$root" dpkg-query -W "${want[@]}" >/dev/null 2>&1; then
  echo "gpu_rehearse: installing ${want[*]} in $root (once)" >&2
  # (-f first: a kept root lacks what the loop below removed, which apt
  # counts as broken.)
  debian_root_run "$root" /bin/bash -c "apt-get update -q >/dev/null &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q -f --no-install-recommends >/dev/null &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends ${want[*]} >/dev/null"
fi
# Debian's libtorch-dev depends on libprotobuf-dev, which a wheel does not
# need: its headers, CMake files and protoc go, the LibTorch stays.
for absent in libgrpc++-dev libprotobuf-dev libabsl-dev protobuf-compiler libgtest-dev; do
  if debian_root_run "$root" dpkg-query -W -f='${Status}' "$absent" 2>/dev/null | grep -q "ok installed"; then
    debian_root_run "$root" dpkg --remove --force-depends "$absent" >/dev/null 2>&1 || {
      echo "gpu_rehearse: could not remove $absent from $root" >&2; exit 1; }
  fi
done

# The source tree as the device machine gets it, fresh each time.
work=$root/work
rm -rf --one-file-system "$work"
mkdir -p "$work/remora" "$work/out"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$work/remora"
cp -r .debs "$work/remora/"
if [ -x /usr/local/cuda/bin/nvcc ]; then
  mkdir -p "$root/usr/local/cuda"
  mount --bind -o ro "$(readlink -f /usr/local/cuda)" "$root/usr/local/cuda"
  cuda=ON
else
  echo "gpu_rehearse: no CUDA toolkit here: building without the CUDA channel" >&2
  cuda=OFF
fi

rc=0
# No network inside but loopback, as on the device.
debian_root_run_offline "$root" REMORA_GPU_TORCH_DIR=/usr/lib/x86_64-linux-gnu/cmake/Torch \
  REMORA_GPU_CUDA=$cuda REMORA_GPU_TARGETS="${REMORA_GPU_TARGETS:-}" \
  /bin/bash -c 'cd /work/remora && scripts/gpu_check.sh /work/out "$0"' "$steps" || rc=$?
# The root may live outside the tree (debian_root_path); the logs do not.
mkdir -p "$src/build-bookworm"
rm -rf "$src/build-bookworm/check"
cp -r "$work/out" "$src/build-bookworm/check"
echo "gpu_rehearse: gpu_check.sh exited $rc; logs in build-bookworm/check/:" >&2
cat "$src/build-bookworm/check/summary.txt" >&2
exit $rc
