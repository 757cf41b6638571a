#include "autograd/split_backward.h"

#include <algorithm>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <ATen/TensorOperators.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include "base/status_util.h"

namespace remora::autograd {

namespace {

using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;
// An owning pointer to a node: std::shared_ptr up to LibTorch 2.x,
// c10::intrusive_ptr in later ones.
using NodeRef = decltype(Edge().function);

// Keeps the gradients arriving at a node while B runs it.
class KeepGradients : public torch::autograd::FunctionPreHook {
 public:
  explicit KeepGradients(variable_list* kept) : kept_(kept) {}
  variable_list operator()(const variable_list& grads) override {
    *kept_ = grads;
    return grads;
  }

 private:
  variable_list* kept_;
};

// The edge a gradient of leaf `t` arrives by; none for a tensor that needs
// no gradient.
Edge LeafEdge(const at::Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return Edge();
  return torch::autograd::impl::gradient_edge(t);
}

// The graph below some outputs' edges, as Plan walks it.
struct Graph {
  std::unordered_map<Node*, std::vector<Node*>> parents;  // each node's in it
  std::unordered_set<Node*> nodes;
  std::unordered_set<Node*> root_nodes;  // the outputs' nodes
};

// Walks the graph below `roots`, noting an owning pointer to each of its
// nodes in `refs`.
Graph WalkGraph(const torch::autograd::edge_list& roots, std::unordered_map<Node*, NodeRef>* refs) {
  Graph g;
  std::vector<Node*> stack;
  for (const Edge& e : roots) {
    if (e.function) stack.push_back(e.function.get()), g.root_nodes.insert(e.function.get());
  }
  for (const Edge& e : roots) {
    if (e.function) refs->emplace(e.function.get(), e.function);
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (!g.nodes.insert(n).second) continue;
    for (const Edge& e : n->next_edges()) {
      if (!e.function) continue;
      g.parents[e.function.get()].push_back(n);
      refs->emplace(e.function.get(), e.function);
      stack.push_back(e.function.get());
    }
  }
  return g;
}

// False, saying why in `why`, when an output's node rules a split out.
bool RootsAllowSplit(const Graph& g, std::string* why) {
  for (Node* r : g.root_nodes) {
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(r) != nullptr) {
      *why = "it returns a parameter or its input as they are";
      return false;
    }
    if (g.parents.count(r)) {
      *why = "it returns an output made from another of its outputs";
      return false;
    }
  }
  return true;
}

// Collects the nodes the inputs' gradients arrive at in `targets`; false,
// saying why in `why`, when the inputs rule a split out.
bool FindInputTargets(const std::vector<at::Tensor>& inputs, const std::unordered_set<Node*>& root_nodes,
                      std::unordered_set<Node*>* targets, std::string* why) {
  for (const at::Tensor& x : inputs) {
    if (!x.defined() || !x.requires_grad()) continue;
    if (x.grad_fn()) {  // (inputs are leaves)
      *why = "an input is not a leaf of its graph";
      return false;
    }
    if (Edge e = LeafEdge(x); e.function) targets->insert(e.function.get());
  }
  for (Node* r : root_nodes) {
    if (targets->count(r)) {
      *why = "it returns its input";
      return false;
    }
  }
  return true;
}

// The nodes from which one of `targets` is reached.
std::unordered_set<Node*> NodesAbove(const std::unordered_set<Node*>& targets,
                                     const std::unordered_map<Node*, std::vector<Node*>>& parents) {
  std::unordered_set<Node*> above;
  std::vector<Node*> stack;
  for (Node* t : targets) {
    if (parents.count(t)) stack.insert(stack.end(), parents.at(t).begin(), parents.at(t).end());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (!above.insert(n).second) continue;
    if (parents.count(n)) stack.insert(stack.end(), parents.at(n).begin(), parents.at(n).end());
  }
  return above;
}

// A parameter's starts, sorted: walking up from its node `leaf` over nodes
// B does not run, the first nodes B does run, or an output's node.
std::vector<Node*> StartsAbove(Node* leaf, const std::unordered_set<Node*>& to_inputs, Graph* g) {
  std::vector<Node*> starts;
  std::unordered_set<Node*> seen;
  std::vector<Node*> up = g->parents[leaf];
  while (!up.empty()) {
    Node* n = up.back();
    up.pop_back();
    if (!seen.insert(n).second) continue;
    if (to_inputs.count(n) || g->root_nodes.count(n)) {
      starts.push_back(n);
    } else if (g->parents.count(n)) {
      up.insert(up.end(), g->parents[n].begin(), g->parents[n].end());
    }
  }
  std::sort(starts.begin(), starts.end());
  return starts;
}

// Whether another of a group's `group_starts` is reached from one of them.
bool StartReachesAnother(const std::vector<Node*>& group_starts) {
  const std::unordered_set<Node*> starts(group_starts.begin(), group_starts.end());
  for (Node* s : group_starts) {
    std::unordered_set<Node*> seen;
    std::vector<Node*> down;
    for (const Edge& e : s->next_edges()) {
      if (e.function) down.push_back(e.function.get());
    }
    while (!down.empty()) {
      Node* n = down.back();
      down.pop_back();
      if (!seen.insert(n).second) continue;
      if (starts.count(n)) return true;
      for (const Edge& e : n->next_edges()) {
        if (e.function) down.push_back(e.function.get());
      }
    }
  }
  return false;
}

// Whether a node computes its parameters' gradients from what its input's
// gradient computes anyway, or all of its gradients whenever it runs: a
// normalization's (batch, layer, group norm: the weights' gradients are
// the reductions the input's gradient needs) or a TorchScript graph's
// fused node. Run again in W it would redo most of its work there, so B
// computes its parameters' gradients. Any other node (a convolution's, a
// matrix product's, an elementwise scale's, a recomputed stage's) leaves
// them to W.
bool WeightsComeWithTheInput(Node* n) {
  std::string name = n->name();
  std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::tolower(c); });
  return name.find("norm") != std::string::npos || name.find("differentiablegraph") != std::string::npos;
}

}  // namespace

