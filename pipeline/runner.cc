#include "pipeline/runner.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include <ATen/Context.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/List.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "autograd/dist_autograd.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "optim/distributed_optimizer.h"
#include "pipeline/batch_end.h"
#include "pipeline/microbatch.h"
#include "pipeline/recompute.h"
#include "pipeline/pipeline.h"
#include "pipeline/protocol.h"
#include "pipeline/runner_plan.h"
#include "pipeline/stage.h"
#include "pipeline/worker_data.h"
#include "rpc/agent.h"
#include "runtime/action_mark.h"
#include "runtime/compute_lane.h"
#include "trace/trace.h"

namespace remora::pipeline {
namespace {

// One batch on this worker. Guarded by its runner's mutex.
struct Batch {
  explicit Batch(int64_t c, rpc::Executor* executor) : context(c), done(executor) {}
  const int64_t context;
  bool started = false;  // its actions are under way
  bool over = false;     // finished or failed: nothing more runs for it
  // Its "run" call has come, but the batch before it (`after`) has not
  // ended here yet: `inputs` wait with it.
  bool queued = false;
  int64_t after = -1;
  std::vector<c10::IValue> inputs;   // on stage 0's worker, until it starts
  // Outputs pushed here before "run" came: (stage, micro-batch, value).
  std::vector<std::tuple<int64_t, int64_t, c10::IValue>> early;
  std::vector<c10::IValue> targets;  // on the last stage's worker
  std::vector<double> weights;       // each micro-batch's share of the batch's rows
  // Whether `targets` are here: they come with "run", or, where stage 0's
  // worker reads the batch (pipeline/worker_data.h), in its "targets"
  // message; the last stage's forward passes wait for them in `awaiting`.
  bool targets_here = false;
  std::vector<std::tuple<int64_t, int64_t, c10::IValue>> awaiting;
  at::Tensor loss_sum;               // detached, on the last stage's device
  std::vector<rpc::Future<rpc::Empty>> backwards;  // started here, from the losses
  rpc::Future<c10::IValue> done;          // the reply to "run"
};

// One pipeline's part on this worker (see runner.h). Owns its batches'
// state; shared by the process's runner table and the closures in flight.
// Thread-safety: every method may be called from any thread.
class Runner : public std::enable_shared_from_this<Runner> {
 public:
  Runner(rpc::Agent& agent, RunnerPlan plan)
      : agent_(agent),
        plan_(std::make_shared<const RunnerPlan>(std::move(plan))),
        evals_(std::make_shared<EvalRunner>(agent, plan_)) {}

  EvalRunner& evals() { return *evals_; }

  absl::Status Attach(std::shared_ptr<StepParticipant> participant) {
    base::MutexLock lock(mu_);
    if (participant_) {
      return absl::AlreadyExistsError(absl::StrCat("the step runner of pipeline ", plan_->id,
                                                   " on worker '", agent_.self().name,
                                                   "' has a participant already"));
    }
    participant_ = std::move(participant);
    return absl::OkStatus();
  }

  int num_stages() const { return plan_->num_stages(); }
  bool hosts(int64_t stage) const { return plan_->hosts(stage); }

