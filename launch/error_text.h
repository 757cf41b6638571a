// Error text for people: a TorchScript interpreter's traceback cut down to
// PyTorch's own message and the source line it marks.
//
//   std::cerr << "master: " << (verbose ? s.message() : launch::WithoutTorchScriptTraceback(s.message()));
//
// Thread-safety: a pure function.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace remora::launch {

// `message` with each TorchScript traceback in it (from "The following
// operation failed in the TorchScript interpreter." or "Traceback of
// TorchScript" to the message that ends it) replaced by that message and
// the innermost source line the traceback marks, and a pointer to
// --verbose:
//
//   stage 1 on worker 'w2': RuntimeError: mat1 and mat2 shapes cannot be
//   multiplied (2x3 and 4x5) (at `return torch.linear(input, weight,
//   bias)`; --verbose shows the TorchScript traceback)
//
// What comes before and after a traceback stays. A message without one
// comes back unchanged.
std::string WithoutTorchScriptTraceback(absl::string_view message);

}  // namespace remora::launch
