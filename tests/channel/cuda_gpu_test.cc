// The CUDA channel on GPUs (CudaGpu.*): staging, device maps, CUDA IPC
// between processes on one GPU, NCCL between GPUs, failures, and the
// ResNet50 pipeline on GPU workers. Each test skips, saying why, where the
// GPUs or the channel it needs are missing.
#include <csignal>
#include <fstream>

#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "launch/cli.h"
#include "launch/local_group.h"
#include "rpc/codec.h"
#include "channel/cuda/cuda_channel.h"
#include "channel/devices.h"
#include "rpc/message.h"
#include "tests/support/master_runs.h"
#include "tests/support/script_models.h"
#include "tests/support/test_functions.h"
#include "tests/support/test_group.h"

#ifdef REMORA_TORCH_CUDA
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace remora {
namespace {

using ::testing::HasSubstr;


c10::Device Cuda(int i) { return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)); }

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// --- GPUs -------------------------------------------------------------------------
// Everything below needs GPUs and skips, with the reason, where there are none.

#define REMORA_REQUIRE_GPUS(n)                                                              \
  do {                                                                                      \
    if (channel::LocalGpuCount() < (n)) {                                                            \
      GTEST_SKIP() << "needs " << (n) << " GPU(s); this process's LibTorch sees "           \
                   << channel::LocalGpuCount();                                                      \
    }                                                                                       \
  } while (0)

#define REMORA_REQUIRE_CHANNEL()                                                            \
  do {                                                                                      \
    if (!channel::CudaChannelBuilt()) GTEST_SKIP() << channel::kNoCudaBuild;                                  \
  } while (0)

// Waits until `done()` or 20 s (what happens in the background, e.g. a
// release, is not instantaneous; no timing is asserted).
template <typename F>
bool Eventually(F done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

TEST(CudaGpu, UnmappedCudaTensorFailsAtSendTimeNamingDeviceAndPeer) {
  REMORA_REQUIRE_GPUS(1);
  Group g(1);
  at::Tensor x = at::ones({8}, at::TensorOptions().device(Cuda(0)));
  auto r = g.master().rpc_sync("w1", "echo", {x});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(r.status()), HasSubstr("tensor on cuda:0"));
  EXPECT_THAT(Message(r.status()), HasSubstr("'w1'"));
}

TEST(CudaGpu, AgentsInOneProcessStageThroughHostMemory) {
  REMORA_REQUIRE_GPUS(1);
  rpc::AgentOptions opts;
  opts.device = "cuda:0";
  opts.map_to_peer_devices = true;
  Group g(1, opts);
  EXPECT_EQ(g.master().channel_to("w1", "cuda:0").value(), "staged:shm");
  at::Tensor x = at::randn({512, 512}, at::TensorOptions().device(Cuda(0)));
  EXPECT_EQ(g.master().rpc_sync("w1", "device_of", {x}).value().toStringRef(), "cuda:0");
  auto y = g.master().rpc_sync("w1", "echo", {x});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->toTensor().device(), Cuda(0));
  EXPECT_TRUE(at::equal(y->toTensor(), x));
}

TEST(CudaGpu, MappedToTheCpuArrivesOnTheCpu) {
  REMORA_REQUIRE_GPUS(1);
  rpc::AgentOptions opts;
  opts.device_maps["w1"]["cuda:0"] = "cpu";
  Group g(1, opts);
  at::Tensor x = at::randn({64}, at::TensorOptions().device(Cuda(0)));
  EXPECT_EQ(g.master().rpc_sync("w1", "device_of", {x}).value().toStringRef(), "cpu");
}

TEST(CudaGpu, ShardsLiveOnTheirWorkersDevice) {
  REMORA_REQUIRE_GPUS(1);
  rpc::AgentOptions opts;
  opts.device = "cuda:0";
  opts.map_to_peer_devices = true;
  Group g(1, opts);
  rpc::RRef head = g.master().remote("w1", "ResNetShard", {int64_t{17}, int64_t{18}, int64_t{0}}).value();
  rpc::RRef y = head.remote("forward", {at::randn({2, 2048, 4, 4})}).value();  // a CPU input
  EXPECT_EQ(g.master().rpc_sync("w1", "device_of", {y}).value().toStringRef(), "cuda:0");
  auto out = y.to_here();
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->toTensor().device(), Cuda(0));  // the master's home device
  EXPECT_EQ(out->toTensor().sizes(), (std::vector<int64_t>{2, 1000}));
}

