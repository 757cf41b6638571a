#!/usr/bin/env bash
# Installs remora from BUILD (cmake --install) into WORK/prefix and checks
# what a user's project meets there:
#  1. the exported targets ask users to link gRPC, protobuf, CUDA and NCCL,
#     never to include their headers ($<LINK_ONLY:...>);
#  2. the installed public headers compile, all in one unit, each twice (its
#     guard), with an include folder first whose protobuf, gRPC, CUDA and
#     NCCL headers stop the build with #error (a LibTorch wheel carries
#     protobuf headers of another version: a public header that reached
#     protobuf would break there); and each header with no source of its
#     name compiles alone there too. A header with a source of its name is
#     that source's first include (scripts/check_layout.sh), so compiling
#     each source alone (./run thread-safety, in CI) shows it compiles
#     alone: compiling it alone here again cost about 4 s of CPU a header
#     without a compiler cache, nearly all LibTorch's headers;
#  3. examples/custom_model builds against the package with that same
#     folder first, and its train_custom runs on train/: two replicas of a
#     two-stage pipeline of the project's own module over four of its own
#     worker programs, with checkpoints; a second run resumes from one and
#     must train the steps after it with the same losses.
# Run by ctest (Package.CustomModelBuildsAgainstTheInstalledPackage).
#
# usage: scripts/package_check.sh BUILD WORK
set -euo pipefail
src=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
build=$(cd "$1" && pwd)
work=$2
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
echo "package_check: installed into $work/prefix ($(find "$work/prefix" -type f | wc -l) files)"
# Through the compiler cache when there is one, as remora's own build
# (cmake/Ccache.cmake): paths relative to the source tree, which holds WORK
# in ctest's runs, so that CI's fresh clones find the objects.
launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR=$src CCACHE_INODECACHE=true
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER="$(command -v ccache)")
fi

# 1. Usage requirements: the private dependencies appear only as LINK_ONLY.
targets=$(find "$work/prefix" -name 'remoraTargets.cmake')
if grep -E 'INTERFACE_LINK_LIBRARIES' "$targets" | grep -oE '[^;"]*(gRPC::|protobuf::|CUDA::|remora::nccl)[^;"]*' |
     grep -vE '^[\\]?[$]<LINK_ONLY:' ; then
  echo "package_check: the exported targets above ask users for gRPC/protobuf/CUDA/NCCL usage requirements" \
       "(use remora_private_dependency, cmake/PrivateDeps.cmake)"
  exit 1
fi
if find "$work/prefix/include" -name '*.pb.h' | grep .; then
  echo "package_check: generated protobuf headers were installed"; exit 1
fi
echo "package_check: the exported targets ask only to link gRPC, protobuf, CUDA and NCCL"

# 2. The poisoned folder: every header name under these folders of the
# protobuf and gRPC this build used (/usr/include on Debian; an unpacked
# prefix on a GPU machine, which scripts/gpu_check.sh puts on
# CMAKE_PREFIX_PATH; the LibTorch wheel's own protobuf), and CUDA's and
# NCCL's main headers.
poison=$work/poison
mkdir -p "$poison"
cached() { sed -n "s|^$1:[A-Z]*=||p" "$build/CMakeCache.txt" 2>/dev/null | head -1; }
roots=(/usr/include)
IFS=: read -r -a prefixes <<<"${CMAKE_PREFIX_PATH:-}"
for p in "${prefixes[@]}"; do [ -n "$p" ] && roots+=("$p/include"); done
pb=$(cached Protobuf_INCLUDE_DIR) && [ -n "$pb" ] && roots+=("$pb")
torch_dir=$(cached Torch_DIR) && [ -n "$torch_dir" ] && roots+=("$torch_dir/../../../include")
for r in "${roots[@]}"; do
  for d in google/protobuf grpcpp grpc grpc++; do
    [ -d "$r/$d" ] || continue
    # (The folders made at once, the files by the shell's own echo: a
    # process or two a header took 11 s.)
    found=$(cd "$r" && find "$d" -name '*.h' -o -name '*.inc')
    [ -n "$found" ] || continue
    sed 's|/[^/]*$||' <<<"$found" | sort -u | (cd "$poison" && xargs mkdir -p)
    while read -r h; do
      echo "#error \"a remora public header includes <$h>: keep protobuf/gRPC out of them\"" >"$poison/$h"
    done <<<"$found"
  done
done
for h in cuda.h cuda_runtime.h cuda_runtime_api.h nccl.h; do
  echo "#error \"a remora public header includes <$h>: keep CUDA/NCCL out of them\"" >"$poison/$h"
