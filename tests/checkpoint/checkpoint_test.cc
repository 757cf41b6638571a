// Checkpoints: atomic files and CRC-32, owner files, the manifest and which
// checkpoint is the latest, pruning; with real worker processes, a pipeline
// resumed from a checkpoint ends bitwise equal to one that never stopped
// (dropout included: the workers' generators are saved), corrupt and
// mismatched checkpoints are clear errors; and the real programs: a job
// whose worker is SIGKILLed is resumed with --resume and ends equal to an
// uninterrupted one.
#include "checkpoint/checkpoint.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/max.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/api/module.h>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "checkpoint/owner_file.h"
#include "proto/checkpoint.pb.h"
#include "tests/support/master_runs.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/script_models.h"
#include "tests/support/test_group.h"

namespace remora::checkpoint {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using test_support::AllStageState;
using test_support::CompareStages;
using test_support::FreshDir;
using test_support::LineStarting;
using test_support::MasterArgv;
using test_support::Mlp;
using test_support::StageDifference;
using test_support::StartWorkers;


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

TEST(CheckpointFiles, OwnerFilesRoundTripAndCorruptionIsNamed) {
  OwnerFile owned;
  owned.stages = {1, 3};
  owned.tensors = {{at::randn({3, 4}), at::randn({4})}, {at::randn({2})}};
  owned.names = {{"fc.weight", "fc.bias"}, {"bn.running_mean"}};
  owned.rng = at::detail::getDefaultCPUGenerator().get_state();
  owned.cuda_rng = CudaGeneratorStates();  // one per device on a GPU machine; none here
  const std::string bytes = EncodeOwnerFile(owned);
  auto back = DecodeOwnerFile(bytes, "x.pt");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->stages, owned.stages);
  ASSERT_EQ(back->tensors.size(), 2u);
  EXPECT_TRUE(at::equal(back->tensors[0][0], owned.tensors[0][0]));
  EXPECT_TRUE(at::equal(back->tensors[1][0], owned.tensors[1][0]));
  EXPECT_EQ(back->names, owned.names);
  EXPECT_TRUE(back->optimizer.isNone());
  EXPECT_EQ(EncodeOwnerFile(*back), bytes) << "the same state, the same bytes";
  EXPECT_TRUE(at::equal(back->rng, owned.rng));
  // The CUDA generators' states travel in the owner file too, and load back
  // into the generators (on a machine without GPUs, two made-up states
  // travel, and setting them sets nothing).
  ASSERT_EQ(back->cuda_rng.size(), owned.cuda_rng.size());
  if (owned.cuda_rng.empty()) {
    owned.cuda_rng = {at::randint(255, {16}).to(at::kByte), at::randint(255, {16}).to(at::kByte)};
  }
  auto with_cuda = DecodeOwnerFile(EncodeOwnerFile(owned), "y.pt");
  ASSERT_TRUE(with_cuda.ok()) << with_cuda.status();
  ASSERT_EQ(with_cuda->cuda_rng.size(), owned.cuda_rng.size());
  for (size_t i = 0; i < owned.cuda_rng.size(); ++i) {
    EXPECT_TRUE(at::equal(with_cuda->cuda_rng[i], owned.cuda_rng[i])) << "device " << i;
  }
  SetCudaGeneratorStates(with_cuda->cuda_rng);
  const std::vector<at::Tensor> now = CudaGeneratorStates();
  for (size_t i = 0; i < now.size(); ++i) EXPECT_TRUE(at::equal(now[i], owned.cuda_rng[i])) << "device " << i;

  auto garbage = DecodeOwnerFile("not an owner file", "x.pt");
  EXPECT_FALSE(garbage.ok());
  EXPECT_THAT(std::string(garbage.status().message()), HasSubstr("x.pt: not a remora checkpoint owner file"));

