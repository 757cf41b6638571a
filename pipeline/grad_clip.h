// Global gradient-norm clipping over a pipeline's workers
// (PipelineOptions::clip_grad_norm), for the step runner (runner.cc).
//
// At the end of a batch each worker adds up the squared norms of the
// gradients its stages' parameters got in the batch's distributed autograd
// context, sends that share to the pipeline's other workers
// ("remora.pipeline.grad_norm", one message to each) and waits for theirs;
// then every worker knows the whole model's norm and scales its gradients
// by min(1, max_norm / (norm + 1e-6)), as
// torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) does.
//
// Thread-safety: every function may be called from any thread; the shares
// wait in a process-wide table.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "rpc/agent.h"
#include "rpc/registry.h"

namespace remora::pipeline {

// Clips batch `context`'s gradients here (see above); returns the whole
// model's norm. `peers`: the pipeline's other workers. An error (a context
// unknown here, a share that did not come, the batch abandoned) names the
// worker.
absl::StatusOr<double> ClipGradients(Agent& agent, int64_t runner, const std::vector<std::string>& peers,
                                     int64_t context, double max_norm);

// The batch was abandoned: a ClipGradients waiting for its shares returns
// an error, and its shares are forgotten.
void AbandonGradNorm(int64_t runner, int64_t context);

// Registers "remora.pipeline.grad_norm" (a share from another worker).
absl::Status RegisterGradNormFunction(Registry& registry);

}  // namespace remora::pipeline
