// pipeline::Pipeline: trains a model cut into stages as a pipeline over
// worker processes, through distributed autograd and the
// DistributedOptimizer (PyTorch's torch.distributed.pipelining, natively).
//
//   pipeline::PipelineOptions o;
//   o.stages = {pipeline::StageSpec::Registered("MLPStage", {16, 32, 1}),
//               pipeline::StageSpec::Registered("MLPStage", {32, 4, 2, false})};
//   o.workers = {"worker1", "worker2"};          // stage k on workers[k % 2]
//   o.schedule = "1f1b";
//   o.micro_batches = 4;
//   o.loss = pipeline::MseLoss();
//   o.optimizer = optim::OptimizerOptions::SGD(0.05);
//   auto pipe = pipeline::Pipeline::Create(*agent, o).value();
//   double loss = pipe->start_train_step(inputs, targets).wait().value();
//   c10::IValue outputs = pipe->eval_step(inputs).value();
//
// A training step cuts the batch into micro-batches (pipeline/microbatch.h),
// tells every worker its actions' order for the batch (pipeline/schedule.h),
// starts every micro-batch's forward pass (each worker runs them in its
// order), computes each micro-batch's loss on this process as its output
// arrives, runs the backward passes through distributed autograd (again in
// each worker's order) and steps the optimizer once. The loss function sees
// one micro-batch's output and targets and returns their mean loss; the
// pipeline weights the micro-batches by their rows, so the step equals one
// step on the whole batch with that loss. eval_step runs forward only (eval
// mode, no autograd context, no gradients kept) and returns the outputs.
//
// Thread-safety: one thread drives it (its steps and evaluations). Ownership: the pipeline holds the RRefs to its stages and the
// optimizer; they are freed on the workers when it is destroyed.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "optim/distributed_optimizer.h"
#include "pipeline/accuracy.h"
#include "pipeline/schedule.h"
#include "pipeline/step.h"
#include "pipeline/worker_data.h"
#include "rpc/agent.h"

namespace remora::parallel {
class DataParallelPipeline;
}  // namespace remora::parallel

namespace remora::pipeline {

// What one stage is: a stage type registered in the worker program, with
// its arguments, or a TorchScript module's bytes.
struct StageSpec {
  static StageSpec Registered(std::string type, std::vector<c10::IValue> args = {});
  // The file's bytes are read here and shipped to the worker.
  static absl::StatusOr<StageSpec> TorchScriptFile(const std::string& path);
  static StageSpec TorchScript(std::string bytes, std::string label);

  // What the worker builds the stage from: the script's bytes (a byte
  // tensor) or the type's arguments (a list).
  c10::IValue Payload() const;

