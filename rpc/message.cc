#include "rpc/message.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <string>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "runtime/buffer_cache.h"

namespace remora::rpc {
namespace {

void DeleteTensor(void* tensor) { delete static_cast<at::Tensor*>(tensor); }

constexpr size_t kParallelCopyBytes = 8 << 20;

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
  absl::StatusOr<at::Tensor> Take(size_t n) {
    const int64_t len = static_cast<int64_t>(n);
    if (n == 0) return at::empty({0}, at::kByte);
    if (slices_[index_].size() - offset_ >= n) {
      auto slice = std::make_shared<grpc::Slice>(slices_[index_]);
      void* data = const_cast<uint8_t*>(slice->begin() + offset_);
      Advance(n);
      return at::from_blob(data, {len}, [slice](void*) mutable { slice.reset(); },
                           at::TensorOptions().dtype(at::kByte));
    }
    ASSIGN_OR_RETURN(at::Tensor out, runtime::AllocateReceiveBuffer(n));
    if (n < kParallelCopyBytes) {
      Copy(out.data_ptr(), n);
      return out;
    }
    // Large payloads: gather the pieces, then copy them on LibTorch's
    // intra-op threads (the network side is idle by now).
    std::vector<std::pair<const uint8_t*, size_t>> pieces;
    size_t left = n;
    while (left > 0) {
      const grpc::Slice& s = slices_[index_];
      size_t take = std::min(left, s.size() - offset_);
      pieces.emplace_back(s.begin() + offset_, take);
      Advance(take);
      left -= take;
    }
    std::vector<size_t> starts(pieces.size());
    for (size_t i = 1; i < pieces.size(); ++i) starts[i] = starts[i - 1] + pieces[i - 1].second;
    auto* dst = static_cast<uint8_t*>(out.data_ptr());
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        std::memcpy(dst + starts[i], pieces[i].first, pieces[i].second);
      }
    });
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

void FillAll(const channel::Route& route, std::vector<ShmFill>& fills) {
  for (auto& f : fills) {
    route.shm->Fill(f.descriptor, f.payload);
    f.payload = at::Tensor();
  }
}

