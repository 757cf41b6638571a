#!/usr/bin/env bash
# Layout.ASourceNotIncludingItsOwnHeaderFirstIsNamed: scripts/check_layout.sh
# ($1) on a small repository of its own names a source whose first #include
# is not the header of its name (what lets ./run thread-safety, compiling
# each source alone, prove that header compiles alone), passes a source
# with no header of its name, and passes once the source is mended.
set -euo pipefail
check=$1
source "$(dirname "$(readlink -f "$0")")/layout_fixture.sh"
mkdir -p rpc
cat >rpc/codec.h <<'H'
#pragma once
namespace remora::rpc {
int Codec();
}  // namespace remora::rpc
H
cat >rpc/codec.cc <<'C'
#include <string>

#include "rpc/codec.h"

namespace remora::rpc {
int Codec() { return 1; }
}  // namespace remora::rpc
C
cat >rpc/codec_impl.cc <<'C'
#include <vector>

#include "rpc/codec.h"
C
check_refuses "a source including <string> before its own header" \
  'rpc/codec.cc: its first #include is <string>; include "rpc/codec.h" first'
check_leaves_out 'codec_impl' "a source that has no header of its name"
printf '#include "rpc/codec.h"\n\n#include <string>\n\nnamespace remora::rpc {\nint Codec() { return 1; }\n}  // namespace remora::rpc\n' >rpc/codec.cc
check_passes "the mended tree"
