// data::ImageFolder (data/imagefolder.h): the pool of decoding threads,
// the crops. The listing: data/image_listing.cc.
#include "data/imagefolder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/tensor.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "data/mix.h"

namespace remora::data {
namespace {

constexpr double kMean[3] = {0.485, 0.456, 0.406};
constexpr double kStd[3] = {0.229, 0.224, 0.225};

// Uniform doubles in [0, 1) from a splitmix64 stream.
class Draws {
 public:
  explicit Draws(uint64_t state) : state_(state) {}
  double Uniform() {
    state_ += 0x9e3779b97f4a7c15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return static_cast<double>(z >> 11) * 0x1.0p-53;
  }
  double Uniform(double lo, double hi) { return lo + (hi - lo) * Uniform(); }
  int64_t Int(int64_t lo, int64_t hi) {  // [lo, hi]
    return lo + std::min<int64_t>(hi - lo, static_cast<int64_t>(Uniform() * static_cast<double>(hi - lo + 1)));
  }

 private:
  uint64_t state_;
};

// torchvision's RandomResizedCrop.get_params: ten tries at an area of
// scale 0.08-1 and a log-uniform aspect ratio 3/4-4/3, else the centre
// crop of the ratio clamped into that range.
Region RandomResizedCrop(int width, int height, Draws& d) {
  const double area = static_cast<double>(width) * height;
  const double log_lo = std::log(3.0 / 4.0), log_hi = std::log(4.0 / 3.0);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target = area * d.Uniform(0.08, 1.0);
    const double ratio = std::exp(d.Uniform(log_lo, log_hi));
    const int64_t w = std::llround(std::sqrt(target * ratio));
    const int64_t h = std::llround(std::sqrt(target / ratio));
    if (w > 0 && h > 0 && w <= width && h <= height) {
      const int64_t y = d.Int(0, height - h), x = d.Int(0, width - w);
      return {static_cast<double>(x), static_cast<double>(y), static_cast<double>(w), static_cast<double>(h)};
    }
  }
  const double in_ratio = static_cast<double>(width) / height;
  double w = width, h = height;
  if (in_ratio < 3.0 / 4.0) {
    h = std::round(w / (3.0 / 4.0));
  } else if (in_ratio > 4.0 / 3.0) {
    w = std::round(h * (4.0 / 3.0));
  }
  return {std::floor((width - w) / 2), std::floor((height - h) / 2), w, h};
}

// Resampling from a span of input pixels [start, start + len) to `total`
// output pixels, of which outputs [skip, skip + n) are made: output i
// reads count[i] inputs from first[i], weighted by w[i * stride + k]. A
// triangle (bilinear) filter, widened by the downscale factor so that
// every input pixel counts (antialiasing), and cut at the span's edges as
// if the span had been cropped out first: what torchvision's
// RandomResizedCrop computes (crop, then PIL's or ATen's antialiased
// bilinear resize).
struct Taps {
  std::vector<int> first, count;
  std::vector<float> w;
  int stride = 0;
};

Taps MakeTaps(double start, double len, int in_size, int total, int skip, int n) {
  Taps t;
  const double scale = len / total;
  const double support = std::max(scale, 1.0);
  t.stride = static_cast<int>(std::ceil(support)) * 2 + 1;
  t.first.resize(n);
  t.count.resize(n);
  t.w.assign(static_cast<size_t>(n) * t.stride, 0.f);
  const int edge_lo = std::max(0, static_cast<int>(std::floor(start + 1e-9)));
  const int edge_hi = std::min(in_size, static_cast<int>(std::ceil(start + len - 1e-9)));
  for (int i = 0; i < n; ++i) {
    const double center = start + (skip + i + 0.5) * scale;
    const int lo = std::max(edge_lo, static_cast<int>(std::floor(center - support + 0.5)));
    const int hi = std::min({edge_hi, static_cast<int>(std::floor(center + support + 0.5)), lo + t.stride});
    auto triangle = [center, support](int x) { return std::max(0.0, 1.0 - std::abs((x - center + 0.5) / support)); };
    float* w = t.w.data() + static_cast<size_t>(i) * t.stride;
    double sum = 0;
    for (int x = lo; x < hi; ++x) sum += triangle(x);
    for (int x = lo; x < hi; ++x) w[x - lo] = static_cast<float>(triangle(x) / sum);
    t.first[i] = lo;
    t.count[i] = std::max(0, hi - lo);
  }
  return t;
}

// The file at `path` into `bytes` (its memory reused).
absl::Status ReadFileInto(const std::string& path, std::string* bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  struct stat st;
  absl::Status status;
  if (::fstat(fd, &st) != 0) {
    status = absl::InternalError(absl::StrCat("cannot stat ", path, ": ", std::strerror(errno)));
  } else {
    bytes->resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < bytes->size()) {
      const ssize_t n = ::read(fd, bytes->data() + got, bytes->size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        status = absl::DataLossError(absl::StrCat("cannot read ", path, ": ",
                                                  n < 0 ? std::strerror(errno) : "shorter than its size"));
        break;
      }
      got += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  return status;
}

// Memory one decoding thread keeps from image to image, so that an image
// costs no allocation (and no page faults) for its buffers.
struct Scratch {
  std::string bytes;       // the file
  Rgb rgb;                 // its decoded region
  std::vector<float> row;  // one output row after the vertical pass
};

// Four floats in one SIMD register (GCC's and Clang's vector extension;
// plain code where the target has none).
typedef float Float4 __attribute__((vector_size(16)));

// One output row of the horizontal pass: s pixels from `acc` (a row of
// interleaved RGB floats starting at column x0), each over all the
// stride's taps (the weights past an output's count are zero, and `acc`
// is padded so that reading under them is safe), normalised (v * scale +
// bias) and stored into the three planes of `out`. kTaps is the stride
// where known at compile time (loops unrolled), else 0. Each tap is one
// 4-wide multiply-add: R, G, B and the next pixel's R, which is dropped.
template <int kTaps>
void HorizontalRow(const float* acc, const Taps& tx, int x0, int s, bool flip, Float4 scale, Float4 bias,
                   float* out, size_t plane) {
  const int taps = kTaps > 0 ? kTaps : tx.stride;
  for (int i = 0; i < s; ++i) {
    const float* w = tx.w.data() + static_cast<size_t>(i) * taps;
    const float* p = acc + static_cast<size_t>(tx.first[i] - x0) * 3;
    Float4 v = {0, 0, 0, 0};
    for (int k = 0; k < taps; ++k) {
      Float4 pixel;
      std::memcpy(&pixel, p + 3 * k, sizeof(pixel));
      v += w[k] * pixel;
    }
    // The weights are non-negative and sum to one, so v stays within its
    // inputs' 0-255 (to float rounding): no clamp.
    v = v * scale + bias;
    const int at = flip ? s - 1 - i : i;
    for (int c = 0; c < 3; ++c) out[c * plane + at] = v[c];
  }
}

// `box` (in the file's pixels) of `rgb` (decoded at rgb.full_width /
// width of the file's size) resized to out_w x out_h, of which the centre
// s x s is kept, flipped left to right if asked, normalised, into the
// float planes [3, s, s] at `dst`. Vertical pass first, one output row at
// a time over the columns the horizontal pass reads: its inner loop runs
// along contiguous bytes (vectorised), leaving the horizontal pass only
// s rows to resample.
void CropResize(const Rgb& rgb, int width, int height, const Region& box, int out_w, int out_h, int s, bool flip,
                float* dst, std::vector<float>& row) {
  // The box in the decoded region's pixels.
  const double sx = static_cast<double>(rgb.full_width) / width, sy = static_cast<double>(rgb.full_height) / height;
  const int skip_x = (out_w - s) / 2, skip_y = (out_h - s) / 2;
  const Taps tx = MakeTaps(box.x * sx - rgb.x0, box.w * sx, rgb.width, out_w, skip_x, s);
  const Taps ty = MakeTaps(box.y * sy - rgb.y0, box.h * sy, rgb.height, out_h, skip_y, s);
  int x0 = rgb.width, x1 = 0;
  for (int i = 0; i < s; ++i) {
    x0 = std::min(x0, tx.first[i]);
    x1 = std::max(x1, tx.first[i] + tx.count[i]);
  }
  const int span = std::max(0, x1 - x0) * 3;
  row.resize(static_cast<size_t>(span + tx.stride * 3 + 1));  // the padding HorizontalRow reads
  Float4 scale = {0, 0, 0, 0}, bias = {0, 0, 0, 0};  // (v / 255 - mean) / std = v * scale + bias
  for (int c = 0; c < 3; ++c) {
    scale[c] = static_cast<float>(1.0 / (255.0 * kStd[c]));
    bias[c] = static_cast<float>(-kMean[c] / kStd[c]);
  }
  const size_t plane = static_cast<size_t>(s) * s;
  for (int j = 0; j < s; ++j) {
    std::fill(row.begin(), row.end(), 0.f);
    float* acc = row.data();
    for (int k = 0; k < ty.count[j]; ++k) {
      const float w = ty.w[static_cast<size_t>(j) * ty.stride + k];
      const uint8_t* in = rgb.pixels.data() + (static_cast<size_t>(ty.first[j] + k) * rgb.width + x0) * 3;
      for (int x = 0; x < span; ++x) acc[x] += w * in[x];
    }
    float* out = dst + static_cast<size_t>(j) * s;
    switch (tx.stride) {  // 3: enlarging; 5: shrinking up to 2x; 7: up to 3x
      case 3:
        HorizontalRow<3>(acc, tx, x0, s, flip, scale, bias, out, plane);
        break;
      case 5:
        HorizontalRow<5>(acc, tx, x0, s, flip, scale, bias, out, plane);
        break;
      case 7:
        HorizontalRow<7>(acc, tx, x0, s, flip, scale, bias, out, plane);
        break;
      default:
        HorizontalRow<0>(acc, tx, x0, s, flip, scale, bias, out, plane);
    }
  }
}

// Reads, decodes, crops and resizes the image at `path` (row `id` of the
// listing) into `dst`, 3 x s x s floats for s = options.image_size.
absl::Status MakeImage(const std::string& path, int64_t id, int epoch, const ImageFolderOptions& options,
                       Scratch& scratch, float* dst) {
  const int64_t s = options.image_size;
  RETURN_IF_ERROR(ReadFileInto(path, &scratch.bytes));
  ASSIGN_OR_RETURN(const auto size, ImageSize(scratch.bytes, path));
  const int width = size.first, height = size.second;
  TrainingCrop crop;
  int64_t out_w = s, out_h = s;
  if (options.train) {
    crop = DrawTrainingCrop(width, height, options.seed, epoch, id);
  } else {
    // The short side to s / 0.875 (256 for 224), then the centre s x s.
    const int64_t target = std::llround(static_cast<double>(s) / 0.875);
    const double scale = static_cast<double>(target) / std::min(width, height);
    out_w = std::max<int64_t>(s, std::llround(width * scale));
    out_h = std::max<int64_t>(s, std::llround(height * scale));
    crop.box = {0, 0, static_cast<double>(width), static_cast<double>(height)};
  }
  const Region& box = crop.box;
  // Decode no larger than the crop needs (JPEG's DCT scaling).
  const int min_w = static_cast<int>(std::min<double>(width, std::ceil(out_w * width / box.w)));
  const int min_h = static_cast<int>(std::min<double>(height, std::ceil(out_h * height / box.h)));
  // Only the rows and columns the crop reads (its filter's reach around it).
  const double reach = std::max(box.w / out_w, box.h / out_h);
  RETURN_IF_ERROR(DecodeImageInto(scratch.bytes, path, min_w, min_h, box,
                                  static_cast<int>(std::ceil(std::max(reach, 1.0))) + 2, &scratch.rgb));
  CropResize(scratch.rgb, width, height, box, static_cast<int>(out_w), static_cast<int>(out_h),
             static_cast<int>(s), crop.flip, dst, scratch.row);
  return absl::OkStatus();
}

}  // namespace

// Runs ForEach's jobs on its threads and the caller's. Thread-safe; jobs
// from several callers queue up and run in turn. Owns its threads: the
// destructor joins them (no ForEach may still run).
class ImageFolder::Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 0; i < threads - 1; ++i) threads_.emplace_back([this] { Serve(); });
  }
  ~Pool() {
    {
      base::MutexLock lock(mu_);
      stop_ = true;
    }
    wake_.SignalAll();
    for (auto& t : threads_) t.join();
  }

  // Runs fn(0) ... fn(n - 1), each once, on any of the threads; returns
  // when all have run.
  void ForEach(int64_t n, const std::function<void(int64_t)>& fn) {
    auto job = std::make_shared<Job>();
    job->n = n;
    job->fn = &fn;
    {
      base::MutexLock lock(mu_);
      jobs_.push_back(job);
    }
    wake_.SignalAll();
    Work(*job);
    base::MutexLock lock(mu_);
    while (job->finished.load() != n) done_.Wait(&mu_);
  }

 private:
  struct Job {
    int64_t n = 0;
    const std::function<void(int64_t)>* fn = nullptr;
    std::atomic<int64_t> next{0};      // the next index to take
    std::atomic<int64_t> finished{0};  // indices run
  };

  // Takes indices of `job` until none are left. (The last one signals
  // under mu_, so a ForEach that saw too few finished is already waiting.)
  void Work(Job& job) {
    for (int64_t i; (i = job.next.fetch_add(1)) < job.n;) {
      (*job.fn)(i);
      if (job.finished.fetch_add(1) + 1 == job.n) {
        base::MutexLock lock(mu_);
        done_.SignalAll();
      }
    }
  }

  void Serve() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        base::MutexLock lock(mu_);
        for (;;) {
          while (!jobs_.empty() && jobs_.front()->next.load() >= jobs_.front()->n) jobs_.pop_front();
          if (stop_ || !jobs_.empty()) break;
          wake_.Wait(&mu_);
        }
        if (stop_) return;
        job = jobs_.front();
      }
      Work(*job);
    }
  }

  absl::Mutex mu_;
  absl::CondVar wake_, done_;
  std::deque<std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

