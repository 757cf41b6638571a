#include "optim/distributed_optimizer.h"

#include <cstring>
#include <map>
#include <sstream>
#include <type_traits>

#include <ATen/core/grad_mode.h>
#include <ATen/core/Dict.h>
#include <ATen/ops/empty.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include "absl/strings/str_cat.h"
#include "autograd/container.h"
#include "autograd/dist_autograd.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "optim/protocol.h"
#include "runtime/compute_lane.h"
#include "trace/trace.h"

namespace remora::optim {
namespace {

constexpr const char* kLocalOptimizer = MakeLocalOptimizerRequest::kFunction;

// One owner's optimizer over its own parameters.
class LocalOptimizer {
 public:
  LocalOptimizer(const c10::impl::GenericDict& options, std::vector<at::Tensor> params)
      : params_(params), optimizer_(MakeOptimizer(options, std::move(params))) {}

  int64_t state_bytes() const { return StateBytes(*optimizer_); }

  // The state dict (OptimizerStateDict); and loading one, or the bytes of
  // one or of LibTorch's archive (older checkpoints).
  c10::IValue SaveState() const { return OptimizerStateDict(*optimizer_); }
  void LoadState(const c10::IValue& state) {
    if (state.isTensor()) {
      LoadOptimizerState(*optimizer_, state.toTensor());
    } else {
      LoadOptimizerStateDict(*optimizer_, state);
    }
  }

  // Steps with the gradients `context` accumulated here.
  void Step(const autograd::DistContext& context) {
    runtime::ComputeTurn compute;
    trace::Scope scope("step", -1);
    for (auto& p : params_) p.mutable_grad() = context.Gradient(p);
    optimizer_->step();
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
  }

 private:
  std::vector<at::Tensor> params_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
};

// A LibTorch optimizer of type Base whose rate follows a schedule, or
// whose decoupled weight decay (AdamW's) spares the parameters of fewer than
// two dimensions, or both.
// Thread-safety: as Base, one caller at a time (its owner's step, or a
// checkpoint's save or load between steps).
template <typename Base, typename BaseOptions>
class Adjusted : public Base {
 public:
  Adjusted(std::vector<at::Tensor> params, BaseOptions options, const LrSchedule& schedule,
           bool matrices_only)
      : Base(std::move(params), options), lr_(options.lr()), schedule_(schedule),
        matrices_only_(matrices_only) {}

  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) override {
    if (schedule_.scheduled()) {
      const double lr = ScheduledLr(lr_, schedule_, steps_);
      for (auto& group : this->param_groups()) group.options().set_lr(lr);
    }
    at::Tensor loss = matrices_only_ ? StepDecayingMatricesOnly(std::move(closure))
                                     : Base::step(std::move(closure));
    ++steps_;
    return loss;
  }

 protected:
  int64_t steps_ = 0;

 private:
  // What AdamW does first for each parameter with a gradient (p *= 1 - lr x
  // weight_decay), done here for the matrices only; then AdamW's step with
  // no decay, and the groups' weight_decay as they were.
  at::Tensor StepDecayingMatricesOnly(torch::optim::Optimizer::LossClosure closure) {
    if constexpr (std::is_same_v<BaseOptions, torch::optim::AdamWOptions>) {
      std::vector<double> decays;
      {
        at::NoGradGuard no_grad;
        for (auto& group : this->param_groups()) {
          auto& o = static_cast<torch::optim::AdamWOptions&>(group.options());
          decays.push_back(o.weight_decay());
          if (o.weight_decay() == 0) continue;
          for (at::Tensor& p : group.params()) {
            if (p.grad().defined() && p.dim() >= 2) p.mul_(1 - o.lr() * o.weight_decay());
          }
          o.weight_decay(0);
        }
      }
      at::Tensor loss = Base::step(std::move(closure));
      for (size_t g = 0; g < decays.size(); ++g) {
        static_cast<torch::optim::AdamWOptions&>(this->param_groups()[g].options()).weight_decay(decays[g]);
      }
      return loss;
    } else {
      return Base::step(std::move(closure));  // (only AdamW is made so)
    }
  }

