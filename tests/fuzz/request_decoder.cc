#include "tests/fuzz/request_decoder.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/codec.h"
#include "rpc/message.h"
#include "rpc/request_checks.h"
#include "rpc/rref_context.h"
#include "base/status_util.h"
#include "proto/request.h"
#include "proto/rref.pb.h"

namespace remora::fuzz {
namespace {

// The group as the decoding worker sees it: workers 0..kGroupSize-1; control
// messages "succeed" at once and go nowhere. Stateless, so thread-safe.
class FakeChannel final : public rpc::ControlChannel {
 public:
  rpc::Future<rpc::Empty> SendControl(base::WorkerId dst, wire::Request request) override {
    return rpc::Future<rpc::Empty>::Ready(rpc::Empty{});
  }
  std::string NameOf(base::WorkerId id) const override { return absl::StrCat("worker", id); }
  bool IsKnown(base::WorkerId id) const override { return id < kGroupSize; }
};

// The channel's membership, as rpc/request_checks.h asks for it.
auto Member(const FakeChannel& channel) {
  return [&channel](base::WorkerId id) { return channel.IsKnown(id); };
}

// Every id names a member of the group (rpc/request_checks.h).
absl::Status CheckIds(const FakeChannel& channel, std::initializer_list<wire::Guid> ids) {
  for (const wire::Guid& g : ids) {
    if (g.worker() > base::kUnknownWorker) {
      return absl::InvalidArgumentError(absl::StrCat("id of worker ", g.worker(), " out of range"));
    }
    RETURN_IF_ERROR(remora::rpc::CheckIds("request", {rpc::FromWire(g)}, Member(channel)));
  }
  return absl::OkStatus();
}

template <typename Body>
bool Is(const wire::Request& r) {
  return r.kind() == Body::descriptor()->full_name();
}

// Parses the body as a `Body`, as the dispatch table does (rpc/dispatch.h).
template <typename Body>
absl::Status Parses(const wire::Request& r) {
  return wire::RequestBody<Body>(r).status();
}

// What the agent checks before it acts on a request, then decoding every
// value as its handlers would.
absl::Status DecodeRequest(const wire::Request& r, rpc::DecodeContext& ctx,
                           const FakeChannel& channel) {
  // A joining worker has no id yet: the agent handles joins before
  // CheckSender (and only on the master).
  if (Is<wire::JoinRequest>(r)) {
    ASSIGN_OR_RETURN(wire::JoinRequest join, wire::RequestBody<wire::JoinRequest>(r));
    return base::IsValidWorkerName(join.name()) ? absl::OkStatus()
                                          : absl::InvalidArgumentError("invalid worker name");
  }
  RETURN_IF_ERROR(rpc::CheckSender(r, Member(channel)));
  RETURN_IF_ERROR(rpc::CheckContext(r, Member(channel)));
  if (Is<wire::CallRequest>(r)) {
    ASSIGN_OR_RETURN(wire::CallRequest call, wire::RequestBody<wire::CallRequest>(r));
    RETURN_IF_ERROR(rpc::CheckCall(call, static_cast<base::WorkerId>(r.from())));
    for (const auto& arg : call.args()) {
      auto v = rpc::DecodeValue(arg, ctx);
      if (!v.ok()) return base::Annotate(v.status(), "decoding the arguments");
    }
    if (call.has_self()) {
      auto v = rpc::DecodeValue(call.self(), ctx);
      if (!v.ok()) return base::Annotate(v.status(), "decoding the RRef");
      if (!v->isRRef()) return absl::InvalidArgumentError("a method call must target an RRef");
    }
    if (call.has_caller_fork()) RETURN_IF_ERROR(CheckIds(channel, {call.caller_fork()}));
    return absl::OkStatus();
  }
  if (Is<wire::FetchRequest>(r)) {
    ASSIGN_OR_RETURN(wire::FetchRequest f, wire::RequestBody<wire::FetchRequest>(r));
    return CheckIds(channel, {f.rref_id(), f.fork_id()});
  }
  if (Is<wire::ForkRequest>(r)) {
    ASSIGN_OR_RETURN(wire::ForkRequest f, wire::RequestBody<wire::ForkRequest>(r));
    return CheckIds(channel, {f.rref_id(), f.fork_id()});
  }
  if (Is<wire::ChildAccept>(r)) {
    ASSIGN_OR_RETURN(wire::ChildAccept a, wire::RequestBody<wire::ChildAccept>(r));
    return CheckIds(channel, {a.fork_id()});
  }
  if (Is<wire::UserDelete>(r)) {
    ASSIGN_OR_RETURN(wire::UserDelete d, wire::RequestBody<wire::UserDelete>(r));
    return CheckIds(channel, {d.rref_id(), d.fork_id()});
  }
  if (Is<wire::ShutdownProbe>(r)) return Parses<wire::ShutdownProbe>(r);
  if (Is<wire::ShutdownFinish>(r)) return Parses<wire::ShutdownFinish>(r);
  if (Is<wire::Ping>(r)) return Parses<wire::Ping>(r);
  // CUDA channel control: checked by CudaChannel (tests/channel/cuda_test.cc).
  if (Is<wire::NcclSetup>(r)) return Parses<wire::NcclSetup>(r);
  if (Is<wire::NcclAbort>(r)) return Parses<wire::NcclAbort>(r);
  if (Is<wire::CudaRelease>(r)) return Parses<wire::CudaRelease>(r);
  return absl::InvalidArgumentError("unknown request kind");
}

absl::Status DecodeResponse(const wire::Response& r, rpc::DecodeContext& ctx) {
  if (r.has_error()) {
    if (r.error().code() <= 0) return absl::InvalidArgumentError("error without a code");
    return absl::OkStatus();
  }
  for (const auto& w : r.workers()) {
    if (!base::IsValidWorkerName(w.name())) return absl::InvalidArgumentError("invalid worker name");
  }
  if (r.has_value()) {
    auto v = rpc::DecodeValue(r.value(), ctx);
    if (!v.ok()) return base::Annotate(v.status(), "decoding the reply");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeRequestFrame(const grpc::ByteBuffer& frame) {
  auto message = rpc::ParseMessage(frame);
  if (!message.ok()) return message.status();
  FakeChannel channel;
  auto rrefs = std::make_shared<rpc::RRefContext>(kSelf, nullptr, &channel, nullptr);
  std::vector<rpc::Future<rpc::Empty>> pending;
  std::vector<at::Tensor> grad_tensors;
  rpc::DecodeContext ctx{rrefs.get(), &message->payloads, &pending, &grad_tensors};
  const wire::Header& header = message->header;
  if (header.has_request() == header.has_response()) {
    return absl::InvalidArgumentError("a frame holds exactly one of request and response");
  }
  if (header.has_request()) return DecodeRequest(header.request(), ctx, channel);
  return DecodeResponse(header.response(), ctx);
}

absl::Status DecodeRequestBytes(const std::string& bytes, size_t slice_bytes) {
  std::vector<grpc::Slice> slices;
  if (slice_bytes == 0 || bytes.empty()) {
    slices.emplace_back(bytes);
  } else {
    for (size_t i = 0; i < bytes.size(); i += slice_bytes) {
      slices.emplace_back(bytes.data() + i, std::min(slice_bytes, bytes.size() - i));
    }
  }
  return DecodeRequestFrame(grpc::ByteBuffer(slices.data(), slices.size()));
}

}  // namespace remora::fuzz