ImageFolder::ImageFolder(std::string root, ImageListing listing, ImageFolderOptions options)
    : root_(std::move(root)),
      listing_(std::move(listing)),
      options_(std::move(options)),
      pool_(std::make_unique<Pool>(std::max(1, options_.threads))) {}

ImageFolder::~ImageFolder() = default;

absl::StatusOr<std::unique_ptr<ImageFolder>> ImageFolder::Open(const std::string& dir, const std::string& split,
                                                               const ImageFolderOptions& options) {
  if (options.image_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("image folder: image size ", options.image_size));
  }
  std::string root;
  ASSIGN_OR_RETURN(ImageListing listing,
                   ListImageFolderCached(dir, split, options.val_fraction, options.listing_cache, &root));
  return std::unique_ptr<ImageFolder>(new ImageFolder(std::move(root), std::move(listing), options));
}

absl::StatusOr<Batch> ImageFolder::Get(const at::Tensor& rows, int epoch) const {
  const at::Tensor index = rows.to(at::kLong).contiguous();
  const int64_t n = index.numel();
  const int64_t* ids = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    if (ids[r] < 0 || ids[r] >= size()) {
      return absl::OutOfRangeError(absl::StrCat("image folder ", root_, ": row ", ids[r], " of ", size()));
    }
  }
  const int64_t s = options_.image_size;
  // Each image is made in its place in the batch.
  Batch batch;
  batch.images = BatchMemory(n);
  float* images = batch.images.data_ptr<float>();
  std::vector<absl::Status> errors(n);
  pool_->ForEach(n, [&](int64_t r) {
    thread_local Scratch scratch;
    // A rare huge photo's buffers are not kept by every thread for good.
    constexpr size_t kKeep = size_t{32} << 20;
    if (scratch.bytes.capacity() > kKeep) std::string().swap(scratch.bytes);
    if (scratch.rgb.pixels.capacity() > kKeep) std::vector<uint8_t>().swap(scratch.rgb.pixels);
    const int64_t id = ids[r];
    const std::string path = absl::StrCat(root_, "/", listing_.files[id]);
    try {
      errors[r] = MakeImage(path, id, epoch, options_, scratch, images + r * 3 * s * s);
    } catch (...) {
      errors[r] = base::StatusFromCurrentException(absl::StrCat("decoding ", path));
    }
  });
  std::vector<int64_t> labels, kept;
  for (int64_t r = 0; r < n; ++r) {
    if (!errors[r].ok()) {
      if (!options_.skip_bad_images) {
        return absl::Status(errors[r].code(),
                            absl::StrCat(errors[r].message(), " (give --skip-bad-images to leave such files out)"));
      }
      ++batch.skipped;
      continue;
    }
    kept.push_back(r);
    labels.push_back(listing_.labels[ids[r]]);
  }
  if (batch.skipped > 0) batch.images = batch.images.index_select(0, at::tensor(kept, at::kLong));
  batch.labels = at::tensor(labels, at::kLong);
  return batch;
}

