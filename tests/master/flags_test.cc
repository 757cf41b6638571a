// master's command line in this process: every bad flag is an error that
// names it, and good ones resolve to the configuration master runs. (The
// program itself is tested in tests/shards/resnet_test.cc: --help, the
// exit codes, workers that never come.)
#include "master/flags.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/manifest.h"
#include "launch/cli.h"
#include "parallel/process_group.h"
#include "shards/protocol.h"
#include "tests/master/flag_cases.h"
#include "tests/support/script_models.h"
#include "tests/support/test_group.h"

namespace remora::master {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

using flag_cases::Case;
using flag_cases::ErrorOf;
using flag_cases::ExpectErrors;

// No number flag takes inf or nan (a nan --momentum passed the [0, 1)
// check once): the parser refuses them, naming the flag (exit 2).
TEST(MasterFlags, NumbersMustBeFinite) {
  const std::vector<Case> cases = {
      {{"--local", "--lr", "inf"}, "--lr wants a finite number, got 'inf'"},
      {{"--local", "--lr", "nan"}, "--lr wants a finite number, got 'nan'"},
      {{"--local", "--momentum", "nan"}, "--momentum wants a finite number, got 'nan'"},
      {{"--local", "--val-fraction", "-inf"}, "--val-fraction wants a finite number, got '-inf'"},
  };
  for (const Case& k : cases) {
    testing::internal::CaptureStderr();
    testing::internal::CaptureStdout();
    auto line = ParseCommandLine(k.args);
    const std::string said = testing::internal::GetCapturedStderr() + testing::internal::GetCapturedStdout();
    EXPECT_FALSE(line.ok()) << absl::StrJoin(k.args, " ");
    EXPECT_THAT(said, HasSubstr(k.error)) << absl::StrJoin(k.args, " ");
  }
}

// Data parallelism's collectives check no token and encrypt nothing: with
// a token (or TLS), --replicas needs --insecure-collectives.
TEST(MasterFlags, ReplicasWithATokenNeedInsecureCollectives) {
  const std::string token = TempPath("flags.token");
  std::ofstream(token) << "a-secret\n";
  const std::vector<std::string> args = {"--workers", "a,b", "--replicas", "2", "--token-file", token};
  EXPECT_THAT(ErrorOf(args),
              HasSubstr("--replicas with a token: data parallelism's gradients go over Gloo's connections"));
  std::vector<std::string> accepted = args;
  accepted.push_back("--insecure-collectives");
  auto line = ParseCommandLine(accepted);
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(line->config.replicas, 2);
  EXPECT_TRUE(ParseCommandLine({"--workers", "a,b", "--token-file", token}).ok()) << "one pipeline needs nothing";
}

TEST(MasterFlags, BadValuesAreClearErrorsNamingTheFlag) {
  ExpectErrors({
      {{"--splits", "1"}, "--workers is required"},
      {{"--local", "--splits", "0"}, "positive integers"},
      {{"--local", "--splits", ","}, "--splits is empty"},
      {{"--local", "--splits", "16", "--batch-size", "8"}, "exceeds --batch-size 8"},
      {{"--local", "--batch-size", "8"},  // the demo's --splits 8
       "--splits 8 cuts --batch-size 8 into micro-batches of 1 image, and ResNet50's batch norm needs 2 or more "
       "in each: give --splits 4 or fewer, or --batch-size 16 or more (2 images x --splits 8)"},
      // At --splits 1 fewer splits cannot help: only a larger batch does.
      {{"--workers", "a,b", "--replicas", "2", "--batch-size", "3"},
       "--splits 1 x --replicas 2 cuts --batch-size 3 into micro-batches of 1 image, and ResNet50's batch norm "
       "needs 2 or more in each: give --batch-size 4 or more (2 images x --splits 1 x --replicas 2)"},
      {{"--workers", "a,b", "--replicas", "2", "--splits", "2", "--batch-size", "6"}, "--splits 2 x --replicas 2"},
      {{"--local", "--batch-size", "0"}, "--batch-size must be >= 1"},
      {{"--local", "--image-size", "4"}, "--image-size"},
      {{"--local", "--timeline", "t.png"}, "--timeline writes an SVG picture: give a FILE.svg; got 't.png'"},
      {{"--local", "--curves", "c"}, "--curves writes an SVG picture"},
      {{"--local", "--threads", "100000"}, "--threads must be at most 1024; got 100000"},
      {{"--workers", "a,b", "--busy-poll-us", "-1"}, "--busy-poll-us must be >= 0; got -1"},
      {{"--workers", "a,b", "--busy-poll-us", "20000"}, "--busy-poll-us 20000 is above 10000 (10 ms)"},
      {{"--local", "--image-size", "1024", "--batch-size", "128", "--splits", "1"},  // (the kernel killed it)
       "one process trains micro-batches of 128 images at 1024x1024 here, and ResNet50 keeps about 275 GiB"},
      {{"--local", "--lr", "0"}, "--lr must be > 0; got 0"},
      {{"--local", "--lr", "-1"}, "--lr must be > 0; got -1"},  // not taken for "not given"
      {{"--local", "--splits", "1,,2"}, "--splits '1,,2' has an empty count"},
      {{"--local", "--splits", "1,2,"}, "has an empty count"},
      {{"--local", "--batch-size", "100000000", "--image-size", "1024"},
       "--batch-size 100000000 of 3x1024x1024 images is"},
      {{"--local", "--batch-size", "100000000", "--image-size", "1024"}, "of memory; give a smaller --batch-size"},
      {{"--workers", "a,b", "--schedule", "1f1b", "--interleave", "2"},
       "--interleave 2 puts several stages on each worker, which --schedule 1f1b does not run"},
      {{"--local", "--batch-size", "-1"}, "--batch-size must be >= 1"},
      {{"--local", "--batches", "-1"}, "--batches must be >= 1; got -1"},
      {{"--workers", "a,a"}, "--workers: 'a' is named twice"},
      {{"--workers", "a,,b"}, "has an empty name"},
      {{"--workers", "a,b", "--max-restarts", "1", "--checkpoint-dir", "/tmp", "--spares", "c,,d"},
       "--spares 'c,,d' has an empty name"},
      {{"--workers", "a,b", "--schedule", "interleaved", "--splits", "3"}, "is not a multiple of the 2 pipeline workers: give --splits 2 (or another multiple)"},
      {{"--workers", "a b,c"}, "--workers: invalid worker name 'a b'"},
      {{"--workers", "master,b"}, "'master' is the master's own name"},
      {{"--local", "--momentum", "1"}, "--momentum must be in [0, 1)"},
      {{"--local", "--optimizer", "lbfgs"}, "--optimizer must be sgd, adam or adamw"},
      {{"--local", "--epochs", "0"}, "--epochs must be >= 1"},
      {{"--local", "--device", "tpu:0"}, "--device"},
      {{"--local", "--dataset", "fashion-mnist", "--compare-local"}, "--compare-local compares"},
      {{"--workers", "a,b", "--zero", "2"}, "--zero must be 0 or 1"},
      {{"--workers", "a,b", "--bucket-mb", "0"}, "--bucket-mb"},
      {{"--workers", "a,b,c", "--partition", "tutorial"}, "exactly two"},
      {{"--workers", "a", "--partition", "odd"}, "balanced or tutorial"},
      {{"--workers", "a,b", "--interleave", "-1"}, "--interleave must be >= 1"},
      {{"--workers", "a,b", "--schedule", "zigzag"}, "--schedule must be auto, gpipe, 1f1b, interleaved"},
      {{"--local", "--schedule", "zigzag"}, "--schedule must be auto"},  // (a typo, though unused)
      {{"--workers", "a,b", "--pipeline-stages", "-1"}, "--pipeline-stages must be >= 1"},
      {{"--workers", "a", "--listen", "nowhere"}, "HOST:PORT"},
      {{"--workers", "a", "--listen", "127.0.0.1:70000"}, "--listen"},
      {{"--workers", "a,b,c,d,e", "--dataset", "fashion-mnist"}, "give at most that many --workers"},
      // A typo in --dataset is a bad flag like any other (exit 2), found
      // before anything starts.
      {{"--local", "--dataset", "fashion-mnsit"}, "--dataset wants fashion-mnist, idx:DIR, cifar10:DIR, imagefolder:DIR or text:PATH"},
      {{"--local", "--dataset", "idx:"}, "--dataset wants"},
  });
  // The small CNN has no batch norm: one image per micro-batch trains.
  EXPECT_TRUE(ParseCommandLine({"--local", "--dataset", "fashion-mnist", "--batch-size", "8"}).ok());
}

TEST(MasterFlags, CutsAndTopologiesThatDoNotFitAreErrors) {
  ExpectErrors({
      {{"--workers", "a,b", "--interleave", "10"},
       "2 workers x 10 stages per worker (--interleave) is more stages than the 18 layers"},
      {{"--workers", "a,b", "--partition", "tutorial", "--interleave", "2"},
       "--partition tutorial cuts ResNet50 into exactly 2 stages, one per worker: not with --interleave 2"},
      {{"--workers", "a,b", "--split-at", "3,x"},
       "--split-at 3,x names submodules, which only a one-file --model cut over several workers has"},
      {{"--workers", "a,b", "--split-at", "3,-1"}, "--split-at wants layer numbers like 8 or 5,9,14, or submodule"},
      {{"--workers", "a,b", "--split-at", "12,5,7"}, "must increase strictly"},
      {{"--workers", "a,b", "--schedule", "zbv", "--interleave", "3"},
       "--schedule zbv runs two stages per worker (a V: worker k hosts stage k and stage 2 n - 1 - k), not "
       "--interleave 3"},
      {{"--workers", "a,b", "--schedule", "zbv", "--split-at", "5"},
       "--schedule zbv runs two stages per worker (a V), and --split-at makes 1 per worker"},
      {{"--workers", "a,b,c", "--schedule", "zbv", "--dataset", "fashion-mnist"},
       "small CNN has 4 blocks: give at most 2 --workers for zbv's two stages per worker"},
      {{"--workers", "a,b", "--split-at", "5,,9"}, "--split-at '5,,9' has an empty index"},
      {{"--workers", "a,b,c", "--split-at", "8"}, "--split-at makes 2 stages for 3 workers"},
      {{"--workers", "a,b", "--dataset", "fashion-mnist", "--split-at", "2"},
       "--dataset fashion-mnist trains the built-in small CNN, whose 4 blocks are spread over the --workers "
       "already: leave --split-at out"},
      {{"--workers", "a,b,c", "--replicas", "2"}, "--replicas 2 does not match the 3 --workers"},
      {{"--workers", "a,b,c,d", "--replicas", "2", "--pipeline-stages", "3"},
       "--replicas 2 x --pipeline-stages 3 does not match the 4 --workers"},
      {{"--workers", "a,b", "--replicas", "2", "--splits", "8", "--batch-size", "12"},
       "--splits 8 x --replicas 2 exceeds --batch-size 12: every micro-batch needs at least one image; give "
       "--splits 6 or fewer, or --batch-size 16 or more"},
      {{"--workers", "a,b", "--replicas", "0"}, "--replicas must be >= 1; got 0"},
      {{"--workers", "a,b", "--bucket-mb", "0"}, "--bucket-mb must be >= 1; got 0"},
  });
}

// Several stages in one worker's pipeline cannot run (consecutive stages
// call each other's workers): a flag error, before any worker is waited
// for, that says what to give instead, and names no "replica 0".
TEST(MasterFlags, SeveralStagesOnOneWorkerPerPipelineAreRefusedSayingWhatToGive) {
  const std::string dir = TempPath("flags_two_stages");
  std::filesystem::create_directories(dir);
  for (int k = 0; k < 2; ++k) test_support::ScriptLinear(4, 4, k, false).save(absl::StrCat(dir, "/stage", k, ".pt"));
  const std::string one = ErrorOf({"--workers", "w1", "--model", dir, "--input-shape", "4"});
  EXPECT_THAT(one, HasSubstr("--model has 2 stage files and the pipeline has 1 worker (--workers w1), but "
                             "consecutive stages must run on different workers: give 2 workers per pipeline "
                             "(--workers with 2 names), or export the model as one nn.Sequential file"));
  EXPECT_THAT(one, Not(HasSubstr("replica")));
  ExpectErrors({{{"--workers", "w1", "--interleave", "2"},
                 "2 stages on the one worker of the pipeline (--interleave): consecutive stages must run on "
                 "different workers; give 2 or more workers per pipeline, or leave --interleave out"}});
  if (!parallel::HaveGloo()) GTEST_SKIP() << "built without Gloo";
  ExpectErrors({{{"--workers", "w1,w2", "--replicas", "2", "--model", dir, "--input-shape", "4"},
                 "--model has 2 stage files and --replicas 2 over the 2 --workers leaves 1 worker per pipeline, "
                 "but consecutive stages must run on different workers: give 2 workers per pipeline (4 names in "
                 "--workers for --replicas 2)"}});
}

// A one-file model that cannot be cut says why and what to export, not a
// count of stages per worker (--interleave, never given).
TEST(MasterFlags, AOneFileModelThatCannotBeCutSaysWhyAndWhatToExport) {
  torch::jit::Module pair("Pair");
  pair.register_module("net", test_support::ScriptLinear(4, 3, 1, false));
  pair.define("def forward(self, x):\n  y = self.net.forward(x)\n  return (y, y.sum())\n");
  const std::string tuple = TempPath("flags_tuple.pt");
  pair.save(tuple);
  torch::jit::Module single("Single");
  single.register_module("net", test_support::ScriptLinear(4, 3, 1, false));
  single.define("def forward(self, x):\n  return self.net.forward(x)\n");
  const std::string one = TempPath("flags_one_child.pt");
  single.save(one);
  const std::string returns_tuple = ErrorOf({"--workers", "a,b", "--model", tuple, "--input-shape", "4"});
  EXPECT_THAT(returns_tuple, HasSubstr("--model " + tuple + " cannot be cut into stages: its forward returns "
                                       "Tuple[Tensor, Tensor], not one tensor of logits"));
  EXPECT_THAT(returns_tuple, HasSubstr("export one TorchScript file per stage"));
  const std::string one_child = ErrorOf({"--workers", "a,b", "--model", one, "--input-shape", "4"});
  EXPECT_THAT(one_child, HasSubstr("cannot cut " + one + " into 2 stages (2 workers x 1 per worker): it has 1 layer "
                                   "(child modules, or the statements of its forward between which one tensor "
                                   "crosses) and each stage needs one; give one worker per pipeline (it trains the "
                                   "model whole), or export one TorchScript file per stage"));
  EXPECT_THAT(one_child, Not(HasSubstr("--interleave")));
}

// --split-at names the submodules of a one-file model that its forward
// calls at cut points; one called inside a layer is refused with the
// nearest cut points.
TEST(MasterFlags, SplitAtNamesSubmodulesOfAOneFileModel) {
  torch::jit::Module net("Net");
  net.register_module("fc1", test_support::ScriptLinear(4, 6, 1, false));
  net.register_module("fc2", test_support::ScriptLinear(6, 3, 2, false));
  net.define("def forward(self, x):\n  x = torch.relu(self.fc1.forward(x))\n  return self.fc2.forward(x)\n");
  const std::string path = TempPath("flags_named_cut.pt");
  net.save(path);
  auto line = ParseCommandLine({"--workers", "a,b", "--model", path, "--input-shape", "4", "--split-at", "fc2"});
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_THAT(line->config.split_at, ElementsAre(2));  // fc1 | relu | fc2
  ExpectErrors({
      {{"--workers", "a,b", "--model", path, "--input-shape", "4", "--split-at", "fc2.weight"},
       "--split-at fc2.weight: cannot cut " + path + " before fc2.weight: it is used inside submodule fc2"},
      {{"--workers", "a,b", "--model", path, "--input-shape", "4", "--split-at", "fc3"},
       "calls no submodule named fc3; it can be cut before fc2"},
      {{"--workers", "a,b", "--model", path, "--input-shape", "4", "--split-at", "fc1"}, "fc1 begins the model"},
      {{"--workers", "a,b", "--model", path, "--input-shape", "4", "--split-at", "2,fc2"}, "mixes layer numbers"},
  });
}

TEST(MasterFlags, MissingOrBadFilesAreErrorsNamingThem) {
  ExpectErrors({
      {{"--local", "--model", TempPath("no_such_model")}, "cannot read the TorchScript file"},
      {{"--workers", "a,b", "--model", TempPath("no_such_model"), "--split-at", "2"},
       "cannot read the TorchScript file"},
      {{"--local", "--model", "x.pt", "--input-shape", "3,0"}, "--input-shape wants positive sizes"},
      {{"--local", "--model", "x.pt", "--classes", "0"}, "--classes must be >= 1"},
      // An image folder's input shape is --image-size's, said as that flag.
      {{"--local", "--model", "x.pt", "--dataset", "imagefolder:" + TempPath("photos"), "--input-shape", "3,32,32"},
       "--input-shape 3,32,32 does not match --dataset imagefolder:" +
           std::filesystem::path(TempPath("photos")).lexically_normal().string() +
           "'s images, 3,128,128: an image folder's images are 3 x S x S at --image-size S; give --image-size 32 "
           "(and leave --input-shape out)"},
      {{"--local", "--model", "x.pt", "--dataset", "imagefolder:" + TempPath("photos"), "--input-shape", "784"},
       "leave --input-shape out, and give --image-size for the side the model takes"},
      {{"--workers", "a", "--tls-cert", "node.crt"}, "--tls-cert is given without --tls-key"},
      {{"--workers", "a", "--tls-cert", TempPath("absent.crt"), "--tls-key", "k"}, "cannot read --tls-cert"},
      {{"--workers", "a", "--token-file", TempPath("absent.token")}, "--token-file"},
      {{"--workers", "a,b", "--splits", "2", "--resume", TempPath("no_checkpoints")},
       TempPath("no_checkpoints")},
  });
  // A sequential model cut by --split-at: the cut is checked against its layers.
  const std::string file = TempPath("flags_sequential.pt");
  test_support::ScriptSequential({12, 16, 16, 5}).save(file);
  ExpectErrors({
      {{"--workers", "a,b", "--model", file, "--input-shape", "12", "--split-at", "9"},
       "must increase strictly and lie in 1..2 (the model has 3 layers"},
      {{"--workers", "a,b", "--model", file, "--input-shape", "12", "--split-at", "1,2"},
       "--split-at makes 3 stages for 2 workers"},
  });
  // A file that is no TorchScript: a bad flag with --local too (as over
  // workers), not a failure once the run began.
  const std::string garbage = TempPath("flags_garbage.pt");
  std::ofstream(garbage) << "not a model";
  ExpectErrors({{{"--local", "--model", garbage}, "cannot load TorchScript from " + garbage},
                {{"--workers", "a,b", "--model", garbage}, "cannot load TorchScript from " + garbage}});
}

TEST(MasterFlags, CheckpointFlagsGoWithOneSplitCountOverWorkers) {
  const std::string dir = TempPath("flags_checkpoints");
  ExpectErrors({
      {{"--local", "--checkpoint-dir", dir}, "not with --local"},
      {{"--workers", "a,b", "--checkpoint-dir", dir, "--splits", "1,2"}, "not a sweep"},
      {{"--workers", "a,b", "--checkpoint-dir", dir, "--splits", "2", "--compare-local"},
       "--compare-local does not go with"},
      {{"--workers", "a,b", "--checkpoint-every", "-1"}, "--checkpoint-every must be >= 0; got -1"},
      {{"--workers", "a,b", "--keep", "0"}, "--keep must be >= 1; got 0"},
  });
  if (parallel::HaveGloo()) {  // ZeRO-1 runs are checkpointed (their shares gathered) like the others
    EXPECT_EQ(ErrorOf({"--workers", "a,b", "--replicas", "2", "--zero", "1", "--checkpoint-dir", dir,
                       "--splits", "2"}),
              "(passed)");
  }
}

TEST(MasterFlags, PsModeRefusesFlagsThatDoNotGoWithIt) {
  ExpectErrors({
      {{"--mode", "ps", "--workers", "a,b", "--replicas", "2"}, "not with --replicas"},
      {{"--mode", "ps", "--workers", "a,b", "--backup-workers", "2"}, "give 0 <= k < n"},
      {{"--mode", "ps", "--workers", "a,b", "--ps-partitions", "2"}, "at least one more must compute"},
      {{"--mode", "ps", "--workers", "a,b", "--ps-partitions", "-1"}, "--ps-partitions -1: give 0 or 1"},
      {{"--mode", "ps", "--workers", "a,b,c", "--ps-partitions", "2", "--backup-workers", "1"},
       "--backup-workers 1 with 1 compute workers"},
      {{"--mode", "ps", "--local", "--ps-partitions", "2"}, "not with --local"},
      {{"--mode", "ps", "--workers", "a,b", "--splits", "4"}, "--splits"},
      {{"--mode", "ps", "--local"}, "not with --local"},
      {{"--workers", "a,b", "--backup-workers", "1"}, "go with --mode ps"},
      {{"--workers", "a,b", "--ps-step-lines"}, "--ps-step-lines go with --mode ps"},
      {{"--mode", "sideways", "--workers", "a"}, "--mode must be pipeline or ps"},
  });
}

// --splits auto and --schedule auto given ask the planner, which times the
// layers of a model the master cuts itself; elsewhere --splits auto says
// what to give instead and --schedule auto keeps its rule.
TEST(MasterFlags, AutoSchedulesAndSplitsArePlannedWhereTheMasterCutsTheModel) {
  auto splits = ParseCommandLine({"--workers", "a,b", "--splits", "auto", "--batch-size", "12"});  // (not 8's)
  ASSERT_TRUE(splits.ok()) << splits.status();
  EXPECT_TRUE(splits->config.plan_splits);
  auto schedule = ParseCommandLine({"--workers", "a,b", "--schedule", "auto", "--splits", "4"});
  ASSERT_TRUE(schedule.ok()) << schedule.status();
  EXPECT_TRUE(schedule->config.plan_schedule && !schedule->config.plan_splits);
  EXPECT_FALSE(ParseCommandLine({"--workers", "a,b"})->config.plan_schedule);  // (auto by default: the rule)
  auto cnn = ParseCommandLine({"--workers", "a,b", "--dataset", "fashion-mnist", "--schedule", "auto"});
  ASSERT_TRUE(cnn.ok()) << cnn.status();
  EXPECT_FALSE(cnn->config.plan_schedule);
  ExpectErrors({
      {{"--local", "--splits", "auto"},
       "--splits auto plans a pipeline from its layers' measured times (ResNet50, the GPT of --dataset text:, a "
       "one-file --model cut over the workers), but --local trains in one process, with no pipeline to plan: give "
       "--splits N"},
      {{"--workers", "a,b", "--dataset", "fashion-mnist", "--splits", "auto"}, "small CNN's blocks are spread"},
      {{"--workers", "a,b", "--split-at", "5", "--splits", "auto"}, "but --split-at fixes the cut: give --splits N"},
      {{"--workers", "a,b", "--splits", "auto", "--interleave", "3"}, "give --interleave 1 or 2, or name --schedule"},
      {{"--workers", "a,b", "--schedule", "auto", "--splits", "2,4"},
       "--schedule auto plans one micro-batch count, and --splits 2,4 sweeps several: give one --splits, or "
       "--splits auto"},
  });
}

TEST(MasterFlags, DefaultsDependOnWhatIsTrained) {
  auto demo = ParseCommandLine({"--workers", "w1,w2"});
  ASSERT_TRUE(demo.ok()) << demo.status();
  EXPECT_EQ(demo->config.batch_size, 128);
  EXPECT_DOUBLE_EQ(demo->config.lr, 0.05);
  EXPECT_THAT(demo->config.splits, ElementsAre(8));
  EXPECT_THAT(demo->config.workers, ElementsAre("w1", "w2"));
  EXPECT_FALSE(demo->ps_mode);
  EXPECT_TRUE(demo->security.token.empty());
  EXPECT_EQ(demo->config.busy_poll_us, 0);

  auto dataset = ParseCommandLine({"--local", "--dataset", "fashion-mnist", "--splits", "1,2"});
  ASSERT_TRUE(dataset.ok()) << dataset.status();
  EXPECT_EQ(dataset->config.batch_size, 64);
  EXPECT_DOUBLE_EQ(dataset->config.lr, 0.01);
  EXPECT_THAT(dataset->config.splits, ElementsAre(1, 2));
  // Adam's rates are lower (at SGD's it diverges); a given --lr stands.
  EXPECT_DOUBLE_EQ(ParseCommandLine({"--local", "--optimizer", "adam"})->config.lr, 0.0001);
  EXPECT_DOUBLE_EQ(ParseCommandLine({"--local", "--optimizer", "adam", "--dataset", "fashion-mnist"})->config.lr,
                   0.001);
  EXPECT_DOUBLE_EQ(ParseCommandLine({"--local", "--optimizer", "adam", "--lr", "0.03"})->config.lr, 0.03);

  auto ps = ParseCommandLine({"--mode", "ps", "--workers", "a,b,c", "--ps-partitions", "2", "--lr", "0.2"});
  ASSERT_TRUE(ps.ok()) << ps.status();
  EXPECT_TRUE(ps->ps_mode);
  EXPECT_EQ(ps->config.schedule, "ps");
  EXPECT_THAT(ps->config.splits, ElementsAre(1));
  EXPECT_EQ(ps->ps.partitions, 2);
  EXPECT_DOUBLE_EQ(ps->config.lr, 0.2);
}

TEST(MasterFlags, ALearningRateScheduleIsCheckedAndReachesTheOptimizer) {
  ExpectErrors({
      {{"--local", "--lr-schedule", "step"}, "--lr-schedule must be constant, cosine or linear; got 'step'"},
      {{"--local", "--warmup-steps", "-1"}, "--warmup-steps must be 0 or more"},
      {{"--local", "--lr-schedule", "cosine", "--decay-steps", "-2"}, "--decay-steps must be 0"},
      {{"--local", "--lr-schedule", "linear", "--min-lr", "-0.1"}, "--min-lr must be 0 or more"},
      {{"--local", "--dataset", "fashion-mnist", "--eval-every", "-1"}, "--eval-every must be 0"},
  });
  auto cosine = ParseCommandLine({"--local", "--lr", "0.02", "--lr-schedule", "cosine", "--warmup-steps", "5",
                                  "--decay-steps", "50"});
  ASSERT_TRUE(cosine.ok()) << cosine.status();
  EXPECT_EQ(cosine->note, "");
  const optim::OptimizerOptions o = OptimizerOf(cosine->config);
  EXPECT_EQ(o.schedule.kind, optim::LrSchedule::Kind::kCosine);
  EXPECT_EQ(o.schedule.warmup_steps, 5);
  EXPECT_EQ(o.schedule.decay_steps, 50);
  EXPECT_DOUBLE_EQ(o.schedule.min_lr, 0.002);  // lr / 10 unless given
  EXPECT_EQ(DescribeSchedule(o), "cosine warmup-steps=5 min-lr=0.002 decay-steps=50");
  EXPECT_FALSE(OptimizerOf(ParseCommandLine({"--local"})->config).schedule.scheduled());
  auto constant = ParseCommandLine({"--local", "--min-lr", "0.001", "--decay-steps", "9"});
  ASSERT_TRUE(constant.ok()) << constant.status();
  EXPECT_THAT(constant->note, HasSubstr("--min-lr, --decay-steps with --lr-schedule constant"));
}

TEST(MasterFlags, ReplicasSplitTheWorkersIntoPipelines) {
  if (!parallel::HaveGloo()) GTEST_SKIP() << "built without Gloo";
  auto line = ParseCommandLine({"--workers", "a,b,c,d", "--replicas", "2", "--splits", "2",
                                "--checkpoint-dir", TempPath("flags_ckpt")});
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_THAT(line->config.workers, ElementsAre("a", "b"));  // replica 0's pipeline
  EXPECT_THAT(line->config.all_workers, ElementsAre("a", "b", "c", "d"));
  EXPECT_EQ(line->checkpoints.identity.micro_batches, 2);
  EXPECT_EQ(line->checkpoints.identity.replicas, 2);
  EXPECT_FALSE(line->checkpoints.resume.has_value());

  // One stage per replica is DDP: one micro-batch per replica unless
  // --splits says otherwise; a pipeline per replica keeps 8.
  auto ddp = ParseCommandLine({"--workers", "a,b", "--replicas", "2"});
  ASSERT_TRUE(ddp.ok()) << ddp.status();
  EXPECT_THAT(ddp->config.splits, ElementsAre(1));
  auto hybrid = ParseCommandLine({"--workers", "a,b,c,d", "--replicas", "2"});
  ASSERT_TRUE(hybrid.ok()) << hybrid.status();
  EXPECT_THAT(hybrid->config.splits, ElementsAre(8));
}

// --resume auto, as a supervisor restarts a job: a fresh start when
// --checkpoint-dir holds no checkpoint yet (said on a line of its own), an
// error when the latest there is damaged (never a silent start over).
// Going on from a real checkpoint: ps_fixtures::ExpectResumeGoesOn.
TEST(MasterFlags, ResumeAutoStartsFreshWhenThereIsNoCheckpointYet) {
  ExpectErrors({{{"--workers", "a,b", "--resume", "auto"}, "give --checkpoint-dir too"}});
  const std::string dir = TempPath("auto_resume_ckpt");
  auto fresh = ParseCommandLine({"--workers", "a,b", "--checkpoint-dir", dir, "--resume", "auto"});
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->config.resume, "");
  EXPECT_FALSE(fresh->checkpoints.resume.has_value());
  EXPECT_THAT(fresh->note, HasSubstr("no complete checkpoint in " + dir + " yet"));
  EXPECT_THAT(fresh->note, HasSubstr("starting fresh (--resume auto)"));
  // An existing directory without a complete checkpoint: fresh too.
  std::filesystem::create_directories(dir + "/step-00000003");
  auto empty = ParseCommandLine({"--workers", "a,b", "--checkpoint-dir", dir, "--resume", "auto"});
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->config.resume, "");
  EXPECT_THAT(empty->note, HasSubstr("starting fresh"));
  std::ofstream(dir + "/step-00000003/manifest.json") << "{ not json";
  EXPECT_THAT(ErrorOf({"--workers", "a,b", "--checkpoint-dir", dir, "--resume", "auto"}),
              HasSubstr("is not a remora manifest"));
}

