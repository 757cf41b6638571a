// parallel/: Gloo groups meeting through the master's TCPStore or its keys
// over the agents; data and
// hybrid data x pipeline parallelism with real worker processes: the same
// losses and parameters as one process on the whole batch, for every
// schedule, replicas bitwise equal; mismatched replicas and a dead
// replica are clear errors, not hangs.
#include "parallel/data_parallel.h"

#include <csignal>
#include <thread>

#include <ATen/TensorOperators.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "channel/devices.h"
#include "shards/mlp.h"
#include "optim/distributed_optimizer.h"
#include "parallel/process_group.h"
#include "parallel/protocol.h"
#include "parallel/rpc_store.h"
#include "tests/support/pipeline_fixtures.h"
#include "tests/support/test_group.h"

namespace remora::parallel {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;


void CountPipes(int) {}

TEST(ProcessGroup, MembersSumAndBroadcastThroughTheStore) {
  if (!HaveGloo()) GTEST_SKIP() << "built without Gloo";
  auto store = StoreServer::Start("127.0.0.1");
  ASSERT_TRUE(store.ok()) << store.status();
  std::vector<at::Tensor> sums(2), copies(2);
  std::vector<absl::Status> status(2);
  std::vector<std::thread> members;
  for (int r = 0; r < 2; ++r) {
    members.emplace_back([&, r] {
      auto group = ProcessGroup::Join({(*store)->host(), (*store)->port(), "g", r, 2});
      if (!group.ok()) {
        status[r] = group.status();
        return;
      }
      sums[r] = at::full({5}, float(r + 1));
      Collective c = (*group)->AllReduceSum(sums[r]);
      status[r] = c.Wait();
      copies[r] = at::full({3}, float(10 * r));
      if (status[r].ok()) status[r] = (*group)->Broadcast(copies[r], 1);
    });
  }
  for (auto& t : members) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_TRUE(at::equal(sums[r], at::full({5}, 3.0f)));
    EXPECT_TRUE(at::equal(copies[r], at::full({3}, 10.0f)));
  }
  // Members ignore SIGPIPE (Gloo's writes to a dead peer are errors, not
  // the silent end of the process); a handler of the program's own stays.
  struct sigaction now = {};
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &now), 0);
  EXPECT_EQ(now.sa_handler, SIG_IGN);
  signal(SIGPIPE, CountPipes);
  auto solo = ProcessGroup::Join({(*store)->host(), (*store)->port(), "solo", 0, 1});
  ASSERT_TRUE(solo.ok()) << solo.status();
  ASSERT_EQ(sigaction(SIGPIPE, nullptr, &now), 0);
  EXPECT_EQ(now.sa_handler, &CountPipes);
  signal(SIGPIPE, SIG_DFL);
  // A member whose peer never comes: an error after the timeout, naming the group.
  GroupOptions alone{(*store)->host(), (*store)->port(), "lonely", 0, 2, absl::Milliseconds(500)};
  auto lonely = ProcessGroup::Join(alone);
  ASSERT_FALSE(lonely.ok());
  EXPECT_THAT(lonely.status().message(), HasSubstr("joining group 'lonely' as rank 0 of 2"));
}

using test_support::Mlp;
using test_support::StepMessagesBetween;
using test_support::RelativeError;
using Workers = test_support::TestWorkers;

pipeline::StageSpec Spec(const shards::MLPStageOptions& o) { return test_support::MlpSpec(o); }

std::vector<std::pair<at::Tensor, at::Tensor>> Data(int steps, int rows, int in, int out) {
  return test_support::RandomBatches(steps, rows, in, out);
}

// One MLP stage, replicated over w1 and w2 (plain data parallelism).
DataParallelOptions TwoPlainReplicas() {
  DataParallelOptions o;
  o.pipeline.stages = {Spec(Mlp(6, 3, 1))};
  o.pipeline.workers = {"w1", "w2"};
  o.pipeline.loss = pipeline::MseLoss();
  o.replicas = 2;
  return o;
}

