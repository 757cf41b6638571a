#include "parallel/data_parallel.h"

#include <unistd.h>

#include <atomic>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "autograd/dist_autograd.h"
#include "base/status_util.h"
#include "optim/distributed_optimizer.h"
#include "parallel/protocol.h"
#include "parallel/rpc_store.h"
#include "pipeline/microbatch.h"
#include "pipeline/pending_step.h"

namespace remora::parallel {
DataParallelPipeline::DataParallelPipeline(rpc::Agent& agent, DataParallelOptions options,
                                           std::vector<std::unique_ptr<pipeline::Pipeline>> replicas,
                                           std::unique_ptr<StoreServer> store,
                                           std::vector<Member> members, std::string backend)
    : agent_(agent),
      options_(std::move(options)),
      replicas_(std::move(replicas)),
      store_(std::move(store)),
      members_(std::move(members)),
      backend_(std::move(backend)) {}

DataParallelPipeline::~DataParallelPipeline() {
  if (!store_keys_.empty()) ClearStoreKeys(store_keys_);
}

absl::Status DataParallelPipeline::CallGroups(
    const std::vector<Member>& members, int replica, const std::string& method,
    const std::function<std::vector<c10::IValue>(const Member&)>& args_of, const std::string& what,
    std::vector<c10::IValue>* values) {
  std::vector<const Member*> called;
  std::vector<rpc::Future<c10::IValue>> pending;
  for (const Member& m : members) {
    if (replica < 0 || m.replica == replica) {
      called.push_back(&m);
      pending.push_back(m.group.rpc_async(method, args_of(m)));
    }
  }
  ASSIGN_OR_RETURN(std::vector<c10::IValue> replies, rpc::WaitAll(pending, [&](size_t i) {
                     return absl::StrCat(what, " on worker '", called[i]->worker, "'");
                   }));
  if (values != nullptr) values->insert(values->end(), replies.begin(), replies.end());
  return absl::OkStatus();
}

namespace {

absl::Status CheckOptions(const DataParallelOptions& o) {
  const int R = o.replicas;
  const int n = static_cast<int>(o.pipeline.workers.size());
  if (R < 1) return absl::InvalidArgumentError(absl::StrCat("replicas must be >= 1, not ", R));
  if (n % R != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        n, " workers do not make ", R, " replicas of one pipeline: give P x ", R,
        " workers (replica r runs on workers r*P .. r*P + P - 1)"));
  }
  if (o.bucket_bytes < 1) return absl::InvalidArgumentError("the bucket size must be positive");
  if (o.zero != 0 && o.zero != 1) {
    return absl::InvalidArgumentError(absl::StrCat("ZeRO stage ", o.zero, ": 0 or 1 are offered"));
  }
  return absl::OkStatus();
}

// The o.replicas copies of o.pipeline, replica r over workers r*P ..
// r*P + P - 1, each with seeds of its own (their dropout masks differ).
absl::StatusOr<std::vector<std::unique_ptr<pipeline::Pipeline>>> MakeReplicas(rpc::Agent& agent,
                                                                           const DataParallelOptions& o) {
  const int R = o.replicas;
  const int P = static_cast<int>(o.pipeline.workers.size()) / R;
  std::vector<std::unique_ptr<pipeline::Pipeline>> replicas;
  for (int r = 0; r < R; ++r) {
    pipeline::PipelineOptions p = o.pipeline;
    p.workers.assign(o.pipeline.workers.begin() + r * P, o.pipeline.workers.begin() + (r + 1) * P);
    if (p.seed) *p.seed += static_cast<uint64_t>(r) * 1000003;
    auto pipe = pipeline::Pipeline::Create(agent, std::move(p));
    // (One pipeline is no replica to name.)
    if (!pipe.ok()) return R > 1 ? base::Annotate(pipe.status(), absl::StrCat("replica ", r)) : pipe.status();
    replicas.push_back(std::move(*pipe));
  }
  return replicas;
}

