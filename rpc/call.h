// Typed calls: the arguments of a function one process calls on another,
// as a struct whose fields are listed once, in order, for both sides.
//
//   struct PushRequest {
//     static constexpr char kFunction[] = "remora.pipeline.push";
//     int64_t runner = 0;
//     c10::IValue value;
//     template <typename Fields>
//     void Visit(Fields& f) { f("runner", runner)("value", value); }
//   };
//
//   // caller:  agent.rpc_async(to, PushRequest::kFunction, EncodeCall(request));
//   // callee:  ASSIGN_OR_RETURN(PushRequest r, DecodeCall<PushRequest>(args));
//
// Visit names each field and its place; EncodeCall writes the fields as the
// call's arguments in that order and DecodeCall reads them back, checking
// each one's type. A missing, extra or mistyped argument is an error that
// names the call and the field ("remora.pipeline.push: argument 2 ('stage')
// must be an int, got a Tensor"), never a crash. Replies that carry several
// values, and structs inside a call, travel as tuples (EncodeTuple/
// DecodeTuple), named for errors by their own kFunction.
//
// Field types: int64_t, int, double, bool, std::string, std::vector of
// int64_t, double, std::string, at::Tensor or c10::IValue, at::Tensor, std::optional of
// any of these (None when empty), and c10::IValue (anything, None included:
// a value the callee interprets itself, like a stage's input or an RRef).
//
// Thread-safety: the functions are pure; ArgReader and ArgWriter live for
// one encode or decode, on one thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "rpc/registry.h"

namespace remora::rpc {

// Throws std::invalid_argument with `status`'s message.
[[noreturn]] void ThrowStatus(const absl::Status& status);

// Marks a field that callers may leave off the end of a call (a
// registered stage type's optional arguments, say): f("seed", seed,
// kMayBeLeftOff). Reading keeps the field's default when the call ends
// before it; writing always writes it.
struct MayBeLeftOff {};
inline constexpr MayBeLeftOff kMayBeLeftOff{};

// Reads a call's arguments in the order Visit lists them. After the first
// error every read does nothing; status() holds it.
class ArgReader {
 public:
  ArgReader(absl::string_view function, c10::ArrayRef<c10::IValue> values)
      : function_(function), values_(values) {}

  ArgReader& operator()(absl::string_view field, int64_t& out);
  ArgReader& operator()(absl::string_view field, int& out);
  ArgReader& operator()(absl::string_view field, double& out);
  ArgReader& operator()(absl::string_view field, bool& out);
  ArgReader& operator()(absl::string_view field, std::string& out);
  ArgReader& operator()(absl::string_view field, std::vector<int64_t>& out);
  ArgReader& operator()(absl::string_view field, std::vector<double>& out);
  ArgReader& operator()(absl::string_view field, std::vector<std::string>& out);
  ArgReader& operator()(absl::string_view field, at::Tensor& out);
  ArgReader& operator()(absl::string_view field, std::vector<at::Tensor>& out);
  ArgReader& operator()(absl::string_view field, std::vector<c10::IValue>& out);
  ArgReader& operator()(absl::string_view field, c10::IValue& out);
  template <typename T>
  ArgReader& operator()(absl::string_view field, std::optional<T>& out) {
    const c10::IValue* v = Next(field);
    if (v == nullptr || v->isNone()) {
      if (v != nullptr) out.reset();
      return *this;
    }
    --next_;  // read the value itself as a T
    T value{};
    (*this)(field, value);
    if (status_.ok()) out = std::move(value);
    return *this;
  }

  template <typename T>
  ArgReader& operator()(absl::string_view field, T& out, MayBeLeftOff) {
    if (status_.ok() && next_ >= values_.size()) return *this;  // left off: the default
    return (*this)(field, out);
  }

  // OK when every argument was there with its type and none was left over.
  absl::Status Finish();

 private:
  // The next argument, or null (status_ set) when it is missing or an
  // earlier one failed.
  const c10::IValue* Next(absl::string_view field);
  void Wrong(absl::string_view field, absl::string_view wanted, const c10::IValue& got);

  absl::string_view function_;
  c10::ArrayRef<c10::IValue> values_;
  size_t next_ = 0;
  absl::Status status_;
};

// Writes fields as a call's arguments, in the order Visit lists them.
class ArgWriter {
 public:
  explicit ArgWriter(std::vector<c10::IValue>& out) : out_(out) {}

  ArgWriter& operator()(absl::string_view, const std::vector<std::string>& value);
  ArgWriter& operator()(absl::string_view, const std::vector<at::Tensor>& value);
  ArgWriter& operator()(absl::string_view, const std::vector<c10::IValue>& value);
  template <typename T>
  ArgWriter& operator()(absl::string_view field, const T& value, MayBeLeftOff) {
    return (*this)(field, value);
  }
  template <typename T>
  ArgWriter& operator()(absl::string_view field, const std::optional<T>& value) {
    if (!value.has_value()) {
      out_.emplace_back();
      return *this;
    }
    return (*this)(field, *value);
  }
  template <typename T>
  ArgWriter& operator()(absl::string_view, const T& value) {
    out_.emplace_back(value);
    return *this;
  }

 private:
  std::vector<c10::IValue>& out_;
};

// The call's arguments: `request`'s fields in Visit's order.
template <typename Request>
std::vector<c10::IValue> EncodeCall(const Request& request) {
  std::vector<c10::IValue> out;
  ArgWriter writer(out);
  // (Visit is one template for reading and writing; writing only reads.)
  const_cast<Request&>(request).Visit(writer);
  return out;
}

// The request `args` hold, or an error naming Request::kFunction and the
// field that is missing, extra or of the wrong type.
template <typename Request>
absl::StatusOr<Request> DecodeCall(c10::ArrayRef<c10::IValue> args) {
  Request request;
  ArgReader reader(Request::kFunction, args);
  request.Visit(reader);
  if (absl::Status s = reader.Finish(); !s.ok()) return s;
  return request;
}
template <typename Request>
absl::StatusOr<Request> DecodeCall(const Args& args) {
  // (Args keeps its values in one vector.)
  return DecodeCall<Request>(args.size() == 0 ? c10::ArrayRef<c10::IValue>()
                                              : c10::ArrayRef<c10::IValue>(&args[0], args.size()));
}

// For a registered function's body (or a stage type's factory, which takes
// a vector): DecodeCall's request, or a throw of its error (the registry
// turns it into the caller's error).
template <typename Request>
Request DecodeCallOrThrow(c10::ArrayRef<c10::IValue> args) {
  absl::StatusOr<Request> request = DecodeCall<Request>(args);
  if (!request.ok()) ThrowStatus(request.status());
  return *std::move(request);
}
template <typename Request>
Request DecodeCallOrThrow(const Args& args) {
  absl::StatusOr<Request> request = DecodeCall<Request>(args);
  if (!request.ok()) ThrowStatus(request.status());
  return *std::move(request);
}

// A reply of several values, or a struct that travels inside a call: the
// fields as a tuple, and back.
template <typename Reply>
c10::IValue EncodeTuple(const Reply& reply) {
  return c10::ivalue::Tuple::create(EncodeCall(reply));
}
template <typename Reply>
absl::StatusOr<Reply> DecodeTuple(const c10::IValue& value) {
  if (!value.isTuple()) {
    return absl::InternalError(std::string(Reply::kFunction) + ": a " + value.tagKind() +
                               " where a tuple of its fields was expected (are both sides the same remora version?)");
  }
  return DecodeCall<Reply>(value.toTupleRef().elements().asArrayRef());
}

}  // namespace remora::rpc
