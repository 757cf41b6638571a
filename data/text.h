// Text for language models: a UTF-8 file, or a folder of .txt files, as
// byte-level tokens (vocabulary 256, nothing to install) or a SentencePiece
// model's, written once to a token file beside the run's checkpoints and
// memory-mapped, so that a corpus larger than memory works; and the
// windows a causal language model trains on, drawn from (seed, epoch, row)
// so that a run is the same on any thread count and resumes bitwise.
//
// SentencePiece runs as Debian's `sentencepiece` programs (spm_encode,
// spm_decode, spm_export_vocab), not as libsentencepiece: that library
// exports the protobuf it bundles, whose symbols would mix with the
// protobuf that gRPC links in the same process. spm_encode reads a line at
// a time, so line breaks are not tokens under a SentencePiece model.
//
//   auto corpus = data::TextCorpus::Open("book.txt", "/ckpt/book.tokens").value();
//   data::TextWindows train(corpus, {/*seq_len=*/256, /*val_fraction=*/0.05, /*seed=*/0}, /*train=*/true);
//   data::Batch b = train.Get(rows, epoch).value();  // images: tokens [n, T]; labels: the next ones
//
// Thread-safety: a TextCorpus is immutable once open and may be shared;
// TextWindows::Get may be called from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "data/source.h"

namespace remora::data {

class TextCorpus {
 public:
  // Reads `path` (a file; or a directory's *.txt files in name order, a
  // newline between two that lack one), checks that it is UTF-8, and
  // writes its bytes as tokens to `cache`, with a record of the source's
  // size and modification time beside it (`cache`.source): a later Open of
  // the same source reuses the cache. An error names the path and, for
  // text that is not UTF-8, the byte where it stops being so.
  // With `tokenizer` (a SentencePiece model file), its tokens instead,
  // stored as int32; the record names the model (its size and time too).
  static absl::StatusOr<std::shared_ptr<const TextCorpus>> Open(const std::string& path, const std::string& cache,
                                                                const std::string& tokenizer = "");

  ~TextCorpus();
  TextCorpus(const TextCorpus&) = delete;
  TextCorpus& operator=(const TextCorpus&) = delete;

  int64_t size() const { return size_; }  // tokens
  int64_t vocab() const { return vocab_; }
  int64_t token(int64_t i) const { return wide_ ? wide_[i] : bytes_[i]; }
  const std::string& path() const { return path_; }
  const std::string& tokenizer() const { return tokenizer_; }  // empty: bytes
  bool reused_cache() const { return reused_; }  // Open found the cache up to date

 private:
  TextCorpus() = default;

  std::string path_, tokenizer_;
  // Mapped from the cache (one of them; owned): bytes, or int32 tokens.
  const uint8_t* bytes_ = nullptr;
  const int32_t* wide_ = nullptr;
  int64_t size_ = 0;  // tokens
  int64_t mapped_ = 0;  // bytes
  int64_t vocab_ = 256;
  bool reused_ = false;
};

// A SentencePiece model file's vocabulary size; `text` as its tokens; and
// tokens back as text (through spm_export_vocab, spm_encode, spm_decode).
// An error names the file and says what to do (a file that is not a model;
// the programs missing: install Debian's `sentencepiece`).
absl::StatusOr<int64_t> SentencePieceVocab(const std::string& model);
absl::StatusOr<std::vector<int64_t>> SentencePieceEncode(const std::string& model, const std::string& text);
absl::StatusOr<std::string> SentencePieceDecode(const std::string& model, const std::vector<int64_t>& tokens);

struct TextWindowOptions {
  int64_t seq_len = 256;      // tokens per window (T)
  double val_fraction = 0.05;  // the corpus's tail held out for validation
  uint64_t seed = 0;
};

// The windows of a corpus as a Source: row r's images are T tokens and its
// labels the T tokens one further on (int64 [n, T] each). Training
// (`train`): the corpus's first (1 - val_fraction) of tokens, size()
// windows an epoch (as many as tile it), row r of epoch e starting where
// (seed, e, r) says, anywhere in it. Validation: the held-out tail cut into
// consecutive windows, the same every epoch. Check() says whether the
// options fit the corpus; Get fails where they do not.
class TextWindows final : public Source {
 public:
  TextWindows(std::shared_ptr<const TextCorpus> corpus, TextWindowOptions options, bool train);

  // An error when a window does not fit its part of the corpus (a
  // --seq-len longer than the text, a tail too short for one window).
  absl::Status Check() const;
  int64_t size() const override;
  absl::StatusOr<Batch> Get(const at::Tensor& rows, int epoch) const override;
  // Where row `row` of `epoch` starts (a token index).
  int64_t Start(int64_t row, int epoch) const;

 private:
  std::shared_ptr<const TextCorpus> corpus_;
  TextWindowOptions options_;
  bool train_;
  int64_t begin_ = 0, end_ = 0;  // the part's tokens
};

}  // namespace remora::data
