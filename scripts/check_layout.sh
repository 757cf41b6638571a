#!/usr/bin/env bash
# Checks remora's layout (docs/architecture.md): every quoted #include
# points to the file's own folder or to a folder on a lower layer, never up
# or sideways, and no source file is longer than 700 lines. Prints each
# offence and exits 1 when there is one.
#
#   scripts/check_layout.sh [REPO]     (default: this script's repository)
set -euo pipefail
cd "${1:-$(dirname "$(readlink -f "$0")")/..}"

# The layers, bottom up; folders on one line are one layer and must not
# include each other.
LAYERS=("base proto"
        "runtime data"
        "channel"
        "rpc"
        "autograd"
        "optim"
        "pipeline"
        "parallel checkpoint"
        "ps"
        "shards launch"
        "train"
        "examples"
        "master"
        "tests")
MAX_LINES=700

declare -A rank
for i in "${!LAYERS[@]}"; do
  for folder in ${LAYERS[$i]}; do rank[$folder]=$i; done
done

bad=0
while IFS= read -r file; do
  top=${file%%/*}
  [ -n "${rank[$top]+x}" ] || continue
  lines=$(wc -l <"$file")
  if [ "$lines" -gt "$MAX_LINES" ]; then
    echo "$file: $lines lines (at most $MAX_LINES: split it by concern)"
    bad=1
  fi
  while IFS= read -r inc; do
    target=${inc%%/*}
    [ "$target" = "$inc" ] && continue            # "foo.pb.h" style, generated
    [ -n "${rank[$target]+x}" ] || continue        # not one of ours (absl/...)
    [ "$target" = "$top" ] && continue
    if [ "${rank[$target]}" -ge "${rank[$top]}" ]; then
      echo "$file includes \"$inc\": $top/ may include only folders below it"
      bad=1
    fi
  done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$file")
done < <(git ls-files -- '*.h' '*.cc' 2>/dev/null ||
         find . \( -name '*.h' -o -name '*.cc' \) -not -path './build*' | sed 's#^\./##')

if [ $bad -ne 0 ]; then
  echo "check_layout: FAILED" >&2
  exit 1
fi
echo "check_layout: every include points down; no source file over $MAX_LINES lines"
