#!/usr/bin/env bash
# The cluster figures of docs/measurements.md ("On a cluster"):
# - rendezvous of 2, 4 and 8 local workers (rpc_bench --rendezvous N: the
#   workers' processes starting included, median of 3);
# - rpc_bench between two network namespaces joined by a veth pair
#   (10.48.0.1 and 10.48.0.2, which exist only inside them), beside
#   rpc_bench over loopback in the same run. Root only for the second part;
#   the namespaces are removed on exit, also on failure.
#
#   scripts/measure_cluster.sh [BUILD_DIR]     (default: build)
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
bin=$(readlink -f "${1:-build}")/bin
for n in 2 4 8; do "$bin/rpc_bench" --rendezvous "$n" 2>/dev/null; done
if [ "$(id -u)" -ne 0 ]; then
  echo "measure_cluster: not root: no network namespaces, no veth figures" >&2
  exit 0
fi
a=remora-m$$-a b=remora-m$$-b
cleanup() { ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$a"
ip netns add "$b"
ip link add eth0 netns "$a" type veth peer name eth0 netns "$b"
ip -n "$a" addr add 10.48.0.1/24 dev eth0
ip -n "$b" addr add 10.48.0.2/24 dev eth0
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; ip -n "$ns" link set eth0 up; done
bench=(--sizes "" --calls 2000 --bulk-mib 64 --bulk-calls 20)
echo "== loopback (one namespace; shared memory for the bulk tensor)"
"$bin/rpc_bench" "${bench[@]}" 2>/dev/null | grep -E '^(latency_us_median|channel|bulk_gbps)='
echo "== loopback, REMORA_SHM=0 (gRPC over TCP on lo)"
REMORA_SHM=0 "$bin/rpc_bench" "${bench[@]}" 2>/dev/null | grep -E '^(latency_us_median|channel|bulk_gbps)='
echo "== veth pair between two network namespaces"
ip netns exec "$b" "$bin/rpc_bench" worker --name peer --master 10.48.0.1:29500 --listen 10.48.0.2:0 \
  --connect-timeout 60 >/dev/null 2>&1 &
ip netns exec "$a" "$bin/rpc_bench" "${bench[@]}" --external --listen 10.48.0.1:29500 |
  grep -E '^(latency_us_median|channel|bulk_gbps)='
wait
