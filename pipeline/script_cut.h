// Cutting a TorchScript module's own forward into layers (internal to
// pipeline/partition.cc; not installed).
//
// A model as PyTorch users script it (torchvision's ResNet, a GPT) is no
// chain of its children: its forward calls them in straight-line code with
// tensor operations between (`torch.flatten(x, 1)` before `fc`, the
// embeddings' sum before the blocks). ScriptCut reads that forward's graph,
// with calls of the module's own methods (`_forward_impl`) and of its
// nn.Sequential submodules inlined, as a list of top-level statements. A
// cut point is a place between two statements where every value made
// before it and used after it is a tensor: what one stage hands the next,
// one tensor or several (a residual stream beside a block's output, token
// ids beside their embeddings), given as a tuple and taken as arguments. The statements between two neighbouring cut points
// are one layer. A stage of layers [first, last) is a TorchScript module of
// its own that holds the submodules (and parameters) its statements use,
// under their names in the whole model ("layer2.1.conv1.weight"), and
// whose forward is those statements: the stages run one after another
// compute what the whole forward does.
//
//   auto cut = ScriptCut::Make(module, "resnet18.pt").value();
//   cut->num_layers();        // 15 for torchvision's resnet18
//   cut->layer_name(4);       // "layer1.0"
//   std::string stage = cut->Stage(0, 8).value();  // TorchScript bytes
//
// Thread-safety: immutable after Make; every method may be called from any
// thread. Ownership: holds a copy of the forward's graph and shares the
// module's parameters (a stage made from it shares them too until saved).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace torch::jit {
struct Module;
}  // namespace torch::jit

namespace remora::pipeline {

class ScriptCut {
 public:
  // Reads `module`'s forward; `label` names the model in errors. Fails for a
  // forward that takes other than one input, that uses the module itself as
  // a value, or that has no statement.
  static absl::StatusOr<std::unique_ptr<ScriptCut>> Make(const torch::jit::Module& module,
                                                         const std::string& label);
  ~ScriptCut();

  int num_layers() const;
  // What layer i runs, for messages and the partition's description: the
  // submodules it calls and the operations between ("layer1.0",
  // "avgpool, flatten, fc").
  const std::string& layer_name(int i) const;
  // Whether the forward is exactly its direct children called one after
  // another in their order, each on the previous one's output (an
  // nn.Sequential's forward; remora cuts such a model at its children).
  bool IsChainOfChildren() const;
  // A parameter the module holds under two paths (nanoGPT's
  // lm_head.weight = wte.weight), read in its first layers under the one
  // and in its last under the other: the two paths. Every cut lies between
  // their reads, so a pipeline's first stage holds the one and its last
  // the other, which it ties (PipelineOptions::tied_first/tied_last).
  std::optional<std::pair<std::string, std::string>> Tied() const;

  // The layer that begins with the call of submodule `name` (a dotted path,
  // "layer3" or "layer3.1"): what `--split-at layer3` cuts before. A name
  // that is called inside a layer, inside a loop or a branch, or inside a
  // submodule is refused with the nearest cut points before and after it.
  absl::StatusOr<int> LayerStartingAt(const std::string& name) const;

  // Layers [first, last) as a saved TorchScript module (the bytes
  // torch.jit.save writes); its forward takes what crosses into layer
  // `first`, one argument a tensor, and returns what layer last - 1 gives
  // on (several tensors as one tuple).
  absl::StatusOr<std::string> Stage(int first, int last) const;

 private:
  struct Graph;
  explicit ScriptCut(std::unique_ptr<Graph> graph);
  std::unique_ptr<Graph> graph_;
};

}  // namespace remora::pipeline
