#include "tests/fuzz/request_decoder.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/codec.h"
#include "rpc/message.h"
#include "rpc/request_checks.h"
#include "rpc/rref.h"
#include "rpc/status_util.h"

namespace remora::fuzz {
namespace {

// The group as the decoding worker sees it: workers 0..kGroupSize-1; control
// messages "succeed" at once and go nowhere. Stateless, so thread-safe.
class FakeChannel final : public ControlChannel {
 public:
  Future<Empty> SendControl(WorkerId dst, wire::Request request) override {
    return Future<Empty>::Ready(Empty{});
  }
  std::string NameOf(WorkerId id) const override { return absl::StrCat("worker", id); }
  bool IsKnown(WorkerId id) const override { return id < kGroupSize; }
};

// The channel's membership, as rpc/request_checks.h asks for it.
auto Member(const FakeChannel& channel) {
  return [&channel](WorkerId id) { return channel.IsKnown(id); };
}

// Every id names a member of the group (rpc/request_checks.h).
absl::Status CheckIds(const FakeChannel& channel, std::initializer_list<wire::Guid> ids) {
  for (const wire::Guid& g : ids) {
    if (g.worker() > kUnknownWorker) {
      return absl::InvalidArgumentError(absl::StrCat("id of worker ", g.worker(), " out of range"));
    }
    RETURN_IF_ERROR(remora::CheckIds("request", {FromWire(g)}, Member(channel)));
  }
  return absl::OkStatus();
}

// What the agent checks before it acts on a request, then decoding every
// value as its handlers would.
absl::Status DecodeRequest(const wire::Request& r, DecodeContext& ctx,
                           const FakeChannel& channel) {
  // A joining worker has no id yet: the agent handles joins before
  // CheckSender (and only on the master).
  if (r.body_case() == wire::Request::kJoin) {
    return IsValidWorkerName(r.join().name())
               ? absl::OkStatus()
               : absl::InvalidArgumentError("invalid worker name");
  }
  RETURN_IF_ERROR(CheckSender(r, Member(channel)));
  RETURN_IF_ERROR(CheckContext(r, Member(channel)));
  switch (r.body_case()) {
    case wire::Request::kCall: {
      const wire::CallRequest& call = r.call();
      RETURN_IF_ERROR(CheckCall(call, static_cast<WorkerId>(r.from())));
      for (const auto& arg : call.args()) {
        auto v = DecodeValue(arg, ctx);
        if (!v.ok()) return Annotate(v.status(), "decoding the arguments");
      }
      if (call.has_self()) {
        auto v = DecodeValue(call.self(), ctx);
        if (!v.ok()) return Annotate(v.status(), "decoding the RRef");
        if (!v->isRRef()) return absl::InvalidArgumentError("a method call must target an RRef");
      }
      if (call.has_caller_fork()) RETURN_IF_ERROR(CheckIds(channel, {call.caller_fork()}));
      return absl::OkStatus();
    }
    case wire::Request::kFetch:
      return CheckIds(channel, {r.fetch().rref_id(), r.fetch().fork_id()});
    case wire::Request::kFork:
      return CheckIds(channel, {r.fork().rref_id(), r.fork().fork_id()});
    case wire::Request::kChildAccept:
      return CheckIds(channel, {r.child_accept().fork_id()});
    case wire::Request::kUserDelete:
      return CheckIds(channel, {r.user_delete().rref_id(), r.user_delete().fork_id()});
    case wire::Request::kJoin:  // above
    case wire::Request::kProbe:
    case wire::Request::kFinish:
    case wire::Request::kPing:
    // CUDA channel control: checked by CudaChannel (tests/cuda_test.cc).
    case wire::Request::kNcclSetup:
    case wire::Request::kNcclAbort:
    case wire::Request::kCudaRelease:
      return absl::OkStatus();
    case wire::Request::BODY_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError("request without a known body");
}

absl::Status DecodeResponse(const wire::Response& r, DecodeContext& ctx) {
  if (r.has_error()) {
    if (r.error().code() <= 0) return absl::InvalidArgumentError("error without a code");
    return absl::OkStatus();
  }
  for (const auto& w : r.workers()) {
    if (!IsValidWorkerName(w.name())) return absl::InvalidArgumentError("invalid worker name");
  }
  if (r.has_value()) {
    auto v = DecodeValue(r.value(), ctx);
    if (!v.ok()) return Annotate(v.status(), "decoding the reply");
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodeRequestFrame(const grpc::ByteBuffer& frame) {
  auto message = ParseMessage(frame);
  if (!message.ok()) return message.status();
  FakeChannel channel;
  auto rrefs = std::make_shared<RRefContext>(kSelf, nullptr, &channel, nullptr);
  std::vector<Future<Empty>> pending;
  std::vector<at::Tensor> grad_tensors;
  DecodeContext ctx{rrefs.get(), &message->payloads, &pending, &grad_tensors};
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
