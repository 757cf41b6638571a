// What the pipeline, partition and data-parallel suites share: real worker
// processes beside a master in the test's process, MLP stages and random
// batches, and the same MLP trained in one process as the reference.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "launch/local_group.h"
#include "shards/mlp.h"
#include "shards/protocol.h"
#include "pipeline/pipeline.h"

namespace remora::test_support {

// Workers w1 .. wn (the stock worker, one intra-op thread each) and a
// master in this process. The destructor shuts the group down and expects
// it to go cleanly, unless the test killed a worker (ExpectUncleanShutdown:
// then the workers still running are killed after a second).
class TestWorkers {
 public:
  // `program`: the workers' program, "worker" or "test_worker" (which
  // also offers tests/support/test_functions.h's functions), and its
  // environment; `args`: more of its flags (e.g. --device cuda:0).
  explicit TestWorkers(int n = 2, const launch::WorkerProgram& program = "worker",
                       const std::vector<std::string>& args = {});
  ~TestWorkers();
  TestWorkers(const TestWorkers&) = delete;
  TestWorkers& operator=(const TestWorkers&) = delete;

  rpc::Agent& master() { return *group_.master; }
  launch::Subprocess& worker(int i) { return *group_.workers[i]; }
  void ExpectUncleanShutdown() { clean_ = false; }

 private:
  rpc::Registry registry_;
  launch::LocalGroup group_;
  bool clean_ = true;
};

shards::MLPStageOptions Mlp(int64_t in, int64_t out, int64_t seed, bool relu = true);
pipeline::StageSpec MlpSpec(const shards::MLPStageOptions& o);  // "MLPStage"
// The built-in GPT's parts [first, last) as one stage ("Gpt"), sized as
// `shape` says (its first and last are these).
pipeline::StageSpec GptPart(shards::GptArgs shape, int64_t first, int64_t last);
// A small GPT's shape: vocabulary 64, windows of 16, d-model 32, 4 heads,
// 2 layers, seed 5, embedding and head tied.
shards::GptArgs SmallGpt();

// Every stage's parameters then buffers, stage by stage (the whole model's
// state, for comparing runs).
std::vector<at::Tensor> AllStageState(pipeline::Pipeline& pipe);

// `steps` (inputs [rows, in], targets [rows, out]) pairs, seeded.
std::vector<std::pair<at::Tensor, at::Tensor>> RandomBatches(int steps, int rows, int in, int out);

// The requests sent between two counts (pipeline::MessagesBetween) less
// the ones that go by the clock, not by the step: the workers' heartbeat
// to the master (remora.wire.Ping) and the master's liveness probe
// (remora.pipeline.alive), one a second each, so a slow step has more.
std::map<std::string, int64_t> StepMessagesBetween(const std::map<std::string, int64_t>& before,
                                                   const std::map<std::string, int64_t>& after);

// max |a - b| / max |b|.
double RelativeError(const at::Tensor& a, const at::Tensor& b);

// The MLP stages trained in one process on whole batches, with MSE and
// SGD (lr 0.05, momentum 0.9): each step's loss and, per stage, its
// parameters then buffers after the last step. With `clip_grad_norm`
// above 0, each step's gradients are clipped to it over the whole model
// (torch::nn::utils::clip_grad_norm_), whose norms before clipping are kept.
struct LocalRun {
  std::vector<double> losses;
  std::vector<std::vector<at::Tensor>> state;
  std::vector<double> norms;  // with clip_grad_norm
};
LocalRun TrainMlpLocally(const std::vector<shards::MLPStageOptions>& stages,
                         const std::vector<std::pair<at::Tensor, at::Tensor>>& data, double clip_grad_norm = 0);

// A learnable toy IDX dataset in `dir` (master --dataset idx:DIR): class c
// is a bright 6x6 square at one of ten places, on noise.
void WriteToyIdx(const std::string& dir, int train, int test);

}  // namespace remora::test_support
