// Devices and the CUDA channel, everywhere: device parsing, device maps and
// their errors, the channel choice from endpoint information, descriptor
// checks, frames with CUDA payloads, and what a build or process without
// CUDA says. cuda_gpu_test.cc has the tests that need GPUs.
#include <csignal>

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
#include "tests/support/test_functions.h"
#include "tests/support/test_group.h"

namespace remora {
namespace {

using ::testing::HasSubstr;


const c10::Device kCpu(c10::kCPU);
c10::Device Cuda(int i) { return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)); }

// A participant as the address book would list it.
base::WorkerInfo Info(base::WorkerId id, const std::string& name, const std::string& host, uint32_t pid,
                std::vector<std::string> gpus, bool nccl = true,
                const std::string& device = "cpu") {
  base::WorkerInfo w;
  w.id = id;
  w.name = name;
  w.host_id = host;
  w.shm.pid = pid;
  w.cuda.gpus = std::move(gpus);
  w.cuda.nccl = nccl;
  w.cuda.incarnation = 1000 + id;
  w.device = device;
  return w;
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

// --- devices ---------------------------------------------------------------

TEST(Devices, ParseTakesCpuAndIndexedCudaOnly) {
  EXPECT_EQ(channel::ParseDevice("cpu", "x").value(), kCpu);
  EXPECT_EQ(channel::ParseDevice("cuda:0", "x").value(), Cuda(0));
  EXPECT_EQ(channel::ParseDevice("cuda:12", "x").value(), Cuda(12));
  for (const char* bad : {"cuda", "gpu", "cuda:-1", "cuda:01", "cuda:x", "", "CPU", "cuda:1:2"}) {
    auto d = channel::ParseDevice(bad, "--device");
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(Message(d.status()), HasSubstr("--device")) << bad;
  }
}

TEST(Devices, CheckLocalDeviceSaysWhatIsMissing) {
  EXPECT_TRUE(channel::CheckLocalDevice(kCpu).ok());
  const int gpus = channel::LocalGpuCount();
  absl::Status s = channel::CheckLocalDevice(Cuda(gpus));  // one past the last GPU
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(s), HasSubstr(absl::StrCat("cuda:", gpus, " is not available")));
  if (gpus == 0) {
    EXPECT_THAT(Message(s), HasSubstr("LibTorch has no CUDA"));
  } else {
    EXPECT_THAT(Message(s), HasSubstr(absl::StrCat("sees ", gpus, " GPU(s)")));
    EXPECT_TRUE(channel::CheckLocalDevice(Cuda(0)).ok());
  }
}

// --- device maps -----------------------------------------------------------

TEST(DeviceMaps, CpuTensorsAlwaysLandOnTheCpu) {
  auto m = channel::DeviceMapper::Create("me", {}, /*map_to_peer_devices=*/true, /*local_gpus=*/0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->Map(kCpu, Info(1, "w1", "h", 1, {}, true, "cuda:0")).value(), kCpu);
}

TEST(DeviceMaps, AnUnmappedCudaTensorIsAnErrorNamingDeviceAndPeer) {
  auto m = channel::DeviceMapper::Create("me", {{"w2", {{"cuda:0", "cuda:0"}}}}, false, /*local_gpus=*/2);
  ASSERT_TRUE(m.ok()) << m.status();
  const base::WorkerInfo w2 = Info(2, "w2", "h", 2, {"GPU-a", "GPU-b"});
  EXPECT_EQ(m->Map(Cuda(0), w2).value(), Cuda(0));
  auto unmapped = m->Map(Cuda(1), w2);
  EXPECT_EQ(unmapped.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(unmapped.status()), HasSubstr("tensor on cuda:1"));
  EXPECT_THAT(Message(unmapped.status()), HasSubstr("to worker 'w2'"));
  EXPECT_THAT(Message(unmapped.status()), HasSubstr("device_maps[\"w2\"][\"cuda:1\"]"));
  // Another peer has no entries at all.
  auto other = m->Map(Cuda(0), Info(3, "w3", "h", 3, {"GPU-a"}));
  EXPECT_THAT(Message(other.status()), HasSubstr("'w3'"));
}