  const std::string path = FreshDir("owner file") + "/owner-0.pt";
  ASSERT_TRUE(WriteFileAtomically(path, bytes).ok());
  EXPECT_TRUE(ReadOwnerFile(path, static_cast<int64_t>(bytes.size()), Crc32(bytes)).ok());
  auto short_file = ReadOwnerFile(path, static_cast<int64_t>(bytes.size()) + 1, Crc32(bytes));
  EXPECT_EQ(short_file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(short_file.status().message()), HasSubstr(path));
  std::string flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x5a;
  Overwrite(path, flipped);
  auto corrupt = ReadOwnerFile(path, static_cast<int64_t>(bytes.size()), Crc32(bytes));
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
  m.add_files()->set_file("owner-0.pt");
  m.add_stages()->set_owner(0);
  const std::string json =
      "{\"format\": 1, \"step\": 4, \"shards\": [{\"file\": \"shard-0.pt\"}], \"stages\": [{\"shard\": 0}]}";
  fs::create_directories(dir + "/step-00000004");
  Overwrite(dir + "/step-00000004/manifest.json", json);
  fs::create_directories(dir + "/step-00000008");  // a save that crashed: no manifest
  Overwrite(dir + "/step-00000008/owner-0.pt", "partial");
  auto latest = Latest(dir);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(latest->manifest.step, 4);
  ASSERT_EQ(latest->manifest.files.size(), 1u);
  EXPECT_EQ(latest->manifest.files[0].file, "shard-0.pt");  // (an older manifest's keys read)
  EXPECT_EQ(CompleteSteps(dir), std::vector<int64_t>{4});
  EXPECT_EQ(Latest(dir + "/step-00000004")->manifest.step, 4);  // a checkpoint's own directory

  // A trailing '/' names the same directory.
  EXPECT_EQ(Latest(dir + "/")->dir, dir + "/step-00000004");
  EXPECT_EQ(Latest(dir + "/step-00000004/")->dir, dir + "/step-00000004");

  // A newer manifest garbled on disk is passed over, and said.
  fs::create_directories(dir + "/step-00000012");
  Overwrite(dir + "/step-00000012/manifest.json", "garbage\n");
  auto older = Latest(dir);
  ASSERT_TRUE(older.ok()) << older.status();
  EXPECT_EQ(older->manifest.step, 4);
  ASSERT_EQ(older->passed_over.size(), 1u);
  EXPECT_THAT(older->passed_over[0], HasSubstr("step-00000012/manifest.json is not a remora manifest"));
  EXPECT_THAT(older->passed_over[0], Not(HasSubstr("garbage")));  // (the file's text is not quoted)

  // None readable: the newest one's error.
  Overwrite(dir + "/step-00000004/manifest.json", "{\"format\": 1, \"step\": ");
  auto broken = Latest(dir);
  EXPECT_FALSE(broken.ok());
  EXPECT_THAT(std::string(broken.status().message()), HasSubstr("step-00000012/manifest.json"));
  fs::remove_all(dir + "/step-00000012");
  broken = Latest(dir);
  EXPECT_FALSE(broken.ok());
  EXPECT_THAT(std::string(broken.status().message()), HasSubstr("step-00000004/manifest.json"));

  Checkpoint ck;
  ck.manifest_path = "/x/manifest.json";
  ck.manifest.model = "mlp";
  ck.manifest.micro_batches = 2;
  RunIdentity id;
  id.model = "mlp";
  id.micro_batches = 2;
  EXPECT_TRUE(CheckMatches(ck, id).ok());
  id.model = "resnet50";
  auto mismatch = CheckMatches(ck, id);
  EXPECT_EQ(mismatch.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(mismatch.message()),
              HasSubstr("/x/manifest.json is of another run: the model was 'mlp', this run's is 'resnet50'"));
  // The data: a folder named relatively (as runs before absolute names
  // recorded it) or with a trailing '/' is the same folder; an image size
  // that an older run did not record is not compared, one it did is.
  id.model = "mlp";
  const std::string here = fs::current_path().string();
  ck.manifest.data = "imagefolder:data/cats batch-size=8 seed=0 shuffle";
  id.data = "imagefolder:" + here + "/data/cats batch-size=8 seed=0 shuffle image-size=32";
  EXPECT_TRUE(CheckMatches(ck, id).ok()) << CheckMatches(ck, id);
  ck.manifest.data = "imagefolder:" + here + "/data/cats/ batch-size=8 seed=0 shuffle image-size=32";
  EXPECT_TRUE(CheckMatches(ck, id).ok()) << CheckMatches(ck, id);
  id.data = "imagefolder:" + here + "/data/cats batch-size=8 seed=0 shuffle image-size=64";
  EXPECT_THAT(std::string(CheckMatches(ck, id).message()), HasSubstr("the data was"));
  id.data = "imagefolder:" + here + "/data/dogs batch-size=8 seed=0 shuffle image-size=32";
  EXPECT_THAT(std::string(CheckMatches(ck, id).message()), HasSubstr("the data was"));
}

// A TorchScript stage that always drops half its activations: its results depend on the worker's generator.
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

