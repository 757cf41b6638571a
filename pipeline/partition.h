// Cutting a sequential model into pipeline stages.
//
// A SequentialModel is a list of layers, each taking the previous one's
// output: a TorchScript nn.Sequential (its children are the layers), any
// other scripted module (its forward's top-level statements, grouped
// between the places where only tensors cross: pipeline/script_cut.h), or
// a stage type registered in the worker programs whose first two arguments
// are a layer range [first, last) (e.g. "ResNetShard"(first, last, seed)).
// Partition cuts it into stages, either at explicit split points or
// balanced by cost: every worker times the forward and backward pass of
// every layer on a sample micro-batch at once (in the pipeline the stages
// share the machine, and layers suffer from that unequally), and the
// layers are split to minimise the pipeline's estimated batch time. With
// several stages per worker the placement is interleaved (stage k on
// worker k mod n, Megatron-LM's virtual stages), or for zbv a V.
//
//   auto model = pipeline::SequentialModel::TorchScriptFile("model.pt").value();
//   pipeline::PartitionOptions p;
//   p.sample = at::randn({16, 3, 32, 32});   // one micro-batch
//   p.micro_batches = 8;
//   auto cut = pipeline::Partition(agent, model, {"worker1", "worker2"}, p).value();
//   std::cout << cut.Describe({"worker1", "worker2"});
//   options.stages = cut.stages;             // pipeline::PipelineOptions
//
// Thread-safety: SequentialModel is immutable after creation and may be
// shared; the free functions are thread-safe.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "pipeline/pipeline.h"
#include "pipeline/planner.h"
#include "rpc/agent.h"

namespace torch::jit {
struct Module;
}  // namespace torch::jit

namespace remora::pipeline {

class ScriptCut;

class SequentialModel {
 public:
  // A registered stage type that hosts layers [first, last) of
  // `num_layers` when built with arguments (first, last, args...).
  static SequentialModel Registered(std::string type, int num_layers,
                                    std::vector<c10::IValue> args = {});
  // A TorchScript module. When its forward is its children called one
  // after another (what torch.jit.script(nn.Sequential(...)).save(path)
  // writes), the children are the layers; otherwise its forward is cut at
  // its top-level statements (torchvision's ResNet: conv1, bn1, relu,
  // maxpool, each residual block, avgpool, flatten + fc). Check tests on a
  // sample that the layers run one after another give the forward's output.
  static absl::StatusOr<SequentialModel> TorchScript(const std::string& bytes, std::string label);
  static absl::StatusOr<SequentialModel> TorchScriptFile(const std::string& path);

  int num_layers() const { return num_layers_; }
  // What layer i is, for messages: a child's name, or what a forward's
  // statements call ("layer2.1", "avgpool, flatten, fc"); registered
  // models: "<type> layer i".
  std::string layer_name(int i) const;
  // The layer that begins with submodule `name` (`--split-at layer3`): a
  // child's name, or a submodule the forward calls at a cut point; an
  // error names the nearest cut points. Registered models: an error.
  absl::StatusOr<int> LayerNamed(const std::string& name) const;
  const std::string& label() const { return label_; }
  // For TorchScript: the type its forward returns, as TorchScript writes
  // it ("Tensor", "Tuple[Tensor, Tensor]"); empty for registered models.
  const std::string& output_type() const { return output_type_; }

  // A parameter the TorchScript module holds under two paths, read in its
  // first and in its last layers (ScriptCut::Tied: nanoGPT's tied
  // embeddings): the first's path and the last's, for
  // PipelineOptions::tied_first/tied_last when it is cut; else none.
  std::optional<std::pair<std::string, std::string>> Tied() const;

  // Layers [first, last) as one stage: the registered type with the range,
  // or a TorchScript module made of those children.
  absl::StatusOr<StageSpec> Stage(int first, int last) const;

  // For TorchScript: the module's forward on `sample` equals running its
  // children one after another (eval mode); an error says where they part.
  // Registered models: always OK.
  absl::Status Check(const c10::IValue& sample) const;

 private:
  SequentialModel() = default;

