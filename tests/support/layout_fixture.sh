# Sourced by the Layout.* tests of scripts/check_layout.sh: makes an empty
# repository of the test's own under TEST_TMPDIR ($dir, removed on exit),
# moves into it, and sets $have_git (without git, the check lists the
# files with find).
dir=$(mktemp -d "${TEST_TMPDIR:-/tmp}/layout.XXXXXX")
trap 'rm -rf "$dir"' EXIT
cd "$dir"
have_git=false
if command -v git >/dev/null; then git init -q . && have_git=true; fi

# The steps these tests share, on $check (the script under test) and this
# repository:
#   check_refuses WHAT TEXT...  the check must fail (else it passed WHAT)
#                               and its output name every TEXT (grep
#                               patterns); the output is left in $out
#   check_leaves_out TEXT WHAT  $out must not name TEXT (WHAT, which it
#                               should pass)
#   check_passes WHAT           the check must pass now (WHAT: the mended tree)
check_refuses() {
  local what=$1 text
  shift
  ! $have_git || git add .
  if out=$("$check" . 2>&1); then
    echo "FAIL: the check passed $what:"; echo "$out"; exit 1
  fi
  for text in "$@"; do
    grep -q -- "$text" <<<"$out" || { echo "FAIL: the check did not name '$text':"; echo "$out"; exit 1; }
  done
}

check_leaves_out() {
  if grep -q -- "$1" <<<"$out"; then
    echo "FAIL: the check named $2:"; echo "$out"; exit 1
  fi
}

check_passes() {
  out=$("$check" . 2>&1) || { echo "FAIL: $1 still fails:"; echo "$out"; exit 1; }
  echo "ok: $out"
}
