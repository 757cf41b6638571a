#include "data/datasets.h"

#include <zlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/arange.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/std.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/randperm.h>
#include <torch/data/datasets/mnist.h>

#include "absl/strings/str_cat.h"
#include "base/status_util.h"

namespace remora::data {
namespace {

namespace fs = std::filesystem;

// `gz` decompressed to `out` (written to a temporary name, then renamed, so
// that a half-written file is never taken for a whole one).
absl::Status Gunzip(const std::string& gz, const std::string& out) {
  gzFile in = gzopen(gz.c_str(), "rb");
  if (in == nullptr) return absl::NotFoundError(absl::StrCat("cannot open ", gz));
  const std::string tmp = out + ".part";
  std::ofstream o(tmp, std::ios::binary);
  if (!o) {
    gzclose(in);
    return absl::PermissionDeniedError(absl::StrCat("cannot write ", tmp, " (is the cache directory writable?)"));
  }
  char buf[1 << 16];
  int n;
  while ((n = gzread(in, buf, sizeof(buf))) > 0) o.write(buf, n);
  const bool failed = n < 0;
  gzclose(in);
  o.close();
  if (failed || !o) {
    std::remove(tmp.c_str());
    return absl::DataLossError(absl::StrCat("decompressing ", gz, " failed (a damaged file?)"));
  }
  std::error_code ec;
  fs::rename(tmp, out, ec);
  if (ec) return absl::InternalError(absl::StrCat("renaming ", tmp, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Dataset> LoadIdx(const std::string& dir, bool train, const std::string& cache_dir) {
  const std::string prefix = train ? "train" : "t10k";
  const std::vector<std::string> names = {prefix + "-images-idx3-ubyte", prefix + "-labels-idx1-ubyte"};
  // The reader wants both plain files in one directory: `dir` itself when
  // they are there, else `cache_dir`, filled from the .gz files.
  std::string root = dir;
  std::error_code ec;
  for (const auto& name : names) {
    if (fs::exists(fs::path(dir) / name, ec)) continue;
    const std::string gz = (fs::path(dir) / (name + ".gz")).string();
    if (!fs::exists(gz, ec)) {
      return absl::NotFoundError(absl::StrCat(
          "no ", name, " or ", name, ".gz in ", dir,
          " (for Fashion-MNIST: apt-get install dataset-fashion-mnist, which puts it in ",
          kFashionMnistDir, ")"));
    }
    root = cache_dir;
  }
  if (root != dir) {
    fs::create_directories(cache_dir, ec);
    for (const auto& name : names) {
      const std::string plain = (fs::path(cache_dir) / name).string();
      if (fs::exists(plain, ec)) continue;
      const fs::path src = fs::path(dir) / name;
      if (fs::exists(src, ec)) {
        fs::copy_file(src, plain, ec);
        if (ec) return absl::InternalError(absl::StrCat("copying ", src.string(), ": ", ec.message()));
      } else {
        RETURN_IF_ERROR(Gunzip(src.string() + ".gz", plain));
      }
    }
  }
  try {
    torch::data::datasets::MNIST mnist(root, train ? torch::data::datasets::MNIST::Mode::kTrain
                                                   : torch::data::datasets::MNIST::Mode::kTest);
    return Dataset{mnist.images(), mnist.targets()};
  } catch (...) {
    return StatusFromCurrentException(absl::StrCat("reading the IDX files in ", root));
  }
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
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      return absl::NotFoundError(absl::StrCat("cannot read ", path,
                                              " (CIFAR-10's binary version: cifar-10-batches-bin)"));
    }
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
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

}  // namespace remora::data
