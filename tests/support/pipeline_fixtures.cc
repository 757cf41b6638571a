#include "tests/support/pipeline_fixtures.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <gtest/gtest.h>
#include <torch/types.h>  // (the torch:: functions clip_grad.h calls)
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/sgd.h>

#include "tests/support/test_functions.h"

namespace remora::test_support {

TestWorkers::TestWorkers(int n, const launch::WorkerProgram& program,
                         const std::vector<std::string>& args) {
  EXPECT_TRUE(RegisterForTests(registry_).ok());
  std::vector<std::string> names;
  for (int i = 1; i <= n; ++i) names.push_back("w" + std::to_string(i));
  std::vector<std::string> flags = {"--threads", "1"};
  flags.insert(flags.end(), args.begin(), args.end());
  auto g = launch::StartLocalGroup(names, &registry_, flags, {}, program);
  EXPECT_TRUE(g.ok()) << g.status();
  if (g.ok()) group_ = std::move(*g);
}

TestWorkers::~TestWorkers() {
  // After an unclean end the test has often shut the master down itself,
  // so nothing can tell the workers left to stop and they would wait out
  // their 10 s without a master: they get a second, then are killed.
  absl::Status s = group_.Shutdown(clean_ ? absl::Seconds(30) : absl::Seconds(1));
  if (clean_) {
    EXPECT_TRUE(s.ok()) << s;
  }
}

shards::MLPStageOptions Mlp(int64_t in, int64_t out, int64_t seed, bool relu) {
  shards::MLPStageOptions o;
  o.in = in;
  o.out = out;
  o.seed = seed;
  o.relu = relu;
  return o;
}

pipeline::StageSpec MlpSpec(const shards::MLPStageOptions& o) {
  if (o.batchnorm) return pipeline::StageSpec::Registered("MLPStage", {o.in, o.out, o.seed, o.relu, true});
  return pipeline::StageSpec::Registered("MLPStage", {o.in, o.out, o.seed, o.relu});
}

shards::GptArgs SmallGpt() {
  shards::GptArgs shape;
  shape.vocab = 64;
  shape.seq_len = 16;
  shape.d_model = 32;
  shape.heads = 4;
  shape.layers = 2;
  shape.seed = 5;
  shape.tie = 1;
  return shape;
}

pipeline::StageSpec GptPart(shards::GptArgs shape, int64_t first, int64_t last) {
  shape.first = first;
  shape.last = last;
  return pipeline::StageSpec::Registered(shards::GptArgs::kFunction, rpc::EncodeCall(shape));
}

std::vector<at::Tensor> AllStageState(pipeline::Pipeline& pipe) {
  std::vector<at::Tensor> out;
  for (int k = 0; k < pipe.num_stages(); ++k) {
    const std::vector<at::Tensor> state = pipe.stage_state(k).value();
    out.insert(out.end(), state.begin(), state.end());
  }
  return out;
}

std::vector<std::pair<at::Tensor, at::Tensor>> RandomBatches(int steps, int rows, int in, int out) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (int i = 0; i < steps; ++i) {
    data.emplace_back(at::randn({rows, in}, gen, at::TensorOptions()),
                      at::randn({rows, out}, gen, at::TensorOptions()));
  }
  return data;
}

std::map<std::string, int64_t> StepMessagesBetween(const std::map<std::string, int64_t>& before,
                                                   const std::map<std::string, int64_t>& after) {
  std::map<std::string, int64_t> sent = pipeline::MessagesBetween(before, after);
  for (const char* by_the_clock : {"remora.wire.Ping", "function 'remora.pipeline.alive'"}) sent.erase(by_the_clock);
  return sent;
}

double RelativeError(const at::Tensor& a, const at::Tensor& b) {
  const double scale = std::max(b.abs().max().item<double>(), 1e-12);
  return (a - b).abs().max().item<double>() / scale;
}

LocalRun TrainMlpLocally(const std::vector<shards::MLPStageOptions>& stages,
                         const std::vector<std::pair<at::Tensor, at::Tensor>>& data, double clip_grad_norm) {
  std::vector<torch::nn::Sequential> local;
  std::vector<at::Tensor> params;
  for (const auto& s : stages) {
    local.push_back(shards::MakeMLPStage(s));
    for (const auto& p : local.back()->parameters()) params.push_back(p);
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05).momentum(0.9));
  LocalRun run;
  for (const auto& [x, t] : data) {
    opt.zero_grad();
    at::Tensor y = x;
    for (auto& m : local) y = m->forward(y);
    at::Tensor l = at::mse_loss(y, t);
    l.backward();
    if (clip_grad_norm > 0) run.norms.push_back(torch::nn::utils::clip_grad_norm_(params, clip_grad_norm));
    opt.step();
    run.losses.push_back(l.item<double>());
  }
  for (auto& m : local) run.state.push_back(shards::ModuleState(*m));
  return run;
}

void WriteToyIdx(const std::string& dir, int train, int test) {
  std::filesystem::create_directories(dir);
  auto be = [](std::string* out, uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out->push_back(static_cast<char>((v >> s) & 0xff));
  };
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  for (auto [prefix, n] : {std::pair<std::string, int>{"train", train}, {"t10k", test}}) {
    std::string images, labels;
    be(&images, 2051), be(&images, n), be(&images, 28), be(&images, 28);
    be(&labels, 2049), be(&labels, n);
    at::Tensor noise = at::randint(0, 60, {n, 28, 28}, gen, at::TensorOptions(at::kByte));
    for (int i = 0; i < n; ++i) {
      const int c = i % 10, r = 2 + (c / 5) * 14, col = 2 + (c % 5) * 5;
      noise[i].slice(0, r, r + 6).slice(1, col, col + 6).fill_(250);
      labels.push_back(static_cast<char>(c));
    }
    images.append(static_cast<const char*>(noise.data_ptr()), n * 28 * 28);
    std::ofstream(dir + "/" + prefix + "-images-idx3-ubyte", std::ios::binary) << images;
    std::ofstream(dir + "/" + prefix + "-labels-idx1-ubyte", std::ios::binary) << labels;
  }
}

}  // namespace remora::test_support
