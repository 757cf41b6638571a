#include "runtime/action_mark.h"

#include <torch/csrc/autograd/custom_function.h>

namespace remora::runtime {
namespace {

ActionMarkInfo InfoOf(const torch::autograd::AutogradContext& ctx) {
  const auto& data = ctx.saved_data;
  ActionMarkInfo info;
  info.action.context_id = data.at("context_id").toInt();
  info.action.stage = data.at("stage").toInt();
  info.action.micro_batch = data.at("mb").toInt();
  info.action.backward = true;
  info.stage = data.at("label").toStringRef();
  info.split = data.at("split").toBool();
  info.hold_tag = data.at("hold_tag").toInt();
  return info;
}

struct ActionMarkFn : public torch::autograd::Function<ActionMarkFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x,
                            const ActionMarkInfo& info) {
    ctx->saved_data["context_id"] = info.action.context_id;
    ctx->saved_data["stage"] = info.action.stage;
    ctx->saved_data["mb"] = info.action.micro_batch;
    ctx->saved_data["label"] = info.stage;
    ctx->saved_data["split"] = info.split;
    ctx->saved_data["hold_tag"] = info.hold_tag;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

}  // namespace

at::Tensor MarkAction(const at::Tensor& output, const ActionMarkInfo& info) {
  if (!output.requires_grad()) return output;
  return ActionMarkFn::apply(output, info);
}

std::optional<ActionMarkInfo> MarkedAction(const at::Tensor& root) {
  auto* node = dynamic_cast<torch::autograd::CppNode<ActionMarkFn>*>(root.grad_fn().get());
  if (node == nullptr) return std::nullopt;
  return InfoOf(node->ctx_);
}

}  // namespace remora::runtime
