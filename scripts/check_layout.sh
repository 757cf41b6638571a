#!/usr/bin/env bash
# Checks remora's layout (docs/architecture.md): every quoted #include
# points to the file's own folder or to a folder on a lower layer, never up
# or sideways; no source file is longer than 700 lines; and every library
# header declares what it declares in the namespace named after its folder
# (remora::<folder>, or one nested in it; proto/'s is remora::wire, the
# protobuf package's; a block that only forward-declares another
# namespace's classes is allowed); every source whose folder has a header
# of its name includes that header first; and every header
# public-headers.txt lists (where the repository has one) exists and
# includes only headers of ours that the list names too. Prints each
# offence and exits 1 when there is one.
#
#   scripts/check_layout.sh [REPO]     (default: this script's repository)
set -euo pipefail
cd "${1:-$(dirname "$(readlink -f "$0")")/..}"

# The layers, bottom up; folders on one line are one layer and must not
# include each other.
LAYERS=("base proto"
        "trace"
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

# check_namespaces HEADER NAME: prints each top-level namespace block of
# HEADER that is neither remora::NAME (or within it) nor forward
# declarations only; fails when there is one.
check_namespaces() {
  awk -v want="remora::$2" '
    /^namespace [A-Za-z_:]+ [{]/ {
      if (depth == 0) { name = $2; fwd = 1; start = FNR } else { fwd = 0 }
      depth++; next
    }
    /^namespace [{]/ { fwd = 0; depth++; next }
    /^[}]  \/\/ namespace/ {
      depth--
      if (depth == 0 && name != want && index(name, want "::") != 1 && !fwd) {
        printf "%s:%d: declares in namespace %s; a header in this folder declares in %s\n", FILENAME, start, name, want
        failed = 1
      }
      next
    }
    depth > 0 && !/^(class|struct) [A-Za-z_]+;$/ && !/^[[:space:]]*$/ && !/^[[:space:]]*\/\// { fwd = 0 }
    END { exit failed }' "$1"
}

bad=0
while IFS= read -r file; do
  top=${file%%/*}
  [ -n "${rank[$top]+x}" ] || continue
  lines=$(wc -l <"$file")
  if [ "$lines" -gt "$MAX_LINES" ]; then
    echo "$file: $lines lines (at most $MAX_LINES: split it by concern)"
    bad=1
  fi
  # (Not the tests, nor the example of a user's own program.)
  case "$file" in
    tests/* | examples/custom_model/*) ;;
    proto/*.h) check_namespaces "$file" wire || bad=1 ;;  # the protobuf package's
    *.h) check_namespaces "$file" "$top" || bad=1 ;;
  esac
  # A source includes its own header first, so that compiling the source
  # alone (./run thread-safety) proves the header compiles alone.
  if [ "${file%.cc}" != "$file" ] && [ -f "${file%.cc}.h" ]; then
    first=$(sed -n 's/^#include \(.*\)/\1/p' "$file" | head -1)
    if [ "$first" != "\"${file%.cc}.h\"" ]; then
      echo "$file: its first #include is ${first:-none}; include \"${file%.cc}.h\" first"
      bad=1
    fi
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

# The public headers: each exists and includes no internal header of ours.
if [ -f public-headers.txt ]; then
  declare -A public
  mapfile -t listed < <(grep -v '^#' public-headers.txt | grep -v '^[[:space:]]*$')
  for header in "${listed[@]}"; do public[$header]=1; done
  for header in "${listed[@]}"; do
    if [ ! -f "$header" ]; then
      echo "public-headers.txt lists $header, which does not exist"
      bad=1
      continue
    fi
    while IFS= read -r inc; do
      [ -n "${rank[${inc%%/*}]+x}" ] || continue  # not one of ours
      if [ -z "${public[$inc]+x}" ]; then
        echo "$header includes \"$inc\": a public header includes only the public ones (public-headers.txt)"
        bad=1
      fi
    done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$header")
  done
fi

if [ $bad -ne 0 ]; then
  echo "check_layout: FAILED" >&2
  exit 1
fi
echo "check_layout: every include points down; every library header is in its folder's namespace; every source includes its own header first; public headers include only public ones; no source file over $MAX_LINES lines"
