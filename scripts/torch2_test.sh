#!/usr/bin/env bash
# The whole test suite on Debian 13 ("trixie"): LibTorch 2.6 (CPU), g++ 14,
# Abseil 20240722, GoogleTest 1.16, against Debian 12's LibTorch 1.13 that
# the other commands use. GPU machines build with LibTorch 2.x; this runs
# everything that does not need a GPU on that major version, here.
#
# A trixie root is made once with debootstrap (about 2 GB with the build
# dependencies, which `./run` installs inside it as it does here), kept
# across clones in /var/cache/remora/roots (see debian_root_path); the source tree is bind-mounted at /src, and
# `./run test` builds in /build inside the root and runs ctest there
# (without the fuzzer: clang-14 is a Debian 12 package). Needs root:
# debootstrap, chroot and mount.
#
# REMORA_TORCH2_SUITE=sid runs it on Debian unstable instead (LibTorch
# 2.14, which needs C++20; g++ 16; a moving target, so not part of CI),
# in build-sid/.
#
# usage: scripts/torch2_test.sh [ctest arguments]   (./run torch2-test)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
src=$PWD
suite=${REMORA_TORCH2_SUITE:-trixie}
. scripts/debian_root.sh
root=$(debian_root_path "$suite" "$src/build-$suite/root")

debian_root_unshare "$@"
debian_root_make "$suite" "$root"
debian_root_mount "$root"
rm -rf --one-file-system "$root/build" "$root/build.log"  # a fresh build each time
mkdir -p "$root/src"
mount --bind "$src" "$root/src"

# ctest arguments keep `./run test` from fuzzing (clang-14 is Debian 12's).
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--timeout 600)
debian_root_run "$root" REMORA_BUILD_DIR=/build /bin/bash -c '
    cd /src
    echo "torch2_test: installing the build dependencies and building in /build" \
         "(log: $0/build.log)"
    ./run build >/build.log 2>&1 || { tail -60 /build.log; exit 1; }
    echo "torch2_test: Debian $(cat /etc/debian_version), $(g++ --version | head -1)"
    dpkg-query -W -f="torch2_test: \${Package} \${Version}\n" libtorch-dev libabsl-dev libgtest-dev libgrpc++-dev libdnnl3.6
    # Known trap (2026-11-24): with trixie'"'"'s oneDNN 3.7.2 (libdnnl3.6),
    # LibTorch 2.6 dies of SIGFPE (integer divide by zero in
    # dnnl_convolution_backward_data_primitive_desc_create) in any
    # convolution backward pass on this VM, remora'"'"'s code before and after
    # the layout change alike. One local ResNet50 step tells; if it dies,
    # the tests whose programs train a convolution (ResNet50 or the CNN)
    # are left out, loudly.
    conv_trainers="^(Master[.]|RemoraLaunch[.]ThreeRanks|CheckpointJob[.]|Ps(Partitions)?[.]Master|NetNamespaces[.](ThreeHosts|ACutLink)|ImageFolderMaster[.](TrainsLocallyAndOverWorkersAlike|AFolderWithoutVal))"
    if ! /build/bin/master --local --splits 2 --batches 1 --image-size 64 --batch-size 8 \
         >/build/probe.log 2>&1; then
      echo "torch2_test: WARNING: LibTorch 2.6 here cannot train a convolution" \
           "($(grep -o "Caught signal [0-9]* ([^)]*)" /build/probe.log | head -1)); the" \
           "tests that train a convolution in a program are left out: $conv_trainers" \
           "(see docs/cuda-and-libtorch2.md)" >&2
      # (merged with an -E of the caller'"'"'s: ctest keeps only the last -E)
      excluded=$conv_trainers kept=()
      while [ $# -gt 0 ]; do
        if [ "$1" = -E ] && [ $# -gt 1 ]; then excluded="($2)|$excluded"; shift 2
        else kept+=("$1"); shift; fi
      done
      set -- "${kept[@]}" -E "$excluded"
    fi
    ./run test "$@"' "${root#"$src"/}" "${args[@]}"