  // Batch `context`, to start once batch `after` (the master's previous one) has ended
  // here: the master may send a batch's call while the one before it still runs, and
  // calls may arrive in any order. `after` -1: the master waits for no batch before this
  // one, so any older one still here is one whose abandon was lost (sent to a worker cut
  // off for a while): it is dropped.
  // With `data` (WorkerRows), stage 0's worker reads the batch itself and
  // sends the labels to the last stage's worker, which then gets none here.
  rpc::Future<c10::IValue> Run(int64_t context, int64_t after, const c10::IValue& inputs,
                          const c10::IValue& targets, int64_t total_rows, const c10::IValue& data) {
    const int last = num_stages() - 1;
    const std::optional<WorkerRows> rows = WorkerRowsFrom(data);
    c10::IValue x = inputs, t = targets;
    at::Tensor send_labels;  // to the last stage's worker
    std::vector<c10::IValue> xs, ts;
    std::vector<double> weights;
    // What each micro-batch's rows are a share of.
    double total = static_cast<double>(total_rows);
    absl::Status status = autograd::EnsureContext(agent_, context);
    if (status.ok() && rows && hosts(0)) status = ReadBatch(*rows, total_rows, &x, &t, &send_labels, &total);
    // The whole batch goes to the stage's device at once, before the
    // micro-batches are cut from it (while an earlier batch may still run).
    std::optional<trace::Scope> input;
    if (status.ok() && (hosts(0) || hosts(last))) input.emplace("input", -1);
    if (status.ok() && hosts(0)) {
      auto split = SplitMicroBatches(ToDevice(x, plan_->stages.at(0).device()), plan_->micro_batches);
      if (split.ok()) xs = std::move(*split);
      status = split.status();
    }
    const bool targets_come = hosts(last) && (!rows || hosts(0));
    if (status.ok() && targets_come) status = SplitTargets(t, total, &ts, &weights);
    input.reset();
    if (!status.ok()) {
      autograd::ReleaseHere(agent_, context);
      return rpc::Future<c10::IValue>::Ready(base::Annotate(status, absl::StrCat("worker '", agent_.self().name, "'")));
    }
    std::shared_ptr<Batch> b;
    {
      base::MutexLock lock(mu_);
      b = BatchOf(context);
      if (b->over || context < latest_) {
        autograd::ReleaseHere(agent_, context);
        return rpc::Future<c10::IValue>::Ready(absl::AbortedError(absl::StrCat(
            "batch ", context, " was abandoned before it started on worker '", agent_.self().name, "'")));
      }
      b->queued = true;
      b->after = after;
      b->inputs = std::move(xs);
      if (targets_come) {
        b->targets = std::move(ts);
        b->weights = std::move(weights);
        b->targets_here = true;
      }
    }
    if (send_labels.defined()) {
      const std::string& to = plan_->stage_workers[last];
      agent_.rpc_async(to, TargetsRequest::kFunction,
                       rpc::EncodeCall(TargetsRequest{plan_->id, context, send_labels, total}))
          .then([self = shared_from_this(), b, to](const absl::StatusOr<c10::IValue>& r) {
            if (!r.ok()) {
              self->Fail(b, base::Annotate(r.status(), absl::StrCat("worker '", self->agent_.self().name,
                                                              "' sending the batch's labels to worker '", to,
                                                              "' (the last stage's)")));
            }
          });
    }
    if (after < 0) FailOlder(context);
    StartReady();
    return b->done;
  }

  void Push(int64_t context, int64_t stage, int64_t mb, c10::IValue value) {
    plan_->RequireHosted(stage, agent_.self().name);
    std::shared_ptr<Batch> b;
    {
      base::MutexLock lock(mu_);
      // A failed batch's: receiving it made its context here again (the
      // RPC layer records every message that carries gradients), which
      // nothing else would release.
      if (context < latest_ || (batches_.count(context) > 0 && batches_[context]->over)) {
        autograd::ReleaseHere(agent_, context);
        return;
      }
      b = BatchOf(context);
      if (!b->started) {
        b->early.emplace_back(stage, mb, std::move(value));
        return;
      }
    }
    StartForward(b, stage, mb, std::move(value));
  }

