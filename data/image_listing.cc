// The listing of an image folder's split (data/imagefolder.h): the class
// folders and their images, a held-out fraction, and the listing cache.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status_util.h"
#include "data/imagefolder.h"
#include "data/mix.h"

namespace remora::data {
namespace {

namespace fs = std::filesystem;

// Version 2 lists subfolders' images and the count of files left out, and
// skips hidden names; a version 1 listing is still read (ReadListing).
constexpr char kListingHeader[] = "remora-imagefolder-listing 2";
constexpr char kListingHeaderVersion1[] = "remora-imagefolder-listing 1";
constexpr size_t kUnlistedExamples = 3;  // names kept of the files not listed

bool IsImageName(const std::string& name) {
  const std::string ext = absl::AsciiStrToLower(fs::path(name).extension().string());
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png";
}

// A listing cache's lines back, if it lists `root`.
std::optional<ImageListing> ReadListing(const std::string& path, const std::string& root) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  // Version 1 (before subfolders, hidden names and other files counted)
  // is read as it is: a resumed run trains on the files and labels of the
  // run that wrote it. It has no count of other files.
  const bool version1 = line == absl::StrCat(kListingHeaderVersion1, " ", root);
  if (!version1 && line != absl::StrCat(kListingHeader, " ", root)) return std::nullopt;
  ImageListing l;
  int64_t classes = 0, files = 0;
  if (!std::getline(in, line) || !absl::SimpleAtoi(line, &classes)) return std::nullopt;
  for (int64_t i = 0; i < classes && std::getline(in, line); ++i) l.classes.push_back(line);
  if (!std::getline(in, line) || !absl::SimpleAtoi(line, &files)) return std::nullopt;
  for (int64_t i = 0; i < files && std::getline(in, line); ++i) {
    const std::vector<std::string> parts = absl::StrSplit(line, absl::MaxSplits('\t', 1));
    int64_t label = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &label) || label < 0 || label >= classes) {
      return std::nullopt;
    }
    l.labels.push_back(label);
    l.files.push_back(parts[1]);
  }
  if (static_cast<int64_t>(l.classes.size()) != classes || static_cast<int64_t>(l.files.size()) != files) {
    return std::nullopt;
  }
  if (version1) return l;
  // "<files not listed> <examples>", then the examples' names.
  int64_t examples = 0;
  std::vector<std::string> counts;
  if (!std::getline(in, line) || (counts = absl::StrSplit(line, ' ')).size() != 2 ||
      !absl::SimpleAtoi(counts[0], &l.unlisted) || !absl::SimpleAtoi(counts[1], &examples)) {
    return std::nullopt;
  }
  for (int64_t i = 0; i < examples && std::getline(in, line); ++i) l.unlisted_examples.push_back(line);
  if (static_cast<int64_t>(l.unlisted_examples.size()) != examples) return std::nullopt;
  return l;
}

void WriteListing(const std::string& path, const std::string& root, const ImageListing& l) {
  // Its own temporary file: the master and the workers that read the
  // folder (on one host, or on several sharing the directory) may write
  // the same listing at once.
  static std::atomic<int64_t> written{0};
  char host[256] = "host";
  gethostname(host, sizeof(host) - 1);
  const std::string tmp = absl::StrCat(path, ".tmp.", host, ".", getpid(), ".", written++);
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kListingHeader << " " << root << "\n" << l.classes.size() << "\n";
    for (const std::string& c : l.classes) out << c << "\n";
    out << l.files.size() << "\n";
    for (size_t i = 0; i < l.files.size(); ++i) out << l.labels[i] << "\t" << l.files[i] << "\n";
    out << l.unlisted << " " << l.unlisted_examples.size() << "\n";
    for (const std::string& e : l.unlisted_examples) out << e << "\n";
    out.close();
    if (!out) {  // a cache that cannot be written is only slower next time
      fs::remove(tmp, ec);
      return;
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) fs::remove(tmp, ec);
}

// A name that starts with '.': hidden (.DS_Store, .ipynb_checkpoints,
// macOS's ._x.jpg AppleDouble files), never a class or an image.
bool IsHidden(const std::string& name) { return !name.empty() && name[0] == '.'; }

// A folder's entries that are not hidden, by name: the folders (links to
// folders followed, as torchvision's os.walk(followlinks=True) does) and
// the rest.
struct Entries {
  std::vector<std::string> folders, files;
};

absl::StatusOr<Entries> ReadFolder(const fs::path& dir) {
  Entries e;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (IsHidden(name)) continue;
    std::error_code type_ec;  // (an entry that cannot be looked at is a file: reading it names it)
    (it->is_directory(type_ec) ? e.folders : e.files).push_back(name);
  }
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat("cannot list ", dir.string(), ": ", ec.message(),
                                                    " (make it readable, or move it out of the image folder)"));
  }
  std::sort(e.folders.begin(), e.folders.end());
  std::sort(e.files.begin(), e.files.end());
  return e;
}

