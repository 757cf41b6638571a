// Image folders as torchvision's ImageFolder lays them out, read from disk
// as batches need them: DIR/train/<class>/*.jpg|*.jpeg|*.png and
// DIR/val/<class>/... (ImageNet's layout), or DIR/<class>/... alone (the
// training images; ImageFolder(root)), classes numbered in name order, a
// class's images in its subfolders too (ListImageFolder says what is
// listed and what is skipped).
// Where there is no val/ folder, a fraction of the training images can be
// held out as the "val" split, chosen by a hash of each file's name (the
// same files in every process and every run). Files are decoded (JPEG through libjpeg-turbo,
// scaled down in the DCT where the crop allows; PNG through libpng) and
// augmented by a pool of threads: training takes the ImageNet recipe's
// random resized crop (scale 0.08-1, ratio 3/4-4/3) to `image_size` and a
// horizontal flip; evaluation resizes the short side to image_size / 0.875
// and takes the centre crop; both normalise by ImageNet's mean and std.
// The augmentation of row i in epoch e is drawn from (seed, e, i) alone,
// so a batch is the same whichever thread makes it and whenever, and a
// resumed run sees what an uninterrupted one saw.
//
//   data::ImageFolderOptions o;
//   o.image_size = 224;
//   o.threads = 8;
//   auto train = data::ImageFolder::Open("/data/imagenet", "train", o).value();
//   data::Batch b = train->Get(rows, epoch).value();   // [n, 3, 224, 224]
//
// Thread-safety: Get may be called from several threads at once; they
// share the pool. A batch's images are written into memory of an earlier
// batch that nobody holds any more (not a view, not a copy of the
// tensor), so a steady loop does not fault in fresh pages every batch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "data/source.h"

namespace remora::data {

struct ImageFolderOptions {
  int64_t image_size = 224;  // the square side of every image out
  bool train = true;         // the training recipe; else evaluation's
  int threads = 4;           // decoding and augmenting threads
  uint64_t seed = 0;
  // Leave unreadable files out of their batch (counted in Batch::skipped)
  // instead of failing the batch naming the file.
  bool skip_bad_images = false;
  // Where to keep the listing (empty: nowhere): read when it is there and
  // lists this folder, else written after the scan, so a restarted run
  // does not list a million files again.
  std::string listing_cache;
  // Where DIR has no val/ folder: the fraction of the training images held
  // out as "val" (and left out of "train"); 0: none.
  double val_fraction = 0;
};

// A SourceSpec's image-folder options (data/source.h).
ImageFolderOptions FolderOptions(const SourceSpec& spec);

// What was found: classes in name order, and every image with its class.
struct ImageListing {
  std::vector<std::string> classes;
  std::vector<std::string> files;  // relative to the split's folder: cat/x.jpg, cat/sub/y.png
  std::vector<int64_t> labels;
  // Files in the class folders that are not images by name (.bmp, .gif,
  // .txt ...), left out: how many, and the first few (relative names), so
  // that a folder of another format does not shrink a dataset unseen.
  // Hidden files are not counted.
  int64_t unlisted = 0;
  std::vector<std::string> unlisted_examples;
};

// Lists the split `split` of the image folder `dir` as torchvision's
// ImageFolder does: every folder in it is a class (in name order), and its
// images are the files with a .jpg, .jpeg or .png name (any case) in it and
// in its subfolders at any depth, folder by folder in path order and by
// name within one. Names starting with '.' (.DS_Store, .ipynb_checkpoints,
// macOS's ._x.jpg) are neither classes nor images; other files are counted
// in `unlisted`. "train" is DIR/train, else DIR itself, less what
// `val_fraction` holds out; "val" is DIR/val, else that held-out fraction;
// another name is DIR/<split>. NotFound when the split is not there (no
// val/ folder and no fraction); InvalidArgument when it has no class
// folders or a class folder without an image (torchvision refuses it too),
// or when a fraction is given beside a val/ folder.
absl::StatusOr<ImageListing> ListImageFolder(const std::string& dir, const std::string& split,
                                             double val_fraction = 0);

// ListImageFolder's listing, read from the listing cache file `cache`
// where it lists this split (empty: no cache), else scanned and written
// there, so a restarted run does not list a million files again; `root` is
// set to the folder the files are named relative to.
absl::StatusOr<ImageListing> ListImageFolderCached(const std::string& dir, const std::string& split,
                                                   double val_fraction, const std::string& cache,
                                                   std::string* root);

// InvalidArgument when `val_fraction` > 0 would hold images of the folder
// `dir` out though it has a val/ folder (checked before a run starts).
absl::Status CheckValFraction(const std::string& dir, double val_fraction);

class ImageFolder final : public Source {
 public:
  // The `split` ("train" or "val") of the image folder `dir` (as
  // ListImageFolder finds it, with options.val_fraction).
  static absl::StatusOr<std::unique_ptr<ImageFolder>> Open(const std::string& dir, const std::string& split,
                                                         const ImageFolderOptions& options);
  ~ImageFolder() override;

