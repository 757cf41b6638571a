// The CUDA channel (see channel/cuda/cuda_channel.h): the facade and the
// parts of CudaChannel::Impl that IPC and NCCL share (channel_impl.h lists
// the files). Compiled only with REMORA_WITH_CUDA; REMORA_TORCH_CUDA adds
// LibTorch's CUDA stream API.
#include "channel/cuda/cuda_channel.h"

#include <iostream>

#include "channel/cuda/channel_impl.h"

namespace remora::channel {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes, "CUDA IPC handle size");
static_assert(sizeof(cudaIpcEventHandle_t) == kCudaIpcHandleBytes, "CUDA IPC handle size");

CudaChannel::Impl::Impl(Options options, Control control) : options_(options), control_(std::move(control)) {
  self_ep_.incarnation = base::RandomIncarnation();
  Probe();
  if (!self_ep_.gpus.empty()) background_ = std::thread([this] { Background(); });
}

CudaChannel::Impl::~Impl() {
  Stop();
  // Destroyed outside mu_: a Comm's destructor takes its own lock first.
  decltype(send_comms_) send_comms;
  decltype(recv_comms_) recv_comms;
  {
    base::MutexLock lock(mu_);
    send_comms.swap(send_comms_);
    recv_comms.swap(recv_comms_);
  }
  send_comms.clear();  // aborts
  recv_comms.clear();
  std::deque<Pending> pending;
  {
    base::MutexLock lock(pending_mu_);
    pending.swap(pending_);
  }
  for (Pending& p : pending) {
    // A copy still queued keeps reading the sender's mapping: left open.
    if (cudaEventQuery(p.done) != cudaSuccess && p.mem != nullptr) new std::shared_ptr<Opened>(p.mem);
    cudaEventDestroy(p.done);  // freed once complete
  }
  pending.clear();
  base::MutexLock lock(mu_);
  held_.clear();
  opened_.clear();
  for (auto& [key, event] : opened_events_) cudaEventDestroy(event);
  opened_events_.clear();
  for (auto& e : events_) cudaEventDestroy(e->event);
  events_.clear();
  for (auto& [device, stream] : copy_streams_) ReleaseStream(stream);
  copy_streams_.clear();
}

