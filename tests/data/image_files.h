// Image folders written for tests, with libjpeg and libpng: fresh
// directories, images whose pixels a function gives, and class folders.
//
// Thread-safety: the functions are; they write only the paths given.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace remora::test_images {

// An empty directory TEST_TMPDIR/remora_imagefolder_<pid>_<name>.
std::string FreshImageDir(const std::string& name);

// An RGB image whose pixel (x, y) is fn(x, y, channel).
std::vector<uint8_t> Pixels(int w, int h, const std::function<int(int, int, int)>& fn);

// `rgb` (w x h, rows of w * 3 bytes) as a PNG, or a JPEG of `quality`, at
// `path`; a failure is a test failure.
void WritePng(const std::string& path, int w, int h, const std::vector<uint8_t>& rgb);
void WriteJpeg(const std::string& path, int w, int h, const std::vector<uint8_t>& rgb, int quality = 95);

// How WriteCmykJpeg stores its pixels.
enum class CmykJpeg {
  kAdobe,        // CMYK with Adobe's APP14 marker (libjpeg's default for CMYK)
  kNoMarker,     // CMYK without the marker
  kAdobeYcck,    // converted to YCCK (which needs the marker)
};

// `cmyk` (w x h, rows of w * 4 bytes, stored as given: Adobe's inverted
// values where the reader follows Adobe) as a JPEG at `path`.
void WriteCmykJpeg(const std::string& path, int w, int h, const std::vector<uint8_t>& cmyk, CmykJpeg kind,
                   int quality = 95);

// DIR/train/<classes[c]>/ and DIR/val/<classes[c]>/ with `train` and `val`
// 24 x 20 images per class, PNG and JPEG in turn; pixel (x, y, channel) of
// image i of class c is pixel(c, i, x, y, channel).
void WriteClassFolders(const std::string& dir, const std::vector<std::string>& classes, int train, int val,
                       const std::function<int(int, int, int, int, int)>& pixel);

}  // namespace remora::test_images
