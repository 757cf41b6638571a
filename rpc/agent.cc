// The public Agent and RRef methods: starting an agent, calls, remote()
// and RRef operations, and what an agent reports about itself. The work is
// done by Agent::Impl (rpc/agent_impl.h, one file per concern).
#include "rpc/agent.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "proto/rref.pb.h"
#include "rpc/agent_impl.h"

namespace remora::rpc {
namespace {

// `option`, unless the environment sets `variable` to 0 for this process:
// REMORA_CUDA_CHANNEL=0 stages CUDA tensors through host memory, REMORA_SHM=0
// turns shared memory off, REMORA_STREAMS=0 sends every call as a unary
// gRPC call, REMORA_LANE=0 runs the lane's tasks on the pool's threads (as
// before the lane, for comparing).
bool OnUnlessEnvOff(bool option, const char* variable) {
  const char* env = std::getenv(variable);
  return option && !(env != nullptr && std::string(env) == "0");
}

// `option`, unless environment `variable` gives microseconds (0 or more).
absl::Duration MicrosecondsUnlessEnv(absl::Duration option, const char* variable) {
  const char* env = std::getenv(variable);
  int us = 0;
  if (env != nullptr && absl::SimpleAtoi(env, &us) && us >= 0) return absl::Microseconds(us);
  return option;
}

channel::CudaChannel::Options CudaOptions(const AgentOptions& options) {
  channel::CudaChannel::Options o;
  o.enabled = OnUnlessEnvOff(options.cuda_channel, "REMORA_CUDA_CHANNEL");
  o.timeout = options.rpc_timeout;
  absl::StatusOr<channel::StreamReceives> mode =
      channel::ParseStreamReceives(std::getenv("REMORA_CUDA_STREAM_RECEIVES"));
  if (mode.ok()) {
    o.stream_receives = *mode;
  } else {
    std::cerr << "remora: " << mode.status().message() << "; using the default\n";
  }
  return o;
}

}  // namespace

Agent::Impl::Impl(Agent* agent)
    : agent_(agent),
      sync_spin_(MicrosecondsUnlessEnv(agent->options_.sync_spin, "REMORA_SYNC_SPIN_US")),
      streams_(OnUnlessEnvOff(agent->options_.streams, "REMORA_STREAMS")),
      local_links_(OnUnlessEnvOff(agent->options_.local_links, "REMORA_LINKS")),
      prompt_here_(OnUnlessEnvOff(true, "REMORA_PROMPT")),
      busy_poll_(std::min(MicrosecondsUnlessEnv(agent->options_.busy_poll, "REMORA_BUSY_POLL_US"), kMaxBusyPoll)),
      pool_(std::make_unique<ThreadPool>(agent->options_.num_threads, busy_poll_)),
      shm_(std::make_unique<channel::ShmChannel>(channel::ShmChannel::Options{
          OnUnlessEnvOff(agent->options_.shared_memory, "REMORA_SHM"),
          agent->options_.shm_max_bytes})),
      channel_credentials_(MakeChannelCredentials(agent->options_.tls)),
      cuda_(std::make_unique<channel::CudaChannel>(
          CudaOptions(agent->options_),
          [this](base::WorkerId peer, wire::Request request, absl::Duration timeout) {
            return SendAndWait(peer, std::move(request), timeout);
          })) {}

Agent::Agent(AgentOptions options, const Registry* registry)
    : options_(std::move(options)), registry_(registry) {}

Agent::~Agent() {
  if (impl_) impl_->Stop();
}

namespace {

// The options' names and TLS files, checked.
absl::Status CheckOptions(const AgentOptions& options) {
  if (!base::IsValidWorkerName(options.name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid name '", options.name, "': use 1 to 128 characters of [A-Za-z0-9_:-]"));
  }
  if (absl::Status s = CheckTlsOptions(options.tls); !s.ok()) {
    return base::Annotate(s, absl::StrCat("'", options.name, "'"));
  }
  if (options.busy_poll < absl::ZeroDuration() || options.busy_poll > kMaxBusyPoll) {
    return absl::InvalidArgumentError(absl::StrCat("'", options.name, "': busy_poll ",
                                                   absl::FormatDuration(options.busy_poll), " is not within 0 and ",
                                                   absl::FormatDuration(kMaxBusyPoll)));
  }
  if (!options.is_master) return absl::OkStatus();
  std::set<std::string> seen;
  for (const auto& w : options.workers) {
    if (!base::IsValidWorkerName(w)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "invalid worker name '", w, "': use 1 to 128 characters of [A-Za-z0-9_:-]"));
    }
    if (w == options.name) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker name '", w, "' is the master's own name: name the workers otherwise"));
    }
    if (!seen.insert(w).second) return absl::InvalidArgumentError(absl::StrCat("duplicate worker name '", w, "'"));
  }
  if (options.workers.size() >= base::kUnknownWorker) return absl::InvalidArgumentError("too many workers");
  return absl::OkStatus();
}

