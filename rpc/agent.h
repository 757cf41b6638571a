// The RPC agent: one per process, a named participant in a group.
//
// Every agent runs a gRPC server (callback API) and keeps one channel per
// peer. The master agent listens at a known address; worker agents register
// with it (name, address, host id) and every participant receives the same
// address book with stable ids: the master is 0, workers are 1..N in the
// order the master lists them.
//
//   AgentOptions opts;                       // worker side
//   opts.name = "worker1";
//   opts.master_address = "127.0.0.1:29500";
//   auto agent = Agent::Start(opts, registry);
//   (*agent)->Join();                        // blocks until the group formed
//   (*agent)->WaitForShutdown();             // serve until the master ends it
//
//   auto y = agent->rpc_sync("worker1", "add", {x, x});
//   RRef m = agent->remote("worker1", "Linear", {4, 2}).value();
//   auto z = m.rpc_sync("forward", {x});
//
// Calls are PyTorch's: rpc_sync, rpc_async (a Future), remote (an RRef at
// once). Functions and modules are found by name in the callee's Registry.
// A remote failure completes the caller's future with an error that names
// the worker and carries the original message. Callbacks and handlers run
// on the agent's thread pool, never on gRPC's threads.
//
// Thread-safety: all public methods may be called from any thread after
// Start(). Ownership: the caller owns the Agent; destroying it shuts down
// without ceremony (call Shutdown() first for the graceful protocol).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "base/ids.h"
#include "channel/stats.h"
#include "rpc/autograd_hooks.h"
#include "rpc/future.h"
#include "rpc/registry.h"
#include "rpc/rref.h"
#include "rpc/tls.h"

namespace grpc {
class CompletionQueue;
}  // namespace grpc

namespace remora::rpc {

class DispatchTable;

// Takes the next event of `cq`, polling for up to `spin` before sleeping:
// how rpc_sync waits for its reply (AgentOptions::sync_spin). False when
// `cq` is shut down and drained.
bool NextPolling(grpc::CompletionQueue* cq, absl::Duration spin, void** tag, bool* ok);

inline constexpr char kDefaultMasterAddress[] = "127.0.0.1:29500";
// The longest AgentOptions::busy_poll.
inline constexpr absl::Duration kMaxBusyPoll = absl::Milliseconds(10);

struct AgentOptions {
  // This participant's name: 1 to 128 characters of [A-Za-z0-9_:-].
  std::string name;
  // Where this agent's server listens. Port 0 picks a free port. Workers
  // default to a free port on 127.0.0.1; the master listens here and
  // `master_address` is ignored for it.
  std::string listen_address = "127.0.0.1:0";
  // Where the master listens (workers register there).
  std::string master_address = kDefaultMasterAddress;
  // Set on the master only: the workers that must join, in id order.
  bool is_master = false;
  std::vector<std::string> workers;

  // How long a worker keeps trying to reach the master, and how long the
  // master waits for all workers to join.
  absl::Duration connect_timeout = absl::Seconds(60);
  // Default per-call timeout (PyTorch's default is also 60 s).
  absl::Duration rpc_timeout = absl::Seconds(60);
  // Bound on the graceful shutdown protocol.
  absl::Duration shutdown_timeout = absl::Seconds(60);
  // Worker: how long the master may stay unreachable while the worker waits
  // for the group to end before the worker gives up (it pings the master
  // every second). Zero waits forever.
  absl::Duration master_timeout = absl::Seconds(10);
  // Threads that run request handlers and callbacks. Handlers may block on
  // nested calls (to_here inside a stage), so keep a few spare.
  int num_threads = 16;
  // Largest message accepted or sent, both ends (default 2 GiB - 1).
  int max_message_bytes = 0x7fffffff;
  // A shared secret. When set, every call this agent makes carries it and
  // every call it serves must carry it too; others are rejected
  // (UNAUTHENTICATED, logged, nothing runs). The token travels in clear
  // text on an insecure channel: it keeps strangers on an open port out,
  // it does not hide traffic (use `tls` for that).
  std::string token;