// What makes replica r's member of gradient group `p` (its worker in
// place p): the parameters of the stages that worker holds, and the
// group's settings; the groups meet at `store` (null: over the agents)
// under names that begin with `prefix`.
absl::StatusOr<MakeGradientGroupRequest> GroupRequest(pipeline::Pipeline& replica, int r, int p,
                                                      const DataParallelOptions& o, const StoreServer* store,
                                                      const std::string& prefix) {
  MakeGradientGroupRequest g;
  for (int k = 0; k < replica.num_stages(); ++k) {
    if (replica.schedule().WorkerOf(k) != p) continue;  // (k % P, or zbv's V)
    ASSIGN_OR_RETURN(std::vector<rpc::RRef> mine, optim::parameter_rrefs(replica.stages()[k]));
    c10::impl::GenericList list(c10::AnyType::get());
    for (const rpc::RRef& x : mine) list.push_back(x.ToIValue());
    g.stage_indices.push_back(k);
    g.stage_params.emplace_back(std::move(list));
  }
  if (store != nullptr) {
    g.store_host = store->host();
    g.store_port = store->port();
  }
  g.name = absl::StrCat(prefix, "-slot", p);
  g.rank = r;
  g.size = o.replicas;
  g.timeout_ms = absl::ToInt64Milliseconds(o.timeout);
  g.bucket_bytes = o.bucket_bytes;
  g.overlap = o.overlap;
  g.zero = o.zero == 1 && o.replicas > 1;
  g.optimizer_options = optim::OptionsToDict(o.pipeline.optimizer);
  return g;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataParallelPipeline>> DataParallelPipeline::Create(
    rpc::Agent& agent, DataParallelOptions o) {
  RETURN_IF_ERROR(CheckOptions(o));
  RETURN_IF_ERROR(autograd::CheckEnabled(agent, "making a data-parallel pipeline"));
  const int R = o.replicas;
  const int P = static_cast<int>(o.pipeline.workers.size()) / R;
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<pipeline::Pipeline>> replicas, MakeReplicas(agent, o));
  std::unique_ptr<StoreServer> store;
  std::vector<Member> members;
  std::string backend;
  std::string prefix;
  // The groups meet through this process's keys over the agents when it
  // hosts them (RegisterStoreFunctions: no port opened), else through a
  // TCPStore it starts.
  const bool over_agents = agent.registry().Contains("remora.store.set");
  if (R > 1) {
    if (!over_agents) {
      ASSIGN_OR_RETURN(store, StoreServer::Start(HostOf(agent.self().address)));
    }
    static std::atomic<int64_t> next_id{0};
    prefix = absl::StrCat("remora-dp-", agent.self().name, "-", getpid(), "-", next_id++);
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) {
        ASSIGN_OR_RETURN(MakeGradientGroupRequest g, GroupRequest(*replicas[r], r, p, o, store.get(), prefix));
        Member m;
        m.worker = o.pipeline.workers[r * P + p];
        m.slot = p;
        m.replica = r;
        ASSIGN_OR_RETURN(m.group, agent.remote(m.worker, MakeGradientGroupRequest::kFunction, rpc::EncodeCall(g)));
        members.push_back(m);
      }
    }
    // Every member joins its group at once; wait for all of them.
    std::vector<c10::IValue> backends;
    RETURN_IF_ERROR(CallGroups(members, -1, "backend",
                               [](const Member&) -> std::vector<c10::IValue> { return {}; },
                               "making the gradient group", &backends));
    std::set<std::string> names;
    for (const c10::IValue& b : backends) names.insert(b.toStringRef());
    backend = absl::StrJoin(names.rbegin(), names.rend(), " and ");
    // With the step protocol, each worker's step runner sums the gradients
    // at the end of its batch (the group takes part in it) and the master
    // is no part of the step.
    // ZeRO-1: a worker's optimizer state lives in its gradient group, and
    // checkpoints save and load it there.
    if (o.zero == 1) {
      for (const Member& m : members) replicas[m.replica]->set_optimizer_state_holder(m.worker, m.group);
    }
    bool on_workers = true;
    for (const auto& r : replicas) on_workers = on_workers && r->runs_on_workers();
    if (on_workers) {
      RETURN_IF_ERROR(CallGroups(
          members, -1, GroupAttachRequest::kMethod,
          [&replicas](const Member& m) -> std::vector<c10::IValue> {
            return rpc::EncodeCall(GroupAttachRequest{replicas[m.replica]->runner_id()});
          },
          "joining the gradient group to the step runner"));
    }
  }
  auto pipe = std::unique_ptr<DataParallelPipeline>(new DataParallelPipeline(
      agent, std::move(o), std::move(replicas), std::move(store), std::move(members),
      std::move(backend)));
  if (over_agents) pipe->store_keys_ = prefix;
  return pipe;
}

