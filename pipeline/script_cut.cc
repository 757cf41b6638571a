#include "pipeline/script_cut.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status_util.h"

namespace remora::pipeline {

using torch::jit::Node;
using torch::jit::Value;

namespace {

// The forward's graph, inlined, and what Make found in it.
struct ForwardGraph {
  std::string label;
  torch::jit::Module root;
  std::shared_ptr<torch::jit::Graph> graph;
  Value* self = nullptr;   // the graph's first input
  Value* input = nullptr;  // its second: what stage 0 takes
  // Top-level nodes that are neither constants nor attribute reads of the
  // module: the statements, in order.
  std::vector<Node*> statements;
  // Attribute reads of the module and of its submodules: their dotted
  // paths ("layer1", "layer1.0"); the module itself is "".
  std::unordered_map<const Value*, std::string> paths;
  // Per statement: the module attributes it reads (its calls' submodules,
  // parameters, attributes read inside its loops and branches), as paths.
  std::vector<std::vector<std::string>> reads;
  // Per statement: the submodule it calls, when it is a call ("" if not).
  std::vector<std::string> calls;
  // The statements where layers begin, and the end: layer i is statements
  // [starts[i], starts[i + 1]).
  std::vector<int> starts;
  // Per entry of starts: the values that cross into that statement, in
  // the order they were made (the forward's input at 0); at the end, the
  // value the forward returns. A stage whose input or output is several
  // takes or gives them as one tuple.
  std::vector<std::vector<Value*>> crossing;
  std::vector<std::string> names;
  bool chain_of_children = false;
  // A parameter held under two paths (nanoGPT's lm_head.weight =
  // wte.weight): the path read in the first layers and the one read in the
  // last (every cut lies between their reads); empty: none.
  std::string tied_first, tied_last;
};

bool IsSequential(const c10::ClassTypePtr& type) {
  if (!type || !type->name()) return false;
  const std::string name = type->name()->qualifiedName();
  return absl::StrContains(name, "torch.nn.modules.container.") && absl::EndsWith(name, ".Sequential");
}

// "aten::flatten" -> "flatten"; prim::If -> "if".
std::string OperationName(const Node* n) {
  std::string s = n->kind().toUnqualString();
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

// A class name for the container that holds the used part of submodule
// `path` in a stage ("layer2.1" -> "remora.cut.layer2_1").
std::string ContainerName(const std::string& path) {
  std::string s = "remora.cut.m_";
  for (char c : path) s += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return s;
}

// Every node in `block` and in the blocks nested in it.
void ForEachNode(torch::jit::Block* block, const std::function<void(Node*)>& f) {
  for (Node* n : block->nodes()) {
    f(n);
    for (torch::jit::Block* b : n->blocks()) ForEachNode(b, f);
  }
}

// Whether `graph` (a forward, its own methods inlined) is `module`'s
// direct children called one after another in their order, each on the
// previous one's output, the last one's returned.
bool ChainOfChildren(const torch::jit::Module& module, torch::jit::Graph& graph) {
  std::vector<std::string> children;
  for (const auto& child : module.named_children()) children.push_back(child.name);
  Value* self = graph.inputs()[0];
  Value* x = graph.inputs()[1];
  size_t i = 0;
  for (Node* n : graph.nodes()) {
    if (n->kind() == c10::prim::Constant) continue;
    if (n->kind() == c10::prim::GetAttr && n->input(0) == self) continue;
    Node* object = n->inputs().empty() ? nullptr : n->input(0)->node();
    if (i == children.size() || n->kind() != c10::prim::CallMethod || n->s(c10::attr::name) != "forward" ||
        object->kind() != c10::prim::GetAttr || object->input(0) != self ||
        object->s(c10::attr::name) != children[i] || n->inputs().size() != 2 || n->input(1) != x ||
        n->outputs().size() != 1) {
      return false;
    }
    x = n->output();
    ++i;
  }
  return i == children.size() && graph.outputs().size() == 1 && graph.outputs()[0] == x;
}

// Inlines the top-level calls of `self`'s own methods in `graph` and, when
// `sequentials`, of its nn.Sequential submodules, until none is left.
void InlineCalls(torch::jit::Graph& graph, Value* self, bool sequentials) {
  for (bool inlined = true; inlined;) {
    inlined = false;
    for (Node* n : graph.nodes()) {
      if (n->kind() != c10::prim::CallMethod) continue;
      Value* object = n->input(0);
      const auto type = object->type()->cast<c10::ClassType>();
      const bool own = object == self;
      const bool sequential =
          sequentials && IsSequential(type) && object->node()->kind() == c10::prim::GetAttr;
      if (!type || (!own && !sequential)) continue;
      // (Its graph as written: the optimised one has every call inlined.)
      torch::jit::GraphFunction& method = torch::jit::toGraphFunction(type->getMethod(n->s(c10::attr::name)));
      torch::jit::inlineCallTo(n, &method, method.graph().get());
      inlined = true;
      break;
    }
  }
}

// Copies `module`'s forward graph into `g` (with its self and input) and
// inlines its calls; sets g.chain_of_children.
absl::Status ReadForward(const torch::jit::Module& module,
                         const std::string& label, ForwardGraph& g) {
  try {
    auto forward = module.find_method("forward");
    if (!forward) return absl::InvalidArgumentError(absl::StrCat(label, " has no forward method to cut"));
    g.graph = torch::jit::toGraphFunction(forward->function()).graph()->copy();
    if (g.graph->inputs().size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the forward of ", label, " takes ", g.graph->inputs().size() - 1,
          " inputs; remora cuts a forward that takes one tensor"));
    }
    g.self = g.graph->inputs()[0];
    g.input = g.graph->inputs()[1];
    // Inline the module's own methods (`_forward_impl`); then, unless the
    // forward is a chain of its children (an nn.Sequential's), its
    // nn.Sequential submodules too, until the top level calls neither.
    InlineCalls(*g.graph, g.self, /*sequentials=*/false);
    g.chain_of_children = ChainOfChildren(module, *g.graph);
    if (!g.chain_of_children) InlineCalls(*g.graph, g.self, /*sequentials=*/true);
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat("reading the forward of ", label));
  }
  return absl::OkStatus();
}

