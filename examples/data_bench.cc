// data_bench: how fast an image folder is read, decoded and augmented.
// Reads --batches batches of --batch-size rows of DIR/train (the training
// recipe at --image-size) with each --threads count, after one batch of
// warm-up (the page cache then holds the files read), and prints images
// per second and per thread. scripts/imagefolder_bench.sh writes a folder
// of photo-sized JPEGs and compares with torchvision's ImageFolder and
// DataLoader on the same files.
//
//   data_bench --dataset imagefolder:/data/imagenet --data-threads 1,2 --batches 8 --batch-size 64
#include <chrono>
#include <cstdio>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "data/imagefolder.h"
#include "launch/cli.h"

int main(int argc, char** argv) {
  std::string dataset, dir, threads_list = "1,2", data_threads;
  int batches = 8, batch_size = 64, image_size = 224;
  bool skip_bad_images = false;
  remora::launch::FlagParser flags("data_bench",
                                "Images per second of an image folder's training reads (decode, random resized "
                                "crop, flip, normalise), per decoding thread count.");
  flags.JoinsNoGroup();
  flags.AddString("dataset", &dataset,
                  "imagefolder:DIR, the image folder (DIR/train/<class>/*.jpg, or DIR/<class>/*.jpg)");
  flags.AddString("data-threads", &data_threads, "decoding thread counts to measure, comma-separated (default 1,2)");
  flags.AddString("dir", &dir, "DIR: the same as --dataset imagefolder:DIR");
  flags.AddString("threads", &threads_list, "the same as --data-threads");
  flags.AddInt("batches", &batches, "measured batches per thread count");
  flags.AddInt("batch-size", &batch_size, "rows per batch");
  flags.AddInt("image-size", &image_size, "crop side");
  flags.AddBool("skip-bad-images", &skip_bad_images,
                "leave files that cannot be decoded out of their batch (else the first one is an error)");
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  if (!dataset.empty()) {
    absl::string_view folder = dataset;
    if (!absl::ConsumePrefix(&folder, "imagefolder:") || folder.empty()) {
      std::fprintf(stderr, "data_bench: --dataset wants imagefolder:DIR (DIR/train/<class>/*.jpg)\n");
      return 2;
    }
    if (!dir.empty() && dir != folder) {
      std::fprintf(stderr, "data_bench: --dir %s and --dataset %s name two folders: give one\n", dir.c_str(),
                   dataset.c_str());
      return 2;
    }
    dir = std::string(folder);
  }
  const char* const threads_flag = data_threads.empty() ? "--threads" : "--data-threads";
  if (!data_threads.empty()) threads_list = data_threads;
  std::vector<int> thread_counts;
  for (absl::string_view t : absl::StrSplit(threads_list, ',')) {
    int n = 0;
    if (!absl::SimpleAtoi(t, &n) || n < 1 || n > 256) {
      std::fprintf(stderr, "data_bench: %s wants integers in [1, 256]; got '%s'\n", threads_flag,
                   threads_list.c_str());
      return 2;
    }
    thread_counts.push_back(n);
  }
  if (image_size < 16 || image_size > 1024) {  // (as master's --image-size)
    std::fprintf(stderr, "data_bench: --image-size must be in [16, 1024]; got %d\n", image_size);
    return 2;
  }
  if (dir.empty()) {
    std::fprintf(stderr, "data_bench: --dataset imagefolder:DIR is required\n");
    return 2;
  }
  if (auto s = remora::launch::CheckAtLeast({{"batches", batches, 1}, {"batch-size", batch_size, 1}}); !s.ok()) {
    std::fprintf(stderr, "data_bench: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  at::set_num_threads(1);  // the pool's threads are the parallelism measured
  for (int threads : thread_counts) {
    remora::data::ImageFolderOptions o;
    o.image_size = image_size;
    o.threads = threads;
    o.skip_bad_images = skip_bad_images;
    auto set = remora::data::ImageFolder::Open(dir, "train", o);
    if (!set.ok()) {
      std::fprintf(stderr, "data_bench: %s\n", std::string(set.status().message()).c_str());
      return 1;
    }
    const int64_t n = (*set)->size();
    auto rows = [&](int b) { return at::arange(int64_t{b} * batch_size, int64_t{b + 1} * batch_size, at::kLong) % n; };
    if (auto warm = (*set)->Get(rows(0), 1); !warm.ok()) {
      std::fprintf(stderr, "data_bench: %s\n", std::string(warm.status().message()).c_str());
      return 1;
    }
    const auto t0 = std::chrono::steady_clock::now();
    int64_t images = 0, skipped = 0;  // (skipped files are not counted as read)
    for (int b = 1; b <= batches; ++b) {
      auto got = (*set)->Get(rows(b), 1);
      if (!got.ok()) {
        std::fprintf(stderr, "data_bench: %s\n", std::string(got.status().message()).c_str());
        return 1;
      }
      images += got->labels.size(0);
      skipped += got->skipped;
    }
    if (images == 0 && skipped > 0) {
      std::fprintf(stderr, "data_bench: no image of %s could be read: all %lld were skipped as unreadable "
                   "(--skip-bad-images); check its files\n", dir.c_str(), static_cast<long long>(skipped));
      return 1;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double ips = images / s;
    std::printf("threads=%d images=%lld seconds=%.3f images_per_second=%.1f per_thread=%.1f%s\n", threads,
                static_cast<long long>(images), s, ips, ips / threads,
                skipped > 0 ? absl::StrCat(" skipped_images=", skipped).c_str() : "");
    std::fflush(stdout);
  }
  return 0;
}
