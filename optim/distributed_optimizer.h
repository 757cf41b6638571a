// DistributedOptimizer: steps parameters that live on many workers, with the
// gradients a distributed autograd context accumulated there (PyTorch's
// torch.distributed.optim.DistributedOptimizer).
//
//   auto params = optim::parameter_rrefs(stage1).value();     // RRefs to parameters
//   auto more = optim::parameter_rrefs(stage2).value();
//   params.insert(params.end(), more.begin(), more.end());
//   auto opt = optim::DistributedOptimizer::Create(
//       *agent, optim::OptimizerOptions::SGD(0.05).set_momentum(0.9), params).value();
//   ... backward(context.id()) ...
//   opt->step(context.id());
//
// It creates one LibTorch optimizer per owner, on that owner, over the
// owner's parameters; step(context_id) steps all owners concurrently with the
// context's gradients (never .grad of other contexts). Optimizer state
// (momentum, Adam moments) lives on the owners and persists across steps.
//
// Thread-safety: step() may be called from any thread, one step at a time.
// Ownership: the optimizer holds RRefs to its per-owner optimizers; they are
// freed on the owners when it is destroyed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <torch/optim/optimizer.h>

#include "absl/status/statusor.h"
#include "optim/lr_schedule.h"
#include "rpc/agent.h"

namespace remora::optim {

struct OptimizerOptions {
  enum class Kind { kSGD, kAdam, kAdamW };

  static OptimizerOptions SGD(double lr) { return OptimizerOptions(Kind::kSGD, lr, 0.0); }
  static OptimizerOptions Adam(double lr) { return OptimizerOptions(Kind::kAdam, lr, 0.0); }
  // AdamW's default weight decay is LibTorch's (0.01); it applies to
  // parameters of two or more dimensions only unless set_decay_all(true).
  static OptimizerOptions AdamW(double lr) { return OptimizerOptions(Kind::kAdamW, lr, 1e-2); }

  OptimizerOptions& set_momentum(double v) { momentum = v; return *this; }
  OptimizerOptions& set_dampening(double v) { dampening = v; return *this; }
  OptimizerOptions& set_weight_decay(double v) { weight_decay = v; return *this; }
  OptimizerOptions& set_nesterov(bool v) { nesterov = v; return *this; }
  OptimizerOptions& set_betas(double b1, double b2) { beta1 = b1; beta2 = b2; return *this; }
  OptimizerOptions& set_eps(double v) { eps = v; return *this; }
  OptimizerOptions& set_amsgrad(bool v) { amsgrad = v; return *this; }
  OptimizerOptions& set_schedule(const LrSchedule& v) { schedule = v; return *this; }
  OptimizerOptions& set_decay_all(bool v) { decay_all = v; return *this; }

  Kind kind;
  double lr;
  double momentum = 0.0, dampening = 0.0, weight_decay;
  bool nesterov = false;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  bool amsgrad = false;
  LrSchedule schedule;  // the rate by step number (lr_schedule.h); constant by default
  // AdamW only: whether biases and norm weights (every parameter of fewer
  // than two dimensions) decay too, as in LibTorch's AdamW over one group.
  // By default they do not, as in nanoGPT and Megatron: the same as two
  // parameter groups, weight_decay on the matrices and 0 on the rest.
  bool decay_all = false;

 private:
  OptimizerOptions(Kind k, double l, double wd) : kind(k), lr(l), weight_decay(wd) {}
};

// The options as they travel to owners (kind, lr, momentum, ...), and the
// LibTorch optimizer they make over `params` (parallel/'s ZeRO-1 shards
// make theirs so too).
// With a schedule (LrSchedule::scheduled()), the optimizer is also a
// ScheduledSteps: before each step it sets every group's rate to
// ScheduledLr(lr, schedule, steps()), and its state dict carries steps() in
// each parameter group as "scheduled_steps", so that loading it (a resume,
// ZeRO-1's shares) goes on with the same rates. AdamW without decay_all
// decays the parameters of two or more dimensions itself and steps with no
// decay (its state dict still says the weight_decay: one group holds all).
c10::Dict<std::string, double> OptionsToDict(const OptimizerOptions& options);
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const c10::impl::GenericDict& options,
                                                       std::vector<at::Tensor> params);

