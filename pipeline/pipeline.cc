#include "pipeline/pipeline.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>

#include <ATen/TensorOperators.h>
#include <ATen/core/List.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "autograd/dist_autograd.h"
#include "base/status_util.h"
#include "pipeline/accuracy.h"
#include "pipeline/microbatch.h"
#include "pipeline/pending_step.h"
#include "pipeline/protocol.h"
#include "pipeline/recompute.h"

namespace remora::pipeline {

namespace {

// The schedule `name` resolves to for this shape.
std::string ResolveSchedule(const std::string& name, int workers, int per_worker, int m) {
  if (name != "auto") return name;
  if (per_worker >= 2 && m % workers == 0) return "interleaved";
  return per_worker == 1 ? "1f1b" : "gpipe";
}

}  // namespace

Pipeline::Pipeline(rpc::Agent& agent, PipelineOptions options, std::vector<std::string> workers,
                   std::vector<rpc::RRef> stages, Schedule schedule,
                   std::unique_ptr<optim::DistributedOptimizer> optimizer)
    : agent_(agent),
      options_(std::move(options)),
      workers_(std::move(workers)),
      stages_(std::move(stages)),
      schedule_(std::move(schedule)),
      optimizer_(std::move(optimizer)) {}

absl::Status SeedWorkers(rpc::Agent& agent, const std::vector<std::string>& workers, uint64_t seed) {
  std::vector<rpc::Future<c10::IValue>> seeded;
  for (size_t i = 0; i < workers.size(); ++i) {
    // Distinct per worker, and far from the run's own seed's neighbours.
    const uint64_t s = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull * (i + 1);
    seeded.push_back(agent.rpc_async(workers[i], SeedRequest::kFunction,
                                     rpc::EncodeCall(SeedRequest{static_cast<int64_t>(s & 0x7fffffffffffffffull)})));
  }
  return rpc::WaitAll(seeded, [&workers](size_t i) { return absl::StrCat("seeding worker '", workers[i], "'"); })
      .status();
}

namespace {

// The schedule `o` asks for, resolved, after checking what `o` holds
// alone (worker and stage counts, the loss, clipping, a tied weight).
absl::StatusOr<std::string> CheckedSchedule(const PipelineOptions& o) {
  const int n = static_cast<int>(o.workers.size());
  const int S = static_cast<int>(o.stages.size());
  if (n < 1) return absl::InvalidArgumentError("pipeline: no workers given");
  if (S < 1) return absl::InvalidArgumentError("pipeline: no stages given");
  if (S % n != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline: ", S, " stages do not spread evenly over ", n,
        " workers (stage k runs on worker k mod ", n, "): give a multiple of ", n, " stages"));
  }
  std::string schedule_name = ResolveSchedule(o.schedule, n, S / n, o.micro_batches);
  if (n == 1 && S > 1 && schedule_name != "zbv") {
    // (Stage k's output goes to stage k + 1's worker as a call: one worker
    // would call itself, and its schedule would wait on itself.)
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline: ", S, " stages on 1 worker: consecutive stages must be on different workers; give 2 or more "
        "workers, a count that divides ", S, ", or make the model one stage"));
  }
  if (!o.loss) return absl::InvalidArgumentError("pipeline: no loss function given");
  if (!(o.clip_grad_norm >= 0) || (o.clip_grad_norm > 0 && o.loss.name().empty())) {
    return absl::InvalidArgumentError("pipeline: clip_grad_norm must be 0 or more, and above 0 needs a named loss "
                                      "(pipeline::RegisterLoss: the workers' step runners clip)");
  }
  if (o.tied_first.empty() != o.tied_last.empty() || (!o.tied_first.empty() && (S < 2 || o.loss.name().empty()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline: tied_first '", o.tied_first, "' and tied_last '", o.tied_last, "' name one weight held by the "
        "first and the last stage: give both or neither, with two stages or more (one stage ties within its "
        "module) and a named loss (pipeline::RegisterLoss: the workers' step runners sum the gradients)"));
  }
  return schedule_name;
}

// What the master must have set up, checked before anything is placed:
// distributed autograd, and every worker of `o` in its group.
absl::Status CheckSetUp(rpc::Agent& agent, const PipelineOptions& o) {
  RETURN_IF_ERROR(autograd::CheckEnabled(agent, "making a pipeline"));
  for (const std::string& w : o.workers) {
    if (absl::StatusOr<base::WorkerInfo> info = agent.worker(w); !info.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "pipeline: ", info.status().message(), ": name workers of the group of '", agent.self().name,
          "' (its AgentOptions::workers), and make the pipeline once Join() has returned "
          "(launch::StartLocalGroup returns after it)"));
    }
  }
  return absl::OkStatus();
}

