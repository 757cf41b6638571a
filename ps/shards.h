// Parameter-server shards (master --mode ps --ps-shards K): the model's
// parameters partitioned over K server processes, each holding its
// partition and an optimizer over exactly those parameters.
//
// A server process is a stock worker hosting the module "remora.ps.Shard":
//
//   shard = remote(server, "remora.ps.Shard", {params, OptionsToDict(opt)})
//   shard.rpc_async("pull")                        -> its parameters
//   shard.rpc_async("push", {round, worker, grads}) -> kept (bool)
//   shard.rpc_async("norm", {round, workers, scale}) -> its squared share
//   shard.rpc_async("apply", {round, workers, scale, clip})
//   shard.rpc_async("state") -> (params, optimizer archive); "load" back
//
// Compute workers pull from and push to every shard themselves
// (ps/replica.h, "compute_sharded"): the parameters and gradients do not
// pass through the master. The master (ps::ParameterServer, through a
// ShardSet) tells each shard which workers' gradients to apply for a round:
// the shard sums them in that order (as the single server does), scales
// them and steps. Pushes for a round at or before the last one applied are
// discarded (a straggler's late gradients); a round left behind unapplied
// (redone after a lost worker) is dropped with the next apply. Since the
// optimizers are per parameter (SGD, momentum, Adam), the K partitioned
// steps equal the whole model's step in one process.
//
// Thread-safety: a shard's methods run one at a time (the registry holds
// its lock). ShardSet: one call at a time (the parameter server's training
// thread). Ownership: a ShardSet holds RRefs to its shards (freed on the
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

inline constexpr char kShardType[] = "remora.ps.Shard";

// Partitions tensors of `bytes` over `k` shards balanced by bytes, each
// tensor whole: the largest first (the lowest index among equals) to the
// shard holding the fewest bytes so far (the lowest index among equals).
// Deterministic. Returns each shard's indices, ascending.
std::vector<std::vector<int64_t>> PartitionByBytes(const std::vector<int64_t>& bytes, int k);

// The shards' optimizer states (optim::SaveOptimizerState's bytes) packed
// into one record, the checkpoint's optimizer entry with shards: pickled
// {"ps_shards": k, "shards": [state dict, ...]}; the number of shards a
// record holds (0: a single server's own state); and the states back (an
// error, saying what to give, when the record holds another number). Older
// records (LibTorch archives) are read too.
at::Tensor PackShardStates(const std::vector<at::Tensor>& states);
int SavedShards(const at::Tensor& record);
absl::StatusOr<std::vector<at::Tensor>> UnpackShardStates(const at::Tensor& record, int k);

// One server's share of the model.
struct ShardPlacement {
  std::string server;
  std::vector<int64_t> params;  // indices into the model's parameters
  int64_t bytes = 0;
};

class ShardSet {
 public:
  // Places on each of `servers` a shard holding its partition of `params`
  // (their current values) with an optimizer of `optimizer` over it. An
  // error names the server that failed.
  static absl::StatusOr<std::unique_ptr<ShardSet>> Create(rpc::Agent& agent, const std::vector<std::string>& servers,
                                                          const std::vector<at::Tensor>& params,
                                                          const optim::OptimizerOptions& optimizer);

  const std::vector<ShardPlacement>& placement() const { return placement_; }
  // The shards, in placement()'s order (what a replica pulls from).
  const std::vector<rpc::RRef>& shards() const { return shards_; }

  // Every shard steps with the gradients `workers` pushed for `round`,
  // summed in that order and multiplied by `scale` (unless 1), then by
  // `clip` (unless 1: clipping's coefficient, in the gradients' float).
  absl::Status Apply(int64_t round, const std::vector<std::string>& workers, double scale, double clip = 1);
  // The norm over the whole model of the gradients Apply would step with
  // (each shard's squared share, added in shard order): for clipping.
  absl::StatusOr<double> GradNorm(int64_t round, const std::vector<std::string>& workers, double scale) const;
  // Each shard's parameters, as it holds them (CPU copies).
  absl::StatusOr<std::vector<std::vector<at::Tensor>>> Parameters() const;
  // Copies every shard's parameters into `params` (the model's, in order).
  absl::Status Gather(std::vector<at::Tensor>& params) const;
  // The shards' optimizer states as one record (PackShardStates); and the
  // parameters' values and such a record (or undefined) back to the shards.
  absl::StatusOr<at::Tensor> OptimizerState() const;
  absl::Status Load(const std::vector<at::Tensor>& params, const at::Tensor& optimizer);
  // OK while every server answers (within 4 s); else an error naming the
  // first that does not.
  absl::Status Check() const;

 private:
  ShardSet(std::vector<ShardPlacement> placement, std::vector<rpc::RRef> shards)
      : placement_(std::move(placement)), shards_(std::move(shards)) {}

  // Calls `method` on every shard at once; waits for all. The error names
  // the server and says that the job cannot go on without it.
  absl::StatusOr<std::vector<c10::IValue>> CallAll(const std::string& method,
                                                   const std::vector<std::vector<c10::IValue>>& args,
                                                   const std::string& what, rpc::CallOptions options = {}) const;

  std::vector<ShardPlacement> placement_;
  std::vector<rpc::RRef> shards_;
};

// Registers "remora.ps.Shard" in a worker's registry.
absl::Status RegisterShard(rpc::Registry& registry);

}  // namespace remora::ps
