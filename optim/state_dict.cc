// An optimizer's state as PyTorch's `optimizer.state_dict()` lays it out
// (optim/distributed_optimizer.h: SaveOptimizerState, LoadOptimizerState):
//
//   {"state": {0: {"momentum_buffer": t}, ...},          SGD
//             {0: {"step": t, "exp_avg": t, "exp_avg_sq": t
//                  [, "max_exp_avg_sq": t]}, ...},         Adam, AdamW
//    "param_groups": [{"lr": .., ..., "params": [0, 1, ...]}]}
//
// (a scheduled optimizer's groups also hold "scheduled_steps", the steps it
// has taken, as PyTorch's schedulers add "initial_lr": Python ignores it)
//
// pickled as torch.save's legacy format does, so the bytes depend only on
// the state (LibTorch's own archive keys entries by the parameters'
// addresses) and Python's `optimizer.load_state_dict(torch.load(...))`
// takes it. Parameters are numbered in the optimizer's order, as PyTorch
// numbers them.
#include "optim/state_dict.h"

#include <cstring>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include "absl/strings/str_cat.h"
#include "optim/distributed_optimizer.h"

namespace remora::optim {
namespace {

using GenericDict = c10::impl::GenericDict;

// LibTorch keys an optimizer's per-parameter state by the parameter's
// TensorImpl: its address as a string up to 1.13, the pointer itself since.
template <typename Map>
typename Map::key_type StateKey(const at::Tensor& p) {
  if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
    std::ostringstream key;  // as c10::guts::to_string wrote it
    key << static_cast<const void*>(p.unsafeGetTensorImpl());
    return key.str();
  } else {
    return p.unsafeGetTensorImpl();
  }
}

using StateMap = std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

GenericDict NewDict() { return GenericDict(c10::StringType::get(), c10::AnyType::get()); }

// A copy of `t` on the CPU (undefined stays undefined).
at::Tensor Saved(const at::Tensor& t) { return t.defined() ? t.detach().cpu().clone() : t; }

template <typename AdamState>
GenericDict AdamEntry(const AdamState& s) {
  GenericDict e = NewDict();
  // PyTorch keeps the step as a float tensor.
  e.insert("step", at::scalar_tensor(static_cast<double>(s.step()), at::kFloat));
  e.insert("exp_avg", Saved(s.exp_avg()));
  e.insert("exp_avg_sq", Saved(s.exp_avg_sq()));
  if (s.max_exp_avg_sq().defined()) e.insert("max_exp_avg_sq", Saved(s.max_exp_avg_sq()));
  return e;
}

// The saved `key` of parameter `i`, on `p`'s device, checked against `p`'s
// shape.
at::Tensor Restored(const GenericDict& entry, const char* key, const at::Tensor& p, int64_t i, bool like_p = true) {
  if (!entry.contains(key) || !entry.at(key).isTensor()) {
    throw std::invalid_argument(absl::StrCat("optimizer state: parameter ", i, " has no tensor '", key, "'"));
  }
  const at::Tensor t = entry.at(key).toTensor();
  if (like_p && t.sizes() != p.sizes()) {
    throw std::invalid_argument(absl::StrCat("optimizer state: parameter ", i, "'s '", key, "' is ",
                                             c10::str(t.sizes()), "; the parameter is ", c10::str(p.sizes()),
                                             " (is it the same model?)"));
  }
  return like_p ? t.to(p.device(), p.scalar_type()).clone() : t;
}

template <typename AdamState>
std::unique_ptr<AdamState> AdamFrom(const GenericDict& e, const at::Tensor& p, int64_t i) {
  auto s = std::make_unique<AdamState>();
  const at::Tensor step = Restored(e, "step", p, i, /*like_p=*/false);
  s->step(static_cast<int64_t>(step.item<double>()));
  s->exp_avg(Restored(e, "exp_avg", p, i));
  s->exp_avg_sq(Restored(e, "exp_avg_sq", p, i));
  if (e.contains("max_exp_avg_sq")) s->max_exp_avg_sq(Restored(e, "max_exp_avg_sq", p, i));
  return s;
}

template <typename AdamOptions>
void SaveAdamOptions(const AdamOptions& o, GenericDict& g) {
  g.insert("lr", o.lr());
  g.insert("betas", c10::ivalue::Tuple::create({std::get<0>(o.betas()), std::get<1>(o.betas())}));
  g.insert("eps", o.eps());
  g.insert("weight_decay", o.weight_decay());
  g.insert("amsgrad", o.amsgrad());
}

template <typename AdamOptions>
void LoadAdamOptions(const GenericDict& g, AdamOptions& o) {
  if (g.contains("lr")) o.lr(g.at("lr").toDouble());
  if (g.contains("betas")) {
    const auto& b = g.at("betas").toTupleRef().elements();
    o.betas(std::make_tuple(b.at(0).toDouble(), b.at(1).toDouble()));
  }
  if (g.contains("eps")) o.eps(g.at("eps").toDouble());
  if (g.contains("weight_decay")) o.weight_decay(g.at("weight_decay").toDouble());
  if (g.contains("amsgrad")) o.amsgrad(g.at("amsgrad").toBool());
}

}  // namespace

