// The agent's gRPC service: one reactor per incoming call (unary) or stream,
// authentication, and dispatch of every request to the handler its kind
// registered (rpc/dispatch.h), on the pool.
#include <iostream>

#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "rpc/agent_impl.h"
#include "rpc/auth.h"
#include "rpc/request_checks.h"
#include "trace/trace.h"

namespace remora::rpc {
namespace {

// A request's name in traces: a call's function, else its kind.
std::string TracedName(const wire::Request& request) {
  if (request.kind() == wire::CallRequest::descriptor()->full_name()) {
    if (absl::StatusOr<wire::CallRequest> call = wire::RequestBody<wire::CallRequest>(request); call.ok()) {
      return call->function();
    }
  }
  return request.kind();
}

// The reply slot of a unary call, shared by its reactor and the handler
// working on the request.
class ServerCall;
class UnaryReplySlot final : public ReplySlot {
 public:
  explicit UnaryReplySlot(ServerCall* call) : call_(call) {}
  // Sends `message` and finishes the call; false when already finished.
  bool Reply(grpc::ByteBuffer message) override;
  // Finishes the call with `status` and no reply message.
  bool Fail(grpc::Status status);
  void Detach() {
    base::MutexLock lock(mu_);
    call_ = nullptr;
  }

 private:
  ServerCall* Claim() {
    base::MutexLock lock(mu_);
    if (finished_ || call_ == nullptr) return nullptr;
    finished_ = true;
    return call_;
  }