grpc::ByteBuffer SerializeMessage(OutMessage message, const channel::Route& route,
                                  std::vector<ShmFill>* fills,
                                  std::vector<wire::CudaPayload>* cuda_sent) {
  std::vector<bool> out_of_band(message.payloads.size(), false);
  for (size_t i = 0; i < message.payloads.size(); ++i) {
    at::Tensor& p = message.payloads[i];
    message.header.add_payload_sizes(p.nbytes());
    if (p.is_cuda()) {
      const int dst = i < message.cuda_destinations.size() ? message.cuda_destinations[i] : -1;
      if (route.cuda != nullptr && dst >= 0) {
        if (auto d = route.cuda->Send(route.peer, p, dst)) {
          d->set_payload(static_cast<uint32_t>(i));
          d->set_stream_group(message.stream_group);
          if (cuda_sent != nullptr) cuda_sent->push_back(*d);
          *message.header.add_cuda_payloads() = std::move(*d);
          out_of_band[i] = true;
          continue;
        }
      }
      p = p.cpu();  // staged: waits for the producer, then travels as bytes
    }
    if (route.shm == nullptr || p.nbytes() < route.threshold) continue;
    std::optional<wire::ShmPayload> d =
        fills != nullptr ? route.shm->Reserve(p.nbytes()) : route.shm->Write(p);
    if (!d) continue;  // no segment to spare: inline
    d->set_payload(static_cast<uint32_t>(i));
    if (fills != nullptr) fills->push_back(ShmFill{*d, p});
    *message.header.add_shm_payloads() = std::move(*d);
    out_of_band[i] = true;
  }
  const uint32_t header_len = static_cast<uint32_t>(message.header.ByteSizeLong());

  std::vector<grpc::Slice> slices;
  std::string buf;
  buf.resize(4 + header_len);
  std::memcpy(&buf[0], &header_len, 4);  // x86-64 and aarch64: little-endian
  message.header.SerializeWithCachedSizesToArray(
      reinterpret_cast<uint8_t*>(&buf[4]));
  for (size_t i = 0; i < message.payloads.size(); ++i) {
    if (out_of_band[i]) continue;
    at::Tensor& p = message.payloads[i];
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

namespace {

// Reads a frame's header into `header` and leaves `reader` at the payloads.
absl::Status ReadHeader(SliceReader& reader, wire::Header* header) {
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
  bool parsed;
  if (const uint8_t* p = reader.Peek(header_len)) {
    parsed = header->ParseFromArray(p, static_cast<int>(header_len));
    reader.Advance(header_len);
  } else {
    std::string bytes(header_len, '\0');
    reader.Copy(&bytes[0], header_len);
    parsed = header->ParseFromString(bytes);
  }
  if (!parsed) return absl::InvalidArgumentError("frame: header does not parse");
  return absl::OkStatus();
}

absl::StatusOr<SliceReader> ReaderOf(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) {
    return absl::InvalidArgumentError("frame: cannot read the received buffer");
  }
  return SliceReader(std::move(slices));
}

// Indexes the frame's shared-memory payloads by payload (null: not one).
absl::Status IndexShmPayloads(const wire::Header& header, const channel::ShmChannel* shm,
                              std::vector<const wire::ShmPayload*>* shm_of) {
  for (const auto& d : header.shm_payloads()) {
    if (d.payload() >= shm_of->size() || (*shm_of)[d.payload()] != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "frame: shared-memory payload index ", d.payload(), " is out of range or repeated"));
    }
    (*shm_of)[d.payload()] = &d;
  }
  if (!header.shm_payloads().empty() && shm == nullptr) {
    return absl::InvalidArgumentError(
        "frame: it carries shared-memory payloads, but the sender is not on this host "
        "or shared memory is off here");
  }
  return absl::OkStatus();
}

// Checks the inline payloads' sizes against the bytes after the header.
absl::Status CheckInlineSizes(const google::protobuf::RepeatedField<uint64_t>& sizes,
                              const std::vector<const wire::ShmPayload*>& shm_of,
                              const std::vector<const wire::CudaPayload*>& cuda_of,
                              size_t remaining) {
  uint64_t total = 0;
  for (int i = 0; i < sizes.size(); ++i) {
    if (shm_of[i] != nullptr || cuda_of[i] != nullptr) continue;
    const uint64_t n = sizes[i];
    if (n > remaining || total + n > remaining) {
      return absl::InvalidArgumentError(absl::StrCat(
          "frame: payload sizes exceed the ", remaining,
          " bytes received"));
    }
    total += n;
  }
  if (total != remaining) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame: payload sizes add up to ", total, " but ",
                     remaining, " bytes follow the header"));
  }
  return absl::OkStatus();
}

}  // namespace

