// The value codec: c10::IValue <-> wire::Value plus tensor payloads.
//
// Supported: None, bool, int, double, complex, string, device, tensors
// (dense, CPU or CUDA, any dtype, views included), lists (typed and
// generic), tuples, dicts with string/int/double/bool/tensor keys, and
// RRefs. Each tensor becomes one payload with only its own elements; a
// non-contiguous view is made contiguous first. On receipt a tensor is
// built over its payload's bytes when they are suitably aligned, and copied
// otherwise. A CUDA tensor lands where the sender's device map says
// (channel/devices.h): on a GPU of the receiver (TensorMeta.device), or on its
// CPU; without a map entry it is an error at send time.
//
// RRefs need the RRef context (fork ids, reference counting); the codec
// reaches it through RRefHooks. Without hooks, RRefs are an error.
#pragma once

#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"
#include "channel/devices.h"
#include "rpc/future.h"
#include "base/ids.h"
#include "proto/common.pb.h"

namespace remora::rpc {

// What the codec needs from the RRef layer. Implemented by RRefContext.
class RRefHooks {
 public:
  virtual ~RRefHooks() = default;
  // Prepares `rref` for sending to worker `dst` (creates and records a fork).
  virtual absl::Status ForkForSend(const c10::IValue& rref, base::WorkerId dst,
                                   wire::RRefMeta* out) = 0;
  // Turns a received RRef into a local RRef value. When the receiver must
  // wait for the owner to confirm it before using it, a future to wait on is
  // appended to `pending`.
  virtual absl::StatusOr<c10::IValue> Receive(const wire::RRefMeta& meta,
                                              std::vector<Future<Empty>>* pending) = 0;
};

// Serialization state of one message being built.
struct EncodeContext {
  base::WorkerId dst = base::kUnknownWorker;
  RRefHooks* rrefs = nullptr;
  std::vector<at::Tensor>* payloads = nullptr;  // where tensors go
  // When set, receives every tensor that requires grad, as given (with its
  // autograd history), in message order.
  std::vector<at::Tensor>* grad_tensors = nullptr;
  // CUDA tensors: where they land on `peer` (the receiver). Without these,
  // a CUDA tensor is an error.
  const channel::DeviceMapper* devices = nullptr;
  const base::WorkerInfo* peer = nullptr;
  // By payload index: the receiver's GPU for CUDA payloads (-1 otherwise);
  // see OutMessage::cuda_destinations.
  std::vector<int>* cuda_destinations = nullptr;
};

struct DecodeContext {
  RRefHooks* rrefs = nullptr;
  const std::vector<at::Tensor>* payloads = nullptr;  // uint8 tensors
  std::vector<Future<Empty>>* pending = nullptr;       // RRef confirmations
  // When set, receives every decoded tensor that requires grad, in order.
  std::vector<at::Tensor>* grad_tensors = nullptr;
};

absl::Status EncodeValue(const c10::IValue& value, EncodeContext& ctx,
                         wire::Value* out);
absl::StatusOr<c10::IValue> DecodeValue(const wire::Value& value,
                                        DecodeContext& ctx);

// `bytes` (a contiguous uint8 tensor, any device) seen as a `dtype` tensor
// of `sizes`, sharing its storage: how payloads that arrive on a GPU become
// tensors. A view, not a tensor over a raw pointer, so that LibTorch's
// caching allocator still knows the memory (record_stream works on it).
absl::StatusOr<at::Tensor> ViewBytesAs(const at::Tensor& bytes, c10::ScalarType dtype,
                                       at::IntArrayRef sizes);

}  // namespace remora::rpc
