// Checkpoints: atomic files and CRC-32, shards, the manifest and which
// checkpoint is the latest, pruning; with real worker processes, a pipeline
// resumed from a checkpoint ends bitwise equal to one that never stopped
// (dropout included: the workers' generators are saved), corrupt and
// mismatched checkpoints are clear errors; and the real programs: a job
// whose worker is SIGKILLed is resumed with --resume and ends equal to an
// uninterrupted one.
#include "checkpoint/checkpoint.h"

#include <csignal>
#include <filesystem>
#include <fstream>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include "checkpoint/shard.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/script_models.h"
#include "tests/support/test_group.h"

namespace remora::checkpoint {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using test_support::Mlp;

const std::string kBin = REMORA_BIN_DIR;

std::string FreshDir(const std::string& name) {
  const std::string dir = TempPath(name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TrainingState At(int64_t step) {
  TrainingState s;
  s.step = step;
  return s;
}

void Overwrite(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

TEST(CheckpointFiles, AtomicWriteReplacesTheFileAndLeavesNoTemporary) {
  const std::string dir = FreshDir("atomic");
  const std::string path = dir + "/f.bin";
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  ASSERT_TRUE(WriteFileAtomically(path, std::string("sec\0ond", 7)).ok());
  EXPECT_EQ(ReadFile(path).value(), std::string("sec\0ond", 7));
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
  auto bad = WriteFileAtomically(dir + "/missing/f.bin", "x");
  EXPECT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.message()), HasSubstr("missing"));
  EXPECT_EQ(Crc32("123456789"), "cbf43926");  // the standard check value
  EXPECT_EQ(Crc32(""), "00000000");
}

TEST(CheckpointFiles, ShardsRoundTripAndCorruptionIsNamed) {
  Shard shard;
  shard.stages = {1, 3};
  shard.tensors = {{at::randn({3, 4}), at::randn({4})}, {at::randn({2})}};
  shard.rng = at::detail::getDefaultCPUGenerator().get_state();
  const std::string bytes = EncodeShard(shard);
  auto back = DecodeShard(bytes, "x.pt");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->stages, shard.stages);
  ASSERT_EQ(back->tensors.size(), 2u);
  EXPECT_TRUE(at::equal(back->tensors[0][0], shard.tensors[0][0]));
  EXPECT_TRUE(at::equal(back->tensors[1][0], shard.tensors[1][0]));
  EXPECT_FALSE(back->optimizer.defined());
  EXPECT_TRUE(at::equal(back->rng, shard.rng));

  auto garbage = DecodeShard("not a shard", "x.pt");
  EXPECT_FALSE(garbage.ok());
  EXPECT_THAT(std::string(garbage.status().message()), HasSubstr("x.pt: not a remora checkpoint shard"));

  const std::string path = FreshDir("shard") + "/shard-0.pt";
  ASSERT_TRUE(WriteFileAtomically(path, bytes).ok());
  EXPECT_TRUE(ReadShard(path, static_cast<int64_t>(bytes.size()), Crc32(bytes)).ok());
  auto short_file = ReadShard(path, static_cast<int64_t>(bytes.size()) + 1, Crc32(bytes));
  EXPECT_EQ(short_file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(short_file.status().message()), HasSubstr(path));
  std::string flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x5a;
  Overwrite(path, flipped);
  auto corrupt = ReadShard(path, static_cast<int64_t>(bytes.size()), Crc32(bytes));
  EXPECT_EQ(corrupt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(corrupt.status().message()), HasSubstr("the file is corrupt"));
}

TEST(CheckpointFiles, TheLatestIsTheNewestWithAManifest) {
  const std::string dir = FreshDir("latest");
  EXPECT_EQ(Latest(dir).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Latest(dir + "/nothing").status().code(), absl::StatusCode::kNotFound);
  wire::Manifest m;
  m.set_format(1);
  m.set_step(4);
  m.add_shards()->set_file("shard-0.pt");
  m.add_stages()->set_shard(0);
  const std::string json =
      "{\"format\": 1, \"step\": 4, \"shards\": [{\"file\": \"shard-0.pt\"}], \"stages\": [{\"shard\": 0}]}";
  fs::create_directories(dir + "/step-00000004");
  Overwrite(dir + "/step-00000004/manifest.json", json);
  fs::create_directories(dir + "/step-00000008");  // a save that crashed: no manifest
  Overwrite(dir + "/step-00000008/shard-0.pt", "partial");
  auto latest = Latest(dir);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->manifest.step(), 4);
  EXPECT_EQ(CompleteSteps(dir), std::vector<int64_t>{4});
  EXPECT_EQ(Latest(dir + "/step-00000004")->manifest.step(), 4);  // a checkpoint's own directory