  std::string kind;  // "type" or "script"
  std::string name;  // the type, or the script's label (its path)
  std::vector<c10::IValue> args;
  std::string script;
  std::string device;  // "" : the worker's home device (worker --device)
  // Activation recomputation: each training forward pass keeps only its
  // input and runs again in its backward pass (the same gradients; less
  // memory held between the passes, a forward's time more). A run's
  // setting (--recompute), not part of the model: checkpoints leave it out.
  bool recompute = false;
  // Mixed precision: the stage computes under bf16 autocast (Bf16Autocast,
  // pipeline/recompute.h: float32 parameters and optimizer state, matrix
  // products in bf16) and its floating outputs leave it as bf16, so
  // activations and their gradients cross stage boundaries in half the
  // bytes (a stage takes its bf16 input on as float32); a loss takes the
  // last stage's output as float32. A run's setting (--precision bf16),
  // not part of the model.
  bool bf16 = false;
};

// The module a spec describes, built in this process on `device` (what a
// worker builds for the stage, for code that needs no worker: an
// evaluator, local training). The stage types must be registered here.
class StageModule;
absl::StatusOr<std::unique_ptr<StageModule>> BuildStage(const StageSpec& spec, c10::Device device);

// TorchScript stages from `model`: a directory holding stage0.pt,
// stage1.pt, ... (in order), or a comma-separated list of files.
absl::StatusOr<std::vector<StageSpec>> TorchScriptStages(const std::string& model);

// Waits for `replies` (`workers[i]` owes `replies[i]`) until all have come
// or one has failed; a worker that stops answering is found by probing it
// ("remora.pipeline.alive" every 2 s, 5 s to answer). On a failure calls
// `abandon` (telling the others to drop the batch), then returns the index
// of the failure to report, its error in `status`: the first, unless a
// worker that could not be reached (UNAVAILABLE: dead, cut off) fails
// within 2 s more, which caused the others'. -1 when all succeeded.
int WaitForReplies(rpc::Agent& agent, const std::vector<std::string>& workers,
                   std::vector<rpc::Future<c10::IValue>>& replies, const std::function<void()>& abandon,
                   absl::Status* status);

// The workers of `workers` that do not answer a probe
// ("remora.pipeline.alive") within `timeout`, each probed once, in parallel:
// stopped, hung, cut off or gone, where a failed call alone does not tell
// a lost worker from one whose own computation threw. With `why`, each
// one's probe's failure is added to it, in the same order.
std::vector<std::string> UnansweringWorkers(rpc::Agent& agent, const std::vector<std::string>& workers,
                                            absl::Duration timeout, std::vector<absl::Status>* why = nullptr);

class PendingStep;  // (pipeline/pending_step.h, internal)


// The requests `agent` and `workers` have sent so far, by kind
// (Agent::sent_messages), summed; the calls that ask are left out.
absl::StatusOr<std::map<std::string, int64_t>> SentMessages(rpc::Agent& agent,
                                                            const std::vector<std::string>& workers);
// The requests sent between two such counts, by kind (kinds with none left
// out).
std::map<std::string, int64_t> MessagesBetween(const std::map<std::string, int64_t>& before,
                                               const std::map<std::string, int64_t>& after);

// The mean loss of one micro-batch's output against its targets. A named
// loss (MseLoss, CrossEntropyLoss, or one registered with RegisterLoss in
// every worker program) is computed on the last stage's worker, on its
// device, and only the batch's loss comes back; an unnamed one (any
// function) is computed on this process, and each micro-batch's output
// travels here for it (the slower protocol of PyTorch RPC's tutorials).
class LossFn {
 public:
  using Fn = std::function<at::Tensor(const c10::IValue& output, const c10::IValue& target)>;

  LossFn() = default;
  LossFn(std::nullptr_t) {}  // NOLINT: no loss
  // Any function of (output, target) is a loss.
  template <typename F, typename = std::enable_if_t<
                            std::is_constructible_v<Fn, F> &&
                            !std::is_same_v<std::decay_t<F>, LossFn> &&
                            !std::is_same_v<std::decay_t<F>, std::nullptr_t>>>
  LossFn(F&& fn) : fn_(std::forward<F>(fn)) {}  // NOLINT
  // A loss of this process's table (RegisterLoss); empty when unknown.
  static LossFn Named(const std::string& name);

  at::Tensor operator()(const c10::IValue& output, const c10::IValue& target) const {
    return fn_(output, target);
  }
  // The same, an exception turned into an error that names the loss and
  // the shapes it was given ("the loss 'cross_entropy' of an output of
  // [8, 5] against targets of [8]: Target 6 is out of bounds.").
  absl::StatusOr<at::Tensor> Compute(const c10::IValue& output, const c10::IValue& target) const;
  explicit operator bool() const { return static_cast<bool>(fn_); }
  // The name workers know it by; empty for an unnamed loss.
  const std::string& name() const { return name_; }

