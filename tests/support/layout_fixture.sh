# Sourced by the Layout.* tests of scripts/check_layout.sh: makes an empty
# repository of the test's own under TEST_TMPDIR ($dir, removed on exit),
# moves into it, and sets $have_git (without git, the check lists the
# files with find).
dir=$(mktemp -d "${TEST_TMPDIR:-/tmp}/layout.XXXXXX")
trap 'rm -rf "$dir"' EXIT
cd "$dir"
have_git=false
if command -v git >/dev/null; then git init -q . && have_git=true; fi
