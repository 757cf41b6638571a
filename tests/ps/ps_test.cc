// The parameter server (ps/): synchronous steps equal one process on the
// whole batch, backup workers drop a slowed worker, lost workers fail the
// step or are dropped, checkpoints the evaluator reads, and master --mode ps.
#include <csignal>
#include <filesystem>

#include <ATen/ops/equal.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "checkpoint/checkpoint.h"
#include "launch/local_group.h"
#include "ps/parameter_server.h"
#include "ps/replica.h"
#include "train/local_trainer.h"
#include "tests/ps/ps_fixtures.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using test_support::Mlp;
using test_support::MlpSpec;
using test_support::RelativeError;
using test_support::TestWorkers;
using ps_fixtures::ExpectResumeGoesOn;
using ps_fixtures::ExpectStateNear;
using ps_fixtures::kStages;
using ps_fixtures::MlpServer;
using ps_fixtures::ReportEpochs;
using ps_fixtures::RunPs;
using ps_fixtures::StartWorkers;

TEST(Ps, SyncStepsEqualOneProcessOnTheWholeBatch) {
  TestWorkers workers(2);
  auto server = ps_fixtures::Server(workers.master(), MlpServer({"w1", "w2"}));
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(4, 13, 8, 4);  // 13 rows: shares of 7 and 6
  const test_support::LocalRun local = test_support::TrainMlpLocally(kStages, data);
  const int64_t param_bytes = (*server)->server().parameter_bytes();
  for (size_t s = 0; s < data.size(); ++s) {
    auto r = ps_fixtures::Step(**server, data[s].first, data[s].second);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->step, static_cast<int64_t>(s + 1));
    EXPECT_LE(std::abs(r->loss - local.losses[s]) / std::abs(local.losses[s]), 1e-5)
        << "step " << s << ": " << r->loss << " vs " << local.losses[s];
    EXPECT_THAT(r->used, ElementsAre("w1", "w2"));
    EXPECT_TRUE(r->dropped.empty() && r->lost.empty());
    EXPECT_EQ(r->rows, 13);
    EXPECT_EQ(r->pull_bytes, 2 * param_bytes);  // every worker pulled every parameter
    EXPECT_EQ(r->push_bytes, 2 * param_bytes);  // and pushed a gradient of each
  }
  ExpectStateNear((*server)->server().stage_state().value(), local.state, "after 4 steps");

  // --precision bf16: each worker's share under bf16 autocast, as one
  // process computes two parts of the batch under it.
  ps::PsOptions bf16 = MlpServer({"w1", "w2"});
  bf16.bf16 = true;
  auto half = ps_fixtures::Server(workers.master(), bf16);
  ASSERT_TRUE(half.ok()) << half.status();
  train::LocalOptions lo;
  lo.stages = bf16.stages;
  lo.loss = pipeline::LossFn::Named(bf16.loss);
  lo.optimizer = bf16.optimizer;
  lo.micro_batches = 2;  // (13 rows: 7 and 6, the workers' shares)
  lo.bf16 = true;
  auto one = train::LocalTrainer::Create(lo);
  ASSERT_TRUE(one.ok()) << one.status();
  bool differs = false;
  for (size_t s = 0; s < data.size(); ++s) {
    const double want = (*one)->StartStep({data[s].first, data[s].second}).wait().value();
    auto r = ps_fixtures::Step(**half, data[s].first, data[s].second);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_NEAR(r->loss, want, 1e-5 * std::abs(want)) << "bf16, step " << s;
    differs |= r->loss != local.losses[s];
  }
  EXPECT_TRUE(differs) << "bf16 rounds otherwise than float32";
}

TEST(Ps, BadOptionsAreClearErrors) {
  TestWorkers workers(2);
  auto too_many = ps_fixtures::Server(workers.master(), MlpServer({"w1", "w2"}, /*backup=*/2));
  ASSERT_FALSE(too_many.ok());
  EXPECT_THAT(too_many.status().message(), HasSubstr("0 <= k < n"));
  ps::PsOptions bad_loss = MlpServer({"w1", "w2"});
  bad_loss.loss = "hinge";
  EXPECT_THAT(ps_fixtures::Server(workers.master(), bad_loss).status().message(),
              HasSubstr("unknown loss 'hinge'"));
  ps::PsOptions bad_type = MlpServer({"w1", "w2"});
  bad_type.stages = {pipeline::StageSpec::Registered("NoSuchStage", {})};
  EXPECT_FALSE(ps_fixtures::Server(workers.master(), bad_type).ok());
  auto server = ps_fixtures::Server(workers.master(), MlpServer({"w1", "w2"}));
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(1, 1, 8, 4);  // one row for two workers
  EXPECT_THAT(ps_fixtures::Step(**server, data[0].first, data[0].second).status().message(),
              HasSubstr("at least one row per worker"));
}