 private:
  Fn fn_;
  std::string name_;
};
LossFn MseLoss();           // "mse": output and target tensors of one shape
LossFn CrossEntropyLoss();  // "cross_entropy": logits [N, C], class indices [N]
// "causal_lm": a language model's logits [N, T, V] against the next tokens
// [N, T], cross-entropy averaged over every position.
LossFn CausalLmLoss();

// Adds a named loss to this process's table ("mse", "cross_entropy" and
// "causal_lm" are there from the start); AlreadyExists for a taken name. A worker program
// registers its own losses before it serves; the master's program too.
absl::Status RegisterLoss(const std::string& name, LossFn::Fn fn);

struct PipelineOptions {
  std::vector<StageSpec> stages;
  // Stage k runs on workers[k % workers.size()], but in zbv's V
  // (pipeline/schedule.h).
  std::vector<std::string> workers;
  // gpipe, 1f1b, interleaved, zb1p, zbv, or auto: interleaved with several
  // stages per worker (when the micro-batches divide into groups of the
  // worker count), else 1f1b.
  std::string schedule = "auto";
  int micro_batches = 4;
  LossFn loss;
  optim::OptimizerOptions optimizer = optim::OptimizerOptions::SGD(0.01);
  // When set, every worker's random generators (CPU and CUDA) are seeded
  // from it and the worker's place in `workers` before the stages are
  // placed (SeedWorkers), so that dropout draws the same numbers in two
  // runs with the same seed.
  std::optional<uint64_t> seed;
  // Above 0: each step's gradients are scaled so that their norm over the
  // whole model (every stage) is at most this, as
  // torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
  // before the optimizer steps: each worker adds up its squared norm and
  // sends it to the pipeline's other workers (one message to each a step).
  // Needs a named loss (the step runners); with replicas, after their sum.
  double clip_grad_norm = 0;
  // Tied parameters: the first stage's parameter named `tied_first` and the
  // last stage's named `tied_last` (their state_dict names, e.g. the
  // built-in GPT's token embedding "embed.tokens.weight" and head
  // "head.head.weight") are one weight held twice, built equal. Each step
  // their gradients are summed (the first's plus the last's, one message
  // each way between their two workers, at the batch's end) and both
  // copies get the sum, so the optimizer keeps them bitwise equal; the
  // norm of clip_grad_norm counts the weight once. Both empty: none. Needs
  // a named loss and two stages or more (one stage ties within its module).
  std::string tied_first, tied_last;
};

// Seeds the random generators (CPU and every CUDA device's) of each of
// `workers` from `seed` and its place in the list
// ("remora.pipeline.seed"). An error names the worker.
absl::Status SeedWorkers(rpc::Agent& agent, const std::vector<std::string>& workers, uint64_t seed);

class Pipeline {
 public:
  // Places the stages on the workers and creates the optimizer; with a
  // named loss, also each worker's step runner (pipeline/runner.h). An
  // error names the stage and the worker that failed. FailedPrecondition,
  // before anything is placed, when `agent` lacks autograd::Enable or
  // a worker is not in its group (not listed, or Join() not yet returned).
  static absl::StatusOr<std::unique_ptr<Pipeline>> Create(rpc::Agent& agent, PipelineOptions options);
  ~Pipeline();

  // Starts one training step on the batch; wait() on what it returns
  // gives the step's loss (the whole batch's). With a named loss (step
  // runners): one call per worker (the inputs to stage 0's, the targets to
  // the last stage's), the workers do the rest (runner.h), and the next
  // step may be started before this one is waited for (the workers queue
  // it behind this one). Otherwise the step runs here, within the call
  // (over_at_start()).
  StartedStep start_train_step(const c10::IValue& inputs, const c10::IValue& targets);
  // The same for a batch that stage 0's worker reads itself
  // (pipeline/worker_data.h); needs step runners.
  StartedStep start_train_step(const WorkerRows& rows);
  // Whether the workers run the step protocol (a named loss), and the id
  // their step runners have (the `runner` of a RunRequest, runner.h).
  bool runs_on_workers() const { return runner_id_ >= 0; }
  int64_t runner_id() const { return runner_id_; }

