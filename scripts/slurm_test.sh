#!/usr/bin/env bash
# `./run slurm-test`: a real Slurm cluster on this machine, and remora's job
# script submitted to it. Starts munged (as the munge user, on a private
# socket), slurmctld and two slurmd (nodes n1 and n2, both on this host)
# with scripts/slurm/slurm.conf.in filled in under $REMORA_BUILD_DIR/slurm;
# submits examples/slurm/train.sbatch (4 tasks over the 2 nodes: the
# master and 3 workers) and checks that it trained (losses printed, exit 0);
# then submits the same script with a master flag that fails and checks
# that the job fails with the task's error in its output. Every daemon it
# started is stopped when it ends, also on failure or Ctrl-C. Root only.
#
#   scripts/slurm_test.sh [master flags for the training job]
#
# Environment: REMORA_BUILD_DIR (build), REMORA_SLURM_PORT (first of three
# ports: slurmctld, then the two slurmd; default 16817).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
build=$(readlink -f "${REMORA_BUILD_DIR:-build}")
dir=$build/slurm
port=${REMORA_SLURM_PORT:-16817}
train_flags=("$@")
[ ${#train_flags[@]} -gt 0 ] || train_flags=(--batches 2 --batch-size 8 --image-size 32 --splits 2)
say() { echo "slurm-test: $*" >&2; }
die() { say "FAILED: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (munged runs as the munge user, slurmd as root)"
for p in remora-launch master worker; do
  [ -x "$build/bin/$p" ] || die "$build/bin/$p is missing: run ./run build first"
done
for cmd in munged slurmctld slurmd sbatch scontrol squeue setpriv; do
  command -v "$cmd" >/dev/null || die "$cmd is missing (./run slurm-test installs munge, slurmctld, slurmd, slurm-client)"
done
for p in $port $((port + 1)) $((port + 2)); do
  if ss -Hltn "sport = :$p" | grep -q .; then
    die "port $p is in use (another cluster?); set REMORA_SLURM_PORT to a free range"
  fi
done

pids=()       # the daemons this script started, stopped by cleanup
hand_pids=()  # the workers of the run by hand
cleanup() {
  local rc=$?
  set +e
  local p
  for p in "${hand_pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  if [ -n "${SLURM_CONF:-}" ] && [ -f "$dir/run/slurmctld.pid" ]; then
    scancel --quiet --full $(squeue -h -o %i 2>/dev/null) 2>/dev/null
    for _ in $(seq 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null
    wait "$p" 2>/dev/null
  done
  [ ${#pids[@]} -eq 0 ] || say "stopped munged, slurmctld and slurmd (pids ${pids[*]})"
  if [ $rc -ne 0 ]; then
    for log in "$dir"/log/*.log; do
      [ -f "$log" ] && { say "last lines of $log:"; tail -15 "$log" >&2; }
    done
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A fresh cluster every time: state, spool, logs and the munge socket.
rm -rf "$dir"
mkdir -p "$dir"/{state,spool/n1,spool/n2,run,log,munge,jobs}
chown munge:munge "$dir/munge"
chmod 700 "$dir/munge"
export SLURM_CONF=$dir/slurm.conf
sed -e "s|@DIR@|$dir|g" -e "s|@CTLD_PORT@|$port|g" \
    -e "s|@NODE_PORTS@|$((port + 1))-$((port + 2))|g" scripts/slurm/slurm.conf.in >"$SLURM_CONF"

start=$SECONDS
setpriv --reuid munge --regid munge --init-groups \
  munged -F --force --socket="$dir/munge/munge.socket" --pid-file="$dir/munge/munged.pid" \
  --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" \
  >"$dir/log/munged.out" 2>&1 &
pids+=($!)
for _ in $(seq 50); do [ -S "$dir/munge/munge.socket" ] && break; sleep 0.1; done
[ -S "$dir/munge/munge.socket" ] || die "munged did not create its socket"
slurmctld -D -i >"$dir/log/slurmctld.out" 2>&1 &
pids+=($!)
for node in n1 n2; do
  slurmd -D -N "$node" >"$dir/log/slurmd-$node.out" 2>&1 &
  pids+=($!)
done
idle=""
for _ in $(seq 150); do
  idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | tr '\n' ' ')
  [ "$idle" = "n1 n2 " ] && break
  sleep 0.2
done
[ "$idle" = "n1 n2 " ] || die "nodes n1 n2 not idle after 30 s: $(sinfo -N 2>&1 | tr '\n' ';')"
say "cluster up in $((SECONDS - start)) s: slurmctld and slurmd n1, n2 on ports $port-$((port + 2))"

# submit NAME [master flags]: runs examples/slurm/train.sbatch to its end;
# sets job_rc (sbatch --wait's exit code: the job's) and job_out.
submit() {
  local name=$1
  shift
  job_out=$dir/jobs/$name.out
  local t=$SECONDS
  job_rc=0
  timeout 300 sbatch --wait --parsable --chdir="$PWD" --output="$job_out" \
    --export="ALL,REMORA_BIN=$build/bin" examples/slurm/train.sbatch "$@" >"$dir/jobs/$name.id" \
    || job_rc=$?
  job_seconds=$((SECONDS - t))
  say "job '$name' ($(cat "$dir/jobs/$name.id")) ended with exit code $job_rc in $job_seconds s"
}

submit train "${train_flags[@]}"
cat "$job_out"
[ "$job_rc" -eq 0 ] || die "the training job failed (exit $job_rc); its output is above"
grep -q '^batch=0 loss=[0-9]' "$job_out" || die "no loss in the training job's output"
for r in 0 1 2 3; do
  grep -q "remora-launch: rank $r of 4 (slurm, node n[12]" "$job_out" || die "rank $r did not start"
done
grep -q "rank 3 of 4 (slurm, node n2" "$job_out" || die "rank 3 did not run on node n2"
grep -q "master at 127.0.0.1:" "$job_out" || die "the master did not listen at n1's NodeAddr"
state=$(scontrol show job "$(cat "$dir/jobs/train.id")" | grep -o 'JobState=[A-Z]*')
[ "$state" = "JobState=COMPLETED" ] || die "the training job's state is $state"
train_seconds=$job_seconds
times=$(scontrol show job "$(cat "$dir/jobs/train.id")" | grep -o '\(Start\|End\)Time=[^ ]*' | cut -d= -f2)
job_elapsed=$(( $(date -d "$(echo "$times" | sed -n 2p)" +%s) - $(date -d "$(echo "$times" | sed -n 1p)" +%s) ))

# The same run started by hand (master and three workers, no Slurm, no
# launcher), for the launcher's and Slurm's overhead.
hand_port=$((port + 3))
t0=$(date +%s.%N)
for w in 1 2 3; do
  "$build/bin/worker" --name "worker$w" --master "127.0.0.1:$hand_port" >"$dir/jobs/hand-worker$w.out" 2>&1 &
  hand_pids+=($!)
done
"$build/bin/master" --listen "127.0.0.1:$hand_port" --workers worker1,worker2,worker3 "${train_flags[@]}" \
  >"$dir/jobs/hand-master.out" 2>&1 || die "the run by hand failed: $(tail -3 "$dir/jobs/hand-master.out")"
for p in "${hand_pids[@]}"; do wait "$p" || die "a worker of the run by hand failed"; done
hand_seconds=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
say "wall time: the job $job_elapsed s (Slurm's StartTime to EndTime; sbatch --wait $train_seconds s), by hand ${hand_seconds} s"

# A task that fails fails the job, with its error in the output.
submit fail --batches 1 --schedule no-such-schedule
[ "$job_rc" -ne 0 ] || die "the job whose master failed exited 0"
grep -q "schedule" "$job_out" || { cat "$job_out"; die "the failed task's error is not in the job's output"; }
state=$(scontrol show job "$(cat "$dir/jobs/fail.id")" | grep -o 'JobState=[A-Z]*')
[ "$state" = "JobState=FAILED" ] || die "the failing job's state is $state, not FAILED"
say "the failing job failed (exit $job_rc, $state) with: $(grep -m1 -i 'schedule' "$job_out")"
# An elastic job: a worker SIGKILLed once mid-training is started again by
# its task's remora-launch (--max-restarts), the master (given
# --max-restarts too) puts it back in its place and goes on from its last
# checkpoint, the other ranks keep their processes: the job still ends
# with exit code 0 and its last epoch.
ckpt=$dir/jobs/elastic-ckpt
job_out=$dir/jobs/elastic.out
t=$SECONDS
timeout 300 sbatch --wait --parsable --chdir="$PWD" --output="$job_out" \
  --export="ALL,REMORA_BIN=$build/bin" examples/slurm/train.sbatch --max-restarts 1 \
  --dataset fashion-mnist --train-rows 960 --epochs 4 --batch-size 64 --splits 2 --threads 1 \
  --checkpoint-dir "$ckpt" --checkpoint-every 5 --resume auto -- --threads 1 >"$dir/jobs/elastic.id" &
sbatch_pid=$!
for _ in $(seq 1200); do [ -f "$ckpt/step-00000005/manifest.json" ] && break; sleep 0.05; done
[ -f "$ckpt/step-00000005/manifest.json" ] || die "the elastic job wrote no checkpoint in 60 s: $(tail -5 "$job_out")"
victim=$(pgrep -f -- "bin/worker .*--name worker2 " | head -1 || true)
[ -n "$victim" ] || die "the elastic job runs no worker2 to kill"
kill -KILL "$victim"
say "killed worker2 (pid $victim) of the elastic job after its checkpoint of step 5"
job_rc=0
wait "$sbatch_pid" || job_rc=$?
say "job 'elastic' ($(cat "$dir/jobs/elastic.id")) ended with exit code $job_rc in $((SECONDS - t)) s"
[ "$job_rc" -eq 0 ] || { cat "$job_out"; die "the elastic job failed (exit $job_rc)"; }
for line in "worker 'worker2' was killed by signal 9" "elastic: 'worker2' is back" \
            "resumed from $ckpt/step-" "epoch=4 train_loss="; do
  grep -qF "$line" "$job_out" || { cat "$job_out"; die "the elastic job's output lacks '$line'"; }
done
if grep -qE "(the master|worker 'worker[13]') (exited|was killed)" "$job_out"; then
  cat "$job_out"
  die "the elastic job restarted a process other than worker2"
fi
state=$(scontrol show job "$(cat "$dir/jobs/elastic.id")" | grep -o 'JobState=[A-Z]*')
[ "$state" = "JobState=COMPLETED" ] || die "the elastic job's state is $state"
say "the elastic job lost worker2 once and completed, the others kept running: $(grep -m1 -F 'elastic: recovery' "$job_out")"

say "OK: trained over 4 tasks on 2 nodes in $train_seconds s; a failing task fails the job; an elastic job survives a killed worker"
