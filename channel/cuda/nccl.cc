// The CUDA channel's NCCL half: one communicator per direction and device
// pair, set up by the sender (NcclSetup) and joined by the receiver; a
// lane thread per communicator posts transfers in the sender's order, and a
// failure on either end aborts both (NcclAbort).
#include "channel/cuda/channel_impl.h"

namespace remora::channel {

absl::StatusOr<std::optional<wire::CudaPayload>> CudaChannel::Impl::SendNccl(base::WorkerId peer,
                                                                             const at::Tensor& payload, int src,
                                                                             int dst) {
  ASSIGN_OR_RETURN(std::shared_ptr<Comm> c, SendComm(peer, src, dst));
  DeviceGuard guard(src);
  // The lane posts the send after the work that produced the tensor; the
  // frame leaves at once (the receiver's ncclRecv needs it).
  ASSIGN_OR_RETURN(cudaEvent_t after, LibTorchEvent(src));
  base::MutexLock lock(c->mu);
  if (c->state != Comm::State::kReady) {
    if (after != nullptr) cudaEventDestroy(after);
    return c->ErrorLocked();
  }
  const uint64_t seq = c->next_seq++;
  const absl::Time deadline = absl::Now() + options_.timeout;
  c->in_flight.push_back({seq, nullptr, payload, deadline});
  c->jobs[seq] = Comm::Job{payload, after, deadline};
  wire::CudaPayload d;
  d.set_channel(wire::CudaPayload::NCCL);
  d.set_src_device(src);
  d.set_dst_device(dst);
  d.set_incarnation(self_ep_.incarnation);
  d.set_generation(c->generation);
  d.set_seq(seq);
  nccl_sends_.fetch_add(1);
  Wake();
  return std::optional<wire::CudaPayload>(std::move(d));
}

absl::StatusOr<std::shared_ptr<Comm>> CudaChannel::Impl::SendComm(base::WorkerId peer, int src, int dst) {
  const auto key = std::make_tuple(peer, src, dst);
  std::shared_ptr<Comm> c;
  std::shared_ptr<Comm> replaced;  // a failed one, destroyed (lane joined) outside mu_
  bool create = false;
  {
    base::MutexLock lock(mu_);
    if (auto b = broken_until_.find(key); b != broken_until_.end()) {
      if (absl::Now() < b->second.first) return b->second.second;
      broken_until_.erase(b);
    }
    auto& slot = send_comms_[key];
    if (slot && slot->failed) replaced = std::move(slot);
    if (!slot) {
      slot = NewComm(peer, peers_.count(peer) ? peers_[peer].name : absl::StrCat("#", peer),
                     src, dst, ++generations_[key], /*sending=*/true);
      create = true;
    }
    c = slot;
  }
  if (create) {
    absl::Status s = InitSender(*c);
    if (!s.ok()) {
      {
        base::MutexLock lock(c->mu);
        c->FailLocked(std::string(s.message()));
      }
      // Do not retry on every message: stage for a while.
      base::MutexLock lock(mu_);
      broken_until_[key] = {absl::Now() + absl::Seconds(30), s};
      return s;
    }
  }
  base::MutexLock lock(c->mu);
  RETURN_IF_ERROR(c->WaitReadyLocked(absl::Now() + options_.timeout));
  return c;
}

std::shared_ptr<Comm> CudaChannel::Impl::NewComm(base::WorkerId peer, std::string peer_name, int src, int dst,
                              uint64_t generation, bool sending) {
  auto c = std::make_shared<Comm>();
  c->peer = peer;
  c->peer_name = std::move(peer_name);
  c->src = src;
  c->dst = dst;
  c->generation = generation;
  c->sending = sending;
  c->device = sending ? src : dst;
  c->timeout = options_.timeout;
  c->on_failure = [this](const Comm& failed) { QueueAbort(failed); };
  return c;
}

absl::Status CudaChannel::Impl::StartComm(Comm& c, const ncclUniqueId& id, int rank) {
  DeviceGuard guard(c.device);
  REMORA_CUDA_TRY(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking),
                  "creating the NCCL stream");
  c.Start(id, rank);
  return absl::OkStatus();
}