  const double lr_;  // the schedule's peak rate
  const LrSchedule schedule_;
  const bool matrices_only_;
};

// The same whose steps are counted for a schedule (ScheduledSteps).
template <typename Base, typename BaseOptions>
class Scheduled final : public Adjusted<Base, BaseOptions>, public ScheduledSteps {
 public:
  using Adjusted<Base, BaseOptions>::Adjusted;
  int64_t steps() const override { return this->steps_; }
  void set_steps(int64_t steps) override { this->steps_ = steps; }
};

// `options` made into an optimizer of type Base, scheduled where asked,
// its decay on matrices only where asked (AdamW).
template <typename Base, typename BaseOptions>
std::unique_ptr<torch::optim::Optimizer> Make(std::vector<at::Tensor> params, const BaseOptions& options,
                                              const LrSchedule& schedule, bool matrices_only = false) {
  if (schedule.scheduled()) {
    return std::make_unique<Scheduled<Base, BaseOptions>>(std::move(params), options, schedule,
                                                          matrices_only);
  }
  if (matrices_only) {
    return std::make_unique<Adjusted<Base, BaseOptions>>(std::move(params), options, schedule, true);
  }
  return std::make_unique<Base>(std::move(params), options);
}

}  // namespace

c10::Dict<std::string, double> OptionsToDict(const OptimizerOptions& o) {
  c10::Dict<std::string, double> d;
  d.insert("kind", static_cast<double>(o.kind));
  d.insert("lr", o.lr);
  d.insert("momentum", o.momentum);
  d.insert("dampening", o.dampening);
  d.insert("weight_decay", o.weight_decay);
  d.insert("nesterov", o.nesterov ? 1.0 : 0.0);
  d.insert("beta1", o.beta1);
  d.insert("beta2", o.beta2);
  d.insert("eps", o.eps);
  d.insert("amsgrad", o.amsgrad ? 1.0 : 0.0);
  d.insert("schedule", static_cast<double>(o.schedule.kind));
  d.insert("warmup_steps", static_cast<double>(o.schedule.warmup_steps));
  d.insert("decay_steps", static_cast<double>(o.schedule.decay_steps));
  d.insert("min_lr", o.schedule.min_lr);
  d.insert("decay_all", o.decay_all ? 1.0 : 0.0);
  return d;
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const c10::impl::GenericDict& options,
                                                       std::vector<at::Tensor> params) {
  auto get = [&](const char* key) { return options.at(key).toDouble(); };
  auto get_or = [&](const char* key, double otherwise) {
    return options.contains(key) ? options.at(key).toDouble() : otherwise;
  };
  LrSchedule schedule;
  schedule.kind = static_cast<LrSchedule::Kind>(static_cast<int>(get_or("schedule", 0)));
  schedule.warmup_steps = static_cast<int64_t>(get_or("warmup_steps", 0));
  schedule.decay_steps = static_cast<int64_t>(get_or("decay_steps", 0));
  schedule.min_lr = get_or("min_lr", 0);
  const auto kind = static_cast<OptimizerOptions::Kind>(static_cast<int>(get("kind")));
  switch (kind) {
    case OptimizerOptions::Kind::kSGD:
      return Make<torch::optim::SGD>(std::move(params),
                                     torch::optim::SGDOptions(get("lr"))
                                         .momentum(get("momentum"))
                                         .dampening(get("dampening"))
                                         .weight_decay(get("weight_decay"))
                                         .nesterov(get("nesterov") != 0.0),
                                     schedule);
    case OptimizerOptions::Kind::kAdam:
      return Make<torch::optim::Adam>(std::move(params),
                                      torch::optim::AdamOptions(get("lr"))
                                          .betas({get("beta1"), get("beta2")})
                                          .eps(get("eps"))
                                          .weight_decay(get("weight_decay"))
                                          .amsgrad(get("amsgrad") != 0.0),
                                      schedule);
    case OptimizerOptions::Kind::kAdamW:
      return Make<torch::optim::AdamW>(std::move(params),
                                       torch::optim::AdamWOptions(get("lr"))
                                           .betas({get("beta1"), get("beta2")})
                                           .eps(get("eps"))
                                           .weight_decay(get("weight_decay"))
                                           .amsgrad(get("amsgrad") != 0.0),
                                       schedule, get_or("decay_all", 0) == 0);
  }
  throw std::invalid_argument("unknown optimizer kind");
}