// Each stage of `o` built on its worker under `schedule`; a stage that
// fails to build (a file that does not load) fails here, with its own
// error, before any call is made on it.
absl::StatusOr<std::vector<rpc::RRef>> PlaceStages(rpc::Agent& agent, const PipelineOptions& o,
                                                   const Schedule& schedule) {
  const int S = static_cast<int>(o.stages.size());
  auto where = [&](int k) {
    return absl::StrCat("placing stage ", k, " on worker '", o.workers[schedule.WorkerOf(k)], "'");
  };
  std::vector<rpc::RRef> stages;
  for (int k = 0; k < S; ++k) {
    const StageSpec& s = o.stages[k];
    const std::string& w = o.workers[schedule.WorkerOf(k)];
    auto stage =
        agent.remote(w, MakeStageRequest::kFunction,
                     rpc::EncodeCall(MakeStageRequest{s.kind, s.name, s.Payload(), k, s.device, s.recompute, s.bf16}));
    if (!stage.ok()) return base::Annotate(stage.status(), where(k));
    stages.push_back(*stage);
  }
  for (int k = 0; k < S; ++k) {
    if (const absl::Status built = stages[k].WaitConfirmed(); !built.ok()) return base::Annotate(built, where(k));
  }
  for (int k = 0; k < S; ++k) {
    // Also starts the stage's activation count afresh (stage indices repeat
    // across pipelines).
    if (auto r = stages[k].rpc_sync(ActivationBytesRequest::kMethod, rpc::EncodeCall(ActivationBytesRequest{true}));
        !r.ok()) {
      return base::Annotate(r.status(), where(k));
    }
  }
  return stages;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Pipeline>> Pipeline::Create(rpc::Agent& agent, PipelineOptions o) {
  const int n = static_cast<int>(o.workers.size());
  const int S = static_cast<int>(o.stages.size());
  ASSIGN_OR_RETURN(const std::string schedule_name, CheckedSchedule(o));
  RETURN_IF_ERROR(CheckSetUp(agent, o));
  ASSIGN_OR_RETURN(Schedule schedule, MakeSchedule(schedule_name, n, S / n, o.micro_batches));
  RETURN_IF_ERROR(Simulate(schedule).status());
  if (schedule.SplitsBackward() && o.loss.name().empty()) {  // (splitting needs the step runners)
    return absl::InvalidArgumentError(absl::StrCat(
        "pipeline: schedule ", schedule.name, " splits each backward pass into B and W, which the workers' step "
        "runners run: give a loss registered by name (LossFn::Named), or use 1f1b"));
  }
  if (o.seed) RETURN_IF_ERROR(SeedWorkers(agent, o.workers, *o.seed));
  ASSIGN_OR_RETURN(std::vector<rpc::RRef> stages, PlaceStages(agent, o, schedule));
  std::vector<rpc::RRef> params;
  for (int k = 0; k < S; ++k) {
    auto p = optim::parameter_rrefs(stages[k]);
    if (!p.ok()) {
      return base::Annotate(p.status(),
                            absl::StrCat("stage ", k, " on worker '", o.workers[schedule.WorkerOf(k)], "'"));
    }
    params.insert(params.end(), p->begin(), p->end());
  }
  ASSIGN_OR_RETURN(auto optimizer, optim::DistributedOptimizer::Create(agent, o.optimizer, params));
  std::vector<std::string> workers = o.workers;
  const bool named_loss = !o.loss.name().empty();
  std::unique_ptr<Pipeline> pipe(new Pipeline(agent, std::move(o), std::move(workers),
                                              std::move(stages), std::move(schedule),
                                              std::move(optimizer)));
  if (named_loss) RETURN_IF_ERROR(pipe->MakeRunners());
  return pipe;
}

absl::Status Pipeline::MakeRunners() {
  // Ids differ between the pipelines of this process and, with the clock
  // in them, between masters that one worker meets.
  static std::atomic<int64_t> next{(absl::ToUnixMicros(absl::Now()) & 0xffffffffff) << 16};
  const int64_t id = next++;
  const int n = static_cast<int>(workers_.size());
  const int S = num_stages();
  std::vector<std::string> stage_workers;
  for (int k = 0; k < S; ++k) stage_workers.push_back(worker_of(k));
  std::vector<rpc::Future<c10::IValue>> made;
  for (int w = 0; w < n; ++w) {
    MakeRunnerRequest r;
    r.runner = id;
    r.stage_workers = stage_workers;
    r.micro_batches = schedule_.micro_batches;
    r.order = EncodeOrder(schedule_.actions[w]);
    for (int k = 0; k < S; ++k) {
      if (schedule_.WorkerOf(k) == w) r.stages.push_back(stages_[k].ToIValue());
    }
    r.loss = options_.loss.name();
    r.clip_grad_norm = options_.clip_grad_norm;
    r.tied_first = options_.tied_first;
    r.tied_last = options_.tied_last;
    ASSIGN_OR_RETURN(base::WorkerInfo info, agent_.worker(workers_[w]));
    for (const rpc::RRef& o : optimizer_->owners()) {
      if (o.owner() == info.id) r.optimizer = o.ToIValue();
    }
    made.push_back(agent_.rpc_async(workers_[w], MakeRunnerRequest::kFunction, rpc::EncodeCall(r)));
  }
  RETURN_IF_ERROR(rpc::WaitAll(made, [this](size_t w) {
                    return absl::StrCat("starting the step runner on worker '", workers_[w], "'");
                  }).status());
  runner_id_ = id;
  return absl::OkStatus();
}

Pipeline::~Pipeline() {
  if (runner_id_ < 0) return;
  std::vector<rpc::Future<c10::IValue>> dropped;
  for (const std::string& w : workers_) {
    rpc::CallOptions quick;  // (a stopped worker must not hold this up for long)
    quick.timeout = absl::Seconds(5);
    dropped.push_back(
        agent_.rpc_async(w, DropRunnerRequest::kFunction, rpc::EncodeCall(DropRunnerRequest{runner_id_}), quick));
  }
  // (A worker that is gone has nothing to drop.)
  for (auto& d : dropped) d.wait().status().IgnoreError();
}

absl::StatusOr<std::vector<rpc::Future<c10::IValue>>> Pipeline::StartStep(const c10::IValue& inputs,
                                                                     const c10::IValue& targets,
                                                                     int64_t context_id,
                                                                     int64_t total_rows) {
  if (!runs_on_workers()) {
    return absl::FailedPreconditionError("StartStep: the pipeline has no step runners (an unnamed loss)");
  }
  const int64_t rows = BatchRows(inputs);
  const int m = schedule_.micro_batches;
  if (rows < m) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a batch of ", rows, " rows cannot be split into ", m,
        " micro-batches (use a larger batch or fewer splits)"));
  }
  if (BatchRows(targets) != rows) {
    return absl::InvalidArgumentError(absl::StrCat("the batch has ", rows, " inputs but ",
                                                   BatchRows(targets), " targets"));
  }
  return SendRun(inputs, targets, c10::IValue(), context_id, total_rows);
}