// The steps a scheduled optimizer has taken (see MakeOptimizer).
class ScheduledSteps {
 public:
  virtual ~ScheduledSteps() = default;
  virtual int64_t steps() const = 0;
  virtual void set_steps(int64_t steps) = 0;
};

// The tensors behind a list of parameter RRefs owned by this process;
// throws std::invalid_argument, naming `who`, for any other entry.
std::vector<at::Tensor> OwnedParameters(const c10::IValue& rrefs, const std::string& who);

// An optimizer's state as PyTorch's optimizer.state_dict() lays it out
// ({"state": {i: {...}}, "param_groups": [{"lr": ..., "params": [i, ...]}]},
// parameters numbered in the optimizer's order; SGD, Adam and AdamW), and
// loading one back (throws std::invalid_argument, naming the parameter,
// when it does not fit). Python's `optimizer.load_state_dict` takes it.
c10::IValue OptimizerStateDict(const torch::optim::Optimizer& optimizer);
void LoadOptimizerStateDict(torch::optim::Optimizer& optimizer, const c10::IValue& dict);
// The same pickled (torch.save's legacy format) in a uint8 tensor: what
// checkpoints store; the same state gives the same bytes. Loading also
// takes LibTorch's archive, which older checkpoints hold.
at::Tensor SaveOptimizerState(const torch::optim::Optimizer& optimizer);
void LoadOptimizerState(torch::optim::Optimizer& optimizer, const at::Tensor& bytes);
// Any value pickled into a uint8 tensor, and back (throws for bytes that
// are not a pickle); whether bytes are a LibTorch module archive (what
// remora saved optimizer states as before).
at::Tensor PickleBytes(const c10::IValue& value);
c10::IValue Unpickle(const at::Tensor& bytes);
bool IsModuleArchive(const at::Tensor& bytes);
// Any LibTorch archive as such a uint8 tensor, and the archive back into
// `archive` (throws for bytes that are not one).
at::Tensor ArchiveBytes(torch::serialize::OutputArchive& archive);
void ReadArchive(const at::Tensor& bytes, torch::serialize::InputArchive& archive);

// Bytes of an optimizer's state (SGD's momentum buffers, Adam's moments).
int64_t StateBytes(const torch::optim::Optimizer& optimizer);

// Registers remora.optim.LocalOptimizer, the per-owner optimizer. Every
// worker's registry needs it.
absl::Status RegisterFunctions(rpc::Registry& registry);

// On the owner of `optimizer` (one of DistributedOptimizer::owners()):
// steps it with the gradients that context `context_id` accumulated in this
// process, without a message (what a worker does at the end of its part of
// a pipeline step, pipeline/runner.h). An error says what is wrong.
absl::Status StepHere(rpc::Agent& agent, const rpc::RRef& optimizer, int64_t context_id);

class DistributedOptimizer {
 public:
  // `params`: RRefs to parameter tensors (owned by any workers).
  static absl::StatusOr<std::unique_ptr<DistributedOptimizer>> Create(
      rpc::Agent& agent, const OptimizerOptions& options, const std::vector<rpc::RRef>& params);

  // Steps every owner with the gradients of `context_id`; an error names the
  // worker that failed.
  absl::Status step(int64_t context_id);

  // The bytes of optimizer state on all owners together.
  absl::StatusOr<int64_t> state_bytes() const;

  // The per-owner optimizers (remora.optim.LocalOptimizer, one per owner of
  // parameters, in owner-name order). Their methods "save_state" (the
  // optimizer's state dict, OptimizerStateDict) and "load_state" (such a
  // dict, or SaveOptimizerState's or LibTorch's archive bytes) serve
  // checkpoints (checkpoint/).
  const std::vector<rpc::RRef>& owners() const { return optimizers_; }

 private:
  explicit DistributedOptimizer(std::vector<rpc::RRef> optimizers)
      : optimizers_(std::move(optimizers)) {}
  std::vector<rpc::RRef> optimizers_;  // one remora.optim.LocalOptimizer per owner
};

// The parameter RRefs of a module that lives on a worker: calls its
// registered "parameter_rrefs" method (PyTorch example's parameter_rrefs).
absl::StatusOr<std::vector<rpc::RRef>> parameter_rrefs(const rpc::RRef& module);

}  // namespace remora::optim
