#include "ps/parameter_server.h"

#include <algorithm>
#include <map>

#include <ATen/TensorOperators.h>
#include <ATen/core/Dict.h>
#include <ATen/ops/tensor_split.h>
#include <torch/types.h>  // (the torch:: functions clip_grad.h calls)
#include <torch/nn/utils/clip_grad.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "ps/replica.h"
#include "ps/protocol.h"

namespace remora::ps {
namespace {

// Whether worker `name` answers a liveness probe: a failed call alone does
// not tell a lost worker from one whose own computation threw.
bool Answers(rpc::Agent& agent, const std::string& name) {
  return pipeline::UnansweringWorkers(agent, {name}, absl::Seconds(5)).empty();
}

int64_t Bytes(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const at::Tensor& t : ts) n += static_cast<int64_t>(t.numel() * t.element_size());
  return n;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ParameterServer>> ParameterServer::Create(rpc::Agent& agent, PsOptions options) {
  const int n = static_cast<int>(options.workers.size());
  if (n == 0) return absl::InvalidArgumentError("parameter server: no workers");
  if (options.backup_workers < 0 || options.backup_workers >= n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter server: --backup-workers ", options.backup_workers, " with ", n,
        " workers: give 0 <= k < n (each step needs the gradients of n - k >= 1 workers)"));
  }
  for (const std::string& server : options.servers) {
    if (std::count(options.servers.begin(), options.servers.end(), server) > 1 ||
        std::find(options.workers.begin(), options.workers.end(), server) != options.workers.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter server: '", server, "' is named twice among the servers and workers: give each "
          "process one role (a server holds a partition, a worker computes)"));
    }
  }
  RETURN_IF_ERROR(LossByName(options.loss).status());
  if (options.stages.empty()) return absl::InvalidArgumentError("parameter server: the model has no stages");
  c10::Device device = c10::kCPU;
  try {
    device = c10::Device(options.device);
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat("parameter server: device '", options.device, "'"));
  }
  std::vector<std::unique_ptr<pipeline::StageModule>> model;
  std::vector<at::Tensor> params;
  for (size_t k = 0; k < options.stages.size(); ++k) {
    auto stage = pipeline::BuildStage(options.stages[k], device);
    if (!stage.ok()) return base::Annotate(stage.status(), absl::StrCat("parameter server: stage ", k));
    for (const at::Tensor& p : (*stage)->Parameters()) params.push_back(p);
    model.push_back(std::move(*stage));
  }
  if (params.empty()) return absl::InvalidArgumentError("parameter server: the model has no parameters");
  // The partitions, if any; a replica on every worker, then its shapes, checked.
  std::unique_ptr<PartitionSet> partitions;
  MakeReplicaRequest made;
  made.stages = EncodeStages(options.stages).toListRef().vec();
  made.loss = options.loss;
  made.bf16 = options.bf16;
  if (!options.servers.empty()) {
    ASSIGN_OR_RETURN(partitions, PartitionSet::Create(agent, options.servers, params, options.optimizer));
    for (size_t k = 0; k < partitions->partitions().size(); ++k) {
      made.partitions.push_back(partitions->partitions()[k].ToIValue());
      made.partition_params.emplace_back(c10::List<int64_t>(partitions->placement()[k].params));
    }
  }
  const std::vector<c10::IValue> replica_args = rpc::EncodeCall(made);
  if (options.seed) RETURN_IF_ERROR(pipeline::SeedWorkers(agent, options.workers, *options.seed));
  std::vector<Slot> slots(n);
  for (int i = 0; i < n; ++i) {
    slots[i].name = options.workers[i];
    auto replica = agent.remote(options.workers[i], MakeReplicaRequest::kFunction, replica_args);
    if (!replica.ok()) {
      return base::Annotate(replica.status(), absl::StrCat("parameter server: placing the replica on worker '",
                                                     options.workers[i], "'"));
    }
    slots[i].replica = std::move(*replica);
  }
  std::vector<rpc::Future<c10::IValue>> shapes;
  for (int i = 0; i < n; ++i) shapes.push_back(slots[i].replica.rpc_async("shapes"));
  ASSIGN_OR_RETURN(std::vector<c10::IValue> got, rpc::WaitAll(shapes, [&options](size_t i) {
                     return absl::StrCat("parameter server: building the replica on worker '", options.workers[i], "'");
                   }));
  for (int i = 0; i < n; ++i) {
    const auto list = got[i].toListRef();
    bool same = list.size() == params.size();
    for (size_t j = 0; same && j < list.size(); ++j) same = list[j].toIntVector() == params[j].sizes().vec();
    if (!same) {
      return absl::FailedPreconditionError(absl::StrCat(
          "parameter server: the replica on worker '", options.workers[i], "' has ", list.size(),
          " parameters of other shapes than the server's ", params.size(),
          " (does that worker program register another model under the same stage type?)"));
    }
  }
  return std::unique_ptr<ParameterServer>(
      new ParameterServer(agent, std::move(options), std::move(model), std::move(params), std::move(slots),
                          std::move(partitions)));
}