absl::Status CudaChannel::Impl::InitSender(Comm& c) {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return absl::UnavailableError(absl::StrCat("ncclGetUniqueId: ", NcclText(r)));
  }
  RETURN_IF_ERROR(StartComm(c, id, /*rank=*/0));
  wire::NcclSetup setup;
  setup.set_unique_id(std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  setup.set_src_device(c.src);
  setup.set_dst_device(c.dst);
  setup.set_generation(c.generation);
  setup.set_incarnation(self_ep_.incarnation);
  absl::Status s = control_(c.peer, wire::MakeRequest(setup), options_.timeout);
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat("setting up ", c.Describe(), ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status CudaChannel::Impl::ReceiveNccl(const base::WorkerInfo& peer, const wire::CudaPayload& d, uint64_t length,
                         at::Tensor& out) {
  const absl::Time deadline = absl::Now() + options_.timeout;
  std::shared_ptr<Comm> c;
  {
    base::MutexLock lock(mu_);
    auto key = std::make_tuple(peer.id, d.src_device(), d.dst_device(), d.generation());
    auto found = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return recv_comms_.count(key) > 0; };
    mu_.AwaitWithDeadline(absl::Condition(&found), deadline);
    auto it = recv_comms_.find(key);
    if (it == recv_comms_.end()) {
      return absl::UnavailableError(absl::StrCat(
          "NCCL payload from '", peer.name, "': no communicator generation ", d.generation(),
          " (its set-up never arrived, or it was aborted)"));
    }
    c = it->second;
  }
  // The lane posts the receive once the memory LibTorch just handed out
  // is free of its earlier work, and strictly in the sender's order.
  ASSIGN_OR_RETURN(cudaEvent_t after, LibTorchEvent(d.dst_device()));
  cudaEvent_t done = nullptr;
  {
    base::MutexLock lock(c->mu);
    absl::Status s = c->WaitReadyLocked(deadline);
    if (s.ok() && (d.seq() < c->next_post || c->jobs.count(d.seq()) > 0 ||
                   c->posted.count(d.seq()) > 0)) {
      s = absl::InvalidArgumentError(absl::StrCat(c->Describe(), ": transfer ", d.seq(),
                                                  " was received already"));
    }
    if (!s.ok()) {
      if (after != nullptr) cudaEventDestroy(after);
      return s;
    }
    c->jobs[d.seq()] = Comm::Job{out, after, deadline};
    auto posted = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu) {
      return c->state == Comm::State::kFailed || c->posted.count(d.seq()) > 0;
    };
    c->mu.AwaitWithDeadline(absl::Condition(&posted), deadline);
    if (c->state == Comm::State::kFailed) return c->ErrorLocked();
    auto it = c->posted.find(d.seq());
    if (it == c->posted.end()) {
      c->FailLocked(c->next_post < d.seq()
                        ? absl::StrCat("transfer ", c->next_post, " never arrived within ",
                                       absl::FormatDuration(options_.timeout), " (", d.seq(),
                                       " did; its call was lost)")
                        : absl::StrCat("transfer ", d.seq(), " was not posted within ",
                                       absl::FormatDuration(options_.timeout)));
      QueueAbort(*c);
      return c->ErrorLocked();
    }
    done = it->second;
    c->posted.erase(it);
  }
  if (StreamOrdered(d)) {
    // LibTorch's stream waits for the transfer; a late one aborts the
    // communicator (its kernel ends), and a failure fails its group's Settle.
    Pending p{0,       d.stream_group(), done,     peer.id, 0, 0,
              nullptr, c,                deadline, absl::StrCat(c->Describe(), ": transfer ", d.seq())};
    if (LeaveToStream(d.dst_device(), p)) return absl::OkStatus();
  }
  // Wait on the host: errors and a dead sender surface here, not as a
  // kernel that never ends.
  absl::Status s = PollEvent(done, deadline, absl::StrCat(c->Describe(), ": transfer ", d.seq()),
                             [&] { return c->Failure(); });  // the lane watches NCCL's errors
  cudaEventDestroy(done);
  if (s.code() == absl::StatusCode::kDeadlineExceeded) {
    base::MutexLock lock(c->mu);
    c->FailLocked(absl::StrCat("transfer ", d.seq(), " did not complete within ",
                               absl::FormatDuration(options_.timeout),
                               " (is the sender alive?)"));
    QueueAbort(*c);
    return c->ErrorLocked();
  }
  return s;
}