// This process as the master on cuda:0 and one `test_worker` process "w1" on
// `device`, where the master's cuda:0 maps.
absl::StatusOr<launch::LocalGroup> StartWorkerOn(const rpc::Registry& registry, const std::string& device,
                                              absl::Duration rpc_timeout = absl::Seconds(60),
                                              std::vector<std::string> env = {}) {
  rpc::AgentOptions opts;
  opts.device = "cuda:0";
  opts.device_maps["w1"]["cuda:0"] = device;
  opts.rpc_timeout = rpc_timeout;
  launch::WorkerProgram program("test_worker");
  program.env = std::move(env);
  return launch::StartLocalGroup({"w1"}, &registry, {"--device", device}, opts, program);
}

#ifdef REMORA_TORCH_CUDA
// 4 Mi elements of `value` on cuda:0, written on LibTorch's current stream
// behind about half a second of matrix products (bounded; 27 TFLOP).
at::Tensor FullBehindProducts(double value) {
  const auto on0 = at::TensorOptions().device(Cuda(0));
  at::Tensor a = at::randn({4096, 4096}, on0);
  const at::Tensor b = at::randn({4096, 4096}, on0).div(64);
  for (int i = 0; i < 200; ++i) a = at::matmul(a, b).tanh();
  return at::full({1 << 22}, value, on0).add(a.sum().mul(0));
}

// Sends a worker process on `device` (reached by `channel`) tensors that a
// side stream produces behind about half a second of matrix products, from
// that stream and without waiting for it on the host: the channel must
// order the transfer after the producer (an event on LibTorch's current
// stream), or the worker copies stale memory. `stream_ordered`: as the
// pipeline's pushes and gradients go (CallOptions::stream_group), the
// worker's handler queues its sum behind the copy on the GPU, with no wait
// on the host, and reads it once its receives are settled.
// `stream_receives`: the worker's REMORA_CUDA_STREAM_RECEIVES ("": unset,
// where only NCCL's receives wait on the GPU).
void ExpectSentAfterItsProducer(const std::string& device, const std::string& channel, bool stream_ordered,
                                const std::string& stream_receives = "1") {
  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  std::vector<std::string> env;
  if (!stream_receives.empty()) env.push_back("REMORA_CUDA_STREAM_RECEIVES=" + stream_receives);
  const bool on_gpu = stream_receives == "1" || (stream_receives.empty() && channel == "nccl");
  auto group = StartWorkerOn(registry, device, absl::Seconds(60), env);
  ASSERT_TRUE(group.ok()) << group.status();
  rpc::Agent& master = *group->master;
  ASSERT_EQ(master.channel_to("w1", "cuda:0").value(), channel) << master.cuda_disabled_reason();
  const auto on0 = at::TensorOptions().device(Cuda(0));
  for (int round = 1; round <= 3; ++round) {
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0);
    c10::cuda::CUDAStreamGuard current(side);
    const double value = 0.5 * round;
    if (!stream_ordered) {
      auto y = master.rpc_sync("w1", "echo", {FullBehindProducts(value)});
      ASSERT_TRUE(y.ok()) << y.status();
      EXPECT_TRUE(at::equal(y->toTensor(), at::full({1 << 22}, value, on0)))
          << "the transfer read the tensor before its producer wrote it";
      continue;
    }
    auto r =
        master.rpc_sync("w1", "settled_sum", {FullBehindProducts(value), int64_t{round}}, rpc::StreamOrdered(round));
    ASSERT_TRUE(r.ok()) << r.status();
    const auto t = r->toTupleRef().elements();
    EXPECT_DOUBLE_EQ(t[0].toDouble(), value * (1 << 22)) << "the sum read the tensor before the copy";
    EXPECT_EQ(t[1].toInt(), on_gpu ? round : 0) << "receives left to the worker's stream so far";
  }
  EXPECT_TRUE(Eventually([&] { return master.cuda_stats().held_buffers == 0; }))
      << "the worker never released " << master.cuda_stats().held_buffers << " buffers";
  ASSERT_TRUE(group->Shutdown().ok());
}
#endif

