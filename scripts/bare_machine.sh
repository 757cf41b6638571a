#!/usr/bin/env bash
# Times the README's two commands as a new user meets them: in a Debian 12
# root that has nothing but debootstrap's minimal base and git (no
# compiler, no CMake, no compiler cache), a clone of this repository's
# HEAD runs `./run demo`, then `./run test`, each timed from its start to
# its end, apt-get included. Each command's output goes to WORK/demo.log
# and WORK/test.log; the times to WORK/times.txt and the console.
#
# The root is made afresh each run (debootstrap, a few minutes, not timed)
# and removed at the end unless --keep is given. The root is a mount point
# of its own (so that `ip netns` works in it, for the NetNamespaces.*
# tests), with /proc, /dev and /sys mounted, all in a private mount
# namespace (they vanish with the script, however it ends): everything
# runs as on a machine of its own, on this machine's cores. Needs root.
#
# usage: scripts/bare_machine.sh [--keep] [WORK]   (default /var/tmp/remora-bare)
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
src=$(cd "$(dirname "$(readlink -f "$0")")/.." && pwd)
. "$src/scripts/debian_root.sh"
debian_root_unshare "$@"
keep=false
if [ "${1:-}" = --keep ]; then keep=true; shift; fi
work=${1:-/var/tmp/remora-bare}
root=$work/root
say() { echo "bare_machine: $*" | tee -a "$work/times.txt"; }

rm -rf --one-file-system "$work"
mkdir -p "$work"
$keep || trap 'umount -R "$root" 2>/dev/null; rm -rf --one-file-system "$root"' EXIT
debian_root_make bookworm "$root"
mount --bind "$root" "$root"
debian_root_mount "$root"
mkdir -p "$root/sys" && mount -t sysfs sysfs "$root/sys"
debian_root_run "$root" /bin/bash -c 'apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q git ca-certificates' \
  >"$work/setup.log" 2>&1 || { tail -20 "$work/setup.log"; exit 1; }
git clone -q "$src" "$root/root/remora"
say "commit $(git -C "$root/root/remora" log -1 --format=%h), Debian $(cat "$root/etc/debian_version"), $(nproc) cores, $(date -u +%FT%TZ)"

# run_timed NAME COMMAND: COMMAND in the clone, inside the root, its
# output's lines stamped with the time (WORK/NAME.log); its wall time and
# exit code.
run_timed() {
  local name=$1 start rc=0
  shift
  start=$(date +%s%N)
  debian_root_run "$root" /bin/bash -c "cd /root/remora && $*" 2>&1 |
    while IFS= read -r line; do printf '%(%H:%M:%S)T %s\n' -1 "$line"; done >"$work/$name.log" || rc=$?
  say "$(printf '%-12s %6d s, exit %d' "$*" $((($(date +%s%N) - start) / 1000000000)) "$rc")"
  return $rc
}
run_timed demo ./run demo || { tail -30 "$work/demo.log"; exit 1; }
grep -E '^[0-9:]{8}  +[0-9]+ ' "$work/demo.log" | tee -a "$work/times.txt" || true
run_timed test ./run test || { tail -30 "$work/test.log"; exit 1; }
grep -E 'tests passed|Total Test time|executions' "$work/test.log" | tee -a "$work/times.txt" || true
