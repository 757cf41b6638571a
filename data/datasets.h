// Datasets for training and evaluation, in memory: Fashion-MNIST and MNIST
// (IDX files, plain or gzipped, of any size: LibTorch's torch::data MNIST
// reader wants exactly 60,000 and 10,000 images and no .gz; a test checks
// that both read Fashion-MNIST alike) and CIFAR-10 (its binary format),
// plus the order batches are drawn in.
//
//   auto train = data::LoadIdx("/usr/share/datasets/fashion-mnist", /*train=*/true).value();
//   for (const at::Tensor& rows : data::EpochBatches(train.size(), 64, true, seed, epoch)) {
//     at::Tensor x = train.images.index_select(0, rows), y = train.labels.index_select(0, rows);
//     ...
//   }
//
// Thread-safety: plain functions; a Dataset is a pair of tensors.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace remora::data {

struct Dataset {
  at::Tensor images;  // float [N, C, H, W] in [0, 1]
  at::Tensor labels;  // int64 [N]
  int64_t size() const { return labels.defined() ? labels.size(0) : 0; }
};

// Where Debian's dataset-fashion-mnist package puts the files.
inline constexpr char kFashionMnistDir[] = "/usr/share/datasets/fashion-mnist";

// The training or test half of an IDX dataset (Fashion-MNIST, MNIST) in
// `dir`: train-images-idx3-ubyte, train-labels-idx1-ubyte,
// t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each plain or gzipped
// (.gz, as Debian ships them). Images [N, 1, H, W]. NotFound names the
// missing file and what to install; DataLoss a damaged or truncated file.
absl::StatusOr<Dataset> LoadIdx(const std::string& dir, bool train);

// The training (data_batch_1.bin ... data_batch_5.bin) or test
// (test_batch.bin) half of CIFAR-10's binary version in `dir`: records of
// one label byte and 3072 pixel bytes (R, G, B planes of 32x32). Images
// [N, 3, 32, 32]. A file that is not whole records is an error naming it.
absl::StatusOr<Dataset> LoadCifar10(const std::string& dir, bool train);

// The training and test sets a name gives: fashion-mnist (Debian's
// package), idx:DIR or cifar10:DIR, normalised (Normalize); an
// InvalidArgument error lists the names for any other. (imagefolder:DIR
// is a name too, but not loaded whole: data/imagefolder.h.)
absl::StatusOr<std::pair<Dataset, Dataset>> LoadNamed(const std::string& name);
// Whether `name` is one LoadNamed takes (its form only; nothing is read).
absl::Status CheckDatasetName(const std::string& name);
// `name` with its directory (idx:DIR, cifar10:DIR, imagefolder:DIR) made
// absolute from this process's working directory and normalised
// (imagefolder:data/x/ -> imagefolder:/home/u/data/x): the name workers
// that start elsewhere are given, and a checkpoint records. Other names as
// they are.
std::string AbsoluteDatasetName(const std::string& name);

// Checks, before anything waits on it, that a well-formed name's directory
// (Fashion-MNIST's: kFashionMnistDir) exists on this machine: a missing or
// non-directory path is NotFound naming --dataset, the path and, for
// Fashion-MNIST, the package that installs it. What is in it is checked
// when it loads. With imagefolder:DIR, a `val_fraction` > 0 beside a val/
// folder is refused too (CheckValFraction).
absl::Status CheckDatasetDir(const std::string& name, double val_fraction = 0);

// Normalises both sets per channel with the training set's mean and
// standard deviation (torchvision's Normalize with the set's own figures).
void Normalize(Dataset* train, Dataset* test);

// The row indices of each batch of one epoch over `n` rows, `batch_size`
// rows a batch (the last one may be smaller): a permutation drawn from
// (seed, epoch) when `shuffle`, else file order.
std::vector<at::Tensor> EpochBatches(int64_t n, int64_t batch_size, bool shuffle, uint64_t seed,
                                     int epoch);

}  // namespace remora::data
