// rpc_demo: the smallest end-to-end remora run. A master and two local
// workers exchange calls and RRefs, including the canonical pipeline where
// the master's input RRef goes to worker1 and worker1's result RRef goes to
// worker2, which fetches it from worker1.
#include <iostream>
#include <string>
#include <vector>

#include <ATen/ops/allclose.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>

#include "launch/local_group.h"
#include "examples/demo_functions.h"
#include "launch/worker_main.h"
#include "runtime/allocator.h"

namespace {

template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::cerr << "rpc_demo: " << what << " failed: " << v.status().message() << "\n";
    std::exit(1);
  }
  return std::move(*v);
}

// rpc_sync and rpc_async of a registered function on both workers.
void Calls(remora::rpc::Agent& agent, const std::vector<std::string>& names) {
  using namespace remora;
  at::Tensor x = at::ones({2, 3});
  auto sum = Check(agent.rpc_sync(names[0], "add", {x, x}), "rpc_sync add");
  std::cout << "rpc_sync(" << names[0] << ", add, ones+ones) sum = "
            << sum.toTensor().sum().item<double>() << "\n";

  std::vector<rpc::Future<c10::IValue>> futures;
  for (int i = 0; i < 8; ++i) {
    futures.push_back(agent.rpc_async(names[i % 2], "add", {int64_t{i}, int64_t{i}}));
  }
  int64_t total = 0;
  for (auto& f : futures) total += Check(f.wait(), "rpc_async").toInt();
  std::cout << "8 rpc_async calls over both workers, total = " << total << "\n";

}

// The canonical pipeline, as in PyTorch's distributed pipeline example:
// the master's input RRef goes to worker1's stage, whose result RRef goes
// to worker2's stage; then a remote failure.
void Pipeline(remora::rpc::Agent& agent, const std::vector<std::string>& names) {
  using namespace remora;
  rpc::RRef stage1 = Check(agent.remote(names[0], "Affine", {int64_t{8}, int64_t{16}, int64_t{1}}),
                      "remote Affine");
  rpc::RRef stage2 = Check(agent.remote(names[1], "Affine", {int64_t{16}, int64_t{4}, int64_t{2}}),
                      "remote Affine");
  at::Tensor input = at::randn({5, 8});
  rpc::RRef x_rref = agent.local_rref(input);
  rpc::RRef y_rref = Check(stage1.remote("forward", {x_rref}), "stage1.remote(forward)");
  at::Tensor z = Check(stage2.rpc_sync("forward", {y_rref}), "stage2.rpc_sync(forward)").toTensor();
  at::Tensor w1 = Check(stage1.rpc_sync("weight"), "weight").toTensor();
  at::Tensor w2 = Check(stage2.rpc_sync("weight"), "weight").toTensor();
  at::Tensor expected = at::matmul(at::matmul(input, w1.t()), w2.t());
  std::cout << "pipeline " << names[0] << " -> " << names[1] << ": output " << z.sizes()
            << ", matches local computation: " << (at::allclose(z, expected, 1e-5, 1e-6) ? "yes" : "NO")
            << "\n";

  // A stage fed a string instead of a tensor: the worker's exception comes
  // back as the caller's error, naming the worker.
  auto err = stage2.rpc_sync("forward", {std::string("not a tensor")});
  std::cout << "a failing remote function reports: " << err.status().message() << "\n";

}

}  // namespace

int main(int argc, char** argv) {
  using namespace remora;
  if (examples::IsDemoWorker(argc, argv)) launch::ExitProgram(examples::DemoWorkerMain(argc, argv, "rpc_demo"));
  std::string workers = "worker1,worker2";
  launch::FlagParser flags("rpc_demo",
                        "Starts two local workers (this program again, as `rpc_demo worker --name N ...`) "
                        "and exchanges calls and RRefs with them.");
  flags.AddString("workers", &workers, "names of the two workers to start");
  flags.StartsItsOwnGroup();
  launch::TlsFiles tls_files;
  flags.AddTlsFlags(&tls_files);
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  auto tls = launch::LoadTls(tls_files);
  if (!tls.ok()) {
    std::cerr << "rpc_demo: " << tls.status().message() << "\n";
    return 2;
  }
  runtime::TuneAllocator();
  auto names = launch::SplitList(workers);
  if (names.size() != 2 || names[0] == names[1]) {
    std::cerr << "rpc_demo: --workers wants exactly two distinct names, e.g. worker1,worker2\n";
    return 2;
  }
  rpc::Registry registry;
  if (auto s = examples::RegisterDemoWorker(registry); !s.ok()) {
    std::cerr << "rpc_demo: " << s.message() << "\n";
    return 1;
  }
  std::cout << "starting master and workers " << workers << " (" << rpc::TlsModeName(*tls) << ")\n";
  rpc::AgentOptions options;
  options.tls = *tls;
  auto group = Check(launch::StartLocalGroup(names, &registry, tls_files.WorkerArgs(), options,
                                             examples::DemoWorkerProgram("rpc_demo")),
                     "starting the group");
  rpc::Agent& agent = *group.master;
  for (const auto& w : agent.workers()) {
    std::cout << "  id " << w.id << "  " << w.name << " at " << w.address << "\n";
  }

  Calls(agent, names);
  Pipeline(agent, names);  // its RRefs are dropped when it returns
  // Then every owner table is checked at shutdown.
  if (auto s = group.Shutdown(); !s.ok()) {
    std::cerr << "rpc_demo: shutdown: " << s.message() << "\n";
    return 1;
  }
  std::cout << "shut down cleanly\n";
  return 0;
}