  // The labels of batch `context` (of `total` rows in all), from the
  // worker of stage 0 that read it. Throws what fails the batch here, so
  // that the sender fails with the cause too.
  void Targets(int64_t context, const c10::IValue& labels, double total) {
    const int last = num_stages() - 1;
    plan_->RequireHosted(last, agent_.self().name);
    std::vector<c10::IValue> ts;
    std::vector<double> weights;
    const absl::Status status = SplitTargets(labels, total, &ts, &weights);
    std::shared_ptr<Batch> b;
    std::vector<std::tuple<int64_t, int64_t, c10::IValue>> awaiting;
    {
      base::MutexLock lock(mu_);
      if (context < latest_ || (batches_.count(context) > 0 && batches_[context]->over)) return;
      b = BatchOf(context);
      if (b->targets_here) return;  // given already
      if (status.ok()) {
        b->targets = std::move(ts);
        b->weights = std::move(weights);
        b->targets_here = true;
        awaiting = std::move(b->awaiting);
      }
    }
    if (!status.ok()) {
      const absl::Status failed = base::Annotate(status, absl::StrCat("worker '", agent_.self().name, "'"));
      Fail(b, failed);
      throw std::invalid_argument(std::string(failed.message()));
    }
    for (auto& [stage, mb, value] : awaiting) StartForward(b, stage, mb, std::move(value));
  }

  void Abandon(int64_t context) {
    if (evals_->Abandon(context)) return;
    if (plan_->clip_grad_norm > 0 || plan_->tied.any()) AbandonBatchEnd(plan_->id, context);
    std::shared_ptr<Batch> b;
    {
      base::MutexLock lock(mu_);
      b = BatchOf(context);
    }
    Fail(b, absl::AbortedError(absl::StrCat(
        "the batch was abandoned on worker '", agent_.self().name, "' (another worker failed)")));
  }

 private:
  // Reads the batch's `rows` here: images to `x`, labels to `t` or `send_labels`.
  absl::Status ReadBatch(const WorkerRows& rows, int64_t total_rows, c10::IValue* x, c10::IValue* t,
                         at::Tensor* send_labels, double* total) const {
    absl::StatusOr<data::Batch> batch = ReadRows(agent_.self().name, rows.source, rows.rows, rows.epoch);
    if (!batch.ok()) return batch.status();
    absl::Status status;
    const int64_t asked = rows.rows.numel(), read = asked - batch->skipped;
    if (read < plan_->micro_batches) {
      status = absl::FailedPreconditionError(absl::StrCat(
          batch->skipped, " of the batch's ", asked, " files could not be read (--skip-bad-images), leaving ",
          read, " rows for ", plan_->micro_batches, " micro-batches: replace the files or give fewer --splits"));
    }
    // Files left out: this share's micro-batches are weighted by the
    // rows read, so that the replicas' weights still sum to one.
    if (read > 0) *total = static_cast<double>(total_rows) * read / asked;
    *x = std::move(batch->images);
    if (hosts(num_stages() - 1)) {
      *t = std::move(batch->labels);
    } else {
      *send_labels = std::move(batch->labels);
    }
    return status;
  }

  // Fails the batches before `context` still here (the master gave them up).
  void FailOlder(int64_t context) {
    std::vector<std::shared_ptr<Batch>> older;
    {
      base::MutexLock lock(mu_);
      for (auto it = batches_.begin(); it != batches_.end() && it->first < context; ++it) {
        if (!it->second->over) older.push_back(it->second);
      }
    }
    for (const auto& o : older) {
      Fail(o, absl::AbortedError(absl::StrCat("batch ", o->context, " on worker '", agent_.self().name,
                                              "' was given up by the master")));
    }
  }

  // The pipeline's other workers.
  std::vector<std::string> Peers() const {
    std::vector<std::string> peers;
    for (const std::string& w : plan_->stage_workers) {
      if (w != agent_.self().name && std::find(peers.begin(), peers.end(), w) == peers.end()) peers.push_back(w);
    }
    return peers;
  }