pipeline::StartedStep DataParallelPipeline::start_train_step(const c10::IValue& inputs,
                                                             const c10::IValue& targets) {
  const int R = replicas();
  if (R == 1) return replicas_[0]->start_train_step(inputs, targets);
  if (!replicas_[0]->runs_on_workers()) return pipeline::StartedStep::Done(TrainHere(inputs, targets));
  absl::StatusOr<std::pair<std::vector<c10::IValue>, std::vector<c10::IValue>>> shares =
      Shares(inputs, targets);
  if (!shares.ok()) return pipeline::StartedStep::Done(shares.status());
  const std::vector<c10::IValue>& xs = shares->first;
  const std::vector<c10::IValue>& ts = shares->second;
  return StartOnReplicas(pipeline::BatchRows(inputs), [&](int r, int64_t context, int64_t total) {
    return replicas_[r]->StartStep(xs[r], ts[r], context, total);
  });
}

pipeline::StartedStep DataParallelPipeline::start_train_step(const pipeline::WorkerRows& rows) {
  const int R = replicas();
  if (R == 1) return replicas_[0]->start_train_step(rows);
  if (!rows.rows.defined()) return pipeline::StartedStep::Done(absl::InvalidArgumentError("no rows"));
  const int64_t n = rows.rows.numel();
  const int m = replicas_[0]->schedule().micro_batches;
  if (n < static_cast<int64_t>(m) * R) {
    return pipeline::StartedStep::Done(absl::InvalidArgumentError(absl::StrCat(
        "a batch of ", n, " rows gives a replica fewer than its ", m, " micro-batches: give at least ", m * R,
        " rows")));
  }
  absl::StatusOr<std::vector<c10::IValue>> shares = pipeline::SplitMicroBatches(rows.rows, R);
  if (!shares.ok()) return pipeline::StartedStep::Done(shares.status());
  return StartOnReplicas(n, [&](int r, int64_t context, int64_t total) {
    return replicas_[r]->StartStep(pipeline::WorkerRows{rows.source, (*shares)[r].toTensor(), rows.epoch},
                                   context, total);
  });
}

pipeline::StartedStep DataParallelPipeline::StartOnReplicas(
    int64_t total_rows,
    const std::function<absl::StatusOr<std::vector<rpc::Future<c10::IValue>>>(int, int64_t, int64_t)>& start) {
  const int R = replicas();
  // One call per worker of every replica, in one context (the replicas'
  // workers are distinct); each worker's runner sums its gradients with
  // the other replicas' and steps.
  const absl::StatusOr<int64_t> made = autograd::NewContextId(agent_);
  if (!made.ok()) return pipeline::StartedStep::Done(made.status());
  const int64_t context = *made;
  std::vector<rpc::Future<c10::IValue>> replies;
  std::vector<std::string> owers;
  std::vector<std::pair<int, int>> who;  // (replica, worker index in it)
  std::vector<int> losses;               // the replies that carry a replica's loss
  for (int r = 0; r < R; ++r) {
    auto part = start(r, context, total_rows);
    if (!part.ok()) {
      for (auto& replica : replicas_) replica->AbandonStep(context);
      return pipeline::StartedStep::Done(part.status());
    }
    for (size_t w = 0; w < part->size(); ++w) {
      if (static_cast<int>(w) == replicas_[r]->last_worker()) losses.push_back(static_cast<int>(replies.size()));
      replies.push_back(std::move((*part)[w]));
      owers.push_back(replicas_[r]->workers()[w]);
      who.emplace_back(r, static_cast<int>(w));
    }
  }
  return pipeline::Started(pipeline::PendingStep(
      agent_, std::move(owers), std::move(replies), std::move(losses),
      [this, context] {
        for (auto& replica : replicas_) replica->AbandonStep(context);
      },
      [this, who](int i) {
        const auto [r, w] = who[i];
        return absl::StrCat("replica ", r, ", the training step on worker '", replicas_[r]->workers()[w], "'");
      },
      [this, context] {
        for (auto& replica : replicas_) replica->StepOver(context);
      }));
}

