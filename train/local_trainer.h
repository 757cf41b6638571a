// Training in this process alone: the stages a pipeline would run, built
// here and run one after the other, micro-batch by micro-batch, with the
// optimizer the workers would use (optim::MakeOptimizer). The baseline a
// pipeline is compared with (master --local, --compare-local), and a
// Trainer like any other: train::Fit runs it, with checkpoints in the
// one-file format (checkpoint::SaveLocal) that an evaluator reads.
//
//   train::LocalOptions o;
//   o.stages = {pipeline::StageSpec::Registered("SmallCnn", {0, 4, 0})};
//   o.loss = pipeline::LossFn::Named("cross_entropy");
//   o.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);
//   auto t = train::LocalTrainer::Create(std::move(o)).value();
//   double loss = t->StartStep({x, y}).wait().value();
//
// Thread-safety: not thread-safe; one thread drives it. Owns its modules
// and optimizer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include "absl/status/statusor.h"
#include "optim/distributed_optimizer.h"
#include "pipeline/pipeline.h"
#include "pipeline/stage.h"
#include "train/trainer.h"

namespace remora::train {

struct LocalOptions {
  std::vector<pipeline::StageSpec> stages;  // built in this process (types registered here)
  pipeline::LossFn loss;
  optim::OptimizerOptions optimizer = optim::OptimizerOptions::SGD(0.05);
  int micro_batches = 1;  // a batch's gradient summed over this many parts, as a pipeline's
  std::string device = "cpu";
  // Above 0: torch::nn::utils::clip_grad_norm_ over the whole model before
  // each step (pipeline::PipelineOptions::clip_grad_norm's one process).
  double clip_grad_norm = 0;
  // Mixed precision as the pipeline's (pipeline::StageSpec::bf16): each
  // stage under bf16 autocast, its outputs bf16, the loss float32.
  bool bf16 = false;
};

class LocalTrainer final : public Trainer {
 public:
  // An error names the stage that could not be built, or a bad option.
  static absl::StatusOr<std::unique_ptr<LocalTrainer>> Create(LocalOptions options);

  // Where a step spent its time (microseconds on trace::NowUs's clock):
  // "forward"/"backward" of micro-batch mb, "step" (mb -1).
  using SliceFn = std::function<void(const char* what, int64_t mb, int64_t start_us, int64_t end_us)>;
  // With clip_grad_norm: the last step's gradient norm before clipping;
  // else -1.
  double last_grad_norm() const { return last_grad_norm_; }
  // Where the steps started from now on (StartStep) spend their time.
  void set_slices(SliceFn slices) { slices_ = std::move(slices); }
  // The model's outputs for x, in eval mode without gradients (on the CPU).
  absl::StatusOr<at::Tensor> Eval(const at::Tensor& x);

  // One step on (x, y), run within the call (over_at_start()); its loss
  // is the batch's (the micro-batches' losses weighted by their rows).
  StartedStep StartStep(const StepBatch& batch) override;
  absl::StatusOr<pipeline::Correct> CountCorrect(const at::Tensor& x, const at::Tensor& labels) override;
  absl::StatusOr<Saved> Save(const SaveTarget& target, const checkpoint::TrainingState& state,
                             bool final) override;
  absl::StatusOr<int64_t> Load(const checkpoint::Checkpoint& ck) override;

 private:
  LocalTrainer(LocalOptions options, std::vector<std::unique_ptr<pipeline::StageModule>> stages);
  // The step StartStep runs.
  absl::StatusOr<double> RunStep(const at::Tensor& x, const at::Tensor& y);
  // A stage's forward pass, under bf16 autocast with options_.bf16.
  c10::IValue Forward(pipeline::StageModule& stage, const c10::IValue& x) const;

  const LocalOptions options_;
  const c10::Device device_;
  std::vector<std::unique_ptr<pipeline::StageModule>> stages_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  SliceFn slices_;
  double last_grad_norm_ = -1;
};

}  // namespace remora::train
