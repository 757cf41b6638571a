#!/usr/bin/env bash
# Checks that no function of remora's libraries is longer than 80 lines
# (from the line its definition starts on to its closing brace, as
# Universal Ctags reads them): a longer one is split into named steps.
# The library folders are check_layout.sh's layers below examples/; the
# programs (examples/, master/) and the tests are not held to it. Prints
# each offence and exits 1 when there is one; exits 77 (ctest: skipped)
# when Universal Ctags is not installed (`./run test` installs it).
#
#   scripts/check_functions.sh [REPO]     (default: this script's repository)
set -euo pipefail
cd "${1:-$(dirname "$(readlink -f "$0")")/..}"

FOLDERS=(base proto trace runtime data channel rpc autograd optim pipeline parallel checkpoint ps shards
         launch train)
MAX_LINES=80

ctags=
for c in ctags-universal universal-ctags ctags; do
  if command -v "$c" >/dev/null && "$c" --version 2>/dev/null | grep -q 'Universal Ctags'; then
    ctags=$c
    break
  fi
done
if [ -z "$ctags" ]; then
  echo "check_functions: Universal Ctags is not installed (apt-get install universal-ctags): not checked"
  exit 77
fi

mapfile -t files < <(git ls-files -- "${FOLDERS[@]/%//*.h}" "${FOLDERS[@]/%//*.cc}" 2>/dev/null ||
                     find "${FOLDERS[@]}" \( -name '*.h' -o -name '*.cc' \) 2>/dev/null)
[ "${#files[@]}" -gt 0 ] || { echo "check_functions: no library sources found under $(pwd)" >&2; exit 1; }

# ctags' fields: name, file, then line: and end: among the extras.
offences=$("$ctags" --languages=C++ --language-force=C++ --kinds-C++=f --fields=+ne -o - "${files[@]}" |
  awk -F'\t' -v max="$MAX_LINES" '{
    start = ""; end = ""
    for (i = 4; i <= NF; i++) {
      if ($i ~ /^line:/) start = substr($i, 6)
      if ($i ~ /^end:/) end = substr($i, 5)
    }
    if (start != "" && end != "" && end - start + 1 > max)
      printf "%s:%d: %s is %d lines (at most %d: split it into named steps)\n", $2, start, $1, end - start + 1, max
  }' | sort)
if [ -n "$offences" ]; then
  echo "$offences"
  echo "check_functions: FAILED" >&2
  exit 1
fi
echo "check_functions: no library function over $MAX_LINES lines (${#files[@]} files)"
