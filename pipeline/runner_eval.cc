// The evaluation half of a worker's step runner (pipeline/runner_plan.h).
#include <algorithm>
#include <utility>

#include <ATen/TensorOperators.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/eq.h>
#include <ATen/ops/sum.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "pipeline/accuracy.h"
#include "pipeline/microbatch.h"
#include "pipeline/recompute.h"
#include "pipeline/protocol.h"
#include "pipeline/runner_plan.h"
#include "pipeline/worker_data.h"

namespace remora::pipeline {

void RunnerPlan::RequireHosted(int64_t stage, const std::string& me) const {
  if (!hosts(stage)) {
    throw std::invalid_argument(absl::StrCat("worker '", me, "' hosts no stage ", stage, " of this pipeline"));
  }
}

c10::IValue ToDevice(const c10::IValue& value, c10::Device device) {
  if (!value.isTensor() || value.toTensor().device() == device) return value;
  at::Tensor t = value.toTensor();
  if (device.is_cuda() && t.is_cpu()) {
    return t.pin_memory().to(device, /*non_blocking=*/true);
  }
  return t.to(device);
}

bool EvalRunner::Abandon(int64_t id) {
  std::shared_ptr<EvalBatch> eval;
  {
    base::MutexLock lock(mu_);
    if (auto it = evals_.find(id); it != evals_.end()) eval = it->second;
  }
  if (!eval) return false;
  FailEval(eval, absl::AbortedError(absl::StrCat(
      "the evaluation was abandoned on worker '", agent_.self().name, "' (another worker failed)")));
  return true;
}

rpc::Future<c10::IValue> EvalRunner::Eval(int64_t id, const c10::IValue& inputs, int m, const c10::IValue& labels,
                                     const c10::IValue& rows) {
  const std::string& me = agent_.self().name;
  const int64_t last = plan_->num_stages() - 1;
  const std::optional<WorkerRows> read = WorkerRowsFrom(rows);
  c10::IValue x = inputs;
  at::Tensor l = labels.isTensor() ? labels.toTensor() : at::Tensor();
  at::Tensor send;  // the labels, to the last stage's worker
  absl::Status status;
  if (read && plan_->hosts(0)) {
    absl::StatusOr<data::Batch> batch = ReadRows(me, read->source, read->rows, read->epoch);
    status = batch.status();
    if (batch.ok() && batch->labels.size(0) < m) {
      status = absl::FailedPreconditionError(absl::StrCat(
          batch->skipped, " of the ", read->rows.numel(), " files to evaluate could not be read (--skip-bad-images), "
          "leaving fewer rows than the ", m, " micro-batches: replace the files"));
    }
    if (batch.ok()) {
      x = std::move(batch->images);
      (plan_->hosts(last) ? l : send) = std::move(batch->labels);
    }
  }
  std::vector<c10::IValue> xs;
  if (status.ok() && plan_->hosts(0)) {
    auto split = SplitMicroBatches(ToDevice(x, plan_->stages.at(0).device()), m);
    if (split.ok()) xs = std::move(*split);
    status = split.status();
  }
  if (!status.ok()) {
    return rpc::Future<c10::IValue>::Ready(base::Annotate(status, absl::StrCat("worker '", me, "'")));
  }
  std::shared_ptr<EvalBatch> b;
  std::vector<std::tuple<int64_t, int64_t, c10::IValue>> early;
  {
    base::MutexLock lock(mu_);
    evals_.erase(evals_.begin(), evals_.lower_bound(id));
    latest_eval_ = id;
    b = EvalOf(id);
    if (b->over) {
      return rpc::Future<c10::IValue>::Ready(absl::AbortedError(absl::StrCat(
          "evaluation ", id, " was abandoned before it started on worker '", me, "'")));
    }
    b->started = true;
    b->m = m;
    b->by_rows = read.has_value();
    b->remaining = m * static_cast<int>(plan_->stages.size());
    if (plan_->hosts(last)) {
      if (read && !plan_->hosts(0)) {
        l = b->sent_labels;  // undefined until they come
        b->labels_come = !l.defined();
      }
      if (l.defined()) status = SetLabels(*b, l);
      if (!read && !l.defined()) b->outputs.resize(m);
    }
    early = std::move(b->early);
  }
  if (!status.ok()) {
    FailEval(b, base::Annotate(status, absl::StrCat("worker '", me, "'")));
    return b->done;
  }
  if (send.defined()) {
    const std::string& to = plan_->stage_workers[last];
    agent_.rpc_async(to, EvalTargetsRequest::kFunction, rpc::EncodeCall(EvalTargetsRequest{plan_->id, id, send}))
        .then([self = shared_from_this(), b, to, me](const absl::StatusOr<c10::IValue>& r) {
          if (!r.ok()) {
            self->FailEval(b, base::Annotate(r.status(), absl::StrCat("worker '", me,
                                                                      "' sending the evaluation's labels "
                                                                      "to worker '",
                                                                      to, "' (the last stage's)")));
          }
        });
  }
  for (int i = 0; i < static_cast<int>(xs.size()); ++i) StartEval(b, 0, i, std::move(xs[i]));
  for (auto& [stage, mb, value] : early) StartEval(b, stage, mb, std::move(value));
  return b->done;
}

absl::Status EvalRunner::SetLabels(EvalBatch& b, const at::Tensor& labels) {
  ASSIGN_OR_RETURN(std::vector<c10::IValue> split,
                   SplitMicroBatches(ToDevice(labels, plan_->stages.at(plan_->num_stages() - 1).device()), b.m));
  b.labels.clear();
  for (const c10::IValue& l : split) b.labels.push_back(l.toTensor());
  b.rows = labels.size(0);
  b.labels_come = false;
  return absl::OkStatus();
}

void EvalRunner::Labels(int64_t id, const at::Tensor& labels) {
  plan_->RequireHosted(plan_->num_stages() - 1, agent_.self().name);
  std::shared_ptr<EvalBatch> b;
  std::vector<std::pair<int64_t, c10::IValue>> uncounted;
  absl::Status status;
  {
    base::MutexLock lock(mu_);
    if (id < latest_eval_) return;
    b = EvalOf(id);
    if (b->over) return;
    if (!b->started) {
      b->sent_labels = labels;
      return;
    }
    status = SetLabels(*b, labels);
    uncounted = std::move(b->uncounted);
  }
  if (!status.ok()) {
    FailEval(b, base::Annotate(status, absl::StrCat("worker '", agent_.self().name, "'")));
    return;
  }
  for (auto& [mb, y] : uncounted) Account(b, plan_->num_stages() - 1, mb, std::move(y));
}

void EvalRunner::Push(int64_t id, int64_t stage, int64_t mb, c10::IValue value) {
  plan_->RequireHosted(stage, agent_.self().name);
  std::shared_ptr<EvalBatch> b;
  {
    base::MutexLock lock(mu_);
    if (id < latest_eval_) return;
    b = EvalOf(id);
    if (b->over) return;
    if (!b->started) {
      b->early.emplace_back(stage, mb, std::move(value));
      return;
    }
  }
  StartEval(b, stage, mb, std::move(value));
}

std::shared_ptr<EvalBatch> EvalRunner::EvalOf(int64_t id) {
  auto& slot = evals_[id];
  if (!slot) slot = std::make_shared<EvalBatch>(id, agent_.executor());
  return slot;
}

void EvalRunner::StartEval(std::shared_ptr<EvalBatch> b, int64_t stage, int64_t mb, c10::IValue x) {
  rpc::Executor* executor = agent_.lane();  // (every pass on one thread)
  std::shared_ptr<EvalRunner> self = shared_from_this();
  runtime::ComputeTurn::RunInTurn(
      runtime::LaneAction{-1, stage, mb, /*backward=*/false},
      [self, b, stage, mb, x = std::move(x)] { self->EvalForward(b, stage, mb, x); },
      [executor](std::function<void()> fn) { executor->Schedule(std::move(fn)); });
}

void EvalRunner::EvalForward(const std::shared_ptr<EvalBatch>& b, int64_t stage, int64_t mb,
                 const c10::IValue& x) {
  {
    base::MutexLock lock(mu_);
    if (b->over) return;
  }
  c10::IValue y;
  try {
    y = plan_->stages.at(stage).Eval(x, mb);
  } catch (...) {
    FailEval(b, base::StatusFromCurrentException(absl::StrCat(
        "stage ", stage, " on worker '", agent_.self().name, "', eval of micro-batch ", mb)));
    return;
  }
  if (stage + 1 < plan_->num_stages()) {
    EvalPushRequest push;
    push.runner = plan_->id;
    push.context = b->id;
    push.stage = stage + 1;
    push.micro_batch = mb;
    push.value = y;
    agent_.rpc_async(plan_->stage_workers[stage + 1], EvalPushRequest::kFunction, rpc::EncodeCall(push),
                     rpc::StreamOrdered(b->id))
        .then([self = shared_from_this(), b, stage, mb](const absl::StatusOr<c10::IValue>& r) {
          if (!r.ok()) {
            self->FailEval(b, base::Annotate(r.status(), absl::StrCat("pushing stage ", stage,
                                                                "'s eval output of micro-batch ", mb)));
          }
        });
  }
  Account(b, stage, mb, std::move(y));
}

void EvalRunner::Account(const std::shared_ptr<EvalBatch>& b, int64_t stage, int64_t mb, c10::IValue y) {
  // Counting: how many of the micro-batch's rows the output gets right.
  at::Tensor right;
  if (stage + 1 == plan_->num_stages()) {
    y = ToFloat32(y);  // (a bf16 stage's logits counted in float32)
    at::Tensor labels;
    {
      base::MutexLock lock(mu_);
      if (b->over) return;
      if (b->labels_come) {  // counted when the labels come
        b->uncounted.emplace_back(mb, std::move(y));
        return;
      }
      if (!b->labels.empty()) labels = b->labels.at(mb);
    }
    if (labels.defined()) {
      if (!y.isTensor() || !FitsLabels(y.toTensor(), labels)) {
        FailEval(b, absl::InvalidArgumentError(absl::StrCat(
            "stage ", stage, " on worker '", agent_.self().name, "', micro-batch ", mb,
            ": the model's output for ",
            labels.size(0), " rows is ", y.isTensor() ? c10::str(y.toTensor().sizes()) : y.tagKind(),
            "; counting the right answers needs [", absl::StrJoin(labels.sizes(), ", "),
            ", classes] (the labels' shape and the classes)")));
        return;
      }
      right = CountCorrectOnDevice(y.toTensor(), labels);  // [top1, top5, loss sum, labels]
    }
  }
  std::vector<c10::IValue> outputs;
  at::Tensor correct;
  bool by_rows = false;
  int64_t rows = 0;
  {
    base::MutexLock lock(mu_);
    if (b->over) return;
    by_rows = b->by_rows;
    rows = b->rows;
    if (right.defined()) {
      b->correct = b->correct.defined() ? b->correct + right : right;
    } else if (stage + 1 == plan_->num_stages()) {
      b->outputs.at(mb) = std::move(y);
    }
    if (--b->remaining > 0) return;
    b->over = true;
    outputs = std::move(b->outputs);
    correct = std::move(b->correct);
  }
  // Activations that came GPU to GPU: their copies must have completed.
  const absl::Status settled = agent_.settle_cuda_receives(b->id);
  agent_.forget_cuda_receives(b->id);
  if (!settled.ok()) {
    b->done.SetError(base::Annotate(settled, absl::StrCat("evaluation on worker '", agent_.self().name, "'")));
    return;
  }
  if (correct.defined()) {
    const Correct counts = CorrectFromCounts(correct.cpu(), by_rows ? rows : 0);
    b->done.SetValue(
        rpc::EncodeTuple(EvalCorrectReply{counts.top1, counts.top5, counts.rows, counts.items, counts.loss_sum}));
    return;
  }

  if (outputs.empty()) {
    b->done.SetValue(c10::IValue());
    return;
  }
  auto merged = MergeMicroBatches(outputs);
  if (merged.ok()) {
    b->done.SetValue(std::move(*merged));
  } else {
    b->done.SetError(merged.status());
  }
}

void EvalRunner::FailEval(const std::shared_ptr<EvalBatch>& b, absl::Status status) {
  {
    base::MutexLock lock(mu_);
    if (b->over) return;
    b->over = true;
    b->early.clear();
    b->outputs.clear();
    b->labels.clear();
    b->uncounted.clear();
  }
  agent_.forget_cuda_receives(b->id);
  b->done.SetError(std::move(status));
}

}  // namespace remora::pipeline