void CudaChannel::Impl::Stop() {
  {
    base::MutexLock lock(queue_mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  if (background_.joinable()) background_.join();
  std::vector<std::shared_ptr<Comm>> comms;
  {
    base::MutexLock lock(mu_);
    for (auto& [k, c] : send_comms_) comms.push_back(c);
    for (auto& [k, c] : recv_comms_) comms.push_back(c);
  }
  for (auto& c : comms) {
    base::MutexLock lock(c->mu);
    c->FailLocked("the agent is shutting down");
  }
}

void CudaChannel::Impl::SetGroup(const base::WorkerInfo& self, const std::vector<base::WorkerInfo>& book) {
  {
    base::MutexLock lock(mu_);
    self_ = self;
    self_.cuda = self_ep_;
    peers_.clear();
    for (const auto& w : book) {
      if (w.name != self.name) peers_[w.id] = w;
    }
  }
  if (!group_set_.HasBeenNotified()) group_set_.Notify();
}

void CudaChannel::Impl::UpdatePeer(const base::WorkerInfo& peer) {
  std::vector<std::shared_ptr<Comm>> stale;  // failed outside mu_ (a Comm's mu comes first)
  {
    base::MutexLock lock(mu_);
    if (peer.name == self_.name) return;
    peers_[peer.id] = peer;
    warned_.erase(peer.id);
    // Drops the peer's entries of a map keyed by (peer, ...), each value
    // passed to `take` first.
    auto forget = [&peer](auto& by_key, auto take) {
      for (auto it = by_key.begin(); it != by_key.end();) {
        if (std::get<0>(it->first) != peer.id) {
          ++it;
          continue;
        }
        take(it->second);
        it = by_key.erase(it);
      }
    };
    auto keep = [&stale](std::shared_ptr<Comm>& c) { stale.push_back(std::move(c)); };
    forget(send_comms_, keep);
    forget(recv_comms_, keep);
    forget(broken_until_, [](const auto&) {});
    for (auto& [id, held] : held_) {
      if (held.peer == peer.id) held.orphaned = true;  // the old process will never release it
    }
  }
  for (auto& c : stale) {
    base::MutexLock lock(c->mu);
    c->FailLocked(absl::StrCat("worker '", peer.name, "' was replaced by a new process"));
  }
}

absl::StatusOr<base::WorkerInfo> CudaChannel::Impl::Peer(base::WorkerId id) {
  if (!group_set_.WaitForNotificationWithTimeout(options_.timeout)) {
    return absl::UnavailableError("the CUDA channel has no group yet (rendezvous not done)");
  }
  base::MutexLock lock(mu_);
  auto it = peers_.find(id);
  if (it == peers_.end()) {
    return absl::PermissionDeniedError(absl::StrCat("CUDA payload from unknown worker #", id));
  }
  return it->second;
}

CudaRoute CudaChannel::Impl::RouteTo(base::WorkerId peer, int src, int dst) {
  base::MutexLock lock(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return CudaRoute::kStaged;
  return ChooseCudaRoute(self_, src, it->second, dst);
}

std::optional<wire::CudaPayload> CudaChannel::Impl::Send(base::WorkerId peer, const at::Tensor& payload, int dst) {
  if (!payload.is_cuda() || payload.nbytes() == 0 || !payload.is_contiguous() || stopping()) {
    return std::nullopt;
  }
  const int src = payload.device().index();
  absl::StatusOr<std::optional<wire::CudaPayload>> d;
  switch (RouteTo(peer, src, dst)) {
    case CudaRoute::kIpc:
      d = SendIpc(peer, payload, src, dst);
      break;
    case CudaRoute::kNccl:
      d = SendNccl(peer, payload, src, dst);
      break;
    case CudaRoute::kStaged:
      return std::nullopt;
  }
  if (!d.ok()) {
    Warn(peer, d.status());
    return std::nullopt;
  }
  return *d;
}

void CudaChannel::Impl::Reclaim(base::WorkerId peer, const wire::CudaPayload& d) {
  if (d.channel() == wire::CudaPayload::CUDA_IPC) {
    base::MutexLock lock(mu_);
    if (auto it = held_.find(d.buffer()); it != held_.end()) it->second.orphaned = true;
    return;
  }
  // NCCL: the receiver may never post this receive; give it a short grace.
  std::shared_ptr<Comm> c;
  {
    base::MutexLock lock(mu_);
    auto it = send_comms_.find(std::make_tuple(peer, d.src_device(), d.dst_device()));
    if (it == send_comms_.end() || it->second->generation != d.generation()) return;
    c = it->second;
  }
  base::MutexLock lock(c->mu);
  const absl::Time soon = absl::Now() + std::min(options_.timeout, absl::Seconds(5));
  for (auto& f : c->in_flight) {
    if (f.seq == d.seq()) f.deadline = std::min(f.deadline, soon);
  }
}

void CudaChannel::Impl::Abandon(base::WorkerId peer, const wire::CudaPayload& d, const std::string& why) {
  if (d.channel() == wire::CudaPayload::CUDA_IPC) {
    QueueRelease(peer, d.incarnation(), d.buffer());
    return;
  }
  std::shared_ptr<Comm> c;
  {
    base::MutexLock lock(mu_);
    auto it = recv_comms_.find(
        std::make_tuple(peer, d.src_device(), d.dst_device(), d.generation()));
    if (it == recv_comms_.end()) return;
    c = it->second;
  }
  base::MutexLock lock(c->mu);
  if (d.seq() < c->next_post || c->posted.count(d.seq()) > 0) return;  // on its way
  if (c->FailLocked(absl::StrCat("transfer ", d.seq(), " cannot be received (", why, ")"))) {
    QueueAbort(*c);
  }
}

absl::StatusOr<at::Tensor> CudaChannel::Impl::Receive(base::WorkerId from, const wire::CudaPayload& d,
                                                      uint64_t length) {
  ASSIGN_OR_RETURN(base::WorkerInfo peer, Peer(from));
  if (stopping()) return absl::CancelledError("the agent is shutting down");
  RETURN_IF_ERROR(ValidateCudaPayload(d, length, peer, self_ep_));
  const int dst = d.dst_device();
  DeviceGuard guard(dst);
  at::Tensor out;
  try {
    out = at::empty({static_cast<int64_t>(length)},
                    at::TensorOptions().dtype(at::kByte).device(
                        c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dst))));
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "allocating ", length, " bytes on cuda:", dst, " for a payload from '", peer.name,
        "': ", e.what()));
  }
  if (d.channel() == wire::CudaPayload::CUDA_IPC) {
    RETURN_IF_ERROR(ReceiveIpc(peer, d, length, out));
    ipc_receives_.fetch_add(1);
  } else {
    RETURN_IF_ERROR(ReceiveNccl(peer, d, length, out));
    nccl_receives_.fetch_add(1);
  }
  return out;
}