// With --backup-workers 1, a worker slowed by --slow-ms is left behind:
// each step uses the first two gradient sets, rescaled to the mean over
// the rows they cover (the first step: rows 0-7 of 12, as one process on
// those rows); the slow worker, still busy, is not sent the next step's
// share, and its late reply changes nothing.
TEST(Ps, BackupWorkersGoOnWithoutTheSlowedWorker) {
  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  launch::LocalGroup group = StartWorkers(&registry, {{}, {}, {"--slow-ms", "4000"}});
  auto server = ps_fixtures::Server(*group.master, MlpServer({"w1", "w2", "w3"}, 1));
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(2, 12, 8, 4);
  auto first = ps_fixtures::Step(**server, data[0].first, data[0].second);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_THAT(first->used, ElementsAre("w1", "w2"));
  EXPECT_THAT(first->dropped, ElementsAre("w3"));
  EXPECT_EQ(first->rows, 8);
  auto second = ps_fixtures::Step(**server, data[1].first, data[1].second);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_THAT(second->used, ElementsAre("w1", "w2"));
  EXPECT_THAT(second->dropped, ElementsAre("w3"));  // still busy with step 1
  EXPECT_EQ(second->rows, 12);                      // the batch shared by the two
  // The reference: one process, step 1 on rows 0-7, step 2 on all rows.
  const test_support::LocalRun local = test_support::TrainMlpLocally(
      kStages, {{data[0].first.slice(0, 0, 8), data[0].second.slice(0, 0, 8)}, data[1]});
  EXPECT_LE(std::abs(first->loss - local.losses[0]) / local.losses[0], 1e-5);
  EXPECT_LE(std::abs(second->loss - local.losses[1]) / local.losses[1], 1e-5);
  ExpectStateNear((*server)->server().stage_state().value(), local.state, "after the steps without w3");
  // Training goes on; w3's late replies are ignored.
  for (int s = 0; s < 3; ++s) {
    auto r = ps_fixtures::Step(**server, data[1].first, data[1].second);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_THAT(r->used, ElementsAre("w1", "w2"));
    EXPECT_TRUE(r->lost.empty());
  }
  EXPECT_THAT((*server)->server().live_workers(), ElementsAre("w1", "w2", "w3"));
  server->reset();
  EXPECT_TRUE(group.Shutdown(absl::Seconds(60)).ok());
}

TEST(Ps, AKilledWorkerFailsTheStepNamingIt) {
  TestWorkers workers(2);
  workers.ExpectUncleanShutdown();  // w2 is killed
  auto server = ps_fixtures::Server(workers.master(), MlpServer({"w1", "w2"}));
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(1, 8, 8, 4);
  ASSERT_TRUE(ps_fixtures::Step(**server, data[0].first, data[0].second).ok());
  workers.worker(1).Signal(SIGKILL);
  ASSERT_TRUE(workers.worker(1).Wait(absl::Seconds(10)).ok());
  auto r = ps_fixtures::Step(**server, data[0].first, data[0].second);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("worker 'w2' failed"));
  workers.master().Shutdown(/*graceful=*/false).IgnoreError();
}

// A batch whose rows 4-7 (w2's share of 12 rows over three workers) hold
// a value the "ThrowsAbove" stage in front of the MLP refuses.
std::pair<at::Tensor, at::Tensor> WithABadRowForW2(const std::pair<at::Tensor, at::Tensor>& batch) {
  at::Tensor x = batch.first.clone();
  x[5][0] = 1000.0;
  return {x, batch.second};
}

ps::PsOptions ThrowingServer(const std::vector<std::string>& workers, int backup) {
  ps::PsOptions o = MlpServer(workers, backup);
  o.stages.insert(o.stages.begin(), pipeline::StageSpec::Registered("ThrowsAbove", {100.0}));
  return o;
}

