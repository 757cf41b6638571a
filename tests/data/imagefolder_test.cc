// Image folders: the listing (classes in name order, only image files, the
// cache a restart reads), JPEG and PNG decoding (DCT scaling), the
// evaluation crop's exact values, training crops drawn from (seed, epoch,
// row) whatever the threads, and bad files named or skipped. The images
// are written here with libjpeg and libpng (built only where they are
// found, as the decoding is).
#include "data/imagefolder.h"

#include <jpeglib.h>
#include <png.h>

#include <cstdio>
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
#include <torch/csrc/jit/api/module.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "tests/support/master_runs.h"
#include "tests/support/script_models.h"
#include "tests/support/test_group.h"

namespace remora::data {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string FreshDir(const std::string& name) {
  const std::string dir = absl::StrCat(testing::TempDir(), "/remora_imagefolder_", getpid(), "_", name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// An RGB image whose pixel (x, y) is fn(x, y, channel).
std::vector<uint8_t> Pixels(int w, int h, const std::function<int(int, int, int)>& fn) {
  std::vector<uint8_t> p(static_cast<size_t>(w) * h * 3);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      for (int c = 0; c < 3; ++c) p[(static_cast<size_t>(y) * w + x) * 3 + c] = static_cast<uint8_t>(fn(x, y, c));
    }
  }
  return p;
}

void WritePng(const std::string& path, int w, int h, const std::vector<uint8_t>& rgb) {
  png_image image;
  std::memset(&image, 0, sizeof(image));
  image.version = PNG_IMAGE_VERSION;
  image.width = w;
  image.height = h;
  image.format = PNG_FORMAT_RGB;
  ASSERT_TRUE(png_image_write_to_file(&image, path.c_str(), 0, rgb.data(), 0, nullptr)) << path;
}

void WriteJpeg(const std::string& path, int w, int h, const std::vector<uint8_t>& rgb, int quality = 95) {
  jpeg_compress_struct cinfo;
  jpeg_error_mgr err;
  cinfo.err = jpeg_std_error(&err);
  jpeg_create_compress(&cinfo);
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  jpeg_stdio_dest(&cinfo, f);
  cinfo.image_width = w;
  cinfo.image_height = h;
  cinfo.input_components = 3;
  cinfo.in_color_space = JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(rgb.data()) + static_cast<size_t>(cinfo.next_scanline) * w * 3;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::fclose(f);
}

// DIR/train/<classes[c]>/ and DIR/val/<classes[c]>/ with `train` and `val`
// 24 x 20 images per class, PNG and JPEG in turn; pixel (x, y, channel) of
// image i of class c is pixel(c, i, x, y, channel).
void WriteClassFolders(const std::string& dir, const std::vector<std::string>& classes, int train, int val,
                       const std::function<int(int, int, int, int, int)>& pixel) {
  for (const std::string split : {"train", "val"}) {
    for (int c = 0; c < static_cast<int>(classes.size()); ++c) {
      const std::string cls = absl::StrCat(dir, "/", split, "/", classes[c]);
      fs::create_directories(cls);
      for (int i = 0; i < (split == "train" ? train : val); ++i) {
        const auto px = Pixels(24, 20, [&pixel, c, i](int x, int y, int ch) { return pixel(c, i, x, y, ch); });
        if (i % 2) {
          WriteJpeg(absl::StrCat(cls, "/", i, ".jpg"), 24, 20, px);
        } else {
          WritePng(absl::StrCat(cls, "/", i, ".png"), 24, 20, px);
        }
      }
    }
  }
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// DIR/train/{cat,dog}: 3 and 2 gradient images, JPEG and PNG, plus a
// file that is not an image; DIR/val/{cat,dog}: one each.
std::string SmallFolder(const std::string& name) {
  const std::string dir = FreshDir(name);
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

TEST(ImageFolder, ListsClassesInNameOrderAndCachesTheListing) {
  const std::string dir = SmallFolder("listing");
  auto l = ListImageFolder(dir, "train");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_THAT(l->classes, ElementsAre("cat", "dog"));
  EXPECT_THAT(l->files, ElementsAre("cat/a.png", "cat/b.jpg", "cat/c.JPEG", "dog/x.jpeg", "dog/y.png"));
  EXPECT_THAT(l->labels, ElementsAre(0, 0, 0, 1, 1));

  ImageFolderOptions o;
  o.image_size = 16;
  o.listing_cache = dir + "/train.list";
  EXPECT_EQ(ImageFolder::Open(dir, "train", o).value()->size(), 5);
  ASSERT_TRUE(fs::exists(o.listing_cache));
  // A restart reads the cache and does not list the folder again.
  fs::copy_file(dir + "/train/dog/y.png", dir + "/train/dog/z.png");
  EXPECT_EQ(ImageFolder::Open(dir, "train", o).value()->size(), 5);
  o.listing_cache.clear();
  EXPECT_EQ(ImageFolder::Open(dir, "train", o).value()->size(), 6);

  EXPECT_THAT(std::string(ListImageFolder(dir, "test").status().message()),
              HasSubstr("test/<class>/<image> files (torchvision's ImageFolder layout)"));
  fs::create_directories(dir + "/empty/cls");
  EXPECT_THAT(std::string(ListImageFolder(dir, "empty").status().message()),
              HasSubstr("has 1 class folders but no .jpg, .jpeg or .png files"));
}

TEST(ImageFolder, JpegAndPngDecodeToTheirPixelsAndJpegScalesInTheDct) {
  const std::string dir = FreshDir("decode");
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

TEST(ImageFolder, EvaluationResizesTheShortSideCentreCropsAndNormalises) {
  const std::string dir = FreshDir("eval");
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
  const std::string dir = FreshDir("recipe");
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
  const std::string dir = FreshDir("dct");
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

// The train_loss of each "epoch=E train_loss=L ..." line of `out`.
std::vector<double> EpochLosses(const std::string& out) {
  std::vector<double> losses;
  for (absl::string_view line : absl::StrSplit(out, '\n')) {
    if (!absl::ConsumePrefix(&line, "epoch=")) continue;
    const size_t at = line.find(" train_loss=");
    if (at == absl::string_view::npos) continue;
    double loss = 0;
    const absl::string_view rest = line.substr(at + 12);
    if (absl::SimpleAtod(rest.substr(0, rest.find(' ')), &loss)) losses.push_back(loss);
  }
  return losses;
}

// The real programs: master --dataset imagefolder:DIR with a one-file
// model trains in one process and as a two-worker pipeline to the same
// losses (the crops depend on the seed, epoch and row only); a damaged
// file stops the run naming it, or is skipped and counted.
TEST(ImageFolderMaster, TrainsLocallyAndOverWorkersAlikeAndNamesBadFiles) {
  const std::string dir = FreshDir("master");
  WriteClassFolders(dir, {"red", "blue"}, 6, 2, [](int c, int i, int x, int y, int ch) {
    const int base = (ch == 0) == (c == 0) ? 200 : 30;
    return base + (x * 7 + y * 5 + i * 11) % 40;
  });
  torch::jit::Module model("Sequential"), flat("Flatten");
  flat.define("def forward(self, x):\n  return x.flatten(1)\n");
  model.register_module("f", flat);
  model.register_module("l0", test_support::ScriptLinear(3 * 16 * 16, 8, 1, true));
  model.register_module("l1", test_support::ScriptLinear(8, 2, 2, false));
  model.define("def forward(self, x):\n  x = self.f.forward(x)\n  x = self.l0.forward(x)\n"
               "  return self.l1.forward(x)\n");
  const std::string file = TempPath("imagefolder_model.pt");
  model.save(file);
  const std::vector<std::string> common = {"--dataset", "imagefolder:" + dir, "--model", file, "--classes", "2",
                                           "--image-size", "16", "--epochs", "2", "--batch-size", "4",
                                           "--data-threads", "2", "--seed", "3", "--lr", "0.0005"};
  auto master = [&](std::vector<std::string> args) {
    args.insert(args.begin(), BinDir() + "/master");
    args.insert(args.end(), common.begin(), common.end());
    return args;
  };
  const std::string tensorboard = TempPath("imagefolder_tensorboard");
  auto [local_code, local_out] = RunProgram(
      master({"--local", "--threads", "1", "--splits", "1", "--tensorboard", tensorboard}), absl::Seconds(120));
  ASSERT_EQ(local_code, 0) << local_out;
  EXPECT_THAT(local_out, HasSubstr(": 12 training and 4 test images of [3, 16, 16]"));
  const std::vector<double> local = EpochLosses(local_out);
  ASSERT_EQ(local.size(), 2u) << local_out;
  // --tensorboard: 3 steps an epoch (12 images, batches of 4), numbered on
  // across epochs, and each epoch's loss as printed (to its 4 decimals).
  const auto steps = test_support::ScalarsIn(tensorboard, "step/loss");
  ASSERT_EQ(steps.size(), 6u);
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i].step, static_cast<int64_t>(i + 1));
  const auto epochs = test_support::ScalarsIn(tensorboard, "epoch/train_loss");
  ASSERT_EQ(epochs.size(), 2u);
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_EQ(epochs[e].step, static_cast<int64_t>(e + 1));
    EXPECT_NEAR(epochs[e].value, local[e], 6e-5);
    EXPECT_NEAR(epochs[e].value, (steps[3 * e].value + steps[3 * e + 1].value + steps[3 * e + 2].value) / 3, 1e-5);
  }
  EXPECT_EQ(test_support::ScalarsIn(tensorboard, "epoch/test_accuracy").size(), 2u);
  EXPECT_EQ(test_support::ScalarsIn(tensorboard, "epoch/test_top5").size(), 2u);

  // Workers w1 and w2 of a master at `at`, one thread each.
  std::vector<std::unique_ptr<launch::Subprocess>> workers;
  auto start_workers = [&workers](const std::string& at, const std::string& log) {
    workers.clear();
    for (const std::string name : {"w1", "w2"}) {
      const std::vector<std::string> argv = {BinDir() + "/worker", "--name", name, "--master", at, "--threads", "1"};
      workers.push_back(launch::Subprocess::Spawn(argv, TempPath(name + log)).value());
    }
  };
  const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
  start_workers(addr, "_imagefolder.log");
  auto [code, out] = RunProgram(master({"--workers", "w1,w2", "--listen", addr, "--splits", "2"}),
                                absl::Seconds(120));
  ASSERT_EQ(code, 0) << out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  const std::vector<double> piped = EpochLosses(out);
  ASSERT_EQ(piped.size(), 2u) << out;
  for (size_t e = 0; e < 2; ++e) EXPECT_NEAR(piped[e], local[e], 1e-4 * std::abs(local[e])) << "epoch " << e + 1;
  EXPECT_THAT(out, HasSubstr(" test_top5="));  // counted on the last stage's worker

  // Without --model: ResNet50, in one process and cut in two over the workers.
  const std::vector<std::string> resnet = {"--dataset", "imagefolder:" + dir, "--image-size", "32", "--epochs", "1",
                                           "--batch-size", "4", "--seed", "3", "--lr", "0.001"};
  // (Two micro-batches both ways: batch norm sees the same rows.)
  std::vector<std::string> resnet_local = {BinDir() + "/master", "--local", "--threads", "1", "--splits", "2"};
  resnet_local.insert(resnet_local.end(), resnet.begin(), resnet.end());
  auto [resnet_code, resnet_out] = RunProgram(resnet_local, absl::Seconds(120));
  ASSERT_EQ(resnet_code, 0) << resnet_out;
  const std::vector<double> resnet_losses = EpochLosses(resnet_out);
  ASSERT_EQ(resnet_losses.size(), 1u) << resnet_out;
  const std::string addr2 = absl::StrCat("127.0.0.1:", FreePort());
  start_workers(addr2, "_imagefolder_resnet.log");
  const std::string ckpt = TempPath("imagefolder_ckpt");
  std::vector<std::string> resnet_piped = {BinDir() + "/master", "--workers", "w1,w2", "--listen", addr2,
                                           "--splits", "2", "--partition", "tutorial", "--checkpoint-dir", ckpt};
  resnet_piped.insert(resnet_piped.end(), resnet.begin(), resnet.end());
  auto [piped_code, piped_out] = RunProgram(resnet_piped, absl::Seconds(180));
  ASSERT_EQ(piped_code, 0) << piped_out;
  for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
  const std::vector<double> resnet_piped_losses = EpochLosses(piped_out);
  ASSERT_EQ(resnet_piped_losses.size(), 1u) << piped_out;
  EXPECT_NEAR(resnet_piped_losses[0], resnet_losses[0], 1e-3 * std::abs(resnet_losses[0]));
  EXPECT_TRUE(fs::exists(ckpt + "/imagefolder-train.list"));  // a resumed run reads it
  // The evaluator scores the checkpoint on val/ at the training's size.
  auto [eval_code, eval_out] = RunProgram({BinDir() + "/evaluator", "--checkpoint-dir", ckpt, "--dataset",
                                           "imagefolder:" + dir, "--image-size", "32", "--once", "--threads", "1"},
                                          absl::Seconds(120));
  EXPECT_EQ(eval_code, 0) << eval_out;
  EXPECT_THAT(eval_out, HasSubstr("4 test images of imagefolder:"));
  EXPECT_THAT(eval_out, HasSubstr("test_top5="));

  // --train-rows: the first N training images only.
  auto [head_code, head_out] =
      RunProgram(master({"--local", "--splits", "1", "--train-rows", "8"}), absl::Seconds(120));
  EXPECT_EQ(head_code, 0) << head_out;
  EXPECT_THAT(head_out, HasSubstr(": 8 training and 4 test images of [3, 16, 16]"));

  std::ofstream(dir + "/train/red/9.jpg") << "\xff\xd8\xff cut short";
  auto [bad_code, bad_out] = RunProgram(master({"--local", "--splits", "1"}), absl::Seconds(120));
  EXPECT_EQ(bad_code, 1) << bad_out;
  EXPECT_THAT(bad_out, HasSubstr("red/9.jpg: a damaged JPEG image"));
  EXPECT_THAT(bad_out, HasSubstr("give --skip-bad-images"));
  auto [skip_code, skip_out] = RunProgram(master({"--local", "--splits", "1", "--skip-bad-images"}),
                                          absl::Seconds(120));
  EXPECT_EQ(skip_code, 0) << skip_out;
  EXPECT_THAT(skip_out, HasSubstr("skipped_images=1"));
  // Over workers, stage 0's worker reads the files itself: the same error
  // from it, and with --skip-bad-images the same count and losses as in
  // one process at two micro-batches (the last stage's worker weights by
  // the rows stage 0's read; a last batch of one row is dropped both ways).
  auto [skip2_code, skip2_out] = RunProgram(master({"--local", "--threads", "1", "--splits", "2",
                                                    "--skip-bad-images"}),
                                            absl::Seconds(120));
  EXPECT_EQ(skip2_code, 0) << skip2_out;
  for (const bool skip : {false, true}) {
    const std::string at = absl::StrCat("127.0.0.1:", FreePort());
    start_workers(at, "_imagefolder_bad.log");
    std::vector<std::string> args = {"--workers", "w1,w2", "--listen", at, "--splits", "2"};
    if (skip) args.push_back("--skip-bad-images");
    auto [over_code, over_out] = RunProgram(master(args), absl::Seconds(120));
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), skip ? 0 : 1);
    if (!skip) {
      EXPECT_EQ(over_code, 1) << over_out;
      EXPECT_THAT(over_out, HasSubstr("reading a batch on worker 'w1'"));
      EXPECT_THAT(over_out, HasSubstr("red/9.jpg: a damaged JPEG image"));
      continue;
    }
    EXPECT_EQ(over_code, 0) << over_out;
    EXPECT_THAT(over_out, HasSubstr("skipped_images=1"));
    const std::vector<double> want = EpochLosses(skip2_out), got = EpochLosses(over_out);
    ASSERT_EQ(got.size(), want.size()) << over_out;
    for (size_t e = 0; e < want.size(); ++e) {
      EXPECT_NEAR(got[e], want[e], 1e-4 * std::abs(want[e])) << "epoch " << e + 1;
    }
  }
}

