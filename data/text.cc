#include "data/text.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <system_error>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>

#include "absl/strings/str_cat.h"
#include "base/status_util.h"

namespace remora::data {
namespace {

namespace fs = std::filesystem;

// The files a corpus is read from: `path` itself, or a directory's *.txt
// files in name order.
absl::StatusOr<std::vector<fs::path>> CorpusFiles(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) return absl::NotFoundError(absl::StrCat("text ", path, ": no such file or directory"));
  if (!fs::is_directory(path, ec)) return std::vector<fs::path>{path};
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(path, ec)) {
    if (e.is_regular_file() && e.path().extension() == ".txt") files.push_back(e.path());
  }
  if (ec) return absl::PermissionDeniedError(absl::StrCat("text ", path, ": cannot list it: ", ec.message()));
  std::sort(files.begin(), files.end());
  if (files.empty()) return absl::NotFoundError(absl::StrCat("text ", path, ": a directory without .txt files"));
  return files;
}

// What the cache's record says of its source: every file's name, size and
// modification time.
std::string SourceRecord(const std::vector<fs::path>& files) {
  std::string record;
  for (const fs::path& f : files) {
    struct stat st {};
    if (stat(f.c_str(), &st) != 0) return "";
    absl::StrAppend(&record, f.string(), " ", st.st_size, " ", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec, "\n");
  }
  return record;
}

std::string ReadAll(const fs::path& f) {
  std::ifstream in(f, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The offset of the first byte of `text` that is not valid UTF-8, or -1.
int64_t FirstBadUtf8(const std::string& text) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const int64_t n = static_cast<int64_t>(text.size());
  for (int64_t i = 0; i < n;) {
    const unsigned char c = s[i];
    int more = 0;
    uint32_t min = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      more = 1, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      more = 2, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      more = 3, min = 0x10000;
    } else {
      return i;
    }
    if (i + more >= n) return i;  // (cut short)
    uint32_t code = c & (0x3F >> more);
    for (int k = 1; k <= more; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
      code = (code << 6) | (s[i + k] & 0x3F);
    }
    if (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return i;
    i += more + 1;
  }
  return -1;
}

// Writes `bytes` to `path` through a temporary file of this process's
// renamed over it (the master and workers on one host may write it at
// once: each rename is whole).
absl::Status WriteFile(const std::string& path, const std::string& bytes) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out.good()) return absl::PermissionDeniedError(absl::StrCat("cannot write the token file ", tmp));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot write the token file ", path, ": ", ec.message()));
  return absl::OkStatus();
}

// splitmix64: a window's start from (seed, epoch, row), alike everywhere.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

absl::StatusOr<std::shared_ptr<const TextCorpus>> TextCorpus::Open(const std::string& path,
                                                                   const std::string& cache) {
  ASSIGN_OR_RETURN(std::vector<fs::path> files, CorpusFiles(path));
  const std::string record = SourceRecord(files);
  std::shared_ptr<TextCorpus> corpus(new TextCorpus);
  corpus->path_ = path;
  const std::string record_path = cache + ".source";
  corpus->reused_ = !record.empty() && fs::exists(cache) && ReadAll(record_path) == record;
  if (!corpus->reused_) {
    std::string text;
    for (const fs::path& f : files) {
      if (!text.empty() && text.back() != '\n') text += '\n';
      std::ifstream in(f, std::ios::binary);
      if (!in) return absl::PermissionDeniedError(absl::StrCat("text ", f.string(), ": cannot read it"));
      text += ReadAll(f);
    }
    if (text.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("text ", path, " is empty: a language model needs text to read"));
    }
    if (const int64_t bad = FirstBadUtf8(text); bad >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("text ", path, " is not UTF-8: byte ", bad,
                                                     " of the text starts no valid character (convert it with "
                                                     "iconv -t UTF-8)"));
    }
    RETURN_IF_ERROR(WriteFile(cache, text));
    RETURN_IF_ERROR(WriteFile(record_path, record));
  }
  const int fd = ::open(cache.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::PermissionDeniedError(absl::StrCat("cannot open the token file ", cache));
  struct stat st {};
  fstat(fd, &st);
  corpus->size_ = st.st_size;
  void* mapped = corpus->size_ > 0 ? mmap(nullptr, corpus->size_, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  if (mapped == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("cannot map the token file ", cache, " (", corpus->size_, " bytes)"));
  }
  corpus->tokens_ = static_cast<const uint8_t*>(mapped);
  return std::shared_ptr<const TextCorpus>(std::move(corpus));
}

