// A master of one's own (docs/writing-your-own-master.md) that forgets a
// set-up step gets an error saying what to call, never an abort, and its
// worker processes (the stock `worker`) are told to stop and exit 0: a
// master without autograd::Enable, the training loop reaching the
// step without it (where such a master used to end in std::terminate), and
// a local group whose master returns an error.
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ops/randint.h>
#include <ATen/ops/randn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "autograd/dist_autograd.h"
#include "data/source.h"
#include "launch/local_group.h"
#include "pipeline/pipeline.h"
#include "tests/support/test_group.h"
#include "train/fit.h"
#include "train/pipeline_trainer.h"
#include "train/worker_functions.h"

namespace remora {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

// A master made with Agent::Start (as a cluster's is) that does NOT call
// autograd::Enable, and stock worker programs w1, w2 that joined it.
struct ClusterWithoutAutograd {
  ClusterWithoutAutograd() {
    EXPECT_TRUE(train::RegisterWorkerFunctions(registry).ok());
    master = rpc::Agent::Start(MasterOptions({"w1", "w2"}), &registry).value();
    for (const std::string name : {"w1", "w2"}) {
      workers.push_back(launch::Subprocess::Spawn({BinDir() + "/worker", "--name", name, "--master",
                                                   master->self().address, "--threads", "1"})
                            .value());
    }
    EXPECT_TRUE(master->Join().ok());
  }
  // Ends the group gracefully; every worker must exit 0.
  void End() {
    EXPECT_TRUE(master->Shutdown().ok());
    for (size_t i = 0; i < workers.size(); ++i) {
      EXPECT_EQ(workers[i]->Wait(absl::Seconds(30)).value_or(-1), 0) << "worker w" << i + 1;
    }
  }

