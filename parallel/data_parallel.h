// Data parallelism and hybrid data x pipeline parallelism: R replicas of a
// pipeline over P workers each (P x R workers), their gradients summed per
// stage group over c10d (parallel/gradient_group.h), one optimizer step on
// every replica with the same gradients, so that the replicas stay equal.
//
//   parallel::DataParallelOptions o;
//   o.pipeline = ...;                      // pipeline::PipelineOptions, workers: all P x R
//   o.replicas = 2;                        // replica r: workers [r*P, (r+1)*P)
//   auto dp = parallel::DataParallelPipeline::Create(agent, o).value();
//   std::cout << dp->Placement();
//   double loss = dp->start_train_step(inputs, targets).wait().value();
//
// A step gives replica r its contiguous share of the batch's rows (so
// no row is seen twice and their union is the batch), runs the replicas'
// forward and backward passes side by side, sums the gradients of each
// stage over its replicas (each micro-batch's loss weighted by its share of
// the whole batch: the sum is the whole batch's gradient, also when the
// shares differ by a row) and steps every replica. With R = 1 it is the
// plain pipeline; with P = 1 plain data parallelism (DDP).
//
// The master hosts the groups' TCPStore on the host of its listen address.
// A replica that fails, dies or stalls fails the step within the
// collective timeout, with an error naming the worker; the pipeline is
// then unusable (its groups' collectives are out of step).
//
// Thread-safety: one step at a time. Ownership: holds the replicas'
// pipelines, the groups (freed on the workers with it) and the store.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "parallel/process_group.h"
#include "pipeline/pipeline.h"

namespace remora::parallel {

struct DataParallelOptions {
  pipeline::PipelineOptions pipeline;  // its workers: all P x R, replica by replica
  int replicas = 1;
  int64_t bucket_bytes = int64_t{25} << 20;
  bool overlap = true;  // start a stage's sum as its last backward pass ends
  absl::Duration timeout = absl::Seconds(10);  // per collective
  // ZeRO stage: 0 (every replica holds all optimizer state) or 1 (each
  // replica of a stage group holds the state of its share of the
  // parameters, steps that share and sends it to the others).
  int zero = 0;
};

class DataParallelPipeline {
 public:
  // Makes the replicas (pipeline::Pipeline::Create) and their gradient
  // groups. FailedPrecondition when `agent` lacks autograd::Enable.
  static absl::StatusOr<std::unique_ptr<DataParallelPipeline>> Create(rpc::Agent& agent,
                                                                     DataParallelOptions options);
  ~DataParallelPipeline();

  // Starts one step on the whole batch (Pipeline::start_train_step): with
  // step runners the next step may be started before this one is waited
  // for.
  pipeline::StartedStep start_train_step(const c10::IValue& inputs, const c10::IValue& targets);
  // The same for a batch that each replica's stage 0 worker reads itself,
  // its share of `rows` (pipeline/worker_data.h: the source opened on
  // every replica's stage 0 worker).
  pipeline::StartedStep start_train_step(const pipeline::WorkerRows& rows);
  // Forward only, through replica 0.
  absl::StatusOr<c10::IValue> eval_step(const c10::IValue& inputs);
  // How many rows replica 0 classifies right (Pipeline::eval_correct).
  absl::StatusOr<pipeline::Correct> eval_correct(const at::Tensor& inputs, const at::Tensor& labels);
  // The same for rows that replica 0's stage 0 worker reads.
  absl::StatusOr<pipeline::Correct> eval_correct(const pipeline::WorkerRows& rows) {
    return replicas_[0]->eval_correct(rows);
  }

  int replicas() const { return static_cast<int>(replicas_.size()); }
  pipeline::Pipeline& replica(int r) { return *replicas_[r]; }
  // Worker -> (pipeline stages, replica), one line each.
  std::string Placement() const;
  // ZeRO-1: every replica's share of the optimizer state, gathered into
  // replica 0's gradient groups, which the next checkpoint of replica 0
  // saves (checkpoint/checkpoint.h); nothing to do otherwise. Every
  // replica is restored from such a checkpoint as without ZeRO, each group
  // keeping its share. Call between steps.
  absl::Status ConsolidateOptimizerState();
  // Per replica, the bytes of optimizer state its workers hold.
  absl::StatusOr<std::vector<int64_t>> optimizer_state_bytes();
  // The c10d backend the groups sum over: "Gloo", "NCCL" (CUDA stages,
  // each replica on a GPU of its own), or "NCCL and Gloo"; empty with one
  // replica.
  const std::string& backend() const { return backend_; }
  // The buckets the last step summed (over all groups).
  absl::StatusOr<int64_t> last_buckets() const;
  // The requests the master and every replica's workers have sent so far,
  // by kind (pipeline::SentMessages).
  absl::StatusOr<std::map<std::string, int64_t>> sent_messages() const;

 private:
  // The batch cut into the replicas' shares (inputs, targets); an error
  // when a share has fewer rows than a replica's micro-batches.
  absl::StatusOr<std::pair<std::vector<c10::IValue>, std::vector<c10::IValue>>> Shares(
      const c10::IValue& inputs, const c10::IValue& targets) const;
  // A step run from here, replica by replica (an unnamed loss, computed on
  // this process): forward and backward passes, the gradients summed, every
  // replica stepped; its loss.
  absl::StatusOr<double> TrainHere(const c10::IValue& inputs, const c10::IValue& targets);
  // One step in one new context: start(replica, context, total_rows)
  // sends a replica's run calls; the step waits for them all.
  pipeline::StartedStep StartOnReplicas(
      int64_t total_rows,
      const std::function<absl::StatusOr<std::vector<rpc::Future<c10::IValue>>>(int, int64_t, int64_t)>& start);
  struct Member {
    std::string worker;
    int slot = 0, replica = 0;
    rpc::RRef group;
  };
  // Calls `method` on the groups of `members` (of `replica` only, unless
  // it is -1) with args_of(member), all at once, and waits for every
  // reply: the first error, naming `what` and the worker; the replies in
  // member order.
  static absl::Status CallGroups(
      const std::vector<Member>& members, int replica, const std::string& method,
      const std::function<std::vector<c10::IValue>(const Member&)>& args_of,
      const std::string& what, std::vector<c10::IValue>* values = nullptr);

  DataParallelPipeline(rpc::Agent& agent, DataParallelOptions options,
                       std::vector<std::unique_ptr<pipeline::Pipeline>> replicas,
                       std::unique_ptr<StoreServer> store, std::vector<Member> members,
                       std::string backend);

  rpc::Agent& agent_;
  const DataParallelOptions options_;
  std::vector<std::unique_ptr<pipeline::Pipeline>> replicas_;
  std::unique_ptr<StoreServer> store_;
  std::vector<Member> members_;  // replica by replica
  std::string store_keys_;  // the groups' keys in this process's table (rpc_store.h), cleared at the end
  const std::string backend_;
  int64_t last_buckets_ = 0;
};

}  // namespace remora::parallel