// A worker whose own computation throws is not a lost worker: the step
// fails naming it and its error, it stays in the group, the next step
// trains over every worker, and all exit 0 at the end (TestWorkers checks).
TEST(Ps, AWorkerWhoseComputationThrowsFailsTheStepAndStays) {
  TestWorkers workers(3, "test_worker");  // for "ThrowsAbove"
  auto server = ps_fixtures::Server(workers.master(), ThrowingServer({"w1", "w2", "w3"}, 0));
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(1, 12, 8, 4);
  const auto bad = WithABadRowForW2(data[0]);
  auto r = ps_fixtures::Step(**server, bad.first, bad.second);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("step 1: worker 'w2' failed computing its share of the batch "
                                              "(4 rows) and still answers"));
  EXPECT_THAT(r.status().message(), HasSubstr("an input above 100 in magnitude"));
  EXPECT_THAT((*server)->server().live_workers(), ElementsAre("w1", "w2", "w3"));
  EXPECT_FALSE(workers.master().IsLost("w2"));
  auto next = ps_fixtures::Step(**server, data[0].first, data[0].second);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_THAT(next->used, ElementsAre("w1", "w2", "w3"));
  EXPECT_TRUE(next->lost.empty());
}

// With a backup worker the step may go on without w2's reply: its error
// then fails the next step, which finds it. Either way w2 is named, not
// dropped, and training goes on over all three.
TEST(Ps, WithBackupWorkersAThrowingWorkerIsNotDroppedAsLost) {
  TestWorkers workers(3, "test_worker");  // for "ThrowsAbove"
  auto server = ps_fixtures::Server(workers.master(), ThrowingServer({"w1", "w2", "w3"}, 1));
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(1, 12, 8, 4);
  const auto bad = WithABadRowForW2(data[0]);
  auto r = ps_fixtures::Step(**server, bad.first, bad.second);
  int step = 1;
  if (r.ok()) {
    EXPECT_THAT(r->used, ElementsAre("w1", "w3"));
  }
  // (w2's error may come after the steps that do not wait for it.)
  for (; r.ok() && step < 50; ++step) {
    absl::SleepFor(absl::Milliseconds(20));
    r = ps_fixtures::Step(**server, data[0].first, data[0].second);
  }
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(),
              HasSubstr(step == 1 ? "step 1: worker 'w2' failed computing its share of the batch"
                                  : absl::StrCat("step ", step, ": worker 'w2' failed computing its share of an "
                                                 "earlier step's batch (4 rows) and still answers")));
  EXPECT_THAT(r.status().message(), HasSubstr("an input above 100 in magnitude"));
  EXPECT_THAT((*server)->server().live_workers(), ElementsAre("w1", "w2", "w3"));
  for (int s = 0; s < 3; ++s) {
    auto next = ps_fixtures::Step(**server, data[0].first, data[0].second);
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_TRUE(next->lost.empty());
  }
  EXPECT_FALSE(workers.master().IsLost("w2"));
}

// After a step over w1, w2 and w3 (backup workers), SIGKILLs w3 and trains
// on over w1 and w2 until a step reports a worker lost: w3's call fails
// when its connection attempt does, and the step that sees it reports it
// (the first, unless w1 and w2 answer before it fails). Returns that
// step's lost workers (none after 200 steps).
std::vector<std::string> TrainUntilW3IsLost(TestWorkers& workers, train::PsTrainer& server,
                                            const std::pair<at::Tensor, at::Tensor>& batch) {
  if (auto first = ps_fixtures::Step(server, batch.first, batch.second); !first.ok()) {
    ADD_FAILURE() << first.status();
    return {};
  }
  workers.worker(2).Signal(SIGKILL);
  EXPECT_TRUE(workers.worker(2).Wait(absl::Seconds(10)).ok());
  for (int s = 0; s < 200; ++s) {
    auto r = ps_fixtures::Step(server, batch.first, batch.second);
    if (!r.ok()) {
      ADD_FAILURE() << r.status();
      return {};
    }
    EXPECT_THAT(r->used, ElementsAre("w1", "w2"));
    if (!r->lost.empty()) return r->lost;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return {};
}

TEST(Ps, WithBackupWorkersALostWorkerIsDroppedUntilTooFewAreLeft) {
  TestWorkers workers(3);
  workers.ExpectUncleanShutdown();  // w3 and w2 are killed
  auto server = ps_fixtures::Server(workers.master(), MlpServer({"w1", "w2", "w3"}, 1));
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(1, 12, 8, 4);
  EXPECT_THAT(TrainUntilW3IsLost(workers, **server, data[0]), ElementsAre("w3"));
  auto next = ps_fixtures::Step(**server, data[0].first, data[0].second);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->rows, 12);  // w1 and w2 share the batch
  EXPECT_TRUE(next->lost.empty() && next->dropped.empty());
  EXPECT_THAT((*server)->server().live_workers(), ElementsAre("w1", "w2"));
  workers.worker(1).Signal(SIGKILL);
  ASSERT_TRUE(workers.worker(1).Wait(absl::Seconds(10)).ok());
  auto failed = ps_fixtures::Step(**server, data[0].first, data[0].second);
  ASSERT_FALSE(failed.ok());
  EXPECT_THAT(failed.status().message(), HasSubstr("only 1 of 3 workers are left"));
  EXPECT_THAT(failed.status().message(), HasSubstr("'w2'"));
  EXPECT_THAT(failed.status().message(), HasSubstr("'w3'"));
  workers.master().Shutdown(/*graceful=*/false).IgnoreError();
}

