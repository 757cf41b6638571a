// Parameter-server partitions (master --mode ps --ps-partitions K): the model's
// parameters partitioned over K server processes, each holding its
// partition and an optimizer over exactly those parameters.
//
// A server process is a stock worker hosting the module "remora.ps.Partition":
//
//   partition = remote(server, "remora.ps.Partition", {params, OptionsToDict(opt)})
//   partition.rpc_async("pull")                        -> its parameters
//   partition.rpc_async("push", {round, worker, grads}) -> kept (bool)
//   partition.rpc_async("norm", {round, workers, scale}) -> its squared share
//   partition.rpc_async("apply", {round, workers, scale, clip})
//   partition.rpc_async("state") -> (params, optimizer archive); "load" back
//
// Compute workers pull from and push to every partition themselves
// (ps/replica.h, "compute_partitioned"): the parameters and gradients do not
// pass through the master. The master (ps::ParameterServer, through a
// PartitionSet) tells each partition which workers' gradients to apply for a round:
// the partition sums them in that order (as the single server does), scales
// them and steps. Pushes for a round at or before the last one applied are
// discarded (a straggler's late gradients); a round left behind unapplied
// (redone after a lost worker) is dropped with the next apply. Since the
// optimizers are per parameter (SGD, momentum, Adam), the K partitioned
// steps equal the whole model's step in one process.
//
// Thread-safety: a partition's methods run one at a time (the registry holds
// its lock). PartitionSet: one call at a time (the parameter server's training
// thread). Ownership: a PartitionSet holds RRefs to its partitions (freed on the
// servers when it and the replicas' copies are gone); the agent must
// outlive it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "optim/distributed_optimizer.h"
#include "rpc/agent.h"
#include "rpc/registry.h"

namespace remora::ps {

inline constexpr char kPartitionType[] = "remora.ps.Partition";

// Partitions tensors of `bytes` over `k` partitions balanced by bytes, each
// tensor whole: the largest first (the lowest index among equals) to the
// partition holding the fewest bytes so far (the lowest index among equals).
// Deterministic. Returns each partition's indices, ascending.
std::vector<std::vector<int64_t>> PartitionByBytes(const std::vector<int64_t>& bytes, int k);

// The partitions' optimizer states (optim::SaveOptimizerState's bytes) packed
// into one record, the checkpoint's optimizer entry with partitions: pickled
// {"ps_shards": k, "shards": [state dict, ...]} (the format's first names
// for the partitions, kept so that older records read); the number of partitions a
// record holds (0: a single server's own state); and the states back (an
// error, saying what to give, when the record holds another number). Older
// records (LibTorch archives) are read too.
at::Tensor PackPartitionStates(const std::vector<at::Tensor>& states);
int SavedPartitions(const at::Tensor& record);
absl::StatusOr<std::vector<at::Tensor>> UnpackPartitionStates(const at::Tensor& record, int k);

// One server's share of the model.
struct PartitionPlacement {
  std::string server;
  std::vector<int64_t> params;  // indices into the model's parameters
  int64_t bytes = 0;
};

class PartitionSet {
 public:
  // Places on each of `servers` a partition holding its partition of `params`
  // (their current values) with an optimizer of `optimizer` over it. An
  // error names the server that failed.
  static absl::StatusOr<std::unique_ptr<PartitionSet>> Create(rpc::Agent& agent, const std::vector<std::string>& servers,
                                                          const std::vector<at::Tensor>& params,
                                                          const optim::OptimizerOptions& optimizer);

  const std::vector<PartitionPlacement>& placement() const { return placement_; }
  // The partitions, in placement()'s order (what a replica pulls from).
  const std::vector<rpc::RRef>& partitions() const { return partitions_; }

  // Every partition steps with the gradients `workers` pushed for `round`,
  // summed in that order and multiplied by `scale` (unless 1), then by
  // `clip` (unless 1: clipping's coefficient, in the gradients' float).
  absl::Status Apply(int64_t round, const std::vector<std::string>& workers, double scale, double clip = 1);
  // The norm over the whole model of the gradients Apply would step with
  // (each partition's squared share, added in partition order): for clipping.
  absl::StatusOr<double> GradNorm(int64_t round, const std::vector<std::string>& workers, double scale) const;
  // Each partition's parameters, as it holds them (CPU copies).
  absl::StatusOr<std::vector<std::vector<at::Tensor>>> Parameters() const;
  // Copies every partition's parameters into `params` (the model's, in order).
  absl::Status Gather(std::vector<at::Tensor>& params) const;
  // The partitions' optimizer states as one record (PackPartitionStates); and the
  // parameters' values and such a record (or undefined) back to the partitions.
  absl::StatusOr<at::Tensor> OptimizerState() const;
  absl::Status Load(const std::vector<at::Tensor>& params, const at::Tensor& optimizer);
  // OK while every server answers (within 4 s); else an error naming the
  // first that does not.
  absl::Status Check() const;

 private:
  PartitionSet(std::vector<PartitionPlacement> placement, std::vector<rpc::RRef> partitions)
      : placement_(std::move(placement)), partitions_(std::move(partitions)) {}

  // Calls `method` on every partition at once; waits for all. The error names
  // the server and says that the job cannot go on without it.
  absl::StatusOr<std::vector<c10::IValue>> CallAll(const std::string& method,
                                                   const std::vector<std::vector<c10::IValue>>& args,
                                                   const std::string& what, rpc::CallOptions options = {}) const;

  std::vector<PartitionPlacement> placement_;
  std::vector<rpc::RRef> partitions_;
};

// Registers "remora.ps.Partition" in a worker's registry.
absl::Status RegisterPartition(rpc::Registry& registry);

}  // namespace remora::ps