done
[ -f "$poison/google/protobuf/message.h" ] && [ -f "$poison/grpcpp/grpcpp.h" ] || {
  echo "package_check: found no protobuf or gRPC headers to poison (looked in ${roots[*]})"; exit 1; }

headers=$work/headers
mkdir -p "$headers"
list=$(find "$work/prefix" -name remora-public-headers.txt)
installed=$(cd "$work/prefix/include/remora" && find . -name '*.h' | sed 's|^\./||' | sort)
if [ "$installed" != "$(sort "$list")" ]; then
  echo "package_check: installed headers differ from $list"; exit 1
fi
{
  echo 'cmake_minimum_required(VERSION 3.18)'
  echo 'project(remora_headers LANGUAGES CXX)'
  echo 'find_package(remora REQUIRED)'
  echo 'set(CMAKE_CXX_FLAGS "${CMAKE_CXX_FLAGS} ${TORCH_CXX_FLAGS}")'
  echo 'file(GLOB sources ${CMAKE_CURRENT_SOURCE_DIR}/*.cc)'
  echo 'add_library(headers OBJECT ${sources})'
  echo 'target_link_libraries(headers PRIVATE remora::examples)'
} >"$headers/CMakeLists.txt"
n=0
alone=0
{
  echo '// Every public header, twice (its guard), in one unit.'
  while read -r h; do printf '#include "%s"\n#include "%s"\n' "$h" "$h"; done <"$list"
} >"$headers/all_public_headers.cc"
while read -r h; do
  n=$((n + 1))
  # A header with a source of its name is that source's first include
  # (scripts/check_layout.sh says so), and compiles alone when it does.
  [ -f "$src/${h%.h}.cc" ] && continue
  printf '#include "%s"\n#include "%s"\n' "$h" "$h" >"$headers/alone_$(echo "$h" | tr '/.' '__').cc"
  alone=$((alone + 1))
done <"$list"
cmake -S "$headers" -B "$work/headers-build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_CXX_FLAGS="-I$poison" "${launcher[@]}" >"$work/headers-configure.log" 2>&1 || {
  tail -30 "$work/headers-configure.log"; exit 1; }
cmake --build "$work/headers-build" -j "${REMORA_JOBS:-2}" >"$work/headers-build.log" 2>&1 || {
  grep -m 20 -E 'error|Error' "$work/headers-build.log"; exit 1; }
echo "package_check: $n public headers compile together, the $alone with no source of their name alone too;" \
     "protobuf/gRPC/CUDA/NCCL headers poisoned"

# 3. A user's project, with the same poisoned folder first.
cmake -S "$src/examples/custom_model" -B "$work/custom" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_CXX_FLAGS="-I$poison" "${launcher[@]}" \
  >"$work/configure.log" 2>&1 || { tail -30 "$work/configure.log"; exit 1; }
cmake --build "$work/custom" -j "${REMORA_JOBS:-2}" >"$work/build.log" 2>&1 || {
  tail -40 "$work/build.log"; exit 1; }
echo "package_check: examples/custom_model built against the package (protobuf/gRPC headers poisoned)"
# It trains 24 steps with a checkpoint every 4; a second run goes on from
# the first's step 12 (mid-epoch): its 12 steps must have the first's
# losses, bit for bit.
rm -rf "$work/ckpt" "$work/ckpt-resumed"
"$work/custom/train_custom" --help | grep -q '^usage: train_custom' || {
  echo "package_check: train_custom --help printed no usage" >&2; exit 1; }
"$work/custom/train_custom" "$work/ckpt" >"$work/first.log" 2>&1 || { tail -30 "$work/first.log"; exit 1; }
tail -1 "$work/first.log"
"$work/custom/train_custom" "$work/ckpt-resumed" --resume "$work/ckpt/step-00000012" >"$work/resumed.log" 2>&1 || {
  tail -30 "$work/resumed.log"; exit 1; }
grep '^resumed from' "$work/resumed.log"
grep '^step=' "$work/first.log" | tail -n +13 >"$work/first.steps"
grep '^step=' "$work/resumed.log" >"$work/resumed.steps"
if [ "$(wc -l <"$work/first.steps")" -ne 12 ] || ! diff "$work/first.steps" "$work/resumed.steps"; then
  echo "package_check: the run resumed from step 12 did not train steps 13-24 with the first run's losses" >&2
  exit 1
fi
echo "package_check: train_custom resumed from its step-12 checkpoint: steps 13-24 have the same losses"
