#include "channel/devices.h"

#include <algorithm>
#include <optional>

#include <ATen/Context.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace remora::channel {

bool CudaChannelBuilt() {
#ifdef REMORA_WITH_CUDA
  return true;
#else
  return false;
#endif
}

absl::StatusOr<c10::Device> ParseDevice(const std::string& text, const std::string& what) {
  if (text == "cpu") return c10::Device(c10::kCPU);
  int index = -1;
  if (text.rfind("cuda:", 0) == 0 && absl::SimpleAtoi(text.substr(5), &index) && index >= 0 &&
      index < 128 && text.substr(5) == absl::StrCat(index)) {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      what, ": '", text, "' is not a device; use cpu or cuda:N (N: the GPU's index)"));
}

int LocalGpuCount() {
  if (!at::hasCUDA()) return 0;
  return static_cast<int>(at::getNumGPUs());
}

absl::Status CheckLocalDevice(c10::Device device) {
  if (device.is_cpu()) return absl::OkStatus();
  const std::string hint =
      CudaChannelBuilt() ? "" : absl::StrCat(" (and note: ", kNoCudaBuild, ")");
  if (!device.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device ", device.str(), " is not supported; use cpu or cuda:N"));
  }
  if (!at::hasCUDA()) {
    return absl::FailedPreconditionError(absl::StrCat(
        device.str(), " is not available: this process's LibTorch has no CUDA (a CPU-only "
        "build, or no CUDA driver); use a CUDA build of LibTorch on a machine with a GPU, or "
        "cpu", hint));
  }
  const int n = LocalGpuCount();
  if (device.index() < 0 || device.index() >= n) {
    return absl::FailedPreconditionError(absl::StrCat(
        device.str(), " is not available: this process sees ", n,
        " GPU(s) (check CUDA_VISIBLE_DEVICES and nvidia-smi)"));
  }
  return absl::OkStatus();
}

const char* CudaRouteName(CudaRoute route) {
  switch (route) {
    case CudaRoute::kIpc:
      return "cuda_ipc";
    case CudaRoute::kNccl:
      return "nccl";
    case CudaRoute::kStaged:
      break;
  }
  return "staged";
}

CudaRoute ChooseCudaRoute(const base::WorkerInfo& self, int src, const base::WorkerInfo& peer, int dst) {
  const auto& mine = self.cuda.gpus;
  const auto& theirs = peer.cuda.gpus;
  if (src < 0 || dst < 0 || static_cast<size_t>(src) >= mine.size() ||
      static_cast<size_t>(dst) >= theirs.size()) {
    return CudaRoute::kStaged;  // no channel on one end, or an unknown device
  }
  if (mine[src] == theirs[dst]) {
    // One GPU, two processes of this host: CUDA IPC. (One process cannot
    // open its own IPC handles: agents in one process stage.)
    const bool same_host = !self.host_id.empty() && self.host_id == peer.host_id;
    const bool same_process = same_host && self.shm.pid == peer.shm.pid;
    return same_host && !same_process ? CudaRoute::kIpc : CudaRoute::kStaged;
  }
  return self.cuda.nccl && peer.cuda.nccl ? CudaRoute::kNccl : CudaRoute::kStaged;
}

absl::StatusOr<StreamReceives> ParseStreamReceives(const char* value) {
  const std::string v = value == nullptr ? "" : value;
  if (v.empty()) return StreamReceives::kBetweenGpus;
  if (v == "0") return StreamReceives::kNever;
  if (v == "1") return StreamReceives::kAlways;
  return absl::InvalidArgumentError(absl::StrCat(
      "REMORA_CUDA_STREAM_RECEIVES='", v, "': use 0 (receives wait on the host), 1 (on the GPU, "
      "also between processes on one GPU) or leave it unset (on the GPU between GPUs only)"));
}

bool LeaveReceiveToStream(StreamReceives mode, CudaRoute route, int64_t stream_group) {
  if (stream_group == 0 || route == CudaRoute::kStaged) return false;
  switch (mode) {
    case StreamReceives::kNever:
      return false;
    case StreamReceives::kBetweenGpus:
      return route == CudaRoute::kNccl;
    case StreamReceives::kAlways:
      return true;
  }
  return false;
}