// Trains `stages` with `replicas` replicas over `workers` and compares
// with one process: losses, every replica's parameters, replicas equal.
// `device`: the stages' (default: the workers' home device).
void ExpectParity(rpc::Agent& master, const std::vector<std::string>& workers, int replicas,
                  const std::vector<shards::MLPStageOptions>& stages, const std::string& schedule,
                  bool overlap, const std::string& device = "", double tolerance = 1e-5) {
  SCOPED_TRACE(absl::StrCat(schedule, ", ", replicas, " replicas over ", workers.size(),
                            " workers, overlap ", overlap));
  // 18 rows: the replicas' shares of a micro-batch differ by a row.
  const auto data = Data(3, 18, 6, 3);
  const test_support::LocalRun want = test_support::TrainMlpLocally(stages, data);
  const std::vector<double>& want_losses = want.losses;
  const std::vector<std::vector<at::Tensor>>& want_state = want.state;
  DataParallelOptions o;
  for (const auto& s : stages) {
    o.pipeline.stages.push_back(Spec(s));
    o.pipeline.stages.back().device = device;
  }
  o.pipeline.workers = workers;
  o.pipeline.schedule = schedule;
  o.pipeline.micro_batches = 4;
  o.pipeline.loss = pipeline::MseLoss();
  o.pipeline.optimizer = optim::OptimizerOptions::SGD(0.05).set_momentum(0.9);
  o.replicas = replicas;
  o.overlap = overlap;
  o.bucket_bytes = 64;  // several buckets per stage
  auto dp = DataParallelPipeline::Create(master, o);
  ASSERT_TRUE(dp.ok()) << dp.status();
  for (size_t i = 0; i < data.size(); ++i) {
    auto loss = (*dp)->start_train_step(data[i].first, data[i].second).wait();
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_NEAR(*loss, want_losses[i], tolerance * want_losses[i]) << "step " << i;
  }
  if (replicas > 1) {
    EXPECT_GT((*dp)->last_buckets().value(), replicas * static_cast<int64_t>(stages.size()));
  }
  for (size_t k = 0; k < stages.size(); ++k) {
    auto first = (*dp)->replica(0).stage_state(static_cast<int>(k));
    ASSERT_TRUE(first.ok()) << first.status();
    for (size_t i = 0; i < first->size(); ++i) {
      EXPECT_LT(RelativeError((*first)[i].cpu(), want_state[k][i]), tolerance)
          << "stage " << k << " tensor " << i;
    }
    for (int r = 1; r < replicas; ++r) {
      auto other = (*dp)->replica(r).stage_state(static_cast<int>(k));
      ASSERT_TRUE(other.ok()) << other.status();
      for (size_t i = 0; i < first->size(); ++i) {
        EXPECT_TRUE(at::equal((*other)[i], (*first)[i])) << "replica " << r << " stage " << k;
      }
    }
  }
}

// The store over the agents: keys live in the master's table and travel on
// the group's calls (a group with a token: the store's calls carry it);
// two members meet through it and sum, with no store port of their own.
TEST(RpcStore, MembersMeetThroughTheMastersKeysOverTheirAgents) {
  rpc::AgentOptions secured;
  secured.token = "a-token";
  Group g(2, secured);
  RpcStore a(&g.worker(1), "t/"), b(&g.worker(2), "t/");
  a.set("k", {1, 2, 3});
  EXPECT_EQ(b.get("k"), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_EQ(a.add("n", 5), 5);
  EXPECT_EQ(b.add("n", 2), 7);
  EXPECT_TRUE(b.check({"k", "n"}));
  EXPECT_FALSE(b.check({"k", "absent"}));
  EXPECT_EQ(a.getNumKeys(), 2);
  EXPECT_TRUE(a.deleteKey("k"));
  EXPECT_FALSE(a.deleteKey("k"));
  try {
    b.wait({"never"}, std::chrono::milliseconds(50));
    ADD_FAILURE() << "waited for a key that never came";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("waited 50 ms for key 'never'"));
  }
  ClearStoreKeys("t/");
  EXPECT_EQ(a.getNumKeys(), 0);

  if (!HaveGloo()) return;
  std::vector<at::Tensor> sums(2);
  std::vector<absl::Status> status(2);
  std::vector<std::thread> members;
  for (int r = 0; r < 2; ++r) {
    members.emplace_back([&, r] {
      GroupOptions o;
      o.agent = &g.worker(r + 1);
      o.name = "over-agents";
      o.rank = r;
      o.size = 2;
      auto group = ProcessGroup::Join(o);
      if (!group.ok()) {
        status[r] = group.status();
        return;
      }
      sums[r] = at::full({4}, float(r + 1));
      status[r] = (*group)->AllReduceSum(sums[r]).Wait();
    });
  }
  for (auto& t : members) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(status[r].ok()) << status[r];
    EXPECT_TRUE(at::equal(sums[r], at::full({4}, 3.0f)));
  }
  ClearStoreKeys("over-agents/");
}

