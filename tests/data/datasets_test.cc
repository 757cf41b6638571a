// Datasets without sockets: IDX files plain and gzipped (through LibTorch's
// MNIST reader), CIFAR-10's binary format, epoch order, normalisation.
#include "data/datasets.h"

#include <zlib.h>

#include <filesystem>
#include <fstream>

#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>
#include <torch/data/datasets/mnist.h>

#include "data/source.h"

namespace remora::data {
namespace {

namespace fs = std::filesystem;

std::string TempDir(const std::string& name) {
  const std::string dir = testing::TempDir() + "/remora_data_" + std::to_string(getpid()) + "_" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void BigEndian(std::string* out, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out->push_back(static_cast<char>((v >> s) & 0xff));
}

// An IDX image file of n 28x28 images (pixel = image index) and a label file.
std::pair<std::string, std::string> Idx(int n) {
  std::string images, labels;
  BigEndian(&images, 2051);
  BigEndian(&images, n);
  BigEndian(&images, 28);
  BigEndian(&images, 28);
  BigEndian(&labels, 2049);
  BigEndian(&labels, n);
  for (int i = 0; i < n; ++i) {
    images.append(28 * 28, static_cast<char>(i * 10));
    labels.push_back(static_cast<char>(i % 10));
  }
  return {images, labels};
}

void Write(const std::string& path, const std::string& bytes, bool gz) {
  if (gz) {
    gzFile f = gzopen((path + ".gz").c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(gzwrite(f, bytes.data(), bytes.size()), static_cast<int>(bytes.size()));
    gzclose(f);
  } else {
    std::ofstream(path, std::ios::binary) << bytes;
  }
}

TEST(Datasets, IdxFilesPlainOrGzippedReadThroughLibTorch) {
  for (bool gz : {false, true}) {
    const std::string dir = TempDir(gz ? "gz" : "plain");
    auto [train_images, train_labels] = Idx(12);
    auto [test_images, test_labels] = Idx(5);
    Write(dir + "/train-images-idx3-ubyte", train_images, gz);
    Write(dir + "/train-labels-idx1-ubyte", train_labels, gz);
    Write(dir + "/t10k-images-idx3-ubyte", test_images, gz);
    Write(dir + "/t10k-labels-idx1-ubyte", test_labels, gz);
    auto train = LoadIdx(dir, true);
    ASSERT_TRUE(train.ok()) << train.status();
    EXPECT_EQ(train->size(), 12);
    EXPECT_EQ(train->images.sizes(), (std::vector<int64_t>{12, 1, 28, 28}));
    EXPECT_EQ(train->labels[11].item<int64_t>(), 1);
    EXPECT_NEAR(train->images[3].max().item<float>(), 30.0 / 255, 1e-6);
    auto test = LoadIdx(dir, false);
    ASSERT_TRUE(test.ok()) << test.status();
    EXPECT_EQ(test->size(), 5);
  }
}

TEST(Datasets, MissingOrDamagedFilesAreClearErrors) {
  const std::string dir = TempDir("missing");
  auto missing = LoadIdx(dir, true);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("train-images-idx3-ubyte"), std::string::npos);
  // Another directory: no advice to install Fashion-MNIST (it would not help).
  EXPECT_EQ(missing.status().message().find("dataset-fashion-mnist"), std::string::npos) << missing.status();
  auto nowhere = LoadIdx(dir + "/nonexistent", true);
  ASSERT_FALSE(nowhere.ok());
  EXPECT_NE(nowhere.status().message().find("does not exist"), std::string::npos) << nowhere.status();
  auto [images, labels] = Idx(4);
  Write(dir + "/train-images-idx3-ubyte", images.substr(0, images.size() - 5), false);
  Write(dir + "/train-labels-idx1-ubyte", labels, false);
  auto truncated = LoadIdx(dir, true);
  ASSERT_FALSE(truncated.ok());
  EXPECT_NE(truncated.status().message().find("truncated"), std::string::npos) << truncated.status();
  EXPECT_NE(truncated.status().message().find(dir + "/train-images-idx3-ubyte holds"), std::string::npos)
      << truncated.status();  // (the file, with its directory)
  Write(dir + "/train-images-idx3-ubyte", labels, false);  // a label file where images belong
  auto magic = LoadIdx(dir, true);
  ASSERT_FALSE(magic.ok());
  EXPECT_NE(magic.status().message().find("magic"), std::string::npos) << magic.status();
  auto cifar = LoadCifar10(dir, false);
  ASSERT_FALSE(cifar.ok());
  EXPECT_NE(cifar.status().message().find("test_batch.bin"), std::string::npos);
  std::ofstream(dir + "/test_batch.bin") << std::string(3073 + 5, 'a');
  auto partial = LoadCifar10(dir, false);
  ASSERT_FALSE(partial.ok());
  EXPECT_NE(partial.status().message().find("whole number"), std::string::npos);
}

// On Debian's Fashion-MNIST (installed by the set-up), LoadIdx reads the
// .gz files as LibTorch's MNIST reader reads them decompressed.
TEST(Datasets, FashionMnistReadsAsLibTorchsMnistReaderReadsIt) {
  if (!fs::exists(std::string(kFashionMnistDir) + "/t10k-images-idx3-ubyte.gz")) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  const std::string dir = TempDir("fashion");
  for (const char* name : {"t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    gzFile in = gzopen((std::string(kFashionMnistDir) + "/" + name + ".gz").c_str(), "rb");
    ASSERT_NE(in, nullptr);
    std::string bytes;
    char buf[1 << 16];
    int n;
    while ((n = gzread(in, buf, sizeof(buf))) > 0) bytes.append(buf, n);
    gzclose(in);
    Write(dir + "/" + name, bytes, false);
  }
  torch::data::datasets::MNIST reference(dir, torch::data::datasets::MNIST::Mode::kTest);
  auto mine = LoadIdx(kFashionMnistDir, false);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_EQ(mine->size(), 10000);
  EXPECT_TRUE(mine->images.equal(reference.images()));
  EXPECT_TRUE(mine->labels.equal(reference.targets()));
}

TEST(Datasets, Cifar10BinaryRecords) {
  const std::string dir = TempDir("cifar");
  std::string bytes;
  for (int i = 0; i < 3; ++i) {
    bytes.push_back(static_cast<char>(i + 7));
    bytes.append(1024, static_cast<char>(0));    // red plane
    bytes.append(1024, static_cast<char>(255));  // green plane
    bytes.append(1024, static_cast<char>(i));    // blue plane
  }
  std::ofstream(dir + "/test_batch.bin", std::ios::binary) << bytes;
  auto test = LoadCifar10(dir, false);
  ASSERT_TRUE(test.ok()) << test.status();
  EXPECT_EQ(test->images.sizes(), (std::vector<int64_t>{3, 3, 32, 32}));
  EXPECT_EQ(test->labels[2].item<int64_t>(), 9);
  EXPECT_FLOAT_EQ(test->images[1][1][5][5].item<float>(), 1.0f);
  EXPECT_FLOAT_EQ(test->images[2][2][0][0].item<float>(), 2.0f / 255);
}

TEST(Datasets, EpochBatchesCoverEveryRowOnceInASeededOrder) {
  auto a = EpochBatches(10, 4, true, 3, 1), b = EpochBatches(10, 4, true, 3, 1);
  auto c = EpochBatches(10, 4, true, 3, 2), plain = EpochBatches(10, 4, false, 3, 1);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a[2].size(0), 2);
  EXPECT_TRUE(at::cat(a).equal(at::cat(b)));
  EXPECT_FALSE(at::cat(a).equal(at::cat(c)));  // each epoch its own order
  EXPECT_TRUE(std::get<0>(at::cat(a).sort()).equal(at::cat(plain)));
  EXPECT_EQ(plain[1][0].item<int64_t>(), 4);
}

TEST(Datasets, NormalizeUsesTheTrainingSetsFigures) {
  Dataset train{at::cat({at::zeros({2, 1, 2, 2}), at::ones({2, 1, 2, 2}) * 2}), at::zeros({4}, at::kLong)};
  Dataset test{at::ones({1, 1, 2, 2}), at::zeros({1}, at::kLong)};
  Normalize(&train, &test);
  EXPECT_NEAR(train.images.mean().item<float>(), 0, 1e-6);
  EXPECT_NEAR(test.images.mean().item<float>(), 0, 1e-6);  // 1 is the training mean
}

// Dataset names are given to workers and recorded with their folder
// absolute and normalised; other names stay.
TEST(Datasets, AbsoluteDatasetNamesResolveFromHere) {
  const std::string here = fs::current_path().string();
  EXPECT_EQ(AbsoluteDatasetName("imagefolder:data/./cats/"), "imagefolder:" + here + "/data/cats");
  EXPECT_EQ(AbsoluteDatasetName("idx:/srv/mnist//"), "idx:/srv/mnist");
  EXPECT_EQ(AbsoluteDatasetName("cifar10:../c10"), "cifar10:" + fs::path(here).parent_path().string() + "/c10");
  EXPECT_EQ(AbsoluteDatasetName("fashion-mnist"), "fashion-mnist");
  EXPECT_EQ(AbsoluteDatasetName("imagefolder:/"), "imagefolder:/");
}

// A subset of a source sorted by class keeps every class in its share
// (--train-rows on an image folder); the first rows would be class 0's.
TEST(Datasets, SpreadRowsKeepEveryClassOfASortedSource) {
  Dataset sorted{at::zeros({40, 1, 1, 1}), at::arange(40, at::kLong).div(10, "floor")};  // 4 classes of 10
  InMemory all(sorted);
  class View final : public Source {  // owns nothing: SpreadRows holds its source
   public:
    explicit View(const Source& s) : s_(s) {}
    int64_t size() const override { return s_.size(); }
    absl::StatusOr<Batch> Get(const at::Tensor& rows, int epoch) const override { return s_.Get(rows, epoch); }

   private:
    const Source& s_;
  };
  std::unique_ptr<Source> eight = SpreadRows(std::make_unique<View>(all), 8);
  ASSERT_EQ(eight->size(), 8);
  auto batch = eight->Get(at::arange(8, at::kLong), 1);
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_TRUE(batch->labels.equal(at::tensor({0, 0, 1, 1, 2, 2, 3, 3}, at::kLong))) << batch->labels;
  EXPECT_FALSE(eight->Get(at::tensor({8}, at::kLong), 1).ok());  // past the subset
  EXPECT_EQ(SpreadRows(std::make_unique<View>(all), 0)->size(), 40);  // 0: all
  EXPECT_EQ(SpreadRows(std::make_unique<View>(all), 50)->size(), 40);
}

}  // namespace
}  // namespace remora::data