  Overwrite(dir + "/step-00000004/manifest.json", "{\"format\": 1, \"step\": ");
  auto broken = Latest(dir);
  EXPECT_FALSE(broken.ok());
  EXPECT_THAT(std::string(broken.status().message()), HasSubstr("step-00000004/manifest.json"));

  Checkpoint ck;
  ck.manifest_path = "/x/manifest.json";
  ck.manifest.set_model("mlp");
  ck.manifest.set_micro_batches(2);
  RunIdentity id;
  id.model = "mlp";
  id.micro_batches = 2;
  EXPECT_TRUE(CheckMatches(ck, id).ok());
  id.model = "resnet50";
  auto mismatch = CheckMatches(ck, id);
  EXPECT_EQ(mismatch.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(mismatch.message()),
              HasSubstr("/x/manifest.json is of another run: the model was 'mlp', this run's is 'resnet50'"));
}

// A TorchScript stage whose forward drops half its activations, always:
// its results depend on the worker's generator.
pipeline::StageSpec DropoutStage(int64_t in, int64_t out) {
  torch::jit::Module m("DropoutLinear");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  m.register_parameter("weight", at::randn({in, out}, gen, at::TensorOptions()) / 3.0, false);
  m.define("def forward(self, x):\n  return torch.dropout(torch.relu(torch.matmul(x, self.weight)), 0.5, True)\n");
  return pipeline::StageSpec::TorchScript(test_support::SaveToBytes(m), "dropout.pt");
}

std::vector<pipeline::StageSpec> Stages() {
  return {DropoutStage(8, 16), test_support::MlpSpec(Mlp(16, 12, 2)),
          test_support::MlpSpec(Mlp(12, 16, 3)), test_support::MlpSpec(Mlp(16, 4, 4, false))};
}

std::unique_ptr<pipeline::Pipeline> MakePipeline(Agent& master, const std::vector<pipeline::StageSpec>& stages,
                                                 const std::string& schedule = "interleaved") {
  pipeline::PipelineOptions o;
  o.stages = stages;
  o.workers = {"w1", "w2"};
  o.schedule = schedule;
  o.micro_batches = 2;
  o.loss = pipeline::MseLoss();
  o.optimizer = optim::OptimizerOptions::Adam(0.01);
  auto pipe = pipeline::Pipeline::Create(master, o);
  EXPECT_TRUE(pipe.ok()) << pipe.status();
  return pipe.ok() ? std::move(*pipe) : nullptr;
}

std::vector<at::Tensor> AllState(pipeline::Pipeline& pipe) {
  std::vector<at::Tensor> out;
  for (int k = 0; k < pipe.num_stages(); ++k) {
    const std::vector<at::Tensor> state = pipe.stage_state(k).value();
    out.insert(out.end(), state.begin(), state.end());
  }
  return out;
}

