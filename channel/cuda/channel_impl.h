// CudaChannel::Impl: the channel's state and methods, defined in three
// files by concern:
//
//   cuda_channel.cc  the facade, the group, routing, sending and receiving
//                    (dispatching to IPC or NCCL), the background thread
//   ipc.cc           CUDA IPC: sharing allocations and events, copies,
//                    releases
//   nccl.cc          NCCL: communicators, their set-up and abort, transfers
//
// Thread-safety: as annotated; lock order: poll_mu_ before a Comm's mu,
// pending_mu_ or queue_mu_; a Comm's mu before mu_ or queue_mu_; open_mu_
// before mu_; nothing is taken under pending_mu_. Ownership: the CudaChannel owns its Impl;
// the Impl owns its communicators, held buffers, events and streams.
// Include only from channel/cuda/.
#pragma once

#include "channel/cuda/nccl_comm.h"

namespace remora::channel {

class CudaChannel::Impl {
 public:
  Impl(Options options, Control control);

  ~Impl();

  void Stop();

  bool stopping() {
    base::MutexLock lock(queue_mu_);
    return stopping_;
  }

  // --- group -----------------------------------------------------------

  void SetGroup(const base::WorkerInfo& self, const std::vector<base::WorkerInfo>& book);
  void UpdatePeer(const base::WorkerInfo& peer);

  absl::StatusOr<base::WorkerInfo> Peer(base::WorkerId id);

  CudaRoute RouteTo(base::WorkerId peer, int src, int dst);

  // --- sending ---------------------------------------------------------

  std::optional<wire::CudaPayload> Send(base::WorkerId peer, const at::Tensor& payload, int dst);

  absl::StatusOr<std::optional<wire::CudaPayload>> SendIpc(base::WorkerId peer, const at::Tensor& payload,
                                                          int src, int dst);

  absl::StatusOr<std::optional<wire::CudaPayload>> SendNccl(base::WorkerId peer, const at::Tensor& payload,
                                                           int src, int dst);

  // The communicator for transfers to `peer` from `src` to its `dst`:
  // created (and announced to the peer) by the first caller, ready on return.
  absl::StatusOr<std::shared_ptr<Comm>> SendComm(base::WorkerId peer, int src, int dst);

  // A communicator's fixed parts; its lane starts once it has a unique id.
  std::shared_ptr<Comm> NewComm(base::WorkerId peer, std::string peer_name, int src, int dst,
                                uint64_t generation, bool sending);

  // Creates the stream of `c` and starts its lane as `rank` of `id`.
  absl::Status StartComm(Comm& c, const ncclUniqueId& id, int rank);

  // Starts the sending end of `c` and tells the peer to start the other.
  // Both ends form the communicator concurrently, on their lanes.
  absl::Status InitSender(Comm& c);

  void Reclaim(base::WorkerId peer, const wire::CudaPayload& d);

  // --- receiving -------------------------------------------------------

  void Abandon(base::WorkerId peer, const wire::CudaPayload& d, const std::string& why);

  absl::StatusOr<at::Tensor> Receive(base::WorkerId from, const wire::CudaPayload& d, uint64_t length);

  absl::Status ReceiveIpc(const base::WorkerInfo& peer, const wire::CudaPayload& d, uint64_t length,
                          at::Tensor& out);

  absl::Status ReceiveNccl(const base::WorkerInfo& peer, const wire::CudaPayload& d, uint64_t length,
                           at::Tensor& out);

  // --- stream-ordered receives (see cuda_channel.h) ---------------------

  // A receive whose copy LibTorch's stream waits for on the GPU, watched by
  // the background thread (and Settle) until the copy completes.
  struct Pending {
    uint64_t seq = 0;
    int64_t group = 0;             // the descriptor's stream_group
    cudaEvent_t done = nullptr;    // recorded after the copy; owned
    base::WorkerId peer = 0;
    uint64_t buffer = 0;           // CUDA IPC: the sender's, released once done,
    uint64_t incarnation = 0;      //   to this process of it
    std::shared_ptr<Opened> mem;   // CUDA IPC: the mapping the copy reads
    std::shared_ptr<Comm> comm;    // NCCL: failed and aborted when it is late
    absl::Time deadline;
    std::string what;              // "CUDA IPC payload from 'w1'", ...
    bool late = false;             // its failure is reported; still watched
  };

  // Whether a receive of `d` leaves its copy to LibTorch's stream.
  bool StreamOrdered(const wire::CudaPayload& d) const;

  // Makes LibTorch's current stream of `device` (current on this thread)
  // wait for `p.done` and hands `p` (moved from) to the background thread.
  // False when the stream could not be ordered: `p` is left as it was, for
  // the caller to wait on the host.
  bool LeaveToStream(int device, Pending& p);

  // Settles the pending receives that completed (IPC buffers released),
  // failed or are late (kept for Settle by group; a late copy is watched
  // until it completes); true while any are left.
  bool PollReceives();