absl::StatusOr<std::vector<rpc::Future<c10::IValue>>> Pipeline::StartStep(const WorkerRows& rows, int64_t context_id,
                                                                     int64_t total_rows) {
  if (!runs_on_workers()) {
    return absl::FailedPreconditionError(
        "StartStep: rows read on the workers need step runners (a named loss)");
  }
  const int m = schedule_.micro_batches;
  if (!rows.rows.defined() || rows.rows.dim() != 1 || rows.rows.size(0) < m) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a batch of ", rows.rows.defined() ? rows.rows.numel() : 0, " rows cannot be split into ", m,
        " micro-batches (use a larger batch or fewer splits)"));
  }
  return SendRun(c10::IValue(), c10::IValue(), ToIValue(rows), context_id, total_rows);
}

std::vector<rpc::Future<c10::IValue>> Pipeline::SendRun(const c10::IValue& inputs, const c10::IValue& targets,
                                                   const c10::IValue& rows, int64_t context_id,
                                                   int64_t total_rows) {
  const int n = static_cast<int>(workers_.size());
  std::vector<rpc::Future<c10::IValue>> replies;
  for (int w = 0; w < n; ++w) {
    RunRequest r;
    r.runner = runner_id_;
    r.context = context_id;
    r.after = last_over_ ? -1 : last_started_;
    if (w == 0) r.inputs = inputs;
    if (w == last_worker()) r.targets = targets;
    r.total_rows = total_rows;
    if (w == 0 || w == last_worker()) r.rows = rows;
    replies.push_back(agent_.rpc_async(workers_[w], RunRequest::kFunction, rpc::EncodeCall(r)));
  }
  last_started_ = context_id;
  last_over_ = false;
  return replies;
}

