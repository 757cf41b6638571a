// Collectives between processes on c10d, LibTorch's own engine: Gloo
// process groups (CPU tensors) or NCCL process groups (CUDA tensors, one
// device per member) that meet through a store: the master's keys over
// remora's agents (GroupOptions::agent, parallel/rpc_store.h), or a
// TCPStore.
//
// The master hosts the store (RegisterStoreFunctions in its registry; or a
// StoreServer, on its listen address, on a port the system picks); each
// member joins a group by name with its rank
// (ProcessGroup::Join), which returns once all members have joined. Every
// member must issue the same collectives in the same order; a member that
// died or stalled makes the others' collectives fail after the group's
// timeout, with an error naming the group, instead of blocking them.
//
//   auto store = parallel::StoreServer::Start("127.0.0.1").value();   // master
//   parallel::GroupOptions g{store->host(), store->port(), "stage0", rank, 2};
//   auto group = parallel::ProcessGroup::Join(g).value();             // members
//   parallel::Collective c = group->AllReduceSum(flat);
//   ... other work ...
//   RETURN_IF_ERROR(c.Wait());                                        // flat holds the sum
//
// Builds without Gloo (REMORA_WITH_GLOO unset: LibTorch or libgloo-dev
// lacking) fail Join and Start with Unimplemented. Every group is first a
// Gloo group. Members whose tensors are on CUDA devices
// (GroupOptions::cuda_device) then also make an NCCL group, used for every
// collective, where this build has NCCL groups (HaveNcclGroups: LibTorch
// built with CUDA) and no two members are on one GPU (NCCL needs a device
// per member; the members compare their machines' boot ids and their
// devices' PCI addresses over Gloo first). Otherwise the collectives stay
// Gloo's and take host tensors; on_device() says which. NCCL's collectives
// wait with TORCH_NCCL_BLOCKING_WAIT=1 (set unless the environment says
// otherwise), so a dead or stalled member fails them after the timeout, as
// with Gloo, instead of blocking.
//
// Thread-safety: a ProcessGroup may be used from several threads, but the
// order of collectives must be the same on every member. Ownership: the
// store lives as long as its StoreServer; a group as long as its object.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace remora::rpc {
class Agent;
}  // namespace remora::rpc

namespace remora::parallel {

// The host part of HOST:PORT (IPv6 brackets removed).
std::string HostOf(const std::string& address);

// Whether this build has c10d's Gloo backend; its NCCL backend.
bool HaveGloo();
bool HaveNcclGroups();

// The rendezvous store, hosted by the master.
class StoreServer {
 public:
  static absl::StatusOr<std::unique_ptr<StoreServer>> Start(const std::string& host,
                                                            absl::Duration timeout = absl::Seconds(30));
  ~StoreServer();
  const std::string& host() const { return host_; }
  int port() const { return port_; }

 private:
  struct Impl;
  StoreServer(std::string host, int port, std::unique_ptr<Impl> impl);
  std::string host_;
  int port_;
  std::unique_ptr<Impl> impl_;
};

struct GroupOptions {
  std::string store_host;
  int store_port = 0;
  std::string name;  // unique per group within the store
  int rank = 0;
  int size = 1;
  absl::Duration timeout = absl::Seconds(10);  // per collective, and for joining
  int cuda_device = -1;  // this member's CUDA device index, or -1 (CPU tensors)
  // Where the members meet: with `agent`, the master's keys over the
  // group's agents (parallel/rpc_store.h: the token and TLS apply, no port
  // is opened), and Gloo listens on the agent's host; else a TCPStore at
  // store_host:store_port (StoreServer), Gloo on store_host.
  rpc::Agent* agent = nullptr;
};

// A collective in flight; Wait() once.
class Collective {
 public:
  Collective() = default;
  explicit Collective(std::function<absl::Status()> wait) : wait_(std::move(wait)) {}
  absl::Status Wait();

 private:
  std::function<absl::Status()> wait_;
};

class ProcessGroup {
 public:
  // Joins the group (every member must, within options.timeout). The
  // process then ignores SIGPIPE, unless it has a handler of its own:
  // Gloo writes to its peers with writev, which raises SIGPIPE on a
  // connection whose peer died, and the signal's default action ends the
  // process at once and in silence, where the collective would fail with
  // an error naming the peer (Python ignores SIGPIPE, so PyTorch's users
  // never meet this). Programs this process starts through
  // launch::Subprocess get the default action back.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> Join(const GroupOptions& options);
  ~ProcessGroup();

  // Starts summing `tensor` (dense, contiguous; on this member's CUDA
  // device when on_device(), else on the CPU) in place over the group.
  Collective AllReduceSum(at::Tensor tensor);
  // Copies `tensor` of rank `root` into every member's `tensor`.
  absl::Status Broadcast(at::Tensor tensor, int root);

  const GroupOptions& options() const { return options_; }
  // Whether the collectives take CUDA tensors (an NCCL group).
  bool on_device() const;
  // "group 'NAME' (rank R of N)", for messages.
  std::string Describe() const;

 private:
  struct Impl;
  ProcessGroup(GroupOptions options, std::unique_ptr<Impl> impl);
  const GroupOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace remora::parallel