c10::IValue OptimizerStateDict(const torch::optim::Optimizer& optimizer) {
  GenericDict state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList groups(c10::AnyType::get());
  const StateMap& map = optimizer.state();
  int64_t index = 0;
  for (const auto& group : optimizer.param_groups()) {
    GenericDict g = NewDict();
    const auto& options = group.options();
    if (auto* o = dynamic_cast<const torch::optim::SGDOptions*>(&options)) {
      g.insert("lr", o->lr());
      g.insert("momentum", o->momentum());
      g.insert("dampening", o->dampening());
      g.insert("weight_decay", o->weight_decay());
      g.insert("nesterov", o->nesterov());
    } else if (auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&options)) {
      SaveAdamOptions(*o, g);
    } else if (auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) {
      SaveAdamOptions(*o, g);
    } else {
      throw std::invalid_argument("optimizer state: only SGD, Adam and AdamW are saved");
    }
    c10::List<int64_t> params;
    for (const at::Tensor& p : group.params()) {
      const int64_t i = index++;
      params.push_back(i);
      const auto it = map.find(StateKey<StateMap>(p));
      if (it == map.end()) continue;  // no step taken yet
      const torch::optim::OptimizerParamState* s = it->second.get();
      if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(s)) {
        GenericDict e = NewDict();
        e.insert("momentum_buffer", Saved(sgd->momentum_buffer()));
        state.insert(i, e);
      } else if (auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(s)) {
        state.insert(i, AdamEntry(*adam));
      } else if (auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(s)) {
        state.insert(i, AdamEntry(*adamw));
      }
    }
    if (auto* scheduled = dynamic_cast<const ScheduledSteps*>(&optimizer)) {
      g.insert("scheduled_steps", scheduled->steps());
    }
    g.insert("params", params);
    groups.push_back(g);
  }
  GenericDict out = NewDict();
  out.insert("state", state);
  out.insert("param_groups", groups);
  return out;
}

void LoadOptimizerStateDict(torch::optim::Optimizer& optimizer, const c10::IValue& dict) {
  const GenericDict d = dict.toGenericDict();
  if (!d.contains("state") || !d.contains("param_groups")) {
    throw std::invalid_argument("optimizer state: not a state dict (no 'state' and 'param_groups')");
  }
  const GenericDict saved_state = d.at("state").toGenericDict();
  const c10::ArrayRef<c10::IValue> saved_groups = d.at("param_groups").toListRef();
  auto& groups = optimizer.param_groups();
  if (saved_groups.size() != groups.size()) {
    throw std::invalid_argument(absl::StrCat("optimizer state: ", saved_groups.size(),
                                             " parameter groups saved; the optimizer has ", groups.size()));
  }
  StateMap& map = optimizer.state();
  map.clear();
  int64_t index = 0;
  for (size_t k = 0; k < groups.size(); ++k) {
    const GenericDict g = saved_groups[k].toGenericDict();
    auto& group = groups[k];
    const size_t saved_params = g.at("params").toListRef().size();
    if (saved_params != group.params().size()) {
      throw std::invalid_argument(absl::StrCat("optimizer state: group ", k, " saved with ", saved_params,
                                               " parameters; the optimizer has ", group.params().size(),
                                               " (is it the same model?)"));
    }
    if (auto* scheduled = dynamic_cast<ScheduledSteps*>(&optimizer); scheduled && g.contains("scheduled_steps")) {
      scheduled->set_steps(g.at("scheduled_steps").toInt());
    }
    auto& options = group.options();
    if (auto* o = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
      if (g.contains("lr")) o->lr(g.at("lr").toDouble());
      if (g.contains("momentum")) o->momentum(g.at("momentum").toDouble());
      if (g.contains("dampening")) o->dampening(g.at("dampening").toDouble());
      if (g.contains("weight_decay")) o->weight_decay(g.at("weight_decay").toDouble());
      if (g.contains("nesterov")) o->nesterov(g.at("nesterov").toBool());
    } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      LoadAdamOptions(g, *o);
    } else if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      LoadAdamOptions(g, *o);
    }
    for (const at::Tensor& p : group.params()) {
      const int64_t i = index++;
      if (!saved_state.contains(i)) continue;
      const GenericDict e = saved_state.at(i).toGenericDict();
      std::unique_ptr<torch::optim::OptimizerParamState> s;
      if (dynamic_cast<torch::optim::SGDOptions*>(&options) != nullptr) {
        auto sgd = std::make_unique<torch::optim::SGDParamState>();
        sgd->momentum_buffer(Restored(e, "momentum_buffer", p, i));
        s = std::move(sgd);
      } else if (dynamic_cast<torch::optim::AdamOptions*>(&options) != nullptr) {
        s = AdamFrom<torch::optim::AdamParamState>(e, p, i);
      } else if (dynamic_cast<torch::optim::AdamWOptions*>(&options) != nullptr) {
        s = AdamFrom<torch::optim::AdamWParamState>(e, p, i);
      } else {
        throw std::invalid_argument("optimizer state: only SGD, Adam and AdamW are loaded");
      }
      map[StateKey<StateMap>(p)] = std::move(s);
    }
  }
}