void Pipeline::AbandonStep(int64_t context_id) {
  // Not waited for: a dead worker must not delay the error.
  for (const std::string& w : workers_) {
    agent_.rpc_async(w, AbandonRequest::kFunction, rpc::EncodeCall(AbandonRequest{runner_id_, context_id}));
  }
}

StartedStep Pipeline::start_train_step(const c10::IValue& inputs, const c10::IValue& targets) {
  if (!runs_on_workers()) return StartedStep::Done(TrainHere(inputs, targets));
  const absl::StatusOr<int64_t> context = autograd::NewContextId(agent_);
  if (!context.ok()) return StartedStep::Done(context.status());
  return Started(Pending(*context, StartStep(inputs, targets, *context, BatchRows(inputs))));
}

StartedStep Pipeline::start_train_step(const WorkerRows& rows) {
  const absl::StatusOr<int64_t> context = autograd::NewContextId(agent_);
  if (!context.ok()) return StartedStep::Done(context.status());
  return Started(Pending(*context, StartStep(rows, *context, rows.rows.defined() ? rows.rows.numel() : 0)));
}

PendingStep Pipeline::Pending(int64_t context, absl::StatusOr<std::vector<rpc::Future<c10::IValue>>> replies) {
  if (!replies.ok()) return PendingStep::Done(replies.status());
  return PendingStep(agent_, workers_, std::move(*replies), {last_worker()},
                     [this, context] { AbandonStep(context); },
                     [this](int w) { return absl::StrCat("the training step on worker '", workers_[w], "'"); },
                     [this, context] { StepOver(context); });
}

absl::StatusOr<double> Pipeline::TrainHere(const c10::IValue& inputs, const c10::IValue& targets) {
  autograd::Context context(agent_);
  RETURN_IF_ERROR(context.status());
  ASSIGN_OR_RETURN(double loss, forward_backward(inputs, targets, context.id(), BatchRows(inputs)));
  RETURN_IF_ERROR(step(context.id()));
  return loss;
}

absl::Status Pipeline::step(int64_t context_id) { return optimizer_->step(context_id); }

absl::StatusOr<double> Pipeline::forward_backward(const c10::IValue& inputs,
                                                  const c10::IValue& targets, int64_t context_id,
                                                  int64_t total_rows) {
  if (schedule_.SplitsBackward()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pipeline: schedule ", schedule_.name, " splits backward passes, which only the workers' step runners run: "
        "use start_train_step, not forward_backward"));
  }
  const int m = schedule_.micro_batches;
  ASSIGN_OR_RETURN(std::vector<c10::IValue> xs, SplitMicroBatches(inputs, m));
  ASSIGN_OR_RETURN(std::vector<c10::IValue> ts, SplitMicroBatches(targets, m));
  const double rows = static_cast<double>(total_rows);
  // Every worker learns its actions' order for this batch before any starts.
  std::vector<rpc::Future<c10::IValue>> told;
  for (size_t w = 0; w < workers_.size(); ++w) {
    told.push_back(agent_.rpc_async(workers_[w], SetOrderRequest::kFunction,
                                    rpc::EncodeCall(SetOrderRequest{context_id, EncodeOrder(schedule_.actions[w])})));
  }
  RETURN_IF_ERROR(rpc::WaitAll(told, [this](size_t w) {
                    return absl::StrCat("sending the schedule to worker '", workers_[w], "'");
                  }).status());
  absl::StatusOr<double> loss = RunMicroBatches(xs, ts, rows, context_id);
  if (!loss.ok()) AbandonOrder(context_id);
  return loss;
}

void Pipeline::AbandonOrder(int64_t context_id) {
  // Not waited for: a stalled or dead worker must not delay the error, and
  // one that cannot be told is the failure already being reported. (A late
  // message does nothing once a later batch's order is in place.)
  for (const std::string& w : workers_) {
    agent_.rpc_async(w, AbandonOrderRequest::kFunction, rpc::EncodeCall(AbandonOrderRequest{context_id}));
  }
}

