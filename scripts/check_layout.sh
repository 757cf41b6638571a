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

# check_files: reads file names, one a line, and checks each of ours in
# one awk process (a handful of processes a file cost about 12 s here:
# each fork is dear on this VM). For each: its length; for a library
# header, that each top-level namespace block is remora::FOLDER (or
# within it) or forward declarations only; for a source with a header of
# its name, that it includes that header first; that each quoted include
# of ours points to its own folder or one below. Prints each offence;
# fails when there is one.
check_files() {
  local ranks="" folder
  for folder in "${!rank[@]}"; do ranks+="$folder=${rank[$folder]} "; done
  awk -v ranks="$ranks" -v max="$MAX_LINES" '
    BEGIN {
      n = split(ranks, pairs, " ")
      for (i = 1; i <= n; i++) { split(pairs[i], kv, "="); rank[kv[1]] = kv[2] }
    }
    { check($0) }
    END { exit failed }

    function check(file,   top, want, line, lines, depth, name, fwd, start, ns, first, incs, inc, target, own, probe, w) {
      top = file; sub(/\/.*/, "", top)
      if (!(top in rank)) return
      # (Not the tests, nor examples/custom_model, a program as a user
      # writes one; proto/ declares in remora::wire, the protobuf package.)
      want = ""
      if (file ~ /\.h$/ && file !~ /^tests\// && file !~ /^examples\/custom_model\//) {
        want = (file ~ /^proto\//) ? "remora::wire" : "remora::" top
      }
      lines = 0; depth = 0; ns = ""; first = ""; incs = ""
      while ((getline line < file) > 0) {
        lines++
        if (line ~ /^#include /) {
          if (first == "") first = substr(line, 10)
          if (line ~ /^#include "[^"]*"/) {
            inc = line; sub(/^#include "/, "", inc); sub(/".*/, "", inc)
            target = inc; sub(/\/.*/, "", target)
            if (target != inc && (target in rank) && target != top && rank[target] + 0 >= rank[top] + 0) {
              incs = incs file " includes \"" inc "\": " top "/ may include only folders below it\n"
            }
          }
          continue
        }
        if (want == "") continue
        if (line ~ /^namespace [A-Za-z_:]+ [{]/) {
          if (depth == 0) { split(line, w, " "); name = w[2]; fwd = 1; start = lines } else { fwd = 0 }
          depth++
        } else if (line ~ /^namespace [{]/) {
          fwd = 0; depth++
        } else if (line ~ /^[}]  \/\/ namespace/) {
          depth--
          if (depth == 0 && name != want && index(name, want "::") != 1 && !fwd) {
            ns = ns sprintf("%s:%d: declares in namespace %s; a header in this folder declares in %s\n", file, start, name, want)
          }
        } else if (depth > 0 && line !~ /^(class|struct) [A-Za-z_]+;$/ && line !~ /^[[:space:]]*$/ &&
                   line !~ /^[[:space:]]*\/\//) {
          fwd = 0
        }
      }
      close(file)
      if (lines > max) { print file ": " lines " lines (at most " max ": split it by concern)"; failed = 1 }
      if (ns != "") { printf "%s", ns; failed = 1 }
      # A source includes its own header first, so that compiling the
      # source alone (./run thread-safety) proves the header compiles alone.
      if (file ~ /\.cc$/) {
        own = file; sub(/\.cc$/, ".h", own)
        if ((getline probe < own) >= 0) {
          close(own)
          if (first != "\"" own "\"") {
            print file ": its first #include is " (first == "" ? "none" : first) "; include \"" own "\" first"
            failed = 1
          }
        }
      }
      if (incs != "") { printf "%s", incs; failed = 1 }
    }'
}

bad=0
check_files < <(git ls-files -- '*.h' '*.cc' 2>/dev/null ||
                find . \( -name '*.h' -o -name '*.cc' \) -not -path './build*' | sed 's#^\./##') || bad=1

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
