#include "train/local_trainer.h"

#include <utility>

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/types.h>  // (the torch:: functions clip_grad.h calls)
#include <torch/nn/utils/clip_grad.h>

#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "pipeline/microbatch.h"
#include "pipeline/recompute.h"
#include "trace/trace.h"

namespace remora::train {

absl::StatusOr<std::unique_ptr<LocalTrainer>> LocalTrainer::Create(LocalOptions options) {
  if (options.stages.empty()) return absl::InvalidArgumentError("local training: no stages");
  if (!options.loss) return absl::InvalidArgumentError("local training: no loss");
  if (options.micro_batches < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("local training: micro_batches is ", options.micro_batches, "; give at least 1"));
  }
  c10::Device device(c10::kCPU);
  try {
    device = c10::Device(options.device);  // throws for a bad name
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat("local training: device '", options.device, "'"));
  }
  std::vector<std::unique_ptr<pipeline::StageModule>> stages;
  for (size_t k = 0; k < options.stages.size(); ++k) {
    auto stage = pipeline::BuildStage(options.stages[k], device);
    if (!stage.ok()) return base::Annotate(stage.status(), absl::StrCat("building stage ", k, " here"));
    stages.push_back(std::move(*stage));
  }
  return std::unique_ptr<LocalTrainer>(new LocalTrainer(std::move(options), std::move(stages)));
}

LocalTrainer::LocalTrainer(LocalOptions options, std::vector<std::unique_ptr<pipeline::StageModule>> stages)
    : options_(std::move(options)), device_(options_.device), stages_(std::move(stages)) {
  std::vector<at::Tensor> params;
  for (auto& stage : stages_) {
    for (const at::Tensor& p : stage->Parameters()) params.push_back(p);
  }
  optimizer_ = optim::MakeOptimizer(c10::IValue(optim::OptionsToDict(options_.optimizer)).toGenericDict(),
                                    std::move(params));
}

c10::IValue LocalTrainer::Forward(pipeline::StageModule& stage, const c10::IValue& x) const {
  if (!options_.bf16) return stage.Forward(x);
  c10::IValue y;
  {
    pipeline::Bf16Autocast autocast(true);
    y = stage.Forward(pipeline::ToFloat32(x));
  }
  return pipeline::ToBf16(y);
}

absl::StatusOr<double> LocalTrainer::RunStep(const at::Tensor& cpu_x, const at::Tensor& cpu_y) {
  const SliceFn& slices = slices_;
  ASSIGN_OR_RETURN(auto xs, pipeline::SplitMicroBatches(cpu_x.to(device_), options_.micro_batches));
  ASSIGN_OR_RETURN(auto ts, pipeline::SplitMicroBatches(cpu_y.to(device_), options_.micro_batches));
  const double rows = static_cast<double>(cpu_x.size(0));
  double loss = 0;
  // What ran when it failed (named as the pipeline names it).
  enum class Phase { kSetUp, kForward, kBackward, kStep } phase = Phase::kSetUp;
  size_t at_stage = 0, at_mb = 0;
  try {
    for (auto& stage : stages_) stage->Train(true);
    optimizer_->zero_grad();
    for (size_t i = 0; i < xs.size(); ++i) {
      const int64_t f0 = trace::NowUs();
      c10::IValue out = xs[i];
      phase = Phase::kForward;
      at_mb = i;
      for (at_stage = 0; at_stage < stages_.size(); ++at_stage) out = Forward(*stages_[at_stage], out);
      const int64_t f1 = trace::NowUs();
      absl::StatusOr<at::Tensor> computed = options_.loss.Compute(pipeline::ToFloat32(out), ts[i]);
      if (!computed.ok()) return base::Annotate(computed.status(), absl::StrCat("local training, micro-batch ", i));
      at::Tensor l = *computed * pipeline::RowsShare(pipeline::BatchRows(xs[i]), rows);
      phase = Phase::kBackward;
      l.backward();
      if (slices) {
        slices("forward", static_cast<int64_t>(i), f0, f1);
        slices("backward", static_cast<int64_t>(i), f1, trace::NowUs());
      }
      loss += l.item<double>();
    }
    const int64_t s0 = trace::NowUs();
    phase = Phase::kStep;
    if (options_.clip_grad_norm > 0) {
      // (Each group's own: Optimizer::parameters() warns on every call in
      // LibTorch 1.13, and AdamW has two groups.)
      std::vector<at::Tensor> params;
      for (const auto& group : optimizer_->param_groups()) {
        params.insert(params.end(), group.params().begin(), group.params().end());
      }
      last_grad_norm_ = torch::nn::utils::clip_grad_norm_(params, options_.clip_grad_norm);
    }
    optimizer_->step();
    if (slices) slices("step", -1, s0, trace::NowUs());
  } catch (...) {
    const std::string where = phase == Phase::kForward    ? absl::StrCat(", stage ", at_stage, ", micro-batch ", at_mb)
                              : phase == Phase::kBackward ? absl::StrCat(", the backward pass of micro-batch ", at_mb)
                              : phase == Phase::kStep     ? ", the optimizer's step"
                                                          : "";
    return base::StatusFromCurrentException(absl::StrCat("local training", where));
  }
  return loss;
}