at::Tensor ArchiveBytes(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  const std::string bytes = out.str();
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

void ReadArchive(const at::Tensor& bytes, torch::serialize::InputArchive& archive) {
  const at::Tensor b = bytes.contiguous().cpu();
  std::istringstream in(std::string(static_cast<const char*>(b.data_ptr()), b.numel()));
  archive.load_from(in);
}

int64_t StateBytes(const torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  auto add = [&bytes](const at::Tensor& t) {
    if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  };
  for (const auto& [key, state] : optimizer.state()) {
    if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(state.get())) {
      add(sgd->momentum_buffer());
    } else if (auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(state.get())) {
      add(adam->exp_avg());
      add(adam->exp_avg_sq());
      add(adam->max_exp_avg_sq());
    } else if (auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state.get())) {
      add(adamw->exp_avg());
      add(adamw->exp_avg_sq());
      add(adamw->max_exp_avg_sq());
    }
  }
  return bytes;
}

std::vector<at::Tensor> OwnedParameters(const c10::IValue& rrefs, const std::string& who) {
  std::vector<at::Tensor> params;
  for (const c10::IValue& v : rrefs.toListRef()) {
    auto rref = rpc::RRef::FromIValue(v);
    if (!rref.ok() || !rref->is_owner()) {
      throw std::invalid_argument(absl::StrCat(who, ": every parameter RRef must be owned here"));
    }
    auto value = rref->local_value();
    if (!value.ok() || !value->isTensor() || !value->toTensor().requires_grad()) {
      throw std::invalid_argument(absl::StrCat(who, ": an RRef does not hold a parameter"));
    }
    params.push_back(value->toTensor());
  }
  return params;
}

absl::Status StepHere(rpc::Agent& agent, const rpc::RRef& optimizer, int64_t context_id) {
  if (!optimizer.is_owner()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stepping an optimizer on worker '", agent.self().name, "': it lives on another worker"));
  }
  ASSIGN_OR_RETURN(c10::IValue value, optimizer.local_value());
  rpc::RemoteObject* object = rpc::AsRemoteObject(value);
  if (object == nullptr || object->type() != kLocalOptimizer) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stepping an optimizer on worker '", agent.self().name, "': the RRef holds no ",
        kLocalOptimizer));
  }
  auto* container = autograd::ContainerOf(&agent);
  if (container == nullptr) return autograd::CheckEnabled(agent, "stepping an optimizer");
  auto context = container->Find(context_id);
  if (!context) {
    return absl::NotFoundError(absl::StrCat("stepping the optimizer on worker '", agent.self().name,
                                            "': unknown distributed autograd context ", context_id));
  }
  // Gradients that came GPU to GPU: their copies must have completed.
  RETURN_IF_ERROR(base::Annotate(agent.settle_cuda_receives(context_id),
                           absl::StrCat("stepping the optimizer on worker '", agent.self().name, "'")));
  base::MutexLock lock(object->mutex());  // one method of the object at a time
  try {
    object->get<LocalOptimizer>()->Step(*context);
  } catch (...) {
    return base::StatusFromCurrentException(
        absl::StrCat("the optimizer step on worker '", agent.self().name, "'"));
  }
  return absl::OkStatus();
}