std::unique_ptr<pipeline::Pipeline> MakePipeline(rpc::Agent& master, const std::vector<pipeline::StageSpec>& stages,
                                                 const std::string& schedule = "interleaved") {
  pipeline::PipelineOptions o;
  o.stages = stages;
  o.workers = {"w1", "w2"};
  o.schedule = schedule;
  o.micro_batches = 2;
  o.loss = pipeline::MseLoss();
  // (Each step's rate differs: a resumed owner must go on from its count.)
  o.optimizer = optim::OptimizerOptions::Adam(0.01).set_schedule({optim::LrSchedule::Kind::kCosine, 2, 6, 0.001});
  auto pipe = pipeline::Pipeline::Create(master, o);
  EXPECT_TRUE(pipe.ok()) << pipe.status();
  return pipe.ok() ? std::move(*pipe) : nullptr;
}

// Loads owner-0.pt of the pipeline above (worker w1: stage 0, the dropout
// TorchScript stage `script`, and stage 2, a registered MLP) with Debian's
// python3-torch, as a Python user would: with torch.load's defaults (from
// PyTorch 2.6 on, weights only, which refuses the torch.jit._pickle
// globals LibTorch writes for typed lists and dicts; none is in the file),
// the stage's state_dict into the TorchScript module (strict), the
// optimizer's into torch.optim.Adam over the owner file's parameters in order,
// then one Adam step. Skipped where /usr/bin/python3 has no torch.
const char kLoadInPyTorch[] = R"(import sys, torch, zipfile
file_path, script_path = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(file_path) as z:
    pickled = z.read([n for n in z.namelist() if n.endswith("/data.pkl")][0])
assert b"torch.jit._pickle" not in pickled, "typed containers: a weights-only load refuses them"
owned = torch.load(file_path)
assert owned["format"] == 2, owned["format"]
assert owned["stages"] == [0, 2], owned["stages"]
stage0, stage2 = owned["state_dicts"]
m = torch.jit.load(script_path)
m.load_state_dict(stage0)
assert torch.equal(m.weight, stage0["weight"])
assert list(stage2.keys()) == ["0.weight", "0.bias"], list(stage2.keys())
params = list(m.parameters()) + [torch.nn.Parameter(t.clone()) for t in stage2.values()]
opt = torch.optim.Adam(params, lr=0.01)
opt.load_state_dict(owned["optimizer"])
assert len(opt.state) == len(params), len(opt.state)
assert float(opt.state[params[1]]["step"]) == 6.0, opt.state[params[1]]["step"]
for p in params:
    p.grad = torch.ones_like(p)
opt.step()
print("loaded in PyTorch", torch.__version__)
)";

