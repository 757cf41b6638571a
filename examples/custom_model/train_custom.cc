// train_custom CHECKPOINT_DIR [--resume CHECKPOINT_DIR/step-00000012]: trains
// TinyNet, cut into two stages, as two pipeline replicas on four custom_worker
// processes it starts beside itself, on remora's train/ layer: epochs over a
// toy set, the test accuracy after each, a checkpoint every 4 steps.
#include <cstdio>
#include <iostream>
#include <string>
#include <ATen/Context.h>
#include <ATen/ops/randn.h>

#include "launch/local_group.h"
#include "train/fit.h"
#include "train/pipeline_trainer.h"
#include "train/worker_functions.h"

using namespace remora;

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "train_custom: %s\n", std::string(s.message()).c_str());
  return 1;
}

// The toy task: is the sum of 8 features positive?
data::Dataset Toy(int64_t rows) {
  const at::Tensor x = at::randn({rows, 8});
  return {x, x.sum(1).gt(0).to(at::kLong)};
}

int main(int argc, char** argv) {
  const char* usage =
      "usage: train_custom CHECKPOINT_DIR [--resume CHECKPOINT]\n\n"
      "Trains TinyNet, cut into two stages, as two pipeline replicas on four custom_worker processes it\n"
      "starts beside itself (custom_worker must be in this program's directory); a checkpoint every 4\n"
      "steps into CHECKPOINT_DIR; --resume goes on from one of them (CHECKPOINT_DIR/step-N).\n";
  if (argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf("%s", usage);
    return 0;
  }
  if ((argc != 2 && !(argc == 4 && std::string(argv[2]) == "--resume")) || argv[1][0] == '-') {
    std::fprintf(stderr, "%s", usage);
    return 2;
  }
  Registry registry;  // this process's own functions (the master's)
  if (auto s = train::RegisterWorkerFunctions(registry); !s.ok()) return Fail(s);
  auto group = launch::StartLocalGroup({"w1", "w2", "w3", "w4"}, &registry, {"--threads", "1"}, {}, "custom_worker");
  if (!group.ok()) return Fail(group.status());
  parallel::DataParallelOptions o;
  o.pipeline.stages = {pipeline::StageSpec::Registered("TinyNet", {int64_t{8}, int64_t{32}, true}),
                       pipeline::StageSpec::Registered("TinyNet", {int64_t{32}, int64_t{2}, false})};
  o.pipeline.workers = {"w1", "w2", "w3", "w4"};  // replica r on workers 2r and 2r + 1
  o.pipeline.schedule = "1f1b";
  o.pipeline.micro_batches = 4;
  o.pipeline.loss = pipeline::CrossEntropyLoss();
  o.pipeline.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);
  o.replicas = 2;
  auto trainer = train::PipelineTrainer::Create(*group->master, o);
  if (!trainer.ok()) return Fail(trainer.status());
  at::manual_seed(0);
  const data::Dataset train_set = Toy(256), test_set = Toy(128);
  train::TrainOptions t;
  t.fit.epochs = 3;
  t.fit.batch_size = 32;
  t.fit.min_batch_rows = 8;  // a row per micro-batch of each replica
  t.fit.on_step = [](const pipeline::StepRecord& r) {
    std::printf("step=%lld loss=%.9g\n", static_cast<long long>(r.step), r.loss);
  };
  t.checkpoints = {argv[1], /*keep=*/10, {"tiny-net 8-32-2", "toy 256/32", "sgd 0.05 0.9", "1f1b", 4, 2}};
  t.checkpoint_every = 4;
  if (argc == 4) {
    auto ck = checkpoint::Latest(argv[3]);
    if (!ck.ok()) return Fail(ck.status());
    t.resume = *ck;
  }
  auto epochs = train::Fit(**trainer, data::InMemory(train_set), data::InMemory(test_set), t, std::cout);
  trainer->reset();
  if (auto s = group->Shutdown(); !s.ok()) return Fail(s);
  if (!epochs.ok()) return Fail(epochs.status());
  std::printf("train_custom: test accuracy %.3f\n", epochs->back().test_accuracy);
  return epochs->back().test_accuracy > 0.7 ? 0 : 1;
}
