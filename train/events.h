// TensorBoard event files: the scalars a training run writes as it goes
// (loss per step, test accuracy per epoch, images/s, step time), for
// `tensorboard --logdir DIR` — what PyTorch users write with
// torch.utils.tensorboard's SummaryWriter.add_scalar.
//
//   auto events = train::EventWriter::Open("runs/cnn").value();
//   events->AddScalar("loss/train", step, loss);   // after every step
//   events->Flush();                               // at an epoch's end
//
// The file is TFRecord framing around TensorFlow's Event protocol buffer:
// each record is its length (8 bytes, little-endian), the length's masked
// CRC-32C, the Event, the Event's masked CRC-32C. The first record carries
// the file version. ReadScalars reads a file back and checks every CRC.
//
// Thread-safety: an EventWriter is used by one thread at a time (the
// training loop's); the free functions are thread-safe. Ownership: the
// writer owns its file and closes it when destroyed (flushing first).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace remora::train {

class EventWriter {
 public:
  // Makes `dir` (and its parents) if needed and starts a new event file in
  // it, events.out.tfevents.<seconds>.<host>.<pid>.remora; TensorBoard
  // reads every such file of a directory as one run. An error names the
  // directory or file and why.
  static absl::StatusOr<std::unique_ptr<EventWriter>> Open(const std::string& dir);
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  // Appends scalar `tag` at `step`, timed now (or at `wall_time`, seconds
  // since the epoch). Written through to the file at most every 2 s; call
  // Flush to see it at once.
  absl::Status AddScalar(const std::string& tag, int64_t step, double value);
  absl::Status AddScalar(const std::string& tag, int64_t step, double value, double wall_time);
  // Marks that the run goes on from `step` again (after a recovery from a
  // checkpoint): TensorBoard drops the scalars of steps >= `step` written
  // before the mark, so that the steps trained again show once.
  absl::Status AddRestart(int64_t step);
  absl::Status Flush();

  const std::string& path() const { return path_; }

 private:
  EventWriter(std::string path, std::FILE* file) : path_(std::move(path)), file_(file) {}
  absl::Status WriteRecord(const std::string& bytes);

  const std::string path_;
  std::FILE* file_;
  double last_flush_ = 0;  // wall time of the last flush
};

// One scalar as read back from an event file.
struct ScalarEvent {
  std::string tag;
  int64_t step = 0;
  double wall_time = 0;
  float value = 0;
};

// Every scalar of event file `path`, in order, and its file version
// (`version`, may be null); the steps of its restart marks (AddRestart) in
// `restarts` (may be null). The scalars are the file's as written, those a
// restart mark makes TensorBoard drop included. DataLoss naming the file
// and the record's offset for a bad CRC or a truncated record.
absl::StatusOr<std::vector<ScalarEvent>> ReadScalars(const std::string& path, std::string* version = nullptr,
                                                     std::vector<int64_t>* restarts = nullptr);

// CRC-32C (Castagnoli) of `bytes`, and the masked form TFRecord stores:
// rotated right by 15 bits plus 0xa282ead8.
uint32_t Crc32c(std::string_view bytes);
uint32_t MaskedCrc32c(std::string_view bytes);

}  // namespace remora::train