// Fills g.statements and g.paths; returns where each value is made.
std::unordered_map<const Value*, int> FindStatements(ForwardGraph& g) {
  std::unordered_map<const Value*, int> made;  // statement index; the input: -1
  made[g.input] = -1;
  g.paths[g.self] = "";
  for (Node* n : g.graph->nodes()) {
    if (n->kind() == c10::prim::Constant) continue;
    if (n->kind() == c10::prim::GetAttr && g.paths.count(n->input(0))) {
      const std::string& parent = g.paths[n->input(0)];
      g.paths[n->output()] = parent.empty() ? n->s(c10::attr::name)
                                            : absl::StrCat(parent, ".", n->s(c10::attr::name));
      continue;
    }
    const int index = static_cast<int>(g.statements.size());
    g.statements.push_back(n);
    for (Value* v : n->outputs()) made[v] = index;
  }
  return made;
}

// Fills g.reads[i] and g.calls[i] for statement i, and notes in
// `last_use` the values made before it that it reads.
absl::Status ReadStatement(ForwardGraph& g, const std::string& label,
                           const std::unordered_map<const Value*, int>& made,
                           int i,
                           std::unordered_map<const Value*, int>& last_use) {
  Node* s = g.statements[i];
  std::set<std::string> reads;
  auto read = [&](Node* user, Value* v) -> absl::Status {
    if (v == g.self && !(user->kind() == c10::prim::GetAttr)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the forward of ", label, " uses the module itself as a value (in ", OperationName(user),
          "): remora cuts a forward that calls its submodules and operates on tensors"));
    }
    if (auto p = g.paths.find(v); p != g.paths.end()) {
      if (user->kind() == c10::prim::GetAttr) {
        // (Inside a loop or a branch: the attribute read there.)
        reads.insert(p->second.empty() ? user->s(c10::attr::name)
                                       : absl::StrCat(p->second, ".", user->s(c10::attr::name)));
      } else if (!p->second.empty()) {
        reads.insert(p->second);
      }
      return absl::OkStatus();
    }
    if (auto m = made.find(v); m != made.end() && m->second < i) last_use[v] = i;
    return absl::OkStatus();
  };
  for (Value* v : s->inputs()) RETURN_IF_ERROR(read(s, v));
  for (torch::jit::Block* b : s->blocks()) {
    absl::Status status;
    ForEachNode(b, [&](Node* inner) {
      for (Value* v : inner->inputs()) {
        if (status.ok() && v->node()->owningBlock() == g.graph->block()) status = read(inner, v);
      }
    });
    RETURN_IF_ERROR(status);
  }
  g.reads[i].assign(reads.begin(), reads.end());
  if (s->kind() == c10::prim::CallMethod && g.paths.count(s->input(0))) g.calls[i] = g.paths[s->input(0)];
  return absl::OkStatus();
}

