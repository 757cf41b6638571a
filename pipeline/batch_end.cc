#include "pipeline/batch_end.h"

#include <cmath>
#include <map>
#include <memory>
#include <tuple>
#include <utility>

#include <ATen/TensorOperators.h>
#include <ATen/ops/clamp_max.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/core/GradMode.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "autograd/container.h"
#include "autograd/dist_autograd.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "pipeline/protocol.h"
#include "trace/trace.h"

namespace remora::pipeline {
namespace {

// How long a worker waits for the other workers' messages: they send theirs
// as their own part of the batch ends; a worker that failed is the
// master's to find, which then abandons the batch (waking the wait).
constexpr absl::Duration kMailTimeout = absl::Minutes(5);

enum class Kind { kGradNorm, kTiedGrad };

// What came for each (kind, runner, batch), and the batches abandoned.
struct Mail {
  absl::Mutex mu;
  struct Entry {
    std::vector<c10::IValue> values;
    bool abandoned = false;
  };
  std::map<std::tuple<Kind, int64_t, int64_t>, Entry> by_batch ABSL_GUARDED_BY(mu);
};

Mail& TheMail() {
  static Mail* mail = new Mail;  // never destroyed
  return *mail;
}

void Post(Kind kind, int64_t runner, int64_t context, c10::IValue value) {
  Mail& mail = TheMail();
  base::MutexLock lock(mail.mu);
  mail.by_batch[{kind, runner, context}].values.push_back(std::move(value));
}

// Waits for `want` values of `kind` for the batch and takes them; `where`
// and `what` name the wait in an error.
absl::StatusOr<std::vector<c10::IValue>> Await(Kind kind, int64_t runner, int64_t context, size_t want,
                                               const std::string& where, const std::string& what) {
  Mail& mail = TheMail();
  const std::tuple<Kind, int64_t, int64_t> key{kind, runner, context};
  base::MutexLock lock(mail.mu);
  auto arrived = [&mail, &key, want]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mail.mu) {
    const Mail::Entry& e = mail.by_batch[key];
    return e.abandoned || e.values.size() >= want;
  };
  const bool in_time = mail.mu.AwaitWithTimeout(absl::Condition(&arrived), kMailTimeout);
  Mail::Entry e = std::move(mail.by_batch[key]);
  mail.by_batch.erase(key);
  if (e.abandoned) return absl::AbortedError(absl::StrCat(where, ": the batch was abandoned"));
  if (!in_time) {
    return absl::DeadlineExceededError(absl::StrCat(where, ": ", want - e.values.size(), " of ", want, " ", what,
                                                    " did not come within ", absl::FormatDuration(kMailTimeout)));
  }
  return std::move(e.values);
}

std::shared_ptr<autograd::DistContext> ContextHere(rpc::Agent& agent, int64_t context) {
  auto* container = autograd::ContainerOf(&agent);
  return container != nullptr ? container->Find(context) : nullptr;
}

}  // namespace

absl::Status SumTiedGradients(rpc::Agent& agent, int64_t runner, const TiedCopies& tied, int64_t context) {
  trace::Scope scope("tied", -1);
  const std::string where = absl::StrCat("summing the tied weight's gradients of batch ", context, " on worker '",
                                         agent.self().name, "'");
  auto dist = ContextHere(agent, context);
  if (!dist) return absl::NotFoundError(absl::StrCat(where, ": unknown distributed autograd context"));
  at::Tensor first = tied.first.defined() ? dist->Gradient(tied.first) : at::Tensor();
  at::Tensor last = tied.last.defined() ? dist->Gradient(tied.last) : at::Tensor();
  if (!tied.first.defined() || !tied.last.defined()) {
    // The other copy is on another worker: one message each way.
    const bool first_here = tied.first.defined();
    const at::Tensor& mine = first_here ? first : last;
    TiedGradRequest r{runner, context, first_here ? 0 : tied.last_stage,
                      mine.defined() ? c10::IValue(mine) : c10::IValue()};
    agent.rpc_async(first_here ? tied.last_worker : tied.first_worker, TiedGradRequest::kFunction,
                    rpc::EncodeCall(r));
    ASSIGN_OR_RETURN(std::vector<c10::IValue> came,
                     Await(Kind::kTiedGrad, runner, context, 1, where, "the other copy's gradients"));
    at::Tensor theirs = came.front().isTensor() ? came.front().toTensor() : at::Tensor();
    const at::Tensor& here = first_here ? tied.first : tied.last;
    if (theirs.defined()) {
      if (theirs.sizes() != here.sizes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": the copies differ in shape (", c10::str(here.sizes()), " here, ", c10::str(theirs.sizes()),
            " on worker '", first_here ? tied.last_worker : tied.first_worker,
            "'): tie a weight of one shape on the first and the last stage"));
      }
      theirs = theirs.to(here.device());
    }
    (first_here ? last : first) = theirs;
  }
  if (!first.defined() && !last.defined()) return absl::OkStatus();
  c10::NoGradGuard no_grad;
  const at::Tensor sum = !first.defined() ? last.clone() : !last.defined() ? first.clone() : first + last;
  if (tied.first.defined()) dist->SetGradient(tied.first, sum);
  if (tied.last.defined()) dist->SetGradient(tied.last, tied.first.defined() ? sum.clone() : sum);
  return absl::OkStatus();
}

