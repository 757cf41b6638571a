// test_worker: the stock worker plus the test-only functions (raise,
// sleep_ms) of tests/support/test_functions.h, for multi-process tests.
#include "launch/worker_main.h"
#include "tests/support/test_functions.h"

int main(int argc, char** argv) {
  return remora::launch::WorkerMain(argc, argv, "test_worker",
                                    remora::test_support::RegisterForTests);
}
