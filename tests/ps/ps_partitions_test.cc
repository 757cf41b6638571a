// Parameter-server partitions (ps/partitions.h, master --ps-partitions K): the
// partition, synchronous steps equal to one process (and to the server in
// the master) with the parameters living on the partitions, backup workers
// with partitions, a lost server failing the step or the job naming it, and
// the master program.
#include <csignal>

#include <ATen/ops/equal.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "checkpoint/checkpoint.h"
#include "ps/parameter_server.h"
#include "ps/partitions.h"
#include "tests/ps/ps_fixtures.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ps_fixtures::ExpectStateNear;
using ps_fixtures::kStages;
using ps_fixtures::MlpServer;
using ps_fixtures::PsPrograms;
using ps_fixtures::ReportEpochs;
using ps_fixtures::RunPs;
using ps_fixtures::StartWorkers;
using test_support::TestWorkers;

TEST(PsPartitions, PartitionIsBalancedByBytesAndDeterministic) {
  EXPECT_THAT(ps::PartitionByBytes({512, 64, 256, 16}, 2),
              ElementsAre(ElementsAre(0), ElementsAre(1, 2, 3)));
  EXPECT_THAT(ps::PartitionByBytes({10, 10, 10}, 2), ElementsAre(ElementsAre(0, 2), ElementsAre(1)));
  EXPECT_THAT(ps::PartitionByBytes({4}, 2), ElementsAre(ElementsAre(0), ElementsAre()));
}

TEST(PsPartitions, PackedOptimizerStatesNameThePartitionCount) {
  // Two servers' optimizer states (state dicts, pickled).
  auto state = [](double lr) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("lr", lr);
    return optim::PickleBytes(d);
  };
  const at::Tensor a = state(0.1);
  const at::Tensor packed = ps::PackPartitionStates({a, state(0.2)});
  EXPECT_EQ(ps::SavedPartitions(packed), 2);
  auto back = ps::UnpackPartitionStates(packed, 2);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->size(), 2u);
  EXPECT_EQ(optim::Unpickle((*back)[0]).toGenericDict().at("lr").toDouble(), 0.1);
  EXPECT_EQ(optim::Unpickle((*back)[1]).toGenericDict().at("lr").toDouble(), 0.2);
  EXPECT_TRUE(at::equal(ps::PackPartitionStates(*back), packed)) << "the same states, the same bytes";
  EXPECT_THAT(ps::UnpackPartitionStates(packed, 3).status().message(), HasSubstr("resume with --ps-partitions 2"));
  EXPECT_EQ(ps::SavedPartitions(a), 0);  // a single server's own state
  EXPECT_EQ(ps::SavedPartitions(at::ones({5}, at::kByte)), 0);  // not a record
}

