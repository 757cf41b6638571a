// A parameter server (ps/parameter_server.h) as a Trainer: the model and
// optimizer in this process (or its server partitions), the workers pulling
// the parameters and pushing their shares' gradients every step; its
// checkpoints are one-file ones (checkpoint::SaveLocal) that an evaluator
// follows.
//
//   auto t = train::PsTrainer::Create(agent, ps_options).value();
//   t->set_on_step([](const ps::StepReport& r, double seconds) { ... });
//   t->ReadOnWorkers(train_spec, train.size(), test);   // optional: see there
//   auto epochs = train::Fit(*t, train, test, options, out);
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
#include "data/source.h"
#include "pipeline/worker_data.h"
#include "ps/parameter_server.h"
#include "rpc/agent.h"
#include "train/trainer.h"

namespace remora::train {

class PsTrainer final : public Trainer, private WorkersRead {
 public:
  static absl::StatusOr<std::unique_ptr<PsTrainer>> Create(rpc::Agent& agent, ps::PsOptions options);

  // From now on every worker reads its share of each training batch from
  // `train` itself (opened on each; every one must find `train_rows` rows;
  // the master sends row numbers). The model is evaluated here, so the
  // test set is read here, from `test` (borrowed: it must outlive this).
  absl::Status ReadOnWorkers(const data::SourceSpec& train, int64_t train_rows, const data::Source& test);
  // The workers that read (empty: the batches are read here).
  const std::vector<std::string>& readers() const { return readers_; }

  // Called after every step that completed, with its report and time.
  using StepFn = std::function<void(const ps::StepReport& report, double seconds)>;
  void set_on_step(StepFn fn) { on_step_ = std::move(fn); }

  ps::ParameterServer& server() { return *server_; }

  // One step, over within the call (the server waits for its workers);
  // its report (the loss, who took part, the bytes moved) goes to on_step.
  StartedStep StartStep(const StepBatch& batch) override;
  absl::StatusOr<pipeline::Correct> CountCorrect(const at::Tensor& x, const at::Tensor& labels) override;
  absl::StatusOr<Saved> Save(const SaveTarget& target, const checkpoint::TrainingState& state,
                             bool final) override;
  absl::StatusOr<int64_t> Load(const checkpoint::Checkpoint& ck) override;
  WorkersRead* rows() override { return train_data_ != nullptr ? this : nullptr; }

 private:
  PsTrainer(rpc::Agent& agent, std::vector<pipeline::StageSpec> stages, std::unique_ptr<ps::ParameterServer> server)
      : agent_(agent), stages_(std::move(stages)), server_(std::move(server)) {}

  // `r`, given to on_step_ (with the seconds since `t0`) when it is a report.
  absl::StatusOr<ps::StepReport> Reported(absl::StatusOr<ps::StepReport> r, int64_t t0);
  // A step that is over (the server waits within it) as a started step.
  static StartedStep Started(const absl::StatusOr<ps::StepReport>& r);
  absl::StatusOr<pipeline::Correct> CountCorrectRows(const at::Tensor& rows) override;
  // (A worker that fails to answer is lost, as in a step, when backup
  // workers allow it.)
  absl::StatusOr<int64_t> skipped() override {
    return train_data_->skipped(
        [this](const std::string& w, const absl::Status& why) { return server_->Lost(w, why); });
  }

  rpc::Agent& agent_;
  const std::vector<pipeline::StageSpec> stages_;
  std::unique_ptr<ps::ParameterServer> server_;
  StepFn on_step_;
  std::vector<std::string> readers_;
  std::unique_ptr<pipeline::WorkerData> train_data_;
  const data::Source* test_ = nullptr;  // with train_data_
};

}  // namespace remora::train
