// train_custom: trains TinyNet as a two-stage 1F1B pipeline over two
// custom_worker processes that it starts beside itself, with the pipeline
// library; prints the loss of every step and exits 1 if it did not fall.
#include <cstdio>

#include <ATen/ops/randn.h>

#include "autograd/dist_autograd.h"
#include "examples/builtins.h"
#include "launch/local_group.h"
#include "pipeline/pipeline.h"

int main() {
  using namespace remora;
  Registry registry;  // this process's own functions (the master's)
  if (auto s = examples::RegisterStockWorker(registry); !s.ok()) return 1;
  auto group = launch::StartLocalGroup({"w1", "w2"}, &registry, {"--threads", "1"}, {},
                                    "custom_worker");
  if (!group.ok()) {
    std::fprintf(stderr, "train_custom: %s\n", std::string(group.status().message()).c_str());
    return 1;
  }
  pipeline::PipelineOptions o;
  o.stages = {pipeline::StageSpec::Registered("TinyNet", {int64_t{8}, int64_t{32}, true}),
              pipeline::StageSpec::Registered("TinyNet", {int64_t{32}, int64_t{1}, false})};
  o.workers = {"w1", "w2"};
  o.schedule = "1f1b";
  o.micro_batches = 4;
  o.loss = pipeline::MseLoss();
  o.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);
  auto pipe = pipeline::Pipeline::Create(*group->master, o);
  if (!pipe.ok()) {
    std::fprintf(stderr, "train_custom: %s\n", std::string(pipe.status().message()).c_str());
    return 1;
  }
  const at::Tensor x = at::randn({64, 8}), y = x.sum(1, /*keepdim=*/true);  // learn the sum
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    auto loss = (*pipe)->train_step(x, y);
    if (!loss.ok()) {
      std::fprintf(stderr, "train_custom: %s\n", std::string(loss.status().message()).c_str());
      return 1;
    }
    if (step == 0) first = *loss;
    last = *loss;
    std::printf("step=%d loss=%.5f\n", step, *loss);
  }
  pipe->reset();
  if (auto s = group->Shutdown(); !s.ok()) return 1;
  std::printf("train_custom: loss %.5f -> %.5f: %s\n", first, last, last < first ? "OK" : "FAILED");
  return last < first ? 0 : 1;
}