TEST(DataParallel, HybridAndPlainMatchOneProcessUnderEverySchedule) {
  if (!HaveGloo()) GTEST_SKIP() << "built without Gloo";
  Workers workers(4);
  const std::vector<std::string> four = {"w1", "w2", "w3", "w4"};
  const std::vector<shards::MLPStageOptions> two = {Mlp(6, 16, 1), Mlp(16, 3, 2, false)};
  const std::vector<shards::MLPStageOptions> four_stages = {Mlp(6, 16, 1), Mlp(16, 16, 2),
                                                            Mlp(16, 16, 3), Mlp(16, 3, 4, false)};
  ExpectParity(workers.master(), four, 2, two, "gpipe", true);
  ExpectParity(workers.master(), four, 2, two, "1f1b", true);
  ExpectParity(workers.master(), four, 2, four_stages, "interleaved", true);
  ExpectParity(workers.master(), four, 2, two, "1f1b", false);
  // Plain data parallelism: every worker a whole replica.
  ExpectParity(workers.master(), {"w1", "w2"}, 2, {Mlp(6, 3, 7, false)}, "1f1b", true);
  ExpectParity(workers.master(), four, 4, {Mlp(6, 3, 7, false)}, "1f1b", true);
}

// ZeRO-1 steps the same parameters as plain data parallelism (SGD with
// momentum, Adam), with each replica holding about half the optimizer
// state: the replicas' shares add up to one replica's state without it.
TEST(DataParallel, ZeroOneMatchesPlainDataParallelismWithAShareOfTheState) {
  if (!HaveGloo()) GTEST_SKIP() << "built without Gloo";
  Workers workers(4);
  // Whole tensors are shared out: equal layers make equal shares.
  const auto data = Data(3, 16, 16, 16);
  // (Adam's rate follows a schedule: each share's optimizer counts its
  // steps as a whole replica's does.)
  for (const auto& optimizer :
       {optim::OptimizerOptions::SGD(0.05).set_momentum(0.9),
        optim::OptimizerOptions::Adam(0.01).set_schedule({optim::LrSchedule::Kind::kLinear, 1, 3, 0.002})}) {
    SCOPED_TRACE(optimizer.kind == optim::OptimizerOptions::Kind::kAdam ? "adam" : "sgd");
    std::vector<std::vector<at::Tensor>> state[2];
    std::vector<double> losses[2];
    std::vector<int64_t> bytes[2];
    for (int zero : {0, 1}) {
      DataParallelOptions o;
      o.pipeline.stages = {Spec(Mlp(16, 16, 1)), Spec(Mlp(16, 16, 2)), Spec(Mlp(16, 16, 3)),
                           Spec(Mlp(16, 16, 4, false))};
      o.pipeline.workers = {"w1", "w2", "w3", "w4"};
      o.pipeline.micro_batches = 2;
      o.pipeline.loss = pipeline::MseLoss();
      o.pipeline.optimizer = optimizer;
      o.replicas = 2;
      o.zero = zero;
      // (SGD: the gradients clipped too, between the replicas' sum and
      // ZeRO-1's step.)
      const bool sgd = optimizer.kind == optim::OptimizerOptions::Kind::kSGD;
      if (sgd) o.pipeline.clip_grad_norm = 0.05;
      auto dp = DataParallelPipeline::Create(workers.master(), o);
      ASSERT_TRUE(dp.ok()) << dp.status();
      for (const auto& [x, t] : data) {
        auto step = (*dp)->start_train_step(x, t);
        losses[zero].push_back(step.wait().value());
        if (sgd) {
          EXPECT_GT(step.grad_norm(), 0.05) << "clipped";
        }
      }
      for (int r = 0; r < 2; ++r) {
        for (int k = 0; k < 4; ++k) state[zero].push_back((*dp)->replica(r).stage_state(k).value());
      }
      bytes[zero] = (*dp)->optimizer_state_bytes().value();
    }
    EXPECT_EQ(losses[0], losses[1]);
    ASSERT_EQ(state[0].size(), state[1].size());
    for (size_t i = 0; i < state[0].size(); ++i) {
      for (size_t j = 0; j < state[0][i].size(); ++j) {
        EXPECT_LT(RelativeError(state[1][i][j], state[0][i][j]), 1e-6) << i << "/" << j;
      }
    }
    // Plain: each replica holds all of it. ZeRO-1: the shares add up to that.
    EXPECT_EQ(bytes[0][0], bytes[0][1]);
    EXPECT_GT(bytes[0][0], 0);
    EXPECT_EQ(bytes[1][0] + bytes[1][1], bytes[0][0]);
    EXPECT_LT(bytes[1][0], bytes[0][0] * 3 / 4);
    EXPECT_LT(bytes[1][1], bytes[0][0] * 3 / 4);
  }
}