void CheckOwnerFileInPyTorch(const std::string& owned, const std::string& script_bytes) {
  if (RunProgram({"/usr/bin/python3", "-c", "import torch"}).first != 0) {
    std::printf("(no python3-torch: the owner file is not opened in PyTorch)\n");
    return;
  }
  const std::string script = TempPath("dropout.pt");
  const std::string code = TempPath("load_owner_file.py");
  Overwrite(script, script_bytes);
  Overwrite(code, kLoadInPyTorch);
  const auto [rc, out] = RunProgram({"/usr/bin/python3", code, owned, script}, absl::Seconds(120));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("loaded in PyTorch"));
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
    losses.push_back(pipe->start_train_step(data[i].first, data[i].second).wait().value());
    const absl::Status saved = (*saver)->Save(*pipe, Stages(), id, At(static_cast<int64_t>(i + 1)));
    ASSERT_TRUE(saved.ok()) << saved;
  }
  const std::vector<at::Tensor> want = AllStageState(*pipe);
  EXPECT_EQ(CompleteSteps(dir), (std::vector<int64_t>{5, 6}));  // --keep 2
  const std::vector<std::vector<at::Tensor>> saved = ReadStageTensors(Latest(dir).value()).value();
  std::vector<at::Tensor> flat;
  for (const auto& s : saved) flat.insert(flat.end(), s.begin(), s.end());
  ASSERT_EQ(flat.size(), want.size());
  for (size_t j = 0; j < want.size(); ++j) EXPECT_TRUE(at::equal(flat[j], want[j])) << j;
  // The evaluator's way: the whole model in this process, TorchScript and
  // registered stages alike, with the saved weights.
  auto model = LoadModel(Latest(dir).value(), c10::kCPU);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ(model->size(), 4u);
  std::vector<at::Tensor> loaded;
  c10::IValue x = data[0].first;
  for (auto& stage : *model) {
    for (const at::Tensor& p : stage->Parameters()) loaded.push_back(p);
    for (const at::Tensor& b : stage->Buffers()) loaded.push_back(b);
    x = stage->Forward(x);
  }
  EXPECT_EQ(x.toTensor().sizes(), data[0].second.sizes());
  ASSERT_EQ(loaded.size(), want.size());
  for (size_t j = 0; j < want.size(); ++j) EXPECT_TRUE(at::equal(loaded[j], want[j])) << j;
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
  const std::vector<at::Tensor> fresh = AllStageState(*resumed);
  const absl::Status restored = Restore(*resumed, *ck);
  ASSERT_TRUE(restored.ok()) << restored;
  EXPECT_FALSE(at::equal(AllStageState(*resumed)[2], fresh[2])) << "Restore loaded the trained weights";
  const double loss = resumed->start_train_step(data[5].first, data[5].second).wait().value();
  EXPECT_EQ(loss, losses[5]);
  const std::vector<at::Tensor> got = AllStageState(*resumed);
  ASSERT_EQ(got.size(), want.size());
  for (size_t j = 0; j < want.size(); ++j) EXPECT_TRUE(at::equal(got[j], want[j])) << "tensor " << j;

  // Another run that reached the same state saves the same bytes: the
  // optimizer's state is numbered by parameter, not keyed by address.
  const std::string again = FreshDir("resume_again");
  auto saver2 = Checkpointer::Create(workers.master(), again, /*keep=*/1);
  ASSERT_TRUE(saver2.ok()) << saver2.status();
  ASSERT_TRUE((*saver2)->Save(*resumed, *stages, id, At(6)).ok());
  for (const char* file : {"owner-0.pt", "owner-1.pt"}) {
    const std::string a = ReadFile(absl::StrCat(dir, "/step-00000006/", file)).value();
    const std::string b = ReadFile(absl::StrCat(again, "/step-00000006/", file)).value();
    EXPECT_TRUE(a == b) << file << " differs between the runs (" << a.size() << " and " << b.size() << " bytes)";
  }
  // PyTorch opens an owner file: each stage's state_dict by name, the optimizer's
  // in PyTorch's layout.
  CheckOwnerFileInPyTorch(absl::StrCat(dir, "/step-00000006/owner-0.pt"), Stages()[0].script);

  // With w1's generator moved on (an eval pass draws dropout masks), the
  // same step gives another loss: the equality above needs the saved
  // generators, not only the weights.
  auto moved = MakePipeline(workers.master(), *stages);
  ASSERT_NE(moved, nullptr);
  ASSERT_TRUE(Restore(*moved, *ck).ok());
  ASSERT_TRUE(moved->eval_step(data[0].first).ok());
  EXPECT_NE(moved->start_train_step(data[5].first, data[5].second).wait().value(), losses[5]);
}

