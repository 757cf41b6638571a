#include "data/datasets.h"

#include <zlib.h>

#include <cstring>
#include <filesystem>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/std.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/randperm.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "data/imagefolder.h"
#include "data/source.h"
#include "data/text.h"

namespace remora::data {
namespace {

namespace fs = std::filesystem;

}  // namespace

namespace {

// The bytes of `path`, or of `path`.gz decompressed.
absl::StatusOr<std::string> ReadMaybeGz(const std::string& path) {
  std::error_code ec;
  if (fs::exists(path, ec)) return base::ReadWholeFile(path);
  const std::string gz = path + ".gz";
  if (!fs::exists(gz, ec)) return absl::NotFoundError(gz);
  gzFile in = gzopen(gz.c_str(), "rb");
  if (in == nullptr) return absl::NotFoundError(absl::StrCat("cannot open ", gz));
  std::string out;
  char buf[1 << 16];
  int n;
  while ((n = gzread(in, buf, sizeof(buf))) > 0) out.append(buf, n);
  gzclose(in);
  if (n < 0) return absl::DataLossError(absl::StrCat("decompressing ", gz, " failed (a damaged file?)"));
  return out;
}

uint32_t BigEndian(const std::string& b, size_t at) {
  return (uint32_t(uint8_t(b[at])) << 24) | (uint32_t(uint8_t(b[at + 1])) << 16) |
         (uint32_t(uint8_t(b[at + 2])) << 8) | uint32_t(uint8_t(b[at + 3]));
}

// An IDX file of unsigned bytes with `dims` dimensions: its sizes, checked
// against the file's length.
absl::StatusOr<std::vector<int64_t>> IdxSizes(const std::string& b, int dims, const std::string& name) {
  const size_t header = 4 + 4 * dims;
  if (b.size() < header || BigEndian(b, 0) != static_cast<uint32_t>(0x0800 + dims)) {
    return absl::DataLossError(absl::StrCat(name, " is not an IDX file of unsigned bytes with ", dims,
                                            " dimensions (wrong magic number)"));
  }
  std::vector<int64_t> sizes;
  int64_t count = 1;
  for (int d = 0; d < dims; ++d) {
    sizes.push_back(BigEndian(b, 4 + 4 * d));
    count *= sizes.back();
  }
  if (b.size() != header + static_cast<size_t>(count)) {
    return absl::DataLossError(absl::StrCat(name, " holds ", b.size() - header, " bytes of data, its header says ",
                                            count, " (a truncated file?)"));
  }
  return sizes;
}

// Where Fashion-MNIST comes from, for messages where it is missing.
std::string FashionMnistHint() {
  return absl::StrCat(" (apt-get install dataset-fashion-mnist puts Fashion-MNIST in ", kFashionMnistDir, ")");
}

// A well-formed dataset name's directory: Fashion-MNIST's for
// fashion-mnist, DIR for KIND:DIR.
std::string DatasetDir(const std::string& name) {
  if (name == "fashion-mnist") return kFashionMnistDir;
  return name.substr(name.find(':') + 1);
}

}  // namespace

absl::StatusOr<Dataset> LoadIdx(const std::string& dir, bool train) {
  const std::string prefix = train ? "train" : "t10k";
  std::string bytes[2], read_from[2];
  const std::string names[2] = {prefix + "-images-idx3-ubyte", prefix + "-labels-idx1-ubyte"};
  for (int i = 0; i < 2; ++i) {
    const std::string path = (fs::path(dir) / names[i]).string();
    std::error_code ec;
    read_from[i] = fs::exists(path, ec) ? path : path + ".gz";  // (as ReadMaybeGz reads it)
    auto read = ReadMaybeGz(path);
    if (absl::IsNotFound(read.status())) {
      // The package is the cure only where Fashion-MNIST was looked for.
      const bool fashion = fs::path(dir).lexically_normal() == fs::path(kFashionMnistDir).lexically_normal();
      return absl::NotFoundError(absl::StrCat(
          "no ", names[i], " or ", names[i], ".gz in ", dir,
          fashion ? FashionMnistHint()
                  : std::string(fs::exists(dir) ? "" : ": the directory does not exist")));
    }
    if (!read.ok()) return read.status();
    bytes[i] = std::move(*read);
  }
  ASSIGN_OR_RETURN(std::vector<int64_t> image_sizes, IdxSizes(bytes[0], 3, read_from[0]));
  ASSIGN_OR_RETURN(std::vector<int64_t> label_sizes, IdxSizes(bytes[1], 1, read_from[1]));
  if (image_sizes[0] != label_sizes[0]) {
    return absl::DataLossError(absl::StrCat(dir, ": ", image_sizes[0], " images but ", label_sizes[0], " labels"));
  }
  const int64_t n = image_sizes[0];
  at::Tensor images = at::from_blob(bytes[0].data() + 16, {n, 1, image_sizes[1], image_sizes[2]}, at::kByte)
                          .to(at::kFloat)
                          .div_(255.0);
  at::Tensor labels = at::from_blob(bytes[1].data() + 8, {n}, at::kByte).to(at::kLong);
  return Dataset{images, labels};
}

absl::StatusOr<Dataset> LoadCifar10(const std::string& dir, bool train) {
  std::vector<std::string> files;
  if (train) {
    for (int i = 1; i <= 5; ++i) files.push_back(absl::StrCat("data_batch_", i, ".bin"));
  } else {
    files.push_back("test_batch.bin");
  }
  constexpr int64_t kRecord = 1 + 3 * 32 * 32;
  std::vector<at::Tensor> images, labels;
  for (const auto& f : files) {
    const std::string path = (fs::path(dir) / f).string();
    absl::StatusOr<std::string> read = base::ReadWholeFile(path);
    if (!read.ok()) return base::Annotate(read.status(), "CIFAR-10's binary version (cifar-10-batches-bin)");
    std::string& bytes = *read;
    if (bytes.empty() || bytes.size() % kRecord != 0) {
      return absl::DataLossError(absl::StrCat(path, " holds ", bytes.size(),
                                              " bytes, not a whole number of ", kRecord,
                                              "-byte records"));
    }
    const int64_t n = static_cast<int64_t>(bytes.size()) / kRecord;
    at::Tensor raw = at::from_blob(bytes.data(), {n, kRecord}, at::kByte).clone();
    labels.push_back(raw.select(1, 0).to(at::kLong));
    images.push_back(raw.slice(1, 1).reshape({n, 3, 32, 32}).to(at::kFloat).div_(255.0));
  }
  at::Tensor y = at::cat(labels);
  if (y.max().item<int64_t>() > 9) {
    return absl::DataLossError(absl::StrCat("a CIFAR-10 label in ", dir, " is above 9"));
  }
  return Dataset{at::cat(images), y};
}

absl::Status CheckDatasetName(const std::string& name) {
  const size_t colon = name.find(':');
  const std::string kind = name.substr(0, colon);
  if (name == "fashion-mnist" || ((kind == "idx" || kind == "cifar10" || kind == "imagefolder" || kind == "text") &&
                                   colon != std::string::npos && colon + 1 < name.size())) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--dataset wants fashion-mnist, idx:DIR, cifar10:DIR, imagefolder:DIR or text:PATH; got '", name, "'"));
}

std::string AbsoluteDatasetName(const std::string& name) {
  const size_t colon = name.find(':');
  if (colon == std::string::npos || colon + 1 >= name.size()) return name;
  std::error_code ec;
  fs::path dir = fs::absolute(name.substr(colon + 1), ec);
  if (ec) return name;
  dir = dir.lexically_normal();
  if (!dir.has_filename() && dir.has_parent_path() && dir != dir.root_path()) dir = dir.parent_path();  // (a '/')
  return absl::StrCat(name.substr(0, colon + 1), dir.string());
}

absl::Status CheckDatasetDir(const std::string& name, double val_fraction) {
  const std::string dir = DatasetDir(name);
  std::error_code ec;
  if (absl::StartsWith(name, "text:")) {  // a file, or a folder of .txt files
    if (fs::exists(dir, ec)) return absl::OkStatus();
    return absl::NotFoundError(absl::StrCat("--dataset ", name, ": ", dir,
                                            ec ? absl::StrCat(" cannot be read (", ec.message(), ")")
                                               : std::string(" does not exist"),
                                            ": give a UTF-8 text file, or a folder of .txt files"));
  }
  if (fs::is_directory(dir, ec)) {
    return absl::StartsWith(name, "imagefolder:") ? CheckValFraction(dir, val_fraction) : absl::OkStatus();
  }
  std::string why = " does not exist";
  if (fs::exists(dir, ec)) {
    why = " is not a directory";
  } else if (ec) {
    why = absl::StrCat(" cannot be read (", ec.message(), ")");
  }
  return absl::NotFoundError(absl::StrCat(
      "--dataset ", name, ": ", dir, why,
      name == "fashion-mnist" ? FashionMnistHint() : ": give the directory that holds the dataset's files"));
}

absl::StatusOr<std::pair<Dataset, Dataset>> LoadNamed(const std::string& name) {
  RETURN_IF_ERROR(CheckDatasetName(name));
  const std::string kind = name == "fashion-mnist" ? "idx" : name.substr(0, name.find(':'));
  const std::string dir = DatasetDir(name);
  std::pair<Dataset, Dataset> sets;
  if (kind == "idx") {
    ASSIGN_OR_RETURN(sets.first, LoadIdx(dir, true));
    ASSIGN_OR_RETURN(sets.second, LoadIdx(dir, false));
  } else if (kind == "cifar10") {
    ASSIGN_OR_RETURN(sets.first, LoadCifar10(dir, true));
    ASSIGN_OR_RETURN(sets.second, LoadCifar10(dir, false));
  } else if (kind == "imagefolder") {
    return absl::UnimplementedError(absl::StrCat(
        name, " is read from disk as batches need it, never loaded whole: open it with data::ImageFolder::Open"));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--dataset wants fashion-mnist, idx:DIR or cifar10:DIR; got '", name, "'"));
  }
  Normalize(&sets.first, &sets.second);
  return sets;
}

void Normalize(Dataset* train, Dataset* test) {
  const at::Tensor mean = train->images.mean({0, 2, 3}, /*keepdim=*/true);
  const at::Tensor std = train->images.std({0, 2, 3}, /*unbiased=*/true, /*keepdim=*/true).clamp_min(1e-6);
  train->images = (train->images - mean) / std;
  test->images = (test->images - mean) / std;
}

std::vector<at::Tensor> EpochBatches(int64_t n, int64_t batch_size, bool shuffle, uint64_t seed,
                                     int epoch) {
  at::Tensor order;
  if (shuffle) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed * 1000003 + epoch);
    order = at::randperm(n, gen, at::TensorOptions(at::kLong));
  } else {
    order = at::arange(n, at::TensorOptions(at::kLong));
  }
  std::vector<at::Tensor> out;
  for (int64_t at = 0; at < n; at += batch_size) {
    out.push_back(order.slice(0, at, std::min(n, at + batch_size)));
  }
  return out;
}

