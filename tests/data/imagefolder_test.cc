// Image folders' decoding and augmenting: JPEG and PNG decoding (DCT
// scaling; CMYK JPEGs as PIL reads them), the evaluation crop's exact
// values, training crops drawn from (seed, epoch, row) whatever the
// threads, and bad files named or skipped. The images are written with
// libjpeg and libpng (tests/data/image_files.h; built only where they are
// found, as the decoding is). The listing: image_listing_test.cc; the real
// programs: imagefolder_master_test.cc.
#include "data/imagefolder.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <ATen/TensorOperators.h>
#include <ATen/ops/_upsample_bilinear2d_aa.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/flip.h>
#include <ATen/ops/from_blob.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/data/image_files.h"

namespace remora::data {
namespace {

namespace fs = std::filesystem;
using test_images::FreshImageDir;
using test_images::Pixels;
using test_images::WriteClassFolders;
using test_images::WriteJpeg;
using test_images::WritePng;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// DIR/train/{cat,dog}: 3 and 2 gradient images, JPEG and PNG, plus a
// file that is not an image; DIR/val/{cat,dog}: one each.
std::string SmallFolder(const std::string& name) {
  const std::string dir = FreshImageDir(name);
  for (const char* split : {"train", "val"}) {
    for (const char* cls : {"dog", "cat"}) fs::create_directories(absl::StrCat(dir, "/", split, "/", cls));
  }
  auto gradient = [](int seed) {
    return Pixels(48, 40, [seed](int x, int y, int c) { return (x * 5 + y * 3 + c * 40 + seed * 17) % 256; });
  };
  WriteJpeg(dir + "/train/cat/b.jpg", 48, 40, gradient(1));
  WritePng(dir + "/train/cat/a.png", 48, 40, gradient(2));
  WriteJpeg(dir + "/train/cat/c.JPEG", 48, 40, gradient(3));
  WriteJpeg(dir + "/train/dog/x.jpeg", 48, 40, gradient(4));
  WritePng(dir + "/train/dog/y.png", 48, 40, gradient(5));
  std::ofstream(dir + "/train/dog/notes.txt") << "not an image";
  WritePng(dir + "/val/cat/v.png", 48, 40, gradient(6));
  WriteJpeg(dir + "/val/dog/w.jpg", 48, 40, gradient(7));
  return dir;
}

TEST(ImageFolder, JpegAndPngDecodeToTheirPixelsAndJpegScalesInTheDct) {
  const std::string dir = FreshImageDir("decode");
  const auto pixels = Pixels(64, 48, [](int x, int y, int c) { return x * 2 + y * 2 + c * 10; });  // smooth
  WritePng(dir + "/p.png", 64, 48, pixels);
  WriteJpeg(dir + "/j.jpg", 64, 48, pixels);
  auto png = DecodeImage(Slurp(dir + "/p.png"), "p.png");
  ASSERT_TRUE(png.ok()) << png.status();
  EXPECT_EQ(png->width, 64);
  EXPECT_EQ(png->height, 48);
  EXPECT_EQ(png->pixels, pixels);  // lossless
  auto jpg = DecodeImage(Slurp(dir + "/j.jpg"), "j.jpg");
  ASSERT_TRUE(jpg.ok()) << jpg.status();
  ASSERT_EQ(jpg->pixels.size(), pixels.size());
  double diff = 0;
  for (size_t i = 0; i < pixels.size(); ++i) diff += std::abs(int(jpg->pixels[i]) - int(pixels[i]));
  EXPECT_LT(diff / pixels.size(), 3.0);
  // At least 16 x 12 wanted: decoded at 2/8 of the size.
  auto small = DecodeImage(Slurp(dir + "/j.jpg"), "j.jpg", 16, 12);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->width, 16);
  EXPECT_EQ(small->height, 12);
  EXPECT_EQ(ImageSize(Slurp(dir + "/j.jpg"), "j.jpg").value(), std::make_pair(64, 48));
  // A region decodes only the rows and block columns around it, to the
  // same pixels as the whole image has there.
  auto part = DecodeImage(Slurp(dir + "/j.jpg"), "j.jpg", 0, 0, Region{20, 10, 16, 12}, 2);
  ASSERT_TRUE(part.ok()) << part.status();
  EXPECT_LE(part->x0, 18);
  EXPECT_EQ(part->y0, 8);
  EXPECT_EQ(part->height, 16);
  EXPECT_GE(part->x0 + part->width, 38);
  EXPECT_LT(part->width, 64);
  EXPECT_EQ(part->full_width, 64);
  for (int y = 0; y < part->height; ++y) {
    for (int x = 0; x < part->width * 3; ++x) {
      ASSERT_EQ(part->pixels[static_cast<size_t>(y) * part->width * 3 + x],
                jpg->pixels[static_cast<size_t>(y + part->y0) * 64 * 3 + part->x0 * 3 + x])
          << "row " << y << ", byte " << x;
    }
  }
  EXPECT_THAT(std::string(DecodeImage("GIF89a....", "g.gif").status().message()),
              HasSubstr("g.gif: neither a JPEG nor a PNG image"));
  std::string cut = Slurp(dir + "/p.png");
  cut.resize(cut.size() / 2);
  EXPECT_THAT(std::string(DecodeImage(cut, "cut.png").status().message()), HasSubstr("cut.png: a damaged PNG"));
}

// CMYK and YCCK JPEGs (print workflows write them; ImageNet holds some)
// decode to RGB as PIL, and so torchvision, decodes them: the stored values
// taken as Adobe's inverted ones, R = C * K / 255, marker or not. Flat
// 16 x 16 blocks (whole MCUs) keep JPEG's loss away from the centres.
TEST(ImageFolder, CmykAndYcckJpegsDecodeToRgbAsPilDecodesThem) {
  const std::string dir = FreshImageDir("cmyk");
  struct Block {
    uint8_t cmyk[4];
    uint8_t rgb[3];
  };
  const std::vector<Block> blocks = {{{255, 255, 255, 255}, {255, 255, 255}},  // no ink: white
                                     {{255, 0, 0, 255}, {255, 0, 0}},
                                     {{200, 100, 50, 128}, {100, 50, 25}},
                                     {{255, 255, 255, 64}, {64, 64, 64}}};
  const int w = 16 * static_cast<int>(blocks.size()), h = 16;
  std::vector<uint8_t> cmyk(static_cast<size_t>(w) * h * 4);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) std::memcpy(&cmyk[(static_cast<size_t>(y) * w + x) * 4], blocks[x / 16].cmyk, 4);
  }
  using test_images::CmykJpeg;
  for (const auto& [kind, name] : {std::pair{CmykJpeg::kAdobe, "adobe.jpg"},
                                   std::pair{CmykJpeg::kNoMarker, "plain.jpg"},
                                   std::pair{CmykJpeg::kAdobeYcck, "ycck.jpg"}}) {
    SCOPED_TRACE(name);
    test_images::WriteCmykJpeg(dir + "/" + name, w, h, cmyk, kind);
    const std::string bytes = Slurp(dir + "/" + name);
    EXPECT_EQ(ImageSize(bytes, name).value(), std::make_pair(w, h));
    auto rgb = DecodeImage(bytes, name);
    ASSERT_TRUE(rgb.ok()) << rgb.status();
    ASSERT_EQ(rgb->width, w);
    ASSERT_EQ(rgb->pixels.size(), static_cast<size_t>(w) * h * 3);
    for (size_t b = 0; b < blocks.size(); ++b) {
      for (int c = 0; c < 3; ++c) {
        EXPECT_NEAR(rgb->pixels[(8 * static_cast<size_t>(w) + 16 * b + 8) * 3 + c], blocks[b].rgb[c], 4)
            << "block " << b << ", channel " << c;
      }
    }
    // Scaled in the DCT (1/2), and a region alone: the same colours.
    auto half = DecodeImage(bytes, name, w / 2, h / 2);
    ASSERT_TRUE(half.ok()) << half.status();
    ASSERT_EQ(half->width, w / 2);
    EXPECT_NEAR(half->pixels[(4 * static_cast<size_t>(w / 2) + 8 * 2 + 4) * 3], blocks[2].rgb[0], 4);
    auto part = DecodeImage(bytes, name, 0, 0, Region{36, 4, 8, 8}, 0);
    ASSERT_TRUE(part.ok()) << part.status();
    const size_t at = (static_cast<size_t>(8 - part->y0) * part->width + (40 - part->x0)) * 3;
    for (int c = 0; c < 3; ++c) EXPECT_NEAR(part->pixels[at + c], blocks[2].rgb[c], 4) << "channel " << c;
  }
}

