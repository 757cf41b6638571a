// Where a training loop gets its rows: a Source hands out the rows a batch
// names, as (images, labels), whether the set is in memory (InMemory, over
// a Dataset) or read from disk as it is needed (ImageFolder,
// data/imagefolder.h). `epoch` seeds a source's augmentation (0: none, as
// for evaluation), so a batch is the same whenever it is asked for.
//
// Thread-safety: Get may be called from several threads at once (a
// prefetcher's); a Source is otherwise immutable after it is made.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "data/datasets.h"

namespace remora::data {

struct Batch {
  at::Tensor images;  // float [n, C, H, W]
  at::Tensor labels;  // int64 [n]
  // Rows left out because their file could not be read (a source told to
  // skip bad images); n above is the rows asked for less these.
  int64_t skipped = 0;
};

class Source {
 public:
  virtual ~Source() = default;
  virtual int64_t size() const = 0;
  // The rows `rows` (int64 indices into the set) of epoch `epoch`.
  virtual absl::StatusOr<Batch> Get(const at::Tensor& rows, int epoch) const = 0;
};

// A Dataset in memory as a Source (no augmentation; `epoch` is unused).
// Holds a reference: the Dataset must outlive it.
class InMemory final : public Source {
 public:
  explicit InMemory(const Dataset& set) : set_(set) {}
  int64_t size() const override { return set_.size(); }
  absl::StatusOr<Batch> Get(const at::Tensor& rows, int epoch) const override;

 private:
  const Dataset& set_;
};

// What names a source, so that another process (a worker that reads the
// rows it trains on) can open the same one: a --dataset name, which split,
// and how an image folder is read.
struct SourceSpec {
  // fashion-mnist, idx:DIR, cifar10:DIR (in memory, normalised with the
  // training split's mean and std), imagefolder:DIR (read from disk) or
  // text:PATH (a UTF-8 file or a folder of .txt files as byte-level token
  // windows, data/text.h: tokens in `images`, the next ones in `labels`).
  std::string dataset;
  bool train = true;  // the training split; else the test (val) split
  int64_t rows = 0;   // only `rows` rows (0: all): the first, or an image folder's spread (SpreadRows)
  // Image folders (data/imagefolder.h's ImageFolderOptions).
  int64_t image_size = 224;
  int threads = 4;
  uint64_t seed = 0;
  bool skip_bad_images = false;
  std::string listing_cache;
  double val_fraction = 0;  // an image folder without val/ (or text): held out of train
  // Text: tokens a window, the token file (written once, then reused) and
  // the SentencePiece model that tokenises it (empty: byte-level tokens).
  int64_t seq_len = 0;
  std::string token_cache;
  std::string tokenizer;
};

// A source of no rows (a run without a test set); Get fails.
std::unique_ptr<Source> NoRows();

// The first `n` rows of `all` (all of it when n <= 0 or n >= its size).
std::unique_ptr<Source> FirstRows(std::unique_ptr<Source> all, int64_t n);
// `n` of `all`'s rows spread evenly over it (row i is its row
// floor(i * size / n)), for a source sorted by class (an image folder's
// listing), where the first n rows would hold the first classes only:
// every class keeps its share. All of it when n <= 0 or n >= its size.
std::unique_ptr<Source> SpreadRows(std::unique_ptr<Source> all, int64_t n);

// Opens the source `spec` names. An error says what is missing or bad.
absl::StatusOr<std::unique_ptr<Source>> OpenSource(const SourceSpec& spec);

}  // namespace remora::data