// A fresh run into a directory that holds another run's checkpoints is
// refused (its own would be pruned among them); going on from there is not.
TEST(MasterFlags, ACheckpointDirOfAnEarlierRunIsRefusedUnlessResumedFrom) {
  const std::string dir = TempPath("earlier_run_ckpt");
  for (int64_t step : {400, 500}) {
    const std::string at = checkpoint::StepDir(dir, step);
    std::filesystem::create_directories(at);
    ASSERT_TRUE(checkpoint::CommitManifest(checkpoint::NewManifest({}, {step, 0, step, 0, 0, {}}, false), at).ok());
  }
  const std::string refused = ErrorOf({"--workers", "a,b", "--checkpoint-dir", dir});
  EXPECT_THAT(refused, HasSubstr("--checkpoint-dir " + dir + " already holds checkpoints of an earlier run "
                                 "(steps 400 to 500)"));
  EXPECT_THAT(refused, HasSubstr("give --resume " + dir + " (or --resume auto)"));
  // Resumed from elsewhere, saving there: refused too.
  const std::string other = TempPath("other_run_ckpt");
  std::filesystem::create_directories(other);
  EXPECT_THAT(ErrorOf({"--workers", "a,b", "--checkpoint-dir", dir, "--resume", other}),
              HasSubstr("already holds checkpoints"));
  // Going on from its latest gets past this check (to the run's identity).
  for (const std::string& from : {dir, dir + "/", dir + "/step-00000500", std::string("auto")}) {
    const std::string error = ErrorOf({"--workers", "a,b", "--checkpoint-dir", dir, "--resume", from});
    EXPECT_THAT(error, ::testing::Not(HasSubstr("already holds checkpoints"))) << from;
    EXPECT_THAT(error, ::testing::Not(HasSubstr("holds later ones"))) << from;
    EXPECT_THAT(error, HasSubstr("lists no owner files")) << from;
  }
  // From an older step of it: the later ones would outrank the new run's.
  EXPECT_THAT(ErrorOf({"--workers", "a,b", "--checkpoint-dir", dir, "--resume", dir + "/step-00000400"}),
              HasSubstr("is step 400, but --checkpoint-dir " + dir + " holds later ones (up to step 500)"));
  // Also where no --checkpoint-dir is given (the run saves beside it), a
  // trailing '/' or not.
  for (const std::string& from : {dir + "/step-00000400", dir + "/step-00000400/"}) {
    EXPECT_THAT(ErrorOf({"--workers", "a,b", "--resume", from}),
                HasSubstr("is step 400, but the directory it is in, " + dir + ", where this run saves (no "
                          "--checkpoint-dir given), holds later ones (up to step 500)"))
        << from;
  }
}

