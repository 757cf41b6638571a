# Sourced, not run: a Debian root made with debootstrap, for the scripts
# that build and test remora on another Debian than this machine's
# (torch2_test.sh: Debian 13 and unstable; gpu_rehearse.sh: a Debian 12
# without gRPC, as GPU machines are). Needs root.
#
#   debian_root_unshare "$@"     first thing in the script: runs it again in
#                                a private mount namespace, so the mounts
#                                vanish with it however it ends and never
#                                reach this machine's own
#   debian_root_path SUITE FALLBACK  where SUITE's root lives: under
#                                $REMORA_ROOTS (default /var/cache/remora/roots),
#                                shared by every clone on this machine, so CI
#                                does not debootstrap and install 2 GB of
#                                packages per run; REMORA_ROOTS=local keeps
#                                it at FALLBACK inside the tree
#   debian_root_make SUITE ROOT  debootstraps ROOT (minbase) once, and points
#                                its apt and name lookup at this machine's
#   debian_root_mount ROOT       /proc and /dev inside ROOT
#   debian_root_run ROOT CMD...  CMD in ROOT with a clean environment
#   debian_root_run_offline ROOT CMD...  the same with no network but
#                                loopback, where this machine can make a
#                                network namespace

debian_root_unshare() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "$(basename "$0"): needs root (debootstrap, chroot, mount)" >&2
    exit 2
  fi
  if [ -z "${REMORA_ROOT_UNSHARED:-}" ]; then
    REMORA_ROOT_UNSHARED=1 exec unshare --mount --propagation private "$0" "$@"
  fi
}

debian_root_path() {
  local suite=$1 fallback=$2 roots=${REMORA_ROOTS:-/var/cache/remora/roots}
  if [ "$roots" = local ]; then
    echo "$fallback"
  else
    echo "$roots/$suite"
  fi
}

debian_root_make() {
  local suite=$1 root=$2
  if [ ! -f "$root/.remora-ready" ]; then
    command -v debootstrap >/dev/null || {
      apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap; }
    echo "$(basename "$0"): making a Debian $suite root in $root (once)" >&2
    rm -rf --one-file-system "$root"
    mkdir -p "$root"
    debootstrap --variant=minbase "$suite" "$root" http://deb.debian.org/debian \
      >"$root.debootstrap.log" 2>&1 || { tail -20 "$root.debootstrap.log" >&2; return 1; }
    touch "$root/.remora-ready"
  fi
  cp /etc/resolv.conf /etc/hosts "$root/etc/"
  # The root uses this machine's mirror: trust its dates as apt here does
  # (a frozen mirror's unstable Release file is past its Valid-Until).
  apt-config dump | grep -E '^Acquire::Check-(Valid-Until|Date) ' \
    >"$root/etc/apt/apt.conf.d/99remora-host-mirror" || true
}

debian_root_mount() {
  local root=$1
  mkdir -p "$root/proc" "$root/dev"
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
}

debian_root_env=(/usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8)

debian_root_run() {
  local root=$1
  shift
  chroot "$root" "${debian_root_env[@]}" "$@"
}

debian_root_run_offline() {
  local root=$1
  shift
  if unshare --net ip link set lo up 2>/dev/null; then
    unshare --net /bin/bash -c 'ip link set lo up && exec chroot "$@"' net \
      "$root" "${debian_root_env[@]}" "$@"
  else
    debian_root_run "$root" "$@"
  fi
}
