// Pieces of an optimizer state dict of one parameter group (PyTorch's
// layout, optim/distributed_optimizer.h's OptimizerStateDict), for code
// that renumbers parameters: a ZeRO-1 group's shares (parallel/) and a
// checkpoint written again for another cut (checkpoint/relayout.cc).
//
// Thread-compatible free functions.
#pragma once

#include <cstdint>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

namespace remora::optim {

// The one parameter group of state dict `dict`: its options with its
// "params"; throws std::invalid_argument naming `what` when `dict` is not
// a state dict of one group.
c10::impl::GenericDict OneParamGroup(const c10::IValue& dict, const char* what);

// {"state": state, "param_groups": [the group `options` (a group dict, or
// None: no options) with "params" 0 ... n - 1]}.
c10::IValue OneGroupStateDict(const c10::impl::GenericDict& state, const c10::IValue& options, int64_t n);

}  // namespace remora::optim
