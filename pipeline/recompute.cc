#include "pipeline/recompute.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/List.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>
#include <torch/version.h>

#include "autograd/split_backward.h"

namespace remora::pipeline {
namespace {

// The tensors in `value`, in MapTensors' order; and `value` with them
// replaced by `tensors`, in that order.
std::vector<at::Tensor> TensorsIn(const c10::IValue& value) {
  std::vector<at::Tensor> out;
  MapTensors(value, [&out](const at::Tensor& t) {
    out.push_back(t);
    return t;
  });
  return out;
}
c10::IValue WithTensors(const c10::IValue& value, const std::vector<at::Tensor>& tensors) {
  size_t next = 0;
  return MapTensors(value, [&](const at::Tensor&) { return tensors.at(next++); });
}

// One recomputed forward pass: the module and its input's layout (what
// the node keeps besides the input's tensors), and the output's layout
// (set by the forward).
struct RecomputedPass {
  StageModule* module;
  c10::IValue input;   // the layout: tensors replaced by empty ones
  c10::IValue output;  // the same, of the output
  bool bf16 = false;   // under Bf16Autocast
};

// The recomputed pass of a split backward between its B and its W (kept
// in the node's context: it goes with the node).
struct HeldPass : torch::CustomClassHolder {
  std::unique_ptr<autograd::SplitBackward> pass;
};

// Puts into `out`, after the `n` inputs' places, the gradients that
// `held_value` (ctx's "held", which it drops) holds.
void TakeHeldWeights(torch::autograd::AutogradContext* ctx,
                     c10::IValue held_value, size_t n,
                     torch::autograd::variable_list& out) {
  // W of a split backward: the parameters' gradients of B's pass.
  auto pass = held_value.toCapsule();
  ctx->saved_data.erase("held");
  auto dw = static_cast<HeldPass*>(pass.get())->pass->Weights();
  if (!dw.ok()) throw std::runtime_error(std::string(dw.status().message()));
  for (size_t i = 0; i < dw->size(); ++i) out[n + i] = (*dw)[i];
}

// Runs `module`'s forward again on `inputs` with autograd's graph, as the
// first pass ran it (`ctx`'s generator state and bf16), and puts the
// module's buffers back afterwards; returns the output's tensors.
std::vector<at::Tensor> RerunForward(torch::autograd::AutogradContext* ctx,
                                     StageModule* module,
                                     const std::vector<at::Tensor>& inputs) {
  std::vector<at::Tensor> buffers;
  {
    at::NoGradGuard no_grad;
    for (const at::Tensor& b : module->Buffers()) buffers.push_back(b.clone());
  }
  std::vector<at::Tensor> outputs;
  {
    // (The generator as the first pass found it, for dropout's masks;
    // then as it was. CUDA's generators are not kept: a stage on a GPU
    // that draws random numbers draws others the second time.)
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    at::Tensor now;
    {
      std::lock_guard<std::mutex> rng_lock(generator.mutex());
      now = generator.get_state();
      generator.set_state(ctx->saved_data["rng"].toTensor());
    }
    at::AutoGradMode grad(true);
    Bf16Autocast autocast(ctx->saved_data["bf16"].toBool());  // (this thread is autograd's)
    outputs = TensorsIn(module->Forward(WithTensors(ctx->saved_data["input"], inputs)));
    std::lock_guard<std::mutex> rng_lock(generator.mutex());
    generator.set_state(now);
  }
  // (In place but unseen by autograd: the graph just made saved a batch
  // norm's running statistics, and a copy_ into them would fail its
  // backward as a change after the save.)
  const std::vector<at::Tensor> live = module->Buffers();
  for (size_t i = 0; i < live.size() && i < buffers.size(); ++i) live[i].set_data(buffers[i]);
  return outputs;
}

// Puts into `out` the gradients of `roots` (given `root_grads`) with
// respect to those of `inputs` and `params` that require them.
void GradientsOfAll(const std::vector<at::Tensor>& roots,
                    const std::vector<at::Tensor>& root_grads,
                    const std::vector<at::Tensor>& inputs,
                    const std::vector<at::Tensor>& params,
                    torch::autograd::variable_list& out) {
  std::vector<at::Tensor> wrt;
  std::vector<size_t> where;  // the node's input each of wrt is
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].requires_grad()) wrt.push_back(inputs[i]), where.push_back(i);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].requires_grad()) wrt.push_back(params[i]), where.push_back(inputs.size() + i);
  }
  if (wrt.empty()) return;
  const auto found = torch::autograd::grad(roots, wrt, root_grads, /*retain_graph=*/false,
                                           /*create_graph=*/false, /*allow_unused=*/true);
  for (size_t k = 0; k < found.size(); ++k) out[where[k]] = found[k];
}

