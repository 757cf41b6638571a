#include "rpc/codec.h"

#include <cstring>
#include <optional>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/resolve_conj.h>
#include <ATen/ops/resolve_neg.h>
#include <c10/core/ScalarType.h>

#include "absl/strings/str_cat.h"
#include "base/status_util.h"

namespace remora::rpc {
namespace {

constexpr int32_t kUndefinedTensor = -1;

wire::ElemKind KindOf(const c10::TypePtr& type) {
  switch (type->kind()) {
    case c10::TypeKind::IntType:
      return wire::ELEM_INT;
    case c10::TypeKind::FloatType:
      return wire::ELEM_DOUBLE;
    case c10::TypeKind::BoolType:
      return wire::ELEM_BOOL;
    case c10::TypeKind::TensorType:
      return wire::ELEM_TENSOR;
    case c10::TypeKind::StringType:
      return wire::ELEM_STRING;
    default:
      return wire::ELEM_ANY;
  }
}

c10::TypePtr TypeOf(wire::ElemKind kind) {
  switch (kind) {
    case wire::ELEM_INT:
      return c10::IntType::get();
    case wire::ELEM_DOUBLE:
      return c10::FloatType::get();
    case wire::ELEM_BOOL:
      return c10::BoolType::get();
    case wire::ELEM_TENSOR:
      return c10::TensorType::get();
    case wire::ELEM_STRING:
      return c10::StringType::get();
    default:
      return c10::AnyType::get();
  }
}

// True when `v` may be stored in a container whose element kind is `kind`.
bool Matches(const c10::IValue& v, wire::ElemKind kind) {
  switch (kind) {
    case wire::ELEM_INT:
      return v.isInt();
    case wire::ELEM_DOUBLE:
      return v.isDouble();
    case wire::ELEM_BOOL:
      return v.isBool();
    case wire::ELEM_TENSOR:
      return v.isTensor();
    case wire::ELEM_STRING:
      return v.isString();
    default:
      return true;
  }
}

// The dtypes on the wire, by their number in LibTorch 1.13's ScalarType
// (2.x keeps these numbers and adds Bits, Float8, UInt16-64 and sub-byte
// types after them). Listed, not ranged, so that processes built against
// different LibTorch versions accept exactly the same tensors.
bool IsSendableDtype(int32_t dtype) {
  switch (dtype) {
    case static_cast<int32_t>(c10::ScalarType::Byte):
    case static_cast<int32_t>(c10::ScalarType::Char):
    case static_cast<int32_t>(c10::ScalarType::Short):
    case static_cast<int32_t>(c10::ScalarType::Int):
    case static_cast<int32_t>(c10::ScalarType::Long):
    case static_cast<int32_t>(c10::ScalarType::Half):
    case static_cast<int32_t>(c10::ScalarType::Float):
    case static_cast<int32_t>(c10::ScalarType::Double):
    case static_cast<int32_t>(c10::ScalarType::ComplexHalf):
    case static_cast<int32_t>(c10::ScalarType::ComplexFloat):
    case static_cast<int32_t>(c10::ScalarType::ComplexDouble):
    case static_cast<int32_t>(c10::ScalarType::Bool):
    case static_cast<int32_t>(c10::ScalarType::BFloat16):
      return true;
    default:
      return false;
  }
}

absl::Status EncodeTensor(const at::Tensor& tensor, EncodeContext& ctx,
                          wire::TensorMeta* out) {
  if (!tensor.defined()) {
    out->set_dtype(kUndefinedTensor);
    return absl::OkStatus();
  }
  c10::Device dst = tensor.device();
  if (!tensor.device().is_cpu()) {
    if (ctx.devices == nullptr || ctx.peer == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot send a tensor on ", tensor.device().str(),
          ": no device maps here (only agents send CUDA tensors); move it to the CPU first"));
    }
    ASSIGN_OR_RETURN(dst, ctx.devices->Map(tensor.device(), *ctx.peer));
  }
  if (tensor.layout() != at::kStrided || tensor.is_quantized()) {
    return absl::UnimplementedError(
        "cannot send a sparse or quantized tensor; send a dense one");
  }
  if (!IsSendableDtype(static_cast<int32_t>(tensor.scalar_type()))) {
    return absl::UnimplementedError(absl::StrCat(
        "cannot send a tensor of dtype ", c10::toString(tensor.scalar_type()),
        "; convert it to a standard integer, floating, complex or bool dtype first"));
  }
  if (ctx.payloads == nullptr) {
    return absl::InternalError("codec: no payload list for tensors");
  }
  out->set_dtype(static_cast<int32_t>(tensor.scalar_type()));
  for (int64_t s : tensor.sizes()) out->add_sizes(s);
  out->set_requires_grad(tensor.requires_grad());
  out->set_payload(static_cast<uint32_t>(ctx.payloads->size()));
  // contiguous() returns the tensor itself when it already is; a view then
  // sends [data_ptr, data_ptr + nbytes) and nothing else of its storage.
  // resolve_conj/neg: a conjugate or negative view is a flag over the
  // unchanged bytes; send the values it stands for.
  at::Tensor payload = tensor.detach().resolve_conj().resolve_neg().contiguous();
  int cuda_destination = -1;
  if (dst.is_cuda()) {
    out->set_device(dst.str());
    cuda_destination = dst.index();
  } else if (payload.is_cuda()) {
    payload = payload.cpu();  // mapped to the peer's CPU
  }
  if (ctx.cuda_destinations != nullptr) {
    ctx.cuda_destinations->resize(ctx.payloads->size(), -1);
    ctx.cuda_destinations->push_back(cuda_destination);
  }
  ctx.payloads->push_back(std::move(payload));
  if (tensor.requires_grad() && ctx.grad_tensors != nullptr) ctx.grad_tensors->push_back(tensor);
  return absl::OkStatus();
}