absl::StatusOr<double> Pipeline::RunMicroBatches(const std::vector<c10::IValue>& xs,
                                                 const std::vector<c10::IValue>& ts, double rows,
                                                 int64_t context_id) {
  const int m = schedule_.micro_batches;
  // Every micro-batch's forward pass starts at once; the workers run them
  // in their order. Stage k's output stays on its worker (an RRef) until
  // stage k + 1 fetches it; the last stage's comes here.
  const int S = num_stages();
  std::vector<rpc::Future<c10::IValue>> outs;
  for (int i = 0; i < m; ++i) {
    c10::IValue y = agent_.local_rref(xs[i]);
    for (int s = 0; s + 1 < S; ++s) {
      ASSIGN_OR_RETURN(rpc::RRef next, stages_[s].remote(StageForwardRequest::kMethod,
                                                         rpc::EncodeCall(StageForwardRequest{y, i, context_id})));
      y = next;
    }
    outs.push_back(
        stages_[S - 1].rpc_async(StageForwardRequest::kMethod, rpc::EncodeCall(StageForwardRequest{y, i, context_id})));
  }
  double loss = 0;
  std::vector<rpc::Future<rpc::Empty>> backwards;
  for (int i = 0; i < m; ++i) {
    ASSIGN_OR_RETURN(c10::IValue out, outs[i].wait());
    at::Tensor l;
    try {
      l = options_.loss(ToFloat32(out), ts[i]) * RowsShare(BatchRows(xs[i]), rows);
    } catch (...) {
      return base::StatusFromCurrentException(absl::StrCat(
          "the loss of micro-batch ", i, " (the last stage's output against the targets)"));
    }
    loss += l.item<double>();
    backwards.push_back(autograd::backward_async(agent_, context_id, {l}));
  }
  for (auto& b : backwards) RETURN_IF_ERROR(b.wait().status());
  return loss;
}

absl::StatusOr<c10::IValue> Pipeline::EvalOnWorkers(const c10::IValue& inputs, const c10::IValue& labels,
                                                    const WorkerRows* rows) {
  const int64_t n = rows != nullptr ? rows->rows.numel() : BatchRows(inputs);
  const int m = std::min<int64_t>(schedule_.micro_batches, std::max<int64_t>(1, n));
  ASSIGN_OR_RETURN(const int64_t id, autograd::NewContextId(agent_));
  const c10::IValue read = rows != nullptr ? ToIValue(*rows) : c10::IValue();
  std::vector<rpc::Future<c10::IValue>> replies;
  for (int w = 0; w < static_cast<int>(workers_.size()); ++w) {
    EvalRequest r;
    r.runner = runner_id_;
    r.eval = id;
    if (w == 0) r.inputs = inputs;
    r.micro_batches = m;
    if (w == last_worker()) r.labels = labels;
    if (w == 0 || w == last_worker()) r.rows = read;
    replies.push_back(agent_.rpc_async(workers_[w], EvalRequest::kFunction, rpc::EncodeCall(r)));
  }
  absl::Status status;
  if (const int w = WaitForReplies(agent_, workers_, replies, [&] { AbandonStep(id); }, &status);
      w >= 0) {
    return base::Annotate(status, absl::StrCat("evaluating on worker '", workers_[w], "'"));
  }
  return replies[last_worker()].wait();
}

namespace {

// The last stage's worker's reply to an evaluation with labels: (top1,
// top5, rows read).
absl::StatusOr<Correct> CorrectOf(const c10::IValue& reply) {
  ASSIGN_OR_RETURN(const EvalCorrectReply r, rpc::DecodeTuple<EvalCorrectReply>(reply));
  return Correct{r.top1, r.top5, r.rows, r.items, r.loss_sum};
}

}  // namespace

absl::StatusOr<Correct> Pipeline::eval_correct(const at::Tensor& inputs, const at::Tensor& labels) {
  if (BatchRows(inputs) != labels.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat("eval_correct: ", BatchRows(inputs), " inputs but ",
                                                   labels.size(0), " labels"));
  }
  if (!runs_on_workers()) {
    ASSIGN_OR_RETURN(c10::IValue out, eval_step(inputs));
    if (!out.isTensor()) return absl::InvalidArgumentError("eval_correct: the model's output is not a tensor");
    return CountCorrect(out.toTensor(), labels);
  }
  ASSIGN_OR_RETURN(c10::IValue reply, EvalOnWorkers(inputs, labels));
  ASSIGN_OR_RETURN(Correct counted, CorrectOf(reply));
  counted.rows = labels.size(0);
  return counted;
}