  // Out-of-band payloads. Tensors of at least `oob_threshold_bytes` travel
  // outside the gRPC message on the best channel to the peer: shared
  // memory between processes on one host (`shared_memory`, unless the
  // environment sets REMORA_SHM=0), else in the message. `shm_max_bytes`
  // bounds this process's segments; beyond it payloads go inline.
  size_t oob_threshold_bytes = 64 * 1024;
  bool shared_memory = true;
  size_t shm_max_bytes = size_t{1} << 30;
  // rpc_sync polls for its reply this long before it sleeps (environment:
  // REMORA_SYNC_SPIN_US, 0 turns it off). On the 2-core development VM a
  // thread woken from sleep by the reply cost 20-40 us of a ~100 us round
  // trip: paired runs of rpc_bench measured medians of 56-76 us with 200 us
  // of polling against 92-114 us without. A call that takes longer wastes
  // at most this much CPU.
  absl::Duration sync_spin = absl::Microseconds(200);
  // rpc_sync (and RRef::rpc_sync, to_here) reuse long-lived gRPC streams
  // to the peer (rpc/stream.h) instead of opening a unary gRPC call each
  // time. rpc_bench medians in paired runs: about 10 us lower in quiet
  // minutes, 45-117 us against 127-247 us in slow ones
  // (docs/measurements.md, "Streams and Abseil's deadlock detection").
  // False (or REMORA_STREAMS=0): unary calls only. Asynchronous calls are
  // always unary.
  bool streams = true;
  // Calls that do not wait on their own thread (rpc_async, remote, control
  // messages, replies to them) to a peer on this host travel on a local
  // link (rpc/link.h: a Unix-domain socket, read by one thread on each
  // end) instead of a unary gRPC call, when both ends use shared memory
  // and neither uses TLS. False (or REMORA_LINKS=0): gRPC only.
  bool local_links = true;
  // How long the threads that wait for a peer's messages keep looking for
  // the next one before they sleep: the local links' readers, the compute
  // lane and one idle pool thread at a time (each yields its core while it
  // looks); a pipeline's master polls its step's replies as long. A
  // message to a thread that is awake skips the wake-up (on a VM, a halted
  // vCPU's): on the 2-core VM, pipeline_bench's boundary with each worker
  // pinned (--cpus auto) and every process polling 1 ms took 86-102 us a
  // micro-batch at M=8 and 215-301 us at M=1, against 238-245 and 703-735
  // us without, three pairs (docs/measurements.md, "Busy-polling reaches
  // the pool and the master"). It costs the cores it spins on: for hosts
  // with cores to spare beside their workers' compute (as NCCL's proxy
  // threads spend one). Zero (the default): threads sleep at once. At most
  // kMaxBusyPoll; environment: REMORA_BUSY_POLL_US.
  absl::Duration busy_poll = absl::ZeroDuration();
  // TLS or mutual TLS for this agent's server and its channels (see
  // rpc/tls.h); empty: plaintext. Every member of a group must use the same
  // mode and certificates from the same CA.
  TlsOptions tls;

  // Devices (channel/devices.h). `device` is this agent's home device, "cpu"
  // or "cuda:N": shards it constructs live there (worker --device), and
  // peers learn it at rendezvous. `device_maps[peer][src] = dst` (PyTorch's
  // set_device_map): a tensor on this process's CUDA device `src` sent to
  // `peer` lands on the peer's device `dst` ("cuda:N" or "cpu"); a CUDA
  // tensor without an entry is an error at send time, unless
  // `map_to_peer_devices` sends it to the peer's home device. CPU tensors
  // always land on the CPU.
  std::string device = "cpu";
  std::map<std::string, std::map<std::string, std::string>> device_maps;
  bool map_to_peer_devices = false;
  // CUDA tensors of any size travel on the CUDA channel (channel/cuda/cuda_channel.h):
  // CUDA IPC to another process on the same GPU, NCCL to another GPU. False
  // (or REMORA_CUDA_CHANNEL=0) stages them through host memory instead.
  bool cuda_channel = true;
  // This process's host identity (channel/route.h, HostIdentity): empty
  // detects it (host name, boot, network namespace), unless REMORA_HOST_ID
  // is set. Peers with another host identity never share memory with it.
  // Containers that share a kernel but stand for separate hosts, or share
  // a host but not a network namespace, say so here (worker --host-id).
  std::string host_id;
};

class Agent final {
 public:
  // Starts the server and returns at once. The registry must outlive the
  // agent and must not change after this.
  static absl::StatusOr<std::unique_ptr<Agent>> Start(AgentOptions options,
                                                      const Registry* registry);
  ~Agent();