  // Starts the queued batch whose turn it is, if any: none runs here and
  // the batch it waits for has ended.
  void StartReady() {
    std::shared_ptr<Batch> b;
    std::vector<std::tuple<int64_t, int64_t, c10::IValue>> early;
    std::vector<c10::IValue> xs;
    {
      base::MutexLock lock(mu_);
      if (running_ >= 0) return;
      for (auto& [context, batch] : batches_) {
        if (batch->queued && !batch->over && batch->after <= last_ended_) {
          b = batch;
          break;
        }
      }
      if (!b) return;
      const int64_t context = b->context;
      b->queued = false;
      b->started = true;
      running_ = context;
      if (participant_) participant_->Begin(context, plan_->micro_batches);
      // Batches run one at a time and their ids grow: older entries are
      // failed batches' (and late pushes for them are dropped).
      batches_.erase(batches_.begin(), batches_.lower_bound(context));
      latest_ = context;
      std::vector<runtime::LaneAction> order = plan_->actions;
      for (runtime::LaneAction& a : order) a.context_id = context;
      // Under the lock, so that no push starts a forward pass before the
      // order is in place.
      runtime::ComputeTurn::SetOrder(context, std::move(order));
      std::weak_ptr<Runner> weak = weak_from_this();
      rpc::Executor* executor = agent_.executor();
      runtime::ComputeTurn::WhenOrderDone(context, [weak, b, executor] {
        executor->Schedule([weak, b] {
          if (auto self = weak.lock()) self->Finish(b);
        });
      });
      xs = std::move(b->inputs);
      early = std::move(b->early);
    }
    for (int i = 0; i < static_cast<int>(xs.size()); ++i) StartForward(b, 0, i, std::move(xs[i]));
    for (auto& [stage, mb, value] : early) StartForward(b, stage, mb, std::move(value));
  }

  // Batch `b` has ended here (stepped, or failed): the next may start.
  void Ended(const Batch& b) {
    {
      base::MutexLock lock(mu_);
      last_ended_ = std::max(last_ended_, b.context);
      if (running_ == b.context) running_ = -1;
    }
    StartReady();
  }

  bool Over(const Batch& b) {
    base::MutexLock lock(mu_);
    return b.over;
  }

  std::shared_ptr<Batch> BatchOf(int64_t context) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto& slot = batches_[context];
    if (!slot) slot = std::make_shared<Batch>(context, agent_.executor());
    return slot;
  }

  // `targets` on the last stage's device, cut into the micro-batches, and
  // each one's share of the batch's `total_rows` rows.
  absl::Status SplitTargets(const c10::IValue& targets, double total_rows, std::vector<c10::IValue>* ts,
                            std::vector<double>* weights) const {
    ASSIGN_OR_RETURN(*ts, SplitMicroBatches(ToDevice(targets, plan_->stages.at(num_stages() - 1).device()),
                                            plan_->micro_batches));
    for (const c10::IValue& t : *ts) weights->push_back(RowsShare(BatchRows(t), total_rows));
    return absl::OkStatus();
  }

  // Queues the forward pass of (stage, mb) for its turn in the order; the
  // last stage's waits for the batch's targets.
  void StartForward(std::shared_ptr<Batch> b, int64_t stage, int64_t mb, c10::IValue x) {
    if (stage == num_stages() - 1) {
      base::MutexLock lock(mu_);
      if (!b->targets_here) {
        b->awaiting.emplace_back(stage, mb, std::move(x));
        return;
      }
    }
    rpc::Executor* executor = agent_.lane();  // (every pass on one thread)
    std::shared_ptr<Runner> self = shared_from_this();
    runtime::ComputeTurn::RunInTurn(
        runtime::LaneAction{b->context, stage, mb, /*backward=*/false},
        [self, b, stage, mb, x = std::move(x)] { self->Forward(b, stage, mb, x); },
        [executor](std::function<void()> fn) { executor->Schedule(std::move(fn)); });
  }

