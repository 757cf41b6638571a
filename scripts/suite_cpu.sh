#!/usr/bin/env bash
# Where the test suite's CPU goes: runs ctest in BUILD (default build/)
# under the kernel's process accounting and prints the CPU-seconds of each
# test program (the processes it started counted in) and of each program
# the tests started (master, worker, ...), with how many of each ran.
# Accounting is switched off again when ctest ends, fails or is stopped.
# Needs root (accton) and Debian's acct (installed when missing).
#
#   scripts/suite_cpu.sh [ctest arguments]      e.g. -R Master
#   REMORA_BUILD_DIR=build-asan scripts/suite_cpu.sh
#
# Figures in docs/testing-and-ci.md ("Where the test suite's time goes").
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
cd "$(dirname "$(readlink -f "$0")")/.."
build=${REMORA_BUILD_DIR:-build}
if [ "$(id -u)" -ne 0 ]; then
  echo "suite_cpu: process accounting needs root (accton); run it as root" >&2; exit 2
fi
if [ ! -f "$build/CTestTestfile.cmake" ]; then
  echo "suite_cpu: no test build in $build/; run ./run build first" >&2; exit 2
fi
if ! command -v accton >/dev/null; then
  echo "suite_cpu: installing acct" >&2
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends acct
fi
work=$(mktemp -d)
trap 'accton off >/dev/null 2>&1 || true; rm -rf "$work"' EXIT INT TERM
touch "$work/pacct"
accton "$work/pacct" >/dev/null
rm -rf "$build/test-tmp" && mkdir -p "$build/test-tmp"
jobs=${REMORA_JOBS:-$(nproc)}
rc=0
start=$SECONDS
(cd "$build" && TEST_TMPDIR=$PWD/test-tmp ctest -j "$jobs" "$@") >"$work/ctest.log" 2>&1 || rc=$?
wall=$((SECONDS - start))
accton off >/dev/null
grep -E "tests passed|tests failed" "$work/ctest.log" || tail -5 "$work/ctest.log"

# dump-acct: command|version|user|system|elapsed|uid|gid|mem|io|pid|ppid|...
# (times in clock ticks). Each process is charged to its ancestor that
# ctest started: the test program.
dump-acct "$work/pacct" | awk -F'|' -v wall="$wall" -v hz="$(getconf CLK_TCK)" '
  function trim(s) { gsub(/^ +| +$/, "", s); return s }
  { n++; comm[n] = trim($1); cpu[n] = ($3 + $4) / hz; pid[n] = $10 + 0; ppid[n] = $11 + 0
    row[pid[n]] = n; if (comm[n] == "ctest") ctest[pid[n]] = 1 }
  END {
    for (i = 1; i <= n; i++) {
      p = pid[i]; hops = 0
      while ((p in row) && !(ppid[row[p]] in ctest) && hops++ < 64) p = ppid[row[p]]
      if (!(p in row) || !(ppid[row[p]] in ctest)) continue
      root = comm[row[p]]; total += cpu[i]
      by_test[root] += cpu[i]; if (p == pid[i]) tests[root]++
      if (p != pid[i]) { by_prog[comm[i]] += cpu[i]; runs[comm[i]]++ }
    }
    printf "ctest: %d s of wall, %.0f CPU-seconds in its tests\n\n", wall, total
    print "CPU s  tests  test program (with what it started)"
    for (t in by_test) printf "%6.1f %6d  %s\n", by_test[t], tests[t], t | "sort -rn | head -25"
    close("sort -rn | head -25")
    print "\nCPU s   runs  program started by the tests"
    for (c in by_prog) printf "%6.1f %6d  %s\n", by_prog[c], runs[c], c | "sort -rn | head -15"
    close("sort -rn | head -15")
  }'
exit $rc