TEST(ImageFolder, EvaluationResizesTheShortSideCentreCropsAndNormalises) {
  const std::string dir = FreshImageDir("eval");
  fs::create_directories(dir + "/val/red");
  // Left half red, right half blue, 64 x 32: the short side goes to
  // 16 / 0.875 = 18, the long to 36, and the centre 16 x 16 straddles the
  // border.
  WritePng(dir + "/val/red/a.png", 64, 32,
           Pixels(64, 32, [](int x, int, int c) { return x < 32 ? (c == 0 ? 255 : 0) : (c == 2 ? 255 : 0); }));
  ImageFolderOptions o;
  o.image_size = 16;
  o.train = false;
  auto set = ImageFolder::Open(dir, "val", o).value();
  auto b = set->Get(at::arange(1, at::kLong), 0);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->images.sizes(), (std::vector<int64_t>{1, 3, 16, 16}));
  EXPECT_EQ(b->labels.item<int64_t>(), 0);
  // The far left column is red, the far right blue, exactly normalised.
  const at::Tensor img = b->images[0];
  EXPECT_NEAR(img[0][8][0].item<float>(), (1.0 - 0.485) / 0.229, 1e-3);
  EXPECT_NEAR(img[2][8][0].item<float>(), (0.0 - 0.406) / 0.225, 1e-3);
  EXPECT_NEAR(img[0][8][15].item<float>(), (0.0 - 0.485) / 0.229, 1e-3);
  EXPECT_NEAR(img[2][8][15].item<float>(), (1.0 - 0.406) / 0.225, 1e-3);
}