// Whether attribute paths `p` and `q` are one, or one is inside the other.
bool Overlap(const std::string& p, const std::string& q) {
  return p == q || absl::StartsWith(q, absl::StrCat(p, ".")) || absl::StartsWith(p, absl::StrCat(q, "."));
}

// Boundaries that would part two reads of one parameter or submodule
// (or of one inside the other): each stage would hold a copy of its own.
std::vector<bool> SharedBoundaries(const ForwardGraph& g, int n) {
  std::vector<bool> shared(n + 1, false);
  for (int i = 0; i < n; ++i) {
    for (int j = i + 1; j < n; ++j) {
      for (const std::string& p : g.reads[i]) {
        for (const std::string& q : g.reads[j]) {
          if (p == "training" || q == "training" || !Overlap(p, q)) continue;
          for (int b = i + 1; b <= j; ++b) shared[b] = true;
        }
      }
    }
  }
  return shared;
}

// A parameter under two paths: cut only between the reads of the one
// and of the other, so that the first stage holds the one and the last
// the other (a pipeline ties the two copies: PipelineOptions::tied_first);
// any other aliasing keeps its readers in one stage.
void MarkAliases(ForwardGraph& g, int n, std::vector<bool>& shared) {
  std::map<const c10::TensorImpl*, std::vector<std::string>> aliases;
  for (const auto& p : g.root.named_parameters()) aliases[p.value.unsafeGetTensorImpl()].push_back(p.name);
  for (const auto& [impl, paths] : aliases) {
    if (paths.size() < 2) continue;
    std::vector<std::pair<int, int>> spans;  // per path: its first and last reader
    for (const std::string& path : paths) {
      int lo = n, hi = -1;
      for (int i = 0; i < n; ++i) {
        for (const std::string& r : g.reads[i]) {
          if (Overlap(r, path)) lo = std::min(lo, i), hi = std::max(hi, i);
        }
      }
      spans.emplace_back(lo, hi);
    }
    const bool tie = paths.size() == 2 && g.tied_first.empty() && spans[0].second >= 0 && spans[1].second >= 0 &&
                     (spans[0].second < spans[1].first || spans[1].second < spans[0].first);
    if (tie) {
      const int a = spans[0].second < spans[1].first ? 0 : 1;
      g.tied_first = paths[a];
      g.tied_last = paths[1 - a];
      for (int b = 1; b <= spans[a].second; ++b) shared[b] = true;
      for (int b = spans[1 - a].first + 1; b < n; ++b) shared[b] = true;
    } else {
      int lo = n, hi = -1;
      for (const auto& [first, last] : spans) lo = std::min(lo, first), hi = std::max(hi, last);
      for (int b = lo + 1; b <= hi; ++b) shared[b] = true;
    }
  }
}

