#include "pipeline/partition.h"

#include <algorithm>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include <c10/core/GradMode.h>
#include <ATen/ops/allclose.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/serialization/import.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status_util.h"
#include "pipeline/describe.h"
#include "pipeline/protocol.h"
#include "pipeline/script_cut.h"
#include "pipeline/stage.h"

namespace remora::pipeline {
namespace {

// Whether `a` and `b` hold the same tensors, within float rounding.
bool Close(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() && b.isTensor()) {
    const at::Tensor x = a.toTensor(), y = b.toTensor();
    return x.sizes() == y.sizes() && x.dtype() == y.dtype() &&
           (!x.is_floating_point() ? x.equal(y) : at::allclose(x, y, 1e-4, 1e-5));
  }
  if (a.isTuple() && b.isTuple()) {
    const auto& xs = a.toTupleRef().elements();
    const auto& ys = b.toTupleRef().elements();
    if (xs.size() != ys.size()) return false;
    for (size_t i = 0; i < xs.size(); ++i) {
      if (!Close(xs[i], ys[i])) return false;
    }
    return true;
  }
  return false;
}

std::string Describe(const std::vector<int>& v) { return absl::StrJoin(v, ","); }

// `name` as a TorchScript string literal.
std::string PythonString(absl::string_view name) {
  std::string out = "\"";
  for (char ch : name) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

}  // namespace

// --- SequentialModel -------------------------------------------------------------

SequentialModel SequentialModel::Registered(std::string type, int num_layers,
                                            std::vector<c10::IValue> args) {
  SequentialModel m;
  m.label_ = type;
  m.type_ = std::move(type);
  m.num_layers_ = num_layers;
  m.args_ = std::move(args);
  return m;
}

absl::StatusOr<SequentialModel> SequentialModel::TorchScript(const std::string& bytes,
                                                             std::string label) {
  auto module = std::make_shared<torch::jit::Module>();
  try {
    std::istringstream in(bytes);
    *module = torch::jit::load(in);
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat(
        "cannot load TorchScript from ", label,
        " (save it with torch.jit.script(nn.Sequential(...)).save(path))"));
  }
  SequentialModel m;
  if (auto forward = module->find_method("forward")) {
    const auto& returns = forward->function().getSchema().returns();
    if (returns.size() == 1) m.output_type_ = returns[0].type()->annotation_str();
  }
  // A forward that is not its children's chain is cut at its statements.
  // (One that cannot be read so is taken as a chain, as before: Check
  // says where that fails.)
  if (auto cut = ScriptCut::Make(*module, label); cut.ok() && !(*cut)->IsChainOfChildren()) {
    m.num_layers_ = (*cut)->num_layers();
    m.cut_ = std::move(*cut);
    m.label_ = std::move(label);
    m.script_ = std::move(module);
    return m;
  }
  for (const auto& child : module->named_children()) {
    if (!child.value.find_method("forward")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", m.children_.size(), " ('", child.name, "') of ", label, " has no forward method"));
    }
    m.children_.push_back(child.name);
  }
  if (m.children_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        label, " has no child modules to cut into stages (it should be a scripted "
               "nn.Sequential; a model already cut goes in as one file per stage)"));
  }
  m.label_ = std::move(label);
  m.num_layers_ = static_cast<int>(m.children_.size());
  m.script_ = std::move(module);
  return m;
}

std::string SequentialModel::layer_name(int i) const {
  if (cut_) return cut_->layer_name(i);
  if (script_) return children_.at(i);
  return absl::StrCat(type_, " layer ", i);
}

std::optional<std::pair<std::string, std::string>> SequentialModel::Tied() const {
  return cut_ ? cut_->Tied() : std::nullopt;
}

absl::StatusOr<int> SequentialModel::LayerNamed(const std::string& name) const {
  if (cut_) return cut_->LayerStartingAt(name);
  if (script_) {
    for (size_t i = 0; i < children_.size(); ++i) {
      if (children_[i] == name) return static_cast<int>(i);
    }
    if (!absl::StrContains(name, '.') || !std::count(children_.begin(), children_.end(), name.substr(0, name.find('.')))) {
      return absl::NotFoundError(absl::StrCat(label_, " has no child module named ", name, "; its children are ",
                                              absl::StrJoin(children_, ", ")));
    }
    return absl::InvalidArgumentError(absl::StrCat("cannot cut ", label_, " before ", name,
                                                   ": it is inside child ", name.substr(0, name.find('.')),
                                                   ", which is cut whole; cut before a child"));
  }
  return absl::InvalidArgumentError(absl::StrCat(label_, "'s layers have no names; give layer numbers"));
}