  // Runs holding the forward action's turn.
  void Forward(const std::shared_ptr<Batch>& b, int64_t stage, int64_t mb, const c10::IValue& x) {
    if (Over(*b)) return;
    const LocalStage& s = plan_->stages.at(stage);
    rpc::ContextIdGuard in_context(b->context);
    try {
      c10::IValue y = s.Forward(x, mb, b->context, plan_->splits_backward());
      if (stage + 1 < num_stages()) {
        // Straight to the next stage's worker; recorded in the context.
        agent_.rpc_async(plan_->stage_workers[stage + 1], PushRequest::kFunction,
                         rpc::EncodeCall(PushRequest{plan_->id, b->context, stage + 1, mb, y}),
                         rpc::StreamOrdered(b->context))
            .then([self = shared_from_this(), b, stage, mb](const absl::StatusOr<c10::IValue>& r) {
              if (!r.ok()) {
                self->Fail(b, base::Annotate(r.status(), absl::StrCat("pushing stage ", stage,
                                                                "'s output of micro-batch ", mb)));
              }
            });
        // Failed while this pass ran: recording the push made the context
        // here anew after Fail (which marks it over first) released it.
        if (Over(*b)) autograd::ReleaseHere(agent_, b->context);
        return;
      }
      // (The loss in float32: a bf16 stage's output as float32.)
      absl::StatusOr<at::Tensor> computed = plan_->loss.Compute(ToFloat32(y), b->targets.at(mb));
      if (!computed.ok()) {
        Fail(b, base::Annotate(computed.status(), absl::StrCat("stage ", stage, " on worker '", agent_.self().name,
                                                         "', micro-batch ", mb)));
        return;
      }
      at::Tensor loss = *computed * b->weights.at(mb);
      const runtime::LaneAction back{b->context, stage, mb, /*backward=*/true};
      {
        base::MutexLock lock(mu_);
        b->loss_sum = b->loss_sum.defined() ? b->loss_sum + loss.detach() : loss.detach();
      }
      const bool split = plan_->splits_backward();
      if (!loss.requires_grad()) {
        runtime::ComputeTurn::Skip(back);
        if (split) runtime::ComputeTurn::Skip(back.Weight());
        return;
      }
      // Its backward pass runs in the order's turn for `back` (and W's),
      // what B keeps for W metered with the forward (the output's mark).
      runtime::ActionMarkInfo info{back, s.label(), split};
      MapTensors(y, [&info](const at::Tensor& t) {
        if (info.hold_tag < 0 && t.requires_grad()) {
          if (std::optional<runtime::ActionMarkInfo> m = runtime::MarkedAction(t)) info.hold_tag = m->hold_tag;
        }
        return t;
      });
      rpc::Future<rpc::Empty> pass = autograd::backward_async(agent_, b->context, {runtime::MarkAction(loss, info)});
      // A pass that fails (here or on a stage it reached) fails the batch
      // now: the stages before it wait for gradients that will not come,
      // and this worker's later actions for their forwards.
      pass.then([self = shared_from_this(), b](const absl::StatusOr<rpc::Empty>& r) {
        if (!r.ok()) self->Fail(b, r.status());
      });
      base::MutexLock lock(mu_);
      b->backwards.push_back(pass);
    } catch (...) {
      Fail(b, base::StatusFromCurrentException(
                  absl::StrCat("stage ", stage, " on worker '", agent_.self().name, "', micro-batch ", mb)));
    }
  }

