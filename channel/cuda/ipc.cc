// The CUDA channel's CUDA IPC half: a payload on a GPU that the receiver
// shares is sent as handles to its allocation and to an event recorded
// after its producer; the receiver opens both, copies on its own stream, and
// releases the buffer, which the sender holds until then (a stream-ordered
// receive: once the background thread sees the copy done).
#include "channel/cuda/channel_impl.h"

namespace remora::channel {

absl::StatusOr<std::optional<wire::CudaPayload>> CudaChannel::Impl::SendIpc(base::WorkerId peer,
                                                                            const at::Tensor& payload, int src,
                                                                            int dst) {
  DeviceGuard guard(src);
  AddressRangeFn range = AddressRange();
  if (range == nullptr) {
    return absl::UnavailableError(
        "CUDA IPC needs the driver's cuMemGetAddressRange (libcuda.so.1 not found)");
  }
  unsigned long long base = 0;
  size_t size = 0;
  const auto ptr = reinterpret_cast<unsigned long long>(payload.data_ptr());
  if (range(&base, &size, ptr) != 0 || base == 0) {
    return absl::InternalError("CUDA IPC: cannot find the allocation of a tensor");
  }
  cudaIpcMemHandle_t mem;
  const cudaError_t e = cudaIpcGetMemHandle(&mem, reinterpret_cast<void*>(base));
  if (e != cudaSuccess) {
    return CudaFailure(
        "CUDA IPC cannot share this tensor's memory (expandable segments in "
        "PYTORCH_CUDA_ALLOC_CONF are not shareable)", e);
  }
  auto event = TakeEvent(src);
  if (!event.ok()) return event.status();
  IpcEvent* ev = *event;
#ifdef REMORA_TORCH_CUDA
  cudaStream_t producer =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(src)).stream();
  cudaError_t recorded = cudaEventRecord(ev->event, producer);
#else
  cudaError_t recorded = cudaDeviceSynchronize();
  if (recorded == cudaSuccess) recorded = cudaEventRecord(ev->event, nullptr);
#endif
  if (recorded != cudaSuccess) {
    ReturnEvent(ev);
    return CudaFailure("CUDA IPC: recording the producer's event", recorded);
  }
  wire::CudaPayload d;
  d.set_channel(wire::CudaPayload::CUDA_IPC);
  d.set_src_device(src);
  d.set_dst_device(dst);
  d.set_incarnation(self_ep_.incarnation);
  d.set_mem_handle(std::string(reinterpret_cast<const char*>(&mem), sizeof(mem)));
  d.set_base(base);
  d.set_alloc_bytes(size);
  d.set_offset(ptr - base);
  d.set_event_handle(std::string(reinterpret_cast<const char*>(&ev->handle), sizeof(ev->handle)));
  d.set_event_id(ev->id);
  d.set_gpu(self_ep_.gpus[src]);
  {
    base::MutexLock lock(mu_);
    const uint64_t id = next_buffer_++;
    held_[id] = Held{payload, peer, ev, absl::Now(), false};
    d.set_buffer(id);
  }
  ipc_sends_.fetch_add(1);
  return std::optional<wire::CudaPayload>(std::move(d));
}

absl::Status CudaChannel::Impl::ReceiveIpc(const base::WorkerInfo& peer, const wire::CudaPayload& d, uint64_t length,
                        at::Tensor& out) {
  const int dst = d.dst_device();
  const std::string what = absl::StrCat("CUDA IPC payload from '", peer.name, "'");
  ASSIGN_OR_RETURN(std::shared_ptr<Opened> mem, Open(d));
  if (d.offset() > mem->bytes || length > mem->bytes - d.offset()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", length, " bytes at offset ", d.offset(), " exceed the opened allocation of ",
        mem->bytes, " bytes"));
  }
  ASSIGN_OR_RETURN(cudaEvent_t producer, OpenEvent(d));
  ASSIGN_OR_RETURN(cudaStream_t stream, CopyStream(dst));
  RETURN_IF_ERROR(AfterLibTorch(dst, stream));
  REMORA_CUDA_TRY(cudaStreamWaitEvent(stream, producer, 0), what + ": waiting for the sender");
  KeepForStream(out, stream, dst);
  REMORA_CUDA_TRY(cudaMemcpyAsync(out.data_ptr(), static_cast<char*>(mem->ptr) + d.offset(),
                                  length, cudaMemcpyDeviceToDevice, stream),
                  what + ": copying");
  cudaEvent_t done;
  REMORA_CUDA_TRY(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), what);
  cudaError_t e = cudaEventRecord(done, stream);
  if (e == cudaSuccess && StreamOrdered(d)) {
    // LibTorch's stream waits for the copy; the buffer goes back once it is done.
    Pending p{0,   d.stream_group(), done,    peer.id, d.buffer(), d.incarnation(),
              mem, nullptr,          absl::Now() + options_.timeout, what};
    if (LeaveToStream(dst, p)) return absl::OkStatus();
  }
  absl::Status s = e == cudaSuccess
                       ? PollEvent(done, absl::Now() + options_.timeout, what + ": the copy")
                       : CudaFailure(what, e);
  cudaEventDestroy(done);
  if (!s.ok()) return s;
  QueueRelease(peer.id, d.incarnation(), d.buffer());
  return absl::OkStatus();
}

