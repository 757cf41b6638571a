#include "channel/route.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status_util.h"

namespace remora::channel {

std::string HostIdentity(const std::string& explicit_id) {
  if (!explicit_id.empty()) return explicit_id;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  char net[128] = {0};
  const ssize_t len = readlink("/proc/self/ns/net", net, sizeof(net) - 1);
  return absl::StrCat(host, "/", BootId(), "/", len > 0 ? std::string(net, len) : "net:?");
}

absl::Status CheckHostId(const std::string& id) {
  const bool printable = std::all_of(id.begin(), id.end(), [](char c) { return c > ' ' && c < 127; });
  if (id.empty() || id.size() > 255 || !printable) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host id '", id, "' must be 1 to 255 printable characters without spaces"));
  }
  return absl::OkStatus();
}

bool SharesMemory(const base::WorkerInfo& self, const base::WorkerInfo& peer) {
  return !self.host_id.empty() && self.host_id == peer.host_id && !self.shm.domain.empty() &&
         self.shm.domain == peer.shm.domain && self.shm.incarnation != peer.shm.incarnation;
}

Route SelectRoute(const base::WorkerInfo& self, const base::WorkerInfo& peer, ShmChannel* shm,
                  CudaChannel* cuda, size_t threshold) {
  Route route;
  base::WorkerInfo me = self;
  me.shm = shm->endpoint();
  // The same host and domain, and not this very process (its own incarnation).
  if (SharesMemory(me, peer)) route.shm = shm;
  route.threshold = threshold;
  route.cuda = cuda;
  route.peer = peer.id;
  return route;
}

absl::StatusOr<std::string> DescribeRoute(const Route& route, const DeviceMapper& devices,
                                          const base::WorkerInfo& peer, c10::Device device) {
  const char* cpu_way = route.shm != nullptr ? "shm" : "grpc";
  if (!device.is_cuda()) return std::string(cpu_way);
  ASSIGN_OR_RETURN(c10::Device dst, devices.Map(device, peer));
  const CudaRoute cuda = dst.is_cuda() && route.cuda != nullptr
                             ? route.cuda->RouteTo(peer.id, device.index(), dst.index())
                             : CudaRoute::kStaged;
  if (cuda != CudaRoute::kStaged) return std::string(CudaRouteName(cuda));
  return absl::StrCat("staged:", cpu_way);
}

}  // namespace remora::channel
