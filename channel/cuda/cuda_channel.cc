// The CUDA channel (see rpc/cuda_channel.h). Compiled only with
// REMORA_WITH_CUDA; REMORA_TORCH_CUDA adds LibTorch's CUDA stream API.
#include "channel/cuda/cuda_channel.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <iostream>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#ifdef REMORA_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "proto/request.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "remora's CUDA channel needs NCCL >= 2.14 (non-blocking communicators)"
#endif

namespace remora {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes, "CUDA IPC handle size");
static_assert(sizeof(cudaIpcEventHandle_t) == kCudaIpcHandleBytes, "CUDA IPC handle size");

namespace {

std::string CudaText(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// `what` failed with `e`; clears the runtime's (non-sticky) last error.
absl::Status CudaFailure(const std::string& what, cudaError_t e) {
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", CudaText(e)));
}

#define REMORA_CUDA_TRY(expr, what)                   \
  do {                                                \
    const cudaError_t remora_e_ = (expr);             \
    if (remora_e_ != cudaSuccess) {                   \
      return CudaFailure((what), remora_e_);          \
    }                                                 \
  } while (0)

std::string NcclText(ncclResult_t r) {
  return absl::StrCat(ncclGetErrorString(r), " (NCCL ", static_cast<int>(r),
                      "; NCCL_DEBUG=INFO says more)");
}

// Makes `device` current on this thread for its lifetime, then restores
// the previous one (LibTorch keeps its own idea of the current device).
// Setting it also makes its primary context current, which the driver
// calls below need.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    changed_ = cudaSetDevice(device) == cudaSuccess && previous_ != device;
    cudaFree(nullptr);  // CUDA < 12: cudaSetDevice alone creates no context
  }
  ~DeviceGuard() {
    if (changed_ && previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

// cuMemGetAddressRange from the driver, found at run time: an IPC handle
// covers a whole allocation, and LibTorch's caching allocator hands out
// pieces of larger ones. (Linking libcuda would make every program fail to
// start on machines without a driver.)
using AddressRangeFn = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

AddressRangeFn AddressRange() {
  static const AddressRangeFn fn = []() -> AddressRangeFn {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) return nullptr;
    return reinterpret_cast<AddressRangeFn>(dlsym(lib, "cuMemGetAddressRange_v2"));
  }();
  return fn;
}

std::string UuidText(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat(
      "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
      b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

uint64_t RandomIncarnation() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{rd()} << 32) ^ rd();
  return v;
}

// An event on LibTorch's current stream of `device` (current on this
// thread): the work that produced a tensor being sent, or that last used the
// memory of a tensor just allocated. Without LibTorch's CUDA API, waits for
// the whole device on the host instead and returns null.
absl::StatusOr<cudaEvent_t> LibTorchEvent(int device) {
#ifdef REMORA_TORCH_CUDA
  cudaStream_t current =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  cudaEvent_t event = nullptr;
  REMORA_CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "creating an event");
  if (cudaError_t e = cudaEventRecord(event, current); e != cudaSuccess) {
    cudaEventDestroy(event);
    return CudaFailure("recording an event on LibTorch's stream", e);
  }
  return event;
#else
  REMORA_CUDA_TRY(cudaDeviceSynchronize(),
                  absl::StrCat("synchronising cuda:", device, " before a transfer"));
  return static_cast<cudaEvent_t>(nullptr);
#endif
}

// Makes `stream` wait for the work LibTorch queued on `device` so far (the
// producer of a tensor being sent, or whatever last used memory LibTorch
// just handed out). Call with `device` current.
absl::Status AfterLibTorch(int device, cudaStream_t stream) {
  ASSIGN_OR_RETURN(cudaEvent_t event, LibTorchEvent(device));
  if (event == nullptr) return absl::OkStatus();  // waited for on the host
  const cudaError_t e = cudaStreamWaitEvent(stream, event, 0);
  cudaEventDestroy(event);  // freed once it completes
  REMORA_CUDA_TRY(e, "ordering after LibTorch's stream");
  return absl::OkStatus();
}

// Waits on the host until `event` completed, `deadline` passes, or `check`
// (called between polls) reports an error.
absl::Status PollEvent(cudaEvent_t event, absl::Time deadline, const std::string& what,
                       const std::function<absl::Status()>& check = nullptr) {
  absl::Duration pause = absl::Microseconds(10);
  while (true) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return CudaFailure(what, e);
    if (check) {
      absl::Status s = check();
      if (!s.ok()) return s;
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": not done in time"));
    }
    absl::SleepFor(pause);
    pause = std::min(pause * 2, absl::Milliseconds(1));
  }
}

// LibTorch's caching allocator must not hand `t`'s memory out again before
// the work queued on `stream` (of `device`) so far is done, even when `t`
// is dropped first (a receive that failed while its copy was queued).
// Without LibTorch's CUDA API there is no stream-aware allocator to tell.
void KeepForStream(const at::Tensor& t, cudaStream_t stream, int device) {
#ifdef REMORA_TORCH_CUDA
  c10::cuda::CUDACachingAllocator::recordStream(
      t.storage().data_ptr(),
      c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device)));
#else
  (void)t, (void)stream, (void)device;
#endif
}

// Ends the channel's use of `stream`. With LibTorch's CUDA API the stream
// is never destroyed: KeepForStream recorded it on tensors that may outlive
// the channel (received tensors handed to the user, views of sent ones),
// and the caching allocator records an event on it whenever such a tensor
// is freed, which on a destroyed stream fails inside a tensor's deleter
// and terminates the process. One stream per device and per communicator
// generation (a new one only after a failure) stays allocated.
void ReleaseStream(cudaStream_t stream) {
#ifdef REMORA_TORCH_CUDA
  (void)stream;
#else
  if (stream != nullptr) cudaStreamDestroy(stream);
#endif
}