ParameterServer::ParameterServer(rpc::Agent& agent, PsOptions options,
                                 std::vector<std::unique_ptr<pipeline::StageModule>> model,
                                 std::vector<at::Tensor> params, std::vector<Slot> slots,
                                 std::unique_ptr<PartitionSet> partitions)
    : agent_(agent), options_(std::move(options)), model_(std::move(model)), params_(std::move(params)),
      partitions_(std::move(partitions)), slots_(std::move(slots)), signal_(std::make_shared<Signal>()) {
  if (partitions_ == nullptr) {
    optimizer_ = optim::MakeOptimizer(c10::IValue(optim::OptionsToDict(options_.optimizer)).toGenericDict(),
                                      params_);
  }
}

ParameterServer::~ParameterServer() {
  // With partitions, a straggler's call still in flight pulls from and pushes
  // to the partitions: let it finish (each call is bounded by the agent's RPC
  // timeout), so that a shutdown right after does not cut it off midway.
  // Without, a call to a worker that died would hold the agent's shutdown
  // (its request's RRef fork is never accepted) until the worker is lost.
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i].busy) continue;
    const absl::Status s = partitions_ != nullptr ? slots_[i].call.wait().status()
                                              : slots_[i].call.wait_for(absl::Seconds(10)).status();
    if (!s.ok() && partitions_ == nullptr) Failed(i, s, "parameter server, shutting down").IgnoreError();
  }
}

bool ParameterServer::Lost(const std::string& name, const absl::Status& why) {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].name != name) continue;
    if (slots_[i].lost) return true;
    if (options_.backup_workers == 0 || Answers(agent_, name)) return false;
    return Lose(i, why).ok();
  }
  return false;
}

absl::Status ParameterServer::CheckServers(size_t i, const absl::Status& status) const {
  if (partitions_ == nullptr) return absl::OkStatus();
  return base::Annotate(partitions_->Check(),
                  absl::StrCat("after worker '", slots_[i].name, "' failed (", status.message(), ")"));
}

absl::Status ParameterServer::Lose(size_t i, const absl::Status& status) {
  slots_[i].busy = false;
  RETURN_IF_ERROR(CheckServers(i, status));
  slots_[i].lost = true;
  slots_[i].lost_reason = std::string(status.message());
  // Gone for good: nothing here or on the other members waits on it (its
  // RRefs, the graceful shutdown), as after an elastic recovery's loss.
  // (Not the master's agent in some tests: nothing to tell then.)
  agent_.MarkLost(slots_[i].name).IgnoreError();
  return absl::OkStatus();
}

absl::Status ParameterServer::Failed(size_t i, const absl::Status& failure, const std::string& where) {
  Slot& slot = slots_[i];
  slot.busy = false;
  // (A call that timed out is lost whether or not the worker's RPC threads
  // still answer: its computation is stuck.)
  const bool unreached = failure.code() == absl::StatusCode::kDeadlineExceeded ||
                         failure.code() == absl::StatusCode::kUnavailable;
  if (unreached || !Answers(agent_, slot.name)) return base::Annotate(Lose(i, failure), where);
  // A server that is gone fails the calls of workers that are not.
  RETURN_IF_ERROR(base::Annotate(CheckServers(i, failure), where));
  const std::string who = absl::StrCat("worker '", slot.name, "'");
  return absl::Status(failure.code(),
                      absl::StrCat(where, ": ", who, " failed computing its share of ",
                                   slot.call_step >= step_first_round_ ? "the batch" : "an earlier step's batch", " (",
                                   slot.rows, " rows) and still answers, so it is not dropped as lost: ",
                                   base::WithoutLeadingWorker(failure.message(), who)));
}

namespace {

struct Waiting {
  const int64_t* completions;
  int64_t seen;
};

bool Changed(Waiting* w) { return *w->completions != w->seen; }

}  // namespace

int64_t ParameterServer::WaitForCompletion(int64_t seen) {
  Signal& s = *signal_;
  base::MutexLock lock(s.mu);
  Waiting w{&s.completions, seen};
  s.mu.Await(absl::Condition(&Changed, &w));
  return s.completions;
}

