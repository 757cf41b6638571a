#include "train/ps_trainer.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "trace/trace.h"

namespace remora::train {

absl::StatusOr<std::unique_ptr<PsTrainer>> PsTrainer::Create(rpc::Agent& agent, ps::PsOptions options) {
  std::vector<pipeline::StageSpec> stages = options.stages;
  ASSIGN_OR_RETURN(auto server, ps::ParameterServer::Create(agent, std::move(options)));
  return std::unique_ptr<PsTrainer>(new PsTrainer(agent, std::move(stages), std::move(server)));
}

absl::Status PsTrainer::ReadOnWorkers(const data::SourceSpec& train, int64_t train_rows, const data::Source& test) {
  std::vector<std::string> readers = server_->live_workers();
  ASSIGN_OR_RETURN(train_data_, pipeline::WorkerData::Open(agent_, readers, train, train_rows));
  test_ = &test;
  readers_ = std::move(readers);
  return absl::OkStatus();
}

absl::StatusOr<ps::StepReport> PsTrainer::Reported(absl::StatusOr<ps::StepReport> r, int64_t t0) {
  if (r.ok() && on_step_) on_step_(*r, (trace::NowUs() - t0) / 1e6);
  return r;
}

StartedStep PsTrainer::Started(const absl::StatusOr<ps::StepReport>& r) {
  // The server waits for its workers within the step: it is over here.
  return StartedStep::Done(r.ok() ? absl::StatusOr<double>(r->loss) : r.status(), r.ok() ? r->grad_norm : -1.0);
}

StartedStep PsTrainer::StartStep(const StepBatch& batch) {
  const int64_t t0 = trace::NowUs();
  if (!batch.is_rows()) return Started(Reported(server_->train_step(batch.x, batch.y), t0));
  if (train_data_ == nullptr) {
    return StartedStep::Done(absl::FailedPreconditionError(
        "parameter-server trainer: a step over row numbers, but its workers read no data: call ReadOnWorkers "
        "first, or pass the batch's tensors"));
  }
  return Started(Reported(server_->train_step(train_data_->Rows(batch.rows, batch.epoch)), t0));
}

absl::StatusOr<pipeline::Correct> PsTrainer::CountCorrectRows(const at::Tensor& rows) {
  ASSIGN_OR_RETURN(data::Batch b, test_->Get(rows, /*epoch=*/0));
  if (b.labels.size(0) == 0) return pipeline::Correct{};  // every file of it skipped
  return CountCorrect(b.images, b.labels);
}

absl::StatusOr<pipeline::Correct> PsTrainer::CountCorrect(const at::Tensor& x, const at::Tensor& labels) {
  ASSIGN_OR_RETURN(at::Tensor logits, server_->eval(x));
  return pipeline::CountCorrect(logits, labels);
}

absl::StatusOr<Saved> PsTrainer::Save(const SaveTarget& target, const checkpoint::TrainingState& state,
                                      bool final) {
  ASSIGN_OR_RETURN(auto tensors, server_->stage_state());  // gathered from the partitions, if any
  ASSIGN_OR_RETURN(at::Tensor optimizer, server_->optimizer_state());
  ASSIGN_OR_RETURN(checkpoint::LocalSave saved,
                   checkpoint::SaveLocal(target.dir, stages_, tensors, server_->stage_names(), optimizer,
                                         target.identity, state, final, target.keep));
  return Saved{saved.dir, saved.bytes};
}

absl::StatusOr<int64_t> PsTrainer::Load(const checkpoint::Checkpoint& ck) {
  ASSIGN_OR_RETURN(auto tensors, checkpoint::ReadStageTensors(ck));
  ASSIGN_OR_RETURN(at::Tensor optimizer, checkpoint::ReadLocalOptimizer(ck));
  RETURN_IF_ERROR(server_->Load(tensors, optimizer, ck.state().step));
  // (The replicas' dropout draws from their workers' generators, which a
  // one-file checkpoint does not hold; this process's is restored.)
  RETURN_IF_ERROR(checkpoint::RestoreCpuGenerator(ck));
  int64_t bytes = optimizer.defined() ? optimizer.nbytes() : 0;
  for (const auto& stage : tensors) {
    for (const at::Tensor& t : stage) bytes += t.nbytes();
  }
  return bytes;
}

}  // namespace remora::train