// w1 and w2 hold the partitions, w3 and w4 compute. Each step equals the
// server in the master (and, with SGD, one process on the whole batch),
// with SGD + momentum and with Adam; the partitions hold their partitions, and
// the master's copy is only brought up to date when asked.
TEST(PsPartitions, SyncStepsEqualOneProcessWithTheParametersOnThePartitions) {
  TestWorkers workers(4);
  const auto data = test_support::RandomBatches(4, 13, 8, 4);
  // (The third case clips every step: each partition's squared share of the
  // norm, then the coefficient, as clip_grad_norm_ in one process.)
  struct Case {
    optim::OptimizerOptions optimizer;
    double clip;
  };
  for (const Case& c : {Case{optim::OptimizerOptions::SGD(0.05).set_momentum(0.9), 0},
                        Case{optim::OptimizerOptions::Adam(0.01), 0},
                        Case{optim::OptimizerOptions::SGD(0.05).set_momentum(0.9), 0.05}}) {
    const optim::OptimizerOptions& optimizer = c.optimizer;
    SCOPED_TRACE(c.clip > 0 ? "clipped" : "");
    const test_support::LocalRun local = test_support::TrainMlpLocally(kStages, data, c.clip);
    ps::PsOptions whole = MlpServer({"w3", "w4"});
    whole.optimizer = optimizer;
    whole.clip_grad_norm = c.clip;
    ps::PsOptions partitioned = whole;
    partitioned.servers = {"w1", "w2"};
    auto one = ps_fixtures::Server(workers.master(), whole);
    ASSERT_TRUE(one.ok()) << one.status();
    auto server = ps_fixtures::Server(workers.master(), partitioned);
    ASSERT_TRUE(server.ok()) << server.status();
    const auto placement = (*server)->server().placement();
    ASSERT_EQ(placement.size(), 2u);
    EXPECT_EQ(placement[0].server, "w1");
    EXPECT_THAT(placement[0].params, ElementsAre(0));        // the 8x16 weights: 512 bytes
    EXPECT_THAT(placement[1].params, ElementsAre(1, 2, 3));  // 64 + 256 + 16 bytes
    EXPECT_EQ(placement[0].bytes + placement[1].bytes, (*server)->server().parameter_bytes());
    const auto before = (*server)->server().stage_state().value();
    for (size_t s = 0; s < data.size(); ++s) {
      auto a = ps_fixtures::Step(**one, data[s].first, data[s].second);
      auto b = ps_fixtures::Step(**server, data[s].first, data[s].second);
      ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " / " << b.status();
      EXPECT_LE(std::abs(b->loss - a->loss) / std::abs(a->loss), 1e-5) << "step " << s;
      if (optimizer.kind == optim::OptimizerOptions::Kind::kSGD) {
        EXPECT_LE(std::abs(b->loss - local.losses[s]) / std::abs(local.losses[s]), 1e-5) << "step " << s;
      }
      if (c.clip > 0) {
        EXPECT_GT(b->grad_norm, c.clip) << "clipped";
        EXPECT_NEAR(b->grad_norm, local.norms[s], 1e-5 * local.norms[s]) << "step " << s;
        EXPECT_NEAR(a->grad_norm, local.norms[s], 1e-5 * local.norms[s]) << "step " << s;
      } else {
        EXPECT_EQ(b->grad_norm, -1);
      }
      EXPECT_THAT(b->used, ElementsAre("w3", "w4"));
      EXPECT_EQ(b->rows, 13);
      EXPECT_EQ(b->pull_bytes, 2 * (*server)->server().parameter_bytes());
      EXPECT_EQ(b->push_bytes, 2 * (*server)->server().parameter_bytes());
    }
    // The partitions hold the trained parameters: each its partition.
    auto held = (*server)->server().partition_parameters();
    ASSERT_TRUE(held.ok()) << held.status();
    ASSERT_EQ(held->size(), 2u);
    ASSERT_EQ((*held)[0].size(), 1u);
    ASSERT_EQ((*held)[1].size(), 3u);
    EXPECT_FALSE(at::equal((*held)[0][0], before[0][0]));  // stepped there
    const auto state = (*server)->server().stage_state().value();  // gathered from the partitions
    EXPECT_TRUE(at::equal((*held)[0][0], state[0][0]));
    EXPECT_TRUE(at::equal((*held)[1][2], state[1][1]));  // parameter 3: the second stage's bias
    ExpectStateNear(state, (*one)->server().stage_state().value(), "partitioned vs the server in the master");
    if (optimizer.kind == optim::OptimizerOptions::Kind::kSGD) {
      ExpectStateNear(state, local.state, "partitioned vs one process");
    }
  }
}

// Saved state goes back to the partitions: a fresh partitioned server loaded from
// another's state and optimizer record takes the same next step; a record
// from another number of partitions is refused, naming the count to give.
TEST(PsPartitions, StateAndOptimizerRecordLoadIntoFreshPartitions) {
  TestWorkers workers(3);
  ps::PsOptions o = MlpServer({"w3"});
  o.optimizer = optim::OptimizerOptions::Adam(0.01);
  o.servers = {"w1", "w2"};
  auto server = ps_fixtures::Server(workers.master(), o);
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(3, 8, 8, 4);
  for (int s = 0; s < 2; ++s) ASSERT_TRUE(ps_fixtures::Step(**server, data[s].first, data[s].second).ok());
  const auto state = (*server)->server().stage_state().value();
  const at::Tensor record = (*server)->server().optimizer_state().value();
  EXPECT_EQ(ps::SavedPartitions(record), 2);
  auto resumed = ps_fixtures::Server(workers.master(), o);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  ASSERT_TRUE((*resumed)->server().Load(state, record).ok());
  auto a = ps_fixtures::Step(**server, data[2].first, data[2].second);
  auto b = ps_fixtures::Step(**resumed, data[2].first, data[2].second);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->loss, b->loss);
  ExpectStateNear((*resumed)->server().stage_state().value(), (*server)->server().stage_state().value(), "resumed");
  ps::PsOptions in_master = o;
  in_master.servers.clear();
  auto single = ps_fixtures::Server(workers.master(), in_master);
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_THAT((*single)->server().Load(state, record).message(), HasSubstr("resume with --ps-partitions 2"));
  ps::PsOptions three = o;
  three.servers = {"w1", "w2", "w3"};
  three.workers = {"w3"};
  EXPECT_THAT(ps_fixtures::Server(workers.master(), three).status().message(),
              HasSubstr("'w3' is named twice"));
}