TEST(DeviceMaps, EntriesWinOverPeerHomeDevices) {
  auto m = channel::DeviceMapper::Create("me", {{"w2", {{"cuda:1", "cpu"}}}}, /*map_to_peer_devices=*/true,
                                2);
  ASSERT_TRUE(m.ok()) << m.status();
  const base::WorkerInfo w2 = Info(2, "w2", "h", 2, {"GPU-a", "GPU-b"}, true, "cuda:1");
  EXPECT_EQ(m->Map(Cuda(0), w2).value(), Cuda(1));  // its home device
  EXPECT_EQ(m->Map(Cuda(1), w2).value(), kCpu);     // the entry
  const base::WorkerInfo master = Info(0, "master", "h", 9, {});
  EXPECT_EQ(m->Map(Cuda(0), master).value(), kCpu);  // the master trains on the CPU
  ASSERT_EQ(m->EntriesFor("w2").size(), 1u);
  EXPECT_TRUE(m->EntriesFor("nobody").empty());
}

TEST(DeviceMaps, AGpuThePeerDoesNotHaveIsAnError) {
  auto m = channel::DeviceMapper::Create("me", {{"w2", {{"cuda:0", "cuda:3"}}}}, false, 1);
  ASSERT_TRUE(m.ok()) << m.status();
  auto r = m->Map(Cuda(0), Info(2, "w2", "h", 2, {"GPU-a"}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(r.status()), HasSubstr("cuda:3"));
  EXPECT_THAT(Message(r.status()), HasSubstr("has 1 GPU(s)"));
  // A peer that advertises no GPUs (no CUDA channel) is not second-guessed:
  // the tensor is staged and the peer itself checks its device.
  EXPECT_EQ(m->Map(Cuda(0), Info(2, "w2", "h", 2, {})).value(), Cuda(3));
}

TEST(DeviceMaps, CreateRejectsBadEntries) {
  auto check = [](const channel::DeviceMapper::Maps& maps, int gpus, const std::string& text) {
    auto m = channel::DeviceMapper::Create("me", maps, false, gpus);
    EXPECT_FALSE(m.ok()) << text;
    EXPECT_THAT(Message(m.status()), HasSubstr(text));
  };
  check({{"w2", {{"cpu", "cuda:0"}}}}, 1, "only CUDA devices are mapped");
  check({{"w2", {{"cuda:0", "tpu"}}}}, 1, "'tpu' is not a device");
  check({{"w2", {{"gpu0", "cuda:0"}}}}, 1, "'gpu0' is not a device");
  check({{"w2", {{"cuda:1", "cuda:0"}}}}, 1, "has 1 GPU(s)");
  check({{"w2", {{"cuda:0", "cuda:0"}}}}, 0, "LibTorch without CUDA, or no GPU");
  check({{"me", {{"cuda:0", "cuda:0"}}}}, 1, "not a peer's name");
  check({{"bad name", {{"cuda:0", "cuda:0"}}}}, 1, "not a peer's name");
}

TEST(DeviceMapFlag, ParsesAutoNoneAndEntries) {
  auto a = launch::ParseDeviceMapFlag("auto");
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->to_peer_devices);
  EXPECT_TRUE(a->maps.empty());
  auto n = launch::ParseDeviceMapFlag("none");
  ASSERT_TRUE(n.ok());
  EXPECT_FALSE(n->to_peer_devices);
  auto e = launch::ParseDeviceMapFlag("worker2/cuda:0=cuda:1,master/cuda:0=cpu,auto");
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_TRUE(e->to_peer_devices);
  EXPECT_EQ(e->maps.at("worker2").at("cuda:0"), "cuda:1");
  EXPECT_EQ(e->maps.at("master").at("cuda:0"), "cpu");
  // Names may hold ':'; the first '/' ends the name.
  auto colon = launch::ParseDeviceMapFlag("job:1/cuda:0=cuda:0");
  ASSERT_TRUE(colon.ok()) << colon.status();
  EXPECT_EQ(colon->maps.at("job:1").at("cuda:0"), "cuda:0");
  for (const char* bad : {"bogus", "w2/cuda:0", "/cuda:0=cpu", "w2/=cpu", "w2/cuda:0=",
                          "w2/cuda:0=cpu,w2/cuda:0=cuda:1"}) {
    EXPECT_FALSE(launch::ParseDeviceMapFlag(bad).ok()) << bad;
  }
}

// --- channel choice ----------------------------------------------------------

