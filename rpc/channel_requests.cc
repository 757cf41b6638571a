// Handlers of the CUDA channel's control requests (proto/channel.proto:
// NCCL set-up and abort, CUDA IPC releases), and what the agent reports
// about its channels.
#include <iostream>

#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "rpc/agent_impl.h"

namespace remora::rpc {

absl::Status RegisterChannelRequests(Agent::Impl* impl) {
  DispatchTable& t = impl->requests_;
  RETURN_IF_ERROR(t.Register<wire::NcclSetup>(
      [impl](Incoming<wire::NcclSetup> in, std::shared_ptr<Responder> r) {
        r->ReplyStatus(impl->cuda_->OnNcclSetup(in.from, in.body));
      }));
  RETURN_IF_ERROR(t.Register<wire::NcclAbort>(
      [impl](Incoming<wire::NcclAbort> in, std::shared_ptr<Responder> r) {
        impl->cuda_->OnNcclAbort(in.from, in.body);
        r->Reply(OutMessage{});
      }));
  return t.Register<wire::CudaRelease>(
      [impl](Incoming<wire::CudaRelease> in, std::shared_ptr<Responder> r) {
        impl->cuda_->OnRelease(in.from, in.body);
        r->Reply(OutMessage{});
      });
}

void Agent::Impl::LogCudaChannels(const Peer& p) const {
  const int gpus = channel::LocalGpuCount();
  if (gpus > 0 && !cuda_->disabled_reason().empty()) {
    std::cerr << "remora: '" << agent_->self_.name << "': CUDA channel off ("
              << cuda_->disabled_reason() << ")\n";
  }
  for (int i = 0; i < gpus; ++i) {
    const c10::Device src(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
    auto dst = devices_.Map(src, p.info);
    if (!dst.ok()) continue;  // unmapped: sending would fail, and say so
    std::cerr << "remora: '" << agent_->self_.name << "' -> '" << p.info.name << "': "
              << src.str() << " -> its " << dst->str() << " via "
              << channel::DescribeRoute(p.route, devices_, p.info, src).value_or("?") << "\n";
  }
}

}  // namespace remora::rpc
