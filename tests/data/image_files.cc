// Images written for the image folder tests (tests/data/image_files.h).
#include "tests/data/image_files.h"

#include <jpeglib.h>
#include <png.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace remora::test_images {

namespace fs = std::filesystem;

std::string FreshImageDir(const std::string& name) {
  const std::string dir = absl::StrCat(testing::TempDir(), "/remora_imagefolder_", getpid(), "_", name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

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

void WriteJpeg(const std::string& path, int w, int h, const std::vector<uint8_t>& rgb, int quality) {
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

void WriteCmykJpeg(const std::string& path, int w, int h, const std::vector<uint8_t>& cmyk, CmykJpeg kind,
                   int quality) {
  ASSERT_EQ(cmyk.size(), static_cast<size_t>(w) * h * 4) << path;
  jpeg_compress_struct cinfo;
  jpeg_error_mgr err;
  cinfo.err = jpeg_std_error(&err);
  jpeg_create_compress(&cinfo);
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  jpeg_stdio_dest(&cinfo, f);
  cinfo.image_width = w;
  cinfo.image_height = h;
  cinfo.input_components = 4;
  cinfo.in_color_space = JCS_CMYK;
  jpeg_set_defaults(&cinfo);  // CMYK out, with an Adobe marker
  if (kind == CmykJpeg::kAdobeYcck) jpeg_set_colorspace(&cinfo, JCS_YCCK);
  if (kind == CmykJpeg::kNoMarker) cinfo.write_Adobe_marker = FALSE;
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(cmyk.data()) + static_cast<size_t>(cinfo.next_scanline) * w * 4;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::fclose(f);
}

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

}  // namespace remora::test_images