// A stage's forward pass as one autograd node: the forward runs without
// autograd's graph and the node keeps only the pass's inputs (and the CPU
// generator's state); its backward runs the forward again with the graph
// (the module's buffers put back afterwards: a batch norm counts the batch
// once) and takes the gradients through it. torch.utils.checkpoint's
// reentrant form, but with the parameters as inputs of the node, so that
// their gradients reach the distributed autograd context as any leaf's do.
//
// Under a split backward (zero-bubble schedules) autograd runs the node
// twice: for B, wanting only its inputs' gradients, and for W, wanting
// only the parameters'. B runs the forward again, splits the backward of
// that graph (autograd/split_backward.h) and keeps it in the node; W takes
// the parameters' gradients from it: the forward is recomputed once.
class Recompute : public torch::autograd::Function<Recompute> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                at::TensorList params, int64_t pass_address) {
    auto* pass = reinterpret_cast<RecomputedPass*>(static_cast<intptr_t>(pass_address));
    {
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> rng_lock(generator.mutex());
      ctx->saved_data["rng"] = generator.get_state();
    }
    ctx->saved_data["module"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(pass->module));
    ctx->saved_data["input"] = pass->input;
    ctx->saved_data["bf16"] = pass->bf16;
    ctx->save_for_backward(inputs.vec());
    // (A copy: a module may write its input in place, which must stay
    // as it came for the second pass.)
    std::vector<at::Tensor> copies;
    for (const at::Tensor& t : inputs) copies.push_back(t.clone());
    const c10::IValue y = pass->module->Forward(WithTensors(pass->input, copies));
    std::vector<at::Tensor> outputs = TensorsIn(y);
    pass->output = MapTensors(y, [](const at::Tensor&) { return at::empty({0}); });
    torch::autograd::variable_list integers;
    for (const at::Tensor& t : outputs) {
      if (!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type())) integers.push_back(t);
    }
    if (!integers.empty()) ctx->mark_non_differentiable(integers);
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* module = reinterpret_cast<StageModule*>(static_cast<intptr_t>(ctx->saved_data["module"].toInt()));
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    const std::vector<at::Tensor> params = module->Parameters();
    const size_t n = saved.size();
    // One gradient a node input (the inputs' tensors, the parameters, then
    // the pass's address).
    torch::autograd::variable_list out(n + params.size() + 1);
    bool want_inputs = false, want_params = false, params_need = false;
    for (size_t i = 0; i < n; ++i) want_inputs |= ctx->needs_input_grad(i);
    for (size_t i = 0; i < params.size(); ++i) {
      want_params |= ctx->needs_input_grad(n + i);
      params_need |= params[i].requires_grad();
    }
    if (auto held = ctx->saved_data.find("held"); held != ctx->saved_data.end()) {
      TakeHeldWeights(ctx, held->second, n, out);
      return out;
    }
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& t : saved) inputs.push_back(t.detach().requires_grad_(t.requires_grad()));
    const std::vector<at::Tensor> outputs = RerunForward(ctx, module, inputs);
    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size() && i < grads.size(); ++i) {
      if (grads[i].defined() && outputs[i].requires_grad()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (roots.empty()) return out;
    if (want_inputs && !want_params && params_need) {
      // B of a split backward: the inputs' gradients now, the rest kept
      // for W.
      auto held = c10::make_intrusive<HeldPass>();
      held->pass = std::make_unique<autograd::SplitBackward>(roots, root_grads, inputs, params);
      auto dx = held->pass->Inputs();
      if (!dx.ok()) throw std::runtime_error(std::string(dx.status().message()));
      for (size_t i = 0; i < n; ++i) out[i] = (*dx)[i];
      ctx->saved_data["held"] = c10::IValue::make_capsule(std::move(held));
      return out;
    }
    GradientsOfAll(roots, root_grads, inputs, params, out);
    return out;
  }
};

}  // namespace