bool CudaChannel::Impl::StreamOrdered(const wire::CudaPayload& d) const {
#ifdef REMORA_TORCH_CUDA
  const CudaRoute route = d.channel() == wire::CudaPayload::CUDA_IPC ? CudaRoute::kIpc : CudaRoute::kNccl;
  return LeaveReceiveToStream(options_.stream_receives, route, d.stream_group());
#else
  (void)d;
  return false;  // no LibTorch stream to hand the wait to
#endif
}

bool CudaChannel::Impl::LeaveToStream(int device, Pending& p) {
#ifdef REMORA_TORCH_CUDA
  cudaStream_t consumer =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  if (cudaStreamWaitEvent(consumer, p.done, 0) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  stream_ordered_.fetch_add(1);
  {
    base::MutexLock lock(pending_mu_);
    p.seq = next_pending_++;
    pending_.push_back(std::move(p));
  }
  Wake();  // polled every 2 ms from now on
  return true;
#else
  (void)device, (void)p;
  return false;
#endif
}

bool CudaChannel::Impl::PollReceives() {
  // Destroyed last, outside poll_mu_: the last reference to a Comm joins
  // its lane.
  std::vector<Pending> now;
  bool left = false;
  {
    base::MutexLock poll(poll_mu_);
    {
      base::MutexLock lock(pending_mu_);
      now.assign(pending_.begin(), pending_.end());
    }
    if (now.empty()) return false;
    // An aborted communicator's kernels end without the bytes.
    auto comm_failure = [](const std::shared_ptr<Comm>& comm) {
      return comm == nullptr ? absl::OkStatus() : comm->Failure();
    };
    std::set<uint64_t> completed, late;
    std::vector<std::pair<int64_t, absl::Status>> failed;  // by group
    const absl::Time t = absl::Now();
    for (Pending& p : now) {
      const cudaError_t e = cudaEventQuery(p.done);
      absl::Status s;
      if (e == cudaSuccess) {
        completed.insert(p.seq);
        s = comm_failure(p.comm);
        if (s.ok() && p.buffer != 0) QueueRelease(p.peer, p.incarnation, p.buffer);
      } else if (e != cudaErrorNotReady) {
        completed.insert(p.seq);  // the copy will not run
        s = CudaFailure(p.what, e);
        if (p.buffer != 0) QueueRelease(p.peer, p.incarnation, p.buffer);
      } else if (p.late) {
        continue;  // reported already; watched until it completes
      } else {
        s = comm_failure(p.comm);
        if (s.ok() && t > p.deadline) {
          s = absl::DeadlineExceededError(absl::StrCat(
              p.what, ": the copy did not complete within ", absl::FormatDuration(options_.timeout),
              " (is the sender alive?)"));
          if (p.comm != nullptr) {
            base::MutexLock lock(p.comm->mu);  // aborting it ends the transfer's kernel
            if (p.comm->FailLocked(std::string(s.message()))) QueueAbort(*p.comm);
          }
        }
        if (!s.ok()) late.insert(p.seq);  // reported now; watched until it completes
      }
      if (!s.ok() && !p.late) failed.emplace_back(p.group, std::move(s));
    }
    base::MutexLock lock(pending_mu_);
    for (auto& [group, s] : failed) {
      auto& slot = failures_[group];
      if (slot.first.ok()) slot = {std::move(s), t};
    }
    // Failures of groups nobody forgot.
    for (auto it = failures_.begin(); it != failures_.end();) {
      it = t - it->second.second > 10 * options_.timeout ? failures_.erase(it) : std::next(it);
    }
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (completed.count(it->seq) > 0) {
        cudaEventDestroy(it->done);
        it = pending_.erase(it);
        continue;
      }
      if (late.count(it->seq) > 0) it->late = true;
      ++it;
    }
    left = !pending_.empty();
  }
  return left;
}