// A worker lost with backup workers is lost to the agent too: the graceful
// shutdown leaves it out (the RRef fork of its last call, never accepted,
// held it for the 60 s drain timeout, then failed it) and the workers left
// exit 0.
TEST(Ps, ALostWorkerIsLeftOutOfTheGracefulShutdown) {
  TestWorkers workers(3);
  workers.ExpectUncleanShutdown();  // w3 is killed
  auto server = ps_fixtures::Server(workers.master(), MlpServer({"w1", "w2", "w3"}, 1));
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(1, 12, 8, 4);
  EXPECT_THAT(TrainUntilW3IsLost(workers, **server, data[0]), ElementsAre("w3"));
  EXPECT_TRUE(workers.master().IsLost("w3"));
  EXPECT_FALSE(workers.master().IsLost("w2"));
  server->reset();
  const absl::Time start = absl::Now();
  const absl::Status down = workers.master().Shutdown();
  EXPECT_TRUE(down.ok()) << down;
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  for (int i : {0, 1}) {
    absl::StatusOr<int> code = workers.worker(i).Wait(absl::Seconds(20));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << "w" << i + 1;
  }
}

// The server's checkpoints are ordinary checkpoints: Latest, LoadStageSpecs
// and ReadStageTensors read them, and a new server resumes from them.
TEST(Ps, CheckpointsHoldTheServersModelAndResume) {
  TestWorkers workers(2);
  ps::PsOptions o = MlpServer({"w1", "w2"});
  auto server = ps_fixtures::Server(workers.master(), o);
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(3, 8, 8, 4);
  const std::string dir = TempPath("ps_ckpt");
  checkpoint::RunIdentity id;
  id.model = "mlp";
  id.schedule = "ps";
  for (int s = 0; s < 2; ++s) {
    ASSERT_TRUE(ps_fixtures::Step(**server, data[s].first, data[s].second).ok());
    auto saved = checkpoint::SaveLocal(dir, o.stages, (*server)->server().stage_state().value(), (*server)->server().stage_names(),
                                       (*server)->server().optimizer_state().value(),
                                       id, {s + 1, 0, s + 1, 0, 0, {}}, s == 1, /*keep=*/1);
    ASSERT_TRUE(saved.ok()) << saved.status();
  }
  EXPECT_THAT(checkpoint::CompleteSteps(dir), ElementsAre(2));  // keep=1 pruned step 1
  // An owner file that cannot be written (its name taken by a directory): the
  // error says which checkpoint failed and that step 2's is still the latest.
  std::filesystem::create_directories(dir + "/step-00000003/owner-0.pt/taken");
  auto failed = checkpoint::SaveLocal(dir, o.stages, (*server)->server().stage_state().value(), (*server)->server().stage_names(),
                                      (*server)->server().optimizer_state().value(), id, {3, 0, 3, 0, 0, {}}, false, 1);
  EXPECT_FALSE(failed.ok());
  EXPECT_THAT(std::string(failed.status().message()),
              HasSubstr("checkpoint of step 3 in " + std::filesystem::path(dir).lexically_normal().string() +
                        "/step-00000003 (the previous checkpoint is still the latest): "));
  EXPECT_THAT(checkpoint::CompleteSteps(dir), ElementsAre(2));
  std::filesystem::remove_all(dir + "/step-00000003");
  auto ck = checkpoint::Latest(dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(ck->manifest.step, 2);
  EXPECT_TRUE(ck->manifest.final);
  EXPECT_EQ(ck->manifest.files[0].worker, "master");
  auto specs = checkpoint::LoadStageSpecs(*ck);
  ASSERT_TRUE(specs.ok()) << specs.status();
  ASSERT_EQ(specs->size(), 2u);
  EXPECT_EQ((*specs)[1].name, "MLPStage");
  EXPECT_EQ((*specs)[1].args[1].toInt(), 4);
  auto tensors = checkpoint::ReadStageTensors(*ck);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  const auto state = (*server)->server().stage_state().value();
  ASSERT_EQ(tensors->size(), state.size());
  for (size_t k = 0; k < state.size(); ++k) {
    ASSERT_EQ((*tensors)[k].size(), state[k].size());
    for (size_t i = 0; i < state[k].size(); ++i) EXPECT_TRUE(at::equal((*tensors)[k][i], state[k][i]));
  }
  // A fresh server loaded from it takes the same third step.
  auto optimizer = checkpoint::ReadLocalOptimizer(*ck);
  ASSERT_TRUE(optimizer.ok()) << optimizer.status();
  EXPECT_TRUE(optimizer->defined());
  auto resumed = ps_fixtures::Server(workers.master(), o);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  ASSERT_TRUE((*resumed)->server().Load(*tensors, *optimizer, /*steps_done=*/2).ok());
  auto a = ps_fixtures::Step(**server, data[2].first, data[2].second);
  auto b = ps_fixtures::Step(**resumed, data[2].first, data[2].second);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->loss, b->loss);
  EXPECT_EQ(a->step, 3);
  EXPECT_EQ(b->step, 3) << "the resumed server numbers its steps on from the checkpoint's";
  ExpectStateNear((*resumed)->server().stage_state().value(), (*server)->server().stage_state().value(), "resumed");
}