  int64_t size() const override { return static_cast<int64_t>(listing_.files.size()); }
  const std::vector<std::string>& classes() const { return listing_.classes; }
  // The files left out of the listing as not images (ImageListing::unlisted),
  // and the first few of their names.
  int64_t unlisted() const { return listing_.unlisted; }
  const std::vector<std::string>& unlisted_examples() const { return listing_.unlisted_examples; }
  const std::string& root() const { return root_; }
  // The rows' images, decoded and augmented for `epoch` (evaluation
  // ignores it). An unreadable file fails the batch naming it, unless
  // skip_bad_images.
  absl::StatusOr<Batch> Get(const at::Tensor& rows, int epoch) const override;

 private:
  class Pool;
  ImageFolder(std::string root, ImageListing listing, ImageFolderOptions options);

  // A [n, 3, s, s] float tensor for a batch's images: the memory of one
  // of recent_ that nothing else refers to, else new memory (kept in
  // recent_, which drops free memory of other batch sizes).
  at::Tensor BatchMemory(int64_t n) const;

  const std::string root_;  // the folder the listing's files are in (DIR/<split> or DIR)
  const ImageListing listing_;
  const ImageFolderOptions options_;
  std::unique_ptr<Pool> pool_;
  mutable absl::Mutex recent_mu_;
  mutable std::vector<at::Tensor> recent_ ABSL_GUARDED_BY(recent_mu_);  // the last few batches' images
};

// A region of an image in the file's pixels.
struct Region {
  double x = 0, y = 0, w = 0, h = 0;
};

// The training recipe's draw for row `index` in `epoch` of an image of
// width x height: the crop (whole pixels of the file; torchvision's
// RandomResizedCrop) and whether it is flipped left to right (its
// RandomHorizontalFlip), from (seed, epoch, index) alone.
struct TrainingCrop {
  Region box;
  bool flip = false;
};
TrainingCrop DrawTrainingCrop(int width, int height, uint64_t seed, int epoch, int64_t index);

// --- decoding (data/image_decode.cc) -----------------------------------------

// A decoded image, or a region of one: 8-bit RGB, rows of width * 3
// bytes, its top left corner at (x0, y0) of the whole image as decoded
// (full_width x full_height: the file's size, or less where the decoder
// scaled it down).
struct Rgb {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> pixels;
  int x0 = 0, y0 = 0;
  int full_width = 0, full_height = 0;
};

// The size of the JPEG or PNG image in `bytes` without decoding it.
absl::StatusOr<std::pair<int, int>> ImageSize(const std::string& bytes, const std::string& label);
// Decodes a JPEG or PNG image (by its first bytes, not its name; a CMYK or
// YCCK JPEG is converted to RGB as PIL converts it). For a
// JPEG, `min_width` x `min_height` lets the decoder scale down in the DCT,
// by 1/8, 1/4 or 1/2 (the scales libjpeg-turbo decodes with SIMD code;
// the others take longer than the whole size), as far as the result stays
// at least that large; the image out is then smaller than the file's.
// With `region` (w > 0), a JPEG decodes only the rows and block columns
// that cover it, `margin` decoded pixels around it included (the rest of
// the file is not decompressed); a PNG decodes whole. DataLoss naming
// `label` for a file that is neither or is damaged.
absl::StatusOr<Rgb> DecodeImage(const std::string& bytes, const std::string& label, int min_width = 0,
                                int min_height = 0, Region region = {}, int margin = 0);
// The same into `out`, whose pixel memory is reused.
absl::Status DecodeImageInto(const std::string& bytes, const std::string& label, int min_width, int min_height,
                             Region region, int margin, Rgb* out);

}  // namespace remora::data