absl::Status ValidateCudaPayload(const wire::CudaPayload& d, uint64_t length,
                                 const base::WorkerInfo& sender, const base::CudaEndpoint& self) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("CUDA payload ", d.payload(), " from worker '",
                                                   sender.name, "': ", what));
  };
  if (sender.cuda.incarnation == 0 || d.incarnation() != sender.cuda.incarnation) {
    return absl::PermissionDeniedError(absl::StrCat(
        "CUDA payload ", d.payload(), ": not from the process that worker '", sender.name,
        "' registered (a restarted worker, or a forged descriptor)"));
  }
  const auto& src_gpus = sender.cuda.gpus;
  if (d.src_device() < 0 || static_cast<size_t>(d.src_device()) >= src_gpus.size()) {
    return bad(absl::StrCat("source device ", d.src_device(), " is not one of its ",
                            src_gpus.size(), " GPU(s)"));
  }
  if (d.dst_device() < 0 || static_cast<size_t>(d.dst_device()) >= self.gpus.size()) {
    return bad(absl::StrCat("destination cuda:", d.dst_device(), " is not one of this process's ",
                            self.gpus.size(), " GPU(s)"));
  }
  const std::string& src_gpu = src_gpus[d.src_device()];
  const std::string& dst_gpu = self.gpus[d.dst_device()];
  switch (d.channel()) {
    case wire::CudaPayload::CUDA_IPC:
      if (d.gpu() != src_gpu || d.gpu() != dst_gpu) {
        return bad(absl::StrCat("CUDA IPC needs one GPU on both ends; the sender's cuda:",
                                d.src_device(), " is ", src_gpu, ", this process's cuda:",
                                d.dst_device(), " is ", dst_gpu, ", the descriptor names '",
                                d.gpu(), "'"));
      }
      if (d.mem_handle().size() != kCudaIpcHandleBytes ||
          d.event_handle().size() != kCudaIpcHandleBytes) {
        return bad("malformed IPC handle");
      }
      if (d.base() == 0 || d.buffer() == 0 || d.alloc_bytes() == 0) {
        return bad("no allocation or buffer named");
      }
      if (d.offset() > d.alloc_bytes() || length > d.alloc_bytes() - d.offset()) {
        return bad(absl::StrCat(length, " bytes at offset ", d.offset(),
                                " do not lie inside its allocation of ", d.alloc_bytes(),
                                " bytes"));
      }
      return absl::OkStatus();
    case wire::CudaPayload::NCCL:
      if (src_gpu == dst_gpu) {
        return bad("NCCL between two processes on one GPU (" + src_gpu +
                   ") is impossible; that pair uses CUDA IPC");
      }
      if (d.generation() == 0 || d.seq() == 0) return bad("no communicator or sequence number");
      if (length == 0) return bad("empty NCCL transfer");
      return absl::OkStatus();
    default:
      return bad(absl::StrCat("unknown channel ", static_cast<int>(d.channel())));
  }
}

absl::StatusOr<DeviceMapper> DeviceMapper::Create(const std::string& self, const Maps& maps,
                                                  bool map_to_peer_devices, int local_gpus) {
  DeviceMapper m;
  m.self_ = self;
  m.map_to_peer_devices_ = map_to_peer_devices;
  for (const auto& [peer, entries] : maps) {
    if (!base::IsValidWorkerName(peer) || peer == self) {
      return absl::InvalidArgumentError(absl::StrCat(
          "device_maps of '", self, "': '", peer, "' is not a peer's name"));
    }
    auto& out = m.maps_[peer];
    for (const auto& [src_text, dst_text] : entries) {
      const std::string what = absl::StrCat("device_maps[\"", peer, "\"][\"", src_text, "\"]");
      auto src = ParseDevice(src_text, what);
      if (!src.ok()) return src.status();
      auto dst = ParseDevice(dst_text, what);
      if (!dst.ok()) return dst.status();
      if (!src->is_cuda()) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": only CUDA devices are mapped (CPU tensors always land on the CPU)"));
      }
      if (src->index() >= local_gpus) {
        return absl::FailedPreconditionError(absl::StrCat(
            what, " maps ", src->str(), ", but '", self, "' has ", local_gpus,
            " GPU(s) its LibTorch can use",
            local_gpus == 0 ? " (LibTorch without CUDA, or no GPU); drop the entry or run on "
                              "a GPU machine with a CUDA build"
                            : ""));
      }
      out.insert_or_assign(*src, *dst);
    }
  }
  return m;
}

absl::StatusOr<c10::Device> DeviceMapper::Map(c10::Device src, const base::WorkerInfo& peer) const {
  if (src.is_cpu()) return src;
  if (!src.is_cuda()) {
    return absl::UnimplementedError(absl::StrCat(
        "cannot send a tensor on ", src.str(), " to worker '", peer.name,
        "': only CPU and CUDA tensors cross the wire"));
  }
  std::optional<c10::Device> dst;
  if (auto it = maps_.find(peer.name); it != maps_.end()) {
    if (auto e = it->second.find(src); e != it->second.end()) dst = e->second;
  }
  if (!dst && map_to_peer_devices_) {
    auto home = ParseDevice(peer.device, absl::StrCat("the home device of worker '", peer.name, "'"));
    if (!home.ok()) return home.status();
    dst = *home;
  }
  if (!dst) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot send a tensor on ", src.str(), " from '", self_, "' to worker '", peer.name,
        "': no device map entry for ", src.str(), "; set AgentOptions::device_maps[\"",
        peer.name, "\"][\"", src.str(), "\"] to \"cuda:N\" (a GPU of '", peer.name,
        "') or \"cpu\" (worker: --device-map ", peer.name, "/", src.str(),
        "=cuda:N), or move the tensor to the CPU first"));
  }
  if (dst->is_cuda() && !peer.cuda.gpus.empty() &&
      static_cast<size_t>(dst->index()) >= peer.cuda.gpus.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot send a tensor on ", src.str(), " to worker '", peer.name, "': its device map says ",
        dst->str(), " but '", peer.name, "' has ", peer.cuda.gpus.size(), " GPU(s)"));
  }
  return *dst;
}

std::vector<std::pair<c10::Device, c10::Device>> DeviceMapper::EntriesFor(
    const std::string& peer) const {
  std::vector<std::pair<c10::Device, c10::Device>> out;
  if (auto it = maps_.find(peer); it != maps_.end()) {
    for (const auto& e : it->second) out.push_back(e);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.first.index() < b.first.index();
  });
  return out;
}

}  // namespace remora::channel
