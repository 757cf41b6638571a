// The worker side of data parallelism: one replica's share of a stage
// group's gradient all-reduce.
//
// A worker that hosts stages of replica r of a pipeline belongs to one
// group with the workers hosting the same stages in the other replicas
// (one c10d process group, parallel/process_group.h). The master creates a
// "remora.parallel.GradientGroup" on each of them; every batch it tells the
// group its autograd context ("begin"), runs the replica's forward and
// backward passes, then calls "finish": the gradients of the group's
// parameters in that context are summed over the replicas (the pipeline
// already weighted each micro-batch's loss by its share of the whole
// batch, so the sum is the whole batch's gradient) and written back into
// the context, for the optimizer step.
//
// With overlap on, a stage's sum starts as soon as its last micro-batch's
// backward pass has added its gradients (dist_autograd's marked-backward
// hook), in buckets of at most bucket_bytes, while the pipeline's other
// backward passes go on; "finish" starts what has not started and waits.
// When the group is made, rank 0's parameters are copied to every replica
// (as DDP does), after checking that all replicas hold the same number,
// shapes and types of parameters: a mismatch is an error naming the
// worker, not a hang.
//
// ZeRO-1 (zero = true): the group's parameters are shared out among the
// ranks, each rank keeps the optimizer state of its share only, and
// "finish" also steps: each rank steps its share with the summed
// gradients, then broadcasts it to the others (Gloo in LibTorch 1.13 has
// no reduce-scatter or flat all-gather; the sum is an all-reduce, the
// gather one broadcast per owner, as PyTorch's ZeroRedundancyOptimizer
// does). The master then steps no optimizer of its own.
//
// Module "remora.parallel.GradientGroup"(store_host, store_port, name,
// rank, size, timeout_ms, bucket_bytes, overlap, stage_indices, stage_params
// [, zero, optimizer options]) with stage_params a list (one per stage
// index) of parameter RRefs owned here; methods begin(context_id,
// micro_batches), finish(context_id) -> number of buckets,
// state_bytes() (ZeRO-1's optimizer state here), backend() ("NCCL" or
// "Gloo": the master calls it to wait until the group is made),
// discard(context_id)
// (discard(-1) does nothing). A group whose parameters are on a CUDA device is NCCL's where
// the build has NCCL groups (LibTorch with CUDA), and its buckets are
// summed on that device; otherwise the group is Gloo's and buckets are
// summed in host memory (a CUDA stage's gradients staged through it). The
// stages one worker hosts in a replica must share one device.
//
// Thread-safety: the hook and the methods may run on any threads; a
// group's collectives are issued under its lock, in an order that the
// schedule fixes, the same on every replica.
#pragma once

#include "absl/status/status.h"
#include "rpc/registry.h"

namespace remora::parallel {

// Registers the GradientGroup module and installs the backward hook.
absl::Status RegisterFunctions(rpc::Registry& registry);

}  // namespace remora::parallel