// In the background (Save's `background`), a save waits only for the
// owners to copy their state: training goes on while they write, the
// checkpoint is committed (its manifest written) only once every owner file is,
// and it holds the state of its own step, not a later one's. The next save
// finishes it first; a final save is never in the background.
TEST(Checkpoint, ABackgroundSaveHoldsItsStepsStateAndIsCommittedOnceWritten) {
  test_support::TestWorkers workers;
  const auto data = test_support::RandomBatches(3, 10, 8, 4);
  const std::string dir = FreshDir("background");
  RunIdentity id;
  id.model = "dropout-mlp";
  id.micro_batches = 2;
  auto saver = Checkpointer::Create(workers.master(), dir, /*keep=*/3);
  ASSERT_TRUE(saver.ok()) << saver.status();
  auto pipe = MakePipeline(workers.master(), Stages());
  ASSERT_NE(pipe, nullptr);
  ASSERT_TRUE(pipe->start_train_step(data[0].first, data[0].second).wait().ok());
  const std::vector<at::Tensor> at_step1 = AllStageState(*pipe);
  absl::Status saved = (*saver)->Save(*pipe, Stages(), id, At(1), /*final=*/false, /*background=*/true);
  ASSERT_TRUE(saved.ok()) << saved;
  EXPECT_TRUE((*saver)->pending());
  ASSERT_TRUE(pipe->start_train_step(data[1].first, data[1].second).wait().ok());
  EXPECT_TRUE(CompleteSteps(dir).empty());  // committed by Poll or Flush only
  absl::StatusOr<bool> committed = false;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(30);
       committed.ok() && !*committed && absl::Now() < deadline;) {
    absl::SleepFor(absl::Milliseconds(5));
    committed = (*saver)->Poll();
  }
  ASSERT_TRUE(committed.ok() && *committed) << committed.status();
  EXPECT_FALSE((*saver)->pending());
  EXPECT_EQ(CompleteSteps(dir), (std::vector<int64_t>{1}));
  EXPECT_EQ((*saver)->last_step(), 1);
  EXPECT_GT((*saver)->last_bytes(), 0);
  const std::vector<std::vector<at::Tensor>> read = ReadStageTensors(Latest(dir).value()).value();
  std::vector<at::Tensor> flat;
  for (const auto& stage : read) flat.insert(flat.end(), stage.begin(), stage.end());
  const std::vector<at::Tensor> now = AllStageState(*pipe);
  ASSERT_EQ(flat.size(), at_step1.size());
  bool moved = false;
  for (size_t j = 0; j < flat.size(); ++j) {
    EXPECT_TRUE(at::equal(flat[j], at_step1[j])) << j;
    moved |= !at::equal(now[j], at_step1[j]);
  }
  EXPECT_TRUE(moved) << "step 2 changed no parameter: the test shows nothing";

  saved = (*saver)->Save(*pipe, Stages(), id, At(2), /*final=*/false, /*background=*/true);
  ASSERT_TRUE(saved.ok()) << saved;
  ASSERT_TRUE(pipe->start_train_step(data[2].first, data[2].second).wait().ok());
  saved = (*saver)->Save(*pipe, Stages(), id, At(3), /*final=*/true, /*background=*/true);
  ASSERT_TRUE(saved.ok()) << saved;
  EXPECT_FALSE((*saver)->pending());
  EXPECT_EQ(CompleteSteps(dir), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_TRUE(Latest(dir).value().manifest.final);
  // A worker asked for a write it never started says so.
  auto unknown = workers.master().rpc_sync("w1", "remora.checkpoint.owner_file_written", {dir + "/nothing.pt"});
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("no owner file is being written to"));
}

TEST(Checkpoint, CorruptOrMismatchedCheckpointsAreClearErrors) {
  test_support::TestWorkers workers;
  const std::string dir = FreshDir("corrupt");
  auto saver = Checkpointer::Create(workers.master(), dir, 3).value();
  auto pipe = MakePipeline(workers.master(), Stages());
  ASSERT_NE(pipe, nullptr);
  const auto data = test_support::RandomBatches(1, 10, 8, 4);
  pipe->start_train_step(data[0].first, data[0].second).wait().value();
  ASSERT_TRUE(saver->Save(*pipe, Stages(), RunIdentity{}, At(1)).ok());
  Checkpoint ck = Latest(dir).value();
  EXPECT_EQ(ck.manifest.files.size(), 2u);
  EXPECT_EQ(ck.manifest.files[1].worker, "w2");
  EXPECT_EQ(ck.manifest.stages[2].owner, 0);  // stage 2 on w1 again

  // A flipped byte in w2's owner file: the error names the file and the worker.
  const std::string owned = ck.dir + "/owner-1.pt";
  std::string bytes = ReadFile(owned).value();
  bytes[bytes.size() / 3] ^= 0x11;
  Overwrite(owned, bytes);
  auto s = Restore(*pipe, ck);
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("owner-1.pt has CRC-32"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("worker 'w2'"));

  // A pipeline of another shape: refused before anything is loaded.
  auto two = MakePipeline(workers.master(), {DropoutStage(8, 16), test_support::MlpSpec(Mlp(16, 4, 2, false))},
                          "1f1b");
  ASSERT_NE(two, nullptr);
  auto shape = Restore(*two, ck);
  EXPECT_EQ(shape.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(shape.message()), HasSubstr("holds 4 stages in 2 owner files"));

  // A manifest edited to a step before any run's start: refused, not
  // trained on from step -5 (nor pruned around by --keep).
  const std::string manifest = ReadFile(ck.manifest_path).value();
  const std::string step_one = "\"step\": \"1\"";
  const size_t step_at = manifest.find(step_one);
  ASSERT_NE(step_at, std::string::npos) << manifest;
  Overwrite(ck.manifest_path, std::string(manifest).replace(step_at, step_one.size(), "\"step\": \"-5\""));
  auto edited = Latest(ck.dir);
  EXPECT_EQ(edited.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(edited.status().message()), HasSubstr("step -5, epoch 0, batch 0"));
  EXPECT_THAT(std::string(edited.status().message()), HasSubstr("is no position of a run"));
  Overwrite(ck.manifest_path, manifest);

  // A file cut short.
  fs::resize_file(ck.dir + "/model.pt", 10);
  auto specs = LoadStageSpecs(ck);
  EXPECT_EQ(specs.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(specs.status().message()), HasSubstr("model.pt has CRC-32"));
}