// Real worker processes on the master's GPU: CUDA IPC both ways.
TEST(CudaGpu, IpcBetweenProcessesOnOneGpu) {
  REMORA_REQUIRE_CHANNEL();
  REMORA_REQUIRE_GPUS(1);
  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  auto group = StartWorkerOn(registry, "cuda:0");
  ASSERT_TRUE(group.ok()) << group.status();
  rpc::Agent& master = *group->master;
  ASSERT_EQ(master.channel_to("w1", "cuda:0").value(), "cuda_ipc")
      << master.cuda_disabled_reason();
  std::vector<at::Tensor> xs;
  std::vector<rpc::Future<c10::IValue>> ys;
  for (int i = 0; i < 8; ++i) {
    xs.push_back(at::randn({1 << 20}, at::TensorOptions().device(Cuda(0))));  // 4 MiB
    ys.push_back(master.rpc_async("w1", "echo", {xs.back()}));
  }
  for (int i = 0; i < 8; ++i) {
    auto y = ys[i].wait();
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_EQ(y->toTensor().device(), Cuda(0));
    EXPECT_TRUE(at::equal(y->toTensor(), xs[i]));
  }
  // A view sends only its own elements.
  at::Tensor view = xs[0].narrow(0, 1000, 4096);
  EXPECT_TRUE(at::equal(master.rpc_sync("w1", "echo", {view}).value().toTensor(), view));
  EXPECT_EQ(master.rpc_sync("w1", "device_of", {xs[0]}).value().toStringRef(), "cuda:0");
  channel::CudaChannel::Stats s = master.cuda_stats();
  EXPECT_GE(s.ipc_sends, 9);
  EXPECT_GE(s.ipc_receives, 9);  // the echoes came back the same way
  EXPECT_TRUE(Eventually([&] { return master.cuda_stats().held_buffers == 0; }))
      << "the worker never released " << master.cuda_stats().held_buffers << " buffers";
  ASSERT_TRUE(group->Shutdown().ok());
}

TEST(CudaGpu, IpcWaitsForAProducerOnAnotherStream) {
#ifndef REMORA_TORCH_CUDA
  GTEST_SKIP() << "needs a LibTorch with CUDA (its stream API) at build time";
#else
  REMORA_REQUIRE_CHANNEL();
  REMORA_REQUIRE_GPUS(1);
  ExpectSentAfterItsProducer("cuda:0", "cuda_ipc", /*stream_ordered=*/false);
#endif
}

// The pipeline's pushes and gradients: the receive leaves its wait to the
// worker's stream, on the GPU.
TEST(CudaGpu, StreamOrderedIpcQueuesBehindTheCopyAndSettles) {
#ifndef REMORA_TORCH_CUDA
  GTEST_SKIP() << "needs a LibTorch with CUDA (its stream API) at build time";
#else
  REMORA_REQUIRE_CHANNEL();
  REMORA_REQUIRE_GPUS(1);
  ExpectSentAfterItsProducer("cuda:0", "cuda_ipc", /*stream_ordered=*/true);
#endif
}

// By default a CUDA IPC receive (two processes on one GPU) waits on the
// host even in a stream-ordered call: the sum is right and the worker
// left nothing to its stream.
TEST(CudaGpu, StreamOrderedIpcWaitsOnTheHostByDefault) {
#ifndef REMORA_TORCH_CUDA
  GTEST_SKIP() << "needs a LibTorch with CUDA (its stream API) at build time";
#else
  REMORA_REQUIRE_CHANNEL();
  REMORA_REQUIRE_GPUS(1);
  ExpectSentAfterItsProducer("cuda:0", "cuda_ipc", /*stream_ordered=*/true, /*stream_receives=*/"");
#endif
}

