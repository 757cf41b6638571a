// The worker side of the parameter server (ps/parameter_server.h): the
// module "remora.ps.Replica", a copy of the model that a worker builds from
// the server's stage specs and that computes gradients with the
// parameters the server sends.
//
//   replica = remote(worker, "remora.ps.Replica", MakeReplicaRequest{stages, "cross_entropy"})
//   replica.rpc_async("compute", ComputeRequest{params, inputs, targets, total_rows})
//       -> ComputeReply{grads, weighted loss}
//
// (the calls' structs are in ps/protocol.h)
//
// where inputs may instead be rows this worker reads itself
// (pipeline::ToIValue of a WorkerRows, from a source pipeline::WorkerData
// opened here; targets None): the rows' images and labels are read here.
//
// compute copies `params` (every stage's parameters, in order) into the
// replica, runs the forward and backward passes on its rows in the
// worker's compute lane with the loss weighted by rows / total_rows (so
// the gradients of the shares of a batch sum to the whole batch's, as
// parallel/ weights its replicas), and returns the gradients (zeros for a
// parameter the loss does not reach) and the weighted loss. The replica's
// buffers (BatchNorm's running statistics) are its own and are not sent.
//
// With parameter-server partitions (ps/partitions.h) the factory also takes the
// partitions' RRefs and each one's parameter indices, and
//
//   replica.rpc_async("compute_partitioned", ComputePartitionedRequest{round, inputs, targets, total_rows})
//       -> ComputeReply{no grads, weighted loss}
//
// pulls the parameters from every partition itself, computes as above and
// pushes each partition the gradients of its parameters for `round`; an error
// names the server a pull or push failed on.
//
// Thread-safety: a replica's methods run one at a time (the registry holds
// its lock); SetComputeDelay and ComputeDelay are thread-safe.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pipeline/pipeline.h"
#include "rpc/registry.h"

namespace remora::ps {

inline constexpr char kReplicaType[] = "remora.ps.Replica";

// The losses a replica computes, by name: "mse" (pipeline::MseLoss) and
// "cross_entropy" (pipeline::CrossEntropyLoss); InvalidArgument otherwise.
absl::StatusOr<pipeline::LossFn> LossByName(const std::string& name);

// Stage specs as the replica's factory takes them: a list of
// (kind, name, payload, device) tuples; and back.
// (ps/protocol.h's StageSpecValue tuples; DecodeStageList takes the
// list's elements.)
c10::IValue EncodeStages(const std::vector<pipeline::StageSpec>& stages);
absl::StatusOr<std::vector<pipeline::StageSpec>> DecodeStages(const c10::IValue& encoded);
absl::StatusOr<std::vector<pipeline::StageSpec>> DecodeStageList(c10::ArrayRef<c10::IValue> encoded);

// Every compute call of this process's replicas first sleeps this long
// (worker --slow-ms: a deliberately slow worker, for measuring stragglers
// and backup workers). Zero by default.
void SetComputeDelay(absl::Duration delay);
absl::Duration ComputeDelay();

// Registers "remora.ps.Replica" (methods "compute", "compute_partitioned" and
// "shapes": the parameters' shapes, checked by the server) and
// "remora.ps.Partition" (ps/partitions.h) in a worker's registry.
absl::Status RegisterFunctions(rpc::Registry& registry);

}  // namespace remora::ps