// Flags this run does not use are named in a note (not an error: the run
// goes on), so that a mistake does not pass in silence.
TEST(MasterFlags, FlagsWithoutEffectAreNamedInANote) {
  auto demo = ParseCommandLine({"--local", "--epochs", "3", "--checkpoint-every", "2", "--rejoin-timeout", "5"});
  ASSERT_TRUE(demo.ok()) << demo.status();
  EXPECT_THAT(demo->note, HasSubstr("--epochs without --dataset"));
  EXPECT_THAT(demo->note, HasSubstr("--checkpoint-every without --checkpoint-dir"));
  EXPECT_THAT(demo->note, HasSubstr("--rejoin-timeout without --max-restarts"));
  auto in_memory = ParseCommandLine({"--local", "--dataset", "fashion-mnist", "--image-size", "64"});
  ASSERT_TRUE(in_memory.ok()) << in_memory.status();
  EXPECT_THAT(in_memory->note, HasSubstr("--image-size with an in-memory --dataset"));
  auto used = ParseCommandLine({"--local", "--dataset", "fashion-mnist", "--epochs", "2"});
  ASSERT_TRUE(used.ok()) << used.status();
  EXPECT_EQ(used->note, "");
  auto more = ParseCommandLine({"--local", "--workers", "a,b", "--batches", "2", "--zero", "1", "--classes", "5",
                                "--momentum", "0.5", "--dataset", "fashion-mnist", "--optimizer", "adam",
                                "--insecure-collectives"});
  ASSERT_TRUE(more.ok()) << more.status();
  EXPECT_THAT(more->note, HasSubstr("--batches with --dataset: an epoch is the dataset's batches"));
  EXPECT_THAT(more->note, HasSubstr("--zero, --insecure-collectives without --replicas"));
  EXPECT_THAT(more->note, HasSubstr("--classes without --model"));
  EXPECT_THAT(more->note, HasSubstr("--momentum with --optimizer adam"));
  EXPECT_THAT(more->note, HasSubstr("--workers with --local"));
  auto sgd_demo = ParseCommandLine({"--workers", "a,b", "--momentum", "0.5", "--partition", "tutorial",
                                    "--split-at", "5"});
  ASSERT_TRUE(sgd_demo.ok()) << sgd_demo.status();
  EXPECT_THAT(sgd_demo->note, HasSubstr("--momentum with the ResNet50 demo: it trains with plain SGD"));
  EXPECT_THAT(sgd_demo->note, HasSubstr("--partition with --split-at"));
  // --model's random inputs are of --input-shape; --local cuts nothing; stage
  // files are the cut.
  const std::string dir = TempPath("flags_note_stages");
  std::filesystem::create_directories(dir);
  for (int k = 0; k < 2; ++k) test_support::ScriptLinear(4, 4, k, false).save(absl::StrCat(dir, "/stage", k, ".pt"));
  auto local = ParseCommandLine({"--local", "--model", dir, "--input-shape", "4", "--image-size", "64",
                                 "--partition", "tutorial"});
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_THAT(local->note, HasSubstr("--image-size with --model and random data: the inputs are of --input-shape"));
  EXPECT_THAT(local->note, HasSubstr("--partition with --local"));
  auto files = ParseCommandLine({"--workers", "a,b", "--model", dir, "--input-shape", "4", "--partition", "balanced"});
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(files->note, HasSubstr("--partition with --model stage files: they are the stages"));
  const std::string stages = ErrorOf({"--workers", "a,b", "--model", dir, "--input-shape", "4", "--split-at", "1"});
  EXPECT_THAT(stages, HasSubstr("--model " + dir + " is 2 stage files, cut already: leave --split-at out, or give "
                                "the whole model as one TorchScript file"));
  // A one-file model trained --local cuts nothing: --split-at is accepted
  // and named as having no effect, as the other pipeline flags are.
  const std::string file = TempPath("flags_note_sequential.pt");
  test_support::ScriptSequential({12, 16, 16, 5}).save(file);
  auto local_cut = ParseCommandLine({"--local", "--model", file, "--input-shape", "12", "--split-at", "1"});
  ASSERT_TRUE(local_cut.ok()) << local_cut.status();
  EXPECT_THAT(local_cut->note, HasSubstr("--split-at with --local"));
}