ncclConfig_t NonBlockingConfig() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// One NCCL communicator: one direction (sender rank 0 -> receiver rank 1),
// one device pair, one generation.
//
// Every NCCL call on it (initialisation, each ncclSend or ncclRecv) is made
// by its own lane thread, in sequence order, each settled before the next.
// Before NCCL 2.19 the state of a non-blocking call still in progress lives
// with the calling thread (so does aborting it), so calls must not be spread
// over the agent's pool threads (a pool thread that left a send in progress
// could not make its next NCCL call), and a caller never waits for a call to
// settle: the first transfer stays in progress until the receiver posts its
// receive, which needs the frame that the caller is still building.
//
// Thread-safe: `mu` guards the communicator and everything that changes.
// Shared by the channel's tables and the threads using it; the lane thread
// holds no reference and is joined by the destructor.
struct Comm {
  WorkerId peer = kUnknownWorker;
  std::string peer_name;
  int src = 0, dst = 0;     // sender's and receiver's device ordinals
  uint64_t generation = 0;
  bool sending = false;     // this end sends (rank 0)
  int device = 0;           // this end's device
  absl::Duration timeout;   // longest settle of one call
  cudaStream_t stream = nullptr;  // set before the Comm is shared
  // Called (with mu held) when the communicator fails on the lane thread:
  // tells the other end.
  std::function<void(const Comm&)> on_failure;

  enum class State { kInitializing, kReady, kFailed };

  struct InFlight {  // a send not yet complete (sender only)
    uint64_t seq;
    cudaEvent_t done;   // null until the lane has posted it
    at::Tensor tensor;  // kept alive until `done`
    absl::Time deadline;
  };
  struct Job {  // a transfer for the lane to post
    at::Tensor tensor;
    cudaEvent_t after = nullptr;  // the stream waits for it first (may be null)
    absl::Time deadline;
  };

  absl::Mutex mu;
  ncclComm_t comm ABSL_GUARDED_BY(mu) = nullptr;
  State state ABSL_GUARDED_BY(mu) = State::kInitializing;
  std::string error ABSL_GUARDED_BY(mu);
  bool stop ABSL_GUARDED_BY(mu) = false;
  uint64_t next_seq ABSL_GUARDED_BY(mu) = 1;   // sender: next number to give
  uint64_t next_post ABSL_GUARDED_BY(mu) = 1;  // the lane's next to post
  std::map<uint64_t, Job> jobs ABSL_GUARDED_BY(mu);  // by sequence number
  std::map<uint64_t, cudaEvent_t> posted ABSL_GUARDED_BY(mu);  // receiver: done events
  std::deque<InFlight> in_flight ABSL_GUARDED_BY(mu);
  std::atomic<bool> failed{false};
  std::thread lane;

  std::string Describe() const {
    return sending ? absl::StrCat("NCCL to '", peer_name, "' (cuda:", src, " -> its cuda:", dst,
                                  ", generation ", generation, ")")
                   : absl::StrCat("NCCL from '", peer_name, "' (its cuda:", src, " -> cuda:",
                                  dst, ", generation ", generation, ")");
  }

  // Starts the lane: it creates the communicator as `rank` of 2 from `id`,
  // then posts jobs in sequence order until the communicator fails or the
  // Comm is destroyed.
  void Start(const ncclUniqueId& id, int rank) {
    lane = std::thread([this, id, rank] { Lane(id, rank); });
  }

  // Fails the communicator; every waiter sees `reason`, and the lane wakes
  // and aborts it (ncclCommAbort ends its kernels and frees it; before NCCL
  // 2.19 only the thread with a call in progress may abort). Returns false
  // when it had failed already.
  bool FailLocked(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (state == State::kFailed) return false;
    state = State::kFailed;
    error = reason;
    failed = true;
    DeviceGuard guard(device);
    DropEventsLocked();
    return true;
  }