at::Tensor ImageFolder::BatchMemory(int64_t n) const {
  constexpr size_t kKept = 6;  // batches in flight: prefetched, being split, saved for backward
  const int64_t s = options_.image_size;
  // No tensor but recent_'s own refers to the memory any more.
  auto unused = [](const at::Tensor& t) { return t.storage().use_count() == 1; };
  base::MutexLock lock(recent_mu_);
  // Free memory of another batch size (an epoch's short last batch) is
  // not kept for later: only sizes in use stay held.
  recent_.erase(std::remove_if(recent_.begin(), recent_.end(),
                               [&](const at::Tensor& t) { return t.size(0) != n && unused(t); }),
                recent_.end());
  // Each batch gets its own tensor (an alias of the memory), so what a
  // caller does to its shape stays with it.
  for (const at::Tensor& t : recent_) {
    if (t.size(0) == n && unused(t)) return t.alias();
  }
  at::Tensor fresh = at::empty({n, 3, s, s}, at::kFloat);
  if (recent_.size() == kKept) recent_.erase(recent_.begin());
  recent_.push_back(fresh);
  return fresh.alias();
}

TrainingCrop DrawTrainingCrop(int width, int height, uint64_t seed, int epoch, int64_t index) {
  Draws d(Mix(seed, static_cast<uint64_t>(epoch), static_cast<uint64_t>(index)));
  TrainingCrop crop;
  crop.box = RandomResizedCrop(width, height, d);
  crop.flip = d.Uniform() < 0.5;
  return crop;
}

}  // namespace remora::data
