#include "pipeline/grad_clip.h"

#include <cmath>
#include <map>
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
#include "pipeline/protocol.h"
#include "runtime/trace.h"

namespace remora::pipeline {
namespace {

// How long a worker waits for the other workers' shares: they send theirs
// as their own part of the batch ends; a worker that failed is the
// master's to find, which then abandons the batch (waking the wait).
constexpr absl::Duration kShareTimeout = absl::Minutes(5);

// The shares that came for each (runner, batch), and the batches abandoned.
struct Shares {
  absl::Mutex mu;
  struct Entry {
    double squared = 0;
    int count = 0;
    bool abandoned = false;
  };
  std::map<std::pair<int64_t, int64_t>, Entry> by_batch ABSL_GUARDED_BY(mu);
};

Shares& TheShares() {
  static Shares* shares = new Shares;  // never destroyed
  return *shares;
}

}  // namespace

absl::StatusOr<double> ClipGradients(Agent& agent, int64_t runner, const std::vector<std::string>& peers,
                                     int64_t context, double max_norm) {
  trace::Scope scope("clip", -1);
  const std::string where = absl::StrCat("clipping the gradients of batch ", context, " on worker '",
                                         agent.self().name, "'");
  auto* container = dist_autograd::ContainerOf(&agent);
  auto dist = container != nullptr ? container->Find(context) : nullptr;
  if (!dist) return absl::NotFoundError(absl::StrCat(where, ": unknown distributed autograd context"));
  const auto grads = dist->Gradients();
  double mine = 0;
  {
    c10::NoGradGuard no_grad;
    for (const auto& [param, grad] : grads) {
      if (!grad.defined()) continue;
      const double n = grad.norm().item<double>();  // (each in its dtype, as PyTorch's)
      mine += n * n;
    }
  }
  for (const std::string& peer : peers) {
    // (Not waited for: the peers' shares are what this worker waits for.)
    agent.rpc_async(peer, GradNormRequest::kFunction, EncodeCall(GradNormRequest{runner, context, mine}));
  }
  double total = mine;
  {
    Shares& shares = TheShares();
    const std::pair<int64_t, int64_t> key{runner, context};
    const int want = static_cast<int>(peers.size());
    MutexLock lock(shares.mu);
    auto arrived = [&shares, &key, want]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(shares.mu) {
      const Shares::Entry& e = shares.by_batch[key];
      return e.abandoned || e.count >= want;
    };
    const bool in_time = shares.mu.AwaitWithTimeout(absl::Condition(&arrived), kShareTimeout);
    const Shares::Entry e = shares.by_batch[key];
    shares.by_batch.erase(key);
    if (e.abandoned) return absl::AbortedError(absl::StrCat(where, ": the batch was abandoned"));
    if (!in_time) {
      return absl::DeadlineExceededError(absl::StrCat(where, ": ", want - e.count, " of the other ", want,
                                                      " workers' shares of the norm did not come within ",
                                                      absl::FormatDuration(kShareTimeout)));
    }
    total += e.squared;
  }
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

void AbandonGradNorm(int64_t runner, int64_t context) {
  Shares& shares = TheShares();
  MutexLock lock(shares.mu);
  shares.by_batch[{runner, context}].abandoned = true;
}

absl::Status RegisterGradNormFunction(Registry& registry) {
  return registry.RegisterFunction(GradNormRequest::kFunction, [](CallContext&, const Args& a) -> c10::IValue {
    const auto r = DecodeCallOrThrow<GradNormRequest>(a);
    Shares& shares = TheShares();
    MutexLock lock(shares.mu);
    Shares::Entry& e = shares.by_batch[{r.runner, r.context}];
    e.squared += r.squared;
    ++e.count;
    return c10::IValue();
  });
}

}  // namespace remora::pipeline
