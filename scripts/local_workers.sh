# Sourced by scripts/demo.sh and scripts/lm_demo.sh: starts the local
# workers worker1 and worker2 of $BIN, joining a master at 127.0.0.1:$PORT,
# and stops them when the script exits (success, failure or Ctrl-C).
# $REMORA_WORKER_ARGS: more worker flags, split as a shell splits words
# (e.g. REMORA_WORKER_ARGS="--cpus auto": each worker on its own cores).
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for w in worker1 worker2; do
  # shellcheck disable=SC2086  # (split on purpose)
  "$BIN/worker" --name "$w" --master "127.0.0.1:$PORT" ${REMORA_WORKER_ARGS:-} &
  pids+=($!)
done