struct SplitBackward::State {
  std::vector<at::Tensor> outputs, grads, inputs, params;
  bool split = false;
  std::string why_whole;  // why not split, once Plan ran
  bool inputs_done = false;
  bool weights_done = false;
  // The outputs' edges and gradients (those that need one).
  torch::autograd::edge_list roots;
  variable_list root_grads;
  // W: parameters whose gradients come from the same nodes are computed in
  // one pass from those nodes (`starts`), with the gradients B kept there.
  // A group whose starts all run in B and have WeightsComeWithTheInput is
  // computed in B (`in_b`).
  struct Group {
    std::vector<size_t> params;
    std::vector<Node*> starts;
    bool in_b = false;
  };
  std::vector<Group> groups;
  std::unordered_map<Node*, variable_list> kept;
  std::unordered_map<Node*, NodeRef> refs;  // the starts'
  std::vector<at::Tensor> whole;  // the parameters' gradients when not split
  std::vector<std::pair<Node*, KeepGradients*>> hooks;

  // Finds the groups and whether the graph splits.
  void Plan();
  // Takes B's hooks off the nodes (before the graph can go).
  void Unhook();
};

void SplitBackward::State::Unhook() {
  for (auto& [node, hook] : hooks) {
    auto& list = node->pre_hooks();
    list.erase(std::remove_if(list.begin(), list.end(), [hook = hook](const auto& h) { return h.get() == hook; }),
               list.end());
  }
  hooks.clear();
}