// master --mode ps trains the small CNN on a dataset like one process on
// whole batches (--local --splits 1), and its checkpoints are readable.
TEST(Ps, MasterProgramTrainsADatasetLikeOneProcess) {
  const std::string dir = TempPath("ps_toy_idx");
  test_support::WriteToyIdx(dir, 320, 100);
  const std::vector<std::string> args = {"--dataset", "idx:" + dir, "--epochs", "2", "--batch-size", "32"};
  const std::string local_report = TempPath("ps_local.json");
  std::vector<std::string> local_argv = {BinDir() + "/master", "--local", "--threads", "1", "--splits", "1",
                                         "--report", local_report};
  local_argv.insert(local_argv.end(), args.begin(), args.end());
  auto [local_code, local_out] = RunProgram(local_argv, absl::Seconds(240));
  ASSERT_EQ(local_code, 0) << local_out;
  const auto local = ReportEpochs(ReadFile(local_report));
  ASSERT_EQ(local.size(), 2u);
  const std::string report = TempPath("ps.json"), ckpt = TempPath("ps_master_ckpt");
  std::vector<std::string> ps_args = args;
  for (const std::string& a : {std::string("--report"), report, std::string("--threads"), std::string("1"),
                               std::string("--checkpoint-dir"), ckpt, std::string("--checkpoint-every"),
                               std::string("4")}) {
    ps_args.push_back(a);
  }
  auto [code, out] = RunPs(ps_args);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("parameter server: 1 stage, "));
  EXPECT_THAT(out, HasSubstr("ps: steps=20 median_step_seconds="));
  EXPECT_THAT(out, HasSubstr("dropped: none; lost: none; live workers: worker1,worker2"));
  // By default each worker reads its share of every batch itself.
  EXPECT_THAT(out, HasSubstr("data: read on worker1, worker2 (the master sends row numbers"));
  const auto piped = ReportEpochs(ReadFile(report));
  ASSERT_EQ(piped.size(), 2u);
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_LT(std::abs(piped[e].first - local[e].first) / local[e].first, 1e-4) << "epoch " << e + 1;
    EXPECT_NEAR(piped[e].second, local[e].second, 0.011) << "epoch " << e + 1;
  }
  // The master reading and sending the shares trains the same steps.
  const std::string sent_report = TempPath("ps_sent.json");
  std::vector<std::string> sent_args = args;
  for (const std::string& a : {std::string("--report"), sent_report, std::string("--data-on"), std::string("master")}) {
    sent_args.push_back(a);
  }
  auto [sent_code, sent_out] = RunPs(sent_args);
  ASSERT_EQ(sent_code, 0) << sent_out;
  EXPECT_THAT(sent_out, HasSubstr("data: read on the master"));
  const auto sent = ReportEpochs(ReadFile(sent_report));
  ASSERT_EQ(sent.size(), 2u);
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_LT(std::abs(sent[e].first - piped[e].first) / piped[e].first, 1e-6) << "epoch " << e + 1;
    EXPECT_DOUBLE_EQ(sent[e].second, piped[e].second) << "epoch " << e + 1;
  }
  auto ck = checkpoint::Latest(ckpt);
  ASSERT_TRUE(ck.ok()) << ck.status() << "\n" << out;
  EXPECT_EQ(ck->manifest.step, 20);
  EXPECT_TRUE(ck->manifest.final);
  EXPECT_EQ(ck->manifest.schedule, "ps");
  auto tensors = checkpoint::ReadStageTensors(*ck);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  ASSERT_EQ(tensors->size(), 1u);
  EXPECT_EQ((*tensors)[0].size(), 8u);  // the small CNN's four layers' weights and biases
}