  rpc::Registry registry;
  std::unique_ptr<rpc::Agent> master;
  std::vector<std::unique_ptr<launch::Subprocess>> workers;
};

// Two MLP stages over w1 and w2, or (replicas 2) one stage per replica.
parallel::DataParallelOptions SetupOptions(int replicas, pipeline::LossFn loss = pipeline::CrossEntropyLoss()) {
  parallel::DataParallelOptions o;
  if (replicas == 1) {
    o.pipeline.stages = {pipeline::StageSpec::Registered("MLPStage", {int64_t{8}, int64_t{16}, int64_t{1}}),
                         pipeline::StageSpec::Registered("MLPStage", {int64_t{16}, int64_t{3}, int64_t{2}, false})};
  } else {
    o.pipeline.stages = {pipeline::StageSpec::Registered("MLPStage", {int64_t{8}, int64_t{3}, int64_t{1}, false})};
  }
  o.pipeline.workers = {"w1", "w2"};
  o.pipeline.schedule = "1f1b";
  o.pipeline.micro_batches = 2;
  o.pipeline.loss = std::move(loss);
  o.pipeline.optimizer = optim::OptimizerOptions::SGD(0.05);
  o.replicas = replicas;
  return o;
}

data::Dataset Toy(int64_t rows) { return {at::randn({rows, 8}), at::randint(0, 3, {rows})}; }

TEST(MasterSetup, AMasterWithoutDistAutogradGetsFailedPreconditionAndItsWorkersExitZero) {
  ClusterWithoutAutograd c;
  rpc::Agent& master = *c.master;
  const auto says_what_to_call = AllOf(HasSubstr("distributed autograd is not enabled on the master (agent 'master')"),
                                       HasSubstr("call autograd::Enable(agent)"));
  for (int replicas : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(replicas, " replicas"));
    auto trainer = train::PipelineTrainer::Create(master, SetupOptions(replicas));
    ASSERT_FALSE(trainer.ok());
    EXPECT_EQ(trainer.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(trainer.status().message()),
                AllOf(says_what_to_call, HasSubstr("before making a trainer (train::PipelineTrainer::Create)")));
  }
  auto dp = parallel::DataParallelPipeline::Create(master, SetupOptions(2));
  ASSERT_FALSE(dp.ok());
  EXPECT_EQ(dp.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(dp.status().message()), says_what_to_call);
  auto pipe = pipeline::Pipeline::Create(master, SetupOptions(1).pipeline);
  ASSERT_FALSE(pipe.ok());
  EXPECT_EQ(pipe.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(pipe.status().message()), AllOf(says_what_to_call, HasSubstr("before making a pipeline")));
  // The lower-level calls say the same, none throws.
  EXPECT_EQ(autograd::NewContextId(master).status().code(), absl::StatusCode::kFailedPrecondition);
  {
    autograd::Context context(master);
    EXPECT_EQ(context.id(), rpc::kNoContext);
    EXPECT_THAT(std::string(context.status().message()), says_what_to_call);
    const absl::Status backward = autograd::backward(master, context.id(), {at::randn({2}).requires_grad_()});
    EXPECT_EQ(backward.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(autograd::get_gradients(master, context.id()).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  // What the error says to do works, after Join too.
  autograd::Enable(master);
  {
    auto made = train::PipelineTrainer::Create(master, SetupOptions(1));
    ASSERT_TRUE(made.ok()) << made.status();
    const data::Dataset batch = Toy(8);
    auto loss = (*made)->StartStep({batch.images, batch.labels}).wait();
    ASSERT_TRUE(loss.ok()) << loss.status();
  }
  c.End();
}

// The path where a master without distributed autograd used to abort:
// train::Fit's first step asked for a context id (autograd::
// NewContextId, from DataParallelPipeline::StartOnReplicas under
// PipelineTrainer::StartStep) and the exception it threw left Fit on the
// master's own thread; with a loss computed on the master, a replica's
// thread (DataParallelPipeline::TrainHere) threw it. Trainers check it
// when they are made now; here it is taken away after, so that the step
// meets it: Fit returns the error.
TEST(MasterSetup, FitReachingAStepWithoutDistAutogradReturnsTheErrorInsteadOfAborting) {
  ClusterWithoutAutograd c;
  rpc::Agent& master = *c.master;
  const data::Dataset train_set = Toy(32), test_set = Toy(16);
  const pipeline::LossFn on_master = [](const c10::IValue& out, const c10::IValue& target) {
    return pipeline::CrossEntropyLoss()(out, target);
  };
  for (const bool named : {true, false}) {
    for (int replicas : {1, 2}) {
      SCOPED_TRACE(absl::StrCat(named ? "a named loss, " : "a loss on the master, ", replicas, " replicas"));
      autograd::Enable(master);
      auto trainer =
          train::PipelineTrainer::Create(master, SetupOptions(replicas, named ? pipeline::CrossEntropyLoss() : on_master));
      ASSERT_TRUE(trainer.ok()) << trainer.status();
      master.set_autograd(nullptr);
      train::TrainOptions t;
      t.fit.epochs = 1;
      t.fit.batch_size = 8;
      t.fit.min_batch_rows = 4;
      std::ostringstream out;
      auto epochs = train::Fit(**trainer, data::InMemory(train_set), data::InMemory(test_set), t, out);
      ASSERT_FALSE(epochs.ok());
      EXPECT_EQ(epochs.status().code(), absl::StatusCode::kFailedPrecondition) << epochs.status();
      EXPECT_THAT(std::string(epochs.status().message()),
                  HasSubstr("distributed autograd is not enabled on the master (agent 'master'): call "
                            "autograd::Enable(agent)"));
    }
  }
  c.End();
}

// A master of one's own on a local group returns early with an error (a
// stage type the workers do not have): the group ends as it goes out of
// scope, its workers told to stop, and they exit 0, at the addresses
// LocalGroupOptions gave them. Each worker runs under a shell that writes
// the worker's exit code to a file once it has exited (a group that killed
// its workers instead would kill the shells: no file).
TEST(LocalGroup, AMasterThatReturnsAnErrorEndsItsGroupAndTheWorkersExitZero) {
  rpc::Registry registry;
  ASSERT_TRUE(train::RegisterWorkerFunctions(registry).ok());
  const std::string codes = TempPath("exit_codes");
  ASSERT_EQ(system(absl::StrCat("rm -rf '", codes, "' && mkdir -p '", codes, "'").c_str()), 0);
  launch::LocalGroupOptions o;
  o.program = launch::WorkerProgram(
      "/bin/sh", {"-c", "\"$REMORA_TEST_WORKER\" \"$@\"; echo $? >\"$REMORA_TEST_CODES/$2\"", "sh"});
  o.program.env = {"REMORA_TEST_WORKER=" + BinDir() + "/worker", "REMORA_TEST_CODES=" + codes};
  o.worker_args = {"--threads", "1"};
  o.worker_addresses = {absl::StrCat("127.0.0.1:", FreePort()), absl::StrCat("127.0.0.1:", FreePort())};
  auto user_master = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(launch::LocalGroup group, launch::StartLocalGroup({"w1", "w2"}, &registry, o));
    EXPECT_EQ(group.master->worker("w1").value().address, o.worker_addresses[0]);
    EXPECT_EQ(group.master->worker("w2").value().address, o.worker_addresses[1]);
    parallel::DataParallelOptions bad = SetupOptions(1);
    bad.pipeline.stages[1] = pipeline::StageSpec::Registered("NoSuchStage");
    ASSIGN_OR_RETURN(auto trainer, train::PipelineTrainer::Create(*group.master, std::move(bad)));
    return absl::OkStatus();
  };
  testing::internal::CaptureStderr();
  const absl::Status status = user_master();
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_FALSE(status.ok());
  EXPECT_THAT(std::string(status.message()), HasSubstr("NoSuchStage"));
  EXPECT_THAT(err, Not(HasSubstr("ending the local group"))) << err;
  for (const std::string name : {"w1", "w2"}) {
    EXPECT_EQ(ReadFile(codes + "/" + name), "0\n") << "worker " << name << "'s exit code; stderr:\n" << err;
  }
}

// LocalGroupOptions::worker_addresses is checked before anything starts:
// one per worker, distinct, free.
TEST(LocalGroup, WorkerAddressesAreCheckedBeforeAnyWorkerStarts) {
  rpc::Registry registry;
  launch::LocalGroupOptions o;
  o.worker_addresses = {"127.0.0.1:20001"};
  auto few = launch::StartLocalGroup({"w1", "w2"}, &registry, o);
  ASSERT_FALSE(few.ok());
  EXPECT_THAT(std::string(few.status().message()), HasSubstr("1 worker addresses"));
  o.worker_addresses = {"127.0.0.1:20002", "127.0.0.1:20002"};
  auto twice = launch::StartLocalGroup({"w1", "w2"}, &registry, o);
  ASSERT_FALSE(twice.ok());
  EXPECT_THAT(std::string(twice.status().message()), HasSubstr("worker 'w2'"));
  // A port in use (the master's, here): named with its worker.
  rpc::AgentOptions m = MasterOptions({"x"});
  auto other = rpc::Agent::Start(m, &registry);
  ASSERT_TRUE(other.ok()) << other.status();
  o.worker_addresses = {"127.0.0.1:0", (*other)->self().address};
  auto taken = launch::StartLocalGroup({"w1", "w2"}, &registry, o);
  ASSERT_FALSE(taken.ok());
  EXPECT_THAT(std::string(taken.status().message()), AllOf(HasSubstr("worker 'w2'"), HasSubstr("in use")));
  EXPECT_TRUE((*other)->Shutdown(/*graceful=*/false).ok());
}

}  // namespace
}  // namespace remora
