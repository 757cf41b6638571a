// The distributed optimizer's calls, one struct each (rpc/call.h): the
// local optimizer each parameter owner holds, and its step by distributed
// autograd context. Both sides encode and decode through these structs; a
// call that does not match is an error naming the call and the field.
//
// Thread-safety: plain structs.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/ivalue.h>

#include "rpc/call.h"

namespace remora::optim {

// The module: an optimizer of `options` (OptionsToDict's) over the
// parameters (RRefs owned by the callee).
struct MakeLocalOptimizerRequest {
  static constexpr char kFunction[] = "remora.optim.LocalOptimizer";
  c10::IValue options;
  std::vector<c10::IValue> params;
  template <typename Fields>
  void Visit(Fields& f) {
    f("options", options)("params", params);
  }
};

// "step": the parameters step with the gradients accumulated in the
// distributed autograd context `context` on the callee.
struct StepRequest {
  static constexpr char kFunction[] = "remora.optim.LocalOptimizer.step";
  static constexpr char kMethod[] = "step";
  int64_t context = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("context", context);
  }
};

// "load_state": the state "save_state" gave (a local optimizer's, or the
// whole state for a ZeRO-1 gradient group: parallel/protocol.h).
struct LoadStateRequest {
  static constexpr char kFunction[] = "remora.optim.LocalOptimizer.load_state";
  static constexpr char kMethod[] = "load_state";
  c10::IValue state;
  template <typename Fields>
  void Visit(Fields& f) {
    f("state", state);
  }
};

}  // namespace remora::optim
