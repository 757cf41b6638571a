#include "train/events.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/status_util.h"
#include "proto/tensorboard.pb.h"

namespace remora::train {
namespace {

constexpr char kFileVersion[] = "brain.Event:2";

double NowSeconds() { return absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()); }

// The table of CRC-32C, reflected polynomial 0x82f63b78.
const std::array<uint32_t, 256>& Crc32cTable() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

std::string LittleEndian(uint64_t v, int bytes) {
  std::string out(bytes, '\0');
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

uint64_t FromLittleEndian(std::string_view b) {
  uint64_t v = 0;
  for (size_t i = 0; i < b.size(); ++i) v |= uint64_t{static_cast<unsigned char>(b[i])} << (8 * i);
  return v;
}

}  // namespace

uint32_t Crc32c(std::string_view bytes) {
  const auto& table = Crc32cTable();
  uint32_t c = 0xffffffffu;
  for (char ch : bytes) c = table[(c ^ static_cast<unsigned char>(ch)) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t MaskedCrc32c(std::string_view bytes) {
  const uint32_t c = Crc32c(bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

absl::StatusOr<std::unique_ptr<EventWriter>> EventWriter::Open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot make the TensorBoard directory ", dir, ": ",
                                                   ec ? ec.message() : "not a directory"));
  }
  char host[256] = "host";
  gethostname(host, sizeof(host) - 1);
  const std::string path = absl::StrFormat("%s/events.out.tfevents.%d.%s.%d.remora", dir,
                                           static_cast<int64_t>(NowSeconds()), host, getpid());
  std::FILE* file = std::fopen(path.c_str(), "ab");
  if (file == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("cannot write ", path, ": ", std::strerror(errno)));
  }
  std::unique_ptr<EventWriter> writer(new EventWriter(path, file));
  tensorboard::Event first;
  first.set_wall_time(NowSeconds());
  first.set_file_version(kFileVersion);
  absl::Status s = writer->WriteRecord(first.SerializeAsString());
  if (s.ok()) s = writer->Flush();
  if (!s.ok()) return s;
  return writer;
}

EventWriter::~EventWriter() { std::fclose(file_); }

absl::Status EventWriter::WriteRecord(const std::string& bytes) {
  const std::string length = LittleEndian(bytes.size(), 8);
  const std::string record = absl::StrCat(length, LittleEndian(MaskedCrc32c(length), 4), bytes,
                                          LittleEndian(MaskedCrc32c(bytes), 4));
  if (std::fwrite(record.data(), 1, record.size(), file_) != record.size()) {
    return absl::InternalError(absl::StrCat("cannot write ", path_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status EventWriter::AddScalar(const std::string& tag, int64_t step, double value) {
  return AddScalar(tag, step, value, NowSeconds());
}

absl::Status EventWriter::AddScalar(const std::string& tag, int64_t step, double value, double wall_time) {
  tensorboard::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  tensorboard::SummaryValue* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->set_simple_value(static_cast<float>(value));
  if (absl::Status s = WriteRecord(e.SerializeAsString()); !s.ok()) return s;
  if (wall_time - last_flush_ >= 2.0) return Flush();
  return absl::OkStatus();
}

absl::Status EventWriter::AddRestart(int64_t step) {
  tensorboard::Event e;
  e.set_wall_time(NowSeconds());
  e.set_step(step);
  e.mutable_session_log()->set_status(tensorboard::SessionLog::START);
  return WriteRecord(e.SerializeAsString());
}

absl::Status EventWriter::Flush() {
  if (std::fflush(file_) != 0) {
    return absl::InternalError(absl::StrCat("cannot write ", path_, ": ", std::strerror(errno)));
  }
  last_flush_ = NowSeconds();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ScalarEvent>> ReadScalars(const std::string& path, std::string* version,
                                                     std::vector<int64_t>* restarts) {
  ASSIGN_OR_RETURN(const std::string bytes, base::ReadWholeFile(path));
  std::vector<ScalarEvent> out;
  size_t at = 0;
  while (at < bytes.size()) {
    auto bad = [&](const std::string& what) {
      return absl::DataLossError(absl::StrCat(path, ": the record at byte ", at, " ", what));
    };
    if (bytes.size() - at < 12) return bad("is cut short (no length)");
    const std::string_view length(bytes.data() + at, 8);
    if (FromLittleEndian(std::string_view(bytes.data() + at + 8, 4)) != MaskedCrc32c(length)) {
      return bad("has a bad length CRC");
    }
    const uint64_t n = FromLittleEndian(length);
    if (bytes.size() - at - 12 < n + 4) return bad("is cut short (its data)");
    const std::string_view data(bytes.data() + at + 12, n);
    if (FromLittleEndian(std::string_view(bytes.data() + at + 12 + n, 4)) != MaskedCrc32c(data)) {
      return bad("has a bad data CRC");
    }
    tensorboard::Event e;
    if (!e.ParseFromArray(data.data(), static_cast<int>(n))) return bad("is not an Event");
    if (e.has_file_version() && version != nullptr) *version = e.file_version();
    if (e.has_session_log() && e.session_log().status() == tensorboard::SessionLog::START && restarts != nullptr) {
      restarts->push_back(e.step());
    }
    if (e.has_summary()) {
      for (const tensorboard::SummaryValue& v : e.summary().value()) {
        out.push_back(ScalarEvent{v.tag(), e.step(), e.wall_time(), v.simple_value()});
      }
    }
    at += 12 + n + 4;
  }
  return out;
}

}  // namespace remora::train
