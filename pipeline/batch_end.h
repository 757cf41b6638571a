// What a pipeline's workers exchange at the end of a batch, for the step
// runner (runner.cc) before its optimizer steps; internal to pipeline/.
//
// Tied weights (PipelineOptions::tied_first/tied_last): the worker of the
// first stage and the worker of the last each hold a copy of one weight.
// Each sends the gradient its copy got in the batch to the other
// ("remora.pipeline.tied_grad") and waits for the other's; both then set
// first's + last's (in that order, so the two sums are bitwise equal).
//
// Gradient-norm clipping (PipelineOptions::clip_grad_norm): each worker
// adds up the squared norms of the gradients its stages' parameters got in
// the batch's distributed autograd context, sends that share to the
// pipeline's other workers ("remora.pipeline.grad_norm", one message to
// each) and waits for theirs; then every worker knows the whole model's
// norm and scales its gradients by min(1, max_norm / (norm + 1e-6)), as
// torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) does.
//
// What comes from other workers waits in a process-wide table by (runner,
// batch) until the runner takes it; a batch abandoned (AbandonBatchEnd)
// wakes its waits with an error.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "rpc/agent.h"
#include "rpc/registry.h"

namespace remora::pipeline {

// The copies of a tied weight on this worker: `first` where the first
// stage is here, `last` where the last is (undefined where not).
struct TiedCopies {
  at::Tensor first, last;
  std::string first_worker, last_worker;  // where each copy lives
  int64_t last_stage = 0;
  bool any() const { return first.defined() || last.defined(); }
};

// Sums the gradients of batch `context` of the tied weight's two copies
// (see above) and sets the sum on the copies here. An error (a context
// unknown here, the other copy's gradient did not come or has another
// shape, the batch abandoned) names the worker.
absl::Status SumTiedGradients(rpc::Agent& agent, int64_t runner, const TiedCopies& tied, int64_t context);

// Clips batch `context`'s gradients here (see above); returns the whole
// model's norm. `peers`: the pipeline's other workers. `counted_elsewhere`:
// a parameter whose gradient another counts (a tied weight's last copy),
// or undefined. An error (a context unknown here, a share that did not
// come, the batch abandoned) names the worker.
absl::StatusOr<double> ClipGradients(rpc::Agent& agent, int64_t runner, const std::vector<std::string>& peers,
                                     int64_t context, double max_norm, const at::Tensor& counted_elsewhere);

// The batch was abandoned: a wait above for its messages returns an error,
// and what came for it is forgotten.
void AbandonBatchEnd(int64_t runner, int64_t context);

// Registers "remora.pipeline.grad_norm" and "remora.pipeline.tied_grad"
// (what other workers send).
absl::Status RegisterBatchEndFunctions(rpc::Registry& registry);

}  // namespace remora::pipeline