void SplitBackward::State::Plan() {
  for (size_t i = 0; i < outputs.size(); ++i) {
    const at::Tensor& y = outputs[i];
    if (!y.defined() || !y.requires_grad() || i >= grads.size() || !grads[i].defined()) continue;
    roots.push_back(torch::autograd::impl::gradient_edge(y));
    root_grads.push_back(grads[i]);
  }
  // The graph below the outputs, and each node's parents in it.
  Graph graph = WalkGraph(roots, &refs);
  // (Only the starts' are kept, once known.)
  struct KeepStartRefs {
    State* s;
    ~KeepStartRefs() {
      std::unordered_map<Node*, NodeRef> starts;
      for (const Group& g : s->groups) {
        if (g.in_b) continue;
        for (Node* n : g.starts) starts.emplace(n, s->refs.at(n));
      }
      s->refs = s->split ? std::move(starts) : std::unordered_map<Node*, NodeRef>();
    }
  } keep_start_refs{this};
  // (A stage that hands on its input or a parameter, or an output made
  // from another output: not split.)
  if (!RootsAllowSplit(graph, &why_whole)) return;
  std::unordered_set<Node*> targets;
  if (!FindInputTargets(inputs, graph.root_nodes, &targets, &why_whole)) return;
  // The nodes B runs: those from which an input is reached.
  const std::unordered_set<Node*> to_inputs = NodesAbove(targets, graph.parents);
  // Each parameter's starts: walking up from it over nodes B does not run,
  // the first nodes B does run, or an output's node.
  std::map<std::vector<Node*>, size_t> group_of;
  for (size_t p = 0; p < params.size(); ++p) {
    const Edge e = LeafEdge(params[p]);
    if (!e.function || !graph.nodes.count(e.function.get())) continue;  // (no gradient reaches it)
    const std::vector<Node*> starts = StartsAbove(e.function.get(), to_inputs, &graph);
    auto [it, added] = group_of.emplace(starts, groups.size());
    if (added) {
      const bool in_b = std::all_of(starts.begin(), starts.end(),
                                    [&to_inputs](Node* n) { return to_inputs.count(n) && WeightsComeWithTheInput(n); });
      groups.push_back(Group{{}, starts, in_b});
    }
    groups[it->second].params.push_back(p);
  }
  // A start from which another start of its group is reached would hand W
  // the gradient arriving there twice (once kept, once computed again).
  for (const Group& g : groups) {
    if (!g.in_b && StartReachesAnother(g.starts)) {
      why_whole = "a parameter's gradient flows through two nodes that B runs, one after the other";
      return;
    }
  }
  // The outputs' own gradients where an output's node starts a group
  // that B does not run.
  for (size_t i = 0; i < roots.size(); ++i) {
    Node* r = roots[i].function.get();
    if (to_inputs.count(r)) continue;
    variable_list& k = kept[r];
    k.resize(r->num_inputs());
    const uint32_t slot = roots[i].input_nr;
    k[slot] = k[slot].defined() ? k[slot] + root_grads[i] : root_grads[i];
  }
  split = true;
}

SplitBackward::SplitBackward(std::vector<at::Tensor> outputs, std::vector<at::Tensor> grads,
                             std::vector<at::Tensor> inputs, std::vector<at::Tensor> params)
    : state_(std::make_unique<State>()) {
  state_->outputs = std::move(outputs);
  state_->grads = std::move(grads);
  state_->inputs = std::move(inputs);
  state_->params = std::move(params);
  state_->Plan();
}

SplitBackward::~SplitBackward() { state_->Unhook(); }

bool SplitBackward::split() const { return state_->split; }

std::string SplitBackward::why_not_split() const {
  return state_->split ? "" : state_->why_whole.empty() ? "no gradient reaches it" : state_->why_whole;
}

int64_t SplitBackward::held_bytes() const {
  int64_t bytes = 0;
  for (const auto& [node, grads] : state_->kept) {
    for (const at::Tensor& g : grads) {
      if (g.defined()) bytes += static_cast<int64_t>(g.nbytes());
    }
  }
  return bytes;
}

