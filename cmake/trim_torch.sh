#!/usr/bin/env bash
# trim_torch.sh LIBRARY DIR: puts in DIR a copy of LIBRARY (LibTorch's
# libtorch_cpu) that no longer names the shared libraries it never uses.
#
# Debian 12's libtorch_cpu names 46 libraries and uses no symbol of 24 of
# them (OpenCV, FFmpeg, ZeroMQ, LevelDB, LMDB, OpenCL); those bring about
# 250 more (Qt, GDAL, DICOM readers): 286 loaded in all, 38 without them. A
# process that loads LibTorch spends about half of its start on them
# (docs/testing-and-ci.md, "Where the test suite's time goes"). A library is
# dropped when it defines none of LIBRARY's undefined symbols; the copy is
# kept only when every symbol of it and of what it loads still resolves.
#
# Exit 0: DIR/<soname> is the copy (made again only when LIBRARY changed);
# the first line of output says what was dropped. Exit 1: no copy (the line
# says why; LIBRARY is then used as it is).
set -euo pipefail
lib=$(readlink -f "$1")
dir=$2
soname=$(patchelf --print-soname "$lib")
if [ -z "$soname" ]; then
  echo "$lib has no soname; used as it is"
  exit 1
fi
source_id="$lib $(stat -c '%s %Y' "$lib")"
if [ -f "$dir/$soname" ] && [ "$(cat "$dir/.source" 2>/dev/null)" = "$source_id" ]; then
  cat "$dir/.dropped"
  exit 0
fi
rm -rf "$dir"
# A library that finds its own dependencies relative to itself ($ORIGIN, as
# PyTorch's wheels do) would not find them from a copy elsewhere.
if [ -n "$(patchelf --print-rpath "$lib")" ]; then
  echo "$lib has a search path of its own; used as it is"
  exit 1
fi

undefined=$(mktemp)
trap 'rm -f "$undefined"' EXIT
nm -D --undefined-only "$lib" | awk '{print $NF}' | sed 's/@.*//' | sort -u >"$undefined"
declare -A path
while read -r name file; do path[$name]=$file; done \
  < <(ldd "$lib" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}')
unused=()
for name in $(patchelf --print-needed "$lib"); do
  [ -n "${path[$name]:-}" ] || continue  # not found here: kept
  used=$(nm -D --defined-only "${path[$name]}" | awk '{print $NF}' | sed 's/@.*//' | sort -u |
         comm -12 - "$undefined" | wc -l)
  [ "$used" -gt 0 ] || unused+=("$name")
done
if [ ${#unused[@]} -eq 0 ]; then
  echo "$lib uses every library it names; used as it is"
  exit 1
fi

mkdir -p "$dir"
cp "$lib" "$dir/$soname.partial"
args=()
for name in "${unused[@]}"; do args+=(--remove-needed "$name"); done
patchelf "${args[@]}" "$dir/$soname.partial"
if ldd -r "$dir/$soname.partial" 2>&1 | grep -Eq 'undefined symbol|not found'; then
  rm -rf "$dir"
  echo "$lib without ${unused[*]} leaves symbols unresolved; used as it is"
  exit 1
fi
mv "$dir/$soname.partial" "$dir/$soname"
echo "$soname without the ${#unused[@]} libraries it names and never uses" \
     "($(ldd "$lib" | wc -l) libraries loaded -> $(ldd "$dir/$soname" | wc -l)): ${unused[*]}" \
  | tee "$dir/.dropped"
echo "$source_id" >"$dir/.source"