  absl::Status Settle(int64_t group, absl::Time deadline);
  void Forget(int64_t group);
  // A CUDA IPC copy that never completed blocks this process's stream.
  absl::Status StuckLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(pending_mu_);
  absl::Status Stuck();

  // --- control requests ------------------------------------------------

  absl::Status OnNcclSetup(base::WorkerId from, const wire::NcclSetup& setup);

  void OnNcclAbort(base::WorkerId from, const wire::NcclAbort& abort);

  void OnRelease(base::WorkerId from, const wire::CudaRelease& release);

  Stats stats();

  const base::CudaEndpoint& endpoint() const { return self_ep_; }
  const std::string& disabled_reason() const { return disabled_; }

 private:
  // What the channel holds for an IPC payload until the receiver is done.
  struct Held {
    at::Tensor tensor;
    base::WorkerId peer;
    IpcEvent* event;
    absl::Time since;
    bool orphaned;  // its call failed
  };

  // Decides what this process offers: its GPUs, unless something is missing.
  void Probe();

  void Warn(base::WorkerId peer, const absl::Status& why);

  absl::StatusOr<IpcEvent*> TakeEvent(int device);

  void ReturnEvent(IpcEvent* e);

  // The sender's allocation, opened once per (sender, allocation). A new
  // handle for the same address means the old allocation was freed and its
  // address reused: the stale mapping is closed.
  absl::StatusOr<std::shared_ptr<Opened>> Open(const wire::CudaPayload& d);

  absl::StatusOr<cudaEvent_t> OpenEvent(const wire::CudaPayload& d);

  absl::StatusOr<cudaStream_t> CopyStream(int device);

  // --- the background thread -------------------------------------------

  // Tells `peer`'s process `incarnation` (dropped when the peer is another
  // process by then) that its IPC buffer is free.
  void QueueRelease(base::WorkerId peer, uint64_t incarnation, uint64_t buffer);

  // Tells the other end of `c` that it is gone (best effort).
  void QueueAbort(const Comm& c) ABSL_NO_THREAD_SAFETY_ANALYSIS;

  void Wake();

  void Background();

  // Completes finished NCCL sends (frees their tensors); aborts
  // communicators whose sends did not complete in time. True while sends
  // are still in flight.
  bool PollSends();

  void ReclaimStale();

  const Options options_;
  const Control control_;
  base::CudaEndpoint self_ep_;
  std::string disabled_;
  absl::Notification group_set_;

  std::atomic<int64_t> ipc_sends_{0}, ipc_receives_{0}, nccl_sends_{0}, nccl_receives_{0},
      aborted_{0}, stream_ordered_{0};

  // Lock order: a Comm's mu before mu_ or queue_mu_; open_mu_ before mu_.
  absl::Mutex mu_;
  base::WorkerInfo self_ ABSL_GUARDED_BY(mu_);
  std::map<base::WorkerId, base::WorkerInfo> peers_ ABSL_GUARDED_BY(mu_);
  std::set<base::WorkerId> warned_ ABSL_GUARDED_BY(mu_);
  // NCCL, sending: by (peer, src, dst); receiving: by (peer, src, dst, generation).
  std::map<std::tuple<base::WorkerId, int, int>, std::shared_ptr<Comm>> send_comms_ ABSL_GUARDED_BY(mu_);
  std::map<std::tuple<base::WorkerId, int, int>, uint64_t> generations_ ABSL_GUARDED_BY(mu_);
  std::map<std::tuple<base::WorkerId, int, int>, std::pair<absl::Time, absl::Status>> broken_until_
      ABSL_GUARDED_BY(mu_);
  std::map<std::tuple<base::WorkerId, int, int, uint64_t>, std::shared_ptr<Comm>> recv_comms_
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
  bool in_flight_ ABSL_GUARDED_BY(queue_mu_) = false;  // NCCL sends or stream-ordered receives
  std::map<std::pair<base::WorkerId, uint64_t>, std::vector<uint64_t>> releases_ ABSL_GUARDED_BY(queue_mu_);
  std::vector<std::pair<base::WorkerId, wire::Request>> outbox_ ABSL_GUARDED_BY(queue_mu_);

  // Stream-ordered receives, oldest first (by seq). One poll at a time
  // (the background thread's or a Settle's): it alone destroys events.
  absl::Mutex poll_mu_;
  absl::Mutex pending_mu_;
  std::deque<Pending> pending_ ABSL_GUARDED_BY(pending_mu_);
  uint64_t next_pending_ ABSL_GUARDED_BY(pending_mu_) = 1;
  // By group: the first failure and when it was found; kept until Forget
  // (or, should nobody forget it, ten times the timeout).
  std::map<int64_t, std::pair<absl::Status, absl::Time>> failures_ ABSL_GUARDED_BY(pending_mu_);
  std::thread background_;
};

}  // namespace remora::channel
