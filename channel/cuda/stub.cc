// The CUDA channel in builds without the CUDA toolkit or NCCL: it offers no
// GPUs, so every peer stages CUDA tensors through host memory, and whatever
// asks for the channel itself gets kNoCudaBuild.
#include "channel/cuda/cuda_channel.h"

#include "absl/strings/str_cat.h"

namespace remora::channel {

class CudaChannel::Impl {
 public:
  base::CudaEndpoint endpoint;
  std::string reason = kNoCudaBuild;
};

CudaChannel::CudaChannel(Options, Control) : impl_(std::make_unique<Impl>()) {}
CudaChannel::~CudaChannel() = default;

const base::CudaEndpoint& CudaChannel::endpoint() const { return impl_->endpoint; }
const std::string& CudaChannel::disabled_reason() const { return impl_->reason; }
void CudaChannel::SetGroup(const base::WorkerInfo&, const std::vector<base::WorkerInfo>&) {}
void CudaChannel::UpdatePeer(const base::WorkerInfo&) {}
CudaRoute CudaChannel::RouteTo(base::WorkerId, int, int) const { return CudaRoute::kStaged; }

std::optional<wire::CudaPayload> CudaChannel::Send(base::WorkerId, const at::Tensor&, int) {
  return std::nullopt;
}

void CudaChannel::Reclaim(base::WorkerId, const wire::CudaPayload&) {}

void CudaChannel::Abandon(base::WorkerId, const wire::CudaPayload&, const std::string&) {}

absl::StatusOr<at::Tensor> CudaChannel::Receive(base::WorkerId peer, const wire::CudaPayload& d,
                                                uint64_t) {
  return absl::FailedPreconditionError(absl::StrCat(
      "CUDA payload ", d.payload(), " from worker #", peer, ": ", kNoCudaBuild));
}

absl::Status CudaChannel::OnNcclSetup(base::WorkerId, const wire::NcclSetup&) {
  return absl::FailedPreconditionError(absl::StrCat("NCCL set-up: ", kNoCudaBuild));
}

void CudaChannel::Stop() {}
void CudaChannel::OnNcclAbort(base::WorkerId, const wire::NcclAbort&) {}
void CudaChannel::OnRelease(base::WorkerId, const wire::CudaRelease&) {}
CudaChannel::Stats CudaChannel::stats() const { return {}; }
absl::Status CudaChannel::Settle(int64_t, absl::Time) { return absl::OkStatus(); }
void CudaChannel::Forget(int64_t) {}
absl::Status CudaChannel::Stuck() { return absl::OkStatus(); }

absl::StatusOr<double> MeasureDeviceCopyGbps(int, size_t, int) {
  return absl::FailedPreconditionError(kNoCudaBuild);
}

}  // namespace remora::channel
