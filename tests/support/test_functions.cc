#include "tests/support/test_functions.h"

#include <pthread.h>

#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/TensorOperators.h>
#include <ATen/ops/full.h>
#include <torch/csrc/autograd/custom_function.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "examples/demo_functions.h"
#include "pipeline/stage.h"
#include "rpc/rref_args.h"
#include "runtime/compute_lane.h"

namespace remora::test_support {
namespace {

// Identity in forward; its backward throws the message.
struct FailInBackward : public torch::autograd::Function<FailInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x,
                            std::string message) {
    ctx->saved_data["message"] = message;
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    throw std::runtime_error(ctx->saved_data["message"].toStringRef());
  }
};

struct BackwardFails {
  std::string message;
};

// The threads that ran a "PassThreads" stage's passes in this process, as
// "forward|backward <thread name> <thread id>".
struct PassThreadLog {
  absl::Mutex mu;
  std::set<std::string> seen ABSL_GUARDED_BY(mu);

  static PassThreadLog& Get() {
    static PassThreadLog* log = new PassThreadLog;  // never destroyed
    return *log;
  }
  void Add(const char* pass) {
    char name[16] = {};
    pthread_getname_np(pthread_self(), name, sizeof(name));
    base::MutexLock lock(mu);
    seen.insert(absl::StrCat(pass, " ", name, " ", pthread_self()));
  }
};

// Identity in forward; its backward logs its thread.
struct LogBackwardThread : public torch::autograd::Function<LogBackwardThread> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    PassThreadLog::Get().Add("backward");
    return grads;
  }
};

// x * w (w: `width` halves), logging the thread of each pass.
class PassThreads final : public pipeline::StageModule {
 public:
  explicit PassThreads(int64_t width) : w_(at::full({width}, 0.5).requires_grad_()) {}
  c10::IValue Forward(const c10::IValue& input) override {
    PassThreadLog::Get().Add("forward");
    return LogBackwardThread::apply(input.toTensor() * w_);
  }
  std::vector<at::Tensor> Parameters() override { return {w_}; }
  std::vector<at::Tensor> Buffers() override { return {}; }
  void Train(bool) override {}

 private:
  at::Tensor w_;
};

// Identity that throws when an input's magnitude is above `limit`: a
// worker's own computation failing on some rows while its process lives.
class ThrowsAbove final : public pipeline::StageModule {
 public:
  explicit ThrowsAbove(double limit) : limit_(limit) {}
  c10::IValue Forward(const c10::IValue& input) override {
    const at::Tensor x = input.toTensor();
    if (x.abs().max().item<double>() > limit_) {
      throw std::runtime_error(absl::StrCat("ThrowsAbove: an input above ", limit_, " in magnitude"));
    }
    return x;
  }
  std::vector<at::Tensor> Parameters() override { return {}; }
  std::vector<at::Tensor> Buffers() override { return {}; }
  void Train(bool) override {}

 private:
  double limit_;
};

// x * w (w: `width` halves), whose backward pass throws `message`.
class FailsInBackward final : public pipeline::StageModule {
 public:
  FailsInBackward(std::string message, int64_t width)
      : message_(std::move(message)), w_(at::full({width}, 0.5).requires_grad_()) {}
  c10::IValue Forward(const c10::IValue& input) override {
    return FailInBackward::apply(input.toTensor() * w_, message_);
  }
  std::vector<at::Tensor> Parameters() override { return {w_}; }
  std::vector<at::Tensor> Buffers() override { return {}; }
  void Train(bool) override {}

 private:
  std::string message_;
  at::Tensor w_;
};

// x * w (w: `width` halves), each forward pass `ms` milliseconds long: a
// pass that is still running when its batch fails elsewhere.
class SlowScale final : public pipeline::StageModule {
 public:
  SlowScale(int64_t ms, int64_t width) : ms_(ms), w_(at::full({width}, 0.5).requires_grad_()) {}
  c10::IValue Forward(const c10::IValue& input) override {
    absl::SleepFor(absl::Milliseconds(ms_));
    return input.toTensor() * w_;
  }
  std::vector<at::Tensor> Parameters() override { return {w_}; }
  std::vector<at::Tensor> Buffers() override { return {}; }
  void Train(bool) override {}

 private:
  int64_t ms_;
  at::Tensor w_;
};

