// worker: a remora worker process. It registers with the master, hosts
// whatever stages and modules the master asks for (examples/stock_worker.h),
// and exits 0 when the master shuts the group down. `worker --help` lists
// its flags.
#include "examples/stock_worker.h"
#include "launch/worker_main.h"

int main(int argc, char** argv) {
  remora::launch::ExitProgram(
      remora::launch::WorkerMain(argc, argv, "worker", remora::examples::RegisterStockWorker));
}
