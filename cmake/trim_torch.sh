#!/usr/bin/env bash
# trim_torch.sh LIBRARY DIR [refresh]: puts in DIR a copy of LIBRARY
# (LibTorch's libtorch_cpu) that no longer names the shared libraries it
# never uses.
#
# Debian 12's libtorch_cpu names 46 libraries and uses no symbol of 24 of
# them (OpenCV, FFmpeg, ZeroMQ, LevelDB, LMDB, OpenCL); those bring about
# 250 more (Qt, GDAL, DICOM readers): 286 loaded in all, 38 without them. A
# process that loads LibTorch spends about half of its start on them
# (docs/testing-and-ci.md, "Where the test suite's time goes"). A library is
# dropped when it defines none of LIBRARY's undefined symbols; the copy is
# kept only when every symbol of it and of what it loads still resolves.
#
# Exit 0: DIR/<soname> is the copy (made again only when LIBRARY or this
# script changed); the first line of output says what was dropped. Exit 1:
# no copy (the line says why; LIBRARY is then used as it is). With
# `refresh` (every build runs it so: a LibTorch upgraded under a build tree
# must not meet an old copy), it exits 0 either way and prints only when
# it made or removed the copy.
set -euo pipefail
export LC_ALL=C
lib=$(readlink -f "$1")
dir=$2
refresh=${3:-}
# What the copy was made from: the file (size, times, inode) and this script.
source_id="$lib $(stat -c '%s %Y %Z %i' "$lib") $(sha1sum <"$0" | cut -c1-12)"
if [ "$(cat "$dir/.source" 2>/dev/null)" = "$source_id" ] && [ -f "$dir/$(cat "$dir/.soname" 2>/dev/null)" ]; then
  [ -n "$refresh" ] || cat "$dir/.dropped"
  exit 0
fi
# none WHY: no copy (any earlier one removed).
none() {
  rm -rf "$dir"
  if [ -n "$refresh" ]; then
    echo "remora: libtorch_cpu used as it is from now on: $1"
    exit 0
  fi
  echo "$1"
  exit 1
}
soname=$(patchelf --print-soname "$lib")
[ -n "$soname" ] || none "$lib has no soname"
rm -rf "$dir"
# A library that finds its own dependencies relative to itself ($ORIGIN, as
# PyTorch's wheels do) would not find them from a copy elsewhere.
[ -z "$(patchelf --print-rpath "$lib")" ] || none "$lib has a search path of its own"

# symbols FLAG FILE: the dynamic symbols of FILE that nm's FLAG selects,
# without versions, sorted.
symbols() { nm -D "$1" "$2" | awk '{print $NF}' | sed 's/@.*//' | sort -u; }
undefined=$(mktemp)
trap 'rm -f "$undefined"' EXIT
symbols --undefined-only "$lib" >"$undefined"
loaded=$(ldd "$lib")
declare -A path
while read -r name file; do path[$name]=$file; done \
  < <(awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' <<<"$loaded")
unused=()
for name in $(patchelf --print-needed "$lib"); do
  [ -n "${path[$name]:-}" ] || continue  # not found here: kept
  used=$(symbols --defined-only "${path[$name]}" | comm -12 - "$undefined" | wc -l)
  [ "$used" -gt 0 ] || unused+=("$name")
done
[ ${#unused[@]} -gt 0 ] || none "$lib uses every library it names"

mkdir -p "$dir"
cp "$lib" "$dir/$soname.partial"
args=()
for name in "${unused[@]}"; do args+=(--remove-needed "$name"); done
patchelf "${args[@]}" "$dir/$soname.partial"
# (ldd's whole output first: a reader that stops at the first match
# would kill it, and its status would hide the match.)
resolved=$(ldd -r "$dir/$soname.partial" 2>&1) || none "ldd -r failed on the copy of $lib: $resolved"
if grep -Eq 'undefined symbol|not found' <<<"$resolved"; then
  none "$lib without ${unused[*]} leaves symbols unresolved"
fi
mv "$dir/$soname.partial" "$dir/$soname"
echo "$soname without the ${#unused[@]} libraries it names and never uses" \
     "($(wc -l <<<"$loaded") libraries loaded -> $(ldd "$dir/$soname" | wc -l)): ${unused[*]}" \
  | tee "$dir/.dropped"
echo "$soname" >"$dir/.soname"
echo "$source_id" >"$dir/.source"