  // Every action of the batch here has run: step, release, reply.
  void Finish(std::shared_ptr<Batch> b) {
    std::vector<rpc::Future<rpc::Empty>> backwards;
    {
      base::MutexLock lock(mu_);
      if (b->over) return;
      b->over = true;
      backwards = std::move(b->backwards);
      b->targets.clear();
    }
    std::shared_ptr<StepParticipant> participant;
    {
      base::MutexLock lock(mu_);
      participant = participant_;
    }
    // Activations and gradients that came GPU to GPU: their copies must
    // have completed (and not failed) before the step uses them.
    std::optional<trace::Scope> settle(std::in_place, "settle", -1);
    absl::Status status = base::Annotate(agent_.settle_cuda_receives(b->context),
                                   absl::StrCat("batch ", b->context, " on worker '", agent_.self().name, "'"));
    settle.reset();
    if (status.ok() && participant) {
      // The replicas' gradient sum.
      try {
        trace::Scope scope("allreduce", -1);
        participant->Finish(b->context);
      } catch (...) {
        status = base::StatusFromCurrentException(
            absl::StrCat("summing the gradients over the replicas on worker '", agent_.self().name, "'"));
      }
    }
    // (After the replicas' sum, which may have started during the backward
    // passes: each copy then holds the replicas' sum of its own gradient.)
    if (status.ok() && plan_->tied.any()) status = SumTiedGradients(agent_, plan_->id, plan_->tied, b->context);
    std::optional<double> norm;  // with clipping: the gradients' norm before it
    if (status.ok() && plan_->clip_grad_norm > 0) {
      absl::StatusOr<double> clipped =
          ClipGradients(agent_, plan_->id, Peers(), b->context, plan_->clip_grad_norm, plan_->tied.last);
      status = clipped.status();
      if (clipped.ok()) norm = *clipped;
    }
    if (status.ok() && participant && participant->Steps()) {
      // ZeRO-1: each replica steps its share of the parameters.
      try {
        participant->Step(b->context);
      } catch (...) {
        status = base::StatusFromCurrentException(
            absl::StrCat("ZeRO-1's step on worker '", agent_.self().name, "'"));
      }
    } else if (status.ok() && plan_->optimizer) {
      status = optim::StepHere(agent_, *plan_->optimizer, b->context);
    }
    autograd::ReleaseHere(agent_, b->context);
    Ended(*b);
    if (!status.ok()) {
      b->done.SetError(status);
      return;
    }
    c10::IValue reply;
    if (b->loss_sum.defined()) {
      trace::Scope scope("loss reply", -1);  // (waits for the device)
      reply = b->loss_sum.item<double>();
      if (norm) reply = std::vector<double>{reply.toDouble(), *norm};
    }
    // The last stage's passes end when the whole chain behind them has;
    // an error there (another worker's backward) fails this reply.
    rpc::WhenAll(backwards).then([done = b->done, reply](const absl::StatusOr<rpc::Empty>& r) mutable {
      if (r.ok()) {
        done.SetValue(reply);
      } else {
        done.SetError(r.status());
      }
    });
  }

  void Fail(const std::shared_ptr<Batch>& b, absl::Status status) {
    {
      base::MutexLock lock(mu_);
      if (b->over) return;
      b->over = true;
      b->queued = false;
      b->early.clear();
      b->awaiting.clear();
      b->inputs.clear();
      if (participant_) participant_->Discard(b->context);
    }
    runtime::ComputeTurn::Abandon(b->context);
    autograd::ReleaseHere(agent_, b->context);
    Ended(*b);
    b->done.SetError(std::move(status));
  }