TEST(ImageFolder, TrainingCropsComeFromSeedEpochAndRowWhateverTheThreads) {
  const std::string dir = SmallFolder("crops");
  auto get = [&](int threads, uint64_t seed, int epoch, std::vector<int64_t> rows) {
    ImageFolderOptions o;
    o.image_size = 24;
    o.threads = threads;
    o.seed = seed;
    auto set = ImageFolder::Open(dir, "train", o).value();
    auto b = set->Get(at::tensor(rows, at::kLong), epoch);
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? b->images : at::Tensor();
  };
  const at::Tensor one = get(1, 7, 1, {0, 1, 2, 3, 4});
  ASSERT_EQ(one.sizes(), (std::vector<int64_t>{5, 3, 24, 24}));
  EXPECT_TRUE(at::equal(one, get(4, 7, 1, {0, 1, 2, 3, 4}))) << "another thread count";
  // Row 3 alone, in another batch, is cropped as in the first.
  EXPECT_TRUE(at::equal(one[3], get(2, 7, 1, {3})[0]));
  EXPECT_FALSE(at::equal(one, get(1, 7, 2, {0, 1, 2, 3, 4}))) << "another epoch, other crops";
  EXPECT_FALSE(at::equal(one, get(1, 8, 1, {0, 1, 2, 3, 4}))) << "another seed, other crops";
}

// The training recipe's image of `crop` of the RGB `pixels` (w x h),
// computed with ATen: the crop cut out, resized to s x s by the
// antialiased bilinear filter, flipped when drawn so, normalised.
at::Tensor ReferenceImage(std::vector<uint8_t>& pixels, int w, int h, const TrainingCrop& crop, int64_t s) {
  const at::Tensor mean = at::tensor({0.485, 0.456, 0.406}, at::kFloat).view({3, 1, 1});
  const at::Tensor std = at::tensor({0.229, 0.224, 0.225}, at::kFloat).view({3, 1, 1});
  const Region& box = crop.box;
  const at::Tensor part = at::from_blob(pixels.data(), {h, w, 3}, at::kByte)
                              .permute({2, 0, 1})
                              .narrow(1, static_cast<int64_t>(box.y), static_cast<int64_t>(box.h))
                              .narrow(2, static_cast<int64_t>(box.x), static_cast<int64_t>(box.w))
                              .to(at::kFloat)
                              .unsqueeze(0);
  at::Tensor image = at::_upsample_bilinear2d_aa(part, {s, s}, /*align_corners=*/false)[0];
  if (crop.flip) image = at::flip(image, {2});
  return (image.clamp(0, 255) / 255 - mean) / std;
}

