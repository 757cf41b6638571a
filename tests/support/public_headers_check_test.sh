#!/usr/bin/env bash
# Layout.APublicHeaderIncludingAnInternalOneIsNamed: scripts/check_layout.sh
# ($1) on a small repository of its own names a header public-headers.txt
# lists that includes an internal one, and a listed header that does not
# exist; passes once the included header is listed and the missing one
# is not.
set -euo pipefail
check=$1
source "$(dirname "$(readlink -f "$0")")/layout_fixture.sh"
mkdir -p rpc pipeline
printf '#pragma once\nnamespace remora::rpc {\nint Internal();\n}  // namespace remora::rpc\n' >rpc/internal.h
cat >pipeline/api.h <<'H'
#pragma once
#include <vector>

#include "rpc/internal.h"

namespace remora::pipeline {
int Api();
}  // namespace remora::pipeline
H
printf '# the public surface\n\npipeline/api.h\npipeline/gone.h\n' >public-headers.txt
! $have_git || git add .
if out=$("$check" . 2>&1); then
  echo "FAIL: the check passed a public header that includes an internal one:"; echo "$out"; exit 1
fi
grep -q 'pipeline/api.h includes "rpc/internal.h": a public header includes only the public ones' <<<"$out" ||
  { echo "FAIL: the internal include was not named as expected:"; echo "$out"; exit 1; }
grep -q 'public-headers.txt lists pipeline/gone.h, which does not exist' <<<"$out" ||
  { echo "FAIL: the missing header was not named:"; echo "$out"; exit 1; }
printf 'rpc/internal.h\npipeline/api.h\n' >public-headers.txt
out=$("$check" . 2>&1) || { echo "FAIL: the mended tree still fails:"; echo "$out"; exit 1; }
echo "ok: $out"