  rpc::Agent& agent_;
  const std::shared_ptr<const RunnerPlan> plan_;
  const std::shared_ptr<EvalRunner> evals_;
  absl::Mutex mu_;
  int64_t latest_ ABSL_GUARDED_BY(mu_) = -1;     // the last batch started
  int64_t running_ ABSL_GUARDED_BY(mu_) = -1;    // started and not ended, or -1
  int64_t last_ended_ ABSL_GUARDED_BY(mu_) = -1;
  std::shared_ptr<StepParticipant> participant_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::shared_ptr<Batch>> batches_ ABSL_GUARDED_BY(mu_);
};

// The process's runners, by pipeline id.
struct Runners {
  absl::Mutex mu;
  std::map<int64_t, std::shared_ptr<Runner>> by_id ABSL_GUARDED_BY(mu);
};

Runners& TheRunners() {
  static Runners* runners = new Runners;  // never destroyed
  return *runners;
}

std::shared_ptr<Runner> FindRunner(rpc::CallContext& ctx, int64_t id) {
  Runners& runners = TheRunners();
  base::MutexLock lock(runners.mu);
  auto it = runners.by_id.find(id);
  if (it == runners.by_id.end()) {
    throw std::invalid_argument(absl::StrCat(
        "worker '", ctx.worker_name(), "' has no step runner for pipeline ", id,
        " (was the pipeline created by this group's master?)"));
  }
  return it->second;
}

c10::IValue MakeRunner(rpc::CallContext& ctx, const rpc::Args& a) {
  if (ctx.agent == nullptr) throw std::runtime_error("make_runner needs an agent");
  rpc::Agent& agent = *ctx.agent;
  const std::string& me = agent.self().name;
  const auto r = rpc::DecodeCallOrThrow<MakeRunnerRequest>(a);
  RunnerPlan plan;
  plan.id = r.runner;
  plan.stage_workers = r.stage_workers;
  plan.micro_batches = r.micro_batches;
  plan.clip_grad_norm = r.clip_grad_norm;
  plan.actions = DecodeOrder(r.order, -1, MakeRunnerRequest::kFunction);
  for (const c10::IValue& v : r.stages) {
    auto rref = rpc::RRef::FromIValue(v);
    if (!rref.ok()) throw std::invalid_argument(std::string(rref.status().message()));
    auto stage = LocalStage::Resolve(*rref);
    if (!stage.ok()) {
      throw std::invalid_argument(absl::StrCat("worker '", me, "': ", stage.status().message()));
    }
    plan.stages.emplace(stage->index(), std::move(*stage));
  }
  const int64_t last = static_cast<int64_t>(plan.stage_workers.size()) - 1;
  if (plan.stages.count(last) > 0) {
    plan.loss = LossFn::Named(r.loss);
    if (!plan.loss) {
      throw std::invalid_argument(absl::StrCat(
          "the loss '", r.loss, "' is not registered in worker '", me,
          "' (register it with pipeline::RegisterLoss in the worker program)"));
    }
  }
  if (!r.tied_first.empty()) {
    auto copy = [&](int64_t k, const std::string& name) -> at::Tensor {
      auto it = plan.stages.find(k);
      if (it == plan.stages.end()) return at::Tensor();
      absl::StatusOr<at::Tensor> p = it->second.Parameter(name);
      if (!p.ok()) {
        throw std::invalid_argument(absl::StrCat("tying a weight on worker '", me, "': ", p.status().message()));
      }
      return *p;
    };
    plan.tied.first = copy(0, r.tied_first);
    plan.tied.last = copy(last, r.tied_last);
    plan.tied.first_worker = plan.stage_workers.front();
    plan.tied.last_worker = plan.stage_workers.back();
    plan.tied.last_stage = last;
  }
  if (!r.optimizer.isNone()) {
    auto rref = rpc::RRef::FromIValue(r.optimizer);
    if (!rref.ok()) throw std::invalid_argument(std::string(rref.status().message()));
    plan.optimizer = *rref;
  }
  auto runner = std::make_shared<Runner>(agent, std::move(plan));
  Runners& runners = TheRunners();
  base::MutexLock lock(runners.mu);
  if (!runners.by_id.emplace(r.runner, std::move(runner)).second) {
    throw std::invalid_argument(absl::StrCat("worker '", me, "' already has a step runner for pipeline ",
                                             r.runner));
  }
  return c10::IValue();
}

// Registers `Request`'s function, which `handle` runs on the request's runner; `prompt`
// when `handle` only queues work on the compute lane (rpc::Registry::MarkPrompt).
template <typename Request, typename Handle>
absl::Status RegisterRunnerCall(rpc::Registry& registry, Handle handle, bool prompt = false) {
  RETURN_IF_ERROR(registry.RegisterFunction(
      Request::kFunction, [handle](rpc::CallContext& ctx, const rpc::Args& a) -> c10::IValue {
        auto r = rpc::DecodeCallOrThrow<Request>(a);
        handle(*FindRunner(ctx, r.runner), r);
        return c10::IValue();
      }));
  return prompt ? registry.MarkPrompt(Request::kFunction) : absl::OkStatus();
}

}  // namespace