// The cut points: where every value made before and used after is a
// tensor (one or several: a residual stream beside a block's output, the
// token ids beside their embeddings), and no parameter or submodule is
// used on both sides. Fills g.starts and g.crossing.
void FindCutPoints(ForwardGraph& g, int n,
                   const std::unordered_map<const Value*, int>& made,
                   const std::unordered_map<const Value*, int>& last_use,
                   const std::vector<bool>& shared, Value* returned) {
  g.starts.push_back(0);
  g.crossing.push_back({g.input});
  for (int b = 1; b < n; ++b) {
    if (shared[b]) continue;
    std::vector<Value*> live;
    for (const auto& [v, last] : last_use) {
      if (made.at(v) < b && last >= b) live.push_back(const_cast<Value*>(v));
    }
    const bool tensors = std::all_of(live.begin(), live.end(), [](const Value* v) {
      return v->type()->isSubtypeOf(*c10::TensorType::get());
    });
    if (live.empty() || !tensors) continue;
    // (In the order they were made: the same order on every read.)
    std::sort(live.begin(), live.end(), [&made](const Value* a, const Value* b) {
      return std::make_pair(made.at(a), a->offset()) < std::make_pair(made.at(b), b->offset());
    });
    g.starts.push_back(b);
    g.crossing.push_back(std::move(live));
  }
  g.starts.push_back(n);
  g.crossing.push_back({returned});
}

// Fills g.names: each layer's name, from its calls and operations.
void NameLayers(ForwardGraph& g) {
  for (size_t l = 0; l + 1 < g.starts.size(); ++l) {
    // Its calls and operations (not the lists and tuples built for them);
    // where those are many, its calls alone.
    std::vector<std::string> parts, calls;
    for (int i = g.starts[l]; i < g.starts[l + 1]; ++i) {
      const Node* s = g.statements[i];
      if (g.calls[i].empty() && s->kind().is_prim() && s->blocks().empty()) continue;
      std::string part = !g.calls[i].empty() ? g.calls[i] : OperationName(s);
      if (!g.calls[i].empty()) calls.push_back(part);
      if (parts.empty() || parts.back() != part) parts.push_back(std::move(part));
    }
    if (parts.size() > 3 && !calls.empty() && calls.size() <= 3) parts = calls;
    if (parts.size() > 4) parts = {parts.front(), parts[1], "...", parts.back()};
    if (parts.empty()) parts.push_back(OperationName(g.statements[g.starts[l]]));
    g.names.push_back(absl::StrJoin(parts, ", "));
  }
}

// Registers in `stage` the attributes that statements [begin, end) of `g`
// read, each under its path.
void HoldReads(const ForwardGraph& g, int begin, int end,
               const torch::jit::Module& stage) {
  // The attributes the statements read, each under its path: a read
  // path's parents become containers holding only what is read.
  std::set<std::string> read;
  for (int i = begin; i < end; ++i) read.insert(g.reads[i].begin(), g.reads[i].end());
  std::map<std::string, torch::jit::Module> containers = {{"", stage}};
  for (const std::string& path : read) {
    const std::vector<std::string> parts = absl::StrSplit(path, '.');
    // A parent read whole already holds it.
    bool held = false;
    for (size_t k = 1; k < parts.size() && !held; ++k) {
      held = read.count(absl::StrJoin(parts.begin(), parts.begin() + k, "."));
    }
    if (held) continue;
    std::string prefix;
    torch::jit::Module original = g.root;
    for (size_t k = 0; k + 1 < parts.size(); ++k) {
      const std::string parent = prefix;
      prefix = prefix.empty() ? parts[k] : absl::StrCat(prefix, ".", parts[k]);
      original = original.attr(parts[k]).toModule();
      if (!containers.count(prefix)) {
        torch::jit::Module container(ContainerName(prefix));
        container.register_attribute("training", c10::BoolType::get(), true);
        containers.at(parent).register_module(parts[k], container);
        containers.emplace(prefix, container);
      }
    }
    const std::string& field = parts.back();
    if (field == "training") continue;
    torch::jit::Module holder = containers.at(prefix);
    const c10::ClassTypePtr type = original.type();
    const size_t slot = type->getAttributeSlot(field);
    const c10::IValue value = original._ivalue()->getSlot(slot);
    if (value.isModule()) {
      holder.register_module(field, value.toModule());
    } else if (type->is_parameter(slot)) {
      holder.register_parameter(field, value.toTensor(), /*is_buffer=*/false);
    } else if (type->is_buffer(slot)) {
      holder.register_buffer(field, value.toTensor());
    } else {
      holder.register_attribute(field, type->getAttribute(slot), value);
    }
  }
}

