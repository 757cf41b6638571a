#include "tests/support/test_functions.h"

#include <stdexcept>
#include <string>

#include "absl/time/clock.h"
#include "base/status_util.h"
#include "examples/builtins.h"

namespace remora::test_support {

absl::Status RegisterTestFunctions(Registry& r) {
  RETURN_IF_ERROR(r.RegisterFunction("raise", [](CallContext&, const Args& a) -> c10::IValue {
    throw std::runtime_error(a.size() > 0 ? a[0].toStringRef() : "raised on request");
  }));
  return r.RegisterFunction("sleep_ms", [](CallContext&, const Args& a) -> c10::IValue {
    absl::SleepFor(absl::Milliseconds(a[0].toInt()));
    return a[0];
  });
}

absl::Status RegisterForTests(Registry& registry) {
  RETURN_IF_ERROR(examples::RegisterStockWorker(registry));
  return RegisterTestFunctions(registry);
}

}  // namespace remora::test_support