absl::StatusOr<SequentialModel> SequentialModel::TorchScriptFile(const std::string& path) {
  ASSIGN_OR_RETURN(StageSpec file, StageSpec::TorchScriptFile(path));
  return TorchScript(file.script, path);
}

absl::StatusOr<StageSpec> SequentialModel::Stage(int first, int last) const {
  if (first < 0 || last > num_layers_ || first >= last) {
    return absl::OutOfRangeError(absl::StrCat("layers [", first, ", ", last, ") of ", label_,
                                              ", which has ", num_layers_));
  }
  if (!script_) {
    std::vector<c10::IValue> args = {int64_t{first}, int64_t{last}};
    args.insert(args.end(), args_.begin(), args_.end());
    return StageSpec::Registered(type_, std::move(args));
  }
  const std::string label = absl::StrCat(label_, " layers [", first, ", ", last, ")");
  if (cut_) {
    ASSIGN_OR_RETURN(std::string bytes, cut_->Stage(first, last));
    return StageSpec::TorchScript(std::move(bytes), label);
  }
  // A module of those children, its forward their chain; each step has a
  // variable of its own, so a layer may change the value's type. Each
  // child keeps its name in the whole ("0", "1", ... for an nn.Sequential),
  // so that the stages' state dicts, merged, are the whole module's.
  // getattr reaches a name that is no identifier ("0", "fc-1").
  try {
    torch::jit::Module stage("remora.SequentialStage");
    std::string code = "def forward(self, x0):\n";
    for (int i = first; i < last; ++i) {
      const int j = i - first;
      stage.register_module(children_[i], script_->attr(children_[i]).toModule());
      absl::StrAppend(&code, "  x", j + 1, " = getattr(self, ", PythonString(children_[i]), ").forward(x", j,
                      ")\n");
    }
    absl::StrAppend(&code, "  return x", last - first, "\n");
    stage.define(code);
    std::ostringstream out;
    stage.save(out);
    return StageSpec::TorchScript(out.str(), label);
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat(
        "making a stage of ", label, " (does each layer's forward take the previous one's output?)"));
  }
}

namespace {

// The last non-empty line of an error: PyTorch's own message, after the
// TorchScript interpreter's traceback.
std::string LastLine(absl::string_view message) {
  std::vector<absl::string_view> lines = absl::StrSplit(message, '\n', absl::SkipWhitespace());
  absl::string_view line = lines.empty() ? message : absl::StripAsciiWhitespace(lines.back());
  absl::ConsumePrefix(&line, ": ");
  return std::string(line);
}

}  // namespace

