// The named losses (pipeline.h's LossFn, RegisterLoss): the process's
// table, with "mse", "cross_entropy" and "causal_lm" in it from the start.
#include <map>
#include <string>
#include <utility>

#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/mse_loss.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "pipeline/pipeline.h"

namespace remora::pipeline {

namespace {

// The process's named losses.
struct LossTable {
  absl::Mutex mu;
  std::map<std::string, LossFn::Fn> fns ABSL_GUARDED_BY(mu);
};

LossTable& Losses() {
  static LossTable* table = [] {
    auto* t = new LossTable;  // never destroyed
    base::MutexLock lock(t->mu);
    t->fns["mse"] = [](const c10::IValue& out, const c10::IValue& target) {
      return at::mse_loss(out.toTensor(), target.toTensor());
    };
    t->fns["cross_entropy"] = [](const c10::IValue& out, const c10::IValue& target) {
      return at::cross_entropy_loss(out.toTensor(), target.toTensor());
    };
    // (CausalLmLoss: pipeline.h.)
    t->fns["causal_lm"] = [](const c10::IValue& out, const c10::IValue& target) {
      const at::Tensor logits = out.toTensor();
      return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), target.toTensor().reshape({-1}));
    };
    return t;
  }();
  return *table;
}

}  // namespace

LossFn LossFn::Named(const std::string& name) {
  LossTable& table = Losses();
  base::MutexLock lock(table.mu);
  auto it = table.fns.find(name);
  if (it == table.fns.end()) return LossFn();
  LossFn loss(it->second);
  loss.name_ = name;
  return loss;
}

absl::StatusOr<at::Tensor> LossFn::Compute(const c10::IValue& output, const c10::IValue& target) const {
  try {
    return fn_(output, target);
  } catch (...) {
    auto shape = [](const c10::IValue& v) {
      return v.isTensor() ? absl::StrCat("[", absl::StrJoin(v.toTensor().sizes(), ", "), "]") : v.tagKind();
    };
    return base::StatusFromCurrentException(
        absl::StrCat("the loss", name_.empty() ? "" : absl::StrCat(" '", name_, "'"), " of an output of ",
                     shape(output), " against targets of ", shape(target)));
  }
}

absl::Status RegisterLoss(const std::string& name, LossFn::Fn fn) {
  if (name.empty() || !fn) return absl::InvalidArgumentError("RegisterLoss: a name and a function");
  LossTable& table = Losses();
  base::MutexLock lock(table.mu);
  if (!table.fns.emplace(name, std::move(fn)).second) {
    return absl::AlreadyExistsError(absl::StrCat("a loss named '", name, "' is already registered"));
  }
  return absl::OkStatus();
}

LossFn MseLoss() { return LossFn::Named("mse"); }
LossFn CrossEntropyLoss() { return LossFn::Named("cross_entropy"); }
LossFn CausalLmLoss() { return LossFn::Named("causal_lm"); }

}  // namespace remora::pipeline