std::vector<size_t> ParameterServer::Send(const Batch& batch, int64_t round, StepReport* report) {
  std::vector<size_t> idle;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i].lost && !slots_[i].busy) idle.push_back(i);
  }
  // One snapshot of the parameters for every worker: the optimizer steps
  // them in place while a straggler's call may still be on its way. With
  // partitions, the workers pull the parameters from them.
  std::vector<at::Tensor> snapshot;
  if (partitions_ == nullptr) {
    c10::NoGradGuard no_grad;
    for (const at::Tensor& p : params_) snapshot.push_back(p.detach().to(c10::kCPU).clone());
  }
  const int64_t param_bytes = parameter_bytes();
  // Contiguous shares: of the tensors, or of the rows the workers read
  // (then the targets are read with them).
  const auto k = static_cast<int64_t>(idle.size());
  const pipeline::WorkerRows* rows = batch.rows;
  const std::vector<at::Tensor> xs = at::tensor_split(rows != nullptr ? rows->rows : batch.inputs, k);
  const std::vector<at::Tensor> ys = rows != nullptr ? std::vector<at::Tensor>() : at::tensor_split(batch.targets, k);
  const int64_t total = batch.size();
  for (size_t j = 0; j < idle.size(); ++j) {
    Slot& slot = slots_[idle[j]];
    slot.busy = true;
    slot.call_step = round;
    slot.rows = xs[j].size(0);
    const c10::IValue x =
        rows != nullptr ? pipeline::ToIValue({rows->source, xs[j], rows->epoch}) : c10::IValue(xs[j]);
    const c10::IValue y = rows != nullptr ? c10::IValue() : c10::IValue(ys[j]);
    slot.call = partitions_ != nullptr ? slot.replica.rpc_async(ComputePartitionedRequest::kMethod,
                                                            rpc::EncodeCall(ComputePartitionedRequest{round, x, y, total}))
                                   : slot.replica.rpc_async(ComputeRequest::kMethod,
                                                            rpc::EncodeCall(ComputeRequest{snapshot, x, y, total}));
    slot.call.then([signal = signal_](const absl::StatusOr<c10::IValue>&) {
      base::MutexLock lock(signal->mu);
      ++signal->completions;
    });
    report->pull_bytes += param_bytes;
  }
  return idle;
}

absl::Status ParameterServer::TooFew(int live, int needed, const std::string& where) const {
  std::vector<std::string> lost;
  for (const Slot& s : slots_) {
    if (s.lost) lost.push_back(absl::StrCat("'", s.name, "' (", s.lost_reason, ")"));
  }
  return absl::UnavailableError(absl::StrCat(
      where, ": only ", live, " of ", slots_.size(), " workers are left; ",
      options_.backup_workers == 0
          ? "every worker's gradient is needed without --backup-workers"
          : absl::StrCat("--backup-workers ", options_.backup_workers, " needs at least ", needed),
      ". Lost: ", absl::StrJoin(lost, ", "), ". Restart the lost workers and resume from the last checkpoint"));
}

absl::Status ParameterServer::AwaitIdle(int needed, const std::string& where, int64_t* seen, StepReport* report) {
  for (;;) {
    int live = 0, idle = 0;
    for (size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = slots_[i];
      if (s.busy && s.call.ready()) {
        s.busy = false;
        if (auto r = s.call.wait(); !r.ok()) {
          RETURN_IF_ERROR(Failed(i, r.status(), where));
          report->lost.push_back(s.name);
        }
      }
      live += !s.lost;
      idle += !s.lost && !s.busy;
    }
    if (live < needed) return TooFew(live, needed, where);
    if (idle >= needed) return absl::OkStatus();
    *seen = WaitForCompletion(*seen);
  }
}

absl::StatusOr<bool> ParameterServer::AwaitRound(const std::vector<size_t>& sent, int needed,
                                                 const std::string& where, int64_t* seen,
                                                 std::map<size_t, c10::IValue>* done, StepReport* report) {
  for (;;) {
    int pending = 0;
    for (size_t i : sent) {
      Slot& s = slots_[i];
      if (s.lost || done->count(i)) continue;
      if (!s.call.ready()) {
        ++pending;
        continue;
      }
      s.busy = false;
      auto r = s.call.wait();
      if (r.ok()) {
        done->emplace(i, *r);
        continue;
      }
      RETURN_IF_ERROR(Failed(i, r.status(), where));
      if (options_.backup_workers == 0) {
        return base::Annotate(r.status(), absl::StrCat(where, ": worker '", s.name,
                                                 "' failed (without --backup-workers every worker's "
                                                 "gradient is needed; restart it and resume from the "
                                                 "last checkpoint)"));
      }
      report->lost.push_back(s.name);
    }
    if (static_cast<int>(done->size()) >= needed) return true;
    if (static_cast<int>(done->size()) + pending < needed) return false;
    *seen = WaitForCompletion(*seen);
  }
}

