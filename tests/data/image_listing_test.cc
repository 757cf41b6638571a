// Image folders' listing (data/image_listing.cc): classes in name order,
// only image files; class folders at the top, a held-out fraction, and the
// cache a restart reads. The files hold no pixels (the listing reads
// none); decoding: imagefolder_test.cc.
#include "data/imagefolder.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/data/image_files.h"

namespace remora::data {
namespace {

namespace fs = std::filesystem;
using test_images::FreshImageDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Files whose names say image (the listing reads no pixels).
void Touch(const std::string& dir, const std::vector<std::string>& names) {
  fs::create_directories(dir);
  for (const std::string& n : names) std::ofstream(dir + "/" + n) << "x";
}

TEST(ImageListing, ListsClassesInNameOrderAndCachesTheListing) {
  const std::string dir = FreshImageDir("listing");
  Touch(dir + "/train/dog", {"y.png", "x.jpeg"});
  Touch(dir + "/train/cat", {"b.jpg", "a.png", "c.JPEG"});
  Touch(dir + "/val/cat", {"v.png"});
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
  fs::create_directories(dir + "/nothing");
  EXPECT_THAT(std::string(ListImageFolder(dir, "nothing").status().message()), HasSubstr("has no class folders"));
}

// torchvision's ImageFolder(root) layout: the class folders at the top are
// the training images; without val/ there is no validation split until a
// fraction is held out.
TEST(ImageListing, ClassFoldersAtTheTopAreTheTrainingImages) {
  const std::string dir = FreshImageDir("flat");
  Touch(dir + "/cat", {"b.jpg", "a.png"});
  Touch(dir + "/dog", {"x.jpeg"});
  auto l = ListImageFolder(dir, "train");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_THAT(l->classes, ElementsAre("cat", "dog"));
  EXPECT_THAT(l->files, ElementsAre("cat/a.png", "cat/b.jpg", "dog/x.jpeg"));
  ImageFolderOptions o;
  o.image_size = 16;
  auto opened = ImageFolder::Open(dir, "train", o);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ((*opened)->root(), fs::absolute(dir).lexically_normal().string());
  auto val = ListImageFolder(dir, "val");
  EXPECT_EQ(val.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(val.status().message()), HasSubstr("--val-fraction"));
  // val/ without train/: the class folders cannot be told apart from it.
  const std::string odd = FreshImageDir("val_only");
  Touch(odd + "/val/cat", {"a.png"});
  EXPECT_THAT(std::string(ListImageFolder(odd, "train").status().message()), HasSubstr("has val/ but no train/"));
  EXPECT_EQ(ListImageFolder(FreshImageDir("nothing") + "/absent", "train").status().code(),
            absl::StatusCode::kNotFound);
}

// A val fraction splits the training images by a hash of each name: the
// two parts are disjoint and make up the whole, the same every time, and
// an image added moves no other; the listing cache tells fractions apart.
TEST(ImageListing, AValFractionHoldsOutTheSameImagesEveryTime) {
  const std::string dir = FreshImageDir("held_out");
  std::vector<std::string> names;
  for (int i = 0; i < 200; ++i) names.push_back(absl::StrCat(i, ".png"));
  Touch(dir + "/train/a", names);
  Touch(dir + "/train/b", names);
  auto all = ListImageFolder(dir, "train").value();
  auto kept = ListImageFolder(dir, "train", 0.25).value();
  auto held = ListImageFolder(dir, "val", 0.25).value();
  EXPECT_EQ(kept.classes, all.classes);
  EXPECT_EQ(held.classes, all.classes);
  EXPECT_EQ(kept.files.size() + held.files.size(), all.files.size());
  EXPECT_GT(held.files.size(), 60u);  // 100 expected of 400
  EXPECT_LT(held.files.size(), 140u);
  std::vector<std::string> both = kept.files;
  both.insert(both.end(), held.files.begin(), held.files.end());
  std::sort(both.begin(), both.end());
  std::vector<std::string> sorted = all.files;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(both, sorted);
  for (size_t i = 0; i < held.files.size(); ++i) {
    EXPECT_EQ(held.labels[i], held.files[i][0] == 'a' ? 0 : 1) << held.files[i];
  }
  EXPECT_EQ(ListImageFolder(dir, "val", 0.25).value().files, held.files);
  Touch(dir + "/train/a", {"new.png"});
  auto after = ListImageFolder(dir, "val", 0.25).value().files;
  after.erase(std::remove(after.begin(), after.end(), "a/new.png"), after.end());
  EXPECT_EQ(after, held.files);

  ImageFolderOptions o;
  o.image_size = 16;
  o.listing_cache = dir + "/val.list";
  o.val_fraction = 0.25;
  const int64_t quarter = ImageFolder::Open(dir, "val", o).value()->size();
  o.val_fraction = 0.5;
  EXPECT_GT(ImageFolder::Open(dir, "val", o).value()->size(), quarter);  // not the cached quarter

  // Nothing held out, or everything: an error that says which way to go.
  EXPECT_THAT(std::string(ListImageFolder(dir, "val", 1e-12).status().message()), HasSubstr("holds out none"));
  EXPECT_THAT(std::string(ListImageFolder(dir, "train", 1 - 1e-12).status().message()), HasSubstr("holds out all"));
  EXPECT_FALSE(ListImageFolder(dir, "train", 1).ok());
  // Beside a val/ folder a fraction is refused rather than ignored.
  Touch(dir + "/val/a", {"v.png"});
  EXPECT_THAT(std::string(ListImageFolder(dir, "val", 0.25).status().message()), HasSubstr("has val/"));
  EXPECT_EQ(ListImageFolder(dir, "val").value().files.size(), 1u);
}

}  // namespace
}  // namespace remora::data