absl::StatusOr<double> ClipGradients(rpc::Agent& agent, int64_t runner, const std::vector<std::string>& peers,
                                     int64_t context, double max_norm, const at::Tensor& counted_elsewhere) {
  trace::Scope scope("clip", -1);
  const std::string where = absl::StrCat("clipping the gradients of batch ", context, " on worker '",
                                         agent.self().name, "'");
  auto dist = ContextHere(agent, context);
  if (!dist) return absl::NotFoundError(absl::StrCat(where, ": unknown distributed autograd context"));
  const auto grads = dist->Gradients();
  double mine = 0;
  {
    c10::NoGradGuard no_grad;
    for (const auto& [param, grad] : grads) {
      if (!grad.defined() || (counted_elsewhere.defined() && param.is_same(counted_elsewhere))) continue;
      const double n = grad.norm().item<double>();  // (each in its dtype, as PyTorch's)
      mine += n * n;
    }
  }
  for (const std::string& peer : peers) {
    // (Not waited for: the peers' shares are what this worker waits for.)
    agent.rpc_async(peer, GradNormRequest::kFunction, rpc::EncodeCall(GradNormRequest{runner, context, mine}));
  }
  ASSIGN_OR_RETURN(std::vector<c10::IValue> shares,
                   Await(Kind::kGradNorm, runner, context, peers.size(), where, "the other workers' shares of the norm"));
  double total = mine;
  for (const c10::IValue& share : shares) total += share.toDouble();
  // As clip_grad_norm_: the coefficient in the gradients' float, at most 1.
  const double norm = std::sqrt(total);
  c10::NoGradGuard no_grad;
  const at::Tensor coef = (max_norm / (at::scalar_tensor(norm, at::kFloat) + 1e-6)).clamp_max(1.0);
  if (coef.item<float>() < 1.0f) {
    for (const auto& [param, grad] : grads) {
      if (grad.defined()) dist->SetGradient(param, grad * coef.to(grad.device()));
    }
  }
  return norm;
}

void AbandonBatchEnd(int64_t runner, int64_t context) {
  Mail& mail = TheMail();
  base::MutexLock lock(mail.mu);
  for (Kind kind : {Kind::kGradNorm, Kind::kTiedGrad}) mail.by_batch[{kind, runner, context}].abandoned = true;
}

absl::Status RegisterBatchEndFunctions(rpc::Registry& registry) {
  RETURN_IF_ERROR(
      registry.RegisterFunction(GradNormRequest::kFunction, [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
        const auto r = rpc::DecodeCallOrThrow<GradNormRequest>(a);
        Post(Kind::kGradNorm, r.runner, r.context, r.squared);
        return c10::IValue();
      }));
  return registry.RegisterFunction(TiedGradRequest::kFunction,
                                   [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
                                     auto r = rpc::DecodeCallOrThrow<TiedGradRequest>(a);
                                     Post(Kind::kTiedGrad, r.runner, r.context, std::move(r.grad));
                                     return c10::IValue();
                                   });
}

}  // namespace remora::pipeline