// A CUDA IPC copy that never completed blocks every later kernel of the
// stream that waits for it.
absl::Status CudaChannel::Impl::StuckLocked() const {
  for (const Pending& p : pending_) {
    if (p.late && p.comm == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          p.what, " never completed, and this process's GPU work waits behind it: restart this worker"));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaChannel::Impl::Stuck() {
  base::MutexLock lock(pending_mu_);
  return StuckLocked();
}

absl::Status CudaChannel::Impl::Settle(int64_t group, absl::Time deadline) {
  uint64_t mark;
  // The group's failure, kept until Forget(group): every Settle of it fails.
  auto failure = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(pending_mu_) {
    auto it = failures_.find(group);
    return it == failures_.end() ? absl::OkStatus() : it->second.first;
  };
  {
    base::MutexLock lock(pending_mu_);
    mark = next_pending_;
    if (pending_.empty() || !failure().ok()) return failure();
  }
  absl::Duration pause = absl::Microseconds(10);
  while (true) {
    PollReceives();
    {
      base::MutexLock lock(pending_mu_);
      RETURN_IF_ERROR(failure());
      RETURN_IF_ERROR(StuckLocked());
      auto first = std::find_if(pending_.begin(), pending_.end(), [&](const Pending& p) {
        return p.group == group && p.seq < mark && !p.late;
      });
      if (first == pending_.end()) return absl::OkStatus();
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(first->what, ": the copy is still not done (is the sender alive?)"));
      }
    }
    absl::SleepFor(pause);
    pause = std::min(pause * 2, absl::Milliseconds(1));
  }
}

void CudaChannel::Impl::Forget(int64_t group) {
  base::MutexLock lock(pending_mu_);
  failures_.erase(group);
}

CudaChannel::Stats CudaChannel::Impl::stats() {
  Stats s;
  s.ipc_sends = ipc_sends_.load();
  s.ipc_receives = ipc_receives_.load();
  s.nccl_sends = nccl_sends_.load();
  s.nccl_receives = nccl_receives_.load();
  s.aborted = aborted_.load();
  s.stream_ordered = stream_ordered_.load();
  base::MutexLock lock(mu_);
  s.held_buffers = static_cast<int64_t>(held_.size());
  s.opened_handles = static_cast<int64_t>(opened_.size());
  for (const auto& [k, c] : send_comms_) s.communicators += !c->failed;
  for (const auto& [k, c] : recv_comms_) s.communicators += !c->failed;
  return s;
}

void CudaChannel::Impl::Probe() {
  if (!options_.enabled) {
    disabled_ = "turned off (AgentOptions::cuda_channel)";
    return;
  }
  if (!at::hasCUDA()) {
    disabled_ = "LibTorch has no CUDA here (a CPU-only build, or no driver)";
    return;
  }
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
    cudaGetLastError();
    disabled_ = absl::StrCat("cudaGetDeviceCount: ", CudaText(e));
    return;
  }
  if (n == 0) {
    disabled_ = "no GPU visible";
    return;
  }
  std::vector<std::string> gpus;
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop;
    if (cudaError_t e = cudaGetDeviceProperties(&prop, i); e != cudaSuccess) {
      cudaGetLastError();
      disabled_ = absl::StrCat("cudaGetDeviceProperties(", i, "): ", CudaText(e));
      return;
    }
    gpus.push_back(UuidText(prop.uuid));
  }
  int version = 0;
  self_ep_.nccl = ncclGetVersion(&version) == ncclSuccess;
  self_ep_.gpus = std::move(gpus);
}

void CudaChannel::Impl::Warn(base::WorkerId peer, const absl::Status& why) {
  std::string name, self;
  {
    base::MutexLock lock(mu_);
    if (!warned_.insert(peer).second) return;
    name = peers_.count(peer) ? peers_[peer].name : absl::StrCat("#", peer);
    self = self_.name;
  }
  std::cerr << absl::StrCat("remora: '", self, "' -> '", name, "': ", why.message(),
                            "; CUDA tensors to it go through host memory for now\n");  // one write
}

void CudaChannel::Impl::Wake() {
  base::MutexLock lock(queue_mu_);
  wake_ = true;
}

void CudaChannel::Impl::Background() {
  while (true) {
    decltype(releases_) releases;
    std::vector<std::pair<base::WorkerId, wire::Request>> outbox;
    {
      base::MutexLock lock(queue_mu_);
      auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu_) {
        return wake_ || stopping_;
      };
      queue_mu_.AwaitWithTimeout(absl::Condition(&woken),
                                 in_flight_ ? absl::Milliseconds(2) : absl::Milliseconds(200));
      if (stopping_) return;
      wake_ = false;
      releases.swap(releases_);
      outbox.swap(outbox_);
    }
    for (auto& [to, buffers] : releases) {
      const auto& [peer, incarnation] = to;
      base::MutexLock lock(mu_);
      auto it = peers_.find(peer);
      // Buffer numbers are per process: none of the peer's next one's.
      if (it == peers_.end() || it->second.cuda.incarnation != incarnation) continue;
      wire::CudaRelease release;
      release.mutable_buffers()->Add(buffers.begin(), buffers.end());
      release.set_incarnation(incarnation);
      outbox.emplace_back(peer, wire::MakeRequest(release));
    }
    for (auto& [peer, request] : outbox) {
      control_(peer, std::move(request), absl::Seconds(10)).IgnoreError();
    }
    bool in_flight = PollSends();
    if (PollReceives()) in_flight = true;
    ReclaimStale();
    base::MutexLock lock(queue_mu_);
    in_flight_ = in_flight;
  }
}

