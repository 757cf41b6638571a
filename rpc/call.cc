#include "rpc/call.h"

#include <limits>
#include <stdexcept>

#include "absl/strings/str_cat.h"

namespace remora::rpc {

namespace {

// Reads list `v` into `out` when every element passes `is`, converting each
// with `get`: a typed list, or a generic one (as an empty list arrives).
// False, leaving `out` as it was, for anything else.
template <typename T, typename Is, typename Get>
bool ReadList(const c10::IValue& v, Is is, Get get, std::vector<T>& out) {
  if (!v.isList()) return false;
  std::vector<T> values;
  for (const c10::IValue& e : v.toListRef()) {
    if (!is(e)) return false;
    values.push_back(get(e));
  }
  out = std::move(values);
  return true;
}

}  // namespace

void ThrowStatus(const absl::Status& status) { throw std::invalid_argument(std::string(status.message())); }

const c10::IValue* ArgReader::Next(absl::string_view field) {
  if (!status_.ok()) return nullptr;
  if (next_ >= values_.size()) {
    status_ = absl::InvalidArgumentError(absl::StrCat(
        function_, ": argument ", next_, " ('", field, "') is missing: the call has ", values_.size(),
        " arguments (are the caller and this worker the same remora version?)"));
    return nullptr;
  }
  return &values_[next_++];
}

void ArgReader::Wrong(absl::string_view field, absl::string_view wanted, const c10::IValue& got) {
  status_ = absl::InvalidArgumentError(absl::StrCat(function_, ": argument ", next_ - 1, " ('", field,
                                                    "') must be ", wanted, ", got a ", got.tagKind()));
}

ArgReader& ArgReader::operator()(absl::string_view field, int64_t& out) {
  const c10::IValue* v = Next(field);
  if (v == nullptr) return *this;
  if (!v->isInt()) {
    Wrong(field, "an int", *v);
  } else {
    out = v->toInt();
  }
  return *this;
}

ArgReader& ArgReader::operator()(absl::string_view field, int& out) {
  int64_t wide = 0;
  (*this)(field, wide);
  if (!status_.ok()) return *this;
  if (wide < std::numeric_limits<int>::min() || wide > std::numeric_limits<int>::max()) {
    status_ = absl::InvalidArgumentError(
        absl::StrCat(function_, ": argument ", next_ - 1, " ('", field, "') is ", wide, ", out of range"));
  } else {
    out = static_cast<int>(wide);
  }
  return *this;
}

ArgReader& ArgReader::operator()(absl::string_view field, double& out) {
  const c10::IValue* v = Next(field);
  if (v == nullptr) return *this;
  if (v->isDouble()) {
    out = v->toDouble();
  } else if (v->isInt()) {
    out = static_cast<double>(v->toInt());
  } else {
    Wrong(field, "a number", *v);
  }
  return *this;
}

ArgReader& ArgReader::operator()(absl::string_view field, bool& out) {
  const c10::IValue* v = Next(field);
  if (v == nullptr) return *this;
  if (!v->isBool()) {
    Wrong(field, "a bool", *v);
  } else {
    out = v->toBool();
  }
  return *this;
}

ArgReader& ArgReader::operator()(absl::string_view field, std::string& out) {
  const c10::IValue* v = Next(field);
  if (v == nullptr) return *this;
  if (!v->isString()) {
    Wrong(field, "a string", *v);
  } else {
    out = v->toStringRef();
  }
  return *this;
}

ArgReader& ArgReader::operator()(absl::string_view field, std::vector<int64_t>& out) {
  const c10::IValue* v = Next(field);
  auto is_int = [](const c10::IValue& e) { return e.isInt(); };
  auto to_int = [](const c10::IValue& e) { return e.toInt(); };
  if (v != nullptr && !ReadList(*v, is_int, to_int, out)) {
    Wrong(field, "a list of ints", *v);
  }
  return *this;
}

ArgReader& ArgReader::operator()(absl::string_view field, std::vector<double>& out) {
  const c10::IValue* v = Next(field);
  auto is_number = [](const c10::IValue& e) { return e.isDouble() || e.isInt(); };
  auto to_double = [](const c10::IValue& e) {
    return e.isDouble() ? e.toDouble() : static_cast<double>(e.toInt());
  };
  if (v != nullptr && !ReadList(*v, is_number, to_double, out)) Wrong(field, "a list of numbers", *v);
  return *this;
}

ArgReader& ArgReader::operator()(absl::string_view field, std::vector<std::string>& out) {
  const c10::IValue* v = Next(field);
  auto is_string = [](const c10::IValue& e) { return e.isString(); };
  auto to_string = [](const c10::IValue& e) { return e.toStringRef(); };
  if (v != nullptr && !ReadList(*v, is_string, to_string, out)) {
    Wrong(field, "a list of strings", *v);
  }
  return *this;
}

ArgReader& ArgReader::operator()(absl::string_view field, at::Tensor& out) {
  const c10::IValue* v = Next(field);
  if (v == nullptr) return *this;
  if (!v->isTensor()) {
    Wrong(field, "a tensor", *v);
  } else {
    out = v->toTensor();
  }
  return *this;
}

ArgReader& ArgReader::operator()(absl::string_view field, std::vector<at::Tensor>& out) {
  const c10::IValue* v = Next(field);
  auto is_tensor = [](const c10::IValue& e) { return e.isTensor(); };
  auto to_tensor = [](const c10::IValue& e) { return e.toTensor(); };
  if (v != nullptr && !ReadList(*v, is_tensor, to_tensor, out)) {
    Wrong(field, "a list of tensors", *v);
  }
  return *this;
}

ArgReader& ArgReader::operator()(absl::string_view field, std::vector<c10::IValue>& out) {
  const c10::IValue* v = Next(field);
  if (v == nullptr) return *this;
  if (!v->isList()) {
    Wrong(field, "a list", *v);
  } else {
    out = v->toListRef().vec();
  }
  return *this;
}

ArgReader& ArgReader::operator()(absl::string_view field, c10::IValue& out) {
  const c10::IValue* v = Next(field);
  if (v != nullptr) out = *v;
  return *this;
}

absl::Status ArgReader::Finish() {
  if (status_.ok() && next_ < values_.size()) {
    status_ = absl::InvalidArgumentError(absl::StrCat(
        function_, ": ", values_.size(), " arguments where ", next_,
        " were expected (are the caller and this worker the same remora version?)"));
  }
  return status_;
}

ArgWriter& ArgWriter::operator()(absl::string_view, const std::vector<std::string>& value) {
  c10::List<std::string> list;
  list.reserve(value.size());
  for (const std::string& s : value) list.push_back(s);
  out_.emplace_back(std::move(list));
  return *this;
}

ArgWriter& ArgWriter::operator()(absl::string_view, const std::vector<at::Tensor>& value) {
  c10::List<at::Tensor> list;
  list.reserve(value.size());
  for (const at::Tensor& t : value) list.push_back(t);
  out_.emplace_back(std::move(list));
  return *this;
}

ArgWriter& ArgWriter::operator()(absl::string_view, const std::vector<c10::IValue>& value) {
  c10::impl::GenericList list(c10::AnyType::get());
  list.reserve(value.size());
  for (const c10::IValue& v : value) list.push_back(v);
  out_.emplace_back(std::move(list));
  return *this;
}

}  // namespace remora::rpc
