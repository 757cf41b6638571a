// Outgoing calls: unary gRPC calls (asynchronous, or waited for on the
// caller's own completion queue), rpc_sync on pooled streams, and the
// decoding of replies into values.
#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "proto/rref.pb.h"
#include "rpc/agent_impl.h"
#include "rpc/auth.h"
#include "trace/trace.h"

namespace remora::rpc {
namespace {

// How long a peer that did not answer a link's hello goes over gRPC
// before a link is tried again.
constexpr absl::Duration kLinkRetryAfter = absl::Seconds(5);

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace

std::chrono::system_clock::time_point DeadlineIn(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

// gRPC settings of remora's channels (`server` false) and servers (true),
// applied through `set(name, value)`: explicit message limits, flow-control
// windows and read sizes large enough for 100+ MB activations, keepalive.
void ApplyChannelArgs(const std::function<void(const char*, int)>& set, int max_message_bytes,
                      bool server) {
  set(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max_message_bytes);
  set(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max_message_bytes);
  set(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 64 << 20);
  set(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, (1 << 24) - 1);
  set(GRPC_ARG_TCP_READ_CHUNK_SIZE, 4 << 20);
  set(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 256 << 10);
  set(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 16 << 20);
  set(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  if (server) {
    set(GRPC_ARG_ALLOW_REUSEPORT, 0);
    // Accept the peers' keepalive pings.
    set(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
    set(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  } else {
    // Keepalive pings find a peer that vanished without closing its
    // connection (a machine gone, a cable pulled): a ping every second,
    // unanswered for 2 s (gRPC also makes that the socket's TCP_USER_TIMEOUT)
    // closes the connection and fails its calls. A worker's link cut between
    // network namespaces failed the master after 6.6-6.7 s with these
    // values, 8.7-8.9 s with 1 s / 3 s, 10.6-10.9 s with 2 s / 4 s and 12.4 s
    // with the earlier 5 s / 5 s (tests/integration/netns_test.cc; the
    // issue asks for 10 s). The peer's gRPC answers pings on its own
    // threads, whatever its handlers do.
    // (A local link's keepalive keeps the same time, rpc/link.h.)
    set(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(absl::ToInt64Milliseconds(LinkClient::kKeepaliveTime)));
    set(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(absl::ToInt64Milliseconds(LinkClient::kKeepaliveTimeout)));
    set(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
}

// The same for a client channel.
void ApplyChannelArgs(grpc::ChannelArguments& args, int max_message_bytes) {
  ApplyChannelArgs([&args](const char* name, int value) { args.SetInt(name, value); },
                   max_message_bytes, /*server=*/false);
}

// The distributed autograd context a request belongs to, or kNoContext
// (context id 0, protobuf's default, means none).
int64_t ContextOf(const wire::Request& r) {
  return r.has_autograd() && r.autograd().context_id() != 0 ? r.autograd().context_id()
                                                            : kNoContext;
}

ClientCall* Agent::Impl::NewCall(OutMessage message, const channel::Route& route,
                                 std::vector<ShmFill>* fills) {
  auto* call = new ClientCall;
  // Filled once the request is on its way (by the caller); the call may
  // complete, and `call` go, before that.
  call->request = SerializeMessage(std::move(message), route, fills, &call->cuda_sent);
  for (const auto& f : *fills) call->sent.push_back(f.descriptor);
  {
    base::MutexLock lock(calls_mu_);
    if (!stopped_) {
      calls_.insert(call);
      outgoing_.fetch_add(1);
      return call;
    }
  }
  for (const auto& d : call->cuda_sent) cuda_->Reclaim(route.peer, d);
  delete call;
  FillAll(route, *fills);
  for (const auto& f : *fills) shm_->Reclaim(f.descriptor);
  return nullptr;
}

void Agent::Impl::FinishCall(ClientCall* call, base::WorkerId peer, const absl::Status& status) {
  absl::StatusOr<InMessage> result =
      status.ok() ? ParseMessage(call->response, shm_.get(), cuda_.get(), peer) : status;
  // A failed call may never have been read: take its segments back.
  if (!status.ok()) {
    for (const auto& d : call->sent) shm_->Reclaim(d);
    for (const auto& d : call->cuda_sent) cuda_->Reclaim(peer, d);
  }
  Future<InMessage> done = call->done;
  {
    base::MutexLock lock(calls_mu_);
    calls_.erase(call);
  }
  delete call;
  outgoing_.fetch_sub(1);
  done.Complete(std::move(result));
}

void Agent::Impl::FinishCallOffGrpc(ClientCall* call, base::WorkerId peer,
                                    const absl::Status& status) {
  // Only processes that offer GPUs get replies with CUDA payloads.
  if (status.ok() && !cuda_->endpoint().gpus.empty() && CarriesCudaPayloads(call->response)) {
    return RunOwnThread([this, call, peer] { FinishCall(call, peer, absl::OkStatus()); });
  }
  FinishCall(call, peer, status);
}

Future<InMessage> Agent::Impl::Transmit(grpc::GenericStub* stub, OutMessage message,
                                        absl::Duration timeout, bool wait_for_ready,
                                        bool blocking, const channel::Route& route) {
  std::vector<ShmFill> fills;
  ClientCall* call = NewCall(std::move(message), route, &fills);
  if (call == nullptr) {
    return Future<InMessage>::Ready(absl::CancelledError("the agent is shutting down"));
  }
  return SendUnary(stub, call, timeout, wait_for_ready, blocking, route, fills);
}

Future<InMessage> Agent::Impl::SendUnary(grpc::GenericStub* stub, ClientCall* call,
                                         absl::Duration timeout, bool wait_for_ready,
                                         bool blocking, const channel::Route& route,
                                         std::vector<ShmFill>& fills) {
  Future<InMessage> done = call->done;
  call->context = std::make_unique<grpc::ClientContext>();
  call->context->set_deadline(DeadlineIn(timeout));
  call->context->set_wait_for_ready(wait_for_ready);
  AttachToken(call->context.get(), agent_->options_.token);
  const base::WorkerId peer = route.peer;
  if (!blocking) {
    stub->UnaryCall(call->context.get(), kUnaryMethod, grpc::StubOptions(), &call->request,
                    &call->response, [this, call, peer](grpc::Status status) {
                      FinishCallOffGrpc(call, peer, FromGrpc(status));
                    });
    FillAll(route, fills);
    return done;
  }
  // The calling thread drives its own completion queue: the reply wakes
  // this thread directly instead of a gRPC thread that would wake it.
  thread_local std::unique_ptr<grpc::CompletionQueue, void (*)(grpc::CompletionQueue*)> cq(
      new grpc::CompletionQueue, [](grpc::CompletionQueue* q) {
        q->Shutdown();
        void* tag;
        bool ok;
        while (q->Next(&tag, &ok)) {
        }
        delete q;
      });
  auto reader =
      stub->PrepareUnaryCall(call->context.get(), kUnaryMethod, call->request, cq.get());
  reader->StartCall();
  grpc::Status status;
  reader->Finish(&call->response, &status, call);
  FillAll(route, fills);
  void* tag = nullptr;
  bool ok = false;
  // Poll for the reply a little before sleeping: waking a sleeping thread
  // (an idle vCPU) costs more than a short round trip (AgentOptions::sync_spin).
  NextPolling(cq.get(), sync_spin_, &tag, &ok);
  reader.reset();
  FinishCall(call, peer, FromGrpc(status));
  return done;
}

std::unique_ptr<SyncStream> Agent::Impl::TakeStream(const Peer& peer) {
  std::unique_ptr<SyncStream> stream;
  while (true) {
    {
      base::MutexLock lock(peer.stream_mu);
      if (peer.idle_streams.empty()) break;
      stream = std::move(peer.idle_streams.back());
      peer.idle_streams.pop_back();
    }
    if (stream->usable()) break;
    stream.reset();  // the peer ended it meanwhile (it restarted, say)
  }
  if (stream == nullptr) {
    stream = SyncStream::Open(peer.stub.get(), agent_->options_.token);
    streams_opened_.fetch_add(1);
  }
  base::MutexLock lock(calls_mu_);
  if (stopped_) return nullptr;
  streams_in_use_.insert(stream.get());
  return stream;
}

void Agent::Impl::GiveBack(const Peer& peer, std::unique_ptr<SyncStream> stream, bool reusable) {
  {
    // Under calls_mu_ throughout, so that CancelOutgoing, once it set
    // stopped_, finds every idle stream there is.
    base::MutexLock lock(calls_mu_);
    streams_in_use_.erase(stream.get());
    if (reusable && !stopped_) {
      base::MutexLock stream_lock(peer.stream_mu);
      if (peer.idle_streams.size() < kMaxIdleStreams) {
        peer.idle_streams.push_back(std::move(stream));
        return;
      }
    }
  }
  stream.reset();  // cancelled, and waited for until gRPC let go of it
}

Future<InMessage> Agent::Impl::TransmitOnStream(const Peer& peer, OutMessage message,
                                                absl::Duration timeout) {
  const channel::Route& route = peer.route;
  std::vector<ShmFill> fills;
  ClientCall* call = NewCall(std::move(message), route, &fills);
  if (call == nullptr) {
    return Future<InMessage>::Ready(absl::CancelledError("the agent is shutting down"));
  }
  Future<InMessage> done = call->done;
  std::unique_ptr<SyncStream> stream = TakeStream(peer);
  if (stream == nullptr) {
    FillAll(route, fills);
    FinishCall(call, peer.info.id, absl::CancelledError("the agent is shutting down"));
    return done;
  }
  auto reply = stream->Call(
      call->request, [&] { FillAll(route, fills); }, absl::Now() + timeout, sync_spin_);
  GiveBack(peer, std::move(stream), reply.ok());
  if (reply.ok()) call->response = std::move(*reply);
  FinishCall(call, peer.info.id, reply.status());
  return done;
}

void Agent::Impl::ListenForLinks() {
  // Where peers of this host can use them: shared memory on (the link's
  // name comes from its endpoint) and no TLS (a link has no certificates;
  // the token it checks is all a plaintext call has too).
  const AgentOptions& o = agent_->options_;
  const base::WorkerInfo& self = agent_->self_;
  if (!local_links_ || o.tls.enabled() || self.shm.domain.empty()) {
    return;
  }
  auto server = LinkServer::Listen(
      LinkName(self.shm), o.token,
      [this](grpc::ByteBuffer frame, std::shared_ptr<ReplySlot> slot) { Dispatch(std::move(frame), std::move(slot)); },
      busy_poll_);
  // Not listening (the abstract name taken?) is no error: peers use gRPC.
  if (!server.ok()) return;
  link_server_ = std::move(*server);
}

std::shared_ptr<LinkClient> Agent::Impl::LinkTo(const Peer& peer) {
  if (link_server_ == nullptr || peer.route.shm == nullptr) return nullptr;
  base::MutexLock lock(peer.link_mu);
  if (peer.link != nullptr && peer.link->alive()) return peer.link;
  if (peer.link_refused || absl::Now() < peer.link_retry_at) return nullptr;
  if (peer.link != nullptr) peer.closed_links.push_back(std::move(peer.link));
  auto link = LinkClient::Connect(LinkName(peer.info.shm), agent_->options_.token, absl::Seconds(2), busy_poll_);
  if (absl::IsDeadlineExceeded(link.status())) {
    // There but silent (stopped, hung): gRPC for now, a link again later.
    peer.link_retry_at = absl::Now() + kLinkRetryAfter;
    return nullptr;
  }
  if (!link.ok()) {
    // Not listening (links off there, or another network namespace under
    // the same --host-id), gone, or refusing this agent's token: gRPC
    // from now on, which says why a call fails.
    peer.link_refused = true;
    return nullptr;
  }
  peer.link = std::move(*link);
  return peer.link;
}

Future<InMessage> Agent::Impl::TransmitOnLink(LinkClient& link, const Peer& peer,
                                              OutMessage message, absl::Duration timeout) {
  const channel::Route& route = peer.route;
  std::vector<ShmFill> fills;
  ClientCall* call = NewCall(std::move(message), route, &fills);
  if (call == nullptr) {
    return Future<InMessage>::Ready(absl::CancelledError("the agent is shutting down"));
  }
  calls_on_links_.fetch_add(1);
  Future<InMessage> done = call->done;
  const base::WorkerId to = peer.info.id;
  link.Send(call->request, absl::Now() + timeout,
            [this, call, to](absl::StatusOr<grpc::ByteBuffer> reply) {
              if (reply.ok()) call->response = std::move(*reply);
              FinishCallOffGrpc(call, to, reply.status());
            });
  FillAll(route, fills);  // `call` may be gone: the fills are ours
  return done;
}

void Agent::Impl::CloseLinks() {
  std::vector<std::shared_ptr<LinkClient>> links;
  {
    base::MutexLock lock(mu_);
    for (const auto* peers : {&peers_, &retired_peers_}) {
      for (const auto& p : *peers) {
        if (p == nullptr) continue;
        base::MutexLock link_lock(p->link_mu);
        p->link_refused = true;  // no new links
        if (p->link != nullptr) links.push_back(p->link);
      }
    }
  }
  // Outside the locks: the calls' failures run their callbacks here.
  for (const auto& l : links) l->Close(absl::CancelledError("the agent is shutting down"));
}

Future<InMessage> Agent::Impl::SendTo(base::WorkerId dst, OutMessage message,
                                      absl::Duration timeout, bool blocking,
                                      const std::string& what) {
  const Peer* peer = FindPeer(dst);
  if (peer == nullptr) {
    return Future<InMessage>::Ready(absl::NotFoundError(absl::StrCat(
        "no worker with id ", dst, " in the group")));
  }
  // Control messages are counted (and traced) by their request kind, calls by name.
  const std::string& named = what == "control message" ? message.header.request().kind() : what;
  {
    base::MutexLock lock(sent_mu_);
    ++sent_[named];
  }
  std::string traced;
  const int64_t sent_us = trace::Enabled() ? trace::NowUs() : -1;
  if (sent_us >= 0) traced = absl::StrCat("call ", named, " to ", peer->info.name);
  // A caller that waits on its own thread polls a stream for the reply;
  // others go on the local link when there is one.
  std::shared_ptr<LinkClient> link = streams_ && blocking ? nullptr : LinkTo(*peer);
  Future<InMessage> raw =
      streams_ && blocking ? TransmitOnStream(*peer, std::move(message), timeout)
      : link != nullptr    ? TransmitOnLink(*link, *peer, std::move(message), timeout)
          : Transmit(peer->stub.get(), std::move(message), timeout, false, blocking, peer->route);
  Future<InMessage> annotated;
  raw.then([annotated, peer, what, timeout, who = Who(peer->info.name), sent_us,
            traced = std::move(traced)](const absl::StatusOr<InMessage>& r) mutable {
    // Traced: from the send to the reply (or failure) here.
    if (sent_us >= 0) trace::Record(traced, -1, sent_us, trace::NowUs());
    if (r.ok()) {
      annotated.Complete(r);
    } else if (r.status().code() == absl::StatusCode::kDeadlineExceeded) {
      annotated.SetError(absl::DeadlineExceededError(absl::StrCat(
          what, " on ", who, " timed out after ", absl::FormatDuration(timeout))));
    } else {
      annotated.SetError(base::Annotate(r.status(), absl::StrCat(what, " on ", who, " at ", peer->info.address,
                                                           " failed in transport (is it running?)")));
    }
  });
  return annotated;
}

absl::Status Agent::Impl::ErrorFromReply(const wire::Response& response) const {
  const auto& e = response.error();
  int code = e.code();
  if (code <= 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    code = static_cast<int>(absl::StatusCode::kUnknown);
  }
  const std::string who = Who(e.worker());
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::StrCat(who, ": ", base::WithoutLeadingWorker(e.message(), who)));
}

std::string Agent::Impl::Who(const std::string& name) const {
  const Peer* master = FindPeer(0);
  if (master != nullptr ? master->info.name == name : name == "master") {
    return name == "master" ? "the master" : absl::StrCat("the master '", name, "'");
  }
  return absl::StrCat("worker '", name, "'");
}

void Agent::Impl::CompleteWithReply(const absl::StatusOr<InMessage>& reply, base::WorkerId from,
                                    Future<c10::IValue> result) {
  if (!reply.ok()) {
    result.SetError(reply.status());
    return;
  }
  const wire::Response& response = reply->header.response();
  if (response.has_error()) {
    result.SetError(ErrorFromReply(response));
    return;
  }
  std::vector<Future<Empty>> pending;
  std::vector<at::Tensor> grad_tensors;
  DecodeContext ctx{agent_->rrefs_.get(), &reply->payloads, &pending, &grad_tensors};
  auto value = DecodeValue(response.value(), ctx);
  absl::Status recorded =
      value.ok() ? RecordRecv(response.autograd(), from, grad_tensors) : value.status();
  if (!recorded.ok()) {
    result.SetError(base::Annotate(recorded,
                             absl::StrCat("bad reply from worker '", agent_->NameOf(from), "'")));
    return;
  }
  if (pending.empty()) {
    result.SetValue(std::move(*value));
    return;
  }
  WhenAll(pending).then([result, value = std::move(*value)](
                            const absl::StatusOr<Empty>& r) mutable {
    if (r.ok()) {
      result.SetValue(value);
    } else {
      result.SetError(r.status());
    }
  });
}

Future<c10::IValue> Agent::Impl::Call(base::WorkerId dst, wire::CallRequest call,
                                      std::vector<c10::IValue> args, const c10::IValue* self,
                                      CallOptions options,
                                      c10::intrusive_ptr<UserRRef> result_rref,
                                      bool blocking) {
  Future<c10::IValue> result(pool_.get());
  if (result_rref) {
    // remote(): the reply confirms the user, or carries the creation error.
    result.then([rrefs = agent_->rrefs_, result_rref](const absl::StatusOr<c10::IValue>& r) {
      rrefs->FinishPendingUser(result_rref->fork_id(), r.status());
    });
  }
  OutMessage m;
  m.stream_group = options.stream_group;
  wire::Request* request = m.header.mutable_request();
  request->set_from(agent_->self_.id);
  std::vector<at::Tensor> grad_tensors;
  EncodeContext ctx{dst, agent_->rrefs_.get(), &m.payloads, &grad_tensors};
  SetDevices(dst, &m, &ctx);
  absl::Status status;
  for (const auto& arg : args) {
    status = EncodeValue(arg, ctx, call.add_args());
    if (!status.ok()) break;
  }
  if (status.ok() && self != nullptr) status = EncodeValue(*self, ctx, call.mutable_self());
  if (!status.ok()) {
    result.SetError(base::Annotate(status, absl::StrCat("encoding the arguments of '",
                                                  call.function(), "'")));
    return result;
  }
  const std::string what =
      absl::StrCat(self != nullptr ? "method '" : "function '", call.function(), "'");
  request->set_kind(wire::CallRequest::descriptor()->full_name());
  call.SerializeToString(request->mutable_body());
  RecordSend(CurrentContextId(), dst, std::move(grad_tensors), request->mutable_autograd());
  const absl::Duration timeout =
      options.timeout > absl::ZeroDuration() ? options.timeout : agent_->options_.rpc_timeout;
  SendTo(dst, std::move(m), timeout, blocking, what)
      .then([this, dst, result](const absl::StatusOr<InMessage>& reply) {
        CompleteWithReply(reply, dst, result);
      });
  return result;
}

absl::Status Agent::Impl::RecordRecv(const wire::AutogradMeta& meta, base::WorkerId from,
                                     const std::vector<at::Tensor>& grad_tensors) {
  if (grad_tensors.empty() || meta.message_id() == 0) return absl::OkStatus();
  AutogradHooks* hooks = agent_->autograd_.get();
  if (hooks == nullptr) {
    return absl::FailedPreconditionError(
        "distributed autograd is not enabled on this worker (autograd::Enable)");
  }
  hooks->RecordRecv(meta.context_id(), meta.message_id(), from, grad_tensors);
  return absl::OkStatus();
}

void Agent::Impl::RecordSend(int64_t context_id, base::WorkerId dst,
                             std::vector<at::Tensor> grad_tensors, wire::AutogradMeta* meta) {
  if (context_id == kNoContext) return;
  meta->set_context_id(context_id);
  AutogradHooks* hooks = agent_->autograd_.get();
  if (grad_tensors.empty() || hooks == nullptr) return;
  meta->set_message_id(hooks->RecordSend(context_id, dst, std::move(grad_tensors)));
}

absl::Status Agent::Impl::SendAndWait(base::WorkerId dst, wire::Request request,
                                      absl::Duration timeout) {
  OutMessage m;
  request.set_from(agent_->self_.id);
  *m.header.mutable_request() = std::move(request);
  auto reply = SendTo(dst, std::move(m), timeout).wait();
  if (!reply.ok()) return reply.status();
  if (reply->header.response().has_error()) return ErrorFromReply(reply->header.response());
  return absl::OkStatus();
}

}  // namespace remora::rpc