  // The model's outputs for `inputs`, forward only (with step runners: one
  // call per worker, outputs pushed worker to worker, the last stage's
  // worker replying with them).
  absl::StatusOr<c10::IValue> eval_step(const c10::IValue& inputs);
  // How many rows of `inputs` the model classifies as `labels` says, top-1
  // and top-5 (of its output, [rows, classes]: CountCorrect). With step
  // runners the labels go to the last stage's worker, which counts there
  // and replies with the counts alone; otherwise counted here from
  // eval_step's outputs.
  absl::StatusOr<Correct> eval_correct(const at::Tensor& inputs, const at::Tensor& labels);
  // The same for rows that stage 0's worker reads itself (WorkerRows; a
  // source opened there and the labels sent on to the last stage's
  // worker), of the rows read (Correct::rows). Needs step runners.
  absl::StatusOr<Correct> eval_correct(const WorkerRows& rows);

  // Stage k's parameters then buffers (copies on this process's CPU).
  absl::StatusOr<std::vector<at::Tensor>> stage_state(int k);

  // Per stage, the peak bytes of saved activations (what its training
  // forward passes allocated and were still alive, summed over
  // micro-batches, as each forward pass ended) since the pipeline was
  // created, or since the last call with `reset`; -1 where it is not
  // measured: a stage on a GPU (only remora's CPU allocator counts bytes),
  // or a worker without that allocator (REMORA_MALLOC=default).
  absl::StatusOr<std::vector<int64_t>> peak_activation_bytes(bool reset = false);

  // The requests this process and the pipeline's workers have sent so far,
  // by kind (Agent::sent_messages), summed; the calls that ask for them are
  // left out. The difference over N steps, divided by N, is the protocol's
  // messages per batch.
  absl::StatusOr<std::map<std::string, int64_t>> sent_messages() const;

  // The bytes of optimizer state on the workers (momentum, Adam's moments).
  absl::StatusOr<int64_t> optimizer_state_bytes() const { return optimizer_->state_bytes(); }

  const Schedule& schedule() const { return schedule_; }
  const std::vector<rpc::RRef>& stages() const { return stages_; }
  // PipelineOptions::tied_first and tied_last (empty: none).
  const std::string& tied_first() const { return options_.tied_first; }
  const std::string& tied_last() const { return options_.tied_last; }
  const optim::DistributedOptimizer& optimizer() const { return *optimizer_; }
  // Where worker `worker`'s optimizer state lives when its own optimizer
  // does not hold it (ZeRO-1: the worker's gradient group, parallel/): an
  // RRef with methods save_state and load_state, which checkpoints use
  // instead of the optimizer's. Set before training; none by default.
  void set_optimizer_state_holder(const std::string& worker, rpc::RRef holder) {
    state_holders_[worker] = std::move(holder);
  }
  std::optional<rpc::RRef> optimizer_state_holder(const std::string& worker) const {
    auto it = state_holders_.find(worker);
    return it == state_holders_.end() ? std::nullopt : std::optional<rpc::RRef>(it->second);
  }
  const std::vector<std::string>& workers() const { return workers_; }
  rpc::Agent& agent() const { return agent_; }
  int num_stages() const { return static_cast<int>(stages_.size()); }
  // Stage k's worker (workers()[k % workers().size()] but in zbv's V).
  const std::string& worker_of(int k) const { return workers_[schedule_.WorkerOf(k)]; }

 private:
  Pipeline(rpc::Agent& agent, PipelineOptions options, std::vector<std::string> workers,
           std::vector<rpc::RRef> stages, Schedule schedule,
           std::unique_ptr<optim::DistributedOptimizer> optimizer);

