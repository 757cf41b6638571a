#include "rpc/agent.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <system_error>
#include <thread>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "rpc/message.h"
#include "rpc/mutex_lock.h"
#include "rpc/request_checks.h"
#include "rpc/status_util.h"
#include "rpc/stream.h"

namespace remora {
namespace {

// The gRPC method of unary calls (see proto/remora.proto); streams use
// kStreamMethod (rpc/stream.h).
constexpr char kMethod[] = "/remora.Agent/Call";

std::chrono::system_clock::time_point DeadlineIn(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// Identifies the machine: processes with equal host ids share memory.
std::string HostId() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat(host, "/", BootId());
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
    set(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
    set(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  } else {
    // Keepalive pings find a peer that vanished without closing its
    // connection (a machine gone, a cable pulled) within about 10 s.
    set(GRPC_ARG_KEEPALIVE_TIME_MS, 5000);
    set(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
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

std::string Describe(const wire::Request& r) {
  switch (r.body_case()) {
    case wire::Request::kCall:
      return r.call().has_self() ? absl::StrCat("method '", r.call().function(), "'")
                                 : absl::StrCat("function '", r.call().function(), "'");
    case wire::Request::kFetch:
      return "to_here";
    case wire::Request::kJoin:
      return "join";
    default:
      return "control message";
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Server side: one reactor per incoming call. The reactor reads the request,
// hands it to the agent, and finishes when the agent replies or the client
// cancels, whichever comes first; a reply after that is dropped.

class ServerCall;

// The reply slot of a unary call, shared by its reactor and the handler
// working on the request.
class UnaryReplySlot final : public ReplySlot {
 public:
  explicit UnaryReplySlot(ServerCall* call) : call_(call) {}
  // Sends `message` and finishes the call; false when already finished.
  bool Reply(grpc::ByteBuffer message) override;
  // Finishes the call with `status` and no reply message.
  bool Fail(grpc::Status status);
  void Detach() {
    MutexLock lock(mu_);
    call_ = nullptr;
  }

 private:
  ServerCall* Claim() {
    MutexLock lock(mu_);
    if (finished_ || call_ == nullptr) return nullptr;
    finished_ = true;
    return call_;
  }

  absl::Mutex mu_;
  ServerCall* call_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer response_;  // written once, by the claimer
};

class ServerCall final : public grpc::ServerGenericBidiReactor {
 public:
  ServerCall(Agent::Impl* impl) : impl_(impl), slot_(std::make_shared<UnaryReplySlot>(this)) {
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override;
  void OnCancel() override {
    slot_->Fail(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the caller"));
  }
  void OnDone() override {
    slot_->Detach();
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

// A handler's way to answer one request. Replies exactly once: a responder
// dropped without a reply answers with an internal error.
class Responder {
 public:
  Responder(std::shared_ptr<ReplySlot> slot, Agent::Impl* impl, WorkerId to);
  ~Responder();
  void Reply(OutMessage message);
  void ReplyError(const absl::Status& status);
  // An empty reply when `status` is OK, else the error.
  void ReplyStatus(const absl::Status& status);
  void ReplyValue(absl::StatusOr<c10::IValue> value);
  WorkerId to() const { return to_; }
  // The distributed autograd context the reply belongs to.
  void set_context(int64_t context_id) { context_id_ = context_id; }

 private:
  std::shared_ptr<ReplySlot> slot_;
  Agent::Impl* impl_;
  WorkerId to_;
  int64_t context_id_ = kNoContext;
  bool replied_ = false;
};

// ---------------------------------------------------------------------------

// Idle streams kept per peer (rpc/stream.h); each holds a call open on both
// sides.
constexpr size_t kMaxIdleStreams = 8;

struct Peer {
  WorkerInfo info;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> stub;
  Route route;  // how large payloads reach it
  // Streams to it that no rpc_sync is using (AgentOptions::streams), at
  // most kMaxIdleStreams: a burst of callers does not keep its streams.
  // Taken inside Impl::calls_mu_ (GiveBack) and Impl::mu_ (CancelOutgoing),
  // never the other way round.
  mutable absl::Mutex stream_mu;
  mutable std::vector<std::unique_ptr<SyncStream>> idle_streams ABSL_GUARDED_BY(stream_mu);
};

void ToWire(const ShmEndpoint& e, wire::ShmEndpoint* w) {
  w->set_domain(e.domain);
  w->set_pid(e.pid);
  w->set_incarnation(e.incarnation);
}

ShmEndpoint FromWire(const wire::ShmEndpoint& w) {
  return ShmEndpoint{w.domain(), w.pid(), w.incarnation()};
}

void ToWire(const CudaEndpoint& e, wire::CudaEndpoint* w) {
  for (const auto& g : e.gpus) w->add_gpus(g);
  w->set_nccl(e.nccl);
  w->set_incarnation(e.incarnation);
}

CudaEndpoint FromWire(const wire::CudaEndpoint& w) {
  return CudaEndpoint{{w.gpus().begin(), w.gpus().end()}, w.nccl(), w.incarnation()};
}

// `option`, unless the environment sets `variable` to 0 for this process:
// REMORA_CUDA_CHANNEL=0 stages CUDA tensors through host memory, REMORA_SHM=0
// turns shared memory off, REMORA_STREAMS=0 sends every call as a unary
// gRPC call.
bool OnUnlessEnvOff(bool option, const char* variable) {
  const char* env = std::getenv(variable);
  return option && !(env != nullptr && std::string(env) == "0");
}

// AgentOptions::sync_spin, unless REMORA_SYNC_SPIN_US gives microseconds.
absl::Duration SyncSpin(const AgentOptions& options) {
  const char* env = std::getenv("REMORA_SYNC_SPIN_US");
  int us = 0;
  if (env != nullptr && absl::SimpleAtoi(env, &us) && us >= 0) return absl::Microseconds(us);
  return options.sync_spin;
}

// REMORA_DEBUG=channels logs the channel chosen for every peer.
bool DebugChannels() {
  const char* env = std::getenv("REMORA_DEBUG");
  return env != nullptr && std::string(env).find("channels") != std::string::npos;
}

// One outgoing call in flight, unary or on a stream.
struct ClientCall {
  std::unique_ptr<grpc::ClientContext> context;  // unary calls only
  grpc::ByteBuffer request;
  grpc::ByteBuffer response;
  Future<InMessage> done;
  std::vector<wire::ShmPayload> sent;  // segments to take back if it fails
  std::vector<wire::CudaPayload> cuda_sent;  // CUDA transfers, likewise
};

class Agent::Impl final : public grpc::CallbackGenericService {
 public:
  explicit Impl(Agent* agent)
      : agent_(agent),
        sync_spin_(SyncSpin(agent->options_)),
        streams_(OnUnlessEnvOff(agent->options_.streams, "REMORA_STREAMS")),
        pool_(std::make_unique<ThreadPool>(agent->options_.num_threads)),
        shm_(std::make_unique<ShmChannel>(ShmChannel::Options{
            OnUnlessEnvOff(agent->options_.shared_memory, "REMORA_SHM"),
            agent->options_.shm_max_bytes})),
        channel_credentials_(MakeChannelCredentials(agent->options_.tls)),
        cuda_(std::make_unique<CudaChannel>(
            CudaChannel::Options{OnUnlessEnvOff(agent->options_.cuda_channel, "REMORA_CUDA_CHANNEL"),
                                 agent->options_.rpc_timeout},
            [this](WorkerId peer, wire::Request request, absl::Duration timeout) {
              return SendCudaControl(peer, std::move(request), timeout);
            })) {}

  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* ctx) override {
    class Reject : public grpc::ServerGenericBidiReactor {
     public:
      explicit Reject(grpc::Status status) { Finish(std::move(status)); }
      void OnDone() override { delete this; }
    };
    const bool stream = ctx->method() == kStreamMethod;
    if (!stream && ctx->method() != kMethod) {
      return new Reject(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "not a remora method"));
    }
    if (!Authenticated(*ctx)) {
      std::cerr << "remora: '" << agent_->self_.name << "' rejected a call from " << ctx->peer()
                << ": missing or wrong token\n";
      return new Reject(grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                                     "missing or wrong remora token (REMORA_TOKEN / --token-file)"));
    }
    if (!stream) return new ServerCall(this);
    MutexLock lock(server_streams_mu_);
    if (server_streams_closed_) {
      return new Reject(grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat(
          "worker '", agent_->self_.name, "' is shutting down")));
    }
    auto* reactor = new ServerStream(
        [this](grpc::ByteBuffer frame, std::shared_ptr<ReplySlot> slot) {
          Dispatch(std::move(frame), std::move(slot));
        },
        [this](const std::shared_ptr<ServerStream::State>& state) {
          MutexLock lock(server_streams_mu_);
          server_streams_.erase(state);
        });
    server_streams_.insert(reactor->state());
    return reactor;
  }

  // True when no token is configured, or the call carries the right one.
  bool Authenticated(const grpc::GenericCallbackServerContext& ctx) const {
    const std::string& want = agent_->options_.token;
    if (want.empty()) return true;
    auto it = ctx.client_metadata().find(kTokenHeader);
    if (it == ctx.client_metadata().end()) return false;
    const grpc::string_ref& got = it->second;
    // Constant time in the token's length: no early exit on a mismatch.
    unsigned char diff = got.size() != want.size();
    for (size_t i = 0; i < want.size(); ++i) {
      diff |= static_cast<unsigned char>(want[i] ^ (i < got.size() ? got.data()[i] : 0));
    }
    return diff == 0;
  }

  // Entry point of every request (on a gRPC thread): parse, then handle on
  // the pool.
  void Dispatch(grpc::ByteBuffer buffer, std::shared_ptr<ReplySlot> slot) {
    incoming_.fetch_add(1);
    const bool own_thread = !cuda_->endpoint().gpus.empty() && CarriesCudaPayloads(buffer);
    auto task = [this, buffer = std::move(buffer), slot = std::move(slot)]() mutable {
      auto message = ParseMessage(buffer, shm_.get(), cuda_.get());
      buffer.Clear();
      if (!message.ok()) {
        Responder(std::move(slot), this, kUnknownWorker)
            .ReplyError(Annotate(message.status(), "bad request"));
        return;
      }
      Handle(std::move(*message), std::make_shared<Responder>(std::move(slot), this,
                                                              message->header.request().from()));
    };
    // A request with CUDA payloads is received (and handled) on a thread of
    // its own, not on the pool (see RunOwnThread).
    if (own_thread) return RunOwnThread(std::move(task));
    pool_->Schedule(std::move(task));
  }

  void Handle(InMessage message, std::shared_ptr<Responder> responder);
  void HandleCall(InMessage message, std::shared_ptr<Responder> responder);
  void HandleFetch(const wire::Request& request, std::shared_ptr<Responder> responder);
  void HandleJoin(const wire::JoinRequest& join, std::shared_ptr<Responder> responder);
  void HandleProbe(const wire::ShutdownProbe& probe, std::shared_ptr<Responder> responder);

  // Sends a request as a unary call; the future completes on a gRPC
  // thread, or on this thread before returning when `blocking`.
  Future<InMessage> Transmit(grpc::GenericStub* stub, OutMessage message,
                             absl::Duration timeout, bool wait_for_ready,
                             bool blocking = false, const Route& route = {});
  // Sends a request on a stream to `peer` (see rpc/stream.h) and waits for
  // the reply on this thread: what Transmit does when `blocking`.
  Future<InMessage> TransmitOnStream(const Peer& peer, OutMessage message,
                                     absl::Duration timeout);
  // Serializes `message` for `route` and registers the call; null once the
  // agent is stopping (the payloads are taken back). The caller sends
  // call->request, then calls FillAll(route, *fills).
  ClientCall* NewCall(OutMessage message, const Route& route, std::vector<ShmFill>* fills);
  // Sends `call` (from NewCall) as a unary call, as Transmit does.
  Future<InMessage> SendUnary(grpc::GenericStub* stub, ClientCall* call, absl::Duration timeout,
                              bool wait_for_ready, bool blocking, const Route& route,
                              std::vector<ShmFill>& fills);
  // Completes `call` with its reply (call->response, when `status` is OK)
  // or `status`, and forgets it.
  void FinishCall(ClientCall* call, WorkerId peer, const absl::Status& status);
  // Finishes `call` here, or on a thread of its own when its reply carries
  // CUDA payloads (see RunOwnThread).
  void FinishCallOffGrpc(ClientCall* call, WorkerId peer, const absl::Status& status);
  // An idle stream to `peer`, or a new one; registered as in use (null once
  // the agent is stopping).
  std::unique_ptr<SyncStream> TakeStream(const Peer& peer);
  // Puts a stream that `TakeStream` gave back among the idle ones, or drops
  // it when it cannot be used again.
  void GiveBack(const Peer& peer, std::unique_ptr<SyncStream> stream, bool reusable);
  // Sends a request to a group member; errors name it.
  Future<InMessage> SendTo(WorkerId dst, OutMessage message, absl::Duration timeout,
                           bool blocking = false);
  // Turns a reply into a value (decoding RRefs) and completes `result`.
  void CompleteWithReply(const absl::StatusOr<InMessage>& reply, WorkerId from,
                         Future<c10::IValue> result);
  absl::Status ErrorFromReply(const wire::Response& response) const;
  // Whether an id belongs to the group (for rpc/request_checks.h).
  struct Membership {
    const Agent* agent;
    bool operator()(WorkerId id) const { return agent->IsKnown(id); }
  };
  // Distributed autograd bookkeeping for a message received from / sent to
  // a peer (see rpc/autograd_hooks.h).
  absl::Status RecordRecv(const wire::AutogradMeta& meta, WorkerId from,
                          const std::vector<at::Tensor>& grad_tensors);
  void RecordSend(int64_t context_id, WorkerId dst, std::vector<at::Tensor> grad_tensors,
                  wire::AutogradMeta* meta);

  Future<c10::IValue> Call(WorkerId dst, wire::CallRequest call,
                           std::vector<c10::IValue> args, const c10::IValue* self,
                           CallOptions options, c10::intrusive_ptr<UserRRef> result,
                           bool blocking = false);

  absl::StatusOr<WorkerId> Resolve(const std::string& name) const;
  const Peer* FindPeer(WorkerId id) const;
  // Lets `ctx` send CUDA tensors to `to` (device maps, destinations in `m`).
  void SetDevices(WorkerId to, OutMessage* m, EncodeContext* ctx) const {
    const Peer* p = FindPeer(to);
    ctx->devices = &devices_;
    ctx->peer = p != nullptr ? &p->info : nullptr;
    ctx->cuda_destinations = &m->cuda_destinations;
  }
  // How large payloads reach `id` (inline when unknown).
  Route RouteTo(WorkerId id) const {
    const Peer* p = FindPeer(id);
    return p != nullptr ? p->route : Route{};
  }
  void SetBook(std::vector<WorkerInfo> book);
  // The CUDA channel's control requests (NCCL set-up, releases): a call to
  // `peer`, waited for.
  absl::Status SendCudaControl(WorkerId peer, wire::Request request, absl::Duration timeout);
  // What channel_to() reports for CUDA tensors on `device` sent to `p`.
  absl::StatusOr<std::string> CudaChannelTo(const Peer& p, c10::Device device) const;
  // REMORA_DEBUG=channels: the channel of each of this process's GPUs to `p`.
  void LogCudaChannels(const Peer& p) const;

  void CancelOutgoing();
  void Stop();

  RRefContext* rrefs() const { return agent_->rrefs_.get(); }

  Agent* const agent_;
  const absl::Duration sync_spin_;  // see AgentOptions::sync_spin
  const bool streams_;              // see AgentOptions::streams
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<ShmChannel> shm_;
  // Plaintext or TLS (AgentOptions::tls), for every channel to a peer.
  const std::shared_ptr<grpc::ChannelCredentials> channel_credentials_;
  std::unique_ptr<CudaChannel> cuda_;
  DeviceMapper devices_;  // set in Start, then read-only
  std::unique_ptr<grpc::Server> server_;
  std::atomic<int64_t> incoming_{0};
  std::atomic<int64_t> outgoing_{0};

  absl::Notification joined_;
  absl::Notification finished_;  // worker: the master ended the group

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);  // index = id
  std::map<std::string, WorkerId> ids_ ABSL_GUARDED_BY(mu_);

  // Master: workers that registered, by name.
  struct Joiner {
    std::string address;
    std::string host_id;
    ShmEndpoint shm;
    std::shared_ptr<Responder> responder;
    CudaEndpoint cuda;
    std::string device;
  };
  absl::Mutex join_mu_;
  std::map<std::string, Joiner> joiners_ ABSL_GUARDED_BY(join_mu_);
  bool formed_ ABSL_GUARDED_BY(join_mu_) = false;
  std::vector<WorkerInfo> book_ ABSL_GUARDED_BY(join_mu_);

  absl::Mutex calls_mu_;
  absl::flat_hash_set<ClientCall*> calls_ ABSL_GUARDED_BY(calls_mu_);
  absl::flat_hash_set<SyncStream*> streams_in_use_ ABSL_GUARDED_BY(calls_mu_);
  std::atomic<int64_t> streams_opened_{0};
  bool stopped_ = false;

  // Streams peers opened to this agent's server; closed (and no new ones
  // taken) when it stops, which would otherwise wait for them.
  absl::Mutex server_streams_mu_;
  absl::flat_hash_set<std::shared_ptr<ServerStream::State>> server_streams_
      ABSL_GUARDED_BY(server_streams_mu_);
  bool server_streams_closed_ ABSL_GUARDED_BY(server_streams_mu_) = false;

  // Threads started by RunOwnThread and not yet done. Shared with them, so
  // that a finishing thread never touches the Impl after Stop() saw zero.
  struct OwnThreads {
    absl::Mutex mu;
    int running ABSL_GUARDED_BY(mu) = 0;
    bool closed ABSL_GUARDED_BY(mu) = false;
  };
  std::shared_ptr<OwnThreads> own_threads_ = std::make_shared<OwnThreads>();

 public:
  // Runs `task` on a thread of its own, or here once Stop() has begun. For
  // frames with CUDA payloads: receiving them waits for their transfers,
  // and NCCL posts a communicator's transfers in order, so frames waiting on
  // pool or gRPC threads could hold up the very frame they wait for (or the
  // replies a pool thread waits for).
  void RunOwnThread(std::function<void()> task) {
    {
      MutexLock lock(own_threads_->mu);
      if (!own_threads_->closed) {
        ++own_threads_->running;
        try {
          std::thread([state = own_threads_, task] {
            task();
            MutexLock lock(state->mu);
            --state->running;
          }).detach();
          return;
        } catch (const std::system_error&) {  // no thread to be had: run it here
          --own_threads_->running;
        }
      }
    }
    task();
  }

  // Stops RunOwnThread from starting threads and waits for those running.
  void JoinOwnThreads() {
    OwnThreads& state = *own_threads_;
    MutexLock lock(state.mu);
    state.closed = true;
    auto done = [&state]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state.mu) { return state.running == 0; };
    state.mu.Await(absl::Condition(&done));
  }
};

void ServerCall::OnReadDone(bool ok) {
  if (!ok) {
    slot_->Fail(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "no request message"));
    return;
  }
  impl_->Dispatch(std::move(request_), slot_);
}

Responder::Responder(std::shared_ptr<ReplySlot> slot, Agent::Impl* impl, WorkerId to)
    : slot_(std::move(slot)), impl_(impl), to_(to) {}

Responder::~Responder() {
  if (!replied_) ReplyError(absl::InternalError("the request was dropped without a reply"));
}

void Responder::Reply(OutMessage message) {
  if (replied_) return;
  replied_ = true;
  std::vector<ShmFill> fills;
  std::vector<wire::CudaPayload> cuda_sent;
  const Route route = impl_->RouteTo(to_);
  const bool sent =
      slot_->Reply(SerializeMessage(std::move(message), route, &fills, &cuda_sent));
  FillAll(route, fills);  // the caller copies out meanwhile
  if (!sent) {
    for (const auto& f : fills) impl_->shm_->Reclaim(f.descriptor);  // the caller is gone
    for (const auto& d : cuda_sent) impl_->cuda_->Reclaim(to_, d);
  }
  impl_->incoming_.fetch_sub(1);
}

void Responder::ReplyError(const absl::Status& status) {
  OutMessage m;
  auto* e = m.header.mutable_response()->mutable_error();
  e->set_code(static_cast<int>(status.code()));
  e->set_message(std::string(status.message()));
  e->set_worker(impl_->agent_->self().name);
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
  std::vector<at::Tensor> grad_tensors;
  EncodeContext ctx{to_, impl_->rrefs(), &m.payloads, &grad_tensors};
  impl_->SetDevices(to_, &m, &ctx);
  absl::Status s = EncodeValue(*value, ctx, m.header.mutable_response()->mutable_value());
  if (!s.ok()) return ReplyError(Annotate(s, "sending the result"));
  impl_->RecordSend(context_id_, to_, std::move(grad_tensors),
                    m.header.mutable_response()->mutable_autograd());
  Reply(std::move(m));
}

// ---------------------------------------------------------------------------
// Client side.

ClientCall* Agent::Impl::NewCall(OutMessage message, const Route& route,
                                 std::vector<ShmFill>* fills) {
  auto* call = new ClientCall;
  // Filled once the request is on its way (by the caller); the call may
  // complete, and `call` go, before that.
  call->request = SerializeMessage(std::move(message), route, fills, &call->cuda_sent);
  for (const auto& f : *fills) call->sent.push_back(f.descriptor);
  {
    MutexLock lock(calls_mu_);
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

void Agent::Impl::FinishCall(ClientCall* call, WorkerId peer, const absl::Status& status) {
  absl::StatusOr<InMessage> result =
      status.ok() ? ParseMessage(call->response, shm_.get(), cuda_.get(), peer) : status;
  // A failed call may never have been read: take its segments back.
  if (!status.ok()) {
    for (const auto& d : call->sent) shm_->Reclaim(d);
    for (const auto& d : call->cuda_sent) cuda_->Reclaim(peer, d);
  }
  Future<InMessage> done = call->done;
  {
    MutexLock lock(calls_mu_);
    calls_.erase(call);
  }
  delete call;
  outgoing_.fetch_sub(1);
  done.Complete(std::move(result));
}

void Agent::Impl::FinishCallOffGrpc(ClientCall* call, WorkerId peer,
                                    const absl::Status& status) {
  // Only processes that offer GPUs get replies with CUDA payloads.
  if (status.ok() && !cuda_->endpoint().gpus.empty() && CarriesCudaPayloads(call->response)) {
    return RunOwnThread([this, call, peer] { FinishCall(call, peer, absl::OkStatus()); });
  }
  FinishCall(call, peer, status);
}

Future<InMessage> Agent::Impl::Transmit(grpc::GenericStub* stub, OutMessage message,
                                        absl::Duration timeout, bool wait_for_ready,
                                        bool blocking, const Route& route) {
  std::vector<ShmFill> fills;
  ClientCall* call = NewCall(std::move(message), route, &fills);
  if (call == nullptr) {
    return Future<InMessage>::Ready(absl::CancelledError("the agent is shutting down"));
  }
  return SendUnary(stub, call, timeout, wait_for_ready, blocking, route, fills);
}

Future<InMessage> Agent::Impl::SendUnary(grpc::GenericStub* stub, ClientCall* call,
                                         absl::Duration timeout, bool wait_for_ready,
                                         bool blocking, const Route& route,
                                         std::vector<ShmFill>& fills) {
  Future<InMessage> done = call->done;
  call->context = std::make_unique<grpc::ClientContext>();
  call->context->set_deadline(DeadlineIn(timeout));
  call->context->set_wait_for_ready(wait_for_ready);
  if (!agent_->options_.token.empty()) {
    call->context->AddMetadata(kTokenHeader, agent_->options_.token);
  }
  const WorkerId peer = route.peer;
  if (!blocking) {
    stub->UnaryCall(call->context.get(), kMethod, grpc::StubOptions(), &call->request,
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
      stub->PrepareUnaryCall(call->context.get(), kMethod, call->request, cq.get());
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
      MutexLock lock(peer.stream_mu);
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
  MutexLock lock(calls_mu_);
  if (stopped_) return nullptr;
  streams_in_use_.insert(stream.get());
  return stream;
}

void Agent::Impl::GiveBack(const Peer& peer, std::unique_ptr<SyncStream> stream, bool reusable) {
  {
    // Under calls_mu_ throughout, so that CancelOutgoing, once it set
    // stopped_, finds every idle stream there is.
    MutexLock lock(calls_mu_);
    streams_in_use_.erase(stream.get());
    if (reusable && !stopped_) {
      MutexLock stream_lock(peer.stream_mu);
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
  const Route& route = peer.route;
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

Future<InMessage> Agent::Impl::SendTo(WorkerId dst, OutMessage message,
                                      absl::Duration timeout, bool blocking) {
  const Peer* peer = FindPeer(dst);
  if (peer == nullptr) {
    return Future<InMessage>::Ready(absl::NotFoundError(absl::StrCat(
        "no worker with id ", dst, " in the group")));
  }
  const std::string what = Describe(message.header.request());
  Future<InMessage> raw =
      streams_ && blocking ? TransmitOnStream(*peer, std::move(message), timeout)
          : Transmit(peer->stub.get(), std::move(message), timeout, false, blocking, peer->route);
  Future<InMessage> annotated;
  raw.then([annotated, peer, what, timeout](const absl::StatusOr<InMessage>& r) mutable {
    if (r.ok()) {
      annotated.Complete(r);
    } else if (r.status().code() == absl::StatusCode::kDeadlineExceeded) {
      annotated.SetError(absl::DeadlineExceededError(absl::StrCat(
          what, " on worker '", peer->info.name, "' timed out after ",
          absl::FormatDuration(timeout))));
    } else {
      annotated.SetError(Annotate(r.status(), absl::StrCat(
          what, " on worker '", peer->info.name, "' at ", peer->info.address,
          " failed in transport (is the worker running?)")));
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
  return absl::Status(static_cast<absl::StatusCode>(code),
                      absl::StrCat("worker '", e.worker(), "': ", e.message()));
}

void Agent::Impl::CompleteWithReply(const absl::StatusOr<InMessage>& reply, WorkerId from,
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
    result.SetError(Annotate(recorded,
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

Future<c10::IValue> Agent::Impl::Call(WorkerId dst, wire::CallRequest call,
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
    result.SetError(Annotate(status, absl::StrCat("encoding the arguments of '",
                                                  call.function(), "'")));
    return result;
  }
  *request->mutable_call() = std::move(call);
  RecordSend(CurrentContextId(), dst, std::move(grad_tensors), request->mutable_autograd());
  const absl::Duration timeout =
      options.timeout > absl::ZeroDuration() ? options.timeout : agent_->options_.rpc_timeout;
  SendTo(dst, std::move(m), timeout, blocking)
      .then([this, dst, result](const absl::StatusOr<InMessage>& reply) {
        CompleteWithReply(reply, dst, result);
      });
  return result;
}

// ---------------------------------------------------------------------------
// Handlers (on the pool).

void Agent::Impl::Handle(InMessage message, std::shared_ptr<Responder> responder) {
  const wire::Request& request = message.header.request();
  if (request.body_case() == wire::Request::kJoin) {
    HandleJoin(request.join(), std::move(responder));
    return;
  }
  // A peer may call before this agent processed its own join reply.
  if (!joined_.WaitForNotificationWithTimeout(agent_->options_.connect_timeout)) {
    responder->ReplyError(absl::UnavailableError("this worker has not joined the group yet"));
    return;
  }
  const Membership member{agent_};
  if (absl::Status s = CheckSender(request, member); !s.ok()) {
    responder->ReplyError(s);
    return;
  }
  RRefContext& rrefs = *agent_->rrefs_;
  switch (request.body_case()) {
    case wire::Request::kCall:
      HandleCall(std::move(message), std::move(responder));
      return;
    case wire::Request::kFetch:
      HandleFetch(request, std::move(responder));
      return;
    case wire::Request::kFork: {
      const RRefId id = FromWire(request.fork().rref_id());
      const ForkId fork = FromWire(request.fork().fork_id());
      if (absl::Status s = CheckIds("fork request", {id, fork}, member); !s.ok()) {
        return responder->ReplyError(s);
      }
      rrefs.AddFork(id, fork);
      responder->Reply(OutMessage{});
      return;
    }
    case wire::Request::kChildAccept:
      rrefs.AcceptChild(FromWire(request.child_accept().fork_id()));
      responder->Reply(OutMessage{});
      return;
    case wire::Request::kUserDelete: {
      const auto& d = request.user_delete();
      // Deletes are idempotent: an unknown or already deleted user is fine.
      responder->ReplyStatus(rrefs.DeleteFork(FromWire(d.rref_id()), FromWire(d.fork_id())));
      return;
    }
    case wire::Request::kProbe:
      HandleProbe(request.probe(), std::move(responder));
      return;
    case wire::Request::kPing:
      responder->Reply(OutMessage{});
      return;
    case wire::Request::kNcclSetup:
      responder->ReplyStatus(
          cuda_->OnNcclSetup(static_cast<WorkerId>(request.from()), request.nccl_setup()));
      return;
    case wire::Request::kNcclAbort:
      cuda_->OnNcclAbort(static_cast<WorkerId>(request.from()), request.nccl_abort());
      responder->Reply(OutMessage{});
      return;
    case wire::Request::kCudaRelease:
      cuda_->OnRelease(static_cast<WorkerId>(request.from()), request.cuda_release());
      responder->Reply(OutMessage{});
      return;
    case wire::Request::kFinish:
      if (agent_->options_.is_master) {
        responder->ReplyError(absl::PermissionDeniedError("only the master ends the group"));
        return;
      }
      responder->Reply(OutMessage{});
      finished_.Notify();
      return;
    default:
      responder->ReplyError(absl::InvalidArgumentError("request without a known body"));
  }
}

void Agent::Impl::HandleCall(InMessage message, std::shared_ptr<Responder> responder) {
  const wire::Request& request = message.header.request();
  const wire::CallRequest& call = request.call();
  const WorkerId from = static_cast<WorkerId>(request.from());
  RRefContext& rrefs = *agent_->rrefs_;
  const Membership member{agent_};
  if (absl::Status s = CheckCall(call, from); !s.ok()) return responder->ReplyError(s);
  if (absl::Status s = CheckContext(request, member); !s.ok()) return responder->ReplyError(s);
  const int64_t context_id = ContextOf(request);
  responder->set_context(context_id);

  std::vector<Future<Empty>> pending;
  std::vector<at::Tensor> grad_tensors;
  DecodeContext ctx{&rrefs, &message.payloads, &pending, &grad_tensors};
  std::vector<c10::IValue> args;
  args.reserve(call.args_size());
  for (const auto& a : call.args()) {
    auto v = DecodeValue(a, ctx);
    if (!v.ok()) return responder->ReplyError(Annotate(v.status(), "decoding the arguments"));
    args.push_back(std::move(*v));
  }
  c10::intrusive_ptr<OwnerRRef> self_rref;
  if (call.has_self()) {
    auto v = DecodeValue(call.self(), ctx);
    if (!v.ok()) return responder->ReplyError(Annotate(v.status(), "decoding the RRef"));
    auto* owner = v->isRRef() ? dynamic_cast<OwnerRRef*>(v->toRRef().get()) : nullptr;
    if (owner == nullptr) {
      return responder->ReplyError(absl::InvalidArgumentError(
          "a method call must target an RRef owned by the callee"));
    }
    self_rref = c10::intrusive_ptr<OwnerRRef>::unsafe_reclaim_from_nonowning(owner);
  }
  absl::Status recorded = RecordRecv(request.autograd(), from, grad_tensors);
  if (!recorded.ok()) return responder->ReplyError(recorded);
  c10::intrusive_ptr<OwnerRRef> result_rref;
  if (call.has_result_rref()) {  // the caller's own id: CheckCall
    const RRefId id = FromWire(call.result_rref());
    result_rref = rrefs.GetOrCreateOwner(id);
    rrefs.AddFork(id, id);
  }

  // Runs once every RRef argument is confirmed and `self` holds its value.
  auto run = [this, from, responder, result_rref, context_id, args = std::move(args),
              function = call.function(), self_rref]() mutable {
    ContextIdGuard in_context(context_id);
    CallContext cctx{agent_, WorkerInfo{}};
    if (const Peer* p = FindPeer(from)) cctx.caller = p->info;
    Future<c10::IValue> out;
    const Args call_args(std::move(args));
    if (self_rref) {
      auto object = self_rref->value().wait();  // ready: see below
      out = Future<c10::IValue>::Ready(
          object.ok() ? agent_->registry_->InvokeMethod(*object, function, cctx, call_args)
                      : object.status());
    } else {
      out = agent_->registry_->Invoke(function, cctx, call_args);
    }
    out.then([responder, result_rref](const absl::StatusOr<c10::IValue>& result) {
      if (!result_rref) return responder->ReplyValue(result);
      result_rref->SetValue(result);
      // The caller learns success or the creation error; the value stays.
      responder->ReplyValue(result.ok() ? absl::StatusOr<c10::IValue>(c10::IValue())
                                        : result.status());
    });
  };
  const ForkId lane = call.has_caller_fork() ? FromWire(call.caller_fork()) : ForkId{};
  const uint64_t seq = call.seq();
  const absl::Duration gap = agent_->options_.rpc_timeout;
  auto after_args = [run = std::move(run), responder, result_rref, self_rref, from, lane, seq,
                     gap](const absl::StatusOr<Empty>& confirmed) mutable {
    if (!confirmed.ok()) {
      if (result_rref) result_rref->SetValue(confirmed.status());
      return responder->ReplyError(Annotate(confirmed.status(), "an RRef argument"));
    }
    if (!self_rref) return run();
    // Method calls through one user RRef run in the caller's order.
    self_rref->value().then([run = std::move(run), self_rref, from, lane, seq,
                             gap](const absl::StatusOr<c10::IValue>&) mutable {
      self_rref->RunInOrder(from, lane, seq, std::move(run), gap);
    });
  };
  if (pending.empty() && (!self_rref || self_rref->value().ready())) {
    after_args(Empty{});  // common case: run on this thread, no hop
  } else {
    Future<Empty> all = WhenAll(pending, pool_.get());
    all.then(std::move(after_args));
  }
}

absl::Status Agent::Impl::RecordRecv(const wire::AutogradMeta& meta, WorkerId from,
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

void Agent::Impl::RecordSend(int64_t context_id, WorkerId dst,
                             std::vector<at::Tensor> grad_tensors, wire::AutogradMeta* meta) {
  if (context_id == kNoContext) return;
  meta->set_context_id(context_id);
  AutogradHooks* hooks = agent_->autograd_.get();
  if (grad_tensors.empty() || hooks == nullptr) return;
  meta->set_message_id(hooks->RecordSend(context_id, dst, std::move(grad_tensors)));
}

void Agent::Impl::HandleFetch(const wire::Request& request,
                              std::shared_ptr<Responder> responder) {
  const RRefId id = FromWire(request.fetch().rref_id());
  const WorkerId from = static_cast<WorkerId>(request.from());
  if (absl::Status s = CheckContext(request, Membership{agent_}); !s.ok()) {
    return responder->ReplyError(s);
  }
  responder->set_context(ContextOf(request));
  RRefContext& rrefs = *agent_->rrefs_;
  c10::intrusive_ptr<OwnerRRef> owner = rrefs.FindOwner(id);
  if (!owner) {
    // The value's remote() has not arrived yet. Wait for it when the asker
    // is a known user: its creator, or a fork the owner recorded.
    const ForkId fork = FromWire(request.fetch().fork_id());
    const bool known_user = (id.worker == from && fork == id) || rrefs.HasFork(id, fork);
    if (!known_user || id.worker == agent_->self_.id) {
      return responder->ReplyError(absl::NotFoundError(absl::StrCat(
          "to_here: no RRef ", id.ToString(), " here (already deleted, or never created)")));
    }
    owner = rrefs.GetOrCreateOwner(id);
  }
  owner->value().then([responder](const absl::StatusOr<c10::IValue>& v) {
    responder->ReplyValue(v);
  });
}

void Agent::Impl::HandleJoin(const wire::JoinRequest& join,
                             std::shared_ptr<Responder> responder) {
  const AgentOptions& opts = agent_->options_;
  if (!opts.is_master) {
    return responder->ReplyError(absl::FailedPreconditionError(absl::StrCat(
        "'", agent_->self_.name, "' is a worker, not the master; point --master at the master")));
  }
  if (!IsValidWorkerName(join.name())) {
    return responder->ReplyError(absl::InvalidArgumentError(absl::StrCat(
        "invalid worker name '", join.name(),
        "': use 1 to 128 characters of [A-Za-z0-9_:-]")));
  }
  if (join.name() == opts.name ||
      std::find(opts.workers.begin(), opts.workers.end(), join.name()) == opts.workers.end()) {
    return responder->ReplyError(absl::NotFoundError(absl::StrCat(
        "worker '", join.name(), "' is not one of the workers this master expects (",
        absl::StrJoin(opts.workers, ","), ")")));
  }
  std::vector<std::shared_ptr<Responder>> to_answer;
  std::vector<WorkerInfo> book;
  {
    MutexLock lock(join_mu_);
    auto it = joiners_.find(join.name());
    if (it != joiners_.end() && it->second.address != join.address()) {
      return responder->ReplyError(absl::AlreadyExistsError(absl::StrCat(
          "duplicate worker name '", join.name(), "': already registered from ",
          it->second.address, "; give each worker its own --name")));
    }
    if (formed_) {
      if (it == joiners_.end()) {
        return responder->ReplyError(
            absl::FailedPreconditionError("the group has already formed"));
      }
      to_answer.push_back(responder);  // a retried join: answer again
      book = book_;
    } else {
      joiners_[join.name()] = Joiner{join.address(), join.host_id(), FromWire(join.shm()),
                                     responder, FromWire(join.cuda()), join.device()};
      if (joiners_.size() == opts.workers.size()) {
        formed_ = true;
        book_.push_back(agent_->self_);
        book_.back().id = 0;
        for (size_t i = 0; i < opts.workers.size(); ++i) {
          const Joiner& j = joiners_[opts.workers[i]];
          book_.push_back(WorkerInfo{static_cast<WorkerId>(i + 1), opts.workers[i],
                                     j.address, j.host_id, j.shm, j.cuda, j.device});
        }
        book = book_;
        for (auto& [name, j] : joiners_) {
          to_answer.push_back(std::move(j.responder));
        }
      }
    }
  }
  if (book.empty()) return;  // answered when the last worker joins
  SetBook(book);
  for (auto& r : to_answer) {
    OutMessage m;
    auto* response = m.header.mutable_response();
    for (const auto& w : book) {
      auto* e = response->add_workers();
      e->set_id(w.id);
      e->set_name(w.name);
      e->set_address(w.address);
      e->set_host_id(w.host_id);
      ToWire(w.shm, e->mutable_shm());
      ToWire(w.cuda, e->mutable_cuda());
      e->set_device(w.device);
    }
    r->Reply(std::move(m));
  }
}

void Agent::Impl::HandleProbe(const wire::ShutdownProbe& probe,
                              std::shared_ptr<Responder> responder) {
  if (probe.release_users()) agent_->rrefs_->ReleaseAllUsers();
  absl::Status drained = agent_->rrefs_->WaitDrained(agent_->options_.shutdown_timeout);
  if (!drained.ok()) return responder->ReplyError(drained);
  OutMessage m;
  // Minus one: this probe itself.
  m.header.mutable_response()->set_active(agent_->active_calls() - 1);
  responder->Reply(std::move(m));
}

// ---------------------------------------------------------------------------

absl::StatusOr<WorkerId> Agent::Impl::Resolve(const std::string& name) const {
  MutexLock lock(mu_);
  auto it = ids_.find(name);
  if (it == ids_.end()) {
    std::vector<std::string> names;
    for (const auto& [n, id] : ids_) names.push_back(n);
    return absl::NotFoundError(absl::StrCat("unknown worker '", name, "' (the group has: ",
                                            absl::StrJoin(names, ", "), ")"));
  }
  return it->second;
}

const Peer* Agent::Impl::FindPeer(WorkerId id) const {
  MutexLock lock(mu_);
  return id < peers_.size() ? peers_[id].get() : nullptr;
}

void Agent::Impl::SetBook(std::vector<WorkerInfo> book) {
  std::vector<std::unique_ptr<Peer>> peers(book.size());
  for (const auto& w : book) {
    if (w.id >= book.size()) continue;
    grpc::ChannelArguments args;
    ApplyChannelArgs(args, agent_->options_.max_message_bytes);
    auto peer = std::make_unique<Peer>();
    peer->info = w;
    peer->channel = grpc::CreateCustomChannel(w.address, channel_credentials_, args);
    peer->stub = std::make_unique<grpc::GenericStub>(peer->channel);
    const ShmEndpoint& mine = shm_->endpoint();
    if (!mine.domain.empty() && w.shm.domain == mine.domain &&
        w.shm.incarnation != mine.incarnation) {
      peer->route.shm = shm_.get();
    }
    peer->route.threshold = agent_->options_.oob_threshold_bytes;
    peer->route.cuda = cuda_.get();
    peer->route.peer = w.id;
    peers[w.id] = std::move(peer);
  }
  std::vector<ShmEndpoint> endpoints;
  for (const auto& w : book) endpoints.push_back(w.shm);
  shm_->Allow(endpoints);
  for (const auto& w : book) {
    if (w.name == agent_->self_.name) cuda_->SetGroup(w, book);
  }
  if (DebugChannels()) {
    for (const auto& p : peers) {
      if (!p || p->info.name == agent_->self_.name) continue;
      std::cerr << "remora: '" << agent_->self_.name << "' -> '" << p->info.name
                << "': payloads >= " << p->route.threshold << " bytes via "
                << (p->route.shm != nullptr ? "shm" : "grpc") << "\n";
      LogCudaChannels(*p);
    }
  }
  WorkerId self_id = kUnknownWorker;
  {
    MutexLock lock(mu_);
    if (!peers_.empty()) return;  // set once
    peers_ = std::move(peers);
    for (const auto& p : peers_) {
      if (!p) continue;
      ids_[p->info.name] = p->info.id;
      if (p->info.name == agent_->self_.name) self_id = p->info.id;
    }
  }
  agent_->self_.id = self_id;
  agent_->rrefs_ = std::make_shared<RRefContext>(self_id, agent_, agent_, pool_.get());
  joined_.Notify();
}

absl::Status Agent::Impl::SendCudaControl(WorkerId peer, wire::Request request,
                                          absl::Duration timeout) {
  OutMessage m;
  request.set_from(agent_->self_.id);
  *m.header.mutable_request() = std::move(request);
  auto reply = SendTo(peer, std::move(m), timeout).wait();
  if (!reply.ok()) return reply.status();
  if (reply->header.response().has_error()) return ErrorFromReply(reply->header.response());
  return absl::OkStatus();
}

absl::StatusOr<std::string> Agent::Impl::CudaChannelTo(const Peer& p, c10::Device device) const {
  ASSIGN_OR_RETURN(c10::Device dst, devices_.Map(device, p.info));
  const CudaRoute route =
      dst.is_cuda() ? cuda_->RouteTo(p.info.id, device.index(), dst.index()) : CudaRoute::kStaged;
  if (route != CudaRoute::kStaged) return std::string(CudaRouteName(route));
  return absl::StrCat("staged:", p.route.shm != nullptr ? "shm" : "grpc");
}

void Agent::Impl::LogCudaChannels(const Peer& p) const {
  const int gpus = LocalGpuCount();
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
              << CudaChannelTo(p, src).value_or("?") << "\n";
  }
}

void Agent::Impl::CancelOutgoing() {
  {
    MutexLock lock(calls_mu_);
    stopped_ = true;
    for (ClientCall* c : calls_) {
      if (c->context) c->context->TryCancel();
    }
    for (SyncStream* s : streams_in_use_) s->Cancel();
  }
  // Idle streams go now; the callers of those in use give them back.
  std::vector<std::unique_ptr<SyncStream>> idle;
  {
    MutexLock lock(mu_);
    for (const auto& p : peers_) {
      if (p == nullptr) continue;
      MutexLock stream_lock(p->stream_mu);
      for (auto& s : p->idle_streams) idle.push_back(std::move(s));
      p->idle_streams.clear();
    }
  }
  idle.clear();
  // A reply still receiving CUDA payloads stays in calls_ until its
  // transfers end: stopping the channel ends them now.
  cuda_->Stop();
  {
    MutexLock lock(calls_mu_);
    auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) { return calls_.empty(); };
    calls_mu_.AwaitWithTimeout(absl::Condition(&none), absl::Seconds(10));
  }
}

void Agent::Impl::Stop() {
  if (agent_->rrefs_) agent_->rrefs_->Detach();
  // Peers' streams stay open until closed: the server's Shutdown would
  // wait for them. A request being handled still gets its reply first.
  std::vector<std::shared_ptr<ServerStream::State>> server_streams;
  {
    MutexLock lock(server_streams_mu_);
    server_streams_closed_ = true;
    server_streams.assign(server_streams_.begin(), server_streams_.end());
  }
  for (const auto& s : server_streams) {
    ServerStream::Close(s, grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat(
                               "worker '", agent_->self_.name, "' is shutting down")));
  }
  if (server_) {
    server_->Shutdown(DeadlineIn(absl::Seconds(2)));
  }
  CancelOutgoing();  // stops the CUDA channel too: waiting receives fail
  JoinOwnThreads();
  pool_.reset();  // runs what is queued, joins
  if (server_) server_->Wait();
  server_.reset();
}

// ---------------------------------------------------------------------------
// Agent.

Agent::Agent(AgentOptions options, const Registry* registry)
    : options_(std::move(options)), registry_(registry) {}

Agent::~Agent() {
  if (impl_) impl_->Stop();
}

absl::StatusOr<std::unique_ptr<Agent>> Agent::Start(AgentOptions options,
                                                    const Registry* registry) {
  if (!IsValidWorkerName(options.name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid name '", options.name, "': use 1 to 128 characters of [A-Za-z0-9_:-]"));
  }
  if (registry == nullptr) return absl::InvalidArgumentError("no registry given");
  if (absl::Status s = CheckTlsOptions(options.tls); !s.ok()) {
    return Annotate(s, absl::StrCat("'", options.name, "'"));
  }
  if (options.is_master) {
    std::set<std::string> seen;
    for (const auto& w : options.workers) {
      if (!IsValidWorkerName(w)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "invalid worker name '", w, "': use 1 to 128 characters of [A-Za-z0-9_:-]"));
      }
      if (w == options.name || !seen.insert(w).second) {
        return absl::InvalidArgumentError(absl::StrCat("duplicate worker name '", w, "'"));
      }
    }
    if (options.workers.size() >= kUnknownWorker) {
      return absl::InvalidArgumentError("too many workers");
    }
  }
  // gRPC's "poll" engine, unless the environment chose one: on loopback
  // round trips it measured about 3 fewer thread switches per call than the
  // default epoll1 and a 10-20% lower median latency (README, "RPC").
  // Takes effect only before gRPC's first use in this process.
  setenv("GRPC_POLL_STRATEGY", "poll", /*overwrite=*/0);
#if defined(NDEBUG) && !defined(REMORA_SANITIZE)
  // Debian's Abseil is built with absl::Mutex's deadlock detection on, and
  // gRPC locks absl::Mutex too: every lock then updates a global lock graph.
  // Off in release builds of remora (three paired rpc_bench runs: 9-37%
  // less CPU, medians 78-90 us against 99-134 us); debug and sanitizer
  // builds keep it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
  auto home = ParseDevice(options.device, absl::StrCat("the device of '", options.name, "'"));
  if (!home.ok()) return home.status();
  if (absl::Status s = CheckLocalDevice(*home); !s.ok()) {
    return Annotate(s, absl::StrCat("'", options.name, "'"));
  }
  auto devices = DeviceMapper::Create(options.name, options.device_maps,
                                      options.map_to_peer_devices, LocalGpuCount());
  if (!devices.ok()) return devices.status();
  std::unique_ptr<Agent> agent(new Agent(std::move(options), registry));
  agent->impl_ = std::make_unique<Impl>(agent.get());
  agent->impl_->devices_ = std::move(*devices);
  agent->self_.name = agent->options_.name;
  agent->self_.host_id = HostId();
  agent->self_.shm = agent->impl_->shm_->endpoint();
  agent->self_.cuda = agent->impl_->cuda_->endpoint();
  agent->self_.device = home->str();

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(agent->options_.listen_address,
                           MakeServerCredentials(agent->options_.tls), &port);
  builder.RegisterCallbackGenericService(agent->impl_.get());
  builder.SetMaxReceiveMessageSize(agent->options_.max_message_bytes);
  builder.SetMaxSendMessageSize(agent->options_.max_message_bytes);
  ApplyChannelArgs(
      [&builder](const char* name, int value) { builder.AddChannelArgument(name, value); },
      agent->options_.max_message_bytes, /*server=*/true);
  agent->impl_->server_ = builder.BuildAndStart();
  if (!agent->impl_->server_ || port == 0) {
    return absl::UnavailableError(absl::StrCat(
        "'", agent->options_.name, "' cannot listen on ", agent->options_.listen_address,
        agent->options_.tls.enabled()
            ? ": the address is invalid, the port is in use, or the TLS certificate and key "
              "are unusable (a key that does not match the certificate; gRPC's log above "
              "says which); check --listen, --tls-cert and --tls-key"
            : ": the address is invalid or the port is in use; pick another with --listen"));
  }
  agent->port_ = port;
  const std::string& listen = agent->options_.listen_address;
  agent->self_.address = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
  return agent;
}

absl::Status Agent::Join() {
  if (options_.is_master) {
    if (options_.workers.empty()) {
      WorkerInfo me = self_;
      me.id = 0;
      impl_->SetBook({me});
      return absl::OkStatus();
    }
    if (impl_->joined_.WaitForNotificationWithTimeout(options_.connect_timeout)) {
      return absl::OkStatus();
    }
    std::vector<std::string> missing;
    {
      MutexLock lock(impl_->join_mu_);
      for (const auto& w : options_.workers) {
        if (!impl_->joiners_.count(w)) missing.push_back(w);
      }
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "master '", self_.name, "' at ", self_.address, ": workers ",
        absl::StrJoin(missing, ", "), " did not register within ",
        absl::FormatDuration(options_.connect_timeout),
        "; start them with --master ", self_.address));
  }

  grpc::ChannelArguments args;
  ApplyChannelArgs(args, options_.max_message_bytes);
  auto channel =
      grpc::CreateCustomChannel(options_.master_address, impl_->channel_credentials_, args);
  grpc::GenericStub stub(channel);
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  absl::Status last;
  while (absl::Now() < deadline) {
    OutMessage m;
    auto* join = m.header.mutable_request()->mutable_join();
    m.header.mutable_request()->set_from(kUnknownWorker);
    join->set_name(self_.name);
    join->set_address(self_.address);
    join->set_host_id(self_.host_id);
    ToWire(self_.shm, join->mutable_shm());
    ToWire(self_.cuda, join->mutable_cuda());
    join->set_device(self_.device);
    auto reply = impl_->Transmit(&stub, std::move(m), deadline - absl::Now(), true).wait();
    if (reply.ok() && reply->header.response().has_error()) {
      return Annotate(impl_->ErrorFromReply(reply->header.response()),
                      absl::StrCat("the master at ", options_.master_address,
                                   " refused worker '", self_.name, "'"));
    }
    if (reply.ok()) {
      std::vector<WorkerInfo> book;
      for (const auto& e : reply->header.response().workers()) {
        book.push_back(WorkerInfo{static_cast<WorkerId>(e.id()), e.name(), e.address(),
                                  e.host_id(), FromWire(e.shm()), FromWire(e.cuda()),
                                  e.device().empty() ? "cpu" : e.device()});
      }
      bool found = false;
      for (const auto& w : book) found |= w.name == self_.name;
      if (!found) return absl::InternalError("the address book does not list this worker");
      impl_->SetBook(std::move(book));
      return absl::OkStatus();
    }
    last = reply.status();
    if (last.code() == absl::StatusCode::kUnauthenticated) {
      return Annotate(last, absl::StrCat("the master at ", options_.master_address,
                                         " refused worker '", self_.name, "'"));
    }
    if (last.code() != absl::StatusCode::kUnavailable) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  const bool reached = channel->GetState(false) == GRPC_CHANNEL_READY;
  if (!reached) {
    // Waiting for the channel hides why it never connected; one call that
    // does not wait reports the last connection error (refused, or a TLS
    // handshake that failed: "Socket closed").
    OutMessage m;
    m.header.mutable_request()->set_from(kUnknownWorker);
    m.header.mutable_request()->mutable_ping();
    auto probe = impl_->Transmit(&stub, std::move(m), absl::Seconds(1), false).wait();
    if (!probe.ok()) last = probe.status();
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "worker '", self_.name, "' could not join the group at master ",
      options_.master_address, " within ", absl::FormatDuration(options_.connect_timeout),
      reached ? ": the master is up but the group did not form (are all workers started?)"
              : absl::StrCat(": the master is unreachable (is it running? check --master or "
                             "MASTER_ADDR/MASTER_PORT; ",
                             TlsHint(options_.tls), ")"),
      last.ok() ? "" : absl::StrCat(" [", last.ToString(), "]")));
}

std::vector<WorkerInfo> Agent::workers() const {
  MutexLock lock(impl_->mu_);
  std::vector<WorkerInfo> out;
  for (const auto& p : impl_->peers_) {
    if (p) out.push_back(p->info);
  }
  return out;
}

absl::StatusOr<WorkerInfo> Agent::worker(const std::string& name) const {
  ASSIGN_OR_RETURN(WorkerId id, impl_->Resolve(name));
  return impl_->FindPeer(id)->info;
}

std::string Agent::NameOf(WorkerId id) const {
  if (const Peer* p = impl_->FindPeer(id)) return p->info.name;
  return absl::StrCat("worker#", id);
}

bool Agent::IsKnown(WorkerId id) const { return impl_->FindPeer(id) != nullptr; }

absl::StatusOr<std::string> Agent::channel_to(const std::string& name,
                                              const std::string& device) const {
  auto id = impl_->Resolve(name);
  if (!id.ok()) return id.status();
  ASSIGN_OR_RETURN(c10::Device d, ParseDevice(device, "channel_to"));
  if (d.is_cuda()) return impl_->CudaChannelTo(*impl_->FindPeer(*id), d);
  return std::string(impl_->RouteTo(*id).shm != nullptr ? "shm" : "grpc");
}

ShmChannel::Stats Agent::shm_stats() const { return impl_->shm_->stats(); }

CudaChannel::Stats Agent::cuda_stats() const { return impl_->cuda_->stats(); }

std::string Agent::cuda_disabled_reason() const { return impl_->cuda_->disabled_reason(); }

Executor* Agent::executor() const { return impl_->pool_.get(); }

bool NextPolling(grpc::CompletionQueue* cq, absl::Duration spin, void** tag, bool* ok) {
  return NextPolling(cq, spin, absl::InfiniteFuture(), tag, ok) ==
         grpc::CompletionQueue::GOT_EVENT;
}

absl::Duration Agent::sync_spin() const { return impl_->sync_spin_; }

int64_t Agent::streams_opened() const { return impl_->streams_opened_.load(); }

int64_t Agent::active_calls() const {
  return impl_->incoming_.load() + impl_->outgoing_.load();
}

Future<Empty> Agent::SendControl(WorkerId dst, wire::Request request) {
  Future<Empty> done;
  auto attempt = std::make_shared<std::function<void(int)>>();
  *attempt = [this, dst, request, done, attempt](int tries) mutable {
    OutMessage m;
    *m.header.mutable_request() = request;
    impl_->SendTo(dst, std::move(m), options_.rpc_timeout)
        .then([this, done, attempt, tries](const absl::StatusOr<InMessage>& r) mutable {
          absl::Status s = r.ok() && r->header.response().has_error()
                               ? impl_->ErrorFromReply(r->header.response())
                               : r.status();
          // Control messages are idempotent: retry transport failures.
          if (s.code() == absl::StatusCode::kUnavailable && tries < 5) {
            impl_->pool_->Schedule([attempt, tries] {
              absl::SleepFor(absl::Milliseconds(50 << tries));
              (*attempt)(tries + 1);
            });
            return;
          }
          *attempt = nullptr;  // break the self-reference
          if (s.ok()) {
            done.SetValue(Empty{});
          } else {
            done.SetError(s);
          }
        });
  };
  (*attempt)(0);
  return done;
}

absl::StatusOr<c10::IValue> Agent::rpc_sync(const std::string& to, const std::string& function,
                                            std::vector<c10::IValue> args,
                                            CallOptions options) {
  if (!impl_->joined_.HasBeenNotified()) {
    return absl::FailedPreconditionError("call Join() before making calls");
  }
  ASSIGN_OR_RETURN(WorkerId dst, impl_->Resolve(to));
  wire::CallRequest call;
  call.set_function(function);
  return impl_->Call(dst, std::move(call), std::move(args), nullptr, options, {}, true).wait();
}

Future<c10::IValue> Agent::rpc_async(const std::string& to, const std::string& function,
                                     std::vector<c10::IValue> args, CallOptions options) {
  if (!impl_->joined_.HasBeenNotified()) {
    return Future<c10::IValue>::Ready(
        absl::FailedPreconditionError("call Join() before making calls"), impl_->pool_.get());
  }
  auto dst = impl_->Resolve(to);
  if (!dst.ok()) return Future<c10::IValue>::Ready(dst.status(), impl_->pool_.get());
  wire::CallRequest call;
  call.set_function(function);
  return impl_->Call(*dst, std::move(call), std::move(args), nullptr, options, {});
}

absl::StatusOr<RRef> Agent::remote(const std::string& to, const std::string& function,
                                   std::vector<c10::IValue> args, CallOptions options) {
  if (!impl_->joined_.HasBeenNotified()) {
    return absl::FailedPreconditionError("call Join() before making calls");
  }
  ASSIGN_OR_RETURN(WorkerId dst, impl_->Resolve(to));
  auto user = rrefs_->CreateUserForRemote(dst);
  wire::CallRequest call;
  call.set_function(function);
  *call.mutable_result_rref() = ToWire(user->rref_id());
  *call.mutable_result_fork() = ToWire(user->fork_id());
  impl_->Call(dst, std::move(call), std::move(args), nullptr, options, user);
  return RRef(user);
}

RRef Agent::local_rref(c10::IValue value) { return RRef(rrefs_->CreateLocal(std::move(value))); }

Future<c10::IValue> Agent::CallOnRRef(const RRef& rref, const std::string& method,
                                      std::vector<c10::IValue> args, CallOptions options,
                                      c10::intrusive_ptr<UserRRef> result, bool blocking) {
  wire::CallRequest call;
  call.set_function(method);
  if (result) {
    *call.mutable_result_rref() = ToWire(result->rref_id());
    *call.mutable_result_fork() = ToWire(result->fork_id());
  }
  if (!rref.is_owner()) {
    auto* user = static_cast<UserRRef*>(rref.impl().get());
    *call.mutable_caller_fork() = ToWire(user->fork_id());
    call.set_seq(user->NextCallSeq());
  }
  c10::IValue self = rref.ToIValue();
  return impl_->Call(rref.owner(), std::move(call), std::move(args), &self, options, result,
                     blocking);
}

absl::StatusOr<RRef> Agent::RemoteOnRRef(const RRef& rref, const std::string& method,
                                         std::vector<c10::IValue> args, CallOptions options) {
  auto user = rrefs_->CreateUserForRemote(rref.owner());
  CallOnRRef(rref, method, std::move(args), options, user);
  return RRef(user);
}

Future<c10::IValue> Agent::Fetch(const UserRRef& rref, CallOptions options, bool blocking) {
  Future<c10::IValue> result(impl_->pool_.get());
  OutMessage m;
  m.header.mutable_request()->set_from(self_.id);
  if (CurrentContextId() != kNoContext) {
    m.header.mutable_request()->mutable_autograd()->set_context_id(CurrentContextId());
  }
  auto* fetch = m.header.mutable_request()->mutable_fetch();
  *fetch->mutable_rref_id() = ToWire(rref.rref_id());
  *fetch->mutable_fork_id() = ToWire(rref.fork_id());
  const absl::Duration timeout =
      options.timeout > absl::ZeroDuration() ? options.timeout : options_.rpc_timeout;
  const WorkerId owner = rref.owner();
  impl_->SendTo(owner, std::move(m), timeout, blocking)
      .then([this, owner, result](const absl::StatusOr<InMessage>& reply) {
        impl_->CompleteWithReply(reply, owner, result);
      });
  return result;
}

absl::Status Agent::WaitForShutdown() {
  const absl::Duration period = absl::Seconds(1);
  absl::Time last_contact = absl::Now();
  while (!impl_->finished_.WaitForNotificationWithTimeout(period)) {
    if (options_.master_timeout <= absl::ZeroDuration() || options_.is_master) continue;
    OutMessage m;
    m.header.mutable_request()->set_from(self_.id);
    m.header.mutable_request()->mutable_ping();
    auto reply = impl_->SendTo(0, std::move(m), period).wait();
    if (reply.ok()) {
      last_contact = absl::Now();
    } else if (absl::Now() - last_contact > options_.master_timeout) {
      if (impl_->finished_.HasBeenNotified()) break;
      return absl::UnavailableError(absl::StrCat(
          "worker '", self_.name, "': the master '", NameOf(0), "' has not answered for ",
          absl::FormatDuration(absl::Now() - last_contact), " (", reply.status().message(),
          "); the group is gone, stopping"));
    }
  }
  return absl::OkStatus();
}

absl::Status Agent::Shutdown(bool graceful) {
  if (!impl_->server_) return absl::OkStatus();  // already stopped
  absl::Status status;
  if (graceful && impl_->joined_.HasBeenNotified()) {
    if (!options_.is_master) {
      status = WaitForShutdown();
    } else {
      const absl::Time deadline = absl::Now() + options_.shutdown_timeout;
      std::vector<WorkerInfo> others;
      for (const auto& w : workers()) {
        if (w.id != self_.id) others.push_back(w);
      }
      bool release = true;
      int64_t last_active = 0;
      while (true) {
        if (release) rrefs_->ReleaseAllUsers();
        status = rrefs_->WaitDrained(deadline - absl::Now());
        if (!status.ok()) break;
        if (deadline - absl::Now() < absl::Milliseconds(50)) {
          status = absl::DeadlineExceededError(absl::StrCat(
              "shutdown: ", last_active, " calls still in flight after ",
              absl::FormatDuration(options_.shutdown_timeout),
              "; a worker is stuck in a call (raise shutdown_timeout if it is just slow)"));
          break;
        }
        int64_t active = active_calls();
        std::vector<Future<InMessage>> replies;
        for (const auto& w : others) {
          OutMessage m;
          m.header.mutable_request()->set_from(self_.id);
          m.header.mutable_request()->mutable_probe()->set_release_users(release);
          replies.push_back(impl_->SendTo(w.id, std::move(m), deadline - absl::Now()));
        }
        release = false;
        std::vector<std::string> failed;
        for (size_t i = 0; i < replies.size(); ++i) {
          auto r = replies[i].wait();
          if (r.ok() && r->header.response().has_error()) {
            r = impl_->ErrorFromReply(r->header.response());
          }
          if (!r.ok()) {
            failed.push_back(absl::StrCat(others[i].name, " (", r.status().message(), ")"));
            continue;
          }
          active += r->header.response().active();
        }
        if (!failed.empty()) {
          status = absl::DeadlineExceededError(absl::StrCat(
              "shutdown: no answer from ", absl::StrJoin(failed, ", ")));
          break;
        }
        if (active == 0) break;
        last_active = active;
        absl::SleepFor(absl::Milliseconds(10));
      }
      // Tell every worker the group is done, even after an error.
      std::vector<Future<InMessage>> finishes;
      for (const auto& w : others) {
        OutMessage m;
        m.header.mutable_request()->set_from(self_.id);
        m.header.mutable_request()->mutable_finish();
        finishes.push_back(impl_->SendTo(w.id, std::move(m), absl::Seconds(5)));
      }
      // Best effort: a worker that does not answer is already gone.
      for (auto& f : finishes) f.wait().IgnoreError();
    }
  }
  impl_->Stop();
  return status;
}

// ---------------------------------------------------------------------------
// RRef.

absl::StatusOr<RRef> RRef::FromIValue(const c10::IValue& value) {
  if (!value.isRRef()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected an RRef, got a ", value.tagKind()));
  }
  auto* impl = dynamic_cast<RRefImpl*>(value.toRRef().get());
  if (impl == nullptr) return absl::InvalidArgumentError("not a remora RRef");
  return RRef(c10::intrusive_ptr<RRefImpl>::unsafe_reclaim_from_nonowning(impl));
}

c10::IValue RRef::ToIValue() const {
  return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(impl_));
}

absl::StatusOr<c10::IValue> RRef::to_here(CallOptions options) const {
  return Fetch(options, /*blocking=*/true).wait();
}

Future<c10::IValue> RRef::to_here_async(CallOptions options) const {
  return Fetch(options, /*blocking=*/false);
}

Future<c10::IValue> RRef::Fetch(CallOptions options, bool blocking) const {
  if (!impl_) return Future<c10::IValue>::Ready(absl::FailedPreconditionError("empty RRef"));
  if (impl_->isOwner()) return static_cast<OwnerRRef*>(impl_.get())->value();
  auto* user = static_cast<UserRRef*>(impl_.get());
  // A creation error (remote() failed) is raised here.
  if (user->confirmed().ready()) {
    auto confirmed = user->confirmed().wait();
    if (!confirmed.ok()) return Future<c10::IValue>::Ready(confirmed.status());
  }
  Agent* agent = impl_->agent();
  if (agent == nullptr) {
    return Future<c10::IValue>::Ready(absl::FailedPreconditionError("the agent has stopped"));
  }
  return agent->Fetch(*user, options, blocking);
}

absl::StatusOr<c10::IValue> RRef::local_value() const {
  if (!impl_) return absl::FailedPreconditionError("empty RRef");
  if (!impl_->isOwner()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "local_value() is only valid on the owner ('", impl_->ownerName(),
        "'); use to_here() to fetch a copy"));
  }
  return static_cast<OwnerRRef*>(impl_.get())->value().wait();
}

absl::StatusOr<c10::IValue> RRef::rpc_sync(const std::string& method,
                                           std::vector<c10::IValue> args,
                                           CallOptions options) const {
  if (!impl_) return absl::FailedPreconditionError("empty RRef");
  Agent* agent = impl_->agent();
  if (agent == nullptr) return absl::FailedPreconditionError("the agent has stopped");
  return agent->CallOnRRef(*this, method, std::move(args), options, {}, /*blocking=*/true)
      .wait();
}

Future<c10::IValue> RRef::rpc_async(const std::string& method, std::vector<c10::IValue> args,
                                    CallOptions options) const {
  if (!impl_) return Future<c10::IValue>::Ready(absl::FailedPreconditionError("empty RRef"));
  Agent* agent = impl_->agent();
  if (agent == nullptr) {
    return Future<c10::IValue>::Ready(absl::FailedPreconditionError("the agent has stopped"));
  }
  return agent->CallOnRRef(*this, method, std::move(args), options, {});
}

absl::StatusOr<RRef> RRef::remote(const std::string& method, std::vector<c10::IValue> args,
                                  CallOptions options) const {
  if (!impl_) return absl::FailedPreconditionError("empty RRef");
  Agent* agent = impl_->agent();
  if (agent == nullptr) return absl::FailedPreconditionError("the agent has stopped");
  return agent->RemoteOnRRef(*this, method, std::move(args), options);
}

}  // namespace remora
