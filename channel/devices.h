// Devices: where a tensor may live in this process, where it lands on a
// peer, and which channel carries it there.
//
// Device maps are PyTorch RPC's (TensorPipeRpcBackendOptions.set_device_map):
// for each peer, a CUDA device of this process -> a device of the peer.
//
//   opts.device_maps["worker2"]["cuda:0"] = "cuda:1";  // lands on its GPU 1
//   opts.device_maps["master"]["cuda:0"] = "cpu";      // lands in its memory
//
// CPU tensors always land on the CPU. A CUDA tensor sent to a peer without
// an entry for its device is an error at send time, naming the device and
// the peer, unless `map_to_peer_devices` sends it to the peer's home device
// (what `worker --device cuda:N` does). Each agent's map governs everything
// it sends, requests and replies alike (PyTorch instead inverts the caller's
// map for replies).
//
// Everything here is plain logic over endpoint information: no CUDA calls,
// the same in every build, unit-tested without a GPU.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "proto/channel.pb.h"
#include "base/ids.h"

namespace remora::channel {

// What a build without the CUDA channel says when asked for it.
inline constexpr char kNoCudaBuild[] =
    "this build has no CUDA; rebuild on a machine with the CUDA toolkit and NCCL";

// Size of cudaIpcMemHandle_t and cudaIpcEventHandle_t (CUDA_IPC_HANDLE_SIZE).
inline constexpr size_t kCudaIpcHandleBytes = 64;

// True when this build holds the CUDA channel (REMORA_WITH_CUDA).
bool CudaChannelBuilt();

// Parses "cpu" or "cuda:N" (an explicit index: "cuda" alone is ambiguous
// across processes). Errors name `what` (e.g. "--device").
absl::StatusOr<c10::Device> ParseDevice(const std::string& text, const std::string& what);

// GPUs this process's LibTorch can use: 0 when LibTorch has no CUDA.
int LocalGpuCount();

// Checks that this process can place tensors on `device`: the CPU always;
// cuda:N needs LibTorch with CUDA and a visible GPU N. The error says why
// not and what to do.
absl::Status CheckLocalDevice(c10::Device device);

// How a CUDA tensor reaches a peer's GPU.
enum class CudaRoute {
  kStaged,  // through host memory: copied to the CPU, sent as bytes (shm or
            // gRPC), copied to the GPU on arrival. Always possible.
  kIpc,     // CUDA IPC: the peer is another process on this host and the
            // destination is the same GPU (NCCL refuses one GPU twice).
  kNccl,    // NCCL: a different GPU, on this host or another.
};

// "staged", "cuda_ipc" or "nccl".
const char* CudaRouteName(CudaRoute route);

// The route from GPU `src` of `self` to GPU `dst` of `peer`, decided from
// the endpoints exchanged at rendezvous: the same GPU UUID on the same host
// in another process is CUDA IPC; different GPUs where both ends have NCCL
// is NCCL; anything else (no CUDA channel on either end, an unknown device,
// the same process) is staged through host memory.
CudaRoute ChooseCudaRoute(const base::WorkerInfo& self, int src, const base::WorkerInfo& peer, int dst);

// Which receives of a stream-ordered call (CallOptions::stream_group) leave
// their wait to the receiving stream on the GPU instead of the host.
enum class StreamReceives {
  kNever,        // every receive waits on the host until its bytes are there
  kBetweenGpus,  // NCCL receives only; CUDA IPC receives (one GPU, two
                 // processes) wait on the host. Without MPS the GPU
                 // time-slices the two processes, and a consumer whose
                 // kernels wait queued on the GPU behind the producer's
                 // took turns from it: on one H200, ResNet50 over two
                 // processes at one micro-batch took 1.3-1.8x as long per
                 // batch as with host waits in five pairs of seven
                 // (docs/measurements.md).
  kAlways,
};

// REMORA_CUDA_STREAM_RECEIVES's value: unset or empty is the default
// (kBetweenGpus), "0" kNever, "1" kAlways; anything else is an error
// naming the variable.
absl::StatusOr<StreamReceives> ParseStreamReceives(const char* value);

// Whether a receive by `route` of a call in `stream_group` (0: none) is
// left to the stream under `mode`.
bool LeaveReceiveToStream(StreamReceives mode, CudaRoute route, int64_t stream_group);

// Checks a CUDA payload descriptor from `sender` against what both ends
// advertised, before anything touches it: its sender, devices and GPU,
// handle sizes, and that `length` bytes lie inside the described memory.
absl::Status ValidateCudaPayload(const wire::CudaPayload& d, uint64_t length,
                                 const base::WorkerInfo& sender, const base::CudaEndpoint& self);

// The device maps of one agent.
//
// Immutable after Create; thread-safe.
class DeviceMapper {
 public:
  // peer name -> (local device -> peer device), as in AgentOptions.
  using Maps = std::map<std::string, std::map<std::string, std::string>>;

  DeviceMapper() = default;

  // Checks `maps`: every device parses, every source is one of this
  // process's `local_gpus` GPUs, every destination is "cpu" or "cuda:N".
  // `self` names this agent in errors.
  static absl::StatusOr<DeviceMapper> Create(const std::string& self, const Maps& maps,
                                             bool map_to_peer_devices, int local_gpus);

  // Where a tensor on local device `src` sent to `peer` lands. CPU tensors:
  // the CPU. CUDA tensors: the map's entry, else the peer's home device when
  // map_to_peer_devices, else an error naming the device and the peer. A
  // destination GPU the peer does not have is an error too.
  absl::StatusOr<c10::Device> Map(c10::Device src, const base::WorkerInfo& peer) const;

  // The entries for `peer` (for logs).
  std::vector<std::pair<c10::Device, c10::Device>> EntriesFor(const std::string& peer) const;
  bool map_to_peer_devices() const { return map_to_peer_devices_; }

 private:
  std::string self_;
  std::unordered_map<std::string, std::unordered_map<c10::Device, c10::Device>> maps_;
  bool map_to_peer_devices_ = false;
};

}  // namespace remora::channel
