#!/usr/bin/env bash
# Layout.AHeaderOutsideItsFoldersNamespaceIsNamed: scripts/check_layout.sh
# ($1) on a small repository of its own names a header that declares
# outside its folder's namespace, passes forward declarations of another
# namespace's classes, and passes once the header is mended.
set -euo pipefail
check=$1
source "$(dirname "$(readlink -f "$0")")/layout_fixture.sh"
mkdir -p rpc pipeline
cat >rpc/good.h <<'H'
#pragma once
namespace remora::pipeline {
struct Schedule;
}  // namespace remora::pipeline

namespace remora::rpc {
namespace internal {
int Helper();
}  // namespace internal
int Good();
}  // namespace remora::rpc
H
cat >pipeline/stray.h <<'H'
#pragma once
#include "rpc/good.h"

namespace remora {
int Stray();
}  // namespace remora
H
check_refuses "a header declaring in namespace remora from pipeline/" \
  'pipeline/stray.h:4: declares in namespace remora; a header in this folder declares in remora::pipeline'
check_leaves_out 'rpc/good.h' "a header in its own namespace"
sed -i 's/^namespace remora {$/namespace remora::pipeline {/; s|^}  // namespace remora$|}  // namespace remora::pipeline|' pipeline/stray.h
check_passes "the mended tree"
