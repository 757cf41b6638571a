#include "channel/route.h"

#include "absl/strings/str_cat.h"
#include "base/status_util.h"

namespace remora {

Route SelectRoute(const WorkerInfo& peer, ShmChannel* shm, CudaChannel* cuda,
                  size_t threshold) {
  Route route;
  const ShmEndpoint& mine = shm->endpoint();
  // The same domain, and not this very process (its own incarnation).
  if (!mine.domain.empty() && peer.shm.domain == mine.domain &&
      peer.shm.incarnation != mine.incarnation) {
    route.shm = shm;
  }
  route.threshold = threshold;
  route.cuda = cuda;
  route.peer = peer.id;
  return route;
}

absl::StatusOr<std::string> DescribeRoute(const Route& route, const DeviceMapper& devices,
                                          const WorkerInfo& peer, c10::Device device) {
  const char* cpu_way = route.shm != nullptr ? "shm" : "grpc";
  if (!device.is_cuda()) return std::string(cpu_way);
  ASSIGN_OR_RETURN(c10::Device dst, devices.Map(device, peer));
  const CudaRoute cuda = dst.is_cuda() && route.cuda != nullptr
                             ? route.cuda->RouteTo(peer.id, device.index(), dst.index())
                             : CudaRoute::kStaged;
  if (cuda != CudaRoute::kStaged) return std::string(CudaRouteName(cuda));
  return absl::StrCat("staged:", cpu_way);
}

}  // namespace remora