absl::StatusOr<at::Tensor> LocalTrainer::Eval(const at::Tensor& x) {
  c10::AutoGradMode no_grad(false);
  c10::IValue out = x.to(device_);
  try {
    for (auto& stage : stages_) stage->Train(false);
    for (auto& stage : stages_) out = Forward(*stage, out);
    return pipeline::ToFloat32(out).toTensor().cpu();
  } catch (...) {
    return base::StatusFromCurrentException("local evaluation");
  }
}

StartedStep LocalTrainer::StartStep(const StepBatch& batch) {
  if (batch.is_rows()) {
    return StartedStep::Done(absl::FailedPreconditionError(
        "local trainer: a step over row numbers, but it reads no data itself: pass the batch's tensors"));
  }
  // Trains now: the step is over when this returns.
  absl::StatusOr<double> loss = RunStep(batch.x, batch.y);
  return StartedStep::Done(std::move(loss), last_grad_norm_);
}

absl::StatusOr<pipeline::Correct> LocalTrainer::CountCorrect(const at::Tensor& x, const at::Tensor& labels) {
  ASSIGN_OR_RETURN(at::Tensor logits, Eval(x));
  return pipeline::CountCorrect(logits, labels);
}

absl::StatusOr<Saved> LocalTrainer::Save(const SaveTarget& target, const checkpoint::TrainingState& state,
                                         bool final) {
  std::vector<std::vector<at::Tensor>> tensors;
  std::vector<std::vector<std::string>> names;
  for (auto& stage : stages_) {
    tensors.push_back(pipeline::StateTensors(*stage));
    names.push_back(pipeline::StateNames(*stage));
  }
  at::Tensor optimizer;
  try {
    optimizer = optim::SaveOptimizerState(*optimizer_);
  } catch (...) {
    return base::StatusFromCurrentException("saving the optimizer's state");
  }
  ASSIGN_OR_RETURN(checkpoint::LocalSave saved,
                   checkpoint::SaveLocal(target.dir, options_.stages, tensors, names, optimizer, target.identity,
                                         state, final, target.keep, "this process"));
  return Saved{saved.dir, saved.bytes};
}

absl::StatusOr<int64_t> LocalTrainer::Load(const checkpoint::Checkpoint& ck) {
  std::vector<std::vector<std::string>> names;
  ASSIGN_OR_RETURN(auto tensors, checkpoint::ReadStageTensors(ck, &names));
  if (tensors.size() != stages_.size()) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint ", ck.dir, " holds ", tensors.size(),
                                                      " stages; this model has ", stages_.size()));
  }
  ASSIGN_OR_RETURN(at::Tensor optimizer, checkpoint::ReadLocalOptimizer(ck));
  int64_t bytes = 0;
  try {
    c10::AutoGradMode no_grad(false);
    for (size_t k = 0; k < stages_.size(); ++k) {
      pipeline::LoadState(*stages_[k], tensors[k], absl::StrCat("stage ", k, " of ", ck.dir),
                          k < names.size() ? names[k] : std::vector<std::string>{});
      for (const at::Tensor& t : tensors[k]) bytes += t.nbytes();
    }
    if (optimizer.defined()) optim::LoadOptimizerState(*optimizer_, optimizer);
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat("loading ", ck.dir));
  }
  RETURN_IF_ERROR(checkpoint::RestoreCpuGenerator(ck));  // dropout draws here
  return bytes;
}

}  // namespace remora::train
