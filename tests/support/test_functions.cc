#include "tests/support/test_functions.h"

#include <stdexcept>
#include <string>

#include <torch/csrc/autograd/custom_function.h>

#include "absl/time/clock.h"
#include "base/status_util.h"
#include "examples/demo_functions.h"
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

}  // namespace

absl::Status RegisterTestFunctions(Registry& r) {
  RETURN_IF_ERROR(r.RegisterModule<BackwardFails>(
      "BackwardFails",
      [](CallContext&, const Args& a) {
        return std::make_shared<BackwardFails>(BackwardFails{a[0].toStringRef()});
      },
      {{"forward", [](BackwardFails& m, CallContext&, const Args& a) -> c10::IValue {
          return FailInBackward::apply(TensorOrFetch(a[0]), m.message);
        }}}));
  RETURN_IF_ERROR(r.RegisterFunction("raise", [](CallContext&, const Args& a) -> c10::IValue {
    throw std::runtime_error(a.size() > 0 ? a[0].toStringRef() : "raised on request");
  }));
  // settled_sum(tensor, group): (its sum, read on the host once the group's
  // stream-ordered receives are settled; how many receives this process
  // left to its stream so far).
  RETURN_IF_ERROR(r.RegisterFunction("settled_sum", [](CallContext& ctx, const Args& a) -> c10::IValue {
    const at::Tensor sum = a[0].toTensor().sum();  // queued behind the copy
    if (absl::Status s = ctx.agent->settle_cuda_receives(a[1].toInt()); !s.ok()) {
      throw std::runtime_error(std::string(s.message()));
    }
    return c10::ivalue::Tuple::create({sum.item<double>(), ctx.agent->cuda_stats().stream_ordered});
  }));
  RETURN_IF_ERROR(r.RegisterFunction("lane_queued", [](CallContext&, const Args&) -> c10::IValue {
    return ComputeTurn::Queued();
  }));
  return r.RegisterFunction("sleep_ms", [](CallContext&, const Args& a) -> c10::IValue {
    absl::SleepFor(absl::Milliseconds(a[0].toInt()));
    return a[0];
  });
}

absl::Status RegisterForTests(Registry& registry) {
  RETURN_IF_ERROR(examples::RegisterDemoWorker(registry));
  return RegisterTestFunctions(registry);
}

}  // namespace remora::test_support
