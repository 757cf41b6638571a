// The CUDA channel: CUDA tensors between processes without a trip through
// host memory. gRPC carries a descriptor (wire::CudaPayload); the bytes go
// GPU to GPU:
//
//   CUDA IPC (the peer is another process on this host, same GPU):
//     sender                                receiver
//     cudaIpcGetMemHandle(allocation)       open the handle (cached per
//     record an IPC event after the            allocation and sender), wait
//       producer's work                        on the sender's event, copy
//     hold the tensor  ---- descriptor --->    into a tensor of its own,
//     free it on CudaRelease  <-- release --   wait for the copy, release
//
//   NCCL (different GPUs, this host or another):
//     one communicator per direction and device pair (sender rank 0,
//     receiver rank 1), created lazily by the sender, which sends the
//     ncclUniqueId in an NcclSetup request; both initialise concurrently.
//     Each communicator has its own CUDA stream and a sequence: the sender
//     numbers its ncclSends as it enqueues them, the descriptor carries the
//     number, and the receiver posts ncclRecvs strictly in that order
//     (messages may arrive in any order). One direction per communicator
//     means neither end ever waits for its own opposite transfer (two
//     processes sending large tensors to each other through one 2-rank
//     communicator could each block in ncclSend until the other posted its
//     receive), and exactly one process ever creates a given communicator,
//     so no "lower id creates" tie-break or crossing set-ups are needed.
//     Every NCCL call on a communicator (creation, each send or receive) is
//     made by that communicator's own lane thread, in sequence order, each
//     settled before the next, and the lane alone aborts it: before NCCL
//     2.19 an unfinished non-blocking call's state lives with the calling
//     thread, and a first send stays "in progress" until the receiver posts
//     its receive (NCCL connects lazily). Callers only queue transfers: a
//     frame with several CUDA tensors leaves at once. Frames with CUDA
//     payloads are received on threads of their own, never on the pool's
//     or gRPC's (a receive waits for the transfers before it), and a frame
//     that fails abandons its later CUDA payloads at once (Abandon).
//
// Ordering with the computation (which of the two below a build uses is
// decided by cmake/RemoraCuda.cmake). Sender: the transfer waits for the work
// that produced the tensor: with LibTorch's CUDA API (REMORA_TORCH_CUDA), an
// event recorded on LibTorch's current stream of that device; without it,
// cudaDeviceSynchronize on the host. Receiver: the destination is allocated
// by LibTorch and written only after LibTorch's earlier work on that device
// (same event or device synchronisation), and the receiver waits on the host
// until the bytes are there before the tensor reaches any kernel. That wait
// is also where failures surface: a transfer that does not complete within
// Options::timeout, or a communicator that reports an error
// (ncclCommGetAsyncError), fails the call with a message naming the peer,
// and the communicator is aborted (ncclCommAbort) on both ends; the next
// transfer opens a new one. Nothing waits forever.
//
// Stream-ordered receives (a descriptor with a stream_group, from
// CallOptions::stream_group; with LibTorch's CUDA API, and by default
// only NCCL's, between GPUs: Options::stream_receives): the receiver does
// not wait on the host. LibTorch's current stream of the receiving thread
// (the device's default stream, shared by the handlers' threads) waits for
// the copy on the GPU (cudaStreamWaitEvent), so the handler queues its
// kernels while the producer's still run. The background thread watches the copy: it
// releases the sender's IPC buffer once the copy is done (the mapping it
// reads stays open until then) and keeps a failure, or a copy late past
// Options::timeout (an NCCL communicator is then aborted, which ends its
// kernel), for Settle(group), which the receiving code calls before the
// host reads anything computed from the group's tensors. A CUDA IPC copy
// whose producer process died before its event completed may never
// complete (the driver gives no way to abort it), and the stream that
// waits for it is then stuck: every Settle fails saying so until it
// completes, and the process must be restarted (Stuck() says so, and with
// it Agent::restart_required). Such waits are the one
// exception to "nothing waits forever" above.
//
// Zero-byte payloads, peers without the channel, agents in one process and
// any failure to set a route up (for example IPC on memory that cannot be
// shared) fall back to staging through host memory: the tensor is copied to
// the CPU and travels like any CPU payload (shared memory or gRPC); the
// receiver copies it to its device.
//
// Built only with REMORA_WITH_CUDA (cmake/RemoraCuda.cmake); without it the
// channel is off and stages everything (channel/cuda/stub.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "base/ids.h"
#include "channel/channel.h"
#include "channel/stats.h"
#include "channel/devices.h"
#include "proto/agent.pb.h"