TEST(CudaGpu, NcclWaitsForAProducerOnAnotherStream) {
#ifndef REMORA_TORCH_CUDA
  GTEST_SKIP() << "needs a LibTorch with CUDA (its stream API) at build time";
#else
  REMORA_REQUIRE_CHANNEL();
  REMORA_REQUIRE_GPUS(2);
  ExpectSentAfterItsProducer("cuda:1", "nccl", /*stream_ordered=*/false);
#endif
}

TEST(CudaGpu, StreamOrderedNcclQueuesBehindTheTransferAndSettles) {
#ifndef REMORA_TORCH_CUDA
  GTEST_SKIP() << "needs a LibTorch with CUDA (its stream API) at build time";
#else
  REMORA_REQUIRE_CHANNEL();
  REMORA_REQUIRE_GPUS(2);
  ExpectSentAfterItsProducer("cuda:1", "nccl", /*stream_ordered=*/true, /*stream_receives=*/"");  // the default
#endif
}

// A worker on the second GPU: NCCL, many transfers in flight at once.
TEST(CudaGpu, NcclBetweenTwoGpusKeepsTransfersInOrder) {
  REMORA_REQUIRE_CHANNEL();
  REMORA_REQUIRE_GPUS(2);
  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  auto group = StartWorkerOn(registry, "cuda:1");
  ASSERT_TRUE(group.ok()) << group.status();
  rpc::Agent& master = *group->master;
  ASSERT_EQ(master.channel_to("w1", "cuda:0").value(), "nccl") << master.cuda_disabled_reason();
  std::vector<at::Tensor> xs;
  std::vector<rpc::Future<c10::IValue>> ys;
  for (int i = 0; i < 32; ++i) {
    // Different sizes: a receive posted out of order would not match.
    xs.push_back(at::randn({1000 + 977 * i}, at::TensorOptions().device(Cuda(0))));
    ys.push_back(master.rpc_async("w1", "echo", {xs.back()}));
  }
  for (int i = 0; i < 32; ++i) {
    auto y = ys[i].wait();
    ASSERT_TRUE(y.ok()) << y.status();
    EXPECT_EQ(y->toTensor().device(), Cuda(0));
    EXPECT_TRUE(at::equal(y->toTensor(), xs[i]));
  }
  EXPECT_EQ(master.rpc_sync("w1", "device_of", {xs[0]}).value().toStringRef(), "cuda:1");
  EXPECT_GE(master.cuda_stats().nccl_sends, 33);
  EXPECT_GE(master.cuda_stats().nccl_receives, 32);
  ASSERT_TRUE(group->Shutdown().ok());
}

// The first send on a new communicator stays in progress until the
// receiver posts its receive, which needs the very message that is being
// built: a message with several CUDA tensors must still leave at once.
TEST(CudaGpu, NcclFirstMessageWithSeveralTensorsDoesNotWait) {
  REMORA_REQUIRE_CHANNEL();
  REMORA_REQUIRE_GPUS(2);
  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  auto group = StartWorkerOn(registry, "cuda:1", absl::Seconds(30));
  ASSERT_TRUE(group.ok()) << group.status();
  rpc::Agent& master = *group->master;
  const auto on0 = at::TensorOptions().device(Cuda(0));
  const std::vector<at::Tensor> xs = {at::randn({1 << 20}, on0), at::randn({4096}, on0),
                                      at::randn({3, 5}, on0)};
  const absl::Time start = absl::Now();
  auto y = master.rpc_sync("w1", "echo", {c10::ivalue::Tuple::create(std::vector<c10::IValue>(
                                             xs.begin(), xs.end()))});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the message waited for its first send";
  const auto& back = y->toTupleRef().elements();
  ASSERT_EQ(back.size(), xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    EXPECT_EQ(back[i].toTensor().device(), Cuda(0));
    EXPECT_TRUE(at::equal(back[i].toTensor(), xs[i])) << "tensor " << i;
  }
  EXPECT_GE(master.cuda_stats().nccl_sends, 3);
  EXPECT_GE(master.cuda_stats().nccl_receives, 3);
  EXPECT_EQ(master.cuda_stats().aborted, 0);
  ASSERT_TRUE(group->Shutdown().ok());
}