absl::StatusOr<StepReport> ParameterServer::train_step(const at::Tensor& inputs, const at::Tensor& targets) {
  const int n = static_cast<int>(slots_.size());
  StepReport report;
  report.step = step_ + 1;
  report.batch_rows = inputs.size(0);
  if (inputs.size(0) < n || targets.size(0) != inputs.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter server, step ", report.step, ": a batch of ", inputs.size(0), " rows (targets: ",
        targets.size(0), ") for ", n, " workers: give at least one row per worker and as many targets as rows"));
  }
  return Step(Batch{inputs, targets, nullptr}, report);
}

absl::StatusOr<StepReport> ParameterServer::train_step(const pipeline::WorkerRows& rows) {
  const int n = static_cast<int>(slots_.size());
  StepReport report;
  report.step = step_ + 1;
  if (!rows.rows.defined() || rows.rows.dim() != 1 || rows.rows.numel() < n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter server, step ", report.step, ": a batch of ", rows.rows.defined() ? rows.rows.numel() : 0,
        " rows for ", n, " workers: give at least one row per worker (int64 [rows])"));
  }
  report.batch_rows = rows.rows.numel();
  return Step(Batch{at::Tensor(), at::Tensor(), &rows}, report);
}

absl::StatusOr<StepReport> ParameterServer::Step(const Batch& batch, StepReport report) {
  const int n = static_cast<int>(slots_.size());
  const int needed = n - options_.backup_workers;
  const std::string where = absl::StrCat("parameter server, step ", report.step);
  int64_t seen = 0;
  {
    base::MutexLock lock(signal_->mu);
    seen = signal_->completions;
  }
  std::map<size_t, c10::IValue> done;  // slot -> (grads, loss), this round's
  step_first_round_ = round_ + 1;
  for (report.rounds = 1; report.rounds <= n + 1; ++report.rounds) {
    // Settle earlier calls; wait until `needed` live workers are idle.
    RETURN_IF_ERROR(AwaitIdle(needed, where, &seen, &report));
    done.clear();
    const std::vector<size_t> sent = Send(batch, ++round_, &report);
    ASSIGN_OR_RETURN(const bool enough, AwaitRound(sent, needed, where, &seen, &done, &report));
    if (enough) break;
    // Too many of this round's workers were lost: the step starts again
    // over the workers left (the round's gradients are dropped).
  }
  if (static_cast<int>(done.size()) < needed) return TooFew(static_cast<int>(live_workers().size()), needed, where);
  RETURN_IF_ERROR(base::Annotate(Apply(done, report), where));
  step_ = report.step;
  return report;
}