absl::Status CudaChannel::Impl::OnNcclSetup(base::WorkerId from, const wire::NcclSetup& setup) {
  ASSIGN_OR_RETURN(base::WorkerInfo peer, Peer(from));
  if (self_ep_.gpus.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("NCCL set-up: this process has no CUDA channel (",
                                                 disabled_, ")"));
  }
  if (setup.incarnation() != peer.cuda.incarnation || setup.incarnation() == 0) {
    return absl::PermissionDeniedError("NCCL set-up: not from the process the group lists");
  }
  if (setup.unique_id().size() != sizeof(ncclUniqueId)) {
    return absl::InvalidArgumentError("NCCL set-up: malformed unique id");
  }
  if (setup.dst_device() < 0 || static_cast<size_t>(setup.dst_device()) >= self_ep_.gpus.size() ||
      setup.src_device() < 0 ||
      static_cast<size_t>(setup.src_device()) >= peer.cuda.gpus.size() ||
      setup.generation() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NCCL set-up from '", peer.name, "': bad devices cuda:", setup.src_device(),
        " -> cuda:", setup.dst_device(), " or generation ", setup.generation()));
  }
  auto c = NewComm(from, peer.name, setup.src_device(), setup.dst_device(), setup.generation(),
                   /*sending=*/false);
  ncclUniqueId id;
  std::memcpy(&id, setup.unique_id().data(), sizeof(id));
  // The lane forms the communicator while this reply goes back; the
  // sender's first transfer waits for it.
  RETURN_IF_ERROR(StartComm(*c, id, /*rank=*/1));
  std::vector<std::shared_ptr<Comm>> older;
  {
    base::MutexLock lock(mu_);
    // A newer generation means the sender gave up on the older ones.
    for (auto it = recv_comms_.begin(); it != recv_comms_.end();) {
      const auto& [p, s, d, g] = it->first;
      if (p == from && s == c->src && d == c->dst && g < c->generation) {
        older.push_back(it->second);
        it = recv_comms_.erase(it);
      } else {
        ++it;
      }
    }
    recv_comms_[std::make_tuple(from, c->src, c->dst, c->generation)] = c;
  }
  for (auto& o : older) {
    base::MutexLock lock(o->mu);
    o->FailLocked("the sender opened a newer communicator");
  }
  return absl::OkStatus();
}

void CudaChannel::Impl::OnNcclAbort(base::WorkerId from, const wire::NcclAbort& abort) {
  std::shared_ptr<Comm> c;
  {
    base::MutexLock lock(mu_);
    if (abort.from_receiver()) {
      auto it = send_comms_.find(std::make_tuple(from, abort.src_device(), abort.dst_device()));
      if (it != send_comms_.end() && it->second->generation == abort.generation()) c = it->second;
    } else {
      auto it = recv_comms_.find(
          std::make_tuple(from, abort.src_device(), abort.dst_device(), abort.generation()));
      if (it != recv_comms_.end()) c = it->second;
    }
  }
  if (!c) return;
  base::MutexLock lock(c->mu);
  if (c->FailLocked(absl::StrCat("the other end aborted it: ", abort.reason()))) {
    aborted_.fetch_add(1);
  }
}

void CudaChannel::Impl::QueueAbort(const Comm& c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
  aborted_.fetch_add(1);
  wire::NcclAbort a;
  a.set_src_device(c.src);
  a.set_dst_device(c.dst);
  a.set_generation(c.generation);
  a.set_reason(c.error);
  a.set_from_receiver(!c.sending);
  base::MutexLock lock(queue_mu_);
  outbox_.emplace_back(c.peer, wire::MakeRequest(a));
  wake_ = true;
}

bool CudaChannel::Impl::PollSends() {
  std::vector<std::shared_ptr<Comm>> comms;
  {
    base::MutexLock lock(mu_);
    for (auto& [k, c] : send_comms_) {
      if (!c->failed) comms.push_back(c);
    }
  }
  bool any = false;
  for (auto& c : comms) {
    base::MutexLock lock(c->mu);
    if (c->state == Comm::State::kFailed) continue;
    while (!c->in_flight.empty()) {
      Comm::InFlight& f = c->in_flight.front();
      const cudaError_t e = f.done != nullptr ? cudaEventQuery(f.done) : cudaErrorNotReady;
      if (e == cudaSuccess) {
        cudaEventDestroy(f.done);
        c->in_flight.pop_front();
        continue;
      }
      if (e != cudaErrorNotReady) {
        cudaGetLastError();
        c->FailLocked(absl::StrCat("send ", f.seq, ": ", CudaText(e)));
        QueueAbort(*c);
      } else if (absl::Now() > f.deadline) {
        c->FailLocked(absl::StrCat("the receiver did not take transfer ", f.seq, " within ",
                                   absl::FormatDuration(options_.timeout),
                                   " (its call failed, or it is gone)"));
        QueueAbort(*c);
      }
      break;
    }
    any |= !c->in_flight.empty();
  }
  return any;
}
}  // namespace remora::channel
