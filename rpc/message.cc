#include "rpc/message.h"

#include <cstring>
#include <memory>
#include <string>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include "absl/strings/str_cat.h"

namespace remora {
namespace {

void DeleteTensor(void* tensor) { delete static_cast<at::Tensor*>(tensor); }

// Reads a sequence of gRPC slices front to back.
class SliceReader {
 public:
  explicit SliceReader(std::vector<grpc::Slice> slices)
      : slices_(std::move(slices)) {
    for (const auto& s : slices_) remaining_ += s.size();
    SkipEmpty();
  }

  size_t remaining() const { return remaining_; }

  // Copies `n` bytes to `out` (caller checked remaining()).
  void Copy(void* out, size_t n) {
    auto* dst = static_cast<uint8_t*>(out);
    while (n > 0) {
      const grpc::Slice& s = slices_[index_];
      size_t take = std::min(n, s.size() - offset_);
      std::memcpy(dst, s.begin() + offset_, take);
      dst += take;
      Advance(take);
      n -= take;
    }
  }

  // The next `n` bytes as a uint8 tensor: over the slice when they lie in
  // one, else a single copy.
  at::Tensor Take(size_t n) {
    const int64_t len = static_cast<int64_t>(n);
    if (n == 0) return at::empty({0}, at::kByte);
    if (slices_[index_].size() - offset_ >= n) {
      auto slice = std::make_shared<grpc::Slice>(slices_[index_]);
      void* data = const_cast<uint8_t*>(slice->begin() + offset_);
      Advance(n);
      return at::from_blob(data, {len}, [slice](void*) mutable { slice.reset(); },
                           at::TensorOptions().dtype(at::kByte));
    }
    at::Tensor out = at::empty({len}, at::kByte);
    Copy(out.data_ptr(), n);
    return out;
  }

  // A pointer to the next `n` bytes when they lie in one slice, else null.
  const uint8_t* Peek(size_t n) const {
    if (index_ < slices_.size() && slices_[index_].size() - offset_ >= n)
      return slices_[index_].begin() + offset_;
    return nullptr;
  }

  void Advance(size_t n) {
    offset_ += n;
    remaining_ -= n;
    SkipEmpty();
  }

 private:
  void SkipEmpty() {
    while (index_ < slices_.size() && offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  std::vector<grpc::Slice> slices_;
  size_t index_ = 0;
  size_t offset_ = 0;
  size_t remaining_ = 0;
};

}  // namespace

grpc::ByteBuffer SerializeMessage(OutMessage message) {
  for (const auto& p : message.payloads) message.header.add_payload_sizes(p.nbytes());
  const uint32_t header_len = static_cast<uint32_t>(message.header.ByteSizeLong());

  std::vector<grpc::Slice> slices;
  std::string buf;
  buf.resize(4 + header_len);
  std::memcpy(&buf[0], &header_len, 4);  // x86-64 and aarch64: little-endian
  message.header.SerializeWithCachedSizesToArray(
      reinterpret_cast<uint8_t*>(&buf[4]));
  for (auto& p : message.payloads) {
    const size_t n = p.nbytes();
    if (n <= kInlinePayloadBytes) {
      buf.append(static_cast<const char*>(p.data_ptr()), n);
      continue;
    }
    if (!buf.empty()) slices.emplace_back(buf);
    buf.clear();
    auto* keep = new at::Tensor(std::move(p));
    slices.emplace_back(keep->data_ptr(), n, &DeleteTensor, keep);
  }
  if (!buf.empty()) slices.emplace_back(buf);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::StatusOr<InMessage> ParseMessage(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) {
    return absl::InvalidArgumentError("frame: cannot read the received buffer");
  }
  SliceReader reader(std::move(slices));
  if (reader.remaining() < 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame: ", reader.remaining(), " bytes is too short"));
  }
  uint32_t header_len = 0;
  reader.Copy(&header_len, 4);
  if (header_len > reader.remaining()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "frame: header length ", header_len, " exceeds the ",
        reader.remaining(), " bytes received"));
  }
  InMessage message;
  bool parsed;
  if (const uint8_t* p = reader.Peek(header_len)) {
    parsed = message.header.ParseFromArray(p, static_cast<int>(header_len));
    reader.Advance(header_len);
  } else {
    std::string bytes(header_len, '\0');
    reader.Copy(&bytes[0], header_len);
    parsed = message.header.ParseFromString(bytes);
  }
  if (!parsed) return absl::InvalidArgumentError("frame: header does not parse");

  uint64_t total = 0;
  for (uint64_t n : message.header.payload_sizes()) {
    if (n > reader.remaining() || total + n > reader.remaining()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "frame: payload sizes exceed the ", reader.remaining(),
          " bytes received"));
    }
    total += n;
  }
  if (total != reader.remaining()) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame: payload sizes add up to ", total, " but ",
                     reader.remaining(), " bytes follow the header"));
  }
  message.payloads.reserve(message.header.payload_sizes_size());
  for (uint64_t n : message.header.payload_sizes()) {
    message.payloads.push_back(reader.Take(n));
  }
  return message;
}

}  // namespace remora