  // The step in parts, for data parallelism (parallel::DataParallelPipeline,
  // a friend, drives its replicas with them).
  friend class parallel::DataParallelPipeline;
  // The step on the workers' runners: starts the batch's `run` call on
  // every worker, in context `context_id`, each micro-batch's loss weighted
  // by its rows / `total_rows` (the whole batch's, of which `inputs` may be
  // one replica's share); the replies in worker order, the last stage's
  // worker's (last_worker()) carrying the weighted loss. Each worker starts
  // it once the step started before it here has ended there. After a
  // failure, AbandonStep tells every worker to drop the batch.
  absl::StatusOr<std::vector<rpc::Future<c10::IValue>>> StartStep(const c10::IValue& inputs,
                                                                  const c10::IValue& targets,
                                                                  int64_t context_id, int64_t total_rows);
  absl::StatusOr<std::vector<rpc::Future<c10::IValue>>> StartStep(const WorkerRows& rows, int64_t context_id,
                                                                  int64_t total_rows);
  void AbandonStep(int64_t context_id);
  // The master has the outcome of step `context_id` (its replies, or the
  // failure it reported): the next StartStep waits for no earlier step.
  void StepOver(int64_t context_id) {
    if (context_id == last_started_) last_over_ = true;
  }
  int last_worker() const { return schedule_.WorkerOf(num_stages() - 1); }
  // The step run from here (an unnamed loss: the master-centred protocol):
  // the batch's forward and backward passes in distributed autograd context
  // `context_id` (the gradients stay in the context on the workers), each
  // micro-batch's loss weighted by its rows / `total_rows`; returns the
  // weighted loss. Then step() steps the optimizer with the context's
  // gradients. TrainHere is both, in a context of its own.
  absl::StatusOr<double> forward_backward(const c10::IValue& inputs, const c10::IValue& targets,
                                          int64_t context_id, int64_t total_rows);
  absl::Status step(int64_t context_id);
  absl::StatusOr<double> TrainHere(const c10::IValue& inputs, const c10::IValue& targets);

  // Gives every worker its step runner.
  absl::Status MakeRunners();
  // The batch's run call to every worker: `inputs` to stage 0's, `targets`
  // to the last stage's; or `rows` to both (the last stage's worker then
  // waits for the labels from stage 0's).
  std::vector<rpc::Future<c10::IValue>> SendRun(const c10::IValue& inputs, const c10::IValue& targets,
                                           const c10::IValue& rows, int64_t context_id, int64_t total_rows);
  // The PendingStep of step `context` started with `replies`.
  PendingStep Pending(int64_t context, absl::StatusOr<std::vector<rpc::Future<c10::IValue>>> replies);
  // eval_step on the workers' step runners: the last stage's worker's
  // reply (its outputs, or with `labels` its count of right answers).
  absl::StatusOr<c10::IValue> EvalOnWorkers(const c10::IValue& inputs, const c10::IValue& labels,
                                            const WorkerRows* rows = nullptr);
  // forward_backward after the workers have the batch's order.
  absl::StatusOr<double> RunMicroBatches(const std::vector<c10::IValue>& xs,
                                         const std::vector<c10::IValue>& ts, double rows,
                                         int64_t context_id);
  // After a failed batch: tells every worker to serve what still waits for
  // the batch's order as it comes (actions after the failure never arrive,
  // and a forward pass queued behind one of them would wait for ever).
  void AbandonOrder(int64_t context_id);

  rpc::Agent& agent_;
  const PipelineOptions options_;
  const std::vector<std::string> workers_;
  std::vector<rpc::RRef> stages_;
  const Schedule schedule_;
  std::unique_ptr<optim::DistributedOptimizer> optimizer_;
  std::map<std::string, rpc::RRef> state_holders_;  // see set_optimizer_state_holder
  int64_t runner_id_ = -1;  // the workers' step runners, or -1: none
  int64_t last_started_ = -1;  // the context of the last step StartStep sent
  bool last_over_ = true;      // whether that step's outcome is known here
};

}  // namespace remora::pipeline