TEST(DataParallel, BadTopologiesAndMismatchedReplicasAreClearErrors) {
  if (!HaveGloo()) GTEST_SKIP() << "built without Gloo";
  Workers workers(2);
  DataParallelOptions o = TwoPlainReplicas();
  o.replicas = 3;
  EXPECT_THAT(DataParallelPipeline::Create(workers.master(), o).status().message(),
              HasSubstr("2 workers do not make 3 replicas"));
  // Two stages on a pipeline of one worker: "replica 0" only where there
  // are replicas.
  DataParallelOptions one = TwoPlainReplicas();
  one.replicas = 1;
  one.pipeline.workers = {"w1"};
  one.pipeline.stages = {Spec(Mlp(6, 6, 1)), Spec(Mlp(6, 3, 1))};
  const std::string alone(DataParallelPipeline::Create(workers.master(), one).status().message());
  EXPECT_THAT(alone, HasSubstr("pipeline: 2 stages on 1 worker: consecutive stages must be on different workers"));
  EXPECT_THAT(alone, Not(HasSubstr("replica")));
  one.replicas = 2;
  one.pipeline.workers = {"w1", "w2"};
  EXPECT_THAT(DataParallelPipeline::Create(workers.master(), one).status().message(),
              HasSubstr("replica 0: pipeline: 2 stages on 1 worker"));
  o.replicas = 2;
  o.pipeline.micro_batches = 4;
  auto dp = DataParallelPipeline::Create(workers.master(), o);
  ASSERT_TRUE(dp.ok()) << dp.status();
  auto small = (*dp)->start_train_step(at::randn({6, 6}), at::randn({6, 3})).wait();
  EXPECT_THAT(small.status().message(), HasSubstr("give at least 8 rows"));
  // Replicas whose stages differ (here made by hand): an error naming the
  // worker when the groups are made, not a hang.
  pipeline::PipelineOptions a = o.pipeline, b = o.pipeline;
  a.workers = {"w1"};
  b.workers = {"w2"};
  b.stages = {Spec(Mlp(6, 4, 1))};
  auto pa = pipeline::Pipeline::Create(workers.master(), a).value();
  auto pb = pipeline::Pipeline::Create(workers.master(), b).value();
  auto store = StoreServer::Start("127.0.0.1").value();
  std::vector<rpc::RRef> groups;
  int rank = 0;
  for (auto* p : {pa.get(), pb.get()}) {
    c10::impl::GenericList list(c10::AnyType::get());
    const std::vector<rpc::RRef> mine = optim::parameter_rrefs(p->stages()[0]).value();
    for (const rpc::RRef& x : mine) list.push_back(x.ToIValue());
    parallel::MakeGradientGroupRequest g;
    g.store_host = store->host();
    g.store_port = store->port();
    g.name = "mismatch";
    g.rank = rank++;
    g.size = 2;
    g.timeout_ms = 5000;
    g.bucket_bytes = 1 << 20;
    g.overlap = true;
    g.stage_indices = {0};
    g.stage_params = {list};
    groups.push_back(workers.master()
                         .remote(p->worker_of(0), parallel::MakeGradientGroupRequest::kFunction, rpc::EncodeCall(g))
                         .value());
  }
  auto made = groups[1].rpc_sync(parallel::GroupDiscardRequest::kMethod,
                                 rpc::EncodeCall(parallel::GroupDiscardRequest{{-1}}));
  ASSERT_FALSE(made.ok());
  EXPECT_THAT(made.status().message(), HasSubstr("worker 'w2'"));
  EXPECT_THAT(made.status().message(), HasSubstr("every replica must build the same stages"));
}