TEST(CudaRoutes, ChosenFromTheEndpointsExchangedAtRendezvous) {
  const base::WorkerInfo a = Info(1, "a", "host1", 100, {"GPU-0", "GPU-1"});
  const base::WorkerInfo same_gpu = Info(2, "b", "host1", 200, {"GPU-0"});
  const base::WorkerInfo other_gpu = Info(3, "c", "host1", 300, {"GPU-1", "GPU-0"});
  const base::WorkerInfo remote = Info(4, "d", "host2", 100, {"GPU-9"});
  const base::WorkerInfo no_nccl = Info(5, "e", "host1", 500, {"GPU-1"}, /*nccl=*/false);
  const base::WorkerInfo no_channel = Info(6, "f", "host1", 600, {});
  base::WorkerInfo same_process = Info(7, "g", "host1", 100, {"GPU-0"});

  EXPECT_EQ(channel::ChooseCudaRoute(a, 0, same_gpu, 0), channel::CudaRoute::kIpc);        // one GPU, two processes
  EXPECT_EQ(channel::ChooseCudaRoute(a, 1, same_gpu, 0), channel::CudaRoute::kNccl);       // GPU-1 -> GPU-0
  EXPECT_EQ(channel::ChooseCudaRoute(a, 0, other_gpu, 1), channel::CudaRoute::kIpc);  // ordinals differ, UUIDs match
  EXPECT_EQ(channel::ChooseCudaRoute(a, 0, other_gpu, 0), channel::CudaRoute::kNccl);
  EXPECT_EQ(channel::ChooseCudaRoute(a, 0, remote, 0), channel::CudaRoute::kNccl);         // across hosts
  EXPECT_EQ(channel::ChooseCudaRoute(a, 0, no_nccl, 0), channel::CudaRoute::kStaged);      // different GPU, no NCCL
  EXPECT_EQ(channel::ChooseCudaRoute(a, 1, no_nccl, 0), channel::CudaRoute::kIpc);         // same GPU needs no NCCL
  EXPECT_EQ(channel::ChooseCudaRoute(a, 0, no_channel, 0), channel::CudaRoute::kStaged);   // peer without a channel
  EXPECT_EQ(channel::ChooseCudaRoute(a, 0, same_process, 0), channel::CudaRoute::kStaged); // IPC cannot open its own
  EXPECT_EQ(channel::ChooseCudaRoute(a, 2, same_gpu, 0), channel::CudaRoute::kStaged);     // no such local GPU
  EXPECT_EQ(channel::ChooseCudaRoute(a, 0, same_gpu, 1), channel::CudaRoute::kStaged);     // no such peer GPU
  EXPECT_EQ(channel::ChooseCudaRoute(no_channel, 0, a, 0), channel::CudaRoute::kStaged);
  EXPECT_STREQ(channel::CudaRouteName(channel::CudaRoute::kIpc), "cuda_ipc");
  EXPECT_STREQ(channel::CudaRouteName(channel::CudaRoute::kNccl), "nccl");
  EXPECT_STREQ(channel::CudaRouteName(channel::CudaRoute::kStaged), "staged");
}

// By default only NCCL's receives (between GPUs) wait on the GPU; a call
// without a stream group always waits on the host.
TEST(CudaRoutes, StreamReceivesWaitOnTheGpuBetweenGpusByDefault) {
  ASSERT_EQ(channel::ParseStreamReceives(nullptr).value(), channel::StreamReceives::kBetweenGpus);
  ASSERT_EQ(channel::ParseStreamReceives("").value(), channel::StreamReceives::kBetweenGpus);
  ASSERT_EQ(channel::ParseStreamReceives("0").value(), channel::StreamReceives::kNever);
  ASSERT_EQ(channel::ParseStreamReceives("1").value(), channel::StreamReceives::kAlways);
  auto bad = channel::ParseStreamReceives("yes");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("REMORA_CUDA_STREAM_RECEIVES='yes'"));

  const auto mode = channel::StreamReceives::kBetweenGpus;
  EXPECT_TRUE(channel::LeaveReceiveToStream(mode, channel::CudaRoute::kNccl, 7));
  EXPECT_FALSE(channel::LeaveReceiveToStream(mode, channel::CudaRoute::kIpc, 7));  // one GPU: the host waits
  EXPECT_FALSE(channel::LeaveReceiveToStream(mode, channel::CudaRoute::kNccl, 0));  // not a stream-ordered call
  EXPECT_TRUE(channel::LeaveReceiveToStream(channel::StreamReceives::kAlways, channel::CudaRoute::kIpc, 7));
  EXPECT_FALSE(channel::LeaveReceiveToStream(channel::StreamReceives::kAlways, channel::CudaRoute::kStaged, 7));
  EXPECT_FALSE(channel::LeaveReceiveToStream(channel::StreamReceives::kNever, channel::CudaRoute::kNccl, 7));
}