// The forward graph of layers [first, last) of `g`, its self of `stage`'s
// type: their statements copied, taking and returning what crosses.
std::shared_ptr<torch::jit::Graph> StageGraph(const ForwardGraph& g,
                                              int first, int last,
                                              const torch::jit::Module& stage) {
  const int begin = g.starts[first], end = g.starts[last];
  auto graph = std::make_shared<torch::jit::Graph>();
  Value* self = graph->addInput("self");
  self->setType(stage.type());
  // What crosses in: one argument each (a stage given a tuple takes its
  // elements as its arguments).
  const std::vector<Value*>& in = g.crossing[first];
  std::unordered_map<Value*, Value*> env = {{g.self, self}};
  for (size_t k = 0; k < in.size(); ++k) {
    Value* input = graph->addInput(in.size() == 1 ? std::string("x") : absl::StrCat("x", k));
    input->setType(in[k]->type());
    env[in[k]] = input;
  }
  std::function<Value*(Value*)> map = [&](Value* v) -> Value* {
    if (auto it = env.find(v); it != env.end()) return it->second;
    Node* maker = v->node();
    Value* copy = nullptr;
    if (maker->kind() == c10::prim::Constant) {
      copy = graph->insertNode(graph->createClone(maker, map))->output();
    } else if (maker->kind() == c10::prim::GetAttr && g.paths.count(v)) {
      copy = graph->insertNode(graph->createGetAttr(map(maker->input(0)), maker->s(c10::attr::name)))->output();
    } else {
      throw std::logic_error(absl::StrCat("value ", v->debugName(), " made outside layers [", first, ", ", last,
                                          ") is used inside them"));
    }
    env[v] = copy;
    return copy;
  };
  for (int i = begin; i < end; ++i) {
    Node* s = g.statements[i];
    Node* copy = graph->insertNode(graph->createClone(s, map));
    for (size_t k = 0; k < s->outputs().size(); ++k) env[s->output(k)] = copy->output(k);
  }
  const std::vector<Value*>& returns = g.crossing[last];
  if (returns.size() == 1) {
    graph->registerOutput(map(returns[0]));
  } else {
    std::vector<Value*> values;
    for (Value* v : returns) values.push_back(map(v));
    graph->registerOutput(graph->insertNode(graph->createTuple(values))->output());
  }
  return graph;
}

}  // namespace

// What a ScriptCut keeps: the forward's graph and what Make found in it.
struct ScriptCut::Graph : ForwardGraph {};

ScriptCut::ScriptCut(std::unique_ptr<Graph> graph) : graph_(std::move(graph)) {}
ScriptCut::~ScriptCut() = default;

int ScriptCut::num_layers() const { return static_cast<int>(graph_->starts.size()) - 1; }

const std::string& ScriptCut::layer_name(int i) const { return graph_->names.at(i); }

absl::StatusOr<std::unique_ptr<ScriptCut>> ScriptCut::Make(const torch::jit::Module& module,
                                                           const std::string& label) {
  auto g = std::make_unique<Graph>();
  g->label = label;
  g->root = module;
  RETURN_IF_ERROR(ReadForward(module, label, *g));

  // Statements, attribute paths and where each value is made.
  const std::unordered_map<const Value*, int> made = FindStatements(*g);
  const int n = static_cast<int>(g->statements.size());
  if (n == 0) return absl::InvalidArgumentError(absl::StrCat("the forward of ", label, " has nothing to cut"));

  // What each statement reads: values made before it (the last use of
  // each), and the module's attributes.
  std::unordered_map<const Value*, int> last_use;
  g->reads.resize(n);
  g->calls.resize(n);
  for (int i = 0; i < n; ++i) RETURN_IF_ERROR(ReadStatement(*g, label, made, i, last_use));
  Value* returned = g->graph->outputs().size() == 1 ? g->graph->outputs()[0] : nullptr;
  if (returned == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("the forward of ", label, " returns ",
                                                   g->graph->outputs().size(), " values; one is cut"));
  }
  for (Value* v : g->graph->outputs()) last_use[v] = n;

  std::vector<bool> shared = SharedBoundaries(*g, n);
  MarkAliases(*g, n, shared);
  FindCutPoints(*g, n, made, last_use, shared, returned);
  NameLayers(*g);
  return std::unique_ptr<ScriptCut>(new ScriptCut(std::move(g)));
}

