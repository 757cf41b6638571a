// torchvision's models exactly as a PyTorch user saves them
// (torch.jit.script(model).save(path)), cut by the master's partitioner
// into 2 and into 4 stages over two workers (and resnet18 by hand into 8)
// and trained: every batch's loss is one process's (`master --local
// --threads 1`, the same micro-batches). Skipped where Debian's
// python3-torchvision is not installed (`./run test` installs it).
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "tests/support/master_runs.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;

// torchvision.models.<name>(<args>), seeded, scripted and saved; "" where
// python3-torchvision is missing.
std::string SaveTorchvisionModel(const std::string& name, const std::string& args) {
  const std::string path = TempPath(name + ".pt");
  const std::string script = absl::StrCat(
      "/usr/bin/python3 -c 'import torch, torchvision; torch.manual_seed(0); "
      "torch.jit.script(torchvision.models.",
      name, "(", args, ")).save(\"", path, "\")' 2>/dev/null");
  return std::system(script.c_str()) == 0 ? path : "";
}

// `cuts`: each a pipeline's extra flags and its stage count.
using Cuts = std::vector<std::pair<std::vector<std::string>, int>>;

void TrainsOverWorkersAsInOneProcess(const std::string& name, const std::string& args, const Cuts& cuts) {
  const std::string model = SaveTorchvisionModel(name, args);
  if (model.empty()) GTEST_SKIP() << "no python3-torchvision (apt-get install python3-torchvision)";
  // Random 32x32 images, batches of 8 in 2 micro-batches, 10 steps, SGD.
  const std::vector<std::string> common = {"--model", model, "--image-size", "32", "--batch-size", "8",
                                           "--batches", "10", "--splits", "2", "--seed", "3", "--deterministic"};
  const std::vector<std::vector<double>> local = test_support::LocalLosses(common, name + "_local");
  ASSERT_EQ(local.size(), 1u);
  ASSERT_EQ(local[0].size(), 10u);
  for (const auto& [flags, stages] : cuts) {
    const std::string report = TempPath(absl::StrCat(name, "_", stages, ".json"));
    std::vector<std::string> args = common;
    args.insert(args.end(), flags.begin(), flags.end());
    args.insert(args.end(), {"--report", report});
    auto [code, out] = test_support::RunPipeline(2, args);
    ASSERT_EQ(code, 0) << out;
    EXPECT_THAT(out, HasSubstr(absl::StrCat("over 2 workers, ", stages, " stages"))) << out;
    const std::vector<std::vector<double>> piped = test_support::ReportLosses(ReadFile(report));
    ASSERT_EQ(piped.size(), 1u) << out;
    test_support::ExpectSameLosses(piped[0], local[0], absl::StrCat(name, " in ", stages, " stages"));
  }
}

// Also cut by hand where a stage begins with torchvision's in-place ReLU
// (the stem's, applied to the received input) and at six of its eight
// residual blocks: 8 stages, 4 a worker.
TEST(Torchvision, ResNet18AsSavedTrainsIn2And4StagesAndCutAtItsBlocksAsInOneProcess) {
  TrainsOverWorkersAsInOneProcess(
      "resnet18", "num_classes=10",
      {{{"--interleave", "1"}, 2},
       {{"--interleave", "2"}, 4},
       {{"--interleave", "4", "--split-at", "relu,layer1.1,layer2.0,layer2.1,layer3.0,layer3.1,layer4.0"}, 8}});
}

// Without its classifier's dropout: a worker draws its dropout masks from
// a generator of its own, not the one process's (so with dropout the
// pipeline's losses are its own, equal at 2 and at 4 stages).
TEST(Torchvision, MobileNetV2AsSavedTrainsIn2And4StagesAsInOneProcess) {
  TrainsOverWorkersAsInOneProcess("mobilenet_v2", "num_classes=10, dropout=0.0",
                                  {{{"--interleave", "1"}, 2}, {{"--interleave", "2"}, 4}});
}

}  // namespace
}  // namespace remora