// An empty value ("--flag=", or a script's --flag "$UNSET") is an error,
// not the flag's default: an empty --token-file would turn checks off.
TEST(MasterFlags, AnEmptyValueIsAnErrorNotTheDefault) {
  for (const std::string flag : {"token-file", "checkpoint-dir", "resume", "dataset", "report", "model", "splits"}) {
    ::testing::internal::CaptureStderr();
    const std::string error = ErrorOf({"--workers", "a,b", "--" + flag, ""});
    const std::string said = ::testing::internal::GetCapturedStderr();
    EXPECT_THAT(error, HasSubstr("exit code 2")) << flag;
    EXPECT_THAT(said, HasSubstr("--" + flag + " is empty (an unset variable?)")) << flag;
  }
  ::testing::internal::CaptureStderr();
  EXPECT_THAT(ErrorOf({"--workers", "a,b", "--report="}), HasSubstr("exit code 2"));
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), HasSubstr("--report is empty"));
}

TEST(MasterFlags, AParseErrorIsAnError) {
  EXPECT_THAT(ErrorOf({"--workers", "a", "--bogus"}), HasSubstr("exit code 2"));
  EXPECT_THAT(ErrorOf({"--workers"}), HasSubstr("exit code 2"));
}

// An output path is tried, not only asked about: as root, access() says
// yes to /proc, where no file can be made, and the run's report was lost
// at its end. A file that exists keeps its bytes; a missing one is not
// left behind; a directory is checked by a file made in it and removed.
TEST(MasterFlags, OutputPathsAreTriedBeforeTraining) {
  const std::string file = launch::WhyCannotWrite("/proc/remora-report.json");
  const std::string tb = launch::WhyCannotWriteDir("/proc/remora-tb");
  EXPECT_FALSE(file.empty());
  EXPECT_FALSE(tb.empty());
  if (geteuid() == 0) {  // (another user is refused for want of permission)
    EXPECT_EQ(file, "the file system there takes no new files");
    EXPECT_EQ(tb, "it cannot be made: " + std::error_code(ENOENT, std::generic_category()).message());
  }
  const std::string dir = testing::TempDir() + "/output_paths";
  std::filesystem::create_directories(dir);
  EXPECT_EQ(launch::WhyCannotWrite(dir + "/new.json"), "");
  EXPECT_FALSE(std::filesystem::exists(dir + "/new.json"));
  std::ofstream(dir + "/old.json") << "kept";
  EXPECT_EQ(launch::WhyCannotWrite(dir + "/old.json"), "");
  std::ifstream old(dir + "/old.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(old), {}), "kept");
  EXPECT_EQ(launch::WhyCannotWriteDir(dir), "");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir), {}), 1);  // old.json alone
  EXPECT_EQ(launch::WhyCannotWrite("/dev/null"), "");  // (a device: asked, not opened)
}