TextCorpus::~TextCorpus() {
  if (tokens_ != nullptr) munmap(const_cast<uint8_t*>(tokens_), size_);
}

TextWindows::TextWindows(std::shared_ptr<const TextCorpus> corpus, TextWindowOptions options, bool train)
    : corpus_(std::move(corpus)), options_(options), train_(train) {
  const int64_t n = corpus_->size();
  const int64_t held = static_cast<int64_t>(static_cast<double>(n) * std::clamp(options_.val_fraction, 0.0, 1.0));
  begin_ = train_ ? 0 : n - held;
  end_ = train_ ? n - held : n;
}

absl::Status TextWindows::Check() const {
  const int64_t have = end_ - begin_;
  if (options_.seq_len < 1) return absl::InvalidArgumentError("--seq-len must be 1 or more");
  if (have >= options_.seq_len + 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--seq-len ", options_.seq_len, " needs ", options_.seq_len + 1, " tokens in ",
      train_ ? "the training part" : "the held-out tail (--val-fraction)", " of ", corpus_->path(), ", which has ",
      have, " (of ", corpus_->size(), "): give a shorter --seq-len, ",
      train_ ? "a smaller --val-fraction or more text" : "a larger --val-fraction or more text"));
}

int64_t TextWindows::size() const {
  const int64_t have = end_ - begin_ - 1;  // (each window's labels run one token further)
  return options_.seq_len > 0 && have >= options_.seq_len ? have / options_.seq_len : 0;
}

int64_t TextWindows::Start(int64_t row, int epoch) const {
  if (!train_) return begin_ + row * options_.seq_len;
  const uint64_t span = static_cast<uint64_t>(end_ - begin_ - options_.seq_len);  // starts 0 .. span - 1
  const uint64_t h = Mix(options_.seed ^ Mix(static_cast<uint64_t>(epoch) ^ Mix(static_cast<uint64_t>(row))));
  return begin_ + static_cast<int64_t>(h % span);
}

absl::StatusOr<Batch> TextWindows::Get(const at::Tensor& rows, int epoch) const {
  RETURN_IF_ERROR(Check());
  const at::Tensor r = rows.to(at::kLong).contiguous();
  const int64_t n = r.numel(), t = options_.seq_len;
  Batch b;
  b.images = at::empty({n, t}, at::kLong);
  b.labels = at::empty({n, t}, at::kLong);
  const int64_t* want = r.data_ptr<int64_t>();
  int64_t* x = b.images.data_ptr<int64_t>();
  int64_t* y = b.labels.data_ptr<int64_t>();
  const uint8_t* tokens = corpus_->tokens();
  for (int64_t i = 0; i < n; ++i) {
    if (want[i] < 0 || want[i] >= size()) {
      return absl::OutOfRangeError(absl::StrCat("window ", want[i], " of ", size(), " (",
                                                train_ ? "training" : "held out", " windows of ", corpus_->path(),
                                                ")"));
    }
    const int64_t start = Start(want[i], epoch);
    for (int64_t k = 0; k < t; ++k) {
      x[i * t + k] = tokens[start + k];
      y[i * t + k] = tokens[start + k + 1];
    }
  }
  return b;
}

}  // namespace remora::data