// The step protocol with data parallelism: one call per worker per batch
// from the master, and per replica one push each way per stage boundary
// and micro-batch; the gradient sums travel over c10d, not RPC.
TEST(DataParallel, AStepSendsOneCallPerWorkerAndNoPerStepRounds) {
  if (!HaveGloo()) GTEST_SKIP() << "built without Gloo";
  Workers workers(4);
  struct Case {
    std::vector<std::string> workers;
    std::vector<shards::MLPStageOptions> stages;
    int m;
  };
  const std::vector<Case> cases = {
      {{"w1", "w2"}, {Mlp(6, 3, 1, false)}, 1},                          // R = 2, S = 1
      {{"w1", "w2", "w3", "w4"}, {Mlp(6, 16, 1), Mlp(16, 3, 2, false)}, 4},  // R = 2, S = 2
  };
  for (const Case& c : cases) {
    const int64_t W = static_cast<int64_t>(c.workers.size());
    const int64_t S = static_cast<int64_t>(c.stages.size());
    const int64_t R = 2;
    SCOPED_TRACE(::testing::Message() << "W=" << W << " S=" << S << " M=" << c.m);
    DataParallelOptions o;
    for (const auto& st : c.stages) o.pipeline.stages.push_back(Spec(st));
    o.pipeline.workers = c.workers;
    o.pipeline.micro_batches = c.m;
    o.pipeline.loss = pipeline::MseLoss();
    o.replicas = static_cast<int>(R);
    auto dp = DataParallelPipeline::Create(workers.master(), o);
    ASSERT_TRUE(dp.ok()) << dp.status();
    const auto data = Data(4, 16, 6, 3);
    ASSERT_TRUE((*dp)->start_train_step(data[0].first, data[0].second).wait().ok());
    auto before = (*dp)->sent_messages();
    ASSERT_TRUE(before.ok()) << before.status();
    for (int i = 1; i < 4; ++i) {
      auto loss = (*dp)->start_train_step(data[i].first, data[i].second).wait();
      ASSERT_TRUE(loss.ok()) << loss.status();
    }
    auto after = (*dp)->sent_messages();
    ASSERT_TRUE(after.ok()) << after.status();
    int64_t total = 0;
    std::string listing;
    for (const auto& [kind, d] : StepMessagesBetween(*before, *after)) {
      total += d;
      listing += kind + ": " + std::to_string(d) + "\n";
    }
    EXPECT_EQ(total, 3 * (W + R * 2 * c.m * (S - 1))) << listing;
  }
}

