#!/usr/bin/env bash
# Installs remora from BUILD (cmake --install) into WORK/prefix, builds
# examples/custom_model against that package as a user's project would,
# and runs its train_custom: a two-stage pipeline of the project's own
# module over two of its own worker programs. Run by ctest
# (Package.CustomModelBuildsAgainstTheInstalledPackage).
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
cmake -S "$src/examples/custom_model" -B "$work/custom" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" "${launcher[@]}" >"$work/configure.log" 2>&1 || {
  tail -30 "$work/configure.log"; exit 1; }
cmake --build "$work/custom" -j "${REMORA_JOBS:-2}" >"$work/build.log" 2>&1 || {
  tail -40 "$work/build.log"; exit 1; }
echo "package_check: examples/custom_model built against the package"
"$work/custom/train_custom"
