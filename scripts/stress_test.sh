#!/usr/bin/env bash
# The test suite under load, to find tests that fail only on a busy
# machine: runs `ctest -j2` in the build directory N times (default 5)
# while one busy loop per core runs beside it, and says after each run
# whether it passed and which tests failed, and at the end how many runs
# failed and how often each test did. Exits 1 when any run failed.
#
#   scripts/stress_test.sh [N] [ctest arguments]
#   scripts/stress_test.sh 2 -R 'RRefOwner|Codec'
#   scripts/stress_test.sh 3 -E '^CheckpointJob[.]'
#
# Arguments after N go to ctest (-R, -E, --timeout, ...). Builds nothing:
# build first (./run build, or cmake --build build --target <tests>).
# Each run's ctest output is kept in BUILD/stress/run-K.log; its tests
# write under BUILD/stress/test-tmp (TEST_TMPDIR, emptied before each run,
# as ./run test empties BUILD/test-tmp, which a ./run test beside it keeps
# to itself). The busy loops are killed on exit, failure and Ctrl-C.
#
# Environment: REMORA_BUILD_DIR (default build), REMORA_STRESS_JOBS
# (ctest -j, default 2), REMORA_STRESS_LOOPS (busy loops, default one per
# core: nproc).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }

runs=5
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  '') ;;
  *[!0-9]*) ;;  # not a count: every argument goes to ctest
  *) runs=$1; shift ;;
esac
if [ "$runs" -lt 1 ]; then
  echo "stress_test: the number of runs must be at least 1; got $runs" >&2
  exit 2
fi
BUILD_DIR=${REMORA_BUILD_DIR:-build}
JOBS=${REMORA_STRESS_JOBS:-2}
LOOPS=${REMORA_STRESS_LOOPS:-$(nproc)}
if [ ! -f "$BUILD_DIR/CTestTestfile.cmake" ]; then
  echo "stress_test: no ctest tests in $BUILD_DIR (configure and build first: ./run build)" >&2
  exit 2
fi
BUILD_DIR=$(cd "$BUILD_DIR" && pwd)
LOG_DIR=$BUILD_DIR/stress
TMP_DIR=$LOG_DIR/test-tmp
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR"/run-*.log  # (an earlier invocation's)

# The busy loops: started here, and always killed when the script ends
# (by their ids: nothing else is touched).
loops=()
cleanup() {
  local p
  for p in "${loops[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${loops[@]}"; do wait "$p" 2>/dev/null || true; done
  loops=()
}
trap cleanup EXIT
trap 'echo "stress_test: interrupted" >&2; exit 130' INT
trap 'exit 143' TERM HUP
for ((i = 0; i < LOOPS; ++i)); do
  yes >/dev/null &
  loops+=($!)
done
echo "stress_test: $runs run(s) of ctest -j$JOBS ${*:+($*) }in $BUILD_DIR beside $LOOPS busy loop(s)"

# The names of the failed tests in ctest's output $1, one a line.
failed_tests() {
  sed -n '/^The following tests FAILED:/,$p' "$1" |
    sed -n 's/^[[:space:]]*[0-9][0-9]* - \(.*\) (\([^()]*\))[[:space:]]*$/\1 (\2)/p'
}

failed_runs=0
declare -A failures=()
for ((run = 1; run <= runs; ++run)); do
  log=$LOG_DIR/run-$run.log
  rm -rf "$TMP_DIR"
  mkdir -p "$TMP_DIR"
  start=$SECONDS
  code=0
  (cd "$BUILD_DIR" && TEST_TMPDIR=$TMP_DIR ctest --output-on-failure -j "$JOBS" "$@") >"$log" 2>&1 ||
    code=$?
  took=$((SECONDS - start))
  summary=$(grep -E '^[0-9]+% tests passed' "$log" | tail -1 || true)
  if [ "$code" -eq 0 ]; then
    echo "run $run/$runs: passed in ${took}s (${summary:-no summary line})"
    continue
  fi
  failed_runs=$((failed_runs + 1))
  echo "run $run/$runs: FAILED (ctest exit $code) in ${took}s (${summary:-no summary line}; log: $log)"
  names=$(failed_tests "$log")
  if [ -z "$names" ]; then
    echo "    (no failed test named: see the log)"
    failures["(ctest exit $code, no test named)"]=$((${failures["(ctest exit $code, no test named)"]:-0} + 1))
    continue
  fi
  while IFS= read -r name; do
    echo "    $name"
    test=${name% (*}
    failures[$test]=$((${failures[$test]:-0} + 1))
  done <<<"$names"
done

if [ "$failed_runs" -eq 0 ]; then
  echo "stress_test: all $runs run(s) passed"
  exit 0
fi
echo "stress_test: $failed_runs of $runs run(s) failed; failed tests (times):"
for test in "${!failures[@]}"; do echo "    ${failures[$test]}x $test"; done | sort -k2
exit 1