absl::Status AttachToRunner(int64_t runner_id, std::shared_ptr<StepParticipant> participant) {
  std::shared_ptr<Runner> runner;
  {
    Runners& runners = TheRunners();
    base::MutexLock lock(runners.mu);
    auto it = runners.by_id.find(runner_id);
    if (it == runners.by_id.end()) {
      return absl::NotFoundError(absl::StrCat("no step runner for pipeline ", runner_id, " here"));
    }
    runner = it->second;
  }
  return runner->Attach(std::move(participant));
}

absl::Status RegisterRunnerFunctions(rpc::Registry& registry) {
  RETURN_IF_ERROR(registry.RegisterFunction(MakeRunnerRequest::kFunction, MakeRunner));
  RETURN_IF_ERROR(RegisterBatchEndFunctions(registry));
  RETURN_IF_ERROR(registry.RegisterAsyncFunction(
      RunRequest::kFunction, [](rpc::CallContext& ctx, const rpc::Args& a) -> rpc::Future<c10::IValue> {
        const auto r = rpc::DecodeCallOrThrow<RunRequest>(a);
        return FindRunner(ctx, r.runner)->Run(r.context, r.after, r.inputs, r.targets, r.total_rows, r.rows);
      }));
  RETURN_IF_ERROR(RegisterRunnerCall<TargetsRequest>(
      registry, [](Runner& runner, TargetsRequest& r) { runner.Targets(r.context, r.labels, r.total_rows); }, true));
  RETURN_IF_ERROR(RegisterRunnerCall<PushRequest>(registry, [](Runner& runner, PushRequest& r) {
    runner.Push(r.context, r.stage, r.micro_batch, std::move(r.value));
  }, true));
  RETURN_IF_ERROR(registry.RegisterAsyncFunction(
      EvalRequest::kFunction, [](rpc::CallContext& ctx, const rpc::Args& a) -> rpc::Future<c10::IValue> {
        const auto r = rpc::DecodeCallOrThrow<EvalRequest>(a);
        return FindRunner(ctx, r.runner)->evals().Eval(r.eval, r.inputs, r.micro_batches, r.labels, r.rows);
      }));
  RETURN_IF_ERROR(RegisterRunnerCall<EvalTargetsRequest>(
      registry, [](Runner& runner, EvalTargetsRequest& r) { runner.evals().Labels(r.eval, r.labels); }, true));
  RETURN_IF_ERROR(RegisterRunnerCall<EvalPushRequest>(registry, [](Runner& runner, EvalPushRequest& r) {
    runner.evals().Push(r.context, r.stage, r.micro_batch, std::move(r.value));
  }, true));
  RETURN_IF_ERROR(RegisterRunnerCall<AbandonRequest>(
      registry, [](Runner& runner, AbandonRequest& r) { runner.Abandon(r.context); }));
  RETURN_IF_ERROR(registry.RegisterFunction(
      SeedRequest::kFunction, [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
        at::manual_seed(static_cast<uint64_t>(rpc::DecodeCallOrThrow<SeedRequest>(a).seed));
        return c10::IValue();
      }));
  return registry.RegisterFunction(
      DropRunnerRequest::kFunction, [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
        const int64_t id = rpc::DecodeCallOrThrow<DropRunnerRequest>(a).runner;
        Runners& runners = TheRunners();
        std::shared_ptr<Runner> dropped;  // freed outside the lock
        base::MutexLock lock(runners.mu);
        auto it = runners.by_id.find(id);
        if (it != runners.by_id.end()) {
          dropped = std::move(it->second);
          runners.by_id.erase(it);
        }
        return c10::IValue();
      });
}

}  // namespace remora::pipeline
