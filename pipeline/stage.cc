#include "pipeline/stage.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/serialization/import.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "pipeline/describe.h"
#include "pipeline/layer_timing.h"
#include "pipeline/pipeline.h"
#include "pipeline/protocol.h"
#include "pipeline/recompute.h"
#include "pipeline/runner.h"
#include "pipeline/worker_data.h"
#include "rpc/agent.h"
#include "rpc/rref_args.h"
#include "runtime/action_mark.h"
#include "runtime/allocator.h"
#include "runtime/compute_lane.h"
#include "trace/trace.h"

namespace remora::pipeline {
namespace {

// The process's stage types.
struct StageTypes {
  absl::Mutex mu;
  std::map<std::string, StageFactory> factories ABSL_GUARDED_BY(mu);
};

StageTypes& Types() {
  static StageTypes* types = new StageTypes;  // never destroyed
  return *types;
}

// Whether `m`'s forward writes an argument in place (torchvision's
// ReLU(inplace=True) first in a stage), or a view of one, here or in a
// module or function it calls (inlined to look).
bool WritesAnArgumentInPlace(const torch::jit::Module& m) {
  if (!m.find_method("forward")) return false;  // (refused when loaded)
  std::shared_ptr<torch::jit::Graph> graph = m.get_method("forward").graph()->copy();
  torch::jit::Inline(*graph);
  // The arguments (self left out), what unpacks them, and views of them.
  std::vector<const torch::jit::Value*> values(graph->inputs().begin() + 1, graph->inputs().end());
  for (size_t i = 0; i < values.size(); ++i) {
    for (const torch::jit::Use& use : values[i]->uses()) {
      const torch::jit::Node* node = use.user;
      if (node->kind() == c10::prim::TupleUnpack || node->kind() == c10::prim::ListUnpack) {
        values.insert(values.end(), node->outputs().begin(), node->outputs().end());
        continue;
      }
      const c10::FunctionSchema* schema = node->maybeSchema();
      if (schema == nullptr || use.offset >= schema->arguments().size()) continue;
      const c10::AliasInfo* alias = schema->arguments()[use.offset].alias_info();
      if (alias == nullptr) continue;
      if (alias->isWrite()) return true;
      values.insert(values.end(), node->outputs().begin(), node->outputs().end());  // a view
    }
  }
  return false;
}

// A TorchScript module as a stage.
// The named tensors of `list`, each tensor once (its first name).
template <typename List>
std::vector<torch::jit::Named<at::Tensor>> Unique(const List& list) {
  std::vector<torch::jit::Named<at::Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& t : list) {
    if (seen.insert(t.value.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

class ScriptStage final : public StageModule {
 public:
  // Every parameter trains, whatever requires_grad it was saved with
  // (modules scripted in C++ or loaded for inference come without it).
  ScriptStage(torch::jit::Module m, bool on_cpu)
      : m_(std::move(m)), writes_input_(WritesAnArgumentInPlace(m_)), as_written_(on_cpu) {
    for (const at::Tensor& p : m_.parameters()) p.requires_grad_(true);
  }
  // A received input is a leaf that autograd will not let be written in
  // place: a stage that writes its input gets a copy, whose gradient
  // flows back to the leaf. Inputs that its forward does not take (too
  // many or too few, or one of another type) are said with what the
  // forward declares, in place of the interpreter's words. On a CPU the
  // graph runs as written (every run: one plan): the executor's
  // optimisations fuse nothing there, and each differentiable subgraph
  // they form is one autograd node computing all its gradients, which
  // leaves W (zero-bubble schedules) none of its weights'.
  c10::IValue Forward(const c10::IValue& input) override {
    torch::jit::GraphOptimizerEnabledGuard as_written(!as_written_ && torch::jit::getGraphExecutorOptimize());
    try {
      if (!writes_input_ || !c10::GradMode::is_enabled()) return m_.forward(ScriptArgs(input));
      return m_.forward(ScriptArgs(MapTensors(input, [](const at::Tensor& t) {
        return t.is_leaf() && t.requires_grad() ? t.clone() : t;
      })));
    } catch (const std::exception&) {
      if (std::string why = SignatureMismatch(ScriptArgs(input)); !why.empty()) throw std::invalid_argument(why);
      throw;
    }
  }
  // (A tensor held under two paths, nanoGPT's lm_head.weight =
  // wte.weight, is one parameter, under its first path: LibTorch lists it
  // under each, and an optimizer would step it twice.)
  std::vector<at::Tensor> Parameters() override {
    std::vector<at::Tensor> out;
    for (const auto& p : Unique(m_.named_parameters())) out.push_back(p.value);
    return out;
  }
  std::vector<at::Tensor> Buffers() override {
    std::vector<at::Tensor> out;
    for (const auto& b : Unique(m_.named_buffers())) out.push_back(b.value);
    return out;
  }
  void Train(bool on) override { m_.train(on); }
  std::vector<std::string> Names() override {
    std::vector<std::string> names;
    for (const auto& p : Unique(m_.named_parameters())) names.push_back(p.name);
    for (const auto& b : Unique(m_.named_buffers())) names.push_back(b.name);
    return names;
  }

 private:
  // Empty when `args` fit forward's declared inputs (self left out).
  std::string SignatureMismatch(const std::vector<c10::IValue>& args) const {
    const std::vector<c10::Argument>& declared = m_.get_method("forward").function().getSchema().arguments();
    std::vector<std::string> wanted;
    size_t required = 0;
    for (size_t i = 1; i < declared.size(); ++i) {
      wanted.push_back(absl::StrCat(declared[i].name(), ": ", declared[i].type()->annotation_str()));
      if (!declared[i].default_value()) required = i;
    }
    const std::string signature = absl::StrCat("its forward(", absl::StrJoin(wanted, ", "), ")");
    constexpr absl::string_view kWhatToDo =
        " (a stage is given what the stage before it returns, a tuple as its elements: cut both from one "
        "model, or make the two agree)";
    if (args.size() > wanted.size() || args.size() < required) {
      return absl::StrCat(signature, " takes ", wanted.size(), wanted.size() == 1 ? " input" : " inputs", ", not ",
                          args.size(), kWhatToDo);
    }
    for (size_t i = 0; i < args.size(); ++i) {
      if (!args[i].type()->isSubtypeOf(*declared[i + 1].type())) {
        return absl::StrCat(signature, " declares input ", i, " (", declared[i + 1].name(), ") ",
                            declared[i + 1].type()->annotation_str(), ", not ", DescribeValue(args[i]), kWhatToDo);
      }
    }
    return "";
  }

  torch::jit::Module m_;
  const bool writes_input_;  // WritesAnArgumentInPlace(m_)
  const bool as_written_;    // the graph runs unoptimised (on a CPU)
};

// Saved activations per stage index in this process: the bytes that its
// training forward passes allocated and are still alive (saved tensors,
// outputs), counted through allocation tags (runtime/allocator.h), summed
// over micro-batches, with what a split backward's B keeps for W (B runs
// under its forward's tag); the peak of that sum, taken as each forward
// pass ends. -1 without the caching allocator.
// Thread-safe; process-wide, never destroyed.
class ActivationMeter {
 public:
  static ActivationMeter& Get() {
    static ActivationMeter* meter = new ActivationMeter;  // never destroyed
    return *meter;
  }

  // A fresh tag for a forward pass of `stage`.
  int64_t NewTag(int64_t stage) {
    base::MutexLock lock(mu_);
    const int64_t tag = next_tag_++;
    stages_[stage].tags.push_back(tag);
    return tag;
  }

  // Adds up what `stage`'s forward passes still hold; updates the peak.
  void Sample(int64_t stage) {
    base::MutexLock lock(mu_);
    Entry& e = stages_[stage];
    int64_t live = 0;
    std::vector<int64_t> alive;
    for (int64_t tag : e.tags) {
      const int64_t b = runtime::TaggedBytes(tag);
      if (b > 0) alive.push_back(tag);
      live += b;
    }
    e.tags = std::move(alive);
    e.peak = std::max(e.peak, live);
  }

  // The peak of `stage`; `reset` starts a new one.
  int64_t Peak(int64_t stage, bool reset) {
    base::MutexLock lock(mu_);
    Entry& e = stages_[stage];
    const int64_t peak = e.peak;
    if (reset) e.peak = 0;
    return peak;
  }

 private:
  struct Entry {
    std::vector<int64_t> tags;  // of forward passes with bytes alive
    int64_t peak = 0;
  };
  absl::Mutex mu_;
  int64_t next_tag_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<int64_t, Entry> stages_ ABSL_GUARDED_BY(mu_);
};

// A stage on its worker: the module and where it sits in the pipeline.
// Owns the module. Not thread-safe: the registry runs one method of a
// remote object at a time.
class Stage {
 public:
  // `recompute`: training forward passes keep only their input
  // (RecomputedForward); `bf16`: under Bf16Autocast, the outputs bf16.
  Stage(std::unique_ptr<StageModule> module, int64_t index, std::string label,
        std::string worker, bool recompute = false, bool bf16 = false)
      : module_(std::move(module)),
        index_(index),
        label_(std::move(label)),
        trace_label_(absl::StrCat("stage ", index_)),
        worker_(std::move(worker)),
        recompute_(recompute),
        bf16_(bf16) {}

  // `turn_held`: the caller holds the forward action's compute turn.
  // `split_backward`: the backward pass runs as B, then W in its own turn.
  c10::IValue Forward(const c10::IValue& arg, int64_t mb, int64_t context_id, c10::Device device,
                      bool train, bool turn_held = false, bool split_backward = false) {
    c10::IValue given;  // (what the stage was given, said when it fails)
    try {
      c10::IValue x = MapTensors(rpc::ValueOrFetch(arg), [device](const at::Tensor& t) {
        return t.to(device);
      });  // before taking the lane
      given = x;
      std::optional<c10::AutoGradMode> grad_mode;
      if (!train) grad_mode.emplace(false);
      module_->Train(train);
      std::optional<runtime::ComputeTurn> turn;
      if (turn_held) {  // (the step runner took the turn)
      } else if (train && context_id >= 0) {
        turn.emplace(runtime::LaneAction{context_id, index_, mb, /*backward=*/false});
      } else {
        turn.emplace();
      }
      trace::Scope scope(train ? "forward" : "eval", mb, trace_label_);
      const bool metered = train && runtime::CpuBytesInUse() >= 0;
      std::optional<runtime::ScopedAllocationTag> tag;
      const int64_t tag_id = metered ? ActivationMeter::Get().NewTag(index_) : -1;
      if (metered) tag.emplace(tag_id);
      c10::IValue y;
      {
        // (What came in bf16 goes on as float32, as autocast would give
        // an op outside its lists, e.g. CPU's layer norm in LibTorch 1.13;
        // its gradient goes back in bf16.)
        if (bf16_) x = ToFloat32(x);
        Bf16Autocast autocast(bf16_);
        y = train && recompute_ ? RecomputedForward(*module_, x, bf16_) : module_->Forward(x);
      }
      if (bf16_) y = ToBf16(y);
      // (A TorchScript graph may hand out outputs that require grad even
      // with grad mode off.)
      if (!train) return MapTensors(y, [](const at::Tensor& t) { return t.detach(); });
      runtime::ActionMarkInfo mark{runtime::LaneAction{context_id, index_, mb, true}, trace_label_, split_backward};
      // (What B keeps for W is held until W, as the forward's activations
      // are: metered with them.)
      if (split_backward) mark.hold_tag = tag_id;
      bool needs_grad = false;
      y = MapTensors(y, [&mark, &needs_grad](const at::Tensor& t) {
        needs_grad |= t.requires_grad();
        return runtime::MarkAction(t, mark);
      });
      // No gradient flows back here (a first stage without parameters): its
      // backward action (and W) will never come, and the order must not
      // wait for it.
      if (!needs_grad && context_id >= 0) {
        runtime::ComputeTurn::Skip(mark.action);
        if (split_backward) runtime::ComputeTurn::Skip(mark.action.Weight());
      }
      tag.reset();
      if (metered) ActivationMeter::Get().Sample(index_);
      return y;
    } catch (...) {
      absl::Status s = base::StatusFromCurrentException(
          absl::StrCat("stage ", index_, " (", label_, ") on worker '", worker_, "', ",
                       train ? "forward" : "eval", " of micro-batch ", mb,
                       given.isNone() ? "" : absl::StrCat(" given ", DescribeValue(given))));
      std::string message(s.message());
      // (LibTorch's batch norm on one row: say what made the row alone.)
      if (absl::StrContains(message, "Expected more than 1 value per channel when training")) {
        absl::StrAppend(&message, " (a micro-batch of one row reached a batch norm, which needs two or more in "
                                  "training: give a larger --batch-size or fewer --splits; with --skip-bad-images, "
                                  "a batch that lost unreadable images can be this short)");
      }
      throw std::runtime_error(message);
    }
  }

  StageModule& module() { return *module_; }
  int64_t index() const { return index_; }
  const std::string& trace_label() const { return trace_label_; }

 private:
  std::unique_ptr<StageModule> module_;
  const int64_t index_;
  const std::string label_, trace_label_, worker_;
  const bool recompute_;
  const bool bf16_;
};

c10::Device DeviceOf(rpc::CallContext& ctx, const std::string& requested) {
  if (!requested.empty()) return c10::Device(requested);
  return ctx.agent != nullptr ? c10::Device(ctx.agent->options().device) : c10::Device(c10::kCPU);
}

// A stage and the device it computes on (the spec's, else the worker's home
// device).
struct HostedStage {
  std::unique_ptr<Stage> stage;
  c10::Device device = c10::kCPU;
};

// The module of a stage spec as the master sends it (kind, name, payload:
// the script's bytes or the type's arguments), built on `device`; throws
// std::invalid_argument naming `where`.
std::unique_ptr<StageModule> BuildModule(const std::string& kind, const std::string& name,
                                         const c10::IValue& payload, c10::Device device,
                                         const std::string& where) {
  if (kind == "script") {
    at::Tensor bytes = payload.toTensor().contiguous().cpu();
    std::string data(static_cast<const char*>(bytes.data_ptr()), bytes.numel());
    auto loaded = LoadScriptStage(data, name, device);
    if (!loaded.ok()) throw std::invalid_argument(absl::StrCat(where, ": ", loaded.status().message()));
    return std::move(*loaded);
  }
  if (kind != "type") {
    throw std::invalid_argument(absl::StrCat(where, ": unknown stage kind '", kind, "'"));
  }
  StageFactory factory;
  {
    StageTypes& types = Types();
    base::MutexLock lock(types.mu);
    auto it = types.factories.find(name);
    if (it == types.factories.end()) {
      std::string known;
      for (const auto& [n, f] : types.factories) absl::StrAppend(&known, known.empty() ? "" : ", ", n);
      throw std::invalid_argument(absl::StrCat(
          where, ": no stage type '", name, "' is registered in this worker program (it has: ",
          known.empty() ? "none" : known, ")"));
    }
    factory = it->second;
  }
  std::vector<c10::IValue> args;
  for (const auto& v : payload.toListRef()) args.push_back(v);
  try {
    return factory(args, device);
  } catch (...) {
    absl::Status s = base::StatusFromCurrentException(absl::StrCat(where, ": building it failed"));
    throw std::invalid_argument(std::string(s.message()));
  }
}

std::shared_ptr<HostedStage> MakeStage(rpc::CallContext& ctx, const rpc::Args& a) {
  const auto r = rpc::DecodeCallOrThrow<MakeStageRequest>(a);
  const c10::Device device = DeviceOf(ctx, r.device);
  const std::string where = absl::StrCat("stage ", r.index, " (", r.name, ") on worker '",
                                         ctx.worker_name(), "'");
  auto hosted = std::make_shared<HostedStage>();
  hosted->device = device;
  hosted->stage = std::make_unique<Stage>(BuildModule(r.type, r.name, r.payload, device, where),
                                          r.index, r.name, ctx.worker_name(), r.recompute, r.bf16);
  return hosted;
}

// remora.pipeline.layer_costs(kinds, names, payloads, sample, repeats): the
// milliseconds of each layer's forward, input gradient (B) and weight
// gradients (W) on this worker's home device (pipeline/layer_timing.h),
// each layer taking the previous one's output (the first takes `sample`,
// which, as a pipeline's batch, needs no gradient).
c10::IValue LayerCosts(rpc::CallContext& ctx, const rpc::Args& a) {
  const auto r = rpc::DecodeCallOrThrow<LayerCostsRequest>(a);
  if (r.kinds.size() != r.names.size() || r.kinds.size() != r.payloads.size()) {
    throw std::invalid_argument("layer_costs: kinds, names and payloads differ in length");
  }
  const c10::Device device = DeviceOf(ctx, "");
  c10::IValue x = MapTensors(rpc::ValueOrFetch(r.sample), [device](const at::Tensor& t) { return t.to(device); });
  LayerCostsReply reply;
  for (size_t i = 0; i < r.kinds.size(); ++i) {
    const std::string where = absl::StrCat("layer ", i, " (", r.names[i], ") on worker '", ctx.worker_name(), "'");
    std::unique_ptr<StageModule> layer = BuildModule(r.kinds[i], r.names[i], r.payloads[i], device, where);
    layer->Train(true);
    LayerTiming t;
    try {
      t = TimeLayer(*layer, x, device, r.repeats, /*input_needs_grad=*/i > 0);
    } catch (...) {
      absl::Status s =
          base::StatusFromCurrentException(absl::StrCat(where, ": timing it on the previous layer's output failed"));
      throw std::invalid_argument(std::string(s.message()));
    }
    reply.forward_ms.push_back(t.forward_ms);
    reply.input_ms.push_back(t.input_ms);
    reply.weight_ms.push_back(t.weight_ms);
    x = std::move(t.output);
  }
  return rpc::EncodeTuple(reply);
}

}  // namespace

std::vector<c10::IValue> ScriptArgs(const c10::IValue& input) {
  if (!input.isTuple()) return {input};
  std::vector<c10::IValue> args;
  for (const auto& e : input.toTupleRef().elements()) args.push_back(e);
  return args;
}

std::vector<at::Tensor> StateTensors(StageModule& module) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : module.Parameters()) out.push_back(p.detach().cpu().clone());
  for (const at::Tensor& b : module.Buffers()) out.push_back(b.detach().cpu().clone());
  return out;
}

std::vector<std::string> StateNames(StageModule& module) {
  std::vector<std::string> names = module.Names();
  if (!names.empty()) return names;
  const size_t num_parameters = module.Parameters().size();
  for (size_t i = 0; i < num_parameters; ++i) names.push_back(absl::StrCat("parameters.", i));
  const size_t num_buffers = module.Buffers().size();
  for (size_t i = 0; i < num_buffers; ++i) names.push_back(absl::StrCat("buffers.", i));
  return names;
}

void LoadState(StageModule& module, const std::vector<at::Tensor>& state, const std::string& where,
               const std::vector<std::string>& names, const std::string& missing) {
  std::vector<at::Tensor> targets = module.Parameters();
  size_t num_parameters = targets.size();
  for (const at::Tensor& b : module.Buffers()) targets.push_back(b);
  std::vector<std::string> mine = names.empty() ? std::vector<std::string>() : StateNames(module);
  if (!missing.empty() && !names.empty() && std::find(names.begin(), names.end(), missing) == names.end()) {
    // (A tensor stored elsewhere: kept as it is.)
    const auto it = std::find(mine.begin(), mine.end(), missing);
    if (it != mine.end() && static_cast<size_t>(it - mine.begin()) < targets.size()) {
      const size_t i = static_cast<size_t>(it - mine.begin());
      targets.erase(targets.begin() + static_cast<std::ptrdiff_t>(i));
      mine.erase(it);
      if (i < num_parameters) --num_parameters;
    }
  }
  if (state.size() != targets.size()) {
    throw std::invalid_argument(absl::StrCat(
        where, ": the saved state has ", state.size(), " tensors; the stage has ", num_parameters,
        " parameters and ", targets.size() - num_parameters, " buffers (is it the same model?)"));
  }
  if (!names.empty()) {
    for (size_t i = 0; i < mine.size() && i < names.size(); ++i) {
      if (names[i] != mine[i]) {
        throw std::invalid_argument(absl::StrCat(where, ": saved tensor ", i, " is '", names[i],
                                                 "'; the stage's is '", mine[i], "' (is it the same model?)"));
      }
    }
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    if (state[i].sizes() != targets[i].sizes() || state[i].scalar_type() != targets[i].scalar_type()) {
      throw std::invalid_argument(absl::StrCat(
          where, ": saved ", i < num_parameters ? "parameter " : "buffer ",
          i < num_parameters ? i : i - num_parameters, " is ", c10::toString(state[i].scalar_type()),
          c10::str(state[i].sizes()), "; the stage's is ", c10::toString(targets[i].scalar_type()),
          c10::str(targets[i].sizes()), " (is it the same model?)"));
    }
  }
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < targets.size(); ++i) targets[i].copy_(state[i]);
}

absl::StatusOr<std::unique_ptr<StageModule>> BuildStage(const StageSpec& spec, c10::Device device) {
  // (A script's errors name its file already.)
  if (spec.kind == "script") return LoadScriptStage(spec.script, spec.name, device);
  try {
    return BuildModule(spec.kind, spec.name, spec.Payload(), device, spec.name);
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat("building stage ", spec.name));
  }
}