namespace remora::channel {

// Both ends of the CUDA channel for one agent.
//
// Thread-safe. Owned by the agent. Runs one background thread (releases,
// completed NCCL sends and stream-ordered receives, watchdog). Destroying it aborts its communicators
// and closes every handle it opened, except the mappings that copies still
// queued on the GPU read (left open on purpose).
class CudaChannel final : public Channel<wire::CudaPayload> {
 public:
  struct Options {
    // False: offer no GPUs to peers; every CUDA tensor is staged.
    bool enabled = true;
    // The longest any one wait may take: a communicator's set-up, the
    // sequence gap before a transfer, a transfer itself.
    absl::Duration timeout = absl::Seconds(60);
    // An IPC buffer whose call failed and that nobody released for this
    // long is freed (its message was lost); one whose call went through,
    // after 10 times as long (a dead peer never releases it).
    absl::Duration reclaim_after = absl::Minutes(2);
    // Which stream-ordered receives wait on the GPU (channel/devices.h);
    // the agent reads REMORA_CUDA_STREAM_RECEIVES (0: none, 1: all).
    StreamReceives stream_receives = StreamReceives::kBetweenGpus;
  };

  // Counters for tests and logs.
  using Stats = CudaStats;  // channel/stats.h

  // Sends a control request (NcclSetup, NcclAbort, CudaRelease) to `peer`
  // and waits for its reply; an error reply is an error.
  using Control =
      std::function<absl::Status(base::WorkerId peer, wire::Request request, absl::Duration timeout)>;

  CudaChannel(Options options, Control control);
  ~CudaChannel() override;
  CudaChannel(const CudaChannel&) = delete;
  CudaChannel& operator=(const CudaChannel&) = delete;

  // This process's GPUs as peers should see them; no GPUs when the channel
  // is off, and then disabled_reason() says why.
  const base::CudaEndpoint& endpoint() const;
  const std::string& disabled_reason() const;

  // The group, once rendezvous is done. Receiving waits for it.
  void SetGroup(const base::WorkerInfo& self, const std::vector<base::WorkerInfo>& book);
  // A member's new process (elastic rejoin, same id): its endpoint
  // replaces the old one; the old process's NCCL communicators fail and
  // are forgotten (the next transfer sets one up with the new process),
  // and IPC buffers it never released are freed after reclaim_after.
  void UpdatePeer(const base::WorkerInfo& peer);

  // How a tensor on this process's GPU `src` reaches GPU `dst` of `peer`.
  CudaRoute RouteTo(base::WorkerId peer, int src, int dst) const;

  // Sending (before the frame leaves): starts moving `payload` (contiguous,
  // on a GPU of this process) towards GPU `dst` of `peer` and describes it
  // (payload index left 0). nullopt: stage it through host memory instead
  // (no route, or the route failed; failures are logged once per peer).
  std::optional<wire::CudaPayload> Send(base::WorkerId peer, const at::Tensor& payload,
                                        int dst) override;

  // The call that carried `d` failed: it may never be received. NCCL: the
  // communicator is aborted unless the transfer completes shortly. IPC: the
  // buffer is freed after reclaim_after unless released before.
  void Reclaim(base::WorkerId peer, const wire::CudaPayload& d) override;

  // Receiving side: the payload `d` from `peer` will not be received (its
  // frame failed at or before it). IPC: the sender's buffer is released.
  // NCCL: the communicator fails now (later transfers could never be
  // posted) rather than after the timeout. Nothing if it was received.
  void Abandon(base::WorkerId peer, const wire::CudaPayload& d, const std::string& why) override;

  // Receiving: checks `d` (from `peer`, `length` bytes), waits for the bytes
  // and returns them as a uint8 tensor on GPU d.dst_device() of this
  // process, ready for any stream. A stream-ordered `d` (see above) returns
  // before the bytes are there: ready for work queued on LibTorch's
  // current stream of that device on this thread (the device's default
  // stream, which every thread shares unless one sets another), and for
  // the host once Settle of its group has returned OK.
  absl::StatusOr<at::Tensor> Receive(base::WorkerId peer, const wire::CudaPayload& d,
                                     uint64_t length) override;

  // Waits on the host, until `deadline`, for the copies of the
  // stream-ordered receives of `group` (the descriptor's stream_group) made
  // before the call; an error (naming the sender) when one of the group's
  // failed or was late (every Settle of the group until Forget), and while
  // a CUDA IPC copy that never completed blocks this process's stream. OK
  // at once when nothing is pending and the group has no failure.
  absl::Status Settle(int64_t group, absl::Time deadline);
  // Drops what the channel kept for `group` (its failure): the group is
  // over (its distributed autograd context was released).
  void Forget(int64_t group);
  // An error while a CUDA IPC copy that never completed blocks this
  // process's stream (see above: the process must be restarted), else OK.
  absl::Status Stuck();

  // Makes every later call fail fast or stage, aborts the communicators and
  // stops the background thread. The agent calls it while it stops, before
  // the control path goes away.
  void Stop() override;

  // Control requests from peers.
  absl::Status OnNcclSetup(base::WorkerId from, const wire::NcclSetup& setup);
  void OnNcclAbort(base::WorkerId from, const wire::NcclAbort& abort);
  void OnRelease(base::WorkerId from, const wire::CudaRelease& release);

  Stats stats() const;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Device-to-device copy bandwidth of GPU `device` (cudaMemcpy of `bytes`
// within it, best of `reps`), in GB/s of bytes copied: the yardstick for
// rpc_bench --device cuda. An error in builds without the channel.
absl::StatusOr<double> MeasureDeviceCopyGbps(int device, size_t bytes, int reps = 5);

}  // namespace remora::channel