// --- descriptors -------------------------------------------------------------

struct Descriptors {
  base::WorkerInfo sender = Info(1, "w1", "host1", 100, {"GPU-0", "GPU-1"});
  base::CudaEndpoint receiver{{"GPU-1", "GPU-0"}, true, 42};

  wire::CudaPayload Ipc() const {
    wire::CudaPayload d;
    d.set_channel(wire::CudaPayload::CUDA_IPC);
    d.set_src_device(0);
    d.set_dst_device(1);  // GPU-0 here
    d.set_incarnation(sender.cuda.incarnation);
    d.set_mem_handle(std::string(channel::kCudaIpcHandleBytes, 'm'));
    d.set_event_handle(std::string(channel::kCudaIpcHandleBytes, 'e'));
    d.set_base(0x7f0000000000);
    d.set_alloc_bytes(1 << 20);
    d.set_offset(4096);
    d.set_buffer(7);
    d.set_event_id(1);
    d.set_gpu("GPU-0");
    return d;
  }

  wire::CudaPayload Nccl() const {
    wire::CudaPayload d;
    d.set_channel(wire::CudaPayload::NCCL);
    d.set_src_device(1);  // GPU-1
    d.set_dst_device(1);  // GPU-0 here
    d.set_incarnation(sender.cuda.incarnation);
    d.set_generation(1);
    d.set_seq(1);
    return d;
  }
};

TEST(CudaPayloads, GoodDescriptorsPass) {
  Descriptors t;
  EXPECT_TRUE(channel::ValidateCudaPayload(t.Ipc(), 1 << 19, t.sender, t.receiver).ok());
  EXPECT_TRUE(channel::ValidateCudaPayload(t.Ipc(), (1 << 20) - 4096, t.sender, t.receiver).ok());
  EXPECT_TRUE(channel::ValidateCudaPayload(t.Nccl(), 1 << 19, t.sender, t.receiver).ok());
}

TEST(CudaPayloads, BadDescriptorsAreRefusedBeforeAnythingTouchesThem) {
  Descriptors t;
  auto expect = [&](const wire::CudaPayload& d, uint64_t length, absl::StatusCode code,
                    const std::string& text) {
    absl::Status s = channel::ValidateCudaPayload(d, length, t.sender, t.receiver);
    EXPECT_EQ(s.code(), code) << text << ": " << s;
    EXPECT_THAT(Message(s), HasSubstr(text));
  };
  const auto invalid = absl::StatusCode::kInvalidArgument;
  wire::CudaPayload d = t.Ipc();
  d.set_incarnation(99);
  expect(d, 16, absl::StatusCode::kPermissionDenied, "not from the process");
  d = t.Ipc();
  d.set_src_device(2);
  expect(d, 16, invalid, "source device 2");
  d = t.Ipc();
  d.set_dst_device(-1);
  expect(d, 16, invalid, "destination cuda:-1");
  d = t.Ipc();
  d.set_dst_device(0);  // GPU-1: not the sender's GPU-0
  expect(d, 16, invalid, "one GPU on both ends");
  d = t.Ipc();
  d.set_mem_handle("short");
  expect(d, 16, invalid, "malformed IPC handle");
  d = t.Ipc();
  d.set_event_handle(std::string(channel::kCudaIpcHandleBytes + 1, 'e'));
  expect(d, 16, invalid, "malformed IPC handle");
  d = t.Ipc();
  d.set_base(0);
  expect(d, 16, invalid, "no allocation");
  expect(t.Ipc(), (1 << 20) - 4095, invalid, "do not lie inside");
  d = t.Ipc();
  d.set_offset(uint64_t{1} << 40);
  expect(d, 1, invalid, "do not lie inside");
  d = t.Ipc();
  d.set_alloc_bytes(0);
  expect(d, 0, invalid, "no allocation");

  d = t.Nccl();
  d.set_src_device(0);  // GPU-0 -> GPU-0: one GPU
  expect(d, 16, invalid, "impossible");
  d = t.Nccl();
  d.set_seq(0);
  expect(d, 16, invalid, "sequence");
  d = t.Nccl();
  d.set_generation(0);
  expect(d, 16, invalid, "communicator");
  expect(t.Nccl(), 0, invalid, "empty");
  d = t.Nccl();
  d.set_channel(static_cast<wire::CudaPayload::Channel>(7));
  expect(d, 16, invalid, "unknown channel");
  base::WorkerInfo unregistered = t.sender;
  unregistered.cuda.incarnation = 0;
  EXPECT_EQ(channel::ValidateCudaPayload(t.Nccl(), 16, unregistered, t.receiver).code(),
            absl::StatusCode::kPermissionDenied);
}

