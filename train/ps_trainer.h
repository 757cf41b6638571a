// A parameter server (ps/parameter_server.h) as a Trainer: the model and
// optimizer in this process (or its server shards), the workers pulling
// the parameters and pushing their shares' gradients every step; its
// checkpoints are one-shard ones (checkpoint::SaveLocal) that an evaluator
// follows.
//
//   auto t = train::PsTrainer::Create(agent, ps_options).value();
//   t->set_on_step([](const ps::StepReport& r, double seconds) { ... });
//   auto epochs = train::Fit(*t, train, test, options, std::cout);
//
// Thread-safety: one thread drives it (the training loop). Owns the
// server; borrows the agent, which must outlive it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "ps/parameter_server.h"
#include "rpc/agent.h"
#include "train/trainer.h"

namespace remora::train {

class PsTrainer final : public Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<PsTrainer>> Create(Agent& agent, ps::PsOptions options);

  // Called after every step that completed, with its report and time.
  using StepFn = std::function<void(const ps::StepReport& report, double seconds)>;
  void set_on_step(StepFn fn) { on_step_ = std::move(fn); }

  // One step; its report (the loss, who took part, the bytes moved).
  absl::StatusOr<ps::StepReport> Train(const at::Tensor& x, const at::Tensor& y);
  ps::ParameterServer& server() { return *server_; }

  pipeline::StartedStep StartStep(const at::Tensor& x, const at::Tensor& y) override;
  absl::StatusOr<int64_t> CountCorrect(const at::Tensor& x, const at::Tensor& labels) override;
  absl::StatusOr<Saved> Save(const SaveTarget& target, const checkpoint::TrainingState& state,
                             bool final) override;
  absl::StatusOr<int64_t> Load(const checkpoint::Checkpoint& ck) override;

 private:
  PsTrainer(std::vector<pipeline::StageSpec> stages, std::unique_ptr<ps::ParameterServer> server)
      : stages_(std::move(stages)), server_(std::move(server)) {}

  const std::vector<pipeline::StageSpec> stages_;
  std::unique_ptr<ps::ParameterServer> server_;
  StepFn on_step_;
};

}  // namespace remora::train