std::string Describe(const TrainingCrop& crop) {
  return absl::StrCat("box ", crop.box.x, ",", crop.box.y, " ", crop.box.w, "x", crop.box.h,
                      crop.flip ? ", flipped" : "");
}

// A training image is its drawn crop of the file's pixels resized by an
// antialiased bilinear filter (ATen's, which torchvision's tensor resize
// with antialias=True runs and PIL's resize matches), flipped when drawn
// so, and normalised by ImageNet's mean and std: computed here from the
// PNG's pixels, for crops that shrink and crops that enlarge.
TEST(ImageFolder, TrainingImagesAreTheirCropsResizedFlippedAndNormalised) {
  const std::string dir = FreshImageDir("recipe");
  fs::create_directories(dir + "/train/a");
  const std::vector<std::pair<int, int>> sizes = {{120, 90}, {90, 120}, {40, 30}, {301, 207}};
  std::vector<std::vector<uint8_t>> files;
  for (size_t f = 0; f < sizes.size(); ++f) {
    const auto [w, h] = sizes[f];
    files.push_back(Pixels(w, h, [f](int x, int y, int c) {
      return static_cast<int>(127 + 90 * std::sin(0.07 * x + 0.11 * y + c + f) + (x * 7 + y * 13 + c * 5) % 31 - 15);
    }));
    WritePng(absl::StrCat(dir, "/train/a/", f, ".png"), w, h, files.back());
  }
  ImageFolderOptions o;
  o.image_size = 32;
  o.seed = 11;
  o.threads = 2;
  auto set = ImageFolder::Open(dir, "train", o).value();
  int flips = 0, enlarged = 0;
  for (int epoch = 0; epoch < 4; ++epoch) {
    auto b = set->Get(at::arange(static_cast<int64_t>(sizes.size()), at::kLong), epoch);
    ASSERT_TRUE(b.ok()) << b.status();
    for (size_t f = 0; f < sizes.size(); ++f) {
      const auto [w, h] = sizes[f];
      const TrainingCrop crop = DrawTrainingCrop(w, h, o.seed, epoch, static_cast<int64_t>(f));
      const Region& box = crop.box;
      ASSERT_EQ(box.x, std::floor(box.x));
      ASSERT_EQ(box.w, std::floor(box.w));
      const at::Tensor want = ReferenceImage(files[f], w, h, crop, 32);
      const double diff = at::abs(b->images[f] - want).max().item<double>();
      EXPECT_LT(diff, 1e-3) << "image " << f << ", epoch " << epoch << ", " << Describe(crop);
      flips += crop.flip;
      enlarged += box.w < 32;
    }
  }
  EXPECT_GT(flips, 0);
  EXPECT_LT(flips, 16);
  EXPECT_GT(enlarged, 0);
}

