// A pipeline over workers, with or without data-parallel replicas
// (parallel/data_parallel.h), as a Trainer: steps started before the last
// one is waited for, checkpoints written by each stage's owner
// (checkpoint::Checkpointer; replica 0 is saved, every replica restored),
// and, optionally, batches read on the workers themselves.
//
//   parallel::DataParallelOptions o;  // stages, workers, loss, optimizer, replicas
//   auto t = train::PipelineTrainer::Create(agent, std::move(o)).value();
//   RETURN_IF_ERROR(t->ReadOnWorkers(train_spec, n_train, test_spec, n_test));  // optional
//   auto epochs = train::Fit(*t, train, test, options, out);
//
// Thread-safety: one thread drives it (the training loop). Owns the
// pipeline and the workers' opened sets; borrows the agent, which must
// outlive it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "data/source.h"
#include "parallel/data_parallel.h"
#include "pipeline/worker_data.h"
#include "rpc/agent.h"
#include "train/timeline.h"
#include "train/trainer.h"

namespace remora::train {

class PipelineTrainer final : public Trainer, private WorkersRead {
 public:
  // Creates the pipeline and its replicas on the workers. FailedPrecondition
  // naming the call when `agent` lacks autograd::Enable (a master made
  // with Agent::Start; launch::StartLocalGroup's has it).
  static absl::StatusOr<std::unique_ptr<PipelineTrainer>> Create(rpc::Agent& agent,
                                                                 parallel::DataParallelOptions options);
  // From now on each replica's stage 0 worker reads its share of every
  // training batch from `train` itself (the master sends row numbers), and
  // replica 0's reads the test set (none where test_rows is 0); each must
  // find the given row counts.
  // FailedPrecondition when the loss is computed here (an unnamed loss
  // needs the batches on the master).
  absl::Status ReadOnWorkers(const data::SourceSpec& train, int64_t train_rows, const data::SourceSpec& test,
                             int64_t test_rows);
  // The workers that read (empty: the batches are read here).
  const std::vector<std::string>& readers() const { return readers_; }

  parallel::DataParallelPipeline& pipeline() { return *pipe_; }

  // The trace recorders (train/tracing.h) of replica 0's workers, whose
  // slices draw one pipeline's timeline and measure its bubble: turned on
  // (older slices dropped), turned off, and what they recorded since, as
  // a timeline (track k: the pipeline's k-th worker; times since
  // `start_us`, a trace::NowUs). Taking stops their tracing; an error
  // names the worker.
  void StartTracing();
  void StopTracing();
  absl::StatusOr<std::vector<TimelineSlice>> TakeTraces(int64_t start_us);

  StartedStep StartStep(const StepBatch& batch) override;
  absl::StatusOr<pipeline::Correct> CountCorrect(const at::Tensor& x, const at::Tensor& labels) override;
  absl::StatusOr<Saved> Save(const SaveTarget& target, const checkpoint::TrainingState& state,
                             bool final) override;
  absl::StatusOr<int64_t> Load(const checkpoint::Checkpoint& ck) override;
  absl::StatusOr<std::optional<Saved>> CommitSaved(bool wait) override;
  // Whether a save made in the background waits to be committed.
  bool save_pending() const { return saver_ != nullptr && saver_->pending(); }
  WorkersRead* rows() override { return train_data_ != nullptr ? this : nullptr; }

 private:
  PipelineTrainer(rpc::Agent& agent, std::vector<pipeline::StageSpec> stages,
                  std::unique_ptr<parallel::DataParallelPipeline> pipe)
      : agent_(agent), stages_(std::move(stages)), pipe_(std::move(pipe)) {}

  absl::StatusOr<pipeline::Correct> CountCorrectRows(const at::Tensor& rows) override;
  absl::StatusOr<int64_t> skipped() override { return train_data_->skipped(); }

  rpc::Agent& agent_;
  const std::vector<pipeline::StageSpec> stages_;  // what the pipeline was made from
  std::unique_ptr<parallel::DataParallelPipeline> pipe_;
  std::unique_ptr<checkpoint::Checkpointer> saver_;  // made by the first Save
  std::string saver_dir_;
  std::vector<std::string> readers_;
  std::unique_ptr<pipeline::WorkerData> train_data_, test_data_;
};

}  // namespace remora::train
