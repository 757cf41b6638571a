#include "data/text.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>

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
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status_util.h"

extern char** environ;

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

// --- SentencePiece, through Debian's sentencepiece programs -------------

// A temporary file's name beside `near` (a path), or in the temporary
// directory when `near` is empty; removed when the object goes.
class TempFile {
 public:
  explicit TempFile(const std::string& near, const char* what) {
    std::error_code ec;
    const fs::path dir = near.empty() ? fs::temp_directory_path(ec) : fs::path(near).parent_path();
    std::string name = ((dir.empty() ? fs::path(".") : dir) / absl::StrCat(".remora-", what, "-XXXXXX")).string();
    const int fd = ::mkstemp(name.data());
    if (fd >= 0) {
      ::close(fd);
      path_ = name;
    }
  }
  ~TempFile() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }  // empty: none could be made

 private:
  std::string path_;
};

// Runs `argv` (a sentencepiece program; its stdout to /dev/null, which the
// programs here do not write to: each is given --output) and waits. An error
// names the program, `model` and what the program wrote.
absl::Status RunTool(const std::vector<std::string>& argv, const std::string& model) {
  TempFile err("", "spm-stderr");
  if (err.path().empty()) return absl::InternalError("cannot make a temporary file for sentencepiece's messages");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, 2, err.path().c_str(), O_WRONLY | O_TRUNC, 0);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--tokenizer ", model, ": cannot run ", argv[0], " (", std::strerror(spawned),
        "): SentencePiece models are read with Debian's sentencepiece programs; install them "
        "(apt-get install sentencepiece)"));
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return absl::OkStatus();
  std::string said = absl::StrJoin(
      absl::StrSplit(absl::StripAsciiWhitespace(ReadAll(err.path())), '\n', absl::SkipWhitespace()), "; ");
  if (said.size() > 400) said = said.substr(0, 400) + "...";
  return absl::InvalidArgumentError(absl::StrCat(
      "--tokenizer ", model, ": ", argv[0], " failed (", said.empty() ? "no message" : said,
      "): is it a SentencePiece model? (spm_train makes one: docs/pipeline.md)"));
}

// The tokens of spm_encode's output (ids separated by spaces and line
// breaks), each checked to be under `vocab`.
absl::StatusOr<std::vector<int64_t>> ParseIds(const std::string& ids, int64_t vocab, const std::string& model) {
  std::vector<int64_t> out;
  const char* s = ids.c_str();
  const char* end = s + ids.size();
  while (s < end) {
    char* next = nullptr;
    const long long id = std::strtoll(s, &next, 10);
    if (next == s) {
      if (std::isspace(static_cast<unsigned char>(*s))) {
        ++s;
        continue;
      }
      return absl::InternalError(absl::StrCat("--tokenizer ", model, ": spm_encode wrote '", std::string(s, 1),
                                              "', not a token id"));
    }
    if (id < 0 || id >= vocab) {
      return absl::InternalError(absl::StrCat("--tokenizer ", model, ": spm_encode gave token ", id,
                                              ", outside the model's vocabulary of ", vocab));
    }
    out.push_back(id);
    s = next;
  }
  return out;
}

// The ids of `files`' text, all lines of all files in turn, each checked
// against the model's `vocab`.
absl::StatusOr<std::vector<int64_t>> EncodeFiles(const std::string& model, int64_t vocab,
                                                 const std::vector<std::string>& files, const std::string& near) {
  TempFile out(near, "spm-ids");
  if (out.path().empty()) return absl::InternalError("cannot make a temporary file for spm_encode's tokens");
  std::vector<std::string> argv = {"spm_encode", absl::StrCat("--model=", model), "--output_format=id",
                                   absl::StrCat("--output=", out.path())};
  argv.insert(argv.end(), files.begin(), files.end());
  RETURN_IF_ERROR(RunTool(argv, model));
  return ParseIds(ReadAll(out.path()), vocab, model);
}

// splitmix64: a window's start from (seed, epoch, row), alike everywhere.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

absl::StatusOr<int64_t> SentencePieceVocab(const std::string& model) {
  std::error_code ec;
  if (!fs::is_regular_file(model, ec)) {
    return absl::NotFoundError(absl::StrCat("--tokenizer ", model, ": no such file"));
  }
  TempFile out("", "spm-vocab");
  if (out.path().empty()) return absl::InternalError("cannot make a temporary file for spm_export_vocab");
  RETURN_IF_ERROR(RunTool({"spm_export_vocab", absl::StrCat("--model=", model), absl::StrCat("--output=", out.path())},
                          model));
  const std::string vocab = ReadAll(out.path());
  const int64_t n = std::count(vocab.begin(), vocab.end(), '\n');
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat("--tokenizer ", model, ": a model without tokens"));
  return n;
}