// With --backup-workers 1 of three compute workers, the slowed one is left
// behind while the partitions step with the first two; its late pushes are
// discarded.
TEST(PsPartitions, BackupWorkersGoOnWithoutTheSlowedWorker) {
  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  launch::LocalGroup group = StartWorkers(&registry, {{}, {}, {}, {}, {"--slow-ms", "3000"}});
  ps::PsOptions o = MlpServer({"w3", "w4", "w5"}, 1);
  o.servers = {"w1", "w2"};
  auto server = ps_fixtures::Server(*group.master, o);
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(2, 12, 8, 4);
  auto first = ps_fixtures::Step(**server, data[0].first, data[0].second);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_THAT(first->used, ElementsAre("w3", "w4"));
  EXPECT_THAT(first->dropped, ElementsAre("w5"));
  EXPECT_EQ(first->rows, 8);
  auto second = ps_fixtures::Step(**server, data[1].first, data[1].second);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_THAT(second->dropped, ElementsAre("w5"));  // still busy with step 1
  EXPECT_EQ(second->rows, 12);
  const test_support::LocalRun local = test_support::TrainMlpLocally(
      kStages, {{data[0].first.slice(0, 0, 8), data[0].second.slice(0, 0, 8)}, data[1]});
  EXPECT_LE(std::abs(first->loss - local.losses[0]) / local.losses[0], 1e-5);
  EXPECT_LE(std::abs(second->loss - local.losses[1]) / local.losses[1], 1e-5);
  ExpectStateNear((*server)->server().stage_state().value(), local.state, "after the steps without w5");
  absl::SleepFor(absl::Seconds(3.5));  // w5's late pushes for step 1 reach the partitions
  auto third = ps_fixtures::Step(**server, data[1].first, data[1].second);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_TRUE(third->lost.empty());
  EXPECT_THAT((*server)->server().live_workers(), ElementsAre("w3", "w4", "w5"));
  server->reset();
  EXPECT_TRUE(group.Shutdown(absl::Seconds(60)).ok());
}

// A lost server fails the step naming it, even with backup workers (it is
// never a dropped straggler), and soon.
TEST(PsPartitions, AKilledServerFailsTheStepNamingIt) {
  TestWorkers workers(4);
  workers.ExpectUncleanShutdown();  // w2 is killed
  ps::PsOptions o = MlpServer({"w3", "w4"}, 1);
  o.servers = {"w1", "w2"};
  auto server = ps_fixtures::Server(workers.master(), o);
  ASSERT_TRUE(server.ok()) << server.status();
  const auto data = test_support::RandomBatches(1, 8, 8, 4);
  ASSERT_TRUE(ps_fixtures::Step(**server, data[0].first, data[0].second).ok());
  workers.worker(1).Signal(SIGKILL);
  ASSERT_TRUE(workers.worker(1).Wait(absl::Seconds(10)).ok());
  const absl::Time t0 = absl::Now();
  auto r = ps_fixtures::Step(**server, data[0].first, data[0].second);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("parameter server 'w2' (partition 1)"));
  EXPECT_LT(seconds, 10);
  workers.master().Shutdown(/*graceful=*/false).IgnoreError();
}

