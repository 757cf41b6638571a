// Distributed autograd's calls between processes, one struct each
// (rpc/call.h): a backward pass's gradients sent back to the worker that
// sent the tensors, and a context's release. Both sides encode and decode
// through these structs; a call that does not match is an error naming the
// call and the field.
//
// Thread-safety: plain structs.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/ivalue.h>

#include "rpc/call.h"

namespace remora::autograd {

// The gradients of the tensors that message `message` of context `context`
// sent (one per tensor, undefined where none reached it); the receiver runs
// the backward pass from them.
struct PropagateRequest {
  static constexpr char kFunction[] = "remora.autograd.propagate";
  int64_t context = 0;
  int64_t message = 0;
  std::vector<at::Tensor> grads;
  bool retain_graph = false;
  template <typename Fields>
  void Visit(Fields& f) {
    f("context", context)("message", message)("grads", grads)("retain_graph", retain_graph, rpc::kMayBeLeftOff);
  }
};

// Frees context `context` on the receiver.
struct ReleaseRequest {
  static constexpr char kFunction[] = "remora.autograd.release";
  int64_t context = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("context", context);
  }
};

}  // namespace remora::autograd