absl::StatusOr<std::vector<int64_t>> SentencePieceEncode(const std::string& model, const std::string& text) {
  TempFile in("", "spm-text");
  if (in.path().empty()) return absl::InternalError("cannot make a temporary file for spm_encode");
  RETURN_IF_ERROR(WriteFile(in.path(), text));
  ASSIGN_OR_RETURN(const int64_t vocab, SentencePieceVocab(model));
  return EncodeFiles(model, vocab, {in.path()}, "");
}

absl::StatusOr<std::string> SentencePieceDecode(const std::string& model, const std::vector<int64_t>& tokens) {
  TempFile in("", "spm-ids"), out("", "spm-text");
  if (in.path().empty() || out.path().empty()) return absl::InternalError("cannot make temporary files for spm_decode");
  RETURN_IF_ERROR(WriteFile(in.path(), absl::StrCat(absl::StrJoin(tokens, " "), "\n")));
  RETURN_IF_ERROR(RunTool({"spm_decode", absl::StrCat("--model=", model), "--input_format=id",
                           absl::StrCat("--output=", out.path()), in.path()},
                          model));
  std::string text = ReadAll(out.path());
  if (!text.empty() && text.back() == '\n') text.pop_back();
  return text;
}

absl::StatusOr<std::shared_ptr<const TextCorpus>> TextCorpus::Open(const std::string& path, const std::string& cache,
                                                                   const std::string& tokenizer) {
  ASSIGN_OR_RETURN(std::vector<fs::path> files, CorpusFiles(path));
  std::string record = SourceRecord(files);
  std::shared_ptr<TextCorpus> corpus(new TextCorpus);
  corpus->path_ = path;
  corpus->tokenizer_ = tokenizer;
  if (!tokenizer.empty()) {
    ASSIGN_OR_RETURN(corpus->vocab_, SentencePieceVocab(tokenizer));
    const std::string model_record = SourceRecord({fs::path(tokenizer)});
    if (!record.empty()) record = model_record.empty() ? "" : absl::StrCat(record, "tokenizer ", model_record);
  }
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
    if (tokenizer.empty()) {
      RETURN_IF_ERROR(WriteFile(cache, text));
    } else {
      std::vector<std::string> names;
      for (const fs::path& f : files) names.push_back(f.string());
      ASSIGN_OR_RETURN(const std::vector<int64_t> ids, EncodeFiles(tokenizer, corpus->vocab_, names, cache));
      if (ids.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("text ", path, " is no tokens under --tokenizer ", tokenizer, ": only white space?"));
      }
      std::string bytes(ids.size() * sizeof(int32_t), '\0');
      for (size_t i = 0; i < ids.size(); ++i) {
        const int32_t id = static_cast<int32_t>(ids[i]);
        std::memcpy(bytes.data() + i * sizeof(int32_t), &id, sizeof(id));
      }
      RETURN_IF_ERROR(WriteFile(cache, bytes));
    }
    RETURN_IF_ERROR(WriteFile(record_path, record));
  }
  const int fd = ::open(cache.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::PermissionDeniedError(absl::StrCat("cannot open the token file ", cache));
  struct stat st {};
  fstat(fd, &st);
  corpus->mapped_ = st.st_size;
  void* mapped = corpus->mapped_ > 0 ? mmap(nullptr, corpus->mapped_, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  if (mapped == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("cannot map the token file ", cache, " (", corpus->mapped_, " bytes)"));
  }
  if (tokenizer.empty()) {
    corpus->bytes_ = static_cast<const uint8_t*>(mapped);
    corpus->size_ = corpus->mapped_;
  } else {
    corpus->wide_ = static_cast<const int32_t*>(mapped);
    corpus->size_ = corpus->mapped_ / static_cast<int64_t>(sizeof(int32_t));
  }
  return std::shared_ptr<const TextCorpus>(std::move(corpus));
}

TextCorpus::~TextCorpus() {
  const void* mapped = wide_ != nullptr ? static_cast<const void*>(wide_) : bytes_;
  if (mapped != nullptr) munmap(const_cast<void*>(mapped), mapped_);
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
  for (int64_t i = 0; i < n; ++i) {
    if (want[i] < 0 || want[i] >= size()) {
      return absl::OutOfRangeError(absl::StrCat("window ", want[i], " of ", size(), " (",
                                                train_ ? "training" : "held out", " windows of ", corpus_->path(),
                                                ")"));
    }
    const int64_t start = Start(want[i], epoch);
    for (int64_t k = 0; k < t; ++k) {
      x[i * t + k] = corpus_->token(start + k);
      y[i * t + k] = corpus_->token(start + k + 1);
    }
  }
  return b;
}

}  // namespace remora::data
