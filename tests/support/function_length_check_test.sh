#!/usr/bin/env bash
# Layout.ALibraryFunctionOver80LinesIsNamed: scripts/check_functions.sh
# ($1) on a small repository of its own names a library function of 81
# lines (and not one of 80, nor a long function of a program's folder),
# and passes once the long one is split. Skipped (77) without Universal
# Ctags, as the check is.
set -euo pipefail
check=$1
source "$(dirname "$(readlink -f "$0")")/layout_fixture.sh"
mkdir -p pipeline master
# function_of NAME N: a C++ function of N + 3 lines.
function_of() {
  echo "int $1() {"
  for ((i = 0; i < $2; ++i)); do echo "  int v$i = $i;"; done
  echo "  return 0;"
  echo "}"
}
{ echo "namespace remora::pipeline {"; function_of Long 78; echo; function_of Fits 77
  echo "}  // namespace remora::pipeline"; } >pipeline/long.cc
{ echo "namespace remora::master {"; function_of Program 200; echo "}  // namespace remora::master"; } >master/main.cc
! $have_git || git add .
set +e
out=$("$check" . 2>&1)
rc=$?
set -e
[ $rc -ne 77 ] || { echo "$out"; exit 77; }
if [ $rc -eq 0 ]; then
  echo "FAIL: the check passed an 81-line library function:"; echo "$out"; exit 1
fi
grep -q '^pipeline/long.cc:2: Long is 81 lines (at most 80' <<<"$out" ||
  { echo "FAIL: the offence was not named as expected:"; echo "$out"; exit 1; }
check_leaves_out 'Fits\|Program' "a function it should pass"
# Split in two: both pass.
{ echo "namespace remora::pipeline {"; function_of LongFirstHalf 40; echo; function_of LongSecondHalf 38; echo
  function_of Fits 77; echo "}  // namespace remora::pipeline"; } >pipeline/long.cc
check_passes "the split tree"