// The real programs: a job whose worker is SIGKILLed mid-epoch, restarted
// with --resume on workers of other names, ends bitwise equal to a job
// that never stopped; an evaluator follows the uninterrupted job's
// checkpoints and stops after its final one.
TEST(CheckpointJob, AJobKilledMidEpochResumesAndEndsEqualToAnUninterruptedOne) {
  const std::string data = fs::path(TempPath("ckpt_toy")).lexically_normal().string();
  test_support::WriteToyIdx(data, 320, 100);  // 10 batches of 32 per epoch, 3 epochs
  const std::string whole = FreshDir("ckpt_whole"), broken = FreshDir("ckpt_broken");

  // Uninterrupted, with the evaluator following it.
  std::string whole_out;
  {
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto evaluator = launch::Subprocess::Spawn({BinDir() + "/evaluator", "--checkpoint-dir", whole, "--dataset",
                                             "idx:" + data, "--poll-ms", "50", "--timeout", "200",
                                             "--threads", "1"},
                                            TempPath("ckpt_evaluator.log"))
                         .value();
    auto workers = StartWorkers({"w1", "w2"}, addr, "whole");
    auto [code, out] = RunProgram(
        MasterArgv("w1,w2", addr, data, {"--checkpoint-dir", whole, "--checkpoint-every", "3", "--keep", "9"}),
        absl::Seconds(200));
    ASSERT_EQ(code, 0) << out;
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
    EXPECT_THAT(out, HasSubstr("checkpoint: step 30 in " + whole + "/step-00000030"));
    EXPECT_THAT(out, HasSubstr(", final)"));
    // Step 30 is periodic and final: one line for it.
    EXPECT_EQ(out.find("checkpoint: step 30 "), out.rfind("checkpoint: step 30 ")) << out;
    EXPECT_EQ(CompleteSteps(whole), (std::vector<int64_t>{6, 9, 12, 15, 18, 21, 24, 27, 30}));  // --keep 9
    whole_out = out;
    EXPECT_EQ(evaluator->Wait(absl::Seconds(60)).value_or(-1), 0) << "the evaluator stops after the final checkpoint";
    const std::string evaluated = ReadFile(TempPath("ckpt_evaluator.log")).value_or("");
    const std::string jsonl = ReadFile(whole + "/eval.jsonl").value_or("");
    EXPECT_THAT(jsonl, HasSubstr("\"step\": 30, \"epoch\": 3, \"batch\": 10"));
    EXPECT_THAT(jsonl, HasSubstr("\"final\": true"));
    // The evaluator's accuracy of the final weights is the master's after epoch 3.
    const std::string epoch3 = LineStarting(out, "epoch=3 ");
    const size_t acc = epoch3.find("test_accuracy=");
    ASSERT_NE(acc, std::string::npos) << out;
    EXPECT_THAT(evaluated, HasSubstr("step=30 epoch=3 " + epoch3.substr(acc, 20)));
    // Given one checkpoint's directory (not final), it scores that one and
    // exits: no newer one can come there. Its score goes to the job's
    // eval.jsonl, not into the checkpoint, and only once: the follower may
    // have scored step 12 already, and a second run finds it there.
    // (`also`: only the lines that hold it too.)
    auto lines_of = [&whole](int64_t step, const std::string& also = "") {
      const std::string key = absl::StrCat("\"step\": ", step, ", ");
      int n = 0;
      for (const auto line : absl::StrSplit(ReadFile(whole + "/eval.jsonl").value_or(""), '\n')) {
        n += absl::StrContains(line, key) && absl::StrContains(line, also);
      }
      return n;
    };
    // Step 30 is scored once as final. The master commits it as periodic
    // first, as final after testing epoch 3: a follower that looked in
    // between (likelier under load) scored that commit too, a line apart.
    const int step30 = lines_of(30);
    EXPECT_EQ(lines_of(30, "\"final\": true"), 1);
    EXPECT_LE(step30, 2);
    for (int run = 0; run < 2; ++run) {
      auto [one_code, one_out] =
          RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", whole + "/step-00000012", "--dataset", "idx:" + data,
                      "--threads", "1"}, absl::Seconds(60));
      EXPECT_EQ(one_code, 0) << one_out;
      EXPECT_THAT(one_out, HasSubstr("step=12 epoch=2 ")) << one_out;
      if (run == 1) {
        EXPECT_THAT(one_out, HasSubstr("/eval.jsonl already)")) << one_out;
      }
      EXPECT_EQ(lines_of(12), 1);
    }
    // A restarted evaluator (--once: the latest) reports the final score it
    // finds there, without a second line.
    auto [again_code, again_out] = RunProgram(
        {BinDir() + "/evaluator", "--checkpoint-dir", whole, "--dataset", "idx:" + data, "--once", "--threads", "1"},
        absl::Seconds(60));
    EXPECT_EQ(again_code, 0) << again_out;
    EXPECT_THAT(again_out, HasSubstr("step=30 epoch=3 " + epoch3.substr(acc, 20))) << again_out;
    EXPECT_THAT(again_out, HasSubstr("(final) (in " + whole + "/eval.jsonl already)")) << again_out;
    EXPECT_EQ(lines_of(30), step30);
    EXPECT_FALSE(std::filesystem::exists(whole + "/step-00000012/eval.jsonl"));
  }

  // Killed: worker w2 is SIGKILLed once the checkpoint of step 6 is
  // written (epoch 1 of 3); the master fails naming it. (Started with
  // --resume auto, as a supervisor would: nothing to resume yet.)
  {
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = StartWorkers({"w1", "w2"}, addr, "broken");
    const std::string log = TempPath("ckpt_broken_master.log");
    auto master = launch::Subprocess::Spawn(
                      MasterArgv("w1,w2", addr, data,
                                 {"--checkpoint-dir", broken, "--checkpoint-every", "3", "--resume", "auto"}),
                      log)
                      .value();
    ASSERT_TRUE(AwaitOutput(*master, log, "checkpoint: step 6 ", absl::Seconds(200)))
        << "no checkpoint of step 6, nothing to resume from:\n" << ReadFile(log).value_or("");
    workers[1]->Signal(SIGKILL);
    const int code = master->Wait(absl::Seconds(60)).value_or(-1);
    const std::string out = ReadFile(log).value_or("");
    ASSERT_NE(code, 0) << "the job ended before w2 was killed:\n" << out;
    EXPECT_THAT(out, HasSubstr("w2"));
    EXPECT_THAT(out, HasSubstr("starting fresh (--resume auto)"));
    EXPECT_EQ(LineStarting(out, "epoch=3 "), "");
    workers[0]->Wait(absl::Seconds(30)).IgnoreError();
    ASSERT_FALSE(CompleteSteps(broken).empty());
    EXPECT_LT(CompleteSteps(broken).back(), 30);
  }

  // Whether training is bitwise reproducible here, decided from a second
  // uninterrupted job compared with the first at their ends. With Debian's
  // LibTorch (OpenBLAS) it is, and the resumed job must end bitwise equal.
  // With a PyTorch wheel's (MKL) on an H100, two jobs agreed at step 6 but
  // the resumed one ended 6e-8 away: there only closeness can be asked.
  StageDifference twice;
  {
    const std::string again = FreshDir("ckpt_again");
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = StartWorkers({"w1", "w2"}, addr, "again");
    auto [code, out] = RunProgram(MasterArgv("w1,w2", addr, data, {"--checkpoint-dir", again, "--checkpoint-every",
                                                                   "30"}),
                                  absl::Seconds(200));
    ASSERT_EQ(code, 0) << out;
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
    twice = CompareStages(whole, again);
    ASSERT_LT(twice.largest, 1e-5) << "two uninterrupted jobs ended this far apart";
  }

  // Resumed on workers named otherwise: it ends where the whole job did.
  {
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = StartWorkers({"x1", "x2"}, addr, "resumed");
    auto [code, out] = RunProgram(MasterArgv("x1,x2", addr, data, {"--resume", broken}), absl::Seconds(200));
    ASSERT_EQ(code, 0) << out;
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
    EXPECT_THAT(out, HasSubstr("resumed from " + broken + "/step-"));
    const StageDifference after = CompareStages(whole, broken);
    if (twice.equal) {
      EXPECT_EQ(LineStarting(out, "epoch=3 ").substr(0, 50), LineStarting(whole_out, "epoch=3 ").substr(0, 50));
      EXPECT_TRUE(after.equal) << "the resumed job ended " << after.largest << " away from the uninterrupted one";
    } else {
      EXPECT_LT(after.largest, 1e-5) << "training is not bitwise reproducible here (two uninterrupted jobs ended "
                                     << twice.largest << " apart), but the resumed job ended this far away";
    }
    EXPECT_EQ(Latest(broken)->manifest.step, 30);
    // Resumed as the README shows (no checkpoint flags), the run's
    // --checkpoint-every 3 and --keep 3 (the default) go on.
    EXPECT_THAT(out, HasSubstr("checkpoint: step 27 in " + broken + "/step-00000027"));
    EXPECT_EQ(CompleteSteps(broken), (std::vector<int64_t>{24, 27, 30}));
    EXPECT_EQ(Latest(broken)->manifest.checkpoint_every, 3);
    EXPECT_EQ(Latest(broken)->manifest.keep, 3);
  }

  // A checkpoint of another run: refused, naming the manifest, before any
  // worker is waited for; nothing is written.
  const std::vector<int64_t> before = CompleteSteps(broken);
  auto [code, out] = RunProgram(
      {BinDir() + "/master", "--workers", "x1,x2", "--dataset", "idx:" + data, "--epochs", "3", "--batch-size", "64",
       "--splits", "2", "--resume", broken, "--connect-timeout", "1"});
  EXPECT_EQ(code, 2) << out;
  EXPECT_THAT(out, HasSubstr("manifest.json is of another run: the data was"));
  EXPECT_EQ(CompleteSteps(broken), before);
}

