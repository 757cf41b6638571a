// train_custom CHECKPOINT_DIR [--resume CHECKPOINT_DIR/step-00000012]: trains
// TinyNet, cut into two stages, as two pipeline replicas on four custom_worker
// processes it starts beside itself, on remora's train/ layer: epochs over a
// toy set, the test accuracy after each, a checkpoint every 4 steps.
//
// docs/writing-your-own-master.md ("A master, in short") quotes this file
// from the first #include to the end of Train(); a test checks that it does
// (Docs.WritingYourOwnMasterQuotesWhatCiBuilds), so edit both together.
#include <cstdio>
#include <iostream>
#include <string>

#include <ATen/Context.h>
#include <ATen/ops/randn.h>

#include "base/status_util.h"        // RETURN_IF_ERROR, ASSIGN_OR_RETURN
#include "checkpoint/checkpoint.h"   // checkpoint::Latest
#include "data/source.h"             // data::InMemory (data/datasets.h: data::Dataset)
#include "launch/local_group.h"      // launch::StartLocalGroup, LocalGroupOptions
#include "parallel/data_parallel.h"  // parallel::DataParallelOptions
#include "pipeline/pipeline.h"       // pipeline::StageSpec, CrossEntropyLoss
#include "train/fit.h"               // train::TrainOptions, train::Fit, train::StepRecord
#include "train/pipeline_trainer.h"  // train::PipelineTrainer
#include "train/worker_functions.h"  // train::RegisterWorkerFunctions

using namespace remora;

// The toy task: is the sum of 8 features positive?
data::Dataset Toy(int64_t rows) {
  const at::Tensor x = at::randn({rows, 8});
  return {x, x.sum(1).gt(0).to(at::kLong)};
}

// Trains, checkpoints into `checkpoint_dir`, and goes on from the
// checkpoint `resume` when it is not empty.
absl::Status Train(const std::string& checkpoint_dir, const std::string& resume) {
  // 1. The master's own functions, registered before its agent starts.
  rpc::Registry registry;
  RETURN_IF_ERROR(train::RegisterWorkerFunctions(registry));

  // 2. The master (this process) and four workers beside it: the program
  // custom_worker from this program's directory. StartLocalGroup enables
  // distributed autograd on the master and returns once all have joined.
  // (A cluster: Agent::Start, autograd::Enable, Join; see below.)
  // Ports of your choice: g.master.listen_address = "127.0.0.1:29500" and
  // g.worker_addresses = {"127.0.0.1:29501", ...} (one per worker); by
  // default free ones.
  launch::LocalGroupOptions g;
  g.program = "custom_worker";
  g.worker_args = {"--threads", "1"};
  ASSIGN_OR_RETURN(launch::LocalGroup group, launch::StartLocalGroup({"w1", "w2", "w3", "w4"}, &registry, g));

  // 3. The trainer: TinyNet cut into two stages, two replicas of the pipeline.
  parallel::DataParallelOptions o;
  o.pipeline.stages = {pipeline::StageSpec::Registered("TinyNet", {int64_t{8}, int64_t{32}, true}),
                       pipeline::StageSpec::Registered("TinyNet", {int64_t{32}, int64_t{2}, false})};
  o.pipeline.workers = {"w1", "w2", "w3", "w4"};  // replica r on workers 2r and 2r + 1
  o.pipeline.schedule = "1f1b";
  o.pipeline.micro_batches = 4;
  o.pipeline.loss = pipeline::CrossEntropyLoss();
  o.pipeline.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);
  o.replicas = 2;
  ASSIGN_OR_RETURN(auto trainer, train::PipelineTrainer::Create(*group.master, std::move(o)));

  // 4. The loop: epochs, checkpoints, resume.
  at::manual_seed(0);
  const data::Dataset train_set = Toy(256), test_set = Toy(128);
  train::TrainOptions t;
  t.fit.epochs = 3;
  t.fit.batch_size = 32;
  t.fit.min_batch_rows = 8;  // a row per micro-batch of each replica
  train::FitFunctions print;  // (or an observer class of one's own: train::FitObserver)
  print.step = [](const train::StepRecord& r) {
    std::printf("step=%lld loss=%.9g\n", static_cast<long long>(r.step), r.loss);
  };
  t.observers = {&print};
  t.checkpoints = {checkpoint_dir, /*keep=*/10, {"tiny-net 8-32-2", "toy 256/32", "sgd 0.05 0.9", "1f1b", 4, 2}};
  t.checkpoint_every = 4;
  if (!resume.empty()) {
    ASSIGN_OR_RETURN(t.resume, checkpoint::Latest(resume));
  }
  ASSIGN_OR_RETURN(auto epochs, train::Fit(*trainer, data::InMemory(train_set), data::InMemory(test_set), t,
                                           std::cout));

  // 5. The end: the trainer first (its stages live on the workers), then
  // the group; every worker exits 0. (An early return above ends the group
  // too, as LocalGroup goes.)
  trainer.reset();
  RETURN_IF_ERROR(group.Shutdown());
  std::printf("train_custom: test accuracy %.3f\n", epochs.back().test_accuracy);
  if (epochs.back().test_accuracy <= 0.7) return absl::InternalError("the test accuracy is 0.7 or less");
  return absl::OkStatus();
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
  if (absl::Status s = Train(argv[1], argc == 4 ? argv[3] : ""); !s.ok()) {
    std::fprintf(stderr, "train_custom: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