bool ScriptCut::IsChainOfChildren() const { return graph_->chain_of_children; }

std::optional<std::pair<std::string, std::string>> ScriptCut::Tied() const {
  if (graph_->tied_first.empty()) return std::nullopt;
  return std::make_pair(graph_->tied_first, graph_->tied_last);
}

absl::StatusOr<int> ScriptCut::LayerStartingAt(const std::string& name) const {
  const Graph& g = *graph_;
  const auto layer_of = [&](int statement) {
    return static_cast<int>(std::upper_bound(g.starts.begin(), g.starts.end(), statement) - g.starts.begin()) - 1;
  };
  const auto nearest = [&](int layer) {
    std::vector<std::string> where;
    if (layer >= 1) where.push_back(absl::StrCat("before ", g.names[layer], " (layer ", layer, ")"));
    if (layer + 1 < num_layers()) {
      where.push_back(absl::StrCat("before ", g.names[layer + 1], " (layer ", layer + 1, ")"));
    }
    return where.empty() ? std::string("it has one layer, so nowhere")
                         : absl::StrCat("the nearest cut points are ", absl::StrJoin(where, " and "));
  };
  for (int i = 0; i < static_cast<int>(g.statements.size()); ++i) {
    const std::string& call = g.calls[i];
    if (call == name || absl::StartsWith(call, absl::StrCat(name, "."))) {
      const int layer = layer_of(i);
      if (g.starts[layer] == i) return layer;
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot cut ", g.label, " before ", name, ": no cut point lies there, where a value that is no tensor crosses or a parameter is read on both sides (", name,
          " is called inside layer ", layer, ", ", g.names[layer], "); ", nearest(layer)));
    }
  }
  // Inside a loop or a branch, or inside a submodule called whole.
  for (int i = 0; i < static_cast<int>(g.statements.size()); ++i) {
    for (const std::string& read : g.reads[i]) {
      const bool inside_call = !g.calls[i].empty() && absl::StartsWith(name, absl::StrCat(g.calls[i], "."));
      if (read == name || inside_call) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cannot cut ", g.label, " before ", name, ": it is used inside ",
            inside_call ? absl::StrCat("submodule ", g.calls[i])
                        : absl::StrCat(absl::StrContains("aeiou", OperationName(g.statements[i]).substr(0, 1))
                                           ? "an "
                                           : "a ",
                                       OperationName(g.statements[i]), " statement"),
            " (layer ", layer_of(i), ", ", g.names[layer_of(i)], "), which is cut whole; ", nearest(layer_of(i))));
      }
    }
  }
  std::vector<std::string> points;
  for (int l = 1; l < num_layers(); ++l) {
    if (!g.calls[g.starts[l]].empty()) points.push_back(g.calls[g.starts[l]]);
  }
  return absl::NotFoundError(absl::StrCat(
      g.label, "'s forward calls no submodule named ", name, "; it can be cut before ",
      points.empty() ? "no named submodule (give layer numbers)" : absl::StrJoin(points, ", ")));
}

absl::StatusOr<std::string> ScriptCut::Stage(int first, int last) const {
  const Graph& g = *graph_;
  if (first < 0 || last > num_layers() || first >= last) {
    return absl::OutOfRangeError(absl::StrCat("layers [", first, ", ", last, ") of ", g.label, ", which has ",
                                              num_layers()));
  }
  const int begin = g.starts[first], end = g.starts[last];
  try {
    torch::jit::Module stage("remora.cut.Stage");
    stage.register_attribute("training", c10::BoolType::get(), true);
    HoldReads(g, begin, end, stage);

    std::shared_ptr<torch::jit::Graph> graph = StageGraph(g, first, last, stage);
    torch::jit::Function* forward = stage._ivalue()->compilation_unit()->create_function(
        c10::QualifiedName(*stage.type()->name(), "forward"), graph);
    stage.type()->addMethod(forward);
    std::ostringstream out;
    stage.save(out);
    return out.str();
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat("making a stage of layers [", first, ", ", last, ") of ",
                                                   g.label));
  }
}

}  // namespace remora::pipeline