// An --output the evaluator cannot write fails at once (a bad flag value:
// 2), not after its first evaluation; the default one, in a checkpoint
// directory the job has not made yet, is fine. A --checkpoint-dir that is
// a file is said to be one.
TEST(Evaluator, AnOutputThatCannotBeWrittenFailsAtOnce) {
  const std::string dir = TempPath("evaluator_not_yet");
  const std::string data = TempPath("evaluator_toy");
  test_support::WriteToyIdx(data, 20, 10);
  for (const std::string& output : {std::string("/proc/none/eval.jsonl"), testing::TempDir()}) {
    auto [code, out] = RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", dir, "--dataset", "idx:" + data,
                                   "--once", "--output", output});
    EXPECT_EQ(code, 2) << out;
    EXPECT_THAT(out, HasSubstr("cannot write --output " + output)) << out;
  }
  const std::string file = TempPath("evaluator_file");
  std::ofstream(file) << "x";
  auto [file_code, file_out] = RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", file, "--dataset",
                                           "idx:" + data, "--once"});
  EXPECT_EQ(file_code, 2) << file_out;
  EXPECT_THAT(file_out, HasSubstr("--checkpoint-dir " + file + " is not a directory")) << file_out;
  // --once on a directory that is not there: a bad value, said before the
  // test set is read; without --once the evaluator waits for the job.
  auto [code, out] = RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", dir, "--dataset", "idx:" + data, "--once"});
  EXPECT_EQ(code, 2) << out;
  EXPECT_THAT(out, HasSubstr("--checkpoint-dir " + dir + " does not exist: --once evaluates")) << out;
  EXPECT_THAT(out, ::testing::Not(HasSubstr("following"))) << out;
  // Flags for image folders are named as without effect on in-memory data.
  std::filesystem::create_directories(dir);
  auto [note_code, note_out] = RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", dir, "--dataset", "idx:" + data,
                                           "--once", "--image-size", "64", "--test-rows", "10"});
  EXPECT_EQ(note_code, 1) << note_out;
  EXPECT_THAT(note_out, HasSubstr("evaluator: note: --image-size with an in-memory --dataset")) << note_out;
  EXPECT_THAT(note_out, HasSubstr("no complete checkpoint in " + dir)) << note_out;
}

// A directory with the test images alone is not enough, and the error says
// why the training images are wanted.
TEST(Evaluator, ATestSetWithoutItsTrainingImagesSaysWhyTheyAreNeeded) {
  const std::string data = TempPath("evaluator_test_images_only");
  test_support::WriteToyIdx(data, 20, 10);
  for (const char* name : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte"}) {
    std::filesystem::remove(data + "/" + name);
  }
  std::filesystem::create_directories(TempPath("evaluator_none"));
  auto [code, out] = RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", TempPath("evaluator_none"), "--dataset",
                                 "idx:" + data, "--once"});
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("the evaluator reads the training images too")) << out;
  EXPECT_THAT(out, HasSubstr("no train-images-idx3-ubyte")) << out;
}

}  // namespace
}  // namespace remora::checkpoint