absl::Status SequentialModel::Check(const c10::IValue& sample) const {
  if (!script_) return absl::OkStatus();
  torch::jit::Module m = script_->deepcopy();
  m.eval();
  c10::NoGradGuard no_grad;
  // Layer i as a module: a child, or the stage of that one layer.
  std::vector<torch::jit::Module> layers;
  for (int i = 0; i < num_layers_; ++i) {
    if (!cut_) {
      layers.push_back(m.attr(children_[i]).toModule());
      continue;
    }
    ASSIGN_OR_RETURN(std::string bytes, cut_->Stage(i, i + 1));
    try {
      std::istringstream in(bytes);
      layers.push_back(torch::jit::load(in));
      layers.back().eval();
    } catch (...) {
      return base::StatusFromCurrentException(absl::StrCat("loading layer ", i, " (", layer_name(i), ") of ", label_));
    }
  }
  c10::IValue whole, chained = sample;
  try {
    whole = m.forward(ScriptArgs(sample));
  } catch (...) {
    const absl::Status failed =
        base::StatusFromCurrentException(absl::StrCat("the forward of ", label_, " on the sample input"));
    // Name the layer that refuses its input, with the input's shape and
    // PyTorch's own line (which gives the shape the layer wants), not the
    // interpreter's traceback.
    c10::IValue x = sample;
    for (int i = 0; i < num_layers_; ++i) {
      try {
        x = layers[i].forward(ScriptArgs(x));
      } catch (...) {
        const absl::Status s = base::StatusFromCurrentException("");
        auto type = layers[i].type()->name();
        if (cut_) type.reset();  // (the stage's own class, not the user's)
        return absl::InvalidArgumentError(absl::StrCat(
            label_, ": layer ", i, " ('", layer_name(i), "'", type ? absl::StrCat(", ", type->name()) : "",
            ") does not take ", i == 0 ? "the input, " : "the previous layer's output, ", DescribeValue(x), ": ",
            LastLine(s.message())));
      }
    }
    return failed;
  }
  for (int i = 0; i < num_layers_; ++i) {
    try {
      chained = layers[i].forward(ScriptArgs(chained));
    } catch (...) {
      return base::StatusFromCurrentException(absl::StrCat(
          "layer ", i, " ('", layer_name(i), "') of ", label_,
          " on the previous layer's output: the layers do not run one after another, so ",
          label_, " cannot be cut at them (export an nn.Sequential, or one file per stage)"));
    }
  }
  if (!Close(whole, chained)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the forward of ", label_, " is not its ", num_layers_, cut_ ? " layers" : " child modules",
        " run one after another (their chain gives other outputs), so it cannot "
        "be cut at them: export one TorchScript file per stage"));
  }
  return absl::OkStatus();
}

// --- the arithmetic --------------------------------------------------------------