  // Rendezvous. Worker: registers with the master, retrying until
  // connect_timeout, and receives the address book. Master: waits until
  // every listed worker registered; fails as soon as each has either
  // joined or been refused (a name not listed, a wrong token), or at
  // connect_timeout, naming who is missing and who was refused and why,
  // and tells the workers that joined to exit. Blocks; call once.
  absl::Status Join();
  // Master, from another thread while Join waits: no group will form
  // (`why`: a worker process it started has exited), so Join gives up now
  // with `why` instead of waiting for connect_timeout. Nothing once the
  // group has formed.
  void StopJoining(const absl::Status& why);

  // --- calls -----------------------------------------------------------
  absl::StatusOr<c10::IValue> rpc_sync(const std::string& to,
                                       const std::string& function,
                                       std::vector<c10::IValue> args = {},
                                       CallOptions options = {});
  Future<c10::IValue> rpc_async(const std::string& to, const std::string& function,
                                std::vector<c10::IValue> args = {},
                                CallOptions options = {});
  // Runs `function` (or constructs module type `function`) on `to` and keeps
  // the result there. Returns at once; errors appear on the RRef.
  absl::StatusOr<RRef> remote(const std::string& to, const std::string& function,
                              std::vector<c10::IValue> args = {},
                              CallOptions options = {});
  // PyTorch's RRef(value): an RRef owned by this process.
  RRef local_rref(c10::IValue value);

  // --- group -----------------------------------------------------------
  // How long rpc_sync polls for a reply before sleeping (AgentOptions::sync_spin
  // or REMORA_SYNC_SPIN_US).
  absl::Duration sync_spin() const;
  const base::WorkerInfo& self() const { return self_; }
  // The channel that carries large tensors on `device` of this process to
  // `name`: for CPU tensors "shm" or "grpc"; for CUDA tensors "cuda_ipc",
  // "nccl", or "staged:shm" / "staged:grpc" (copied through host memory),
  // or the device-map error that sending one would give.
  absl::StatusOr<std::string> channel_to(const std::string& name,
                                         const std::string& device = "cpu") const;
  // Shared-memory counters (segments, reads, writes) of this agent.
  channel::ShmStats shm_stats() const;
  // CUDA channel counters, and why the channel is off here (empty when on).
  channel::CudaStats cuda_stats() const;
  std::string cuda_disabled_reason() const;
  // Waits, for at most the rpc_timeout, until the copies of the CUDA
  // tensors received here so far in stream group `group`
  // (CallOptions::stream_group) have completed on the GPU; an error names
  // the sender of one of them that failed or is late, or says that a copy
  // that never completed blocks this process's GPU work. Call it before
  // the host reads what was computed from them (a loss, a count) or an
  // optimizer applies their gradients. OK at once when there are none.
  absl::Status settle_cuda_receives(int64_t group);
  // The group is over: drops the failure settle_cuda_receives reports for
  // it (distributed autograd calls it when it releases a context).
  void forget_cuda_receives(int64_t group);
  std::vector<base::WorkerInfo> workers() const;
  absl::StatusOr<base::WorkerInfo> worker(const std::string& name) const;
  const AgentOptions& options() const { return options_; }
  const Registry& registry() const { return *registry_; }
  // The pool that runs handlers and callbacks (for futures of async work).
  Executor* executor() const;
  // How long this agent's threads busy-poll before they sleep
  // (AgentOptions::busy_poll, or REMORA_BUSY_POLL_US): also how long a
  // caller waiting for replies may poll for them (rpc::PollForOutcome).
  absl::Duration busy_poll() const;
  // The pool's lane (ThreadPool::lane): one thread that runs the actions of
  // the compute lane (runtime/compute_lane.h) that are given their turn
  // without a thread waiting for it, a pipeline's forward and backward
  // passes. Always the same thread, so that a GPU library's per-thread state
  // (cuDNN's execution plans) and LibTorch's OpenMP team are built once,
  // not on each pool thread that happens to run a pass. REMORA_LANE=0 in
  // the environment: the pool instead (for comparing).
  Executor* lane() const;
  // Port the server listens on (useful after listening on port 0).
  int port() const { return port_; }
  RRefStats rref_stats() const;
  // Calls this agent is serving or waiting for right now.
  int64_t active_calls() const;
  // Requests this agent has sent since it started, by kind: calls as
  // "function 'NAME'" or "method 'NAME'", fetches as "to_here", control
  // messages by their request kind (e.g. "remora.wire.UserDeleteRequest").
  // Replies are not counted. Thread-safe.
  std::map<std::string, int64_t> sent_messages() const;
  // Streams this agent opened for rpc_sync (AgentOptions::streams), ever.
  int64_t streams_opened() const;
  // Calls this agent sent on local links (AgentOptions::local_links), ever.
  int64_t calls_on_links() const;

