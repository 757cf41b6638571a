// Internals of the CUDA channel shared by its files (cuda_channel.cc, ipc.cc,
// nccl.cc): CUDA and NCCL error text, the device guard, LibTorch stream
// ordering, and the records of IPC allocations and events. Include only
// from channel/cuda/.
//
// Stateless helpers; thread-safe. DeviceGuard is per thread.
#pragma once

#include "channel/cuda/cuda_channel.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <iostream>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#ifdef REMORA_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "proto/request.h"

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "remora's CUDA channel needs NCCL >= 2.14 (non-blocking communicators)"
#endif

namespace remora::channel {

inline std::string CudaText(cudaError_t e) {
  return absl::StrCat(cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// `what` failed with `e`; clears the runtime's (non-sticky) last error.
inline absl::Status CudaFailure(const std::string& what, cudaError_t e) {
  cudaGetLastError();
  return absl::InternalError(absl::StrCat(what, ": ", CudaText(e)));
}

#define REMORA_CUDA_TRY(expr, what)                   \
  do {                                                \
    const cudaError_t remora_e_ = (expr);             \
    if (remora_e_ != cudaSuccess) {                   \
      return CudaFailure((what), remora_e_);          \
    }                                                 \
  } while (0)

inline std::string NcclText(ncclResult_t r) {
  return absl::StrCat(ncclGetErrorString(r), " (NCCL ", static_cast<int>(r),
                      "; NCCL_DEBUG=INFO says more)");
}

// Makes `device` current on this thread for its lifetime, then restores
// the previous one (LibTorch keeps its own idea of the current device).
// Setting it also makes its primary context current, which the driver
// calls below need.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    changed_ = cudaSetDevice(device) == cudaSuccess && previous_ != device;
    cudaFree(nullptr);  // CUDA < 12: cudaSetDevice alone creates no context
  }
  ~DeviceGuard() {
    if (changed_ && previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

// cuMemGetAddressRange from the driver, found at run time: an IPC handle
// covers a whole allocation, and LibTorch's caching allocator hands out
// pieces of larger ones. (Linking libcuda would make every program fail to
// start on machines without a driver.)
using AddressRangeFn = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

inline AddressRangeFn AddressRange() {
  static const AddressRangeFn fn = []() -> AddressRangeFn {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) return nullptr;
    return reinterpret_cast<AddressRangeFn>(dlsym(lib, "cuMemGetAddressRange_v2"));
  }();
  return fn;
}

inline std::string UuidText(const cudaUUID_t& uuid) {
  const auto* b = reinterpret_cast<const unsigned char*>(uuid.bytes);
  return absl::StrFormat(
      "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
      b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

// An event on LibTorch's current stream of `device` (current on this
// thread): the work that produced a tensor being sent, or that last used the
// memory of a tensor just allocated. Without LibTorch's CUDA API, waits for
// the whole device on the host instead and returns null.
inline absl::StatusOr<cudaEvent_t> LibTorchEvent(int device) {
#ifdef REMORA_TORCH_CUDA
  cudaStream_t current =
      c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  cudaEvent_t event = nullptr;
  REMORA_CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "creating an event");
  if (cudaError_t e = cudaEventRecord(event, current); e != cudaSuccess) {
    cudaEventDestroy(event);
    return CudaFailure("recording an event on LibTorch's stream", e);
  }
  return event;
#else
  REMORA_CUDA_TRY(cudaDeviceSynchronize(),
                  absl::StrCat("synchronising cuda:", device, " before a transfer"));
  return static_cast<cudaEvent_t>(nullptr);
#endif
}

// Makes `stream` wait for the work LibTorch queued on `device` so far (the
// producer of a tensor being sent, or whatever last used memory LibTorch
// just handed out). Call with `device` current.
inline absl::Status AfterLibTorch(int device, cudaStream_t stream) {
  ASSIGN_OR_RETURN(cudaEvent_t event, LibTorchEvent(device));
  if (event == nullptr) return absl::OkStatus();  // waited for on the host
  const cudaError_t e = cudaStreamWaitEvent(stream, event, 0);
  cudaEventDestroy(event);  // freed once it completes
  REMORA_CUDA_TRY(e, "ordering after LibTorch's stream");
  return absl::OkStatus();
}

// Waits on the host until `event` completed, `deadline` passes, or `check`
// (called between polls) reports an error.
inline absl::Status PollEvent(cudaEvent_t event, absl::Time deadline, const std::string& what,
                       const std::function<absl::Status()>& check = nullptr) {
  absl::Duration pause = absl::Microseconds(10);
  while (true) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return CudaFailure(what, e);
    if (check) {
      absl::Status s = check();
      if (!s.ok()) return s;
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": not done in time"));
    }
    absl::SleepFor(pause);
    pause = std::min(pause * 2, absl::Milliseconds(1));
  }
}

// LibTorch's caching allocator must not hand `t`'s memory out again before
// the work queued on `stream` (of `device`) so far is done, even when `t`
// is dropped first (a receive that failed while its copy was queued).
// Without LibTorch's CUDA API there is no stream-aware allocator to tell.
inline void KeepForStream(const at::Tensor& t, cudaStream_t stream, int device) {
#ifdef REMORA_TORCH_CUDA
  c10::cuda::CUDACachingAllocator::recordStream(
      t.storage().data_ptr(),
      c10::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device)));
#else
  (void)t, (void)stream, (void)device;
#endif
}

// Ends the channel's use of `stream`. With LibTorch's CUDA API the stream
// is never destroyed: KeepForStream recorded it on tensors that may outlive
// the channel (received tensors handed to the user, views of sent ones),
// and the caching allocator records an event on it whenever such a tensor
// is freed, which on a destroyed stream fails inside a tensor's deleter
// and terminates the process. One stream per device and per communicator
// generation (a new one only after a failure) stays allocated.
inline void ReleaseStream(cudaStream_t stream) {
#ifdef REMORA_TORCH_CUDA
  (void)stream;
#else
  if (stream != nullptr) cudaStreamDestroy(stream);
#endif
}

inline ncclConfig_t NonBlockingConfig() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// A peer's allocation opened here.
struct Opened {
  std::string handle;  // the cudaIpcMemHandle_t it was opened from
  void* ptr = nullptr;
  uint64_t bytes = 0;  // the mapping's size as the driver reports it
  int device = 0;
  absl::Time last_used;  // guarded by the channel's mu_
  ~Opened() {
    if (ptr != nullptr) {
      DeviceGuard guard(device);
      cudaIpcCloseMemHandle(ptr);
    }
  }
};

// One of this process's interprocess events: recorded after a payload's
// producer, waited on by the receiver, reused once that buffer is released.
struct IpcEvent {
  uint64_t id = 0;
  int device = 0;
  cudaEvent_t event = nullptr;
  cudaIpcEventHandle_t handle{};
  bool busy = false;
};

}  // namespace remora::channel