absl::StatusOr<std::pair<std::vector<c10::IValue>, std::vector<c10::IValue>>> DataParallelPipeline::Shares(
    const c10::IValue& inputs, const c10::IValue& targets) const {
  const int R = replicas();
  const int64_t rows = pipeline::BatchRows(inputs);
  ASSIGN_OR_RETURN(std::vector<c10::IValue> xs, pipeline::SplitMicroBatches(inputs, R));
  ASSIGN_OR_RETURN(std::vector<c10::IValue> ts, pipeline::SplitMicroBatches(targets, R));
  const int m = replicas_[0]->schedule().micro_batches;
  for (int r = 0; r < R; ++r) {
    if (pipeline::BatchRows(xs[r]) < m) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a batch of ", rows, " rows gives replica ", r, " ", pipeline::BatchRows(xs[r]),
          " rows, fewer than its ", m, " micro-batches: give at least ", m * R, " rows"));
    }
  }
  return std::make_pair(std::move(xs), std::move(ts));
}

absl::StatusOr<double> DataParallelPipeline::TrainHere(const c10::IValue& inputs, const c10::IValue& targets) {
  const int R = replicas();
  ASSIGN_OR_RETURN(auto shares, Shares(inputs, targets));
  const std::vector<c10::IValue>& xs = shares.first;
  const std::vector<c10::IValue>& ts = shares.second;
  const int64_t rows = pipeline::BatchRows(inputs);
  const int m = replicas_[0]->schedule().micro_batches;
  std::vector<int64_t> ids(R, -1);
  std::vector<absl::StatusOr<double>> losses(R, absl::UnknownError("not run"));
  std::vector<absl::Status> steps(R);
  std::vector<absl::Notification> passed(R);
  absl::Notification go;
  std::atomic<bool> proceed{false};
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    // (Nothing may escape this thread: an error becomes the replica's loss
    // or step status, and the step waits for every thread's Notify.)
    threads.emplace_back([&, r] {
      autograd::Context context(agent_);  // current on this thread
      ids[r] = context.id();
      const int64_t id = context.id();
      try {
        absl::Status s = context.status();
        if (s.ok()) {
          s = CallGroups(
              members_, r, GroupBeginRequest::kMethod,
              [id, m](const Member&) -> std::vector<c10::IValue> { return rpc::EncodeCall(GroupBeginRequest{id, m}); },
              "starting the batch");
        }
        losses[r] = s.ok() ? replicas_[r]->forward_backward(xs[r], ts[r], context.id(), rows) : s;
      } catch (...) {
        losses[r] = base::StatusFromCurrentException("the batch's forward and backward passes");
      }
      passed[r].Notify();
      go.WaitForNotification();
      if (!context.status().ok()) return;
      try {
        if (proceed) {
          // Under ZeRO-1 the groups stepped the shares in "finish".
          if (options_.zero == 0) steps[r] = replicas_[r]->step(context.id());
        } else {
          for (const Member& mb : members_) {
            if (mb.replica == r) {
              mb.group.rpc_async(GroupDiscardRequest::kMethod, rpc::EncodeCall(GroupDiscardRequest{{context.id()}}));
            }
          }
        }
      } catch (...) {
        steps[r] = base::StatusFromCurrentException("the optimizer step");
      }
    });
  }
  absl::Status status;
  for (int r = 0; r < R; ++r) {
    passed[r].WaitForNotification();
    if (!losses[r].ok() && status.ok()) status = base::Annotate(losses[r].status(), absl::StrCat("replica ", r));
  }
  if (status.ok()) {
    std::vector<c10::IValue> buckets;
    status = CallGroups(
        members_, -1, GroupFinishRequest::kMethod,
        [&ids](const Member& mb) -> std::vector<c10::IValue> {
          return rpc::EncodeCall(GroupFinishRequest{ids[mb.replica]});
        },
        "summing the replicas' gradients", &buckets);
    last_buckets_ = 0;
    for (const auto& b : buckets) last_buckets_ += b.toInt();
  }
  proceed = status.ok();
  go.Notify();
  for (auto& t : threads) t.join();
  RETURN_IF_ERROR(status);
  double loss = 0;
  for (int r = 0; r < R; ++r) {
    RETURN_IF_ERROR(base::Annotate(steps[r], absl::StrCat("the optimizer step of replica ", r)));
    loss += *losses[r];
  }
  return loss;
}