// Why a server could not listen, and what to do.
absl::Status CannotListen(const AgentOptions& options) {
  return absl::UnavailableError(absl::StrCat(
      "'", options.name, "' cannot listen on ", options.listen_address,
      options.tls.enabled()
          ? ": the address is invalid, the port is in use, or gRPC cannot use the TLS certificate "
            "and key (its log above says why); check --listen, --tls-cert and --tls-key"
          : ": the address is invalid or the port is in use; pick another with --listen"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Agent>> Agent::Start(AgentOptions options,
                                                    const Registry* registry) {
  if (registry == nullptr) return absl::InvalidArgumentError("no registry given");
  RETURN_IF_ERROR(CheckOptions(options));
  // gRPC's "poll" engine, unless the environment chose one: on loopback
  // round trips it measured about 3 fewer thread switches per call than the
  // default epoll1 and a 10-20% lower median latency (docs/measurements.md, "RPC: rpc_bench").
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
  if (options.host_id.empty()) {
    const char* env = std::getenv("REMORA_HOST_ID");
    options.host_id = env != nullptr ? env : "";
  }
  if (!options.host_id.empty()) {
    if (absl::Status s = channel::CheckHostId(options.host_id); !s.ok()) {
      return base::Annotate(s, absl::StrCat("'", options.name, "' (--host-id or REMORA_HOST_ID)"));
    }
  }
  auto home = channel::ParseDevice(options.device, absl::StrCat("the device of '", options.name, "'"));
  if (!home.ok()) return home.status();
  if (absl::Status s = channel::CheckLocalDevice(*home); !s.ok()) {
    return base::Annotate(s, absl::StrCat("'", options.name, "'"));
  }
  auto devices = channel::DeviceMapper::Create(options.name, options.device_maps,
                                      options.map_to_peer_devices, channel::LocalGpuCount());
  if (!devices.ok()) return devices.status();
  std::unique_ptr<Agent> agent(new Agent(std::move(options), registry));
  agent->impl_ = std::make_unique<Impl>(agent.get());
  // The request kinds rpc/ serves, each registered by its own file.
  for (auto* register_kinds : {&RegisterRendezvousRequests, &RegisterShutdownRequests,
                               &RegisterRRefRequests, &RegisterChannelRequests}) {
    RETURN_IF_ERROR(register_kinds(agent->impl_.get()));
  }
  agent->impl_->devices_ = std::move(*devices);
  agent->self_.name = agent->options_.name;
  agent->self_.host_id = channel::HostIdentity(agent->options_.host_id);
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
  if (!agent->impl_->server_ || port == 0) return CannotListen(agent->options_);
  agent->port_ = port;
  const std::string& listen = agent->options_.listen_address;
  agent->self_.address = absl::StrCat(listen.substr(0, listen.rfind(':')), ":", port);
  agent->impl_->ListenForLinks();
  return agent;
}

absl::StatusOr<std::string> Agent::channel_to(const std::string& name,
                                              const std::string& device) const {
  auto id = impl_->Resolve(name);
  if (!id.ok()) return id.status();
  ASSIGN_OR_RETURN(c10::Device d, channel::ParseDevice(device, "channel_to"));
  const Peer& peer = *impl_->FindPeer(*id);
  return channel::DescribeRoute(peer.route, impl_->devices_, peer.info, d);
}

channel::ShmStats Agent::shm_stats() const { return impl_->shm_->stats(); }

channel::CudaStats Agent::cuda_stats() const { return impl_->cuda_->stats(); }

absl::Status Agent::settle_cuda_receives(int64_t group) {
  return impl_->cuda_->Settle(group, absl::Now() + options_.rpc_timeout);
}

void Agent::forget_cuda_receives(int64_t group) { impl_->cuda_->Forget(group); }

std::string Agent::cuda_disabled_reason() const { return impl_->cuda_->disabled_reason(); }

Executor* Agent::executor() const { return impl_->pool_.get(); }
absl::Duration Agent::busy_poll() const { return impl_->busy_poll_; }
Executor* Agent::lane() const {
  static const bool lane = OnUnlessEnvOff(true, "REMORA_LANE");
  if (!impl_->pool_) return nullptr;
  return lane ? impl_->pool_->lane() : impl_->pool_.get();
}

bool NextPolling(grpc::CompletionQueue* cq, absl::Duration spin, void** tag, bool* ok) {
  return NextPolling(cq, spin, absl::InfiniteFuture(), tag, ok) ==
         grpc::CompletionQueue::GOT_EVENT;
}

absl::Duration Agent::sync_spin() const { return impl_->sync_spin_; }

int64_t Agent::streams_opened() const { return impl_->streams_opened_.load(); }

int64_t Agent::active_calls() const {
  return impl_->incoming_.load() + impl_->outgoing_.load();
}

int64_t Agent::calls_on_links() const { return impl_->calls_on_links_.load(); }

std::map<std::string, int64_t> Agent::sent_messages() const {
  base::MutexLock lock(impl_->sent_mu_);
  return impl_->sent_;
}

Future<Empty> Agent::Impl::SendControl(base::WorkerId dst, wire::Request request) {
  Future<Empty> done;
  auto attempt = std::make_shared<std::function<void(int)>>();
  *attempt = [this, dst, request, done, attempt](int tries) mutable {
    OutMessage m;
    *m.header.mutable_request() = request;
    m.header.mutable_request()->set_from(agent_->self_.id);
    SendTo(dst, std::move(m), agent_->options_.rpc_timeout)
        .then([this, done, attempt, tries](const absl::StatusOr<InMessage>& r) mutable {
          absl::Status s = r.ok() && r->header.response().has_error()
                               ? ErrorFromReply(r->header.response())
                               : r.status();
          // Control messages are idempotent: retry transport failures.
          if (s.code() == absl::StatusCode::kUnavailable && tries < 5) {
            pool_->Schedule([attempt, tries] {
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
  ASSIGN_OR_RETURN(base::WorkerId dst, impl_->Resolve(to));
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
  ASSIGN_OR_RETURN(base::WorkerId dst, impl_->Resolve(to));
  auto user = rrefs_->CreateUserForRemote(dst);
  wire::CallRequest call;
  call.set_function(function);
  *call.mutable_result_rref() = ToWire(user->rref_id());
  *call.mutable_result_fork() = ToWire(user->fork_id());
  impl_->Call(dst, std::move(call), std::move(args), nullptr, options, user);
  return RRef(user);
}

RRef Agent::local_rref(c10::IValue value) { return RRef(rrefs_->CreateLocal(std::move(value))); }

Future<c10::IValue> Agent::Impl::CallOnRRef(const RRef& rref, const std::string& method,
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
  return Call(rref.owner(), std::move(call), std::move(args), &self, options, result, blocking);
}

absl::StatusOr<RRef> Agent::Impl::RemoteOnRRef(const RRef& rref, const std::string& method,
                                               std::vector<c10::IValue> args,
                                               CallOptions options) {
  auto user = agent_->rrefs_->CreateUserForRemote(rref.owner());
  CallOnRRef(rref, method, std::move(args), options, user);
  return RRef(user);
}

Future<c10::IValue> Agent::Impl::Fetch(const UserRRef& rref, CallOptions options, bool blocking) {
  Future<c10::IValue> result(pool_.get());
  wire::FetchRequest fetch;
  *fetch.mutable_rref_id() = ToWire(rref.rref_id());
  *fetch.mutable_fork_id() = ToWire(rref.fork_id());
  OutMessage m;
  *m.header.mutable_request() = wire::MakeRequest(fetch);
  m.header.mutable_request()->set_from(agent_->self_.id);
  if (CurrentContextId() != kNoContext) {
    m.header.mutable_request()->mutable_autograd()->set_context_id(CurrentContextId());
  }
  const absl::Duration timeout =
      options.timeout > absl::ZeroDuration() ? options.timeout : agent_->options_.rpc_timeout;
  const base::WorkerId owner = rref.owner();
  SendTo(owner, std::move(m), timeout, blocking, "to_here")
      .then([this, owner, result](const absl::StatusOr<InMessage>& reply) {
        CompleteWithReply(reply, owner, result);
      });
  return result;
}

DispatchTable& Agent::requests() { return impl_->requests_; }

RRefStats Agent::rref_stats() const { return rrefs_->stats(); }

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
  return agent->impl().Fetch(*user, options, blocking);
}

absl::Status RRef::WaitConfirmed() const {
  if (!impl_) return absl::FailedPreconditionError("empty RRef");
  if (impl_->isOwner()) return absl::OkStatus();
  return static_cast<UserRRef*>(impl_.get())->confirmed().wait().status();
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
  return agent->impl().CallOnRRef(*this, method, std::move(args), options, {}, /*blocking=*/true)
      .wait();
}

Future<c10::IValue> RRef::rpc_async(const std::string& method, std::vector<c10::IValue> args,
                                    CallOptions options) const {
  if (!impl_) return Future<c10::IValue>::Ready(absl::FailedPreconditionError("empty RRef"));
  Agent* agent = impl_->agent();
  if (agent == nullptr) {
    return Future<c10::IValue>::Ready(absl::FailedPreconditionError("the agent has stopped"));
  }
  return agent->impl().CallOnRRef(*this, method, std::move(args), options, {});
}

absl::StatusOr<RRef> RRef::remote(const std::string& method, std::vector<c10::IValue> args,
                                  CallOptions options) const {
  if (!impl_) return absl::FailedPreconditionError("empty RRef");
  Agent* agent = impl_->agent();
  if (agent == nullptr) return absl::FailedPreconditionError("the agent has stopped");
  return agent->impl().RemoteOnRRef(*this, method, std::move(args), options);
}

}  // namespace remora::rpc