// The sizes of a tensor message and their element count, checked: none
// negative, and no product that overflows (the product of the non-zero
// sizes bounds every stride, so it must not overflow even when another
// size is zero).
absl::Status CheckedSizes(const wire::TensorMeta& meta, std::vector<int64_t>* sizes, uint64_t* extent,
                          uint64_t* numel) {
  *extent = 1;
  bool empty = false;
  sizes->reserve(meta.sizes_size());
  for (int64_t s : meta.sizes()) {
    if (s < 0) return absl::InvalidArgumentError(absl::StrCat("tensor: negative size ", s));
    if (s == 0) {
      empty = true;
    } else if (*extent > (uint64_t{1} << 62) / static_cast<uint64_t>(s)) {
      return absl::InvalidArgumentError("tensor: sizes overflow");
    } else {
      *extent *= static_cast<uint64_t>(s);
    }
    sizes->push_back(s);
  }
  *numel = empty ? 0 : *extent;
  return absl::OkStatus();
}

// The device a tensor message names (none: the CPU), checked to exist here.
absl::StatusOr<std::optional<c10::Device>> DeviceOf(const wire::TensorMeta& meta) {
  if (meta.device().empty()) return std::optional<c10::Device>();
  ASSIGN_OR_RETURN(c10::Device device, channel::ParseDevice(meta.device(), "tensor"));
  if (!device.is_cpu()) {
    if (absl::Status s = channel::CheckLocalDevice(device); !s.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("a tensor for ", device.str(), " arrived, but ",
                                                        s.message(), "; fix the sender's device map"));
    }
  }
  return std::optional<c10::Device>(device);
}