absl::StatusOr<Correct> Pipeline::eval_correct(const WorkerRows& rows) {
  if (!runs_on_workers()) {
    return absl::FailedPreconditionError("eval_correct: rows read on the workers need step runners (a named loss)");
  }
  if (!rows.rows.defined() || rows.rows.dim() != 1 || rows.rows.numel() == 0) {
    return absl::InvalidArgumentError("eval_correct: no rows to evaluate");
  }
  ASSIGN_OR_RETURN(c10::IValue reply, EvalOnWorkers(c10::IValue(), c10::IValue(), &rows));
  return CorrectOf(reply);
}

absl::StatusOr<c10::IValue> Pipeline::eval_step(const c10::IValue& inputs) {
  if (runs_on_workers()) return EvalOnWorkers(inputs, c10::IValue());
  const int m = std::min<int64_t>(schedule_.micro_batches, std::max<int64_t>(1, BatchRows(inputs)));
  ASSIGN_OR_RETURN(std::vector<c10::IValue> xs, SplitMicroBatches(inputs, m));
  const int S = num_stages();
  std::vector<rpc::Future<c10::IValue>> outs;
  for (int i = 0; i < m; ++i) {
    c10::IValue y = agent_.local_rref(xs[i]);
    for (int s = 0; s + 1 < S; ++s) {
      ASSIGN_OR_RETURN(rpc::RRef next,
                       stages_[s].remote(StageEvalRequest::kMethod, rpc::EncodeCall(StageEvalRequest{y, i})));
      y = next;
    }
    outs.push_back(stages_[S - 1].rpc_async(StageEvalRequest::kMethod, rpc::EncodeCall(StageEvalRequest{y, i})));
  }
  std::vector<c10::IValue> parts;
  for (auto& f : outs) {
    ASSIGN_OR_RETURN(c10::IValue out, f.wait());
    parts.push_back(std::move(out));
  }
  return MergeMicroBatches(parts);
}

absl::StatusOr<std::vector<int64_t>> Pipeline::peak_activation_bytes(bool reset) {
  std::vector<rpc::Future<c10::IValue>> pending;
  for (const rpc::RRef& s : stages_) {
    pending.push_back(s.rpc_async(ActivationBytesRequest::kMethod, rpc::EncodeCall(ActivationBytesRequest{reset})));
  }
  ASSIGN_OR_RETURN(std::vector<c10::IValue> values, rpc::WaitAll(pending));
  std::vector<int64_t> out;
  for (const c10::IValue& v : values) out.push_back(v.toInt());
  return out;
}

absl::StatusOr<std::map<std::string, int64_t>> SentMessages(rpc::Agent& agent,
                                                            const std::vector<std::string>& workers) {
  constexpr char kAsk[] = "remora.pipeline.sent_messages";
  std::vector<rpc::Future<c10::IValue>> asked;
  for (const std::string& w : workers) asked.push_back(agent.rpc_async(w, kAsk));
  std::map<std::string, int64_t> total = agent.sent_messages();
  ASSIGN_OR_RETURN(std::vector<c10::IValue> counts, rpc::WaitAll(asked, [&workers](size_t w) {
                     return absl::StrCat("counting the messages of worker '", workers[w], "'");
                   }));
  for (const c10::IValue& count : counts) {
    for (const auto& entry : count.toGenericDict()) {
      total[entry.key().toStringRef()] += entry.value().toInt();
    }
  }
  total.erase(absl::StrCat("function '", kAsk, "'"));
  return total;
}

std::map<std::string, int64_t> MessagesBetween(const std::map<std::string, int64_t>& before,
                                               const std::map<std::string, int64_t>& after) {
  std::map<std::string, int64_t> sent;
  for (const auto& [kind, n] : after) {
    auto it = before.find(kind);
    const int64_t d = n - (it == before.end() ? 0 : it->second);
    if (d != 0) sent[kind] = d;
  }
  return sent;
}

absl::StatusOr<std::map<std::string, int64_t>> Pipeline::sent_messages() const {
  return SentMessages(agent_, workers_);
}

absl::StatusOr<std::vector<at::Tensor>> Pipeline::stage_state(int k) {
  if (k < 0 || k >= num_stages()) {
    return absl::OutOfRangeError(absl::StrCat("stage ", k, " of ", num_stages()));
  }
  ASSIGN_OR_RETURN(c10::IValue state, stages_[k].rpc_sync("state"));
  return state.toTensorVector();
}

}  // namespace remora::pipeline