absl::StatusOr<std::vector<int>> BalancedSplit(const std::vector<double>& costs, int parts) {
  const int n = static_cast<int>(costs.size());
  if (parts < 1 || parts > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot cut ", n, " layers into ", parts, " stages (at most one per layer)"));
  }
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the smallest largest part cutting layers [0, i) into k parts.
  std::vector<std::vector<double>> best(parts + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(parts + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0.0;
  for (int k = 1; k <= parts; ++k) {
    for (int i = k; i <= n; ++i) {
      for (int j = k - 1; j < i; ++j) {
        const double v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (v < best[k][i]) {
          best[k][i] = v;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int> bounds(parts + 1);
  bounds[parts] = n;
  for (int k = parts, i = n; k > 0; --k) {
    i = cut[k][i];
    bounds[k - 1] = i;
  }
  return bounds;
}

absl::StatusOr<std::vector<int>> InterleavedSplit(const std::vector<double>& costs, int workers,
                                                  int per_worker, int micro_batches) {
  const int n = static_cast<int>(costs.size());
  const int parts = workers * per_worker;
  if (workers < 1 || per_worker < 1 || micro_batches < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "interleaved split: workers (", workers, "), stages per worker (", per_worker,
        ") and micro-batches (", micro_batches, ") must be at least 1"));
  }
  if (per_worker == 1 || parts > n) return BalancedSplit(costs, parts);
  std::vector<double> prefix(n + 1, 0.0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  std::vector<int> bounds(parts + 1, 0), best;
  bounds[parts] = n;
  double best_time = std::numeric_limits<double>::infinity();
  std::vector<double> load(workers, 0.0);
  // Places the cut ending chunk k - 1 (bounds[k]), given bounds[0..k-1].
  std::function<void(int, double)> place = [&](int k, double largest_chunk) {
    if (k == parts) {
      const double chunk = prefix[n] - prefix[bounds[k - 1]];
      const int w = (k - 1) % workers;
      load[w] += chunk;
      const double busiest = *std::max_element(load.begin(), load.end());
      const double time = micro_batches * busiest + (workers - 1) * std::max(largest_chunk, chunk);
      if (time < best_time) {
        best_time = time;
        best = bounds;
      }
      load[w] -= chunk;
      return;
    }
    // Chunk k - 1 is [bounds[k - 1], bounds[k]); a layer is left for each later chunk.
    for (int end = bounds[k - 1] + 1; end <= n - (parts - k); ++end) {
      const double chunk = prefix[end] - prefix[bounds[k - 1]];
      const int w = (k - 1) % workers;
      load[w] += chunk;
      if (micro_batches * load[w] < best_time) {  // nothing better down this way otherwise
        bounds[k] = end;
        place(k + 1, std::max(largest_chunk, chunk));
      }
      load[w] -= chunk;
    }
  };
  place(1, 0.0);
  return best;
}

absl::StatusOr<std::vector<int>> SplitAt(int num_layers, const std::vector<int>& split_at,
                                         int parts) {
  if (static_cast<int>(split_at.size()) + 1 != parts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "split points ", Describe(split_at), " make ", split_at.size() + 1, " stages; ", parts,
        " are wanted (give ", parts - 1, " points: the first layer of stages 1 to ", parts - 1, ")"));
  }
  std::vector<int> bounds = {0};
  for (int p : split_at) {
    if (p <= bounds.back() || p >= num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(
          "split points ", Describe(split_at), " must increase strictly and lie in 1..",
          num_layers - 1, " (the model has ", num_layers, " layers; every stage needs one)"));
    }
    bounds.push_back(p);
  }
  bounds.push_back(num_layers);
  return bounds;
}

// --- Partition --------------------------------------------------------------------

absl::StatusOr<std::vector<LayerTimes>> MeasureLayers(rpc::Agent& agent, const SequentialModel& model,
                                                      const std::vector<std::string>& workers,
                                                      const c10::IValue& sample, int repeats) {
  if (sample.isNone()) {
    return absl::InvalidArgumentError(
        "measuring layers needs a sample micro-batch of inputs (PartitionOptions::sample)");
  }
  LayerCostsRequest request;
  for (int i = 0; i < model.num_layers(); ++i) {
    ASSIGN_OR_RETURN(StageSpec layer, model.Stage(i, i + 1));
    request.kinds.push_back(layer.kind);
    request.names.push_back(layer.name);
    request.payloads.push_back(layer.Payload());
  }
  request.sample = agent.local_rref(sample).ToIValue();
  request.repeats = repeats;
  std::vector<rpc::Future<c10::IValue>> pending;
  for (const auto& w : workers) {
    pending.push_back(agent.rpc_async(w, LayerCostsRequest::kFunction, rpc::EncodeCall(request),
                                      rpc::CallOptions{absl::Minutes(10)}));
  }
  const auto where = [&](size_t w) {
    return absl::StrCat("measuring the layers of ", model.label(), " on worker '", workers[w], "'");
  };
  ASSIGN_OR_RETURN(std::vector<c10::IValue> replies, rpc::WaitAll(pending, where));
  std::vector<LayerTimes> out;
  for (size_t w = 0; w < replies.size(); ++w) {
    absl::StatusOr<LayerCostsReply> r = rpc::DecodeTuple<LayerCostsReply>(replies[w]);
    if (!r.ok()) return base::Annotate(r.status(), where(w));
    const size_t n = static_cast<size_t>(model.num_layers());
    if (r->forward_ms.size() != n || r->input_ms.size() != n || r->weight_ms.size() != n) {
      return absl::InternalError(absl::StrCat(where(w), ": ", r->forward_ms.size(), " layers timed, not ", n));
    }
    out.push_back({std::move(r->forward_ms), std::move(r->input_ms), std::move(r->weight_ms)});
  }
  return out;
}

absl::StatusOr<LayerTimes> MeasureMeanLayers(rpc::Agent& agent, const SequentialModel& model,
                                             const std::vector<std::string>& workers, const c10::IValue& sample,
                                             int repeats) {
  ASSIGN_OR_RETURN(const std::vector<LayerTimes> measured, MeasureLayers(agent, model, workers, sample, repeats));
  const size_t n = static_cast<size_t>(model.num_layers());
  LayerTimes mean{std::vector<double>(n, 0.0), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  const double share = 1.0 / static_cast<double>(measured.size());
  for (const LayerTimes& t : measured) {
    for (size_t i = 0; i < n; ++i) {
      mean.forward_ms[i] += t.forward_ms[i] * share;
      mean.input_ms[i] += t.input_ms[i] * share;
      mean.weight_ms[i] += t.weight_ms[i] * share;
    }
  }
  return mean;
}

absl::StatusOr<double> MeasureCrossing(rpc::Agent& agent, const std::string& worker, const c10::IValue& sample,
                                       int repeats) {
  if (repeats < 1) return absl::InvalidArgumentError("measuring a crossing needs at least one round trip");
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    LayerCostsRequest request;  // (no layers)
    const absl::Time start = absl::Now();
    request.sample = agent.local_rref(sample).ToIValue();
    std::vector<rpc::Future<c10::IValue>> pending;
    pending.push_back(agent.rpc_async(worker, LayerCostsRequest::kFunction, rpc::EncodeCall(request),
                                      rpc::CallOptions{absl::Minutes(1)}));
    RETURN_IF_ERROR(rpc::WaitAll(pending, [&](size_t) {
                      return absl::StrCat("timing a crossing to worker '", worker, "'");
                    }).status());
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

absl::StatusOr<Partitioning> Partition(rpc::Agent& agent, const SequentialModel& model,
                                       const std::vector<std::string>& workers,
                                       const PartitionOptions& o) {
  const int n = static_cast<int>(workers.size());
  if (n < 1) return absl::InvalidArgumentError("partition: no workers given");
  if (o.stages_per_worker < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("partition: stages per worker must be at least 1, not ", o.stages_per_worker));
  }
  const int parts = n * o.stages_per_worker;
  if (parts > model.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot cut ", model.label(), " (", model.num_layers(), " layers) into ", parts,
        " stages (", n, " workers x ", o.stages_per_worker,
        " per worker): use fewer workers or stages per worker"));
  }
  Partitioning p;
  if (!o.split_at.empty()) {
    ASSIGN_OR_RETURN(p.bounds, SplitAt(model.num_layers(), o.split_at, parts));
  } else {
    RETURN_IF_ERROR(model.Check(o.sample));
    ASSIGN_OR_RETURN(const LayerTimes measured, MeasureMeanLayers(agent, model, workers, o.sample, o.repeats));
    p.layer_ms = measured.Total();
    if (o.schedule == "zbv") {
      // (Each worker hosts two stages of the V: cut where the schedule,
      // run with these times, is predicted to end first.)
      ASSIGN_OR_RETURN(const Schedule v, MakeSchedule(o.schedule, n, o.stages_per_worker, o.micro_batches));
      std::vector<StageTimes> layers;
      for (size_t i = 0; i < p.layer_ms.size(); ++i) {
        layers.push_back({measured.forward_ms[i], measured.input_ms[i], measured.weight_ms[i]});
      }
      ASSIGN_OR_RETURN(p.bounds, PredictedSplit(v, layers, /*crossing_ms=*/0));
    } else {
      ASSIGN_OR_RETURN(p.bounds, InterleavedSplit(p.layer_ms, n, o.stages_per_worker, o.micro_batches));
    }
  }
  p.placement = StagePlacement(o.schedule, n, o.stages_per_worker);
  for (int k = 0; k < parts; ++k) {
    ASSIGN_OR_RETURN(StageSpec s, model.Stage(p.bounds[k], p.bounds[k + 1]));
    p.stages.push_back(std::move(s));
  }
  return p;
}

std::string Partitioning::Describe(const std::vector<std::string>& workers) const {
  const int n = static_cast<int>(workers.size());
  double total = 0;
  for (double x : layer_ms) total += x;
  std::string out;
  for (int w = 0; w < n; ++w) {
    double part = 0;
    std::vector<std::string> ranges;
    for (int k = 0; k + 1 < static_cast<int>(bounds.size()); ++k) {
      if (k < static_cast<int>(placement.size()) ? placement[k] != w : k % n != w) continue;
      for (int b = bounds[k]; b < bounds[k + 1] && b < static_cast<int>(layer_ms.size()); ++b) {
        part += layer_ms[b];
      }
      ranges.push_back(absl::StrFormat("[%2d, %2d)", bounds[k], bounds[k + 1]));
    }
    absl::StrAppendFormat(&out, "  %-10s layers %s", workers[w], absl::StrJoin(ranges, " + "));
    if (total > 0) absl::StrAppendFormat(&out, "  %5.1f%% of the measured cost", 100.0 * part / total);
    out += "\n";
  }
  return out;
}

}  // namespace remora::pipeline
