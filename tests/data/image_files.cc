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

namespace {

// `pixels` (w x h, `components` bytes each, in `space`) as a JPEG of
// `quality` at `path`; `configure` adjusts the defaults before it starts.
void WriteJpegOf(const std::string& path, int w, int h, const std::vector<uint8_t>& pixels, int components,
                 J_COLOR_SPACE space, int quality, const std::function<void(jpeg_compress_struct*)>& configure) {
  ASSERT_EQ(pixels.size(), static_cast<size_t>(w) * h * components) << path;
  jpeg_compress_struct cinfo;
  jpeg_error_mgr err;
  cinfo.err = jpeg_std_error(&err);
  jpeg_create_compress(&cinfo);
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  jpeg_stdio_dest(&cinfo, f);
  cinfo.image_width = w;
  cinfo.image_height = h;
  cinfo.input_components = components;
  cinfo.in_color_space = space;
  jpeg_set_defaults(&cinfo);
  configure(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(pixels.data()) + static_cast<size_t>(cinfo.next_scanline) * w * components;
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::fclose(f);
}

}  // namespace

void WriteJpeg(const std::string& path, int w, int h, const std::vector<uint8_t>& rgb, int quality) {
  WriteJpegOf(path, w, h, rgb, 3, JCS_RGB, quality, [](jpeg_compress_struct*) {});
}

void WriteCmykJpeg(const std::string& path, int w, int h, const std::vector<uint8_t>& cmyk, CmykJpeg kind,
                   int quality) {
  // libjpeg's defaults for CMYK: CMYK out, with an Adobe marker.
  WriteJpegOf(path, w, h, cmyk, 4, JCS_CMYK, quality, [kind](jpeg_compress_struct* cinfo) {
    if (kind == CmykJpeg::kAdobeYcck) jpeg_set_colorspace(cinfo, JCS_YCCK);
    if (kind == CmykJpeg::kNoMarker) cinfo->write_Adobe_marker = FALSE;
  });
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