absl::StatusOr<LocalStage> LocalStage::Resolve(const rpc::RRef& rref) {
  if (!rref.is_owner()) {
    return absl::InvalidArgumentError("a step runner's stage must live on the runner's worker");
  }
  ASSIGN_OR_RETURN(c10::IValue value, rref.local_value());
  rpc::RemoteObject* object = rpc::AsRemoteObject(value);
  if (object == nullptr || object->type() != "remora.pipeline.Stage") {
    return absl::InvalidArgumentError("a step runner's stage RRef holds no remora.pipeline.Stage");
  }
  return LocalStage(rref, object);
}

c10::IValue LocalStage::Forward(const c10::IValue& input, int64_t mb, int64_t context_id,
                                bool split_backward) const {
  HostedStage* h = object_->get<HostedStage>();
  base::MutexLock lock(object_->mutex());
  return h->stage->Forward(input, mb, context_id, h->device, /*train=*/true, /*turn_held=*/true, split_backward);
}

c10::IValue LocalStage::Eval(const c10::IValue& input, int64_t mb) const {
  HostedStage* h = object_->get<HostedStage>();
  base::MutexLock lock(object_->mutex());
  return h->stage->Forward(input, mb, -1, h->device, /*train=*/false, /*turn_held=*/true);
}

absl::StatusOr<at::Tensor> ParameterNamed(StageModule& module, const std::string& name, const std::string& where) {
  const std::vector<at::Tensor> params = module.Parameters();
  const std::vector<std::string> names = StateNames(module);
  const size_t n = std::min(names.size(), params.size());
  for (size_t i = 0; i < n; ++i) {
    if (names[i] == name) return params[i];
  }
  return absl::NotFoundError(absl::StrCat(where, " has no parameter '", name, "'; its parameters: ",
                                          absl::StrJoin(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(n),
                                                        ", ")));
}