void CudaChannel::Impl::OnRelease(base::WorkerId from, const wire::CudaRelease& release) {
  if (release.incarnation() != self_ep_.incarnation) return;  // meant for an older process
  base::MutexLock lock(mu_);
  for (uint64_t id : release.buffers()) {
    auto it = held_.find(id);
    if (it == held_.end() || it->second.peer != from) continue;
    it->second.event->busy = false;
    held_.erase(it);
  }
}

absl::StatusOr<IpcEvent*> CudaChannel::Impl::TakeEvent(int device) {
  {
    base::MutexLock lock(mu_);
    for (auto& e : events_) {
      if (!e->busy && e->device == device) {
        e->busy = true;
        return e.get();
      }
    }
  }
  auto e = std::make_unique<IpcEvent>();
  e->device = device;
  REMORA_CUDA_TRY(
      cudaEventCreateWithFlags(&e->event, cudaEventDisableTiming | cudaEventInterprocess),
      "creating an interprocess event");
  if (cudaError_t err = cudaIpcGetEventHandle(&e->handle, e->event); err != cudaSuccess) {
    cudaEventDestroy(e->event);
    return CudaFailure("cudaIpcGetEventHandle", err);
  }
  e->busy = true;
  base::MutexLock lock(mu_);
  e->id = events_.size() + 1;
  events_.push_back(std::move(e));
  return events_.back().get();
}

void CudaChannel::Impl::ReturnEvent(IpcEvent* e) {
  base::MutexLock lock(mu_);
  e->busy = false;
}

absl::StatusOr<std::shared_ptr<Opened>> CudaChannel::Impl::Open(const wire::CudaPayload& d) {
  const auto key = std::make_pair(d.incarnation(), d.base());
  base::MutexLock lock(open_mu_);
  {
    base::MutexLock l(mu_);
    auto it = opened_.find(key);
    if (it != opened_.end() && it->second->handle == d.mem_handle()) {
      it->second->last_used = absl::Now();
      return it->second;
    }
  }
  auto mem = std::make_shared<Opened>();
  mem->handle = d.mem_handle();
  mem->device = d.dst_device();
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, d.mem_handle().data(), sizeof(handle));
  REMORA_CUDA_TRY(cudaIpcOpenMemHandle(&mem->ptr, handle, cudaIpcMemLazyEnablePeerAccess),
                  "CUDA IPC: opening the sender's memory");
  mem->bytes = d.alloc_bytes();
  if (AddressRangeFn range = AddressRange()) {
    unsigned long long base = 0;
    size_t size = 0;
    if (range(&base, &size, reinterpret_cast<unsigned long long>(mem->ptr)) == 0) {
      mem->bytes = std::min<uint64_t>(mem->bytes, size - (reinterpret_cast<uintptr_t>(mem->ptr) - base));
    }
  }
  base::MutexLock l(mu_);
  mem->last_used = absl::Now();
  opened_[key] = mem;
  return mem;
}

absl::StatusOr<cudaEvent_t> CudaChannel::Impl::OpenEvent(const wire::CudaPayload& d) {
  const auto key = std::make_pair(d.incarnation(), d.event_id());
  base::MutexLock lock(mu_);
  if (auto it = opened_events_.find(key); it != opened_events_.end()) return it->second;
  cudaIpcEventHandle_t handle;
  std::memcpy(&handle, d.event_handle().data(), sizeof(handle));
  cudaEvent_t event;
  REMORA_CUDA_TRY(cudaIpcOpenEventHandle(&event, handle), "CUDA IPC: opening the sender's event");
  opened_events_[key] = event;
  return event;
}

absl::StatusOr<cudaStream_t> CudaChannel::Impl::CopyStream(int device) {
  base::MutexLock lock(mu_);
  if (auto it = copy_streams_.find(device); it != copy_streams_.end()) return it->second;
  cudaStream_t stream;
  REMORA_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                  "creating the copy stream");
  copy_streams_[device] = stream;
  return stream;
}

void CudaChannel::Impl::QueueRelease(base::WorkerId peer, uint64_t incarnation, uint64_t buffer) {
  base::MutexLock lock(queue_mu_);
  releases_[{peer, incarnation}].push_back(buffer);
  wake_ = true;
}

void CudaChannel::Impl::ReclaimStale() {
  const absl::Time now = absl::Now();
  // A sender's allocation mapped here keeps its memory alive after the
  // sender frees it (and CUDA leaves freeing it while mapped undefined):
  // close mappings unused for reclaim_after. Receives still copying hold
  // their own reference; the last one closes it.
  std::vector<std::shared_ptr<Opened>> idle;  // closed outside the lock
  base::MutexLock lock(mu_);
  for (auto it = opened_.begin(); it != opened_.end();) {
    if (now - it->second->last_used > options_.reclaim_after) {
      idle.push_back(std::move(it->second));
      it = opened_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = held_.begin(); it != held_.end();) {
    // A buffer whose call failed is freed after reclaim_after; one whose
    // call went through waits much longer for its release (its frame may
    // still be queued at the receiver, which would copy freed memory).
    const absl::Duration limit =
        it->second.orphaned ? options_.reclaim_after : 10 * options_.reclaim_after;
    if (now - it->second.since > limit) {
      it->second.event->busy = false;
      it = held_.erase(it);
    } else {
      ++it;
    }
  }
}
}  // namespace remora::channel