absl::StatusOr<std::vector<at::Tensor>> SplitBackward::Inputs() {
  State& s = *state_;
  if (s.inputs_done) return absl::FailedPreconditionError("SplitBackward::Inputs: B has run already");
  s.inputs_done = true;
  torch::autograd::edge_list wanted;
  std::vector<size_t> wanted_inputs;
  for (size_t i = 0; i < s.inputs.size(); ++i) {
    if (Edge e = LeafEdge(s.inputs[i]); e.function) {
      wanted.push_back(e);
      wanted_inputs.push_back(i);
    }
  }
  std::vector<size_t> wanted_params;
  if (!s.split) {
    for (size_t p = 0; p < s.params.size(); ++p) {
      if (Edge e = LeafEdge(s.params[p]); e.function) {
        wanted.push_back(e);
        wanted_params.push_back(p);
      }
    }
  } else {
    for (const State::Group& g : s.groups) {
      if (g.in_b) {
        for (size_t p : g.params) {
          wanted.push_back(LeafEdge(s.params[p]));
          wanted_params.push_back(p);
        }
        continue;
      }
      for (Node* n : g.starts) {
        if (s.kept.count(n)) continue;  // (an output's node: its gradient is given)
        auto hook = std::make_unique<KeepGradients>(&s.kept[n]);
        s.hooks.emplace_back(n, hook.get());
        n->add_pre_hook(std::move(hook));
      }
    }
  }
  std::vector<at::Tensor> out(s.inputs.size());
  s.whole.assign(s.params.size(), at::Tensor());
  if (s.roots.empty() || wanted.empty()) {
    s.Unhook();
    return out;
  }
  try {
    const variable_list got = torch::autograd::Engine::get_default_engine().execute(
        s.roots, s.root_grads, /*keep_graph=*/s.split, /*create_graph=*/false, /*accumulate_grad=*/false, wanted);
    for (size_t k = 0; k < wanted_inputs.size(); ++k) out[wanted_inputs[k]] = got[k];
    for (size_t k = 0; k < wanted_params.size(); ++k) s.whole[wanted_params[k]] = got[wanted_inputs.size() + k];
  } catch (...) {
    s.Unhook();
    return base::StatusFromCurrentException("the backward pass for the inputs' gradients (B)");
  }
  s.Unhook();
  return out;
}

absl::StatusOr<std::vector<at::Tensor>> SplitBackward::Weights() {
  State& s = *state_;
  if (!s.inputs_done) return absl::FailedPreconditionError("SplitBackward::Weights: B (Inputs) has not run");
  if (s.weights_done) return absl::FailedPreconditionError("SplitBackward::Weights: W has run already");
  s.weights_done = true;
  std::vector<at::Tensor> out = std::move(s.whole);
  out.resize(s.params.size());
  if (s.split) {
    try {
      for (const State::Group& g : s.groups) {
        if (g.in_b) continue;  // (B computed them)
        torch::autograd::edge_list roots;
        variable_list grads;
        for (Node* n : g.starts) {
          auto k = s.kept.find(n);
          if (k == s.kept.end()) continue;
          for (size_t slot = 0; slot < k->second.size(); ++slot) {
            if (!k->second[slot].defined()) continue;
            roots.emplace_back(s.refs.at(n), static_cast<uint32_t>(slot));
            grads.push_back(k->second[slot]);
          }
        }
        if (roots.empty()) continue;
        torch::autograd::edge_list wanted;
        for (size_t p : g.params) wanted.push_back(LeafEdge(s.params[p]));
        const variable_list got = torch::autograd::Engine::get_default_engine().execute(
            roots, grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false, wanted);
        for (size_t k = 0; k < g.params.size(); ++k) out[g.params[k]] = got[k];
      }
    } catch (...) {
      return base::StatusFromCurrentException("the backward pass for the parameters' gradients (W)");
    }
  }
  // The graph and what B kept go.
  s.kept.clear();
  s.refs.clear();
  s.roots.clear();
  s.root_grads.clear();
  s.outputs.clear();
  s.grads.clear();
  return out;
}

}  // namespace remora::autograd