absl::Status RegisterStageTypes() {
  RETURN_IF_ERROR(pipeline::RegisterStageType(
      "SlowScale", [](const std::vector<c10::IValue>& a, c10::Device) -> std::unique_ptr<pipeline::StageModule> {
        return std::make_unique<SlowScale>(a.at(0).toInt(), a.at(1).toInt());
      }));
  RETURN_IF_ERROR(pipeline::RegisterStageType(
      "PassThreads", [](const std::vector<c10::IValue>& a, c10::Device) -> std::unique_ptr<pipeline::StageModule> {
        return std::make_unique<PassThreads>(a.at(0).toInt());
      }));
  RETURN_IF_ERROR(pipeline::RegisterStageType(
      "FailsInBackward", [](const std::vector<c10::IValue>& a, c10::Device) -> std::unique_ptr<pipeline::StageModule> {
        return std::make_unique<FailsInBackward>(a.at(0).toStringRef(), a.at(1).toInt());
      }));
  return pipeline::RegisterStageType(
      "ThrowsAbove", [](const std::vector<c10::IValue>& a, c10::Device) -> std::unique_ptr<pipeline::StageModule> {
        return std::make_unique<ThrowsAbove>(a.at(0).toDouble());
      });
}

}  // namespace

absl::Status RegisterTestFunctions(rpc::Registry& r) {
  RETURN_IF_ERROR(r.RegisterModule<BackwardFails>(
      "BackwardFails",
      [](rpc::CallContext&, const rpc::Args& a) {
        return std::make_shared<BackwardFails>(BackwardFails{a[0].toStringRef()});
      },
      {{"forward", [](BackwardFails& m, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
          return FailInBackward::apply(rpc::TensorOrFetch(a[0]), m.message);
        }}}));
  RETURN_IF_ERROR(r.RegisterFunction("raise", [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
    throw std::runtime_error(a.size() > 0 ? a[0].toStringRef() : "raised on request");
  }));
  // settled_sum(tensor, group): (its sum, read on the host once the group's
  // stream-ordered receives are settled; how many receives this process
  // left to its stream so far).
  RETURN_IF_ERROR(r.RegisterFunction("settled_sum", [](rpc::CallContext& ctx, const rpc::Args& a) -> c10::IValue {
    const at::Tensor sum = a[0].toTensor().sum();  // queued behind the copy
    if (absl::Status s = ctx.agent->settle_cuda_receives(a[1].toInt()); !s.ok()) {
      throw std::runtime_error(std::string(s.message()));
    }
    return c10::ivalue::Tuple::create({sum.item<double>(), ctx.agent->cuda_stats().stream_ordered});
  }));
  RETURN_IF_ERROR(r.RegisterFunction("lane_queued", [](rpc::CallContext&, const rpc::Args&) -> c10::IValue {
    return runtime::ComputeTurn::Queued();
  }));
  RETURN_IF_ERROR(r.RegisterFunction("require_restart", [](rpc::CallContext& ctx, const rpc::Args& a) -> c10::IValue {
    ctx.agent->RequireRestart(absl::FailedPreconditionError(a[0].toStringRef()));
    return c10::IValue();
  }));
  RETURN_IF_ERROR(r.RegisterFunction("pass_threads", [](rpc::CallContext&, const rpc::Args&) -> c10::IValue {
    PassThreadLog& log = PassThreadLog::Get();
    base::MutexLock lock(log.mu);
    return std::vector<std::string>(log.seen.begin(), log.seen.end());
  }));
  // prompt() / not_prompt(): whether the call ran as a prompt function on
  // the thread that received it (CallContext::prompt); only the first is
  // marked prompt.
  for (const char* name : {"prompt", "not_prompt"}) {
    RETURN_IF_ERROR(r.RegisterFunction(name, [](rpc::CallContext& ctx, const rpc::Args&) -> c10::IValue {
      return ctx.prompt;
    }));
  }
  RETURN_IF_ERROR(r.MarkPrompt("prompt"));
  // Once per process: tests start several agents in one.
  static const absl::Status stage_types = RegisterStageTypes();
  RETURN_IF_ERROR(stage_types);
  return r.RegisterFunction("sleep_ms", [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
    absl::SleepFor(absl::Milliseconds(a[0].toInt()));
    return a[0];
  });
}

absl::Status RegisterForTests(rpc::Registry& registry) {
  RETURN_IF_ERROR(examples::RegisterDemoWorker(registry));
  return RegisterTestFunctions(registry);
}

}  // namespace remora::test_support