absl::StatusOr<at::Tensor> DecodeTensor(const wire::TensorMeta& meta,
                                        DecodeContext& ctx) {
  if (meta.dtype() == kUndefinedTensor) return at::Tensor();
  if (!IsSendableDtype(meta.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor: unknown dtype ", meta.dtype()));
  }
  const auto dtype = static_cast<c10::ScalarType>(meta.dtype());
  const uint64_t item = c10::elementSize(dtype);
  std::vector<int64_t> sizes;
  uint64_t extent = 1, numel = 0;
  RETURN_IF_ERROR(CheckedSizes(meta, &sizes, &extent, &numel));
  if (ctx.payloads == nullptr || meta.payload() >= ctx.payloads->size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor: payload ", meta.payload(), " does not exist"));
  }
  const at::Tensor& bytes = (*ctx.payloads)[meta.payload()];
  if (extent > (uint64_t{1} << 62) / item ||
      static_cast<uint64_t>(bytes.numel()) != numel * item) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor: ", bytes.numel(), " payload bytes do not match dtype ",
        c10::toString(dtype), " x ", numel, " elements"));
  }
  ASSIGN_OR_RETURN(const std::optional<c10::Device> device, DeviceOf(meta));
  auto options = at::TensorOptions().dtype(dtype);
  at::Tensor t;
  void* data = bytes.numel() > 0 ? bytes.data_ptr() : nullptr;
  if (bytes.is_cuda()) {
    // Came through the CUDA channel: already on the device the map named.
    if (!device || *device != bytes.device()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor: its bytes arrived on ", bytes.device().str(), " but it belongs on ",
          device ? device->str() : "cpu"));
    }
    ASSIGN_OR_RETURN(t, ViewBytesAs(bytes, dtype, sizes));
  } else if (data != nullptr && reinterpret_cast<uintptr_t>(data) % item == 0) {
    at::Tensor keep = bytes;  // the payload lives as long as this tensor
    t = at::from_blob(data, sizes, [keep](void*) mutable { keep.reset(); },
                      options);
  } else {
    t = at::empty(sizes, options);
    if (data != nullptr) std::memcpy(t.data_ptr(), data, bytes.numel());
  }
  if (device && device->is_cuda() && !t.is_cuda()) {
    try {
      t = t.to(*device);  // staged through host memory
    } catch (...) {
      return base::StatusFromCurrentException(absl::StrCat("copying a tensor to ", device->str()));
    }
  }
  if (meta.requires_grad()) {
    if (!c10::isFloatingType(dtype) && !c10::isComplexType(dtype)) {
      return absl::InvalidArgumentError(
          "tensor: only floating point tensors can require grad");
    }
    t.set_requires_grad(true);
    if (ctx.grad_tensors != nullptr) ctx.grad_tensors->push_back(t);
  }
  return t;
}