c10::IValue MapTensors(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor&)>& fn) {
  if (value.isTensor()) return fn(value.toTensor());
  if (value.isTuple()) {
    std::vector<c10::IValue> out;
    for (const auto& e : value.toTupleRef().elements()) out.push_back(MapTensors(e, fn));
    return c10::ivalue::Tuple::create(std::move(out));
  }
  if (value.isTensorList()) {
    c10::List<at::Tensor> out;
    const c10::List<at::Tensor> in = value.toTensorList();
    for (size_t i = 0; i < in.size(); ++i) out.push_back(fn(in.get(i)));
    return out;
  }
  return value;
}

c10::IValue RecomputedForward(StageModule& module, const c10::IValue& x, bool bf16) {
  RecomputedPass pass{&module, MapTensors(x, [](const at::Tensor&) { return at::empty({0}); }), c10::IValue(),
                      bf16};
  Bf16Autocast autocast(bf16);
  const std::vector<at::Tensor> inputs = TensorsIn(x);
  const std::vector<at::Tensor> params = module.Parameters();
  const torch::autograd::variable_list outputs =
      Recompute::apply(at::TensorList(inputs), at::TensorList(params),
                       static_cast<int64_t>(reinterpret_cast<intptr_t>(&pass)));
  return WithTensors(pass.output, outputs);
}

// LibTorch 2.4 on names autocast's switches by device; 1.13 by function.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
Bf16Autocast::Bf16Autocast(bool on) : on_(on) {
  if (!on_) return;
  cpu_was_ = at::autocast::is_autocast_enabled(at::kCPU);
  cuda_was_ = at::autocast::is_autocast_enabled(at::kCUDA);
  cpu_dtype_was_ = at::autocast::get_autocast_dtype(at::kCPU);
  cuda_dtype_was_ = at::autocast::get_autocast_dtype(at::kCUDA);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  at::autocast::increment_nesting();
}

Bf16Autocast::~Bf16Autocast() {
  if (!on_) return;
  // (The weights' bf16 copies are kept while autocast is on: dropped at
  // the outermost end.)
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(at::kCPU, cpu_was_);
  at::autocast::set_autocast_enabled(at::kCUDA, cuda_was_);
  at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype_was_);
  at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype_was_);
}
#else
Bf16Autocast::Bf16Autocast(bool on) : on_(on) {
  if (!on_) return;
  cpu_was_ = at::autocast::is_cpu_enabled();
  cuda_was_ = at::autocast::is_enabled();
  cpu_dtype_was_ = at::autocast::get_autocast_cpu_dtype();
  cuda_dtype_was_ = at::autocast::get_autocast_gpu_dtype();
  at::autocast::set_cpu_enabled(true);
  at::autocast::set_enabled(true);
  at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
  at::autocast::set_autocast_gpu_dtype(at::kBFloat16);
  at::autocast::increment_nesting();
}

Bf16Autocast::~Bf16Autocast() {
  if (!on_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_cpu_enabled(cpu_was_);
  at::autocast::set_enabled(cuda_was_);
  at::autocast::set_autocast_cpu_dtype(cpu_dtype_was_);
  at::autocast::set_autocast_gpu_dtype(cuda_dtype_was_);
}
#endif

c10::IValue ToBf16(const c10::IValue& value) {
  return MapTensors(value, [](const at::Tensor& t) {
    return t.defined() && t.scalar_type() == at::kFloat ? t.to(at::kBFloat16) : t;
  });
}

c10::IValue ToFloat32(const c10::IValue& value) {
  return MapTensors(value, [](const at::Tensor& t) {
    return t.defined() && t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t;
  });
}

}  // namespace remora::pipeline