  // The request kinds this agent serves (rpc/dispatch.h). A subsystem above
  // rpc/ registers its own kinds here; call before Join().
  DispatchTable& requests();

  // Installs distributed autograd (see autograd/); call before Join().
  void set_autograd(std::unique_ptr<AutogradHooks> hooks) { autograd_ = std::move(hooks); }
  AutogradHooks* autograd() const { return autograd_.get(); }

  // --- shutdown --------------------------------------------------------
  // Master: graceful shutdown of the whole group. Deletes outstanding RRef
  // users everywhere, waits for their messages to drain, then repeats a
  // barrier until no call is in flight on any participant, tells every
  // worker to stop, and stops. A participant that does not answer within
  // shutdown_timeout makes this return an error naming it (after stopping
  // anyway). Worker: waits until the master ends the group, then stops; an
  // error when the master is gone, or when this worker must be restarted
  // (RequireRestart).
  // `graceful` false skips the protocol and stops at once.
  absl::Status Shutdown(bool graceful = true);
  // Worker: this process cannot go on: Shutdown's wait ends within about a
  // second with an error saying `why`, so that the worker program exits
  // non-zero and elastic training (master --max-restarts, whose liveness
  // probe hears `why` meanwhile) replaces it as a lost worker, by a spare
  // or by the process its supervisor restarts. The first `why` is kept.
  void RequireRestart(const absl::Status& why);
  // "worker 'NAME' must be restarted: " and RequireRestart's `why`, else
  // the same while this process's GPU work waits behind a CUDA IPC copy
  // that never completed (CudaChannel::Stuck: its producer died mid-copy;
  // asked afresh each time, so a copy that completes after all lets the
  // process go on); OK while it can go on.
  absl::Status restart_required() const;
  // Master: ends the group because of `why` (the run failed), without the
  // graceful protocol: tells every worker to stop with `why` as its error
  // (best effort, at most about 2 s; before the group formed, the workers
  // that registered so far), then stops. Elsewhere the same as
  // Shutdown(false).
  void Abort(const absl::Status& why);
  // Master: Abort's telling alone (the workers stop with `why`, at most
  // about 2 s) without stopping here, for a process that exits right after
  // (the master stopped by `signal`, while its main thread still uses the
  // agent: the workers then exit as stopped by it too). Elsewhere nothing.
  void TellGroupEnded(const absl::Status& why, int signal = 0);
  // Worker: the signal that stopped the master where it ended the group
  // for that (TellGroupEnded's `signal`; also when Join failed as the
  // master was stopped before the group formed), else 0.
  int group_ended_by_signal() const;
  // Worker: blocks until the master ended the group (then call Shutdown),
  // or returns UNAVAILABLE naming the master once it has not answered for
  // master_timeout.
  absl::Status WaitForShutdown();

  // --- elastic membership (master) ---------------------------------------
  // Worker `name` is lost (it died or stopped answering): the graceful
  // shutdown no longer waits for it, nothing here or on the other members
  // (told, up to 2 s each) waits on its RRefs any more, and a process that
  // registers under its name from now on takes its place in the group (the
  // same id, its own address), which every member is told. NotFound for a
  // name that is not a worker of the group.
  absl::Status MarkLost(const std::string& name);
  // Waits until a process has registered under the lost worker `name` and
  // every other member that answers knows its address; DeadlineExceeded
  // naming it after `timeout`.
  absl::Status AwaitRejoin(const std::string& name, absl::Duration timeout);
  // Whether worker `name` is lost and has not registered again.
  bool IsLost(const std::string& name) const;

  // --- names -----------------------------------------------------------
  // The name of member `id` ("worker#7" when unknown), and whether `id` is
  // a member of the group.
  std::string NameOf(base::WorkerId id) const;
  bool IsKnown(base::WorkerId id) const;

  // Internal to rpc/ and the subsystems that register request kinds: the
  // implementation (rpc/agent_impl.h), which sends control messages.
  class Impl;
  Impl& impl() const { return *impl_; }

 private:
  Agent(AgentOptions options, const Registry* registry);

  AgentOptions options_;
  const Registry* registry_;
  base::WorkerInfo self_;
  int port_ = 0;
  std::shared_ptr<RRefContext> rrefs_;
  std::unique_ptr<AutogradHooks> autograd_;  // before impl_: outlives the pool
  std::unique_ptr<Impl> impl_;
};

}  // namespace remora::rpc
