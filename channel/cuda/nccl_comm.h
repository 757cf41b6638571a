// One NCCL communicator of the CUDA channel: one direction, one device pair
// (see nccl.cc for how the channel uses it). Include only from
// channel/cuda/.
#pragma once

#include "channel/cuda/util.h"

namespace remora::channel {

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
  base::WorkerId peer = base::kUnknownWorker;
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

  // ErrorLocked once it failed, else OK.
  absl::Status Failure() ABSL_LOCKS_EXCLUDED(mu) {
    base::MutexLock lock(mu);
    return state == State::kFailed ? ErrorLocked() : absl::OkStatus();
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
      base::MutexLock lock(mu);
      stop = true;
    }
    if (lane.joinable()) lane.join();  // it aborts the communicator
    base::MutexLock lock(mu);
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
      base::MutexLock lock(mu);
      RunLocked(id, rank);
      ended = comm;
      comm = nullptr;
    }
    // Only this thread made NCCL calls on it, so only it aborts it, and
    // without holding mu (an abort can take a while).
    if (ended != nullptr) ncclCommAbort(ended);
  }

  // Forms the communicator as `rank` of two; false (the Comm failed or
  // ended) if it did not form.
  bool FormLocked(const ncclUniqueId& id, int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const absl::Time init_deadline = absl::Now() + timeout;
    ncclConfig_t config = NonBlockingConfig();
    ncclResult_t r = ncclCommInitRankConfig(&comm, 2, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      comm = nullptr;
      FailFromLaneLocked(absl::StrCat("ncclCommInitRankConfig: ", NcclText(r)));
      return false;
    }
    r = SettleLocked(r, init_deadline);
    if (EndedLocked()) return false;
    if (r != ncclSuccess) {
      FailFromLaneLocked(r == ncclInProgress
                             ? NotFormed()
                             : absl::StrCat("forming the communicator: ", NcclText(r)));
      return false;
    }
    return true;
  }

  // Runs transfer `seq` on the stream and records its event; false (the
  // Comm failed or ended) if it could not.
  bool TransferLocked(uint64_t seq, Job job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    cudaError_t e = cudaSuccess;
    if (job.after != nullptr) {
      e = cudaStreamWaitEvent(stream, job.after, 0);
      cudaEventDestroy(job.after);
      if (e != cudaSuccess) {
        FailFromLaneLocked(absl::StrCat("ordering transfer ", seq, ": ", CudaText(e)));
        return false;
      }
    }
    KeepForStream(job.tensor, stream, device);
    const size_t bytes = job.tensor.nbytes();
    ncclResult_t r = sending ? ncclSend(job.tensor.data_ptr(), bytes, ncclUint8, 1, comm, stream)
                             : ncclRecv(job.tensor.data_ptr(), bytes, ncclUint8, 0, comm, stream);
    r = SettleLocked(r, job.deadline);
    if (EndedLocked()) return false;
    if (r != ncclSuccess) {
      FailFromLaneLocked(
          r == ncclInProgress
              ? absl::StrCat(sending ? "the receiver did not take transfer "
                                     : "the sender did not send transfer ",
                             seq, " within ", absl::FormatDuration(timeout))
              : absl::StrCat(sending ? "ncclSend " : "ncclRecv ", seq, ": ", NcclText(r)));
      return false;
    }
    cudaEvent_t done = nullptr;
    e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(done, stream);
    if (e != cudaSuccess) {
      if (done != nullptr) cudaEventDestroy(done);
      FailFromLaneLocked(absl::StrCat("recording transfer ", seq, "'s event: ", CudaText(e)));
      return false;
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
    return true;
  }

  // The lane's work until the communicator fails or the Comm goes.
  void RunLocked(const ncclUniqueId& id, int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (EndedLocked()) return;
    if (!FormLocked(id, rank)) return;
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
      if (!TransferLocked(seq, std::move(job))) return;
    }
  }
};

}  // namespace remora::channel