// ---------------------------------------------------------------------------

CudaChannel::CudaChannel(Options options, Control control)
    : impl_(std::make_unique<Impl>(options, std::move(control))) {}
CudaChannel::~CudaChannel() = default;

const base::CudaEndpoint& CudaChannel::endpoint() const { return impl_->endpoint(); }
const std::string& CudaChannel::disabled_reason() const { return impl_->disabled_reason(); }

void CudaChannel::SetGroup(const base::WorkerInfo& self, const std::vector<base::WorkerInfo>& book) {
  impl_->SetGroup(self, book);
}

void CudaChannel::UpdatePeer(const base::WorkerInfo& peer) { impl_->UpdatePeer(peer); }

CudaRoute CudaChannel::RouteTo(base::WorkerId peer, int src, int dst) const {
  return impl_->RouteTo(peer, src, dst);
}

std::optional<wire::CudaPayload> CudaChannel::Send(base::WorkerId peer, const at::Tensor& payload,
                                                   int dst) {
  return impl_->Send(peer, payload, dst);
}

void CudaChannel::Reclaim(base::WorkerId peer, const wire::CudaPayload& d) { impl_->Reclaim(peer, d); }

void CudaChannel::Abandon(base::WorkerId peer, const wire::CudaPayload& d, const std::string& why) {
  impl_->Abandon(peer, d, why);
}

void CudaChannel::Stop() { impl_->Stop(); }

absl::StatusOr<at::Tensor> CudaChannel::Receive(base::WorkerId peer, const wire::CudaPayload& d,
                                                uint64_t length) {
  return impl_->Receive(peer, d, length);
}

absl::Status CudaChannel::OnNcclSetup(base::WorkerId from, const wire::NcclSetup& setup) {
  return impl_->OnNcclSetup(from, setup);
}

void CudaChannel::OnNcclAbort(base::WorkerId from, const wire::NcclAbort& abort) {
  impl_->OnNcclAbort(from, abort);
}

void CudaChannel::OnRelease(base::WorkerId from, const wire::CudaRelease& release) {
  impl_->OnRelease(from, release);
}

CudaChannel::Stats CudaChannel::stats() const { return impl_->stats(); }

absl::Status CudaChannel::Settle(int64_t group, absl::Time deadline) { return impl_->Settle(group, deadline); }
void CudaChannel::Forget(int64_t group) { impl_->Forget(group); }
absl::Status CudaChannel::Stuck() { return impl_->Stuck(); }

absl::StatusOr<double> MeasureDeviceCopyGbps(int device, size_t bytes, int reps) {
  if (LocalGpuCount() <= device || device < 0) {
    return absl::FailedPreconditionError(absl::StrCat("no GPU cuda:", device, " here"));
  }
  DeviceGuard guard(device);
  void* a = nullptr;
  void* b = nullptr;
  REMORA_CUDA_TRY(cudaMalloc(&a, bytes), "cudaMalloc");
  if (cudaError_t e = cudaMalloc(&b, bytes); e != cudaSuccess) {
    cudaFree(a);
    return CudaFailure("cudaMalloc", e);
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  double best_ms = 1e30;
  cudaError_t e = cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);  // warm-up
  for (int i = 0; i < reps && e == cudaSuccess; ++i) {
    cudaEventRecord(start, nullptr);
    e = cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, nullptr);
    cudaEventRecord(stop, nullptr);
    if (e == cudaSuccess) e = cudaEventSynchronize(stop);
    float ms = 0;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, start, stop);
    if (e == cudaSuccess && ms > 0) best_ms = std::min(best_ms, static_cast<double>(ms));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(a);
  cudaFree(b);
  if (e != cudaSuccess) return CudaFailure("measuring cudaMemcpy", e);
  return static_cast<double>(bytes) / (best_ms / 1e3) / 1e9;
}

}  // namespace remora::channel