// --- frames --------------------------------------------------------------------

TEST(CudaFrame, CudaPayloadsNeedAChannelAndGoodIndices) {
  rpc::OutMessage m;
  m.header.mutable_request()->set_from(1);
  m.payloads = {at::zeros({64}, at::kByte)};
  m.header.add_cuda_payloads()->set_payload(0);
  // The frame then claims payload 0 is not in it: 64 bytes too many.
  auto none = rpc::ParseMessage(rpc::SerializeMessage(m), nullptr, nullptr);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Message(none.status()), HasSubstr("CUDA payloads"));

  rpc::OutMessage out_of_range;
  out_of_range.header.add_cuda_payloads()->set_payload(3);
  auto r = rpc::ParseMessage(rpc::SerializeMessage(out_of_range));
  EXPECT_THAT(Message(r.status()), HasSubstr("out of range or repeated"));

  rpc::OutMessage twice;
  twice.payloads = {at::zeros({8}, at::kByte)};
  twice.header.add_cuda_payloads()->set_payload(0);
  twice.header.add_cuda_payloads()->set_payload(0);
  EXPECT_THAT(Message(rpc::ParseMessage(rpc::SerializeMessage(twice)).status()),
              HasSubstr("out of range or repeated"));

  rpc::OutMessage both;
  both.payloads = {at::zeros({8}, at::kByte)};
  both.header.add_shm_payloads()->set_payload(0);
  both.header.add_cuda_payloads()->set_payload(0);
  channel::ShmChannel shm{channel::ShmChannel::Options{}};
  EXPECT_EQ(rpc::ParseMessage(rpc::SerializeMessage(both), &shm).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The agent receives frames that list CUDA payloads on threads of their
// own; telling them apart reads the header alone.
TEST(CudaFrame, CarriesCudaPayloadsReadsTheHeader) {
  rpc::OutMessage plain;
  plain.payloads = {at::zeros({64}, at::kByte)};
  EXPECT_FALSE(rpc::CarriesCudaPayloads(rpc::SerializeMessage(plain)));
  rpc::OutMessage cuda;
  cuda.payloads = {at::zeros({64}, at::kByte)};
  cuda.header.add_cuda_payloads()->set_payload(0);
  EXPECT_TRUE(rpc::CarriesCudaPayloads(rpc::SerializeMessage(cuda)));
  grpc::Slice junk(std::string("\xff\xff\xff\x7f not a frame"));
  EXPECT_FALSE(rpc::CarriesCudaPayloads(grpc::ByteBuffer(&junk, 1)));
  EXPECT_FALSE(rpc::CarriesCudaPayloads(grpc::ByteBuffer()));
}

TEST(CudaFrame, ADescriptorFromAStrangerOrForAMissingGpuIsRefused) {
  channel::CudaChannel channel(channel::CudaChannel::Options{}, nullptr);
  base::WorkerInfo self = Info(0, "me", "host1", 1, channel.endpoint().gpus);
  self.cuda = channel.endpoint();
  const base::WorkerInfo peer = Info(1, "w1", "host1", 2, {"GPU-x"});
  channel.SetGroup(self, {self, peer});
  Descriptors t;
  wire::CudaPayload d = t.Nccl();
  d.set_src_device(0);
  d.set_incarnation(peer.cuda.incarnation);
  d.set_dst_device(static_cast<int>(channel.endpoint().gpus.size()));  // one past the last
  auto got = channel.Receive(1, d, 64);
  EXPECT_FALSE(got.ok());
  auto stranger = channel.Receive(9, t.Nccl(), 64);
  EXPECT_FALSE(stranger.ok());
  if (channel::CudaChannelBuilt()) {
    EXPECT_THAT(Message(got.status()), HasSubstr("not one of this process's"));
    EXPECT_EQ(stranger.status().code(), absl::StatusCode::kPermissionDenied);
  } else {
    EXPECT_THAT(Message(got.status()), HasSubstr(channel::kNoCudaBuild));
  }
}

// --- the channel without GPUs -------------------------------------------------

TEST(CudaChannel, OffersNoGpusWhereThereAreNoneAndSaysWhy) {
  channel::CudaChannel off(channel::CudaChannel::Options{/*enabled=*/false}, nullptr);
  EXPECT_TRUE(off.endpoint().gpus.empty());
  EXPECT_FALSE(off.disabled_reason().empty());
  channel::CudaChannel channel(channel::CudaChannel::Options{}, nullptr);
  EXPECT_EQ(channel.RouteTo(5, 0, 0), channel::CudaRoute::kStaged);  // nobody known yet
  if (!channel::CudaChannelBuilt()) {
    EXPECT_EQ(channel.disabled_reason(), channel::kNoCudaBuild);
    EXPECT_THAT(off.disabled_reason(), HasSubstr("rebuild"));
  } else {
    EXPECT_THAT(off.disabled_reason(), HasSubstr("turned off"));
    EXPECT_NE(channel.endpoint().incarnation, 0u);
  }
  if (channel::LocalGpuCount() == 0) {
    EXPECT_TRUE(channel.endpoint().gpus.empty());
    EXPECT_FALSE(channel.disabled_reason().empty());
    if (channel::CudaChannelBuilt()) {
      EXPECT_THAT(channel.disabled_reason(), HasSubstr("LibTorch has no CUDA"));
    }
  }
  // Nothing to send: a CPU tensor is never the channel's.
  EXPECT_FALSE(channel.Send(1, at::ones({4}), 0).has_value());
  channel.Stop();
  channel.Stop();  // idempotent
}

TEST(CudaChannel, WithoutTheBuildEveryEntryPointSaysRebuild) {
  channel::CudaChannel channel(channel::CudaChannel::Options{}, nullptr);
  auto d2d = channel::MeasureDeviceCopyGbps(0, 1 << 20);
  if (channel::CudaChannelBuilt()) {
    if (channel::LocalGpuCount() == 0) {
      EXPECT_THAT(Message(d2d.status()), HasSubstr("no GPU cuda:0"));
    }
    GTEST_SKIP() << "this build has the CUDA channel; the stub's messages are checked in "
                    "builds without it (cmake -DREMORA_CUDA=OFF)";
  }
  EXPECT_EQ(Message(d2d.status()), channel::kNoCudaBuild);
  EXPECT_THAT(Message(channel.OnNcclSetup(1, wire::NcclSetup())), HasSubstr(channel::kNoCudaBuild));
  EXPECT_THAT(Message(channel.Receive(1, wire::CudaPayload(), 8).status()),
              HasSubstr(channel::kNoCudaBuild));
}

// --- the codec -------------------------------------------------------------------

TEST(CudaCodec, ATensorMeantForAGpuThisProcessLacksIsAClearError) {
  // What a sender whose map says cuda:0 produces, received here: the bytes
  // staged through host memory, the destination in TensorMeta.device.
  at::Tensor x = at::arange(16, at::kFloat);
  std::vector<at::Tensor> payloads = {
      at::from_blob(x.data_ptr(), {static_cast<int64_t>(x.nbytes())}, at::kByte)};
  wire::Value v;
  v.mutable_tensor()->set_dtype(static_cast<int32_t>(at::kFloat));
  v.mutable_tensor()->add_sizes(16);
  v.mutable_tensor()->set_payload(0);
  v.mutable_tensor()->set_device("cuda:0");
  rpc::DecodeContext ctx{nullptr, &payloads};
  auto got = rpc::DecodeValue(v, ctx);
  if (channel::LocalGpuCount() == 0) {
    EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(Message(got.status()), HasSubstr("a tensor for cuda:0 arrived"));
    EXPECT_THAT(Message(got.status()), HasSubstr("fix the sender's device map"));
  } else {
    ASSERT_TRUE(got.ok()) << got.status();  // staged: copied to the GPU on arrival
    EXPECT_EQ(got->toTensor().device(), Cuda(0));
    EXPECT_TRUE(at::equal(got->toTensor().cpu(), x));
  }
  v.mutable_tensor()->set_device("gpu:0");
  EXPECT_EQ(rpc::DecodeValue(v, ctx).status().code(), absl::StatusCode::kInvalidArgument);
}

// --- agents ------------------------------------------------------------------------

TEST(CudaAgents, EndpointsAndHomeDevicesAreExchangedAtRendezvous) {
  Group g(2);
  for (rpc::Agent* a : g.all()) {
    EXPECT_EQ(a->self().device, "cpu");
    for (const auto& w : a->workers()) {
      rpc::Agent* owner = w.name == "master" ? &g.master() : &g.worker(w.name == "w1" ? 1 : 2);
      EXPECT_EQ(w.device, "cpu");
      EXPECT_EQ(w.cuda.incarnation, owner->self().cuda.incarnation) << w.name;
      EXPECT_EQ(w.cuda.gpus, owner->self().cuda.gpus) << w.name;
    }
  }
  EXPECT_EQ(g.master().cuda_stats().ipc_sends, 0);
}

TEST(CudaAgents, ChannelToExplainsCudaTensors) {
  rpc::AgentOptions opts;
  Group g(1, opts);
  EXPECT_EQ(g.master().channel_to("w1").value(), "shm");
  auto unmapped = g.master().channel_to("w1", "cuda:0");
  EXPECT_EQ(unmapped.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(unmapped.status()), HasSubstr("no device map entry for cuda:0"));
  EXPECT_THAT(Message(unmapped.status()), HasSubstr("'w1'"));
  EXPECT_EQ(g.master().channel_to("w1", "gpu").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(g.master().channel_to("nobody", "cuda:0").ok());
}

TEST(CudaAgents, MapToPeerDevicesStagesToACpuPeer) {
  rpc::AgentOptions opts;
  opts.map_to_peer_devices = true;
  Group g(1, opts);
  // w1's home is the CPU: a CUDA tensor would be copied to the host and
  // travel through shared memory.
  EXPECT_EQ(g.master().channel_to("w1", "cuda:0").value(), "staged:shm");
}

TEST(CudaAgents, StartRefusesDevicesThisProcessLacks) {
  if (channel::LocalGpuCount() > 0) GTEST_SKIP() << "this machine has a GPU: CudaGpu.* cover it";
  rpc::Registry registry;
  rpc::AgentOptions opts;
  opts.name = "w1";
  opts.device = "cuda:0";
  auto a = rpc::Agent::Start(opts, &registry);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(a.status()), HasSubstr("cuda:0 is not available"));
  opts.device = "cpu";
  opts.device_maps["w2"]["cuda:0"] = "cuda:0";
  auto b = rpc::Agent::Start(opts, &registry);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(b.status()), HasSubstr("device_maps[\"w2\"][\"cuda:0\"]"));
  opts.device_maps.clear();
  opts.device = "tpu:0";
  EXPECT_EQ(rpc::Agent::Start(opts, &registry).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CudaPrograms, WorkerAndBenchRefuseAGpuTheyDoNotHave) {
  auto [bad, bad_out] = RunProgram({BinDir() + "/worker", "--name", "w1", "--device", "gpu"});
  EXPECT_EQ(bad, 2);
  EXPECT_THAT(bad_out, HasSubstr("'gpu' is not a device"));
  auto [map, map_out] =
      RunProgram({BinDir() + "/worker", "--name", "w1", "--device-map", "w2/cuda:0"});
  EXPECT_EQ(map, 2);
  EXPECT_THAT(map_out, HasSubstr("--device-map"));
  if (channel::LocalGpuCount() > 0) GTEST_SKIP() << "this machine has a GPU: CudaGpu.* cover it";
  auto [gpu, gpu_out] = RunProgram({BinDir() + "/worker", "--name", "w1", "--device", "cuda:0"});
  EXPECT_EQ(gpu, 2);
  EXPECT_THAT(gpu_out, HasSubstr("--device cuda:0 is not available"));
  EXPECT_THAT(gpu_out, HasSubstr("LibTorch has no CUDA"));
  auto [bench, bench_out] = RunProgram({BinDir() + "/rpc_bench", "--device", "cuda"});
  EXPECT_EQ(bench, 2);
  EXPECT_THAT(bench_out, HasSubstr(channel::CudaChannelBuilt() ? "LibTorch has no CUDA" : channel::kNoCudaBuild));
  auto [master, master_out] =
      RunProgram({BinDir() + "/master", "--local", "--device", "cuda:0", "--splits", "1"});
  EXPECT_EQ(master, 2);
  EXPECT_THAT(master_out, HasSubstr("cuda:0 is not available"));
}

}  // namespace
}  // namespace remora