// master --mode ps --backup-workers: a summary counts each worker's
// dropped steps; a line per step only with --ps-step-lines (every step
// printed one).
TEST(Ps, BackupWorkersPrintASummaryAndStepLinesOnlyWhenAsked) {
  const std::string dir = TempPath("ps_backup_idx");
  test_support::WriteToyIdx(dir, 96, 32);
  const std::vector<std::string> args = {"--dataset", "idx:" + dir, "--epochs", "1", "--batch-size", "32",
                                         "--threads", "1", "--backup-workers", "1"};
  auto [code, out] = RunPs(args, 3);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("ps: steps=3 median_step_seconds="));
  EXPECT_THAT(out, HasSubstr("dropped: "));
  EXPECT_THAT(out, Not(HasSubstr("ps step=")));
  std::vector<std::string> lines = args;
  lines.push_back("--ps-step-lines");
  auto [lines_code, lines_out] = RunPs(lines, 3);
  ASSERT_EQ(lines_code, 0) << lines_out;
  for (int s = 1; s <= 3; ++s) EXPECT_THAT(lines_out, HasSubstr(absl::StrCat("ps step=", s, " used="))) << s;
}

// master --mode ps --backup-workers 1 with a worker SIGKILLed mid-run goes
// on over the others to the end and exits 0, whether the workers read
// their shares or the master sends them (the lost worker's skipped-images
// count failed the epoch, and its RRefs held the shutdown for a minute).
TEST(Ps, MasterProgramGoesOnWithoutAKilledWorkerToTheEnd) {
  const std::string dir = TempPath("ps_killed_idx");
  test_support::WriteToyIdx(dir, 3200, 64);
  for (const std::string on : {"workers", "master"}) {
    ps_fixtures::PsPrograms programs(3);
    const std::string log = TempPath("ps_killed_" + on + ".log"), report = TempPath("ps_killed_" + on + ".json");
    auto master = launch::Subprocess::Spawn(
                      programs.MasterArgv({"--dataset", "idx:" + dir, "--epochs", "2", "--batch-size", "32",
                                           "--threads", "1", "--backup-workers", "1", "--ps-step-lines",
                                           "--data-on", on, "--report", report}),
                      log)
                      .value();
    AwaitOutput(*master, log, "ps step=3 ", absl::Seconds(120));
    programs.workers[2]->Signal(SIGKILL);
    const absl::Time killed = absl::Now();
    const absl::StatusOr<int> code = master->Wait(absl::Seconds(180));
    const std::string out = ReadFile(log);
    ASSERT_TRUE(code.ok()) << code.status() << "\n" << out;
    EXPECT_EQ(*code, 0) << on << ":\n" << out;
    EXPECT_LT(absl::Now() - killed, absl::Seconds(45)) << on << ":\n" << out;
    EXPECT_THAT(out, HasSubstr("lost: worker3 x1; live workers: worker1,worker2")) << on;
    EXPECT_EQ(ReportEpochs(ReadFile(report)).size(), 2u) << on << ":\n" << out;
    for (int i : {0, 1}) EXPECT_EQ(programs.workers[i]->Wait(absl::Seconds(30)).value_or(-1), 0) << on << " " << i;
  }
}

// master --mode ps --resume goes on from the server's checkpoint as if it
// had not stopped.
TEST(Ps, MasterResumesFromTheServersCheckpoint) { ExpectResumeGoesOn({}, 2, "ps_resume"); }

}  // namespace
}  // namespace remora