absl::StatusOr<at::Tensor> LocalStage::Parameter(const std::string& name) const {
  HostedStage* h = object_->get<HostedStage>();
  base::MutexLock lock(object_->mutex());
  return ParameterNamed(h->stage->module(), name, h->stage->trace_label());
}

int64_t LocalStage::index() const { return object_->get<HostedStage>()->stage->index(); }
c10::Device LocalStage::device() const { return object_->get<HostedStage>()->device; }
std::string LocalStage::label() const { return object_->get<HostedStage>()->stage->trace_label(); }

absl::Status RegisterStageType(const std::string& name, StageFactory factory) {
  StageTypes& types = Types();
  base::MutexLock lock(types.mu);
  if (!types.factories.emplace(name, std::move(factory)).second) {
    return absl::AlreadyExistsError(absl::StrCat("stage type '", name, "' is already registered"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StageModule>> LoadScriptStage(const std::string& bytes,
                                                            const std::string& label,
                                                            c10::Device device) {
  torch::jit::Module m;
  try {
    std::istringstream in(bytes);
    m = torch::jit::load(in, device);
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat(
        "cannot load TorchScript from ", label,
        " (save it with torch.jit.script(module).save(path))"));
  }
  if (!m.find_method("forward")) {
    return absl::InvalidArgumentError(
        absl::StrCat("the TorchScript module ", label, " has no forward method"));
  }
  return std::unique_ptr<StageModule>(new ScriptStage(std::move(m), device.is_cpu()));
}

namespace {

// The schedule's order functions (set_order, abandon_order) and the
// master's probes (alive, sent_messages).
absl::Status RegisterOrderAndProbes(rpc::Registry& registry) {
  RETURN_IF_ERROR(registry.RegisterFunction(
      SetOrderRequest::kFunction, [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
        const auto r = rpc::DecodeCallOrThrow<SetOrderRequest>(a);
        runtime::ComputeTurn::SetOrder(r.context, DecodeOrder(r.order, r.context, SetOrderRequest::kFunction));
        return c10::IValue();
      }));
  // alive(): answers at once (the master's probe of a worker it waits for), with an error
  // when this process must be restarted (Agent::restart_required): then it counts as lost.
  RETURN_IF_ERROR(registry.RegisterFunction(
      "remora.pipeline.alive", [](rpc::CallContext& ctx, const rpc::Args&) -> c10::IValue {
        if (ctx.agent != nullptr) {
          if (absl::Status why = ctx.agent->restart_required(); !why.ok()) {
            throw std::runtime_error(std::string(why.message()));
          }
        }
        return c10::IValue();
      }));
  // sent_messages(): this process's requests sent, by kind (Agent::sent_messages).
  RETURN_IF_ERROR(registry.RegisterFunction(
      "remora.pipeline.sent_messages", [](rpc::CallContext& ctx, const rpc::Args&) -> c10::IValue {
        c10::Dict<std::string, int64_t> out;
        if (ctx.agent != nullptr) {
          for (const auto& [kind, n] : ctx.agent->sent_messages()) out.insert(kind, n);
        }
        return out;
      }));
  // The batch failed; what waits for its order runs as it comes.
  return registry.RegisterFunction(
      AbandonOrderRequest::kFunction, [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
        runtime::ComputeTurn::Abandon(rpc::DecodeCallOrThrow<AbandonOrderRequest>(a).context);
        return c10::IValue();
      });
}

}  // namespace

absl::Status RegisterFunctions(rpc::Registry& registry) {
  using Hosted = HostedStage;
  RETURN_IF_ERROR(registry.RegisterModule<Hosted>(
      MakeStageRequest::kFunction, [](rpc::CallContext& ctx, const rpc::Args& a) { return MakeStage(ctx, a); },
      {{StageForwardRequest::kMethod,
        [](Hosted& h, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
          const auto r = rpc::DecodeCallOrThrow<StageForwardRequest>(a);
          return h.stage->Forward(r.x, r.micro_batch, r.context, h.device, /*train=*/true);
        }},
       {StageEvalRequest::kMethod,
        [](Hosted& h, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
          const auto r = rpc::DecodeCallOrThrow<StageEvalRequest>(a);
          return h.stage->Forward(r.x, r.micro_batch, -1, h.device, /*train=*/false);
        }},
       {"parameter_rrefs",
        [](Hosted& h, rpc::CallContext& ctx, const rpc::Args&) -> c10::IValue {
          c10::impl::GenericList list(c10::AnyType::get());
          for (const auto& p : h.stage->module().Parameters()) {
            list.push_back(ctx.agent->local_rref(p).ToIValue());
          }
          return list;
        }},
       {"num_parameters",
        [](Hosted& h, rpc::CallContext&, const rpc::Args&) -> c10::IValue {
          int64_t n = 0;
          for (const auto& p : h.stage->module().Parameters()) n += p.numel();
          return n;
        }},
       {ActivationBytesRequest::kMethod,
        [](Hosted& h, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
          const bool reset = rpc::DecodeCallOrThrow<ActivationBytesRequest>(a).reset;
          if (runtime::CpuBytesInUse() < 0 || !h.device.is_cpu()) return int64_t{-1};
          return ActivationMeter::Get().Peak(h.stage->index(), reset);
        }},
       {"state", [](Hosted& h, rpc::CallContext&, const rpc::Args&) -> c10::IValue {
          return c10::List<at::Tensor>(StateTensors(h.stage->module()));
        }},
       {"state_names",
        [](Hosted& h, rpc::CallContext&, const rpc::Args&) -> c10::IValue {
          return c10::List<std::string>(StateNames(h.stage->module()));
        }},
       {LoadStateRequest::kMethod, [](Hosted& h, rpc::CallContext& ctx, const rpc::Args& a) -> c10::IValue {
          const auto r = rpc::DecodeCallOrThrow<LoadStateRequest>(a);
          LoadState(h.stage->module(), r.tensors,
                    absl::StrCat("stage ", h.stage->index(), " on worker '", ctx.worker_name(), "'"), r.names,
                    r.missing);
          return c10::IValue();
        }},
       {StageParameterRequest::kMethod, [](Hosted& h, rpc::CallContext& ctx, const rpc::Args& a) -> c10::IValue {
          const auto r = rpc::DecodeCallOrThrow<StageParameterRequest>(a);
          const std::string where = absl::StrCat("stage ", h.stage->index(), " on worker '", ctx.worker_name(), "'");
          absl::StatusOr<at::Tensor> p = ParameterNamed(h.stage->module(), r.name, where);
          if (!p.ok()) throw std::invalid_argument(std::string(p.status().message()));
          if (r.value.isNone()) return p->detach().clone();
          const at::Tensor v = r.value.toTensor();
          if (v.sizes() != p->sizes()) {
            throw std::invalid_argument(absl::StrCat(where, ": parameter '", r.name, "' is ", c10::str(p->sizes()),
                                                     ", not ", c10::str(v.sizes())));
          }
          c10::NoGradGuard no_grad;
          p->copy_(v);
          return c10::IValue();
        }}}));
  RETURN_IF_ERROR(registry.RegisterFunction(LayerCostsRequest::kFunction, LayerCosts));
  RETURN_IF_ERROR(RegisterRunnerFunctions(registry));
  RETURN_IF_ERROR(RegisterDataFunctions(registry));
  return RegisterOrderAndProbes(registry);
}

}  // namespace remora::pipeline