// The folder root/rel and the folders in it at any depth, each with its
// files; `up` holds the folders above it (device, inode), so a link back
// up is an error rather than endless.
using FolderFiles = std::vector<std::pair<std::string, std::vector<std::string>>>;
absl::Status Walk(const fs::path& root, const std::string& rel, std::vector<std::pair<dev_t, ino_t>>* up,
                  FolderFiles* out) {
  const fs::path dir = root / rel;
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("cannot read ", dir.string(), ": ", std::strerror(errno),
                                                    " (make it readable, or move it out of the image folder)"));
  }
  const std::pair<dev_t, ino_t> id(st.st_dev, st.st_ino);
  if (std::find(up->begin(), up->end(), id) != up->end()) {
    return absl::InvalidArgumentError(absl::StrCat(dir.string(), " is a link to a folder above it, which would be ",
                                                   "listed without end: remove the link"));
  }
  ASSIGN_OR_RETURN(Entries e, ReadFolder(dir));
  out->emplace_back(rel, std::move(e.files));
  up->push_back(id);
  for (const std::string& f : e.folders) RETURN_IF_ERROR(Walk(root, absl::StrCat(rel, "/", f), up, out));
  up->pop_back();
  return absl::OkStatus();
}

constexpr char kImageKinds[] =
    "images are .jpg, .jpeg and .png files (any case) in a class folder or its subfolders; names starting with '.' "
    "are skipped";

// Lists the class folders under `root` and their images, as torchvision's
// ImageFolder does: every folder in `root` is a class, and its images are
// its files and its subfolders' at any depth, named relative to `root`
// (cat/sub/x.jpg), folder by folder in path order, each one's files in name
// order (sorted(os.walk(...))). Unlike torchvision, hidden names are
// skipped. Files of other types are counted in `unlisted`; `what` names
// the layout in errors.
absl::StatusOr<ImageListing> ListClassFolders(const fs::path& root, const std::string& what) {
  ASSIGN_OR_RETURN(Entries top, ReadFolder(root));
  ImageListing l;
  l.classes = std::move(top.folders);  // (files beside the class folders belong to no class)
  if (l.classes.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(root.string(), " has no class folders (", what, ")"));
  }
  std::vector<std::string> empty;  // class folders without an image
  for (size_t c = 0; c < l.classes.size(); ++c) {
    FolderFiles folders;
    std::vector<std::pair<dev_t, ino_t>> up;
    RETURN_IF_ERROR(Walk(root, l.classes[c], &up, &folders));
    std::sort(folders.begin(), folders.end());
    const size_t before = l.files.size();
    for (const auto& [folder, names] : folders) {
      for (const std::string& n : names) {
        std::string file = absl::StrCat(folder, "/", n);
        if (!IsImageName(n)) {
          if (l.unlisted_examples.size() < kUnlistedExamples) l.unlisted_examples.push_back(std::move(file));
          ++l.unlisted;
          continue;
        }
        l.files.push_back(std::move(file));
        l.labels.push_back(static_cast<int64_t>(c));
      }
    }
    if (l.files.size() == before) empty.push_back(l.classes[c]);
  }
  // torchvision refuses a class without images too ("Found no valid file
  // for the classes ..."): its label would never be trained on.
  if (!empty.empty()) {
    constexpr size_t kNamed = 5;
    std::string named = absl::StrJoin(empty.begin(), empty.begin() + std::min(kNamed, empty.size()), ", ");
    if (empty.size() > kNamed) absl::StrAppend(&named, " and ", empty.size() - kNamed, " more");
    std::string others;
    if (l.unlisted > 0) {
      others = absl::StrCat("; ", l.unlisted, " files of other types are not read, e.g. ",
                            absl::StrJoin(l.unlisted_examples, ", "));
    }
    return absl::InvalidArgumentError(absl::StrCat(root.string(), ": class folders with no image (", empty.size(),
                                                   " of ", l.classes.size(), ": ", named,
                                                   "): remove them, or add images to them (", kImageKinds, ")",
                                                   others));
  }
  return l;
}

// Where a split's files are and which of them it takes.
struct SplitPlace {
  fs::path root;  // the folder its files are named relative to
  enum class Part { kAll, kKept, kHeldOut } part = Part::kAll;
  std::string what;  // the layout, for errors
  // What the listing cache checks it lists.
  std::string Key(double fraction) const {
    switch (part) {
      case Part::kKept:
        return absl::StrCat(root.string(), " less val-fraction ", fraction);
      case Part::kHeldOut:
        return absl::StrCat(root.string(), " val-fraction ", fraction);
      case Part::kAll:
        break;
    }
    return root.string();
  }
};

}  // namespace

absl::Status CheckValFraction(const std::string& dir, double val_fraction) {
  std::error_code ec;
  const fs::path top = fs::absolute(fs::path(dir), ec).lexically_normal();
  if (val_fraction > 0 && fs::is_directory(top / "val", ec)) {
    return absl::InvalidArgumentError(absl::StrCat(
        top.string(), " has val/: a val fraction holds training images out only where there is no val/ folder "
        "(drop it, or the val/ folder)"));
  }
  return absl::OkStatus();
}