  absl::Status ErrorLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return absl::UnavailableError(absl::StrCat(Describe(), " failed: ", error));
  }

  std::string NotFormed() const {
    return absl::StrCat("the communicator did not form within ", absl::FormatDuration(timeout),
                        " (is the peer alive and its GPU reachable?)");
  }

  // Waits until the communicator formed or failed, or `deadline` (then
  // fails it).
  absl::Status WaitReadyLocked(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto formed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return state != State::kInitializing;
    };
    mu.AwaitWithDeadline(absl::Condition(&formed), deadline);
    if (state == State::kReady) return absl::OkStatus();
    if (state == State::kInitializing) {
      FailLocked(NotFormed());
      if (on_failure) on_failure(*this);
    }
    return ErrorLocked();
  }

  ~Comm() {
    {
      MutexLock lock(mu);
      stop = true;
    }
    if (lane.joinable()) lane.join();  // it aborts the communicator
    MutexLock lock(mu);
    DeviceGuard guard(device);
    DropEventsLocked();
    ReleaseStream(stream);
  }

 private:
  void DropEventsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto& f : in_flight) {
      if (f.done != nullptr) cudaEventDestroy(f.done);
    }
    in_flight.clear();
    for (auto& [seq, job] : jobs) {
      if (job.after != nullptr) cudaEventDestroy(job.after);
    }
    jobs.clear();
    for (auto& [seq, done] : posted) cudaEventDestroy(done);
    posted.clear();
  }

  bool EndedLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return stop || state == State::kFailed;
  }

  // Polls a call that returned ncclInProgress until it settles, the
  // communicator fails or is dropped, or `deadline` passes (then
  // ncclInProgress). Releases mu between polls.
  ncclResult_t SettleLocked(ncclResult_t r, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::Duration pause = absl::Microseconds(5);
    auto ended = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return EndedLocked(); };
    while (r == ncclInProgress) {
      ncclResult_t state_now = ncclSuccess;
      r = ncclCommGetAsyncError(comm, &state_now);
      if (r == ncclSuccess) r = state_now;
      if (r != ncclInProgress || absl::Now() > deadline) break;
      mu.AwaitWithTimeout(absl::Condition(&ended), pause);
      if (EndedLocked()) return ncclInProgress;
      pause = std::min(pause * 2, absl::Microseconds(500));
    }
    return r;
  }

  void FailFromLaneLocked(const std::string& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (FailLocked(reason) && on_failure) on_failure(*this);
  }

  void Lane(ncclUniqueId id, int rank) {
    // This thread's current device stays `device`: events and NCCL's
    // kernels belong to it.
    cudaSetDevice(device);
    cudaFree(nullptr);
    ncclComm_t ended = nullptr;
    {
      MutexLock lock(mu);
      RunLocked(id, rank);
      ended = comm;
      comm = nullptr;
    }
    // Only this thread made NCCL calls on it, so only it aborts it, and
    // without holding mu (an abort can take a while).
    if (ended != nullptr) ncclCommAbort(ended);
  }

  // The lane's work until the communicator fails or the Comm goes.
  void RunLocked(const ncclUniqueId& id, int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (EndedLocked()) return;
    const absl::Time init_deadline = absl::Now() + timeout;
    ncclConfig_t config = NonBlockingConfig();
    ncclResult_t r = ncclCommInitRankConfig(&comm, 2, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      comm = nullptr;
      FailFromLaneLocked(absl::StrCat("ncclCommInitRankConfig: ", NcclText(r)));
      return;
    }
    r = SettleLocked(r, init_deadline);
    if (EndedLocked()) return;
    if (r != ncclSuccess) {
      FailFromLaneLocked(r == ncclInProgress
                             ? NotFormed()
                             : absl::StrCat("forming the communicator: ", NcclText(r)));
      return;
    }
    state = State::kReady;
    auto next = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      return EndedLocked() || (!jobs.empty() && jobs.begin()->first == next_post);
    };
    while (true) {
      // Between transfers the lane also watches for asynchronous errors (a
      // peer gone mid-transfer): only this thread makes NCCL calls.
      if (!mu.AwaitWithTimeout(absl::Condition(&next), absl::Milliseconds(10))) {
        ncclResult_t async = ncclSuccess;
        if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess &&
            async != ncclInProgress) {
          FailFromLaneLocked(NcclText(async));
          return;
        }
        continue;
      }
      if (EndedLocked()) return;
      const uint64_t seq = next_post;
      Job job = std::move(jobs.begin()->second);
      jobs.erase(jobs.begin());
      cudaError_t e = cudaSuccess;
      if (job.after != nullptr) {
        e = cudaStreamWaitEvent(stream, job.after, 0);
        cudaEventDestroy(job.after);
        if (e != cudaSuccess) {
          FailFromLaneLocked(absl::StrCat("ordering transfer ", seq, ": ", CudaText(e)));
          return;
        }
      }
      KeepForStream(job.tensor, stream, device);
      const size_t bytes = job.tensor.nbytes();
      r = sending ? ncclSend(job.tensor.data_ptr(), bytes, ncclUint8, 1, comm, stream)
                  : ncclRecv(job.tensor.data_ptr(), bytes, ncclUint8, 0, comm, stream);
      r = SettleLocked(r, job.deadline);
      if (EndedLocked()) return;
      if (r != ncclSuccess) {
        FailFromLaneLocked(
            r == ncclInProgress
                ? absl::StrCat(sending ? "the receiver did not take transfer "
                                       : "the sender did not send transfer ",
                               seq, " within ", absl::FormatDuration(timeout))
                : absl::StrCat(sending ? "ncclSend " : "ncclRecv ", seq, ": ", NcclText(r)));
        return;
      }
      cudaEvent_t done = nullptr;
      e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
      if (e == cudaSuccess) e = cudaEventRecord(done, stream);
      if (e != cudaSuccess) {
        if (done != nullptr) cudaEventDestroy(done);
        FailFromLaneLocked(absl::StrCat("recording transfer ", seq, "'s event: ", CudaText(e)));
        return;
      }
      ++next_post;
      if (sending) {
        for (auto& f : in_flight) {
          if (f.seq == seq) std::swap(f.done, done);
        }
        if (done != nullptr) cudaEventDestroy(done);  // reclaimed meanwhile
      } else {
        posted[seq] = done;
      }
    }
  }
};

// A peer's allocation opened here.
struct Opened {
  std::string handle;  // the cudaIpcMemHandle_t it was opened from
  void* ptr = nullptr;
  uint64_t bytes = 0;  // the mapping's size as the driver reports it
  int device = 0;
  absl::Time last_used;  // guarded by the channel's mu_
  ~Opened() {
    if (ptr != nullptr) {
      DeviceGuard guard(device);
      cudaIpcCloseMemHandle(ptr);
    }
  }
};

// One of this process's interprocess events: recorded after a payload's
// producer, waited on by the receiver, reused once that buffer is released.
struct IpcEvent {
  uint64_t id = 0;
  int device = 0;
  cudaEvent_t event = nullptr;
  cudaIpcEventHandle_t handle{};
  bool busy = false;
};

}  // namespace