TEST(DataParallel, AReplicaThatDiesFailsTheStepWithinTheTimeout) {
  if (!HaveGloo()) GTEST_SKIP() << "built without Gloo";
  Workers workers(2);
  workers.ExpectUncleanShutdown();  // w2 is killed
  DataParallelOptions o = TwoPlainReplicas();
  o.pipeline.micro_batches = 2;
  o.timeout = absl::Seconds(3);
  auto dp = DataParallelPipeline::Create(workers.master(), o);
  ASSERT_TRUE(dp.ok()) << dp.status();
  const auto data = Data(1, 8, 6, 3);
  ASSERT_TRUE((*dp)->start_train_step(data[0].first, data[0].second).wait().ok());
  workers.worker(1).Signal(SIGKILL);
  ASSERT_TRUE(workers.worker(1).Wait(absl::Seconds(10)).ok());
  const absl::Time start = absl::Now();
  auto loss = (*dp)->start_train_step(data[0].first, data[0].second).wait();
  ASSERT_FALSE(loss.ok());
  EXPECT_THAT(loss.status().message(), HasSubstr("w2"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  // The group cannot shut down gracefully without w2.
  workers.master().Shutdown(/*graceful=*/false).IgnoreError();
}

// On a GPU machine (scripts/gpu_check.sh runs the Cuda* tests): members on
// CUDA devices make an NCCL group where the build has them and each member
// has a GPU of its own, and sum on their devices; members that share a GPU
// (or a build without NCCL groups) sum over Gloo in host memory instead.
TEST(CudaProcessGroup, MembersOnGpusSumOverNcclOrOverGlooWhenTheyShareOne) {
  if (!HaveGloo()) GTEST_SKIP() << "built without Gloo";
  const int gpus = channel::LocalGpuCount();
  if (gpus == 0) GTEST_SKIP() << "no GPU here";
  auto store = StoreServer::Start("127.0.0.1");
  ASSERT_TRUE(store.ok()) << store.status();
  // Two members on GPUs 0 and 1 (or both on 0), then one member alone.
  for (int size : {2, 1}) {
    SCOPED_TRACE(absl::StrCat(size, " members on ", gpus, " GPUs"));
    std::vector<at::Tensor> sums(size);
    std::vector<absl::Status> status(size);
    std::vector<int> on_device(size, -1);
    std::vector<std::thread> members;
    for (int r = 0; r < size; ++r) {
      members.emplace_back([&, r] {
        GroupOptions g{(*store)->host(), (*store)->port(), absl::StrCat("cuda", size), r, size};
        g.cuda_device = r % gpus;
        auto group = ProcessGroup::Join(g);
        if (!group.ok()) {
          status[r] = group.status();
          return;
        }
        on_device[r] = (*group)->on_device();
        at::Tensor t = at::full({5}, float(r + 1));
        if ((*group)->on_device()) t = t.to(c10::Device(c10::kCUDA, g.cuda_device));
        status[r] = (*group)->AllReduceSum(t).Wait();
        sums[r] = t.cpu();
      });
    }
    for (auto& t : members) t.join();
    const bool nccl = HaveNcclGroups() && (size == 1 || gpus >= 2);
    for (int r = 0; r < size; ++r) {
      ASSERT_TRUE(status[r].ok()) << status[r];
      EXPECT_EQ(on_device[r], nccl ? 1 : 0) << "rank " << r;
      EXPECT_TRUE(at::equal(sums[r], at::full({5}, float(size * (size + 1) / 2)))) << sums[r];
    }
  }
}

// Replicas of a CUDA stage train like one process (on one GPU the two
// replicas share it, so their group sums over Gloo, staging the gradients
// through host memory; on two or more the stage is on cuda:0 in both, the
// same).
TEST(CudaDataParallel, ReplicasOfACudaStageMatchOneProcess) {
  if (!HaveGloo()) GTEST_SKIP() << "built without Gloo";
  if (channel::LocalGpuCount() == 0) GTEST_SKIP() << "no GPU here";
  // Workers on the GPU, as users start them: their activations go to each
  // other's cuda:0 (worker --device-map auto), to the master's CPU.
  Workers workers(4, "worker", {"--device", "cuda:0"});
  // Hybrid (2 stages x 2 replicas), then plain data parallelism.
  ExpectParity(workers.master(), {"w1", "w2", "w3", "w4"}, 2, {Mlp(6, 5, 1), Mlp(5, 3, 2, false)},
               "1f1b", /*overlap=*/true, "cuda:0", /*tolerance=*/1e-4);
  ExpectParity(workers.master(), {"w1", "w2"}, 2, {Mlp(6, 3, 7, false)}, "1f1b",
               /*overlap=*/true, "cuda:0", /*tolerance=*/1e-4);
}

// The collective benchmark runs its ranks as processes and prints a row
// per size.
TEST(CollectiveBench, PrintsAllReduceBandwidthBesideMemcpy) {
  if (!HaveGloo()) GTEST_SKIP() << "built without Gloo";
  auto [code, out] = RunProgram(
      {BinDir() + "/collective_bench", "--ranks", "2", "--reps", "1"}, absl::Seconds(120));
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("allreduce_ms"));
  EXPECT_THAT(out, HasSubstr("     2        64Mi"));
  for (const char* ranks : {"1", "2,,4"}) {
    auto [bad, message] = RunProgram({BinDir() + "/collective_bench", "--ranks", ranks}, absl::Seconds(30));
    EXPECT_EQ(bad, 2);
    EXPECT_THAT(message, HasSubstr("--ranks wants counts in 2..16"));
  }
  auto [internal, internal_out] = RunProgram({BinDir() + "/collective_bench", "--rank", "1"}, absl::Seconds(30));
  EXPECT_EQ(internal, 2);
  EXPECT_THAT(internal_out, HasSubstr("--rank and --store go together"));
}

}  // namespace
}  // namespace remora::parallel