absl::Status ParameterServer::Apply(const std::map<size_t, c10::IValue>& done, StepReport& report) {
  // Use the first `needed` to arrive (done may hold more when several
  // completed together: keep them all, they are this step's), in worker
  // order for a sum that does not depend on arrival order.
  std::vector<at::Tensor> sum(params_.size());
  double loss = 0;
  for (const auto& [i, value] : done) {
    absl::StatusOr<ComputeReply> reply = rpc::DecodeTuple<ComputeReply>(value);
    if (!reply.ok()) return base::Annotate(reply.status(), absl::StrCat("worker '", slots_[i].name, "'"));
    loss += reply->loss;
    report.rows += slots_[i].rows;
    report.push_bytes += parameter_bytes();  // a gradient of every parameter
    report.used.push_back(slots_[i].name);
    if (partitions_ != nullptr) continue;  // the worker pushed them to the partitions
    const std::vector<at::Tensor>& grads = reply->grads;
    if (grads.size() != params_.size()) {
      return absl::DataLossError(absl::StrCat("worker '", slots_[i].name, "' sent ", grads.size(),
                                              " gradients for ", params_.size(), " parameters"));
    }
    for (size_t j = 0; j < grads.size(); ++j) sum[j] = sum[j].defined() ? sum[j] + grads[j] : grads[j];
  }
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i].lost && !done.count(i)) report.dropped.push_back(slots_[i].name);
  }
  // The sum weighted each share by rows / batch rows; the mean over the
  // rows used is that times batch rows / rows used.
  const bool whole = report.rows == report.batch_rows;
  const double scale = static_cast<double>(report.batch_rows) / static_cast<double>(report.rows);
  report.loss = whole ? loss : loss * scale;
  const double max_norm = options_.clip_grad_norm;
  if (partitions_ != nullptr) {
    double clip = 1;
    if (max_norm > 0) {
      ASSIGN_OR_RETURN(report.grad_norm, partitions_->GradNorm(round_, report.used, whole ? 1.0 : scale));
      // As clip_grad_norm_: the coefficient in float, at most 1.
      clip = std::min(1.0f, static_cast<float>(max_norm) / (static_cast<float>(report.grad_norm) + 1e-6f));
    }
    return partitions_->Apply(round_, report.used, whole ? 1.0 : scale, clip);
  }
  try {
    c10::NoGradGuard no_grad;
    for (size_t j = 0; j < params_.size(); ++j) {
      at::Tensor g = sum[j].to(params_[j].device());
      params_[j].mutable_grad() = whole ? g : g * scale;
    }
    if (max_norm > 0) report.grad_norm = torch::nn::utils::clip_grad_norm_(params_, max_norm);
    optimizer_->step();
    for (at::Tensor& p : params_) p.mutable_grad() = at::Tensor();
  } catch (...) {
    return base::StatusFromCurrentException("the optimizer step");
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> ParameterServer::eval(const at::Tensor& inputs) {
  if (partitions_ != nullptr) RETURN_IF_ERROR(base::Annotate(partitions_->Gather(params_), "parameter server: evaluating"));
  c10::NoGradGuard no_grad;
  try {
    c10::IValue out = inputs.to(params_[0].device());
    for (auto& stage : model_) stage->Train(false);
    for (auto& stage : model_) out = stage->Forward(out);
    return out.toTensor().cpu();
  } catch (...) {
    return base::StatusFromCurrentException("parameter server: evaluating the model");
  }
}

absl::StatusOr<std::vector<std::vector<at::Tensor>>> ParameterServer::stage_state() {
  if (partitions_ != nullptr) RETURN_IF_ERROR(base::Annotate(partitions_->Gather(params_), "parameter server: saving"));
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& stage : model_) out.push_back(pipeline::StateTensors(*stage));
  return out;
}

std::vector<std::vector<std::string>> ParameterServer::stage_names() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& stage : model_) out.push_back(pipeline::StateNames(*stage));
  return out;
}

absl::StatusOr<at::Tensor> ParameterServer::optimizer_state() const {
  if (partitions_ != nullptr) return partitions_->OptimizerState();
  return optim::SaveOptimizerState(*optimizer_);
}

absl::Status ParameterServer::Load(const std::vector<std::vector<at::Tensor>>& stages,
                                   const at::Tensor& optimizer, int64_t steps_done) {
  if (stages.size() != model_.size()) {
    return absl::FailedPreconditionError(absl::StrCat("parameter server: ", stages.size(),
                                                      " saved stages for a model of ", model_.size()));
  }
  try {
    for (size_t k = 0; k < stages.size(); ++k) {
      pipeline::LoadState(*model_[k], stages[k], absl::StrCat("parameter server, stage ", k));
    }
    if (partitions_ == nullptr && optimizer.defined()) {
      if (const int k = SavedPartitions(optimizer); k > 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "parameter server: the saved optimizer state comes from ", k, " parameter-server partitions: resume "
            "with --ps-partitions ", k, " (the optimizer's state is split as the parameters are)"));
      }
      optim::LoadOptimizerState(*optimizer_, optimizer);
    }
  } catch (...) {
    return base::StatusFromCurrentException("parameter server: loading the saved state");
  }
  if (partitions_ != nullptr)
    RETURN_IF_ERROR(base::Annotate(partitions_->Load(params_, optimizer), "parameter server: resuming"));
  step_ = steps_done;
  return absl::OkStatus();
}

std::vector<PartitionPlacement> ParameterServer::placement() const {
  return partitions_ != nullptr ? partitions_->placement() : std::vector<PartitionPlacement>{};
}

absl::StatusOr<std::vector<std::vector<at::Tensor>>> ParameterServer::partition_parameters() const {
  if (partitions_ == nullptr) return absl::FailedPreconditionError("parameter server: no partitions (no servers given)");
  return partitions_->Parameters();
}

std::vector<std::string> ParameterServer::live_workers() const {
  std::vector<std::string> out;
  for (const Slot& s : slots_) {
    if (!s.lost) out.push_back(s.name);
  }
  return out;
}

int64_t ParameterServer::parameter_bytes() const { return Bytes(params_); }

}  // namespace remora::ps