class CudaChannel::Impl {
 public:
  Impl(Options options, Control control) : options_(options), control_(std::move(control)) {
    self_ep_.incarnation = RandomIncarnation();
    Probe();
    if (!self_ep_.gpus.empty()) background_ = std::thread([this] { Background(); });
  }

  ~Impl() {
    Stop();
    // Destroyed outside mu_: a Comm's destructor takes its own lock first.
    decltype(send_comms_) send_comms;
    decltype(recv_comms_) recv_comms;
    {
      MutexLock lock(mu_);
      send_comms.swap(send_comms_);
      recv_comms.swap(recv_comms_);
    }
    send_comms.clear();  // aborts
    recv_comms.clear();
    MutexLock lock(mu_);
    held_.clear();
    opened_.clear();
    for (auto& [key, event] : opened_events_) cudaEventDestroy(event);
    opened_events_.clear();
    for (auto& e : events_) cudaEventDestroy(e->event);
    events_.clear();
    for (auto& [device, stream] : copy_streams_) ReleaseStream(stream);
    copy_streams_.clear();
  }

  void Stop() {
    {
      MutexLock lock(queue_mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    if (background_.joinable()) background_.join();
    std::vector<std::shared_ptr<Comm>> comms;
    {
      MutexLock lock(mu_);
      for (auto& [k, c] : send_comms_) comms.push_back(c);
      for (auto& [k, c] : recv_comms_) comms.push_back(c);
    }
    for (auto& c : comms) {
      MutexLock lock(c->mu);
      c->FailLocked("the agent is shutting down");
    }
  }

  bool stopping() {
    MutexLock lock(queue_mu_);
    return stopping_;
  }

  // --- group -----------------------------------------------------------

  void SetGroup(const WorkerInfo& self, const std::vector<WorkerInfo>& book) {
    {
      MutexLock lock(mu_);
      self_ = self;
      self_.cuda = self_ep_;
      peers_.clear();
      for (const auto& w : book) {
        if (w.name != self.name) peers_[w.id] = w;
      }
    }
    if (!group_set_.HasBeenNotified()) group_set_.Notify();
  }

  absl::StatusOr<WorkerInfo> Peer(WorkerId id) {
    if (!group_set_.WaitForNotificationWithTimeout(options_.timeout)) {
      return absl::UnavailableError("the CUDA channel has no group yet (rendezvous not done)");
    }
    MutexLock lock(mu_);
    auto it = peers_.find(id);
    if (it == peers_.end()) {
      return absl::PermissionDeniedError(absl::StrCat("CUDA payload from unknown worker #", id));
    }
    return it->second;
  }

  CudaRoute RouteTo(WorkerId peer, int src, int dst) {
    MutexLock lock(mu_);
    auto it = peers_.find(peer);
    if (it == peers_.end()) return CudaRoute::kStaged;
    return ChooseCudaRoute(self_, src, it->second, dst);
  }

  // --- sending ---------------------------------------------------------

  std::optional<wire::CudaPayload> Send(WorkerId peer, const at::Tensor& payload, int dst) {
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

  absl::StatusOr<std::optional<wire::CudaPayload>> SendIpc(WorkerId peer, const at::Tensor& payload,
                                                          int src, int dst) {
    DeviceGuard guard(src);
    AddressRangeFn range = AddressRange();
    if (range == nullptr) {
      return absl::UnavailableError(
          "CUDA IPC needs the driver's cuMemGetAddressRange (libcuda.so.1 not found)");
    }
    unsigned long long base = 0;
    size_t size = 0;
    const auto ptr = reinterpret_cast<unsigned long long>(payload.data_ptr());
    if (range(&base, &size, ptr) != 0 || base == 0) {
      return absl::InternalError("CUDA IPC: cannot find the allocation of a tensor");
    }
    cudaIpcMemHandle_t mem;
    const cudaError_t e = cudaIpcGetMemHandle(&mem, reinterpret_cast<void*>(base));
    if (e != cudaSuccess) {
      return CudaFailure(
          "CUDA IPC cannot share this tensor's memory (expandable segments in "
          "PYTORCH_CUDA_ALLOC_CONF are not shareable)", e);
    }
    auto event = TakeEvent(src);
    if (!event.ok()) return event.status();
    IpcEvent* ev = *event;
#ifdef REMORA_TORCH_CUDA
    cudaStream_t producer =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(src)).stream();
    cudaError_t recorded = cudaEventRecord(ev->event, producer);
#else
    cudaError_t recorded = cudaDeviceSynchronize();
    if (recorded == cudaSuccess) recorded = cudaEventRecord(ev->event, nullptr);
#endif
    if (recorded != cudaSuccess) {
      ReturnEvent(ev);
      return CudaFailure("CUDA IPC: recording the producer's event", recorded);
    }
    wire::CudaPayload d;
    d.set_channel(wire::CudaPayload::CUDA_IPC);
    d.set_src_device(src);
    d.set_dst_device(dst);
    d.set_incarnation(self_ep_.incarnation);
    d.set_mem_handle(std::string(reinterpret_cast<const char*>(&mem), sizeof(mem)));
    d.set_base(base);
    d.set_alloc_bytes(size);
    d.set_offset(ptr - base);
    d.set_event_handle(std::string(reinterpret_cast<const char*>(&ev->handle), sizeof(ev->handle)));
    d.set_event_id(ev->id);
    d.set_gpu(self_ep_.gpus[src]);
    {
      MutexLock lock(mu_);
      const uint64_t id = next_buffer_++;
      held_[id] = Held{payload, peer, ev, absl::Now(), false};
      d.set_buffer(id);
    }
    ipc_sends_.fetch_add(1);
    return std::optional<wire::CudaPayload>(std::move(d));
  }

  absl::StatusOr<std::optional<wire::CudaPayload>> SendNccl(WorkerId peer, const at::Tensor& payload,
                                                           int src, int dst) {
    ASSIGN_OR_RETURN(std::shared_ptr<Comm> c, SendComm(peer, src, dst));
    DeviceGuard guard(src);
    // The lane posts the send after the work that produced the tensor; the
    // frame leaves at once (the receiver's ncclRecv needs it).
    ASSIGN_OR_RETURN(cudaEvent_t after, LibTorchEvent(src));
    MutexLock lock(c->mu);
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

  // The communicator for transfers to `peer` from `src` to its `dst`:
  // created (and announced to the peer) by the first caller, ready on return.
  absl::StatusOr<std::shared_ptr<Comm>> SendComm(WorkerId peer, int src, int dst) {
    const auto key = std::make_tuple(peer, src, dst);
    std::shared_ptr<Comm> c;
    std::shared_ptr<Comm> replaced;  // a failed one, destroyed (lane joined) outside mu_
    bool create = false;
    {
      MutexLock lock(mu_);
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
          MutexLock lock(c->mu);
          c->FailLocked(std::string(s.message()));
        }
        // Do not retry on every message: stage for a while.
        MutexLock lock(mu_);
        broken_until_[key] = {absl::Now() + absl::Seconds(30), s};
        return s;
      }
    }
    MutexLock lock(c->mu);
    RETURN_IF_ERROR(c->WaitReadyLocked(absl::Now() + options_.timeout));
    return c;
  }

  // A communicator's fixed parts; its lane starts once it has a unique id.
  std::shared_ptr<Comm> NewComm(WorkerId peer, std::string peer_name, int src, int dst,
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

  // Creates the stream of `c` and starts its lane as `rank` of `id`.
  absl::Status StartComm(Comm& c, const ncclUniqueId& id, int rank) {
    DeviceGuard guard(c.device);
    REMORA_CUDA_TRY(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking),
                    "creating the NCCL stream");
    c.Start(id, rank);
    return absl::OkStatus();
  }

  // Starts the sending end of `c` and tells the peer to start the other.
  // Both ends form the communicator concurrently, on their lanes.
  absl::Status InitSender(Comm& c) {
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
    absl::Status s = control_(c.peer, MakeRequest(setup), options_.timeout);
    if (!s.ok()) {
      return absl::UnavailableError(absl::StrCat("setting up ", c.Describe(), ": ", s.message()));
    }
    return absl::OkStatus();
  }

  void Reclaim(WorkerId peer, const wire::CudaPayload& d) {
    if (d.channel() == wire::CudaPayload::CUDA_IPC) {
      MutexLock lock(mu_);
      if (auto it = held_.find(d.buffer()); it != held_.end()) it->second.orphaned = true;
      return;
    }
    // NCCL: the receiver may never post this receive; give it a short grace.
    std::shared_ptr<Comm> c;
    {
      MutexLock lock(mu_);
      auto it = send_comms_.find(std::make_tuple(peer, d.src_device(), d.dst_device()));
      if (it == send_comms_.end() || it->second->generation != d.generation()) return;
      c = it->second;
    }
    MutexLock lock(c->mu);
    const absl::Time soon = absl::Now() + std::min(options_.timeout, absl::Seconds(5));
    for (auto& f : c->in_flight) {
      if (f.seq == d.seq()) f.deadline = std::min(f.deadline, soon);
    }
  }

  // --- receiving -------------------------------------------------------

  void Abandon(WorkerId peer, const wire::CudaPayload& d, const std::string& why) {
    if (d.channel() == wire::CudaPayload::CUDA_IPC) {
      QueueRelease(peer, d.buffer());
      return;
    }
    std::shared_ptr<Comm> c;
    {
      MutexLock lock(mu_);
      auto it = recv_comms_.find(
          std::make_tuple(peer, d.src_device(), d.dst_device(), d.generation()));
      if (it == recv_comms_.end()) return;
      c = it->second;
    }
    MutexLock lock(c->mu);
    if (d.seq() < c->next_post || c->posted.count(d.seq()) > 0) return;  // on its way
    if (c->FailLocked(absl::StrCat("transfer ", d.seq(), " cannot be received (", why, ")"))) {
      QueueAbort(*c);
    }
  }

  absl::StatusOr<at::Tensor> Receive(WorkerId from, const wire::CudaPayload& d, uint64_t length) {
    ASSIGN_OR_RETURN(WorkerInfo peer, Peer(from));
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

  absl::Status ReceiveIpc(const WorkerInfo& peer, const wire::CudaPayload& d, uint64_t length,
                          at::Tensor& out) {
    const int dst = d.dst_device();
    const std::string what = absl::StrCat("CUDA IPC payload from '", peer.name, "'");
    ASSIGN_OR_RETURN(std::shared_ptr<Opened> mem, Open(d));
    if (d.offset() > mem->bytes || length > mem->bytes - d.offset()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": ", length, " bytes at offset ", d.offset(), " exceed the opened allocation of ",
          mem->bytes, " bytes"));
    }
    ASSIGN_OR_RETURN(cudaEvent_t producer, OpenEvent(d));
    ASSIGN_OR_RETURN(cudaStream_t stream, CopyStream(dst));
    RETURN_IF_ERROR(AfterLibTorch(dst, stream));
    REMORA_CUDA_TRY(cudaStreamWaitEvent(stream, producer, 0), what + ": waiting for the sender");
    KeepForStream(out, stream, dst);
    REMORA_CUDA_TRY(cudaMemcpyAsync(out.data_ptr(), static_cast<char*>(mem->ptr) + d.offset(),
                                    length, cudaMemcpyDeviceToDevice, stream),
                    what + ": copying");
    cudaEvent_t done;
    REMORA_CUDA_TRY(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), what);
    cudaError_t e = cudaEventRecord(done, stream);
    absl::Status s = e == cudaSuccess
                         ? PollEvent(done, absl::Now() + options_.timeout, what + ": the copy")
                         : CudaFailure(what, e);
    cudaEventDestroy(done);
    if (!s.ok()) return s;
    QueueRelease(peer.id, d.buffer());
    return absl::OkStatus();
  }

  absl::Status ReceiveNccl(const WorkerInfo& peer, const wire::CudaPayload& d, uint64_t length,
                           at::Tensor& out) {
    const absl::Time deadline = absl::Now() + options_.timeout;
    std::shared_ptr<Comm> c;
    {
      MutexLock lock(mu_);
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
      MutexLock lock(c->mu);
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
    // Wait on the host: errors and a dead sender surface here, not as a
    // kernel that never ends.
    absl::Status s = PollEvent(done, deadline, absl::StrCat(c->Describe(), ": transfer ", d.seq()),
                               [&]() -> absl::Status {
                                 // The lane watches NCCL's errors.
                                 MutexLock lock(c->mu);
                                 if (c->state == Comm::State::kFailed) return c->ErrorLocked();
                                 return absl::OkStatus();
                               });
    cudaEventDestroy(done);
    if (s.code() == absl::StatusCode::kDeadlineExceeded) {
      MutexLock lock(c->mu);
      c->FailLocked(absl::StrCat("transfer ", d.seq(), " did not complete within ",
                                 absl::FormatDuration(options_.timeout),
                                 " (is the sender alive?)"));
      QueueAbort(*c);
      return c->ErrorLocked();
    }
    return s;
  }

  // --- control requests ------------------------------------------------

  absl::Status OnNcclSetup(WorkerId from, const wire::NcclSetup& setup) {
    ASSIGN_OR_RETURN(WorkerInfo peer, Peer(from));
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
      MutexLock lock(mu_);
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
      MutexLock lock(o->mu);
      o->FailLocked("the sender opened a newer communicator");
    }
    return absl::OkStatus();
  }

  void OnNcclAbort(WorkerId from, const wire::NcclAbort& abort) {
    std::shared_ptr<Comm> c;
    {
      MutexLock lock(mu_);
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
    MutexLock lock(c->mu);
    if (c->FailLocked(absl::StrCat("the other end aborted it: ", abort.reason()))) {
      aborted_.fetch_add(1);
    }
  }

  void OnRelease(WorkerId from, const wire::CudaRelease& release) {
    if (release.incarnation() != self_ep_.incarnation) return;  // meant for an older process
    MutexLock lock(mu_);
    for (uint64_t id : release.buffers()) {
      auto it = held_.find(id);
      if (it == held_.end() || it->second.peer != from) continue;
      it->second.event->busy = false;
      held_.erase(it);
    }
  }

  Stats stats() {
    Stats s;
    s.ipc_sends = ipc_sends_.load();
    s.ipc_receives = ipc_receives_.load();
    s.nccl_sends = nccl_sends_.load();
    s.nccl_receives = nccl_receives_.load();
    s.aborted = aborted_.load();
    MutexLock lock(mu_);
    s.held_buffers = static_cast<int64_t>(held_.size());
    s.opened_handles = static_cast<int64_t>(opened_.size());
    for (const auto& [k, c] : send_comms_) s.communicators += !c->failed;
    for (const auto& [k, c] : recv_comms_) s.communicators += !c->failed;
    return s;
  }

  const CudaEndpoint& endpoint() const { return self_ep_; }
  const std::string& disabled_reason() const { return disabled_; }

 private:
  // What the channel holds for an IPC payload until the receiver is done.
  struct Held {
    at::Tensor tensor;
    WorkerId peer;
    IpcEvent* event;
    absl::Time since;
    bool orphaned;  // its call failed
  };

  // Decides what this process offers: its GPUs, unless something is missing.
  void Probe() {
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

  void Warn(WorkerId peer, const absl::Status& why) {
    std::string name, self;
    {
      MutexLock lock(mu_);
      if (!warned_.insert(peer).second) return;
      name = peers_.count(peer) ? peers_[peer].name : absl::StrCat("#", peer);
      self = self_.name;
    }
    std::cerr << "remora: '" << self << "' -> '" << name << "': " << why.message()
              << "; CUDA tensors to it go through host memory for now\n";
  }

  absl::StatusOr<IpcEvent*> TakeEvent(int device) {
    {
      MutexLock lock(mu_);
      for (auto& e : events_) {
        if (!e->busy && e->device == device) {
          e->busy = true;
          return e.get();
        }
      }
    }
    auto e = std::make_unique<IpcEvent>();
    e->device = device;
    REMORA_CUDA_TRY(
        cudaEventCreateWithFlags(&e->event, cudaEventDisableTiming | cudaEventInterprocess),
        "creating an interprocess event");
    if (cudaError_t err = cudaIpcGetEventHandle(&e->handle, e->event); err != cudaSuccess) {
      cudaEventDestroy(e->event);
      return CudaFailure("cudaIpcGetEventHandle", err);
    }
    e->busy = true;
    MutexLock lock(mu_);
    e->id = events_.size() + 1;
    events_.push_back(std::move(e));
    return events_.back().get();
  }

  void ReturnEvent(IpcEvent* e) {
    MutexLock lock(mu_);
    e->busy = false;
  }

  // The sender's allocation, opened once per (sender, allocation). A new
  // handle for the same address means the old allocation was freed and its
  // address reused: the stale mapping is closed.
  absl::StatusOr<std::shared_ptr<Opened>> Open(const wire::CudaPayload& d) {
    const auto key = std::make_pair(d.incarnation(), d.base());
    MutexLock lock(open_mu_);
    {
      MutexLock l(mu_);
      auto it = opened_.find(key);
      if (it != opened_.end() && it->second->handle == d.mem_handle()) {
        it->second->last_used = absl::Now();
        return it->second;
      }
    }
    auto mem = std::make_shared<Opened>();
    mem->handle = d.mem_handle();
    mem->device = d.dst_device();
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, d.mem_handle().data(), sizeof(handle));
    REMORA_CUDA_TRY(cudaIpcOpenMemHandle(&mem->ptr, handle, cudaIpcMemLazyEnablePeerAccess),
                    "CUDA IPC: opening the sender's memory");
    mem->bytes = d.alloc_bytes();
    if (AddressRangeFn range = AddressRange()) {
      unsigned long long base = 0;
      size_t size = 0;
      if (range(&base, &size, reinterpret_cast<unsigned long long>(mem->ptr)) == 0) {
        mem->bytes = std::min<uint64_t>(mem->bytes, size - (reinterpret_cast<uintptr_t>(mem->ptr) - base));
      }
    }
    MutexLock l(mu_);
    mem->last_used = absl::Now();
    opened_[key] = mem;
    return mem;
  }

  absl::StatusOr<cudaEvent_t> OpenEvent(const wire::CudaPayload& d) {
    const auto key = std::make_pair(d.incarnation(), d.event_id());
    MutexLock lock(mu_);
    if (auto it = opened_events_.find(key); it != opened_events_.end()) return it->second;
    cudaIpcEventHandle_t handle;
    std::memcpy(&handle, d.event_handle().data(), sizeof(handle));
    cudaEvent_t event;
    REMORA_CUDA_TRY(cudaIpcOpenEventHandle(&event, handle), "CUDA IPC: opening the sender's event");
    opened_events_[key] = event;
    return event;
  }

  absl::StatusOr<cudaStream_t> CopyStream(int device) {
    MutexLock lock(mu_);
    if (auto it = copy_streams_.find(device); it != copy_streams_.end()) return it->second;
    cudaStream_t stream;
    REMORA_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                    "creating the copy stream");
    copy_streams_[device] = stream;
    return stream;
  }

  // --- the background thread -------------------------------------------

  void QueueRelease(WorkerId peer, uint64_t buffer) {
    MutexLock lock(queue_mu_);
    releases_[peer].push_back(buffer);
    wake_ = true;
  }

  // Tells the other end of `c` that it is gone (best effort).
  void QueueAbort(const Comm& c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    aborted_.fetch_add(1);
    wire::NcclAbort a;
    a.set_src_device(c.src);
    a.set_dst_device(c.dst);
    a.set_generation(c.generation);
    a.set_reason(c.error);
    a.set_from_receiver(!c.sending);
    MutexLock lock(queue_mu_);
    outbox_.emplace_back(c.peer, MakeRequest(a));
    wake_ = true;
  }

  void Wake() {
    MutexLock lock(queue_mu_);
    wake_ = true;
  }

  void Background() {
    while (true) {
      std::map<WorkerId, std::vector<uint64_t>> releases;
      std::vector<std::pair<WorkerId, wire::Request>> outbox;
      {
        MutexLock lock(queue_mu_);
        auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu_) {
          return wake_ || stopping_;
        };
        queue_mu_.AwaitWithTimeout(absl::Condition(&woken),
                                   sends_in_flight_ ? absl::Milliseconds(2) : absl::Milliseconds(200));
        if (stopping_) return;
        wake_ = false;
        releases.swap(releases_);
        outbox.swap(outbox_);
      }
      for (auto& [peer, buffers] : releases) {
        wire::CudaRelease release;
        release.mutable_buffers()->Add(buffers.begin(), buffers.end());
        MutexLock lock(mu_);
        auto it = peers_.find(peer);
        if (it == peers_.end()) continue;
        release.set_incarnation(it->second.cuda.incarnation);
        outbox.emplace_back(peer, MakeRequest(release));
      }
      for (auto& [peer, request] : outbox) {
        control_(peer, std::move(request), absl::Seconds(10)).IgnoreError();
      }
      bool in_flight = PollSends();
      ReclaimStale();
      MutexLock lock(queue_mu_);
      sends_in_flight_ = in_flight;
    }
  }

  // Completes finished NCCL sends (frees their tensors); aborts
  // communicators whose sends did not complete in time. True while sends
  // are still in flight.
  bool PollSends() {
    std::vector<std::shared_ptr<Comm>> comms;
    {
      MutexLock lock(mu_);
      for (auto& [k, c] : send_comms_) {
        if (!c->failed) comms.push_back(c);
      }
    }
    bool any = false;
    for (auto& c : comms) {
      MutexLock lock(c->mu);
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

  void ReclaimStale() {
    const absl::Time now = absl::Now();
    // A sender's allocation mapped here keeps its memory alive after the
    // sender frees it (and CUDA leaves freeing it while mapped undefined):
    // close mappings unused for reclaim_after. Receives still copying hold
    // their own reference; the last one closes it.
    std::vector<std::shared_ptr<Opened>> idle;  // closed outside the lock
    MutexLock lock(mu_);
    for (auto it = opened_.begin(); it != opened_.end();) {
      if (now - it->second->last_used > options_.reclaim_after) {
        idle.push_back(std::move(it->second));
        it = opened_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = held_.begin(); it != held_.end();) {
      // A buffer whose call failed is freed after reclaim_after; one whose
      // call went through waits much longer for its release (its frame may
      // still be queued at the receiver, which would copy freed memory).
      const absl::Duration limit =
          it->second.orphaned ? options_.reclaim_after : 10 * options_.reclaim_after;
      if (now - it->second.since > limit) {
        it->second.event->busy = false;
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
  }

  const Options options_;
  const Control control_;
  CudaEndpoint self_ep_;
  std::string disabled_;
  absl::Notification group_set_;

  std::atomic<int64_t> ipc_sends_{0}, ipc_receives_{0}, nccl_sends_{0}, nccl_receives_{0},
      aborted_{0};

  // Lock order: a Comm's mu before mu_ or queue_mu_; open_mu_ before mu_.
  absl::Mutex mu_;
  WorkerInfo self_ ABSL_GUARDED_BY(mu_);
  std::map<WorkerId, WorkerInfo> peers_ ABSL_GUARDED_BY(mu_);
  std::set<WorkerId> warned_ ABSL_GUARDED_BY(mu_);
  // NCCL, sending: by (peer, src, dst); receiving: by (peer, src, dst, generation).
  std::map<std::tuple<WorkerId, int, int>, std::shared_ptr<Comm>> send_comms_ ABSL_GUARDED_BY(mu_);
  std::map<std::tuple<WorkerId, int, int>, uint64_t> generations_ ABSL_GUARDED_BY(mu_);
  std::map<std::tuple<WorkerId, int, int>, std::pair<absl::Time, absl::Status>> broken_until_
      ABSL_GUARDED_BY(mu_);
  std::map<std::tuple<WorkerId, int, int, uint64_t>, std::shared_ptr<Comm>> recv_comms_
      ABSL_GUARDED_BY(mu_);
  // CUDA IPC, sending: buffers held until released; the event pool.
  std::map<uint64_t, Held> held_ ABSL_GUARDED_BY(mu_);
  uint64_t next_buffer_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<std::unique_ptr<IpcEvent>> events_ ABSL_GUARDED_BY(mu_);
  // CUDA IPC, receiving: peers' allocations and events opened here.
  absl::Mutex open_mu_;  // serialises opening (about 1 ms each)
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Opened>> opened_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<uint64_t, uint64_t>, cudaEvent_t> opened_events_ ABSL_GUARDED_BY(mu_);
  std::map<int, cudaStream_t> copy_streams_ ABSL_GUARDED_BY(mu_);

  absl::Mutex queue_mu_;
  bool stopping_ ABSL_GUARDED_BY(queue_mu_) = false;
  bool wake_ ABSL_GUARDED_BY(queue_mu_) = false;
  bool sends_in_flight_ ABSL_GUARDED_BY(queue_mu_) = false;
  std::map<WorkerId, std::vector<uint64_t>> releases_ ABSL_GUARDED_BY(queue_mu_);
  std::vector<std::pair<WorkerId, wire::Request>> outbox_ ABSL_GUARDED_BY(queue_mu_);
  std::thread background_;
};

// ---------------------------------------------------------------------------

CudaChannel::CudaChannel(Options options, Control control)
    : impl_(std::make_unique<Impl>(options, std::move(control))) {}
CudaChannel::~CudaChannel() = default;

const CudaEndpoint& CudaChannel::endpoint() const { return impl_->endpoint(); }
const std::string& CudaChannel::disabled_reason() const { return impl_->disabled_reason(); }

void CudaChannel::SetGroup(const WorkerInfo& self, const std::vector<WorkerInfo>& book) {
  impl_->SetGroup(self, book);
}

CudaRoute CudaChannel::RouteTo(WorkerId peer, int src, int dst) const {
  return impl_->RouteTo(peer, src, dst);
}

std::optional<wire::CudaPayload> CudaChannel::Send(WorkerId peer, const at::Tensor& payload,
                                                   int dst) {
  return impl_->Send(peer, payload, dst);
}

void CudaChannel::Reclaim(WorkerId peer, const wire::CudaPayload& d) { impl_->Reclaim(peer, d); }

void CudaChannel::Abandon(WorkerId peer, const wire::CudaPayload& d, const std::string& why) {
  impl_->Abandon(peer, d, why);
}

void CudaChannel::Stop() { impl_->Stop(); }

absl::StatusOr<at::Tensor> CudaChannel::Receive(WorkerId peer, const wire::CudaPayload& d,
                                                uint64_t length) {
  return impl_->Receive(peer, d, length);
}

absl::Status CudaChannel::OnNcclSetup(WorkerId from, const wire::NcclSetup& setup) {
  return impl_->OnNcclSetup(from, setup);
}

void CudaChannel::OnNcclAbort(WorkerId from, const wire::NcclAbort& abort) {
  impl_->OnNcclAbort(from, abort);
}

void CudaChannel::OnRelease(WorkerId from, const wire::CudaRelease& release) {
  impl_->OnRelease(from, release);
}

CudaChannel::Stats CudaChannel::stats() const { return impl_->stats(); }

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

}  // namespace remora