namespace {

// `t`'s rows `rows`, copied row by row on the calling thread: a reader runs
// beside the training step, where index_select's intra-op team would spin
// on the cores the step uses.
absl::StatusOr<at::Tensor> GatherRows(const at::Tensor& t, const at::Tensor& rows) {
  const at::Tensor src = t.contiguous();
  const at::Tensor idx = rows.to(at::kLong).contiguous();
  std::vector<int64_t> shape = src.sizes().vec();
  const int64_t n = shape[0];
  shape[0] = idx.numel();
  at::Tensor out = at::empty(shape, src.options());
  const size_t row_bytes = n == 0 ? 0 : src.nbytes() / static_cast<size_t>(n);
  const auto* from = static_cast<const char*>(src.data_ptr());
  auto* to = static_cast<char*>(out.data_ptr());
  const int64_t* r = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    if (r[i] < 0 || r[i] >= n) {
      return absl::OutOfRangeError(absl::StrCat("row ", r[i], " of a set of ", n, " rows"));
    }
    std::memcpy(to + i * row_bytes, from + r[i] * row_bytes, row_bytes);
  }
  return out;
}

}  // namespace

absl::StatusOr<Batch> InMemory::Get(const at::Tensor& rows, int) const {
  auto images = GatherRows(set_.images, rows);
  if (!images.ok()) return images.status();
  auto labels = GatherRows(set_.labels, rows);
  if (!labels.ok()) return labels.status();
  return Batch{std::move(*images), std::move(*labels), 0};
}