TEST(Checkpoint, AResumedPipelineEndsBitwiseEqualToOneThatNeverStopped) {
  test_support::TestWorkers workers;
  const auto data = test_support::RandomBatches(6, 10, 8, 4);
  const std::string dir = FreshDir("resume");
  RunIdentity id;
  id.model = "dropout-mlp";
  id.micro_batches = 2;
  auto saver = Checkpointer::Create(workers.master(), dir, /*keep=*/2);
  ASSERT_TRUE(saver.ok()) << saver.status();

  // Uninterrupted: six steps, a checkpoint after each.
  auto pipe = MakePipeline(workers.master(), Stages());
  ASSERT_NE(pipe, nullptr);
  std::vector<double> losses;
  for (size_t i = 0; i < data.size(); ++i) {
    losses.push_back(pipe->train_step(data[i].first, data[i].second).value());
    ASSERT_TRUE((*saver)->Save(*pipe, Stages(), id, At(static_cast<int64_t>(i + 1))).ok());
  }
  const std::vector<at::Tensor> want = AllState(*pipe);
  EXPECT_EQ(CompleteSteps(dir), (std::vector<int64_t>{5, 6}));  // --keep 2
  const std::vector<std::vector<at::Tensor>> saved = ReadStageTensors(Latest(dir).value()).value();
  std::vector<at::Tensor> flat;
  for (const auto& s : saved) flat.insert(flat.end(), s.begin(), s.end());
  ASSERT_EQ(flat.size(), want.size());
  for (size_t j = 0; j < want.size(); ++j) EXPECT_TRUE(at::equal(flat[j], want[j])) << j;
  pipe.reset();

  // Resumed after step 5: fresh stages, the checkpoint loaded, step 6 again.
  auto ck = Latest(dir + "/step-00000005");
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_TRUE(CheckMatches(*ck, id).ok());
  auto stages = LoadStageSpecs(*ck);
  ASSERT_TRUE(stages.ok()) << stages.status();
  ASSERT_EQ(stages->size(), 4u);
  EXPECT_EQ((*stages)[0].kind, "script");
  EXPECT_EQ((*stages)[1].name, "MLPStage");
  auto resumed = MakePipeline(workers.master(), *stages);
  ASSERT_NE(resumed, nullptr);
  const std::vector<at::Tensor> fresh = AllState(*resumed);
  ASSERT_TRUE(Restore(*resumed, *ck).ok());
  EXPECT_FALSE(at::equal(AllState(*resumed)[2], fresh[2])) << "Restore loaded the trained weights";
  const double loss = resumed->train_step(data[5].first, data[5].second).value();
  EXPECT_EQ(loss, losses[5]);
  const std::vector<at::Tensor> got = AllState(*resumed);
  ASSERT_EQ(got.size(), want.size());
  for (size_t j = 0; j < want.size(); ++j) EXPECT_TRUE(at::equal(got[j], want[j])) << "tensor " << j;

  // With w1's generator moved on (an eval pass draws dropout masks), the
  // same step gives another loss: the equality above needs the saved
  // generators, not only the weights.
  auto moved = MakePipeline(workers.master(), *stages);
  ASSERT_NE(moved, nullptr);
  ASSERT_TRUE(Restore(*moved, *ck).ok());
  ASSERT_TRUE(moved->eval_step(data[0].first).ok());
  EXPECT_NE(moved->train_step(data[5].first, data[5].second).value(), losses[5]);
}

TEST(Checkpoint, CorruptOrMismatchedCheckpointsAreClearErrors) {
  test_support::TestWorkers workers;
  const std::string dir = FreshDir("corrupt");
  auto saver = Checkpointer::Create(workers.master(), dir, 3).value();
  auto pipe = MakePipeline(workers.master(), Stages());
  ASSERT_NE(pipe, nullptr);
  const auto data = test_support::RandomBatches(1, 10, 8, 4);
  pipe->train_step(data[0].first, data[0].second).value();
  ASSERT_TRUE(saver->Save(*pipe, Stages(), RunIdentity{}, At(1)).ok());
  Checkpoint ck = Latest(dir).value();
  EXPECT_EQ(ck.manifest.shards_size(), 2);
  EXPECT_EQ(ck.manifest.shards(1).worker(), "w2");
  EXPECT_EQ(ck.manifest.stages(2).shard(), 0);  // stage 2 on w1 again

  // A flipped byte in w2's shard: the error names the file and the worker.
  const std::string shard = ck.dir + "/shard-1.pt";
  std::string bytes = ReadFile(shard).value();
  bytes[bytes.size() / 3] ^= 0x11;
  Overwrite(shard, bytes);
  auto s = Restore(*pipe, ck);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("shard-1.pt has CRC-32"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("worker 'w2'"));

  // A pipeline of another shape: refused before anything is loaded.
  auto two = MakePipeline(workers.master(), {DropoutStage(8, 16), test_support::MlpSpec(Mlp(16, 4, 2, false))},
                          "1f1b");
  ASSERT_NE(two, nullptr);
  auto shape = Restore(*two, ck);
  EXPECT_EQ(shape.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(shape.message()), HasSubstr("holds 4 stages in 2 shards"));

  // A file cut short.
  fs::resize_file(ck.dir + "/model.pt", 10);
  auto specs = LoadStageSpecs(ck);
  EXPECT_EQ(specs.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(specs.status().message()), HasSubstr("model.pt has CRC-32"));
}

}  // namespace
}  // namespace remora::checkpoint