// master --mode ps --ps-partitions 2 over four workers (two servers, two
// computing) trains the toy dataset like --ps-partitions 1 over two.
TEST(PsPartitions, MasterProgramWithPartitionsTrainsLikeOneServer) {
  const std::string dir = TempPath("ps_partitions_idx");
  test_support::WriteToyIdx(dir, 320, 100);
  const std::vector<std::string> args = {"--dataset", "idx:" + dir, "--epochs", "2", "--batch-size", "32",
                                         "--threads", "1"};
  const std::string one_report = TempPath("ps_one.json"), report = TempPath("ps_partitions.json");
  std::vector<std::string> one_args = args, partition_args = args;
  for (const std::string& a : {std::string("--ps-partitions"), std::string("1"), std::string("--report"), one_report}) {
    one_args.push_back(a);
  }
  const std::string ckpt = TempPath("ps_partitions_ckpt");
  for (const std::string& a : {std::string("--ps-partitions"), std::string("2"), std::string("--report"), report,
                               std::string("--checkpoint-dir"), ckpt}) {
    partition_args.push_back(a);
  }
  auto [one_code, one_out] = RunPs(one_args, 2);
  ASSERT_EQ(one_code, 0) << one_out;
  auto [code, out] = RunPs(partition_args, 4);
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("parameter server: 1 stage, "));
  EXPECT_THAT(out, HasSubstr("over 2 server processes, 2 workers, synchronous"));
  EXPECT_THAT(out, HasSubstr("worker1: server of partition 0"));
  EXPECT_THAT(out, HasSubstr("worker2: server of partition 1"));
  EXPECT_THAT(out, HasSubstr("worker3: computes"));
  EXPECT_THAT(out, HasSubstr("live workers: worker3,worker4"));
  const auto a = ReportEpochs(ReadFile(one_report)), b = ReportEpochs(ReadFile(report));
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_LT(std::abs(b[e].first - a[e].first) / a[e].first, 1e-4) << "epoch " << e + 1;
    EXPECT_NEAR(b[e].second, a[e].second, 0.011) << "epoch " << e + 1;
  }
  // Its checkpoint holds the whole model, as the server in the master's.
  auto ck = checkpoint::Latest(ckpt);
  ASSERT_TRUE(ck.ok()) << ck.status() << "\n" << out;
  auto tensors = checkpoint::ReadStageTensors(*ck);
  ASSERT_TRUE(tensors.ok()) << tensors.status();
  ASSERT_EQ(tensors->size(), 1u);
  EXPECT_EQ((*tensors)[0].size(), 8u);
  EXPECT_EQ(ps::SavedPartitions(checkpoint::ReadLocalOptimizer(*ck).value()), 2);
}

// master --ps-partitions 2 --resume goes on from its checkpoint as if it had
// not stopped; resuming it with another number of partitions is refused,
// naming the number to give.
TEST(PsPartitions, MasterResumesWithTheSamePartitionCountOnly) {
  const std::string ckpt = ps_fixtures::ExpectResumeGoesOn({"--ps-partitions", "2"}, 3, "ps_partitions_resume");
  const std::string dir = TempPath("ps_partitions_resume_idx");  // ExpectResumeGoesOn's data
  PsPrograms programs(2);  // their exit codes do not matter: the master fails
  auto [other, other_out] = RunProgram(programs.MasterArgv({"--dataset", "idx:" + dir, "--batch-size", "32",
                                                            "--threads", "1", "--ps-partitions", "1", "--epochs",
                                                            "2", "--resume", ckpt}),
                                       absl::Seconds(60));
  EXPECT_NE(other, 0) << other_out;
  EXPECT_THAT(other_out, HasSubstr("resume with --ps-partitions 2"));
}

// A server SIGKILLed mid-training makes master --ps-partitions 2 exit non-zero
// within 10 s, naming it.
TEST(PsPartitions, MasterProgramFailsWithinTenSecondsWhenAServerIsKilled) {
  const std::string dir = TempPath("ps_kill_idx");
  test_support::WriteToyIdx(dir, 320, 50);
  PsPrograms programs(4);
  const std::string log = TempPath("ps_kill_master.txt");
  auto master = launch::Subprocess::Spawn(programs.MasterArgv({"--ps-partitions", "2", "--dataset", "idx:" + dir,
                                                            "--epochs", "500", "--batch-size", "32",
                                                            "--threads", "1"}),
                                       log)
                    .value();
  // Train for an epoch first.
  for (int i = 0; i < 600 && ReadFile(log).find("epoch=1 ") == std::string::npos; ++i) {
    ASSERT_TRUE(master->running()) << ReadFile(log);
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_THAT(ReadFile(log), HasSubstr("epoch=1 "));
  programs.workers[1]->Signal(SIGKILL);  // worker2: the server of partition 1
  const absl::Time t0 = absl::Now();
  auto code = master->Wait(absl::Seconds(30));
  const double seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  ASSERT_TRUE(code.ok()) << ReadFile(log) << StacksOf(master->pid());
  EXPECT_NE(*code, 0);
  EXPECT_LT(seconds, 10) << ReadFile(log);
  EXPECT_THAT(ReadFile(log), HasSubstr("parameter server 'worker2'")) << "the master's exit code: " << *code;
}  // the other workers are killed with `programs`

}  // namespace
}  // namespace remora