absl::StatusOr<int64_t> DataParallelPipeline::last_buckets() const {
  if (replicas() == 1 || !replicas_[0]->runs_on_workers()) return last_buckets_;
  std::vector<c10::IValue> counts;
  RETURN_IF_ERROR(CallGroups(members_, -1, "last_buckets",
                             [](const Member&) { return std::vector<c10::IValue>{}; },
                             "reading the buckets of the last step", &counts));
  int64_t total = 0;
  for (const c10::IValue& c : counts) total += c.toInt();
  return total;
}

absl::StatusOr<std::map<std::string, int64_t>> DataParallelPipeline::sent_messages() const {
  return pipeline::SentMessages(agent_, options_.pipeline.workers);
}

absl::StatusOr<c10::IValue> DataParallelPipeline::eval_step(const c10::IValue& inputs) {
  return replicas_[0]->eval_step(inputs);
}

absl::StatusOr<pipeline::Correct> DataParallelPipeline::eval_correct(const at::Tensor& inputs,
                                                           const at::Tensor& labels) {
  return replicas_[0]->eval_correct(inputs, labels);
}

absl::StatusOr<std::vector<int64_t>> DataParallelPipeline::optimizer_state_bytes() {
  std::vector<int64_t> out(replicas(), 0);
  if (options_.zero == 0 || replicas() == 1) {
    for (int r = 0; r < replicas(); ++r) {
      ASSIGN_OR_RETURN(out[r], replicas_[r]->optimizer_state_bytes());
    }
    return out;
  }
  std::vector<c10::IValue> values;
  RETURN_IF_ERROR(CallGroups(members_, -1, "state_bytes",
                             [](const Member&) { return std::vector<c10::IValue>{}; },
                             "reading the optimizer state's size", &values));
  for (size_t i = 0; i < members_.size(); ++i) out[members_[i].replica] += values[i].toInt();
  return out;
}

absl::Status DataParallelPipeline::ConsolidateOptimizerState() {
  if (options_.zero == 0 || replicas() == 1) return absl::OkStatus();
  return CallGroups(members_, -1, "consolidate", [](const Member&) { return std::vector<c10::IValue>{}; },
                    "gathering ZeRO-1's optimizer state for a checkpoint");
}

std::string DataParallelPipeline::Placement() const {
  const int R = replicas();
  const int P = static_cast<int>(options_.pipeline.workers.size()) / R;
  std::string out = absl::StrFormat("  %-12s %-8s %s\n", "worker", "replica", "stages");
  for (int r = 0; r < R; ++r) {
    const int S = replicas_[r]->num_stages();
    for (int p = 0; p < P; ++p) {
      std::vector<int> stages;
      for (int k = 0; k < S; ++k) {
        if (replicas_[r]->schedule().WorkerOf(k) == p) stages.push_back(k);
      }
      absl::StrAppendFormat(&out, "  %-12s %-8d %s\n", options_.pipeline.workers[r * P + p], r,
                            absl::StrJoin(stages, ", "));
    }
  }
  return out;
}

}  // namespace remora::parallel