bool IsModuleArchive(const at::Tensor& bytes) {
  // Both are zip files; only LibTorch's module archive holds constants.pkl
  // (pickle_save's holds data.pkl, data/<n> and version).
  const at::Tensor b = bytes.contiguous().cpu();
  const std::string_view data(static_cast<const char*>(b.data_ptr()), b.numel());
  return data.find("constants.pkl") != std::string_view::npos;
}

at::Tensor PickleBytes(const c10::IValue& value) {
  const std::vector<char> bytes = torch::jit::pickle_save(value);
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

c10::IValue Unpickle(const at::Tensor& bytes) {
  const at::Tensor b = bytes.contiguous().cpu();
  const char* data = static_cast<const char*>(b.data_ptr());
  return torch::jit::pickle_load(std::vector<char>(data, data + b.numel()));
}

at::Tensor SaveOptimizerState(const torch::optim::Optimizer& optimizer) {
  return PickleBytes(OptimizerStateDict(optimizer));
}

void LoadOptimizerState(torch::optim::Optimizer& optimizer, const at::Tensor& bytes) {
  if (IsModuleArchive(bytes)) {  // written by remora before state dicts
    torch::serialize::InputArchive archive;
    ReadArchive(bytes, archive);
    optimizer.load(archive);
    return;
  }
  LoadOptimizerStateDict(optimizer, Unpickle(bytes));
}

GenericDict OneParamGroup(const c10::IValue& dict, const char* what) {
  if (!dict.isGenericDict()) throw std::invalid_argument(absl::StrCat(what, ": the optimizer state is no dict"));
  const GenericDict d = dict.toGenericDict();
  if (!d.contains("state") || !d.contains("param_groups") || d.at("param_groups").toListRef().size() != 1) {
    throw std::invalid_argument(absl::StrCat(what, ": the optimizer state is not one parameter group's state dict"));
  }
  const GenericDict group = d.at("param_groups").toListRef().front().toGenericDict();
  if (!group.contains("params")) throw std::invalid_argument(absl::StrCat(what, ": its parameter group has no params"));
  return group;
}

c10::IValue OneGroupStateDict(const GenericDict& state, const c10::IValue& options, int64_t n) {
  GenericDict group(c10::StringType::get(), c10::AnyType::get());
  if (!options.isNone()) {
    for (const auto& e : options.toGenericDict()) group.insert(e.key(), e.value());
  }
  c10::List<int64_t> params;
  for (int64_t i = 0; i < n; ++i) params.push_back(i);
  group.insert_or_assign("params", params);
  c10::impl::GenericList groups(c10::AnyType::get());
  groups.push_back(group);
  GenericDict out(c10::StringType::get(), c10::AnyType::get());
  out.insert("state", state);
  out.insert("param_groups", groups);
  return out;
}

}  // namespace remora::optim