TEST(CudaGpu, NcclToAWorkerThatDiedFailsTheCallInsteadOfHanging) {
  REMORA_REQUIRE_CHANNEL();
  REMORA_REQUIRE_GPUS(2);
  rpc::Registry registry;
  ASSERT_TRUE(test_support::RegisterForTests(registry).ok());
  auto group = StartWorkerOn(registry, "cuda:1", absl::Seconds(20));
  ASSERT_TRUE(group.ok()) << group.status();
  rpc::Agent& master = *group->master;
  at::Tensor x = at::randn({1 << 20}, at::TensorOptions().device(Cuda(0)));
  ASSERT_TRUE(master.rpc_sync("w1", "sink", {x}).ok());  // the communicator exists
  group->workers[0]->Signal(SIGKILL);
  ASSERT_TRUE(group->workers[0]->Wait(absl::Seconds(10)).ok());
  auto r = master.rpc_sync("w1", "sink", {x});
  EXPECT_FALSE(r.ok());
  EXPECT_THAT(Message(r.status()), HasSubstr("w1"));
  master.Shutdown(/*graceful=*/false).IgnoreError();
}

TEST(CudaGpu, ResNetPipelineOnGpuWorkersMatchesLocalTraining) {
  REMORA_REQUIRE_GPUS(1);
  const int port = FreePort();
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  std::vector<std::unique_ptr<launch::Subprocess>> workers;
  setenv("REMORA_DEBUG", "channels", 1);  // the workers log their routes
  for (const char* name : {"worker1", "worker2"}) {
    workers.push_back(launch::Subprocess::Spawn({BinDir() + "/worker", "--name", name, "--master", addr,
                                              "--device", "cuda:0"},
                                             TempPath(std::string(name) + ".log"))
                          .value());
  }
  // Three batches: the later ones train on what the first's gradients,
  // which came back GPU to GPU, did to the weights. Not 8 images of 32x32:
  // there ResNet50's batch norms see 4 rows of 1x1 and training is so
  // ill-conditioned that the summation order alone (one intra-op thread
  // against two, in one process on the CPU) moves the second batch's loss
  // by 2.5%; 16 images of 64x64 move it by 0.6% at most. And on a GPU
  // cuDNN's fastest kernels there are not reproducible run to run (one
  // process's batch 2 came out 0.583 and 0.579 on an H200): both runs use
  // the deterministic ones.
  const std::vector<std::string> small = {"--batches", "3", "--batch-size", "16", "--image-size",
                                          "64",        "--splits",  "2",  "--deterministic"};
  std::vector<std::string> argv = {BinDir() + "/master", "--workers", "worker1,worker2",
                                   "--listen", addr, "--report", TempPath("gpu.json")};
  argv.insert(argv.end(), small.begin(), small.end());
  auto [code, out] = RunProgram(argv, absl::Seconds(240));
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  unsetenv("REMORA_DEBUG");
  ASSERT_EQ(code, 0) << out;
  EXPECT_THAT(out, HasSubstr("worker1: shards on cuda:0"));
  // Activations went GPU to GPU, not through host memory.
  std::ifstream log(TempPath("worker1.log"));
  const std::string worker_log((std::istreambuf_iterator<char>(log)),
                               std::istreambuf_iterator<char>());
  EXPECT_THAT(worker_log, HasSubstr("-> 'worker2': cuda:0 -> its cuda:0 via cuda_ipc"));
  std::vector<std::string> local = {BinDir() + "/master", "--local", "--device", "cuda:0"};
  local.insert(local.end(), small.begin(), small.end());
  auto [local_code, local_out] = RunProgram(local, absl::Seconds(240));
  ASSERT_EQ(local_code, 0) << local_out;
  auto loss = [](const std::string& text, int b) {
    const std::string key = absl::StrCat("batch=", b, " loss=");
    const auto at = text.find(key);
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + key.size()));
  };
  // Same weights, same images: each batch's loss agrees (TF32 and kernel
  // choices differ a little between the two runs; an activation or a
  // gradient read before its copy completed would not).
  for (int b = 0; b < 3; ++b) {
    ASSERT_GT(loss(out, b), 0) << out;
    EXPECT_NEAR(loss(out, b), loss(local_out, b), 2e-2 * loss(local_out, b)) << "batch " << b;
  }
}