namespace {

absl::StatusOr<SplitPlace> PlaceSplit(const std::string& dir, const std::string& split, double fraction) {
  if (!(fraction >= 0 && fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("image folder ", dir, ": a val fraction of ", fraction,
                                                   " (it must be in [0, 1))"));
  }
  const fs::path top = fs::absolute(fs::path(dir)).lexically_normal();
  std::error_code ec;
  if (split != "train" && split != "val") {
    if (!fs::is_directory(top / split, ec)) {
      return absl::NotFoundError(absl::StrCat("no folder ", (top / split).string(), ": an image folder holds ", split,
                                              "/<class>/<image> files (torchvision's ImageFolder layout)"));
    }
    return SplitPlace{top / split, SplitPlace::Part::kAll, split + "/<class>/<image> files"};
  }
  if (!fs::is_directory(top, ec)) {
    return absl::NotFoundError(absl::StrCat("no folder ", top.string(), ": an image folder holds train/<class>/"
                                            "<image> and val/<class>/<image> files, or <class>/<image> files"));
  }
  const bool has_train = fs::is_directory(top / "train", ec), has_val = fs::is_directory(top / "val", ec);
  RETURN_IF_ERROR(CheckValFraction(top.string(), fraction));
  SplitPlace place;
  place.root = has_train ? top / "train" : top;
  place.what = has_train ? "train/<class>/<image> files" : "<class>/<image> files, torchvision's ImageFolder layout";
  if (split == "train") {
    if (has_val && !has_train) {  // (its class folders cannot be told from val/)
      return absl::InvalidArgumentError(absl::StrCat(top.string(), " has val/ but no train/: training images go in ",
                                                     (top / "train").string(), "/<class>/<image>"));
    }
    if (fraction > 0) place.part = SplitPlace::Part::kKept;
    return place;
  }
  if (has_val) return SplitPlace{top / "val", SplitPlace::Part::kAll, "val/<class>/<image> files"};
  if (fraction == 0) {
    return absl::NotFoundError(absl::StrCat("no folder ", (top / "val").string(),
                                            ": no validation images (add val/<class>/<image> files, or hold a "
                                            "fraction of the training images out: --val-fraction)"));
  }
  place.part = SplitPlace::Part::kHeldOut;
  return place;
}

// Whether the file `name` ("class/file") is among the fraction held out as
// validation: from a hash of its name alone, so every process and every
// run holds out the same files, and adding images moves no other.
bool HeldOut(const std::string& name, double fraction) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, then mixed
  for (const unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return static_cast<double>(Mix(h, 0, 0) >> 11) * 0x1.0p-53 < fraction;
}

// The listing of `place`: all of its folder, or the part kept or held out.
absl::StatusOr<ImageListing> ListPlace(const SplitPlace& place, double fraction) {
  ASSIGN_OR_RETURN(ImageListing all, ListClassFolders(place.root, place.what));
  if (place.part == SplitPlace::Part::kAll) return all;
  const bool want_held = place.part == SplitPlace::Part::kHeldOut;
  ImageListing l;
  l.classes = all.classes;
  l.unlisted = all.unlisted;  // (the whole folder's)
  l.unlisted_examples = all.unlisted_examples;
  for (size_t i = 0; i < all.files.size(); ++i) {
    if (HeldOut(all.files[i], fraction) != want_held) continue;
    l.files.push_back(std::move(all.files[i]));
    l.labels.push_back(all.labels[i]);
  }
  if (l.files.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a val fraction of ", fraction, " of the ", all.files.size(), " images in ", place.root.string(),
        want_held ? " holds out none of them: raise it, or add a val/ folder" : " holds out all of them: lower it"));
  }
  return l;
}

}  // namespace

absl::StatusOr<ImageListing> ListImageFolder(const std::string& dir, const std::string& split, double val_fraction) {
  ASSIGN_OR_RETURN(SplitPlace place, PlaceSplit(dir, split, val_fraction));
  return ListPlace(place, val_fraction);
}

absl::StatusOr<ImageListing> ListImageFolderCached(const std::string& dir, const std::string& split,
                                                   double val_fraction, const std::string& cache,
                                                   std::string* root) {
  ASSIGN_OR_RETURN(SplitPlace place, PlaceSplit(dir, split, val_fraction));
  *root = place.root.string();
  const std::string key = place.Key(val_fraction);
  if (!cache.empty()) {
    if (std::optional<ImageListing> cached = ReadListing(cache, key)) return *std::move(cached);
  }
  ASSIGN_OR_RETURN(ImageListing scanned, ListPlace(place, val_fraction));
  if (!cache.empty()) WriteListing(cache, key, scanned);
  return scanned;
}

}  // namespace remora::data
