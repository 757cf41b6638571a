// custom_worker: what a training group's worker offers, plus the stage type
// "TinyNet" (in, out, relu), which this project defines. Start it as `worker`
// is started; train_custom starts four beside itself.
#include "launch/worker_main.h"
#include "pipeline/stage.h"
#include "rpc/call.h"
#include "tiny_net.h"
#include "train/worker_functions.h"

// TinyNet's arguments, named and typed (rpc/call.h): a call that does not
// match is an error naming the field, not a crash.
struct TinyNetArgs {
  static constexpr char kFunction[] = "TinyNet";
  int64_t in = 0;
  int64_t out = 0;
  bool relu = true;
  template <typename Fields>
  void Visit(Fields& f) {
    f("in", in)("out", out)("relu", relu);
  }
};

absl::Status Register(remora::rpc::Registry& registry) {
  static const absl::Status registered = remora::pipeline::RegisterStageModule<TinyNetImpl>(
      TinyNetArgs::kFunction, [](const std::vector<c10::IValue>& a, c10::Device) {
        const auto r = remora::rpc::DecodeCallOrThrow<TinyNetArgs>(a);
        return std::make_shared<TinyNetImpl>(r.in, r.out, r.relu);
      });
  if (!registered.ok()) return registered;
  return remora::train::RegisterWorkerFunctions(registry);
}

int main(int argc, char** argv) {
  remora::launch::ExitProgram(remora::launch::WorkerMain(argc, argv, "custom_worker", Register));
}
