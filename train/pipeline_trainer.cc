#include "train/pipeline_trainer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "autograd/dist_autograd.h"
#include "base/status_util.h"
#include "train/tracing.h"

namespace remora::train {

absl::StatusOr<std::unique_ptr<PipelineTrainer>> PipelineTrainer::Create(rpc::Agent& agent,
                                                                         parallel::DataParallelOptions options) {
  // (Checked here first, so that the error names the call the user made.)
  RETURN_IF_ERROR(autograd::CheckEnabled(agent, "making a trainer (train::PipelineTrainer::Create)"));
  std::vector<pipeline::StageSpec> stages = options.pipeline.stages;
  ASSIGN_OR_RETURN(auto pipe, parallel::DataParallelPipeline::Create(agent, std::move(options)));
  return std::unique_ptr<PipelineTrainer>(new PipelineTrainer(agent, std::move(stages), std::move(pipe)));
}

void PipelineTrainer::StartTracing() { train::StartTracing(agent_, pipe_->replica(0).workers()); }

void PipelineTrainer::StopTracing() { train::StopTracing(agent_, pipe_->replica(0).workers()); }

absl::StatusOr<std::vector<TimelineSlice>> PipelineTrainer::TakeTraces(int64_t start_us) {
  const std::vector<std::string>& workers = pipe_->replica(0).workers();
  std::vector<TimelineSlice> timeline;
  for (size_t k = 0; k < workers.size(); ++k) {
    ASSIGN_OR_RETURN(std::vector<TraceSliceValue> slices, train::TakeTrace(agent_, workers[k]));
    for (TraceSliceValue& t : slices) {
      timeline.push_back({static_cast<int>(k), std::move(t.name), t.micro_batch, t.start_us - start_us,
                          t.end_us - start_us, std::move(t.stage)});
    }
  }
  return timeline;
}

absl::Status PipelineTrainer::ReadOnWorkers(const data::SourceSpec& train, int64_t train_rows,
                                            const data::SourceSpec& test, int64_t test_rows) {
  if (!pipe_->replica(0).runs_on_workers()) {
    return absl::FailedPreconditionError(
        "reading the data on the workers: this pipeline computes its loss on the master, which needs "
        "the batches there (register the loss by name, or read the data on the master)");
  }
  std::vector<std::string> readers;
  for (int r = 0; r < pipe_->replicas(); ++r) readers.push_back(pipe_->replica(r).worker_of(0));
  ASSIGN_OR_RETURN(train_data_, pipeline::WorkerData::Open(agent_, readers, train, train_rows));
  // The test set on replica 0's (which evaluates), where there is one.
  if (test_rows > 0) {
    ASSIGN_OR_RETURN(test_data_, pipeline::WorkerData::Open(agent_, {readers[0]}, test, test_rows));
  }
  readers_ = std::move(readers);
  return absl::OkStatus();
}

StartedStep PipelineTrainer::StartStep(const StepBatch& batch) {
  if (!batch.is_rows()) return pipe_->start_train_step(batch.x, batch.y);
  if (train_data_ == nullptr) {
    return StartedStep::Done(absl::FailedPreconditionError(
        "pipeline trainer: a step over row numbers, but its workers read no data: call ReadOnWorkers first, "
        "or pass the batch's tensors"));
  }
  return pipe_->start_train_step(train_data_->Rows(batch.rows, batch.epoch));
}

absl::StatusOr<pipeline::Correct> PipelineTrainer::CountCorrect(const at::Tensor& x, const at::Tensor& labels) {
  return pipe_->eval_correct(x, labels);
}

absl::StatusOr<pipeline::Correct> PipelineTrainer::CountCorrectRows(const at::Tensor& rows) {
  return pipe_->eval_correct(test_data_->Rows(rows, 0));
}

absl::StatusOr<Saved> PipelineTrainer::Save(const SaveTarget& target, const checkpoint::TrainingState& state,
                                            bool final) {
  if (saver_ == nullptr || saver_dir_ != target.dir) {
    ASSIGN_OR_RETURN(saver_, checkpoint::Checkpointer::Create(agent_, target.dir, target.keep));
    saver_dir_ = target.dir;
  }
  // (ZeRO-1: every replica's share of the optimizer state goes to replica
  // 0's gradient groups first, whose workers' files then hold it.)
  RETURN_IF_ERROR(pipe_->ConsolidateOptimizerState());
  RETURN_IF_ERROR(saver_->Save(pipe_->replica(0), stages_, target.identity, state, final, target.background));
  if (saver_->pending()) return Saved{saver_dir_, 0, state.step, /*pending=*/true};
  return Saved{saver_->last(), saver_->last_bytes(), state.step};
}

absl::StatusOr<std::optional<Saved>> PipelineTrainer::CommitSaved(bool wait) {
  if (saver_ == nullptr || !saver_->pending()) return std::nullopt;
  if (wait) {
    RETURN_IF_ERROR(saver_->Flush());
  } else {
    ASSIGN_OR_RETURN(const bool committed, saver_->Poll());
    if (!committed) return std::nullopt;
  }
  return Saved{saver_->last(), saver_->last_bytes(), saver_->last_step()};
}

absl::StatusOr<int64_t> PipelineTrainer::Load(const checkpoint::Checkpoint& ck) {
  for (int r = 0; r < pipe_->replicas(); ++r) {
    RETURN_IF_ERROR(base::Annotate(checkpoint::Restore(pipe_->replica(r), ck), absl::StrCat("resuming replica ", r)));
  }
  int64_t bytes = 0;
  for (const auto& file : ck.manifest.files) bytes += file.bytes;
  return bytes * pipe_->replicas();
}

}  // namespace remora::train