  std::string label_;
  int num_layers_ = 0;
  std::string type_;                  // registered
  std::vector<c10::IValue> args_;     // registered
  std::shared_ptr<const torch::jit::Module> script_;  // TorchScript
  std::vector<std::string> children_;                 // TorchScript
  std::string output_type_;                           // TorchScript
  std::shared_ptr<const ScriptCut> cut_;  // TorchScript not cut at its children
};

struct PartitionOptions {
  // Stages per worker: 1 is one stage per worker; more interleave (stage k
  // on worker k mod n).
  int stages_per_worker = 1;
  // Explicit cuts: the first layer of stages 1, 2, ... (strictly
  // increasing, inside the model); nothing is measured. Empty: balanced.
  std::vector<int> split_at;
  // One micro-batch of inputs for the measurement (the first layer's input).
  c10::IValue sample;
  int micro_batches = 1;  // what the balance minimises the batch time for
  // The schedule the stages will run under: zbv places them in a V
  // (pipeline/schedule.h) and cuts where the schedule is predicted to end
  // first with the measured times (PredictedSplit); others interleave.
  std::string schedule;
  int repeats = 4;        // timings per layer; the fastest counts
};

struct Partitioning {
  std::vector<int> bounds;        // stage k has layers [bounds[k], bounds[k + 1])
  std::vector<double> layer_ms;   // measured, averaged over the workers; empty with split_at
  std::vector<StageSpec> stages;
  std::vector<int> placement;     // stage k's worker (StagePlacement)
  // One line per worker: its stages' layer ranges and share of the cost.
  std::string Describe(const std::vector<std::string>& workers) const;
};

// Cuts `model` into workers.size() * stages_per_worker stages.
absl::StatusOr<Partitioning> Partition(rpc::Agent& agent, const SequentialModel& model,
                                       const std::vector<std::string>& workers,
                                       const PartitionOptions& options);

// Each layer's forward, input gradient (B) and weight gradients (W) of
// `model` on `sample`, in milliseconds, measured on each of `workers` at
// once (pipeline/layer_timing.h); one LayerTimes per worker.
absl::StatusOr<std::vector<LayerTimes>> MeasureLayers(rpc::Agent& agent, const SequentialModel& model,
                                                      const std::vector<std::string>& workers,
                                                      const c10::IValue& sample, int repeats = 4);
// The same averaged over the workers.
absl::StatusOr<LayerTimes> MeasureMeanLayers(rpc::Agent& agent, const SequentialModel& model,
                                             const std::vector<std::string>& workers, const c10::IValue& sample,
                                             int repeats = 4);

// What a micro-batch's crossing from one worker to another costs, in
// milliseconds: the median of `repeats` round trips to `worker` of a call
// that carries `sample` (the layer-cost call with no layers: the worker
// fetches the sample and answers at once).
absl::StatusOr<double> MeasureCrossing(rpc::Agent& agent, const std::string& worker, const c10::IValue& sample,
                                       int repeats = 7);

// --- the arithmetic (no sockets) ----------------------------------------------------

// Splits per-layer costs into `parts` contiguous ranges minimising the
// largest range's cost; returns the parts + 1 bounds (0 ... n).
absl::StatusOr<std::vector<int>> BalancedSplit(const std::vector<double>& costs, int parts);

// Interleaved stages: `workers * per_worker` contiguous chunks, chunk k on
// worker k % workers. With m micro-batches a batch takes about
//   m * (the busiest worker's cost) + (workers - 1) * (the largest chunk),
// the second term being the pipeline's fill and drain; returns the cuts
// minimising that (exhaustive over cuts of the busiest-worker bound, fine
// for tens of layers). per_worker 1 is BalancedSplit(costs, workers).
absl::StatusOr<std::vector<int>> InterleavedSplit(const std::vector<double>& costs, int workers,
                                                  int per_worker, int micro_batches);

// The bounds for explicit split points over `num_layers` layers into
// `parts` stages; an error says what is wrong with them.
absl::StatusOr<std::vector<int>> SplitAt(int num_layers, const std::vector<int>& split_at,
                                         int parts);

}  // namespace remora::pipeline