namespace {

// A Dataset this source owns (OpenSource's in-memory sets).
class OwnedInMemory final : public Source {
 public:
  explicit OwnedInMemory(Dataset set) : set_(std::move(set)), view_(set_) {}
  int64_t size() const override { return set_.size(); }
  absl::StatusOr<Batch> Get(const at::Tensor& rows, int epoch) const override { return view_.Get(rows, epoch); }

 private:
  const Dataset set_;
  const InMemory view_;
};

// The first `n` rows of a source. Holds the source.
class FirstRowsOf final : public Source {
 public:
  FirstRowsOf(std::unique_ptr<Source> all, int64_t n) : all_(std::move(all)), n_(n) {}
  int64_t size() const override { return n_; }
  absl::StatusOr<Batch> Get(const at::Tensor& rows, int epoch) const override { return all_->Get(rows, epoch); }

 private:
  std::unique_ptr<Source> all_;
  int64_t n_;
};

// `n` rows spread evenly over a source: row i is its row i * size / n.
// Holds the source.
class SpreadRowsOf final : public Source {
 public:
  SpreadRowsOf(std::unique_ptr<Source> all, int64_t n) : all_(std::move(all)), n_(n) {}
  int64_t size() const override { return n_; }
  absl::StatusOr<Batch> Get(const at::Tensor& rows, int epoch) const override {
    const at::Tensor index = rows.to(at::kLong).contiguous();
    at::Tensor mapped = at::empty_like(index);
    const int64_t* from = index.data_ptr<int64_t>();
    int64_t* to = mapped.data_ptr<int64_t>();
    const int64_t total = all_->size();
    for (int64_t r = 0; r < index.numel(); ++r) {
      if (from[r] < 0 || from[r] >= n_) {
        return absl::OutOfRangeError(absl::StrCat("row ", from[r], " of a subset of ", n_, " rows"));
      }
      // (No overflow: both below 2^31 for any listing that fits in memory.)
      to[r] = from[r] * total / n_;
    }
    return all_->Get(mapped, epoch);
  }

