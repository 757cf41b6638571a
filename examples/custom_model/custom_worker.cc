// custom_worker: what a training group's worker offers, plus the stage type
// "TinyNet" (in, out, relu), which this project defines. Start it as `worker`
// is started; train_custom starts four beside itself.
#include "launch/worker_main.h"
#include "pipeline/stage.h"
#include "tiny_net.h"
#include "train/worker_functions.h"

absl::Status Register(remora::Registry& registry) {
  static const absl::Status registered = remora::pipeline::RegisterStageModule<TinyNetImpl>(
      "TinyNet", [](const std::vector<c10::IValue>& a, c10::Device) {
        return std::make_shared<TinyNetImpl>(a.at(0).toInt(), a.at(1).toInt(), a.at(2).toBool());
      });
  if (!registered.ok()) return registered;
  return remora::train::RegisterWorkerFunctions(registry);
}

int main(int argc, char** argv) {
  remora::launch::ExitProgram(remora::launch::WorkerMain(argc, argv, "custom_worker", Register));
}
