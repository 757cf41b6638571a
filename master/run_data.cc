// The master's data (master/runs.h): its --dataset (Sets, LoadDataset), a
// named set loaded into memory or an image folder listed and read from
// disk as batches need it; and the demo's random batches (MakeBatch,
// FillNormalRows, BatchesAhead).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randint.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "data/imagefolder.h"
#include "data/text.h"
#include "shards/gpt.h"
#include "shards/protocol.h"
#include "master/runs.h"

namespace remora::master {

bool ReadsImageFolder(const RunOptions& c) { return absl::StartsWith(c.dataset, "imagefolder:"); }

bool TrainsSmallCnn(const RunOptions& c) {
  return !c.dataset.empty() && c.model.empty() && !ReadsImageFolder(c) && !ReadsText(c);
}

bool ReadsText(const RunOptions& c) { return absl::StartsWith(c.dataset, "text:"); }

bool TrainsGpt(const RunOptions& c) { return ReadsText(c) && c.model.empty(); }

std::string TokenCacheOf(const RunOptions& c) {
  if (!ReadsText(c)) return "";
  if (!c.checkpoint_dir.empty()) return absl::StrCat(c.checkpoint_dir, "/text.tokens");
  // (A text's own name, and a checksum of its whole path: two texts of one
  // name in two folders do not share a cache.)
  const std::string path = c.dataset.substr(std::strlen("text:"));
  std::error_code ec;
  const std::filesystem::path tmp = std::filesystem::temp_directory_path(ec);
  return absl::StrCat(ec ? std::string("/tmp") : tmp.string(), "/remora-",
                      std::filesystem::path(path).filename().string(), "-", std::hash<std::string>()(path) % 1000000007,
                      ".tokens");
}

int64_t TokensPerRow(const RunOptions& c) { return ReadsText(c) ? c.seq_len : 0; }

absl::StatusOr<int64_t> TextVocabOf(const RunOptions& c) {
  if (c.tokenizer.empty()) return 256;
  // (Read once per model file: each read runs spm_export_vocab.)
  static absl::Mutex mu(absl::kConstInit);
  static auto* vocabs = new std::map<std::string, int64_t>;  // (guarded by mu)
  base::MutexLock lock(mu);
  if (auto it = vocabs->find(c.tokenizer); it != vocabs->end()) return it->second;
  ASSIGN_OR_RETURN(const int64_t vocab, data::SentencePieceVocab(c.tokenizer));
  (*vocabs)[c.tokenizer] = vocab;
  return vocab;
}

pipeline::StageSpec GptPart(const RunOptions& c, int64_t first, int64_t last) {
  shards::GptArgs a;
  a.vocab = TextVocabOf(c).value_or(256);  // (the flags' check has read it)
  a.seq_len = c.seq_len;
  a.d_model = c.d_model;
  a.heads = c.heads;
  a.layers = c.layers;
  a.first = first;
  a.last = last;
  a.seed = c.seed;
  a.tie = c.tie_embeddings ? 1 : 0;
  return pipeline::StageSpec::Registered(shards::GptArgs::kFunction, rpc::EncodeCall(a));
}

double TrainFlopsPerToken(const RunOptions& c) {
  return TrainsGpt(c) ? shards::GptTrainFlopsPerToken(TextVocabOf(c).value_or(256), c.seq_len, c.d_model, c.layers)
                      : 0;
}


data::SourceSpec SourceSpecOf(const RunOptions& c, bool train) {
  data::SourceSpec s;
  s.dataset = c.dataset;
  s.train = train;
  s.rows = train ? c.train_rows : 0;
  s.image_size = c.image_size;
  s.threads = c.data_threads;
  s.seed = static_cast<uint64_t>(c.seed);
  s.skip_bad_images = c.skip_bad_images;
  s.val_fraction = c.val_fraction;
  s.seq_len = c.seq_len;
  s.token_cache = TokenCacheOf(c);
  s.tokenizer = c.tokenizer;
  // Listed once per run directory: a resumed run reads the listing.
  if (ReadsImageFolder(c) && !c.checkpoint_dir.empty()) {
    s.listing_cache = absl::StrCat(c.checkpoint_dir, "/imagefolder-", train ? "train" : "val", ".list");
  }
  return s;
}

absl::StatusOr<std::unique_ptr<Sets>> LoadDataset(const RunOptions& c, bool resuming) {
  auto sets = std::make_unique<Sets>();
  if (ReadsImageFolder(c)) {
    const std::string dir = c.dataset.substr(std::strlen("imagefolder:"));
    if (!c.checkpoint_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(c.checkpoint_dir, ec);
      // A listing left by an earlier run (one that failed, or whose folder
      // has changed since) is not this fresh run's: it lists the folder
      // again, and its workers read the new listing.
      if (!resuming) {
        for (bool train : {true, false}) std::filesystem::remove(SourceSpecOf(c, train).listing_cache, ec);
      }
    }
    ASSIGN_OR_RETURN(auto train, data::ImageFolder::Open(dir, "train", data::FolderOptions(SourceSpecOf(c, true))));
    absl::StatusOr<std::unique_ptr<data::ImageFolder>> test =
        data::ImageFolder::Open(dir, "val", data::FolderOptions(SourceSpecOf(c, false)));
    if (absl::IsNotFound(test.status())) {
      sets->no_test = "no val/ folder; --val-fraction F holds a fraction of the training images out";
    } else if (!test.ok()) {
      return test.status();
    } else if (train->classes() != (*test)->classes()) {
      return absl::InvalidArgumentError(absl::StrCat(train->root(), " has ", train->classes().size(),
                                                     " classes and ", (*test)->root(), " ",
                                                     (*test)->classes().size(), ": both need the same class folders"));
    }
    if (c.model.empty() && train->classes().size() > 1000) {
      return absl::InvalidArgumentError(absl::StrCat(train->root(), " has ", train->classes().size(),
                                                     " classes; ResNet50 has 1000 outputs: give --model stages"));
    }
    if (!c.model.empty() && static_cast<int64_t>(train->classes().size()) != c.classes) {
      const std::vector<std::string>& names = train->classes();
      const size_t shown = std::min<size_t>(names.size(), 10);
      return absl::InvalidArgumentError(absl::StrCat(
          train->root(), " has ", names.size(), " class folders (",
          absl::StrJoin(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
          names.size() > shown ? ", ..." : "", "); --classes is ", c.classes, ": give --classes ", names.size(),
          " (the model's outputs), or move out the folders that are not classes"));
    }
    sets->shape = {3, c.image_size, c.image_size};
    sets->classes = static_cast<int64_t>(train->classes().size());
    // (With --val-fraction both splits count the same folder's: once.)
    sets->unlisted = train->unlisted();
    sets->unlisted_examples = train->unlisted_examples();
    if (test.ok() && (*test)->root() != train->root()) {
      sets->unlisted += (*test)->unlisted();
      for (const std::string& e : (*test)->unlisted_examples()) {
        if (sets->unlisted_examples.size() < 3) sets->unlisted_examples.push_back(e);
      }
    }
    sets->train = std::move(train);
    sets->train = data::SpreadRows(std::move(sets->train), c.train_rows);  // every class, in its share
    sets->test = test.ok() ? std::unique_ptr<data::Source>(std::move(*test)) : data::NoRows();
    return sets;
  }
  if (ReadsText(c)) {
    if (!c.checkpoint_dir.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(c.checkpoint_dir, ec);
    }
    // (Tokenised here first: the sources, and the workers', reuse it.)
    ASSIGN_OR_RETURN(auto corpus, data::TextCorpus::Open(c.dataset.substr(std::strlen("text:")), TokenCacheOf(c),
                                                                   c.tokenizer));
    ASSIGN_OR_RETURN(sets->train, data::OpenSource(SourceSpecOf(c, true)));
    if (c.val_fraction > 0) {
      ASSIGN_OR_RETURN(sets->test, data::OpenSource(SourceSpecOf(c, false)));
    } else {
      sets->test = data::NoRows();
      sets->no_test = "--val-fraction 0 holds none of the text out";
    }
    sets->shape = {c.seq_len};
    sets->classes = corpus->vocab();
    sets->text = absl::StrCat(corpus->size(), " tokens (",
                              c.tokenizer.empty() ? std::string("bytes")
                                                  : absl::StrCat("SentencePiece ", c.tokenizer),
                              ": vocabulary ", corpus->vocab(), "; ",
                              corpus->reused_cache() ? "read from " : "written to ", TokenCacheOf(c), "), ",
                              sets->train->size(), " training windows of ", c.seq_len, " tokens an epoch",
                              c.val_fraction > 0 ? absl::StrCat(", ", sets->test->size(), " held-out windows (the last ",
                                                                c.val_fraction * 100, "%)")
                                                 : absl::StrCat(", no held-out text (", sets->no_test, ")"));
    return sets;
  }
  ASSIGN_OR_RETURN(auto loaded, data::LoadNamed(c.dataset));
  sets->train_set = std::move(loaded.first);
  sets->test_set = std::move(loaded.second);
  if (c.train_rows > 0 && c.train_rows < sets->train_set.size()) {
    sets->train_set.images = sets->train_set.images.slice(0, 0, c.train_rows);
    sets->train_set.labels = sets->train_set.labels.slice(0, 0, c.train_rows);
  }
  const auto sizes = sets->train_set.images.sizes();
  sets->shape.assign(sizes.begin() + 1, sizes.end());
  sets->train = std::make_unique<data::InMemory>(sets->train_set);
  sets->test = std::make_unique<data::InMemory>(sets->test_set);
  return sets;
}

namespace {

// A seed for row `row` of the batch seeded `batch_seed` (splitmix64's
// finaliser over both): rows of every batch get unrelated streams.
uint64_t RowSeed(uint64_t batch_seed, int64_t row) {
  uint64_t z = batch_seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(row) + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Threads for FillNormalRows of `t` in MakeBatch: one per 1M numbers, at
// most 8 and the machine's cores.
int RowThreads(const at::Tensor& t) {
  constexpr int64_t kNumbersPerThread = int64_t{1} << 20;
  return static_cast<int>(std::min<int64_t>({8, std::max(1u, std::thread::hardware_concurrency()),
                                             std::max<int64_t>(1, t.numel() / kNumbersPerThread)}));
}

}  // namespace

void FillNormalRows(at::Tensor& t, uint64_t batch_seed, int threads) {
  const int64_t rows = t.size(0);
  auto fill = [&t, batch_seed](int64_t first, int64_t end) {
    for (int64_t r = first; r < end; ++r) {
      t[r].normal_(0, 1, at::make_generator<at::CPUGeneratorImpl>(RowSeed(batch_seed, r)));
    }
  };
  if (rows == 0) return;
  const int64_t per = (rows + std::max(1, threads) - 1) / std::max(1, threads);
  std::vector<std::thread> helpers;
  std::vector<std::exception_ptr> failed((rows + per - 1) / per);
  helpers.reserve(failed.size());
  int64_t here_from = rows;  // rows from here on are filled on this thread (no thread could start)
  for (int64_t first = per, i = 1; first < rows; first += per, ++i) {
    try {
      helpers.emplace_back([&fill, &failed, first, rows, per, i] {
        try {
          fill(first, std::min(rows, first + per));
        } catch (...) {
          failed[i] = std::current_exception();
        }
      });
    } catch (const std::system_error&) {
      here_from = first;
      break;
    }
  }
  try {
    fill(0, std::min(rows, per));
    fill(here_from, rows);
  } catch (...) {
    failed[0] = std::current_exception();
  }
  for (std::thread& h : helpers) h.join();
  for (const std::exception_ptr& e : failed) {
    if (e) std::rethrow_exception(e);
  }
}

// Batch b of the run: the same inputs and targets in every mode. The
// ResNet50 demo: images and one-hot labels (MSE); --model: inputs of
// --input-shape and class indices (cross-entropy). Inputs are drawn row by
// row (FillNormalRows), targets from the batch's own generator.
absl::StatusOr<std::pair<at::Tensor, at::Tensor>> MakeBatch(const RunOptions& c, int b) try {
  const uint64_t batch_seed = static_cast<uint64_t>(int64_t{c.seed} * 7919 + b);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(batch_seed);
  if (!c.model.empty()) {
    std::vector<int64_t> shape = {c.batch_size};
    shape.insert(shape.end(), c.input_shape.begin(), c.input_shape.end());
    at::Tensor inputs = at::empty(shape, at::TensorOptions());
    FillNormalRows(inputs, batch_seed, RowThreads(inputs));
    return std::pair{inputs, at::randint(c.classes, {c.batch_size}, gen, at::TensorOptions(at::kLong))};
  }
  at::Tensor images = at::empty({c.batch_size, 3, c.image_size, c.image_size}, at::TensorOptions());
  FillNormalRows(images, batch_seed, RowThreads(images));
  at::Tensor labels = at::randint(kClasses, {c.batch_size, 1}, gen, at::TensorOptions(at::kLong));
  at::Tensor one_hot = at::zeros({c.batch_size, kClasses}).scatter_(1, labels, 1.0);
  return std::pair{images, one_hot};
} catch (...) {
  return base::StatusFromCurrentException(absl::StrCat("making batch ", b));
}

BatchesAhead::BatchesAhead(const RunOptions& c, int first, int end, int ahead, int max_makers)
    : BatchesAhead([&c](int b) { return MakeBatch(c, b); }, first, end, ahead, max_makers) {}

BatchesAhead::BatchesAhead(MakeFn make, int first, int end, int ahead, int max_makers)
    : make_(std::move(make)),
      first_(first),
      end_(end),
      ahead_(std::max(1, ahead)),
      max_makers_(std::max(1, max_makers)),
      next_taken_(first),
      next_made_(first) {
  makers_.emplace_back([this] { Make(); });
}

BatchesAhead::~BatchesAhead() {
  {
    base::MutexLock lock(mu_);
    stop_ = true;
  }
  for (std::thread& t : makers_) t.join();
}

void BatchesAhead::Make() {
  while (true) {
    int b;
    {
      base::MutexLock lock(mu_);
      // Room for one more: at most `ahead_` made or being made and not
      // taken.
      mu_.Await(absl::Condition(
          +[](BatchesAhead* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return self->stop_ || !self->failed_.ok() || self->next_made_ >= self->end_ ||
                   self->next_made_ < self->next_taken_ + self->ahead_;
          },
          this));
      if (stop_ || !failed_.ok() || next_made_ >= end_) return;
      b = next_made_++;
    }
    auto batch = make_(b);  // (outside the lock: Take and the other makers go on)
    base::MutexLock lock(mu_);
    if (!batch.ok()) {
      if (failed_.ok() || b < failed_at_) {
        failed_ = batch.status();
        failed_at_ = b;
      }
      return;
    }
    made_.emplace(b, std::move(*batch));
  }
}

absl::StatusOr<std::pair<at::Tensor, at::Tensor>> BatchesAhead::Take(int b) {
  base::MutexLock lock(mu_);
  if (b != next_taken_ || b >= end_) {
    return absl::InternalError(absl::StrCat("BatchesAhead: batch ", b, " taken, ", next_taken_, " was next"));
  }
  auto ready = +[](BatchesAhead* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
    const int b = self->next_taken_;
    return self->made_.count(b) > 0 || (!self->failed_.ok() && b >= self->failed_at_);
  };
  if (b > first_ && !ready(this) && next_made_ < end_ && static_cast<int>(makers_.size()) < max_makers_) {
    try {
      makers_.emplace_back([this] { Make(); });  // the step outran the making
    } catch (const std::system_error&) {
      // (no thread to be had: the makers there are go on)
    }
  }
  mu_.Await(absl::Condition(ready, this));
  auto it = made_.find(b);
  if (it == made_.end()) return failed_;
  auto batch = std::move(it->second);
  made_.erase(it);
  ++next_taken_;
  return batch;
}

DemoBatches::DemoBatches(const RunOptions& c, int first)
    : batch_size_(c.batch_size), batches_(c.batches), ahead_(c, first, c.batches) {}

absl::StatusOr<data::Batch> DemoBatches::Get(const at::Tensor& rows, int /*epoch*/) const {
  const int64_t n = rows.numel();
  const int64_t from = n > 0 ? rows.reshape({-1})[0].item<int64_t>() : -1;
  if (n != batch_size_ || from < 0 || from % batch_size_ != 0 || from / batch_size_ >= batches_) {
    return absl::InvalidArgumentError(absl::StrCat("the demo's batches: ", n, " rows from row ", from,
                                                   " asked for; they come as whole batches of ", batch_size_,
                                                   " rows (a batch run's, in order)"));
  }
  base::MutexLock lock(mu_);
  ASSIGN_OR_RETURN(auto batch, ahead_.Take(static_cast<int>(from / batch_size_)));
  return data::Batch{std::move(batch.first), std::move(batch.second), 0};
}

std::string Sets::Describe() const {
  if (!text.empty()) return text;
  const std::string in_classes =
      classes == 0 ? ""
      : classes == 1 ? " in 1 class (every image has the same label: is the folder's top level right?)"
                     : absl::StrCat(" in ", classes, " classes");
  const std::string not_read =
      unlisted == 0 ? ""
                    : absl::StrCat("; ", unlisted, " other file", unlisted == 1 ? " is" : "s are",
                                   " not read (not .jpg, .jpeg or .png), e.g. ",
                                   absl::StrJoin(unlisted_examples, ", "));
  if (!no_test.empty()) {
    return absl::StrCat(train->size(), " training images of ", c10::str(c10::IntArrayRef(shape)), in_classes,
                        ", no test images (", no_test, "): no test accuracy", not_read);
  }
  return absl::StrCat(train->size(), " training and ", test->size(), " test images of ",
                      c10::str(c10::IntArrayRef(shape)), in_classes, not_read);
}

BatchRunStart StartBatchRun(const RunOptions& c, const Checkpointing* checkpoints, Run& run) {
  BatchRunStart b;
  b.options.fit.batch_run = true;
  b.options.fit.batch_size = c.batch_size;
  if (checkpoints == nullptr) return b;
  b.options.checkpoints = checkpoints->Target(c);
  b.options.checkpoint_every = c.checkpoint_every;
  b.options.resume = checkpoints->resume;
  if (b.options.resume) {
    run.losses = b.options.resume->state().losses;
    b.first = static_cast<int>(b.options.resume->state().step);
  }
  return b;
}

}  // namespace remora::master