// The group's secret: a directory, a blank file or a blank REMORA_TOKEN is
// an error saying so (a directory used to end the program with an
// uncaught exception from reading it); a file's last line break is not
// part of the secret.
TEST(MasterFlags, ASecretThatIsADirectoryOrBlankIsRefused) {
  const std::string dir = testing::TempDir() + "/secrets";
  std::filesystem::create_directories(dir);
  EXPECT_EQ(launch::LoadToken(dir).status().message(), "--token-file " + dir + " is a directory; give a file");
  std::ofstream(dir + "/blank") << "  \t\n";
  EXPECT_THAT(launch::LoadToken(dir + "/blank").status().message(), HasSubstr("holds only white space"));
  std::ofstream(dir + "/good") << "s3cret\n";
  EXPECT_EQ(launch::LoadToken(dir + "/good").value_or(""), "s3cret");
  setenv("REMORA_TOKEN", "   ", 1);
  EXPECT_THAT(launch::LoadToken("").status().message(), HasSubstr("REMORA_TOKEN holds only white space"));
  setenv("REMORA_TOKEN", "", 1);
  EXPECT_EQ(launch::LoadToken("").value_or("?"), "");  // empty: no check
  unsetenv("REMORA_TOKEN");
}

}  // namespace
}  // namespace remora::master