grpc::ByteBuffer TagFrame(uint64_t id, const grpc::ByteBuffer& frame) {
  std::vector<grpc::Slice> slices;
  slices.reserve(4);
  char tag[8];
  std::memcpy(tag, &id, 8);  // x86-64 and aarch64: little-endian
  slices.emplace_back(tag, 8);
  if (frame.Valid()) {
    std::vector<grpc::Slice> rest;
    if (frame.Dump(&rest).ok()) {
      for (auto& s : rest) slices.push_back(std::move(s));
    }
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::StatusOr<uint64_t> UntagFrame(grpc::ByteBuffer* message) {
  std::vector<grpc::Slice> slices;
  if (!message->Valid() || !message->Dump(&slices).ok()) {
    return absl::InvalidArgumentError("stream message: cannot read the received buffer");
  }
  uint64_t id = 0;
  size_t got = 0;
  size_t first = 0;  // slices wholly taken by the id
  for (; first < slices.size() && got < 8; ++first) {
    const size_t take = std::min<size_t>(8 - got, slices[first].size());
    std::memcpy(reinterpret_cast<char*>(&id) + got, slices[first].begin(), take);
    got += take;
    if (take < slices[first].size()) {
      slices[first] = slices[first].sub(take, slices[first].size());
      break;
    }
  }
  if (got < 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("stream message: ", got, " bytes is too short to hold a call id"));
  }
  slices.erase(slices.begin(), slices.begin() + static_cast<std::ptrdiff_t>(first));
  *message = grpc::ByteBuffer(slices.data(), slices.size());
  return id;
}

absl::StatusOr<wire::Header> ReadFrameHeader(const grpc::ByteBuffer& buffer) {
  ASSIGN_OR_RETURN(SliceReader reader, ReaderOf(buffer));
  wire::Header header;
  RETURN_IF_ERROR(ReadHeader(reader, &header));
  return header;
}

bool CarriesCudaPayloads(const grpc::ByteBuffer& buffer) {
  auto header = ReadFrameHeader(buffer);
  return header.ok() && !header->cuda_payloads().empty();
}

absl::StatusOr<InMessage> ParseMessage(const grpc::ByteBuffer& buffer, channel::ShmChannel* shm,
                                       channel::CudaChannel* cuda, base::WorkerId from) {
  ASSIGN_OR_RETURN(SliceReader reader, ReaderOf(buffer));
  InMessage message;
  RETURN_IF_ERROR(ReadHeader(reader, &message.header));

  const auto& sizes = message.header.payload_sizes();
  std::vector<const wire::ShmPayload*> shm_of(sizes.size(), nullptr);
  RETURN_IF_ERROR(IndexShmPayloads(message.header, shm, &shm_of));
  std::vector<const wire::CudaPayload*> cuda_of(sizes.size(), nullptr);
  for (const auto& d : message.header.cuda_payloads()) {
    if (d.payload() >= cuda_of.size() || cuda_of[d.payload()] != nullptr ||
        shm_of[d.payload()] != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "frame: CUDA payload index ", d.payload(), " is out of range or repeated"));
    }
    cuda_of[d.payload()] = &d;
  }
  if (!message.header.cuda_payloads().empty()) {
    if (cuda == nullptr) {
      return absl::InvalidArgumentError(
          "frame: it carries CUDA payloads, but this process has no CUDA channel");
    }
    if (from == base::kUnknownWorker) from = static_cast<base::WorkerId>(message.header.request().from());
  }
  RETURN_IF_ERROR(CheckInlineSizes(sizes, shm_of, cuda_of, reader.remaining()));
  // A payload that fails leaves the frame's later CUDA payloads unreceived:
  // the channel lets their senders know at once (an NCCL transfer that is
  // never posted would hold up the ones after it until they time out).
  auto fail_from = [&](int i, const absl::Status& why) {
    for (int k = i; k < sizes.size(); ++k) {
      if (cuda_of[k] != nullptr) cuda->Abandon(from, *cuda_of[k], std::string(why.message()));
    }
    return base::Annotate(why, "frame");
  };
  message.payloads.reserve(sizes.size());
  for (int i = 0; i < sizes.size(); ++i) {
    if (cuda_of[i] != nullptr) {
      auto out = cuda->Receive(from, *cuda_of[i], sizes[i]);
      if (!out.ok()) return fail_from(i, out.status());
      message.payloads.push_back(std::move(*out));
      continue;
    }
    if (shm_of[i] == nullptr) {
      auto out = reader.Take(sizes[i]);
      if (!out.ok()) return fail_from(i + 1, out.status());
      message.payloads.push_back(std::move(*out));
      continue;
    }
    auto out = shm->Receive(from, *shm_of[i], sizes[i]);
    if (!out.ok()) return fail_from(i + 1, out.status());
    message.payloads.push_back(std::move(*out));
  }
  return message;
}

}  // namespace remora::rpc