 private:
  std::unique_ptr<Source> all_;
  int64_t n_;
};

}  // namespace

ImageFolderOptions FolderOptions(const SourceSpec& spec) {
  ImageFolderOptions o;
  o.image_size = spec.image_size;
  o.train = spec.train;
  o.threads = spec.threads;
  o.seed = spec.seed;
  o.skip_bad_images = spec.skip_bad_images;
  o.listing_cache = spec.listing_cache;
  o.val_fraction = spec.val_fraction;
  return o;
}

std::unique_ptr<Source> NoRows() {
  class Empty final : public Source {
   public:
    int64_t size() const override { return 0; }
    absl::StatusOr<Batch> Get(const at::Tensor&, int) const override {
      return absl::OutOfRangeError("rows asked of a source of none");
    }
  };
  return std::make_unique<Empty>();
}

std::unique_ptr<Source> FirstRows(std::unique_ptr<Source> all, int64_t n) {
  if (n <= 0 || n >= all->size()) return all;
  return std::make_unique<FirstRowsOf>(std::move(all), n);
}

std::unique_ptr<Source> SpreadRows(std::unique_ptr<Source> all, int64_t n) {
  if (n <= 0 || n >= all->size()) return all;
  return std::make_unique<SpreadRowsOf>(std::move(all), n);
}

absl::StatusOr<std::unique_ptr<Source>> OpenSource(const SourceSpec& spec) {
  if (spec.rows < 0) return absl::InvalidArgumentError(absl::StrCat("a source of ", spec.rows, " rows"));
  std::unique_ptr<Source> source;
  constexpr char kFolder[] = "imagefolder:";
  if (spec.dataset.rfind(kFolder, 0) == 0) {
    ASSIGN_OR_RETURN(source, ImageFolder::Open(spec.dataset.substr(sizeof(kFolder) - 1),
                                               spec.train ? "train" : "val", FolderOptions(spec)));
    return SpreadRows(std::move(source), spec.rows);  // (its listing is sorted by class)
  } else if (constexpr char kText[] = "text:"; spec.dataset.rfind(kText, 0) == 0) {
    const std::string path = spec.dataset.substr(sizeof(kText) - 1);
    if (spec.token_cache.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("text ", path, ": no token file named to write its tokens to"));
    }
    ASSIGN_OR_RETURN(std::shared_ptr<const TextCorpus> corpus, TextCorpus::Open(path, spec.token_cache, spec.tokenizer));
    auto windows = std::make_unique<TextWindows>(
        std::move(corpus), TextWindowOptions{spec.seq_len, spec.val_fraction, spec.seed}, spec.train);
    RETURN_IF_ERROR(windows->Check());
    source = std::move(windows);
  } else {
    ASSIGN_OR_RETURN(auto sets, LoadNamed(spec.dataset));
    source = std::make_unique<OwnedInMemory>(spec.train ? std::move(sets.first) : std::move(sets.second));
  }
  return FirstRows(std::move(source), spec.rows);
}

}  // namespace remora::data
