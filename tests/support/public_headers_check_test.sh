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
check_refuses "a public header that includes an internal one" \
  'pipeline/api.h includes "rpc/internal.h": a public header includes only the public ones' \
  'public-headers.txt lists pipeline/gone.h, which does not exist'
printf 'rpc/internal.h\npipeline/api.h\n' >public-headers.txt
check_passes "the mended tree"