// A JPEG whose crop is at least twice the image size is decoded at 1/2,
// 1/4 or 1/8 of its size in the DCT: its training images are the same as
// from the whole decoded file (to within what the DCT's downscaling
// rounds differently), so the crop is mapped onto the smaller picture
// right.
TEST(ImageFolder, JpegsScaledDownInTheDctGiveTheSameTrainingImages) {
  const std::string dir = FreshImageDir("dct");
  fs::create_directories(dir + "/train/a");
  const int w = 480, h = 360;
  const auto pixels = Pixels(w, h, [](int x, int y, int c) {
    return static_cast<int>(127 + 100 * std::sin(0.013 * x + 0.017 * y + 2 * c));  // smooth, no edges
  });
  WriteJpeg(dir + "/train/a/big.jpg", w, h, pixels, 95);
  auto whole = DecodeImage(Slurp(dir + "/train/a/big.jpg"), "big.jpg");
  ASSERT_TRUE(whole.ok()) << whole.status();
  ImageFolderOptions o;
  o.image_size = 24;
  o.seed = 4;
  o.threads = 1;
  auto set = ImageFolder::Open(dir, "train", o).value();
  int scaled = 0;
  for (int epoch = 0; epoch < 12; ++epoch) {
    auto b = set->Get(at::arange(1, at::kLong), epoch);
    ASSERT_TRUE(b.ok()) << b.status();
    const TrainingCrop crop = DrawTrainingCrop(w, h, o.seed, epoch, 0);
    const at::Tensor want = ReferenceImage(whole->pixels, w, h, crop, 24);
    const at::Tensor diff = at::abs(b->images[0] - want);
    // In 255ths: measured mean 0.3-0.7, largest 2-5 (the scaled-down
    // decode rounds differently, most at the crop's edges). The crop
    // misplaced by one of the file's pixels on this gradient moves the
    // mean by about 2, by one decoded pixel (up to 8 of the file's) or
    // mapped at the wrong scale by far more.
    EXPECT_LT(diff.max().item<double>() * 255 * 0.225, 8) << "epoch " << epoch << ", " << Describe(crop);
    EXPECT_LT(diff.mean().item<double>() * 255 * 0.225, 1.2) << "epoch " << epoch << ", " << Describe(crop);
    scaled += std::min(crop.box.w, crop.box.h) >= 48;
  }
  EXPECT_GT(scaled, 3) << "too few crops were decoded scaled down";
}

// Batches reuse the memory of earlier ones that nobody holds: a batch
// still held (or a view of it) is never written again; one dropped is.
TEST(ImageFolder, AHeldBatchIsNeverOverwrittenAndADroppedOnesMemoryIsReused) {
  const std::string dir = SmallFolder("reuse");
  ImageFolderOptions o;
  o.image_size = 16;
  auto set = ImageFolder::Open(dir, "train", o).value();
  const at::Tensor rows = at::arange(5, at::kLong);
  at::Tensor held = set->Get(rows, 1).value().images;
  const at::Tensor copy = held.clone();
  const at::Tensor view = set->Get(rows, 2).value().images[2];  // a view keeps its batch's memory too
  const at::Tensor view_copy = view.clone();
  for (int epoch = 3; epoch < 10; ++epoch) {
    at::Tensor other = set->Get(rows, epoch).value().images;
    EXPECT_NE(other.data_ptr(), held.data_ptr());
    EXPECT_NE(other.data_ptr(), view.storage().data());
  }
  EXPECT_TRUE(at::equal(held, copy));
  EXPECT_TRUE(at::equal(view, view_copy));
  const void* memory = held.data_ptr();
  held = at::Tensor();
  const at::Tensor again = set->Get(rows, 1).value().images;
  EXPECT_EQ(again.data_ptr(), memory) << "the dropped batch's memory is reused";
  EXPECT_TRUE(at::equal(again, copy)) << "and written whole";
}

TEST(ImageFolder, ABadFileFailsTheBatchNamingItOrIsSkippedAndCounted) {
  const std::string dir = SmallFolder("bad");
  std::ofstream(dir + "/train/cat/b.jpg", std::ios::trunc) << "\xff\xd8\xff truncated";
  ImageFolderOptions o;
  o.image_size = 16;
  auto set = ImageFolder::Open(dir, "train", o).value();
  auto failed = set->Get(at::arange(5, at::kLong), 1);
  ASSERT_FALSE(failed.ok());
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("cat/b.jpg: a damaged JPEG image"));
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("--skip-bad-images"));
  o.skip_bad_images = true;
  auto skipping = ImageFolder::Open(dir, "train", o).value();
  auto b = skipping->Get(at::arange(5, at::kLong), 1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->skipped, 1);
  EXPECT_EQ(b->images.size(0), 4);
  EXPECT_TRUE(at::equal(b->labels, at::tensor({0, 0, 1, 1}, at::kLong)));
}

}  // namespace
}  // namespace remora::data