// A scripted GPT cut where several tensors cross (the token ids, an integer
// tensor without a gradient, beside the embeddings) on two GPU workers: the
// tuple goes GPU to GPU over CUDA IPC, each element's gradient (where it
// has one) comes back, and every epoch's losses are one process's on the
// GPU.
TEST(CudaGpu, SeveralTensorsAcrossACutTrainOnGpuWorkersAsInOneProcess) {
  REMORA_REQUIRE_GPUS(1);
  // The cut after wte leaves idx (for the positions) and tok to cross.
  torch::jit::Module gpt = test_support::ScriptByteGpt(R"(def forward(self, idx):
  tok = self.wte.forward(idx)
  pos = torch.arange(idx.size(1), device=idx.device)
  x = tok + torch.embedding(self.wpe, pos)
  x = self.h0.forward(x)
  x = self.h1.forward(x)
  return self.head.forward(x)
)");
  const std::string model = TempPath("gpu_gpt.pt");
  gpt.save(model);
  const std::string text = test_support::WriteText("gpu_gpt.txt");
  const std::string dir = test_support::FreshDir("gpu_gpt");
  // (Named before TMPDIR changes: some GoogleTest releases' TempDir()
  // follow it.)
  const std::string worker1_log = TempPath("gpu_gpt_worker1.log"), worker2_log = TempPath("gpu_gpt_worker2.log");
  setenv("TMPDIR", dir.c_str(), 1);  // (the tokens)
  const std::vector<std::string> common = {"--model", model, "--dataset", "text:" + text, "--seq-len", "16",
                                           "--batch-size", "8", "--epochs", "2", "--train-rows", "32",
                                           "--seed", "5", "--splits", "2", "--deterministic"};
  auto master = [&](std::vector<std::string> args) {
    args.insert(args.begin(), BinDir() + "/master");
    args.insert(args.end(), common.begin(), common.end());
    return args;
  };
  auto [local_code, local_out] = RunProgram(master({"--local", "--device", "cuda:0"}), absl::Seconds(180));
  ASSERT_EQ(local_code, 0) << local_out;
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  setenv("REMORA_DEBUG", "channels", 1);  // the workers log their routes
  std::vector<std::unique_ptr<launch::Subprocess>> workers;
  for (const auto& [name, log] : {std::pair{"worker1", worker1_log}, std::pair{"worker2", worker2_log}}) {
    workers.push_back(launch::Subprocess::Spawn({BinDir() + "/worker", "--name", name, "--master", addr,
                                              "--device", "cuda:0"},
                                             log)
                          .value());
  }
  auto [code, out] = RunProgram(master({"--workers", "worker1,worker2", "--listen", addr, "--split-at", "1"}),
                                absl::Seconds(180));
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  unsetenv("REMORA_DEBUG");
  RestoreTmpdir();
  ASSERT_EQ(code, 0) << out;
  // Stage 1 begins with idx.size(1): the token ids cross beside tok.
  EXPECT_THAT(out, HasSubstr("stage 1 on worker2: size, arange")) << out;
  std::ifstream log(worker1_log);
  const std::string worker_log((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_THAT(worker_log, HasSubstr("-> 'worker2': cuda:0 -> its cuda:0 via cuda_ipc")) << worker_log;
  const std::vector<double> piped = test_support::EpochField(out, "train_loss");
  const std::vector<double> local = test_support::EpochField(local_out, "train_loss");
  ASSERT_EQ(piped.size(), 2u) << out;
  ASSERT_EQ(local.size(), 2u) << local_out;
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_NEAR(piped[e], local[e], 1e-4 * local[e]) << "epoch " << e + 1 << "\n" << out << "\n" << local_out;
  }
}

}  // namespace
}  // namespace remora
