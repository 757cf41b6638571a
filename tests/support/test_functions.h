// Functions that only tests register: they make a worker fail or stall on
// request. Linked by tests and tests/support's test_worker, never by the
// stock worker.
//
//   raise(message): throws `message` (a remote failure)
//   sleep_ms(ms):   sleeps, then returns ms (a slow call)
//   lane_queued():  the compute turns held or waited for in the process
//   require_restart(message): Agent::RequireRestart(message) here
//   pass_threads(): the threads that ran stage type "PassThreads"(width)'s
//                   passes, as "forward|backward <name> <id>"; that stage
//                   computes x * w
//   stage type "SlowScale"(ms, width): x * w (`width` halves), each
//                   forward pass sleeping `ms` milliseconds first
//   stage type "ThrowsAbove"(limit): passes its input through, and throws
//                   when a value's magnitude is above `limit`
//   stage type "FailsInBackward"(message, width): x * w (`width` halves);
//                   its backward pass throws `message`
//   module "BackwardFails"(message): forward(x or RRef x) passes x
//                   through; its backward throws `message`
#pragma once

#include "rpc/registry.h"

namespace remora::test_support {

absl::Status RegisterTestFunctions(rpc::Registry& registry);

// The stock worker's registrations plus RegisterTestFunctions: what the
// tests' groups and test_worker offer.
absl::Status RegisterForTests(rpc::Registry& registry);

}  // namespace remora::test_support
