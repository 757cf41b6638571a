// What a worker's step runner (pipeline/runner.h) holds from batch to batch,
// and its evaluation half; internal to pipeline/ (runner.cc trains,
// runner_eval.cc evaluates).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "pipeline/batch_end.h"
#include "pipeline/pipeline.h"
#include "pipeline/stage.h"
#include "rpc/agent.h"
#include "runtime/compute_lane.h"

namespace remora::pipeline {

// One pipeline's part on one worker, as make_runner gives it.
struct RunnerPlan {
  int64_t id = 0;
  std::vector<std::string> stage_workers;  // stage k's worker
  int micro_batches = 1;
  std::vector<runtime::LaneAction> actions;         // this worker's order (context_id unset)
  std::map<int64_t, LocalStage> stages;    // this worker's, by index
  LossFn loss;                             // empty unless the last stage is here
  std::optional<rpc::RRef> optimizer;           // this worker's LocalOptimizer
  double clip_grad_norm = 0;               // PipelineOptions::clip_grad_norm
  TiedCopies tied;                         // PipelineOptions::tied_first/_last's copies here

  int num_stages() const { return static_cast<int>(stage_workers.size()); }
  bool hosts(int64_t stage) const { return stages.count(stage) > 0; }
  // Whether the order splits backward passes into B and W (zb1p).
  bool splits_backward() const {
    for (const runtime::LaneAction& a : actions) {
      if (a.weight) return true;
    }
    return false;
  }
  // Throws std::invalid_argument unless stage `stage` is on worker `me`
  // (what a push names must be).
  void RequireHosted(int64_t stage, const std::string& me) const;
};

// `value` (a tensor; anything else as it is) on `device`. To a GPU the
// copy is from pinned memory and does not wait (a copy from pageable
// memory would hold this thread until the stream had run everything queued
// before it, and the host could no longer run ahead of the GPU).
c10::IValue ToDevice(const c10::IValue& value, c10::Device device);

// One evaluation batch on this worker (forward only, no autograd).
// Guarded by its EvalRunner's mutex.
struct EvalBatch {
  EvalBatch(int64_t i, rpc::Executor* executor) : id(i), done(executor) {}
  const int64_t id;
  bool started = false;
  bool over = false;
  int remaining = 0;  // forward passes still to run here
  std::vector<std::tuple<int64_t, int64_t, c10::IValue>> early;
  std::vector<c10::IValue> outputs;  // the last stage's, per micro-batch
  // With labels (on the last stage's worker): the outputs are not kept,
  // only how many rows have their label first and among the first five
  // ([top1, top5], summed on the device).
  std::vector<at::Tensor> labels;  // per micro-batch
  at::Tensor correct;
  // Where stage 0's worker reads the rows (pipeline/worker_data.h): the
  // labels come from it ("eval_targets"; `sent_labels` until the batch has
  // started), the outputs that came first wait in `uncounted`, and the
  // reply is (right, rows).
  bool labels_come = false;
  at::Tensor sent_labels;
  std::vector<std::pair<int64_t, c10::IValue>> uncounted;
  bool by_rows = false;
  int64_t rows = 0;  // labelled rows (the reply's, by_rows)
  int m = 0;
  rpc::Future<c10::IValue> done;
};

// The evaluation half of a step runner ("remora.pipeline.eval",
// "eval_push"): forward passes in eval mode, no autograd, each a plain turn
// of the compute lane; outputs pushed worker to worker as in training.
// Thread-safety: every method may be called from any thread. Ownership:
// shared by its runner and the closures in flight; shares the plan.
class EvalRunner : public std::enable_shared_from_this<EvalRunner> {
 public:
  EvalRunner(rpc::Agent& agent, std::shared_ptr<const RunnerPlan> plan)
      : agent_(agent), plan_(std::move(plan)) {}

  // Evaluation `id` of `inputs` (on stage 0's worker) in `m` micro-batches:
  // the last stage's worker replies with the outputs merged (with `labels`:
  // with (top1, top5, rows read): pipeline/accuracy.h's Correct), the
  // others with None once their passes are done.
  rpc::Future<c10::IValue> Eval(int64_t id, const c10::IValue& inputs, int m, const c10::IValue& labels,
                           const c10::IValue& rows = c10::IValue());
  // The labels of evaluation `id`, from the worker of stage 0 that read
  // its rows (WorkerRows).
  void Labels(int64_t id, const at::Tensor& labels);
  // Stage `stage`'s input for micro-batch `mb` of evaluation `id`.
  void Push(int64_t id, int64_t stage, int64_t mb, c10::IValue value);
  // Fails evaluation `id` if it is one here; whether it was.
  bool Abandon(int64_t id);

 private:
  std::shared_ptr<EvalBatch> EvalOf(int64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues an eval pass: a plain turn of the compute lane (first come,
  // first served), never waiting for a thread.
  void StartEval(std::shared_ptr<EvalBatch> b, int64_t stage, int64_t mb, c10::IValue x);
  void EvalForward(const std::shared_ptr<EvalBatch>& b, int64_t stage, int64_t mb, const c10::IValue& x);
  // Accounts for stage `stage`'s output `y` of micro-batch `mb`: counted
  // against its labels on the last stage, kept, or only done; replies once
  // all of the batch's passes here are.
  void Account(const std::shared_ptr<EvalBatch>& b, int64_t stage, int64_t mb, c10::IValue y);
  // Cuts `labels` into the batch's micro-batches on the last stage's
  // device. Needs b->m.
  absl::Status SetLabels(EvalBatch& b, const at::Tensor& labels) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailEval(const std::shared_ptr<EvalBatch>& b, absl::Status status);

  rpc::Agent& agent_;
  const std::shared_ptr<const RunnerPlan> plan_;
  absl::Mutex mu_;
  int64_t latest_eval_ ABSL_GUARDED_BY(mu_) = -1;
  std::map<int64_t, std::shared_ptr<EvalBatch>> evals_ ABSL_GUARDED_BY(mu_);
};

}  // namespace remora::pipeline