// Four classes told apart by their colours, under the training recipe's
// crops and flips: a small CNN over two workers learns them well above
// chance (1 in 4), and the parameter server and data parallelism to the
// same losses. A run whose worker is killed after the checkpoint of
// step 8 (of 24), resumed on new workers, ends as the uninterrupted run
// did: the resumed epochs read the same images with the same crops.
TEST(ImageFolderMaster, ACnnLearnsTheClassesInEveryModeAndAResumedRunEndsAsOneThatNeverStopped) {
  const std::string dir = FreshDir("learn");
  const int colours[4][3] = {{200, 60, 50}, {50, 190, 70}, {60, 70, 200}, {180, 180, 60}};
  WriteClassFolders(dir, {"class0", "class1", "class2", "class3"}, 12, 4,
                    [&colours](int c, int i, int x, int y, int ch) {
                      return colours[c][ch] + (x * 13 + y * 7 + i * 29 + ch * 5) % 50 - 25;
                    });
  const std::string model = TempPath("imagefolder_cnn.pt");
  test_support::ScriptSmallCnn(4, 5).save(model);
  auto master = [&](const std::string& workers, const std::string& addr, const std::string& ckpt) {
    return std::vector<std::string>{BinDir() + "/master", "--workers", workers, "--listen", addr, "--dataset",
                                    "imagefolder:" + dir, "--model", model, "--classes", "4", "--image-size", "16",
                                    "--epochs", "4", "--batch-size", "8", "--splits", "2", "--data-threads", "2",
                                    "--seed", "1", "--lr", "0.05", "--threads", "1", "--checkpoint-dir", ckpt,
                                    "--checkpoint-every", "4"};
  };
  const std::string whole = test_support::FreshDir("imagefolder_whole");
  const std::string broken = test_support::FreshDir("imagefolder_broken");
  std::string whole_out;
  {
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "imagefolder_whole");
    auto [code, out] = RunProgram(master("w1,w2", addr, whole), absl::Seconds(120));
    ASSERT_EQ(code, 0) << out;
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
    whole_out = out;
  }
  const std::string last = test_support::LineStarting(whole_out, "epoch=4 ");
  const size_t at = last.find("test_accuracy=");
  ASSERT_NE(at, std::string::npos) << whole_out;
  double accuracy = 0;
  ASSERT_TRUE(absl::SimpleAtod(last.substr(at + 14, last.find(' ', at) - at - 14), &accuracy)) << last;
  EXPECT_GE(accuracy, 0.75) << "chance is 0.25:\n" << whole_out;
  // The parameter server and data parallelism (each worker reading its
  // own share of the folder) train to the same losses.
  for (const std::string mode : {"--mode ps", "--replicas 2"}) {
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "imagefolder_mode");
    std::vector<std::string> argv = master("w1,w2", addr, test_support::FreshDir("imagefolder_mode"));
    argv.erase(std::find(argv.begin(), argv.end(), "--splits"), std::find(argv.begin(), argv.end(), "--splits") + 2);
    const std::vector<std::string> flags = absl::StrSplit(mode, ' ');
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto [code, out] = RunProgram(argv, absl::Seconds(120));
    ASSERT_EQ(code, 0) << mode << ":\n" << out;
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
    const std::vector<double> got = EpochLosses(out), want = EpochLosses(whole_out);
    ASSERT_EQ(got.size(), want.size()) << mode << ":\n" << out;
    for (size_t e = 0; e < want.size(); ++e) EXPECT_NEAR(got[e], want[e], 1e-4 * std::abs(want[e])) << mode;
  }
  {
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = test_support::StartWorkers({"w1", "w2"}, addr, "imagefolder_broken");
    const std::string log = TempPath("imagefolder_broken_master.log");
    auto job = launch::Subprocess::Spawn(master("w1,w2", addr, broken), log).value();
    const auto deadline = absl::Now() + absl::Seconds(60);
    while (ReadFile(log).find("checkpoint: step 8 ") == std::string::npos && job->running() &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    workers[1]->Signal(SIGKILL);
    ASSERT_NE(job->Wait(absl::Seconds(60)).value_or(-1), 0) << "the run ended before w2 was killed:\n"
                                                            << ReadFile(log);
    workers[0]->Wait(absl::Seconds(30)).IgnoreError();
  }
  {
    const std::string addr = absl::StrCat("127.0.0.1:", FreePort());
    auto workers = test_support::StartWorkers({"x1", "x2"}, addr, "imagefolder_resumed");
    std::vector<std::string> argv = master("x1,x2", addr, broken);
    argv.insert(argv.end(), {"--resume", broken});
    auto [code, out] = RunProgram(argv, absl::Seconds(120));
    ASSERT_EQ(code, 0) << out;
    for (auto& w : workers) EXPECT_EQ(w->Wait(absl::Seconds(30)).value_or(-1), 0);
    EXPECT_THAT(out, HasSubstr("resumed from " + broken + "/step-"));
    const std::vector<double> resumed = EpochLosses(out), uninterrupted = EpochLosses(whole_out);
    ASSERT_FALSE(resumed.empty()) << out;
    ASSERT_EQ(uninterrupted.size(), 4u) << whole_out;
    EXPECT_NEAR(resumed.back(), uninterrupted.back(), 1e-5 * std::abs(uninterrupted.back())) << out;
    EXPECT_LT(test_support::CompareStages(whole, broken).largest, 1e-5);
  }
}

}  // namespace
}  // namespace remora::data
