// Rendezvous and the address book: workers join the master, which answers
// every joiner with the same book once all have come; each participant then
// opens a channel to every peer and picks the route its payloads take.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_util.h"
#include "rpc/agent_impl.h"

namespace remora::rpc {

namespace {

// REMORA_DEBUG=channels logs the channel chosen for every peer.
bool DebugChannels() {
  const char* env = std::getenv("REMORA_DEBUG");
  return env != nullptr && std::string(env).find("channels") != std::string::npos;
}

void ToWire(const base::ShmEndpoint& e, wire::ShmEndpoint* w) {
  w->set_domain(e.domain);
  w->set_pid(e.pid);
  w->set_incarnation(e.incarnation);
}

base::ShmEndpoint FromWire(const wire::ShmEndpoint& w) {
  return base::ShmEndpoint{w.domain(), w.pid(), w.incarnation()};
}

void ToWire(const base::CudaEndpoint& e, wire::CudaEndpoint* w) {
  for (const auto& g : e.gpus) w->add_gpus(g);
  w->set_nccl(e.nccl);
  w->set_incarnation(e.incarnation);
}

base::CudaEndpoint FromWire(const wire::CudaEndpoint& w) {
  return base::CudaEndpoint{{w.gpus().begin(), w.gpus().end()}, w.nccl(), w.incarnation()};
}

base::WorkerInfo FromWire(const wire::WorkerEntry& e) {
  return base::WorkerInfo{static_cast<base::WorkerId>(e.id()), e.name(), e.address(), e.host_id(), FromWire(e.shm()),
                    FromWire(e.cuda()), e.device().empty() ? "cpu" : e.device()};
}

void ToWire(const base::WorkerInfo& w, wire::WorkerEntry* e) {
  e->set_id(w.id);
  e->set_name(w.name);
  e->set_address(w.address);
  e->set_host_id(w.host_id);
  ToWire(w.shm, e->mutable_shm());
  ToWire(w.cuda, e->mutable_cuda());
  e->set_device(w.device);
}

// Why the master refuses `join` at once (OK when it does not).
absl::Status CheckJoinRequest(Agent::Impl& impl, const wire::JoinRequest& join) {
  const AgentOptions& opts = impl.agent_->options();
  if (!opts.is_master) {
    return absl::FailedPreconditionError(absl::StrCat(
        "'", impl.agent_->self().name, "' is a worker, not the master; point --master at the master"));
  }
  const std::string who = absl::StrCat("'", join.name(), "' at ", join.address());
  if (!base::IsValidWorkerName(join.name())) {
    impl.NoteRefused(who, "invalid worker name");
    return absl::InvalidArgumentError(absl::StrCat(
        "invalid worker name '", join.name(),
        "': use 1 to 128 characters of [A-Za-z0-9_:-]"));
  }
  if (join.name() == opts.name ||
      std::find(opts.workers.begin(), opts.workers.end(), join.name()) == opts.workers.end()) {
    impl.NoteRefused(who, absl::StrCat("not in --workers (", absl::StrJoin(opts.workers, ","), ")"));
    return absl::NotFoundError(absl::StrCat(
        "worker '", join.name(), "' is not one of the workers this master expects (",
        absl::StrJoin(opts.workers, ","), ")"));
  }
  return absl::OkStatus();
}

// A join under a registered name: a lost worker's rejoin, or a refusal.
absl::Status HandleRegisteredName(Agent::Impl& impl, const wire::JoinRequest& join,
                                  std::map<std::string, Agent::Impl::Joiner>::iterator it,
                                  std::optional<base::WorkerInfo>* rejoined,
                                  std::vector<base::WorkerInfo>* book)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl.join_mu_) {
  // Another process than the one registered under the name (a restart
  // may reuse the address, a fixed --listen port: not the incarnation).
  const bool other_process = it != impl.joiners_.end() && (it->second.address != join.address() ||
                                                           it->second.shm.incarnation != join.shm().incarnation());
  if (impl.formed_ && other_process && impl.lost_.count(join.name()) && !impl.rejoining_.count(join.name())) {
    // A lost worker's new process (Agent::MarkLost): it takes the id.
    const Agent::Impl::Joiner& j = it->second = Agent::Impl::Joiner{
        join.address(), join.host_id(), FromWire(join.shm()), nullptr, FromWire(join.cuda()), join.device()};
    for (auto& w : impl.book_) {
      if (w.name != join.name()) continue;
      w = base::WorkerInfo{w.id, w.name, j.address, j.host_id, j.shm, j.cuda, j.device};
      *rejoined = w;
    }
    impl.rejoining_.insert(join.name());
    *book = impl.book_;
  } else if (impl.formed_ && other_process) {
    // Perhaps a lost worker's new process, come before the master found
    // the loss: it retries until then (or its connect timeout). Said
    // once per address here: a second worker given a taken name by
    // mistake shows in the master's log too.
    if (impl.told_waiting_.insert(join.address()).second) {
      std::cerr << absl::StrCat("remora: a process at ", join.address(), " asks to join as '", join.name(),
                                "', which is alive at ", it->second.address,
                                ": it waits to take the name's place once that one is lost\n");
    }
    return absl::UnavailableError(absl::StrCat(
        "worker '", join.name(), "' of the group at ", it->second.address,
        " is alive; a new process under its name is taken once the master finds that one lost"));
  } else if (it != impl.joiners_.end() && it->second.address != join.address()) {
    // Not counted as refused: the worker of that name is here (the
    // second one is told, and exits).
    if (!impl.formed_) impl.duplicates_[join.address()] = join.name();
    return absl::AlreadyExistsError(absl::StrCat(
        "duplicate worker name '", join.name(), "': already registered from ",
        it->second.address, "; give each worker its own --name"));
  }
  return absl::OkStatus();
}

// Registers `join` (the last forms the group), or answers a retried one.
absl::Status AdmitJoiner(Agent::Impl& impl, const wire::JoinRequest& join,
                         std::map<std::string, Agent::Impl::Joiner>::iterator it,
                         const std::shared_ptr<Responder>& responder,
                         std::vector<std::shared_ptr<Responder>>* to_answer,
                         std::vector<base::WorkerInfo>* book)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl.join_mu_) {
  const AgentOptions& opts = impl.agent_->options();
  if (impl.formed_) {
    if (it == impl.joiners_.end()) {
      return absl::FailedPreconditionError("the group has already formed");
    }
    to_answer->push_back(responder);  // a retried join: answer again
    *book = impl.book_;
  } else {
    impl.joiners_[join.name()] = Agent::Impl::Joiner{join.address(), join.host_id(), FromWire(join.shm()),
                                                     responder, FromWire(join.cuda()), join.device()};
    if (impl.joiners_.size() == opts.workers.size()) {
      impl.formed_ = true;
      impl.book_.push_back(impl.agent_->self());
      impl.book_.back().id = 0;
      for (size_t i = 0; i < opts.workers.size(); ++i) {
        const Agent::Impl::Joiner& j = impl.joiners_[opts.workers[i]];
        impl.book_.push_back(base::WorkerInfo{static_cast<base::WorkerId>(i + 1), opts.workers[i],
                                              j.address, j.host_id, j.shm, j.cuda, j.device});
      }
      *book = impl.book_;
      for (auto& [name, j] : impl.joiners_) {
        to_answer->push_back(std::move(j.responder));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace


absl::Status RegisterRendezvousRequests(Agent::Impl* impl) {
  RETURN_IF_ERROR(impl->requests_.Register<wire::JoinRequest>(
      [impl](Incoming<wire::JoinRequest> in, std::shared_ptr<Responder> r) {
        impl->HandleJoin(in.body, std::move(r));
      },
      /*before_join=*/true));
  RETURN_IF_ERROR(impl->requests_.Register<wire::PeerLost>(
      [impl](Incoming<wire::PeerLost> in, std::shared_ptr<Responder> r) {
        if (in.from != 0) return r->ReplyError(absl::PermissionDeniedError("only the master announces a lost worker"));
        impl->rrefs()->ForgetPeer(static_cast<base::WorkerId>(in.body.id()),
                                  absl::UnavailableError(absl::StrCat("worker '", impl->NameOf(in.body.id()),
                                                                      "' is lost (the master said so)")));
        r->Reply(OutMessage{});
      }));
  return impl->requests_.Register<wire::PeerRejoined>(
      [impl](Incoming<wire::PeerRejoined> in, std::shared_ptr<Responder> r) {
        if (in.from != 0) {
          return r->ReplyError(absl::PermissionDeniedError("only the master announces a rejoined worker"));
        }
        impl->UpdatePeer(FromWire(in.body.worker()));
        r->Reply(OutMessage{});
      });
}

void Agent::Impl::HandleJoin(const wire::JoinRequest& join,
                             std::shared_ptr<Responder> responder) {
  const absl::Status invalid = CheckJoinRequest(*this, join);
  if (!invalid.ok()) return responder->ReplyError(invalid);
  std::vector<std::shared_ptr<Responder>> to_answer;
  std::vector<base::WorkerInfo> book;
  std::optional<base::WorkerInfo> rejoined;
  {
    base::MutexLock lock(join_mu_);
    auto it = joiners_.find(join.name());
    const absl::Status taken = HandleRegisteredName(*this, join, it, &rejoined, &book);
    if (!taken.ok()) return responder->ReplyError(taken);
    if (gave_up_ && gave_up_signal_ > 0) {
      return responder->ReplyError(
          absl::CancelledError(absl::StrCat("the master was stopped by a signal (", strsignal(gave_up_signal_),
                                            ") before the group formed")),
          gave_up_signal_);
    }
    if (gave_up_) {
      return responder->ReplyError(absl::DeadlineExceededError("the master gave up forming the group"));
    }
    const absl::Status refused = AdmitJoiner(*this, join, it, responder, &to_answer, &book);
    if (!refused.ok()) return responder->ReplyError(refused);
  }
  if (book.empty()) return;  // answered when the last worker joins
  if (rejoined) {
    // Everyone learns the new address before the newcomer hears back.
    UpdatePeer(*rejoined);
    AnnounceRejoin(*rejoined, absl::Seconds(10));
    to_answer.push_back(std::move(responder));
    // One write: the master's progress lines go on meanwhile.
    std::cerr << absl::StrCat("remora: worker '", rejoined->name, "' registered again from ", rejoined->address,
                              " and took its place in the group\n");
  } else {
    SetBook(book);  // (once; a retried join finds it set)
  }
  for (auto& r : to_answer) {
    OutMessage m;
    auto* response = m.header.mutable_response();
    for (const auto& w : book) ToWire(w, response->add_workers());
    r->Reply(std::move(m));
  }
  if (rejoined) {
    base::MutexLock lock(join_mu_);
    lost_.erase(rejoined->name);
    rejoining_.erase(rejoined->name);
  }
}

void Agent::Impl::UpdatePeer(const base::WorkerInfo& info) {
  std::unique_ptr<Peer> peer = MakePeer(info);
  std::vector<base::ShmEndpoint> endpoints;
  {
    base::MutexLock lock(mu_);
    if (info.id >= peers_.size() || !peers_[info.id] || peers_[info.id]->info.name != info.name) return;
    retired_peers_.push_back(std::move(peers_[info.id]));
    peers_[info.id] = std::move(peer);
    for (const auto& p : peers_) {
      if (p && p->info.host_id == agent_->self_.host_id) endpoints.push_back(p->info.shm);
    }
  }
  shm_->Allow(endpoints);
  cuda_->UpdatePeer(info);
}

void Agent::Impl::AnnounceRejoin(const base::WorkerInfo& info, absl::Duration timeout) {
  wire::PeerRejoined body;
  ToWire(info, body.mutable_worker());
  TellMembers(body, info.id, timeout);
}

void Agent::Impl::TellMembers(const google::protobuf::Message& body, base::WorkerId except, absl::Duration timeout) {
  std::vector<Future<InMessage>> replies;
  for (const auto& w : agent_->workers()) {
    if (w.id == agent_->self_.id || w.id == except || agent_->IsLost(w.name)) continue;
    OutMessage m;
    *m.header.mutable_request() = wire::MakeRequest(body);
    m.header.mutable_request()->set_from(agent_->self_.id);
    replies.push_back(SendTo(w.id, std::move(m), timeout));
  }
  for (auto& r : replies) r.wait().IgnoreError();
}

absl::Status Agent::MarkLost(const std::string& name) {
  if (!options_.is_master) return absl::FailedPreconditionError("MarkLost: only the master tracks lost workers");
  ASSIGN_OR_RETURN(base::WorkerId id, impl_->Resolve(name));
  if (id == self_.id) return absl::InvalidArgumentError("MarkLost: the master cannot lose itself");
  {
    base::MutexLock lock(impl_->join_mu_);
    impl_->lost_.insert(name);
  }
  // Nothing here or on the other members waits on it any more.
  const absl::Status why = absl::UnavailableError(absl::StrCat("worker '", name, "' is lost"));
  rrefs_->ForgetPeer(id, why);
  wire::PeerLost lost;
  lost.set_id(id);
  impl_->TellMembers(lost, id, absl::Seconds(2));
  return absl::OkStatus();
}

absl::Status Agent::AwaitRejoin(const std::string& name, absl::Duration timeout) {
  base::MutexLock lock(impl_->join_mu_);
  if (!impl_->lost_.count(name)) return absl::OkStatus();
  auto back = [this, &name]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(impl_->join_mu_) {
    return impl_->lost_.count(name) == 0;
  };
  if (impl_->join_mu_.AwaitWithTimeout(absl::Condition(&back), timeout)) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat(
      "worker '", name, "' did not register again within ", absl::FormatDuration(timeout),
      " (restart it with --name ", name, " --master ", self_.address, ", or give the master --spares)"));
}

bool Agent::IsLost(const std::string& name) const {
  base::MutexLock lock(impl_->join_mu_);
  return impl_->lost_.count(name) > 0;
}

void Agent::Impl::NoteRefused(const std::string& who, const std::string& why) {
  base::MutexLock lock(join_mu_);
  if (!formed_) refused_[who] = why;
}

absl::Status Agent::Impl::GiveUpJoining(const absl::Status& why, bool hint) {
  const AgentOptions& opts = agent_->options_;
  std::vector<std::string> missing, refused;
  {
    base::MutexLock lock(join_mu_);
    if (formed_) return absl::OkStatus();
    for (const auto& w : opts.workers) {
      if (!joiners_.count(w)) missing.push_back(w);
    }
    for (const auto& [who, reason] : refused_) refused.push_back(absl::StrCat(who, " was refused: ", reason));
    for (const auto& [address, name] : duplicates_) {
      refused.push_back(absl::StrCat("a second '", name, "' at ", address, " was refused (a duplicate name)"));
    }
  }
  std::string text;  // (the joined workers know which master this is)
  if (!missing.empty()) {
    absl::StrAppend(&text, missing.size() == 1 ? "worker " : "workers ", absl::StrJoin(missing, ", "),
                    " did not register");
  }
  if (!refused.empty()) absl::StrAppend(&text, missing.empty() ? "" : "; ", absl::StrJoin(refused, "; "));
  absl::StrAppend(&text, " (", why.message(), ")");
  if (!missing.empty() && hint) absl::StrAppend(&text, "; start them with --master ", agent_->self_.address);
  // (Formed meanwhile: the last worker came in the last moment.)
  if (!EndJoining(absl::StrCat("the group did not form: ", text))) return absl::OkStatus();
  return absl::Status(why.code(),
                      absl::StrCat("master '", agent_->self_.name, "' at ", agent_->self_.address, ": ", text));
}

bool Agent::Impl::EndJoining(const std::string& text, int signal) {
  std::vector<std::shared_ptr<Responder>> waiting;
  {
    base::MutexLock lock(join_mu_);
    if (formed_) return false;
    gave_up_ = true;
    gave_up_signal_ = signal;
    for (auto& [name, j] : joiners_) waiting.push_back(std::move(j.responder));
    joiners_.clear();
  }
  // The workers that joined wait for the group: they exit with the reason.
  for (auto& r : waiting) {
    if (r) r->ReplyError(signal > 0 ? absl::CancelledError(text) : absl::AbortedError(text), signal);
  }
  return true;
}

absl::StatusOr<base::WorkerId> Agent::Impl::Resolve(const std::string& name) const {
  base::MutexLock lock(mu_);
  auto it = ids_.find(name);
  if (it == ids_.end()) {
    std::vector<std::string> names;
    for (const auto& [n, id] : ids_) names.push_back(n);
    return absl::NotFoundError(absl::StrCat("unknown worker '", name, "' (the group has: ",
                                            absl::StrJoin(names, ", "), ")"));
  }
  return it->second;
}

const Peer* Agent::Impl::FindPeer(base::WorkerId id) const {
  base::MutexLock lock(mu_);
  return id < peers_.size() ? peers_[id].get() : nullptr;
}

std::unique_ptr<Peer> Agent::Impl::MakePeer(const base::WorkerInfo& w) const {
  grpc::ChannelArguments args;
  ApplyChannelArgs(args, agent_->options_.max_message_bytes);
  auto peer = std::make_unique<Peer>();
  peer->info = w;
  peer->channel = grpc::CreateCustomChannel(w.address, channel_credentials_, args);
  peer->stub = std::make_unique<grpc::GenericStub>(peer->channel);
  peer->route = channel::SelectRoute(agent_->self_, w, shm_.get(), cuda_.get(), agent_->options_.oob_threshold_bytes);
  return peer;
}

void Agent::Impl::SetBook(std::vector<base::WorkerInfo> book) {
  std::vector<std::unique_ptr<Peer>> peers(book.size());
  for (const auto& w : book) {
    if (w.id < book.size()) peers[w.id] = MakePeer(w);
  }
  // Segments are mapped only from peers of this host (a process in another
  // network namespace, or with another --host-id, is another host).
  std::vector<base::ShmEndpoint> endpoints;
  for (const auto& w : book) {
    if (w.host_id == agent_->self_.host_id) endpoints.push_back(w.shm);
  }
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
  base::WorkerId self_id = base::kUnknownWorker;
  {
    base::MutexLock lock(mu_);
    if (!peers_.empty()) return;  // set once
    peers_ = std::move(peers);
    for (const auto& p : peers_) {
      if (!p) continue;
      ids_[p->info.name] = p->info.id;
      if (p->info.name == agent_->self_.name) self_id = p->info.id;
    }
  }
  agent_->self_.id = self_id;
  agent_->rrefs_ = std::make_shared<RRefContext>(self_id, agent_, this, pool_.get());
  joined_.Notify();
}

void Agent::Impl::SetDevices(base::WorkerId to, OutMessage* m, EncodeContext* ctx) const {
  const Peer* p = FindPeer(to);
  ctx->devices = &devices_;
  ctx->peer = p != nullptr ? &p->info : nullptr;
  ctx->cuda_destinations = &m->cuda_destinations;
}

channel::Route Agent::Impl::RouteTo(base::WorkerId id) const {
  const Peer* p = FindPeer(id);
  return p != nullptr ? p->route : channel::Route{};
}

namespace {

// What a worker tells the master when it asks to join.
wire::JoinRequest JoinRequestOf(const base::WorkerInfo& self) {
  wire::JoinRequest join;
  join.set_name(self.name);
  join.set_address(self.address);
  join.set_host_id(self.host_id);
  ToWire(self.shm, join.mutable_shm());
  ToWire(self.cuda, join.mutable_cuda());
  join.set_device(self.device);
  return join;
}

// The address book in the master's answer to a join.
std::vector<base::WorkerInfo> BookFrom(const wire::Response& response) {
  std::vector<base::WorkerInfo> book;
  for (const auto& e : response.workers()) book.push_back(FromWire(e));
  return book;
}

// Why worker `name` could not join by --connect-timeout (`last`: the last error).
absl::Status JoinTimedOut(Agent::Impl& impl, grpc::Channel& channel, grpc::GenericStub* stub,
                          const AgentOptions& options, const std::string& name, bool named_taken,
                          absl::Status last) {
  if (named_taken) {
    return absl::DeadlineExceededError(absl::StrCat(
        "worker '", name, "' could not join the group at master ", options.master_address, " within ",
        absl::FormatDuration(options.connect_timeout), ": a live worker of the group holds the name '",
        name, "' (give this one its own --name, or stop that one first) [", last.ToString(), "]"));
  }
  const bool reached = channel.GetState(false) == GRPC_CHANNEL_READY;
  if (!reached) {
    // Waiting for the channel hides why it never connected; one call that
    // does not wait reports the last connection error (refused, or a TLS
    // handshake that failed: "Socket closed").
    OutMessage m;
    *m.header.mutable_request() = wire::MakeRequest(wire::Ping());
    m.header.mutable_request()->set_from(base::kUnknownWorker);
    auto probe = impl.Transmit(stub, std::move(m), absl::Seconds(1), false).wait();
    if (!probe.ok()) last = probe.status();
  }
  // (A host name that does not resolve is not a TLS matter: said as such.)
  const bool unresolved = absl::StrContains(last.message(), "DNS resolution failed") ||
                          absl::StrContains(last.message(), "Domain name not found") ||
                          absl::StrContains(last.message(), "Name or service not known");
  const std::string host = options.master_address.substr(0, options.master_address.rfind(':'));
  return absl::DeadlineExceededError(absl::StrCat(
      "worker '", name, "' could not join the group at master ",
      options.master_address, " within ", absl::FormatDuration(options.connect_timeout),
      reached      ? ": the master is up but the group did not form (are all workers started?)"
      : unresolved ? absl::StrCat(": the host name '", host, "' does not resolve (check --master or MASTER_ADDR; "
                                  "an IP address needs no name service)")
                   : absl::StrCat(": the master is unreachable (is it running? check --master or "
                                  "MASTER_ADDR/MASTER_PORT; ",
                                  TlsHint(options.tls), ")"),
      last.ok() ? "" : absl::StrCat(" [", last.ToString(), "]")));
}

}  // namespace

absl::Status Agent::Join() {
  if (options_.is_master) return impl_->JoinAsMaster();
  grpc::ChannelArguments args;
  ApplyChannelArgs(args, options_.max_message_bytes);
  auto channel =
      grpc::CreateCustomChannel(options_.master_address, impl_->channel_credentials_, args);
  grpc::GenericStub stub(channel);
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  const std::string refused =
      absl::StrCat("the master at ", options_.master_address, " refused worker '", self_.name, "'");
  absl::Status last;
  bool named_taken = false;  // the last answer: the name is a live member's
  while (absl::Now() < deadline) {
    OutMessage m;
    *m.header.mutable_request() = wire::MakeRequest(JoinRequestOf(self_));
    m.header.mutable_request()->set_from(base::kUnknownWorker);
    auto reply = impl_->Transmit(&stub, std::move(m), deadline - absl::Now(), true).wait();
    if (reply.ok() && reply->header.response().has_error()) {
      const absl::Status reason = impl_->ErrorFromReply(reply->header.response());
      const int signal = reply->header.response().error().signal();
      if (signal > 0) {  // the master was stopped by a signal before the group formed
        {
          base::MutexLock lock(impl_->abort_mu_);
          impl_->abort_signal_ = signal;
        }
        return base::Annotate(reason, absl::StrCat("worker '", self_.name, "' joining the master at ",
                                             options_.master_address));
      }
      if (reason.code() == absl::StatusCode::kAborted) {  // accepted; another member kept the group from forming
        return base::Annotate(reason, absl::StrCat("worker '", self_.name, "' was accepted by the master at ",
                                             options_.master_address));
      }
      absl::Status error = base::Annotate(reason, refused);
      if (error.code() != absl::StatusCode::kUnavailable) return error;
      if (last.ok() || last.code() != absl::StatusCode::kUnavailable || last.message() != error.message()) {
        std::cerr << "remora: worker '" << self_.name << "': " << error.message()
                  << "; waiting for that until --connect-timeout (a second worker started by mistake needs "
                     "its own --name)\n";
      }
      last = error;  // not yet: the master has not found this name's member lost
      named_taken = true;
      absl::SleepFor(absl::Milliseconds(200));
      continue;
    }
    if (reply.ok()) {
      std::vector<base::WorkerInfo> book = BookFrom(reply->header.response());
      bool found = false;
      for (const auto& w : book) found |= w.name == self_.name;
      if (!found) return absl::InternalError("the address book does not list this worker");
      impl_->SetBook(std::move(book));
      return absl::OkStatus();
    }
    last = reply.status();
    named_taken = false;
    if (last.code() == absl::StatusCode::kUnauthenticated) return base::Annotate(last, refused);
    if (last.code() != absl::StatusCode::kUnavailable) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  return JoinTimedOut(*impl_, *channel, &stub, options_, self_.name, named_taken, std::move(last));
}

absl::Status Agent::Impl::JoinAsMaster() {
  const AgentOptions& options = agent_->options_;
  if (options.workers.empty()) {
    base::WorkerInfo me = agent_->self_;
    me.id = 0;
    SetBook({me});
    return absl::OkStatus();
  }
  // Until the group forms, or every expected worker has joined or been
  // refused (nothing more will come), or the timeout; every 10 s (a
  // quarter of a shorter timeout, at least 1 s) a line says who is still
  // awaited.
  bool settled = false, formed = false;
  absl::Status stopped;
  {
    base::MutexLock lock(join_mu_);
    const absl::Time start = absl::Now(), deadline = start + options.connect_timeout;
    const absl::Duration every =
        std::min(absl::Seconds(10), std::max(absl::Seconds(1), options.connect_timeout / 4));
    const absl::Condition over(
        +[](Impl* i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(i->join_mu_) {
          return i->formed_ || !i->stop_joining_.ok() ||
                 i->joiners_.size() + i->refused_.size() >= i->agent_->options_.workers.size();
        },
        this);
    while (!(settled = join_mu_.AwaitWithTimeout(over, std::min(every, deadline - absl::Now()))) &&
           absl::Now() < deadline) {
      std::vector<std::string> missing;
      for (const auto& w : options.workers) {
        if (!joiners_.count(w) && !refused_.count(w)) missing.push_back(w);
      }
      std::cerr << "remora: master: waiting for " << absl::StrJoin(missing, ", ") << " (" << joiners_.size()
                << " of " << options.workers.size() << " registered; "
                << absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Seconds(1)))
                << " of --connect-timeout " << absl::FormatDuration(options.connect_timeout) << ")" << std::endl;
    }
    formed = formed_;
    stopped = stop_joining_;
  }
  if (formed) {
    joined_.WaitForNotification();  // the book is being set
    return absl::OkStatus();
  }
  absl::Status given_up = GiveUpJoining(
      !stopped.ok() ? stopped
      : settled     ? absl::FailedPreconditionError("every expected worker has either joined or been refused")
                    : absl::DeadlineExceededError(absl::StrCat("waited --connect-timeout ",
                                                               absl::FormatDuration(options.connect_timeout))),
      /*hint=*/stopped.ok());
  if (given_up.ok()) {  // formed just now
    joined_.WaitForNotification();
    return absl::OkStatus();
  }
  return given_up;
}

void Agent::StopJoining(const absl::Status& why) {
  base::MutexLock lock(impl_->join_mu_);
  if (!why.ok() && !impl_->formed_ && impl_->stop_joining_.ok()) impl_->stop_joining_ = why;
}

std::vector<base::WorkerInfo> Agent::workers() const {
  base::MutexLock lock(impl_->mu_);
  std::vector<base::WorkerInfo> out;
  for (const auto& p : impl_->peers_) {
    if (p) out.push_back(p->info);
  }
  return out;
}

absl::StatusOr<base::WorkerInfo> Agent::worker(const std::string& name) const {
  ASSIGN_OR_RETURN(base::WorkerId id, impl_->Resolve(name));
  return impl_->FindPeer(id)->info;
}

std::string Agent::NameOf(base::WorkerId id) const {
  if (const Peer* p = impl_->FindPeer(id)) return p->info.name;
  return absl::StrCat("worker#", id);
}

bool Agent::IsKnown(base::WorkerId id) const { return impl_->FindPeer(id) != nullptr; }

}  // namespace remora::rpc