absl::Status EncodeList(const std::vector<c10::IValue>& items,
                        wire::ElemKind elem, EncodeContext& ctx,
                        wire::ListValue* out) {
  out->set_elem(elem);
  for (const auto& item : items) {
    RETURN_IF_ERROR(EncodeValue(item, ctx, out->add_items()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<at::Tensor> ViewBytesAs(const at::Tensor& bytes, c10::ScalarType dtype,
                                       at::IntArrayRef sizes) {
  try {
    at::Tensor flat = bytes.reshape({-1});
    // view(dtype) reinterprets the last dimension; a byte tensor of zero
    // elements has nothing to reinterpret.
    if (flat.numel() == 0) return at::empty(sizes, bytes.options().dtype(dtype));
    return flat.view(dtype).view(sizes);
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat(
        "viewing ", bytes.numel(), " payload bytes as ", c10::toString(dtype)));
  }
}

absl::Status EncodeValue(const c10::IValue& v, EncodeContext& ctx,
                         wire::Value* out) {
  if (v.isNone()) {
    out->set_none(true);
  } else if (v.isBool()) {
    out->set_b(v.toBool());
  } else if (v.isInt()) {
    out->set_i(v.toInt());
  } else if (v.isDouble()) {
    out->set_d(v.toDouble());
  } else if (v.isComplexDouble()) {
    auto c = v.toComplexDouble();
    out->mutable_c()->set_real(c.real());
    out->mutable_c()->set_imag(c.imag());
  } else if (v.isString()) {
    out->set_s(v.toStringRef());
  } else if (v.isDevice()) {
    out->set_device(v.toDevice().str());
  } else if (v.isTensor()) {
    return EncodeTensor(v.toTensor(), ctx, out->mutable_tensor());
  } else if (v.isList()) {
    auto list = v.toList();
    std::vector<c10::IValue> items(list.begin(), list.end());
    return EncodeList(items, KindOf(list.elementType()), ctx, out->mutable_list());
  } else if (v.isTuple()) {
    const auto& elems = v.toTupleRef().elements();
    std::vector<c10::IValue> items(elems.begin(), elems.end());
    return EncodeList(items, wire::ELEM_ANY, ctx, out->mutable_tuple());
  } else if (v.isGenericDict()) {
    auto dict = v.toGenericDict();
    auto* d = out->mutable_dict();
    d->set_key(KindOf(dict.keyType()));
    d->set_value(KindOf(dict.valueType()));
    for (const auto& entry : dict) {
      RETURN_IF_ERROR(EncodeValue(entry.key(), ctx, d->add_keys()));
      RETURN_IF_ERROR(EncodeValue(entry.value(), ctx, d->add_values()));
    }
  } else if (v.isRRef()) {
    if (ctx.rrefs == nullptr) {
      return absl::FailedPreconditionError("cannot send an RRef outside an agent");
    }
    return ctx.rrefs->ForkForSend(v, ctx.dst, out->mutable_rref());
  } else {
    return absl::UnimplementedError(absl::StrCat(
        "cannot send a value of type ", v.tagKind(),
        "; send tensors, scalars, strings, lists, tuples, dicts or RRefs"));
  }
  return absl::OkStatus();
}

absl::StatusOr<c10::IValue> DecodeValue(const wire::Value& v, DecodeContext& ctx) {
  switch (v.kind_case()) {
    case wire::Value::kNone:
      return c10::IValue();
    case wire::Value::kB:
      return c10::IValue(v.b());
    case wire::Value::kI:
      return c10::IValue(static_cast<int64_t>(v.i()));
    case wire::Value::kD:
      return c10::IValue(v.d());
    case wire::Value::kC:
      return c10::IValue(c10::complex<double>(v.c().real(), v.c().imag()));
    case wire::Value::kS:
      return c10::IValue(v.s());
    case wire::Value::kDevice: {
      try {
        return c10::IValue(c10::Device(v.device()));
      } catch (...) {
        return base::StatusFromCurrentException("device");
      }
    }
    case wire::Value::kTensor: {
      ASSIGN_OR_RETURN(at::Tensor t, DecodeTensor(v.tensor(), ctx));
      return c10::IValue(std::move(t));
    }
    case wire::Value::kList: {
      const auto& l = v.list();
      c10::impl::GenericList list(TypeOf(l.elem()));
      list.reserve(l.items_size());
      for (const auto& item : l.items()) {
        ASSIGN_OR_RETURN(c10::IValue iv, DecodeValue(item, ctx));
        if (!Matches(iv, l.elem())) {
          return absl::InvalidArgumentError("list: element does not match its type");
        }
        list.push_back(std::move(iv));
      }
      return c10::IValue(std::move(list));
    }
    case wire::Value::kTuple: {
      std::vector<c10::IValue> elems;
      elems.reserve(v.tuple().items_size());
      for (const auto& item : v.tuple().items()) {
        ASSIGN_OR_RETURN(c10::IValue iv, DecodeValue(item, ctx));
        elems.push_back(std::move(iv));
      }
      return c10::IValue(c10::ivalue::Tuple::create(std::move(elems)));
    }
    case wire::Value::kDict: {
      const auto& d = v.dict();
      if (d.keys_size() != d.values_size()) {
        return absl::InvalidArgumentError("dict: key and value counts differ");
      }
      c10::impl::GenericDict dict(TypeOf(d.key()), TypeOf(d.value()));
      for (int i = 0; i < d.keys_size(); ++i) {
        ASSIGN_OR_RETURN(c10::IValue key, DecodeValue(d.keys(i), ctx));
        ASSIGN_OR_RETURN(c10::IValue value, DecodeValue(d.values(i), ctx));
        if (!Matches(key, d.key()) || !Matches(value, d.value()) ||
            !(key.isString() || key.isInt() || key.isDouble() ||
              key.isBool() || key.isTensor())) {
          return absl::InvalidArgumentError("dict: entry does not match its type");
        }
        dict.insert_or_assign(std::move(key), std::move(value));
      }
      return c10::IValue(std::move(dict));
    }
    case wire::Value::kRref:
      if (ctx.rrefs == nullptr) {
        return absl::FailedPreconditionError("cannot receive an RRef outside an agent");
      }
      return ctx.rrefs->Receive(v.rref(), ctx.pending);
    case wire::Value::KIND_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError("value: no kind set");
}

}  // namespace remora::rpc