absl::Status RegisterFunctions(rpc::Registry& registry) {
  return registry.RegisterModule<LocalOptimizer>(
      kLocalOptimizer,
      [](rpc::CallContext& ctx, const rpc::Args& args) {
        const auto r = rpc::DecodeCallOrThrow<MakeLocalOptimizerRequest>(args);
        if (!r.options.isGenericDict()) {
          throw std::invalid_argument(absl::StrCat(kLocalOptimizer, ": 'options' must be a dict, got a ",
                                                   r.options.tagKind()));
        }
        c10::impl::GenericList params(c10::AnyType::get());
        for (const c10::IValue& p : r.params) params.push_back(p);
        return std::make_shared<LocalOptimizer>(r.options.toGenericDict(),
                                                OwnedParameters(params, "LocalOptimizer"));
      },
      {{"state_bytes",
        [](LocalOptimizer& opt, rpc::CallContext&, const rpc::Args&) -> c10::IValue { return opt.state_bytes(); }},
       {"save_state",
        [](LocalOptimizer& opt, rpc::CallContext&, const rpc::Args&) -> c10::IValue { return opt.SaveState(); }},
       {LoadStateRequest::kMethod,
        [](LocalOptimizer& opt, rpc::CallContext&, const rpc::Args& args) -> c10::IValue {
          opt.LoadState(rpc::DecodeCallOrThrow<LoadStateRequest>(args).state);
          return c10::IValue();
        }},
       {StepRequest::kMethod, [](LocalOptimizer& opt, rpc::CallContext& ctx, const rpc::Args& args) -> c10::IValue {
          const int64_t context_id = rpc::DecodeCallOrThrow<StepRequest>(args).context;
          auto* container = autograd::ContainerOf(ctx.agent);
          if (container == nullptr) {
            throw std::runtime_error(ctx.agent == nullptr ? std::string("step: the call has no agent")
                                                          : std::string(autograd::CheckEnabled(
                                                                *ctx.agent, "stepping an optimizer").message()));
          }
          auto context = container->Find(context_id);
          if (!context) {
            throw std::invalid_argument(absl::StrCat("step: unknown distributed autograd context ", context_id));
          }
          // Gradients that came GPU to GPU: their copies must have completed.
          if (absl::Status s = ctx.agent->settle_cuda_receives(context_id); !s.ok()) {
            throw std::runtime_error(absl::StrCat("step on worker '", ctx.worker_name(), "': ", s.message()));
          }
          opt.Step(*context);
          return c10::IValue();
        }}});
}

absl::StatusOr<std::unique_ptr<DistributedOptimizer>> DistributedOptimizer::Create(
    rpc::Agent& agent, const OptimizerOptions& options, const std::vector<rpc::RRef>& params) {
  if (params.empty()) return absl::InvalidArgumentError("DistributedOptimizer: no parameters");
  std::map<std::string, std::vector<c10::IValue>> by_owner;
  for (const rpc::RRef& p : params) {
    if (!p.valid()) return absl::InvalidArgumentError("DistributedOptimizer: an empty RRef");
    by_owner[p.owner_name()].push_back(p.ToIValue());
  }
  std::vector<rpc::RRef> optimizers;
  const c10::IValue dict(OptionsToDict(options));
  for (auto& [owner, list] : by_owner) {
    ASSIGN_OR_RETURN(rpc::RRef opt, agent.remote(owner, kLocalOptimizer,
                                            rpc::EncodeCall(MakeLocalOptimizerRequest{dict, std::move(list)})));
    optimizers.push_back(opt);
  }
  // Surface construction errors now rather than at the first step.
  for (rpc::RRef& opt : optimizers) {
    RETURN_IF_ERROR(base::Annotate(opt.WaitConfirmed(), "creating the optimizer"));
  }
  return std::unique_ptr<DistributedOptimizer>(new DistributedOptimizer(std::move(optimizers)));
}

absl::StatusOr<int64_t> DistributedOptimizer::state_bytes() const {
  std::vector<rpc::Future<c10::IValue>> pending;
  for (const rpc::RRef& opt : optimizers_) pending.push_back(opt.rpc_async("state_bytes"));
  ASSIGN_OR_RETURN(std::vector<c10::IValue> values, rpc::WaitAll(pending));
  int64_t bytes = 0;
  for (const c10::IValue& v : values) bytes += v.toInt();
  return bytes;
}

absl::Status DistributedOptimizer::step(int64_t context_id) {
  std::vector<rpc::Future<c10::IValue>> steps;
  for (const rpc::RRef& opt : optimizers_) {
    steps.push_back(opt.rpc_async(StepRequest::kMethod, rpc::EncodeCall(StepRequest{context_id})));
  }
  return rpc::WaitAll(steps, [this](size_t i) {
           return absl::StrCat("stepping the optimizer on worker '", optimizers_[i].owner_name(), "'");
         }).status();
}

absl::StatusOr<std::vector<rpc::RRef>> parameter_rrefs(const rpc::RRef& module) {
  ASSIGN_OR_RETURN(c10::IValue list, module.rpc_sync("parameter_rrefs"));
  if (!list.isList()) return absl::InvalidArgumentError("parameter_rrefs did not return a list");
  std::vector<rpc::RRef> out;
  for (const c10::IValue& v : list.toListRef()) {
    ASSIGN_OR_RETURN(rpc::RRef r, rpc::RRef::FromIValue(v));
    out.push_back(r);
  }
  return out;
}

}  // namespace remora::optim