  absl::Mutex mu_;
  ServerCall* call_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer response_;  // written once, by the claimer
};

// A unary call: reads the request, hands it to the agent, and finishes when
// the agent replies or the client cancels, whichever comes first; a reply
// after that is dropped.
class ServerCall final : public grpc::ServerGenericBidiReactor {
 public:
  explicit ServerCall(Agent::Impl* impl)
      : impl_(impl), slot_(std::make_shared<UnaryReplySlot>(this)) {
    impl_->UnaryCallOpened();
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      slot_->Fail(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
      return;
    }
    impl_->Dispatch(std::move(request_), slot_);
  }
  void OnCancel() override {
    slot_->Fail(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the caller"));
  }
  void OnDone() override {
    slot_->Detach();
    impl_->UnaryCallDone();
    delete this;
  }

 private:
  friend class UnaryReplySlot;
  Agent::Impl* const impl_;
  std::shared_ptr<UnaryReplySlot> slot_;
  grpc::ByteBuffer request_;
};

bool UnaryReplySlot::Reply(grpc::ByteBuffer message) {
  ServerCall* call = Claim();
  if (call == nullptr) return false;
  response_ = std::move(message);
  call->StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
  return true;
}

bool UnaryReplySlot::Fail(grpc::Status status) {
  ServerCall* call = Claim();
  if (call == nullptr) return false;
  call->Finish(std::move(status));
  return true;
}

// Finishes a call at once with an error (wrong method, bad token, stopping).
class Reject final : public grpc::ServerGenericBidiReactor {
 public:
  explicit Reject(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

}  // namespace

grpc::ServerGenericBidiReactor* Agent::Impl::CreateReactor(
    grpc::GenericCallbackServerContext* ctx) {
  const bool stream = ctx->method() == kStreamMethod;
  if (!stream && ctx->method() != kUnaryMethod) {
    return new Reject(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "not a remora method"));
  }
  if (!TokenMatches(*ctx, agent_->options_.token)) {
    std::cerr << absl::StrCat("remora: '", agent_->self_.name, "' rejected a call from ", ctx->peer(),
                              ": missing or wrong token\n");  // one write, whatever else prints
    if (agent_->options_.is_master) NoteRefused(ctx->peer(), "missing or wrong token (REMORA_TOKEN / --token-file)");
    return new Reject(grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                                   "missing or wrong remora token (REMORA_TOKEN / --token-file)"));
  }
  if (!stream) return new ServerCall(this);
  base::MutexLock lock(server_streams_mu_);
  if (server_streams_closed_) {
    return new Reject(grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat(
        "worker '", agent_->self_.name, "' is shutting down")));
  }
  auto* reactor = new ServerStream(
      [this](grpc::ByteBuffer frame, std::shared_ptr<ReplySlot> slot) {
        Dispatch(std::move(frame), std::move(slot));
      },
      [this](const std::shared_ptr<ServerStream::State>& state) {
        base::MutexLock lock(server_streams_mu_);
        server_streams_.erase(state);
      });
  server_streams_.insert(reactor->state());
  return reactor;
}

void Agent::Impl::Dispatch(grpc::ByteBuffer buffer, std::shared_ptr<ReplySlot> slot) {
  incoming_.fetch_add(1);
  const bool own_thread = !cuda_->endpoint().gpus.empty() && CarriesCudaPayloads(buffer);
  // A call of a prompt function runs where a local link received it.
  const bool here = prompt_here_ && !own_thread && OnLinkReader() && IsPromptCall(buffer);
  const int64_t arrived_us = trace::Enabled() ? trace::NowUs() : -1;
  auto task = [this, buffer = std::move(buffer), slot = std::move(slot), arrived_us]() mutable {
    auto message = ParseMessage(buffer, shm_.get(), cuda_.get());
    if (!message.ok()) {
      const absl::Status refused = base::Annotate(message.status(), "bad request");
      // A remote() refused here (a payload that could not be received) never
      // reaches its handler; its result RRef still has to hold the refusal.
      if (auto header = ReadFrameHeader(buffer); header.ok()) {
        FailRefusedRemote(this, header->request(), refused);
      }
      buffer.Clear();
      Responder(std::move(slot), this, base::kUnknownWorker).ReplyError(refused);
      return;
    }
    buffer.Clear();
    // Traced: from the frame's arrival to its handler's start (the pool's
    // queue, the payloads' receipt).
    if (arrived_us >= 0) {
      trace::Record(absl::StrCat("recv ", TracedName(message->header.request())), -1, arrived_us, trace::NowUs());
    }
    const base::WorkerId from = static_cast<base::WorkerId>(message->header.request().from());
    Handle(std::move(*message), std::make_shared<Responder>(std::move(slot), this, from));
  };
  // A request with CUDA payloads is received (and handled) on a thread of
  // its own, not on the pool (see RunOwnThread).
  if (own_thread) return RunOwnThread(std::move(task));
  if (here) return task();
  pool_->Schedule(std::move(task));
}

bool Agent::Impl::IsPromptCall(const grpc::ByteBuffer& buffer) const {
  absl::StatusOr<wire::Header> header = ReadFrameHeader(buffer);
  if (!header.ok() || header->request().kind() != wire::CallRequest::descriptor()->full_name()) return false;
  absl::StatusOr<wire::CallRequest> call = wire::RequestBody<wire::CallRequest>(header->request());
  return call.ok() && !call->has_self() && agent_->registry().IsPrompt(call->function());
}

void Agent::Impl::Handle(InMessage message, std::shared_ptr<Responder> responder) {
  const wire::Request& request = message.header.request();
  const DispatchTable::Entry* entry = requests_.Find(request.kind());
  if (entry == nullptr) {
    return responder->ReplyError(absl::InvalidArgumentError(absl::StrCat(
        "unknown request kind '", request.kind().substr(0, 64),
        "' (a newer or different remora on the other side?)")));
  }
  if (!entry->before_join) {
    if (absl::Status s = CheckMember(request); !s.ok()) return responder->ReplyError(s);
  }
  entry->handler(std::move(message), std::move(responder));
}

absl::Status Agent::Impl::CheckMember(const wire::Request& request) {
  // A peer may call before this agent processed its own join reply.
  if (!joined_.WaitForNotificationWithTimeout(agent_->options_.connect_timeout)) {
    return absl::UnavailableError("this worker has not joined the group yet");
  }
  return CheckSender(request, Membership{agent_});
}

// ---------------------------------------------------------------------------
// Responder.

void Agent::Impl::SendReply(ReplySlot& slot, base::WorkerId to, OutMessage message) {
  std::vector<ShmFill> fills;
  std::vector<wire::CudaPayload> cuda_sent;
  const channel::Route route = RouteTo(to);
  const bool sent = slot.Reply(SerializeMessage(std::move(message), route, &fills, &cuda_sent));
  FillAll(route, fills);  // the caller copies out meanwhile
  if (!sent) {
    for (const auto& f : fills) shm_->Reclaim(f.descriptor);  // the caller is gone
    for (const auto& d : cuda_sent) cuda_->Reclaim(to, d);
  }
  incoming_.fetch_sub(1);
}

absl::Status Agent::Impl::EncodeReplyValue(base::WorkerId to, int64_t context_id,
                                           const c10::IValue& value, OutMessage* m) {
  std::vector<at::Tensor> grad_tensors;
  EncodeContext ctx{to, rrefs(), &m->payloads, &grad_tensors};
  SetDevices(to, m, &ctx);
  RETURN_IF_ERROR(EncodeValue(value, ctx, m->header.mutable_response()->mutable_value()));
  RecordSend(context_id, to, std::move(grad_tensors),
             m->header.mutable_response()->mutable_autograd());
  return absl::OkStatus();
}

Responder::~Responder() {
  if (!replied_) ReplyError(absl::InternalError("the request was dropped without a reply"));
}

void Responder::Reply(OutMessage message) {
  if (replied_) return;
  replied_ = true;
  server_->SendReply(*slot_, to_, std::move(message));
}

void Responder::ReplyError(const absl::Status& status, int signal) {
  OutMessage m;
  auto* e = m.header.mutable_response()->mutable_error();
  e->set_code(static_cast<int>(status.code()));
  e->set_message(std::string(status.message()));
  e->set_worker(server_->server_name());
  e->set_signal(signal);
  Reply(std::move(m));
}

void Responder::ReplyStatus(const absl::Status& status) {
  if (status.ok()) {
    Reply(OutMessage{});
  } else {
    ReplyError(status);
  }
}

void Responder::ReplyValue(absl::StatusOr<c10::IValue> value) {
  if (!value.ok()) return ReplyError(value.status());
  OutMessage m;
  absl::Status s = server_->EncodeReplyValue(to_, context_id_, *value, &m);
  if (!s.ok()) return ReplyError(base::Annotate(s, "sending the result"));
  Reply(std::move(m));
}

}  // namespace remora::rpc
