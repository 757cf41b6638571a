// Image folders' listing (data/image_listing.cc), as torchvision's
// ImageFolder lists them: classes in name order, images in their
// subfolders too, hidden names skipped, a class folder without images
// refused, files of other types counted; class folders at the top, a
// held-out fraction, and the cache a restart reads. The files hold no
// pixels (the listing reads none), but for one that is decoded from its
// subfolder; decoding itself: imagefolder_test.cc.
#include "data/imagefolder.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <ATen/ops/zeros.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/data/image_files.h"

namespace remora::data {
namespace {

namespace fs = std::filesystem;
using test_images::FreshImageDir;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

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

// torchvision walks a class folder down (sorted(os.walk(...))): images in
// subfolders at any depth belong to the class, named from the split's
// folder, folder by folder in path order (cat/sub-2 before cat/sub/deeper,
// as Python sorts the paths) and by name within one; a linked folder is
// followed, a link back up is refused rather than walked without end.
TEST(ImageListing, ImagesInSubfoldersAreListedInTorchvisionsOrder) {
  const std::string dir = FreshImageDir("nested");
  Touch(dir + "/train/cat", {"z.png", "a.jpg", "B.jpg"});
  Touch(dir + "/train/cat/sub", {"x.jpg"});
  Touch(dir + "/train/cat/sub/deeper", {"y.jpg"});
  Touch(dir + "/train/cat/sub-2", {"w.jpg"});
  Touch(dir + "/train/cat/Sub", {"u.jpg"});
  Touch(dir + "/train/dog/only/in/here", {"d.png"});
  Touch(dir + "/elsewhere", {"e.jpg"});
  fs::create_directory_symlink(dir + "/elsewhere", dir + "/train/dog/linked");
  auto l = ListImageFolder(dir, "train");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_THAT(l->classes, ElementsAre("cat", "dog"));
  EXPECT_THAT(l->files, ElementsAre("cat/B.jpg", "cat/a.jpg", "cat/z.png", "cat/Sub/u.jpg", "cat/sub/x.jpg",
                                    "cat/sub-2/w.jpg", "cat/sub/deeper/y.jpg", "dog/linked/e.jpg",
                                    "dog/only/in/here/d.png"));
  EXPECT_THAT(l->labels, ElementsAre(0, 0, 0, 0, 0, 0, 0, 1, 1));

  // A listed subfolder image reads from where the listing names it.
  const std::string real = FreshImageDir("nested_real");
  fs::create_directories(real + "/train/red/2024/june");
  test_images::WritePng(real + "/train/red/2024/june/r.png", 8, 8,
                        test_images::Pixels(8, 8, [](int, int, int c) { return c == 0 ? 255 : 0; }));
  ImageFolderOptions o;
  o.image_size = 4;
  o.train = false;
  auto set = ImageFolder::Open(real, "train", o);
  ASSERT_TRUE(set.ok()) << set.status();
  auto b = (*set)->Get(at::zeros({1}, at::kLong), 0);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_NEAR(b->images[0][0][2][2].item<float>(), (1.0 - 0.485) / 0.229, 1e-3);

  fs::create_directory_symlink(dir + "/train/cat", dir + "/train/cat/sub/back");
  EXPECT_THAT(std::string(ListImageFolder(dir, "train").status().message()),
              AllOf(HasSubstr("cat/sub/back is a link to a folder above it"), HasSubstr("remove the link")));
}

// Hidden names (.DS_Store, .ipynb_checkpoints, macOS's ._x.jpg
// AppleDouble files, which say .jpg but hold no image) are neither
// classes nor images anywhere, and are not counted as left out.
TEST(ImageListing, HiddenNamesAreNeitherClassesNorImages) {
  const std::string dir = FreshImageDir("hidden");
  Touch(dir + "/train", {".DS_Store"});
  Touch(dir + "/train/.ipynb_checkpoints", {"a.jpg"});
  Touch(dir + "/train/cat", {"a.jpg", "._a.jpg", ".DS_Store", ".b.png"});
  Touch(dir + "/train/cat/.thumbs", {"t.jpg"});
  Touch(dir + "/train/dog/.git/objects", {"x.jpg"});
  Touch(dir + "/train/dog/pics", {"d.jpg", "._d.jpg"});
  auto l = ListImageFolder(dir, "train");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_THAT(l->classes, ElementsAre("cat", "dog"));
  EXPECT_THAT(l->files, ElementsAre("cat/a.jpg", "dog/pics/d.jpg"));
  EXPECT_EQ(l->unlisted, 0);
}

// A class folder without an image would be a label never trained on:
// refused as torchvision refuses it, naming the folders, what to do, and
// which files are read (and, where there are any, which were not).
TEST(ImageListing, AClassFolderWithoutAnImageIsRefusedNamingIt) {
  const std::string dir = FreshImageDir("empty_class");
  Touch(dir + "/train/cat", {"a.jpg"});
  Touch(dir + "/train/dog", {".DS_Store", "._d.jpg"});
  Touch(dir + "/train/emu/scans", {"e.bmp"});
  fs::create_directories(dir + "/train/fox/sub");
  auto l = ListImageFolder(dir, "train");
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(l.status().message());
  EXPECT_THAT(message, HasSubstr(fs::absolute(dir + "/train").lexically_normal().string()));
  EXPECT_THAT(message, HasSubstr("class folders with no image (3 of 4: dog, emu, fox)"));
  EXPECT_THAT(message, HasSubstr("remove them, or add images to them"));
  EXPECT_THAT(message, HasSubstr(".jpg, .jpeg and .png files (any case) in a class folder or its subfolders"));
  EXPECT_THAT(message, HasSubstr("1 files of other types are not read, e.g. emu/scans/e.bmp"));
  ImageFolderOptions o;
  o.image_size = 16;
  EXPECT_EQ(ImageFolder::Open(dir, "train", o).status(), l.status());
  // All of them empty.
  fs::remove_all(dir + "/train/cat");
  fs::remove_all(dir + "/train/emu");
  EXPECT_THAT(std::string(ListImageFolder(dir, "train").status().message()),
              AllOf(HasSubstr("(2 of 2: dog, fox)"), Not(HasSubstr("other types"))));
}

// Files that are not .jpg, .jpeg or .png stay out (as torchvision's
// IMG_EXTENSIONS would not: its PIL reads .bmp, .ppm ...), but are counted
// with a few names, so a folder of another format does not shrink the
// dataset unseen; the count comes through a held-out part and the cache.
TEST(ImageListing, FilesOfOtherTypesAreCountedNotListed) {
  const std::string dir = FreshImageDir("others");
  Touch(dir + "/train/cat", {"a.jpg", "b.bmp", "c.gif", "notes.txt"});
  Touch(dir + "/train/cat/raw", {"d.ppm"});
  Touch(dir + "/train/dog", {"e.webp", "f.png"});
  Touch(dir + "/train", {"README.txt"});  // beside the classes: in none
  auto l = ListImageFolder(dir, "train");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_THAT(l->files, ElementsAre("cat/a.jpg", "dog/f.png"));
  EXPECT_EQ(l->unlisted, 5);
  EXPECT_THAT(l->unlisted_examples, ElementsAre("cat/b.bmp", "cat/c.gif", "cat/notes.txt"));
  EXPECT_EQ(ListImageFolder(dir + "/train", "train", 0.5).value().unlisted, 5);

  ImageFolderOptions o;
  o.image_size = 16;
  o.listing_cache = dir + "/train.list";
  auto scanned = ImageFolder::Open(dir, "train", o);
  ASSERT_TRUE(scanned.ok()) << scanned.status();
  EXPECT_EQ((*scanned)->unlisted(), 5);
  // From the cache (the folder as it was): the same count and names.
  Touch(dir + "/train/dog", {"g.png", "h.tif"});
  auto cached = ImageFolder::Open(dir, "train", o);
  ASSERT_TRUE(cached.ok()) << cached.status();
  EXPECT_EQ((*cached)->size(), 2);
  EXPECT_EQ((*cached)->unlisted(), 5);
  EXPECT_EQ((*cached)->unlisted_examples(), l->unlisted_examples);
  o.listing_cache.clear();
  EXPECT_EQ(ImageFolder::Open(dir, "train", o).value()->unlisted(), 6);
}

// A listing cache written by the version before subfolders and hidden
// names counted is the listing a checkpoint's run trained on: read as it
// is (its labels kept), so a resumed run goes on with the same rows. (A
// fresh run deletes the cache first: master/run_data.cc.)
TEST(ImageListing, AnOlderListingCacheIsReadAsItsRunListedTheFolder) {
  const std::string dir = FreshImageDir("old_cache");
  Touch(dir + "/train/cat", {"a.jpg"});
  Touch(dir + "/train/cat/sub", {"b.jpg"});
  Touch(dir + "/train/dog", {"c.jpg"});
  const std::string root = fs::absolute(dir + "/train").lexically_normal().string();
  const std::string cache = dir + "/train.list";
  std::ofstream(cache) << "remora-imagefolder-listing 1 " << root << "\n3\n.ipynb_checkpoints\ncat\ndog\n"
                       << "2\n1\tcat/a.jpg\n2\tdog/c.jpg\n";
  ImageFolderOptions o;
  o.image_size = 16;
  o.listing_cache = cache;
  auto set = ImageFolder::Open(dir, "train", o);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_THAT((*set)->classes(), ElementsAre(".ipynb_checkpoints", "cat", "dog"));
  EXPECT_EQ((*set)->size(), 2);
  EXPECT_EQ((*set)->unlisted(), 0);
  // Without the cache: listed anew.
  o.listing_cache.clear();
  EXPECT_THAT(ImageFolder::Open(dir, "train", o).value()->classes(), ElementsAre("cat", "dog"));
}

}  // namespace
}  // namespace remora::data
