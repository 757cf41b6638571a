// JPEG (libjpeg-turbo's libjpeg API) and PNG (libpng's simplified API)
// decoding to 8-bit RGB (data/imagefolder.h). libjpeg reports errors by a
// callback that must not return: it long-jumps back to the decoding
// function, whose locals are plain C values only; what it fills lives in
// the caller.
#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "data/imagefolder.h"

#if REMORA_HAVE_IMAGE_CODECS
#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>

#include <jpeglib.h>
#include <png.h>

namespace remora::data {
namespace {

struct JpegErrors {
  jpeg_error_mgr base;  // first: libjpeg sees a jpeg_error_mgr*
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void OnJpegError(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegErrors*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  std::longjmp(e->jump, 1);
}

void OnJpegWarning(j_common_ptr, int) {}  // corrupt-data warnings: the pixels decoded are kept

bool IsJpeg(const std::string& b) {
  return b.size() >= 3 && static_cast<uint8_t>(b[0]) == 0xFF && static_cast<uint8_t>(b[1]) == 0xD8 &&
         static_cast<uint8_t>(b[2]) == 0xFF;
}

bool IsPng(const std::string& b) {
  return b.size() >= 8 && png_sig_cmp(reinterpret_cast<png_const_bytep>(b.data()), 0, 8) == 0;
}

// `width` CMYK pixels as libjpeg decodes them to RGB, as PIL (and so
// torchvision) does: the values taken as inverted, as Adobe's software
// writes them (nearly every CMYK JPEG there is), whether or not the file
// has Adobe's marker; PIL, OpenCV and Chrome all assume so. R = C * K / 255
// (G from M, B from Y), rounded as PIL rounds.
void CmykToRgb(const JSAMPLE* cmyk, int width, uint8_t* rgb) {
  for (int x = 0; x < width; ++x, cmyk += 4, rgb += 3) {
    const int k = cmyk[3];
    for (int c = 0; c < 3; ++c) {
      const int t = cmyk[c] * k + 128;  // PIL's MULDIV255: round(a * b / 255)
      rgb[c] = static_cast<uint8_t>((t + (t >> 8)) >> 8);
    }
  }
}

// Sets the smallest of libjpeg's scales 1/8, 1/4, 1/2 and 1 that keeps
// the image at least min_width x min_height (none asked: the whole size).
// libjpeg-turbo's other scales (3/8, 5/8 ...) run its plain C inverse
// DCTs, and 5/8 to 7/8 take longer than the whole size with SIMD
// (measured: 500x375 photos, 0.8-1.1 ms against 0.67 ms).
void ChooseJpegScale(jpeg_decompress_struct* cinfo, int min_width, int min_height) {
  for (unsigned n = (min_width > 0 || min_height > 0) ? 1 : 8; n <= 8; n *= 2) {
    cinfo->scale_num = n;
    cinfo->scale_denom = 8;
    jpeg_calc_output_dimensions(cinfo);
    if (static_cast<int>(cinfo->output_width) >= min_width &&
        static_cast<int>(cinfo->output_height) >= min_height) {
      break;
    }
  }
}

// The rows and columns of a started decompression to decode.
struct JpegWindow {
  JDIMENSION x, w, y, h;
};

// The region in decoded pixels, widened by the margin (the whole image
// when no region is asked); columns go out to whole blocks
// (jpeg_crop_scanline moves the left edge down to one).
JpegWindow CropJpeg(jpeg_decompress_struct* cinfo, const Region& region, int margin) {
  JpegWindow win{0, cinfo->output_width, 0, cinfo->output_height};
  if (region.w <= 0 || region.h <= 0) return win;
  const double sx = static_cast<double>(cinfo->output_width) / cinfo->image_width;
  const double sy = static_cast<double>(cinfo->output_height) / cinfo->image_height;
  const long left = std::max(0L, static_cast<long>(region.x * sx) - margin);
  const long top = std::max(0L, static_cast<long>(region.y * sy) - margin);
  const long right = std::min(static_cast<long>(cinfo->output_width),
                              static_cast<long>(std::ceil((region.x + region.w) * sx)) + margin);
  const long bottom = std::min(static_cast<long>(cinfo->output_height),
                               static_cast<long>(std::ceil((region.y + region.h) * sy)) + margin);
  if (right > left && bottom > top) {
    win.x = static_cast<JDIMENSION>(left);
    win.w = static_cast<JDIMENSION>(right - left);
    win.y = static_cast<JDIMENSION>(top);
    win.h = static_cast<JDIMENSION>(bottom - top);
    if (win.x > 0 || win.w < cinfo->output_width) jpeg_crop_scanline(cinfo, &win.x, &win.w);
  }
  return win;
}

// Reads the window's rows into `out` (sized here), converting CMYK rows,
// and ends the decompression; the rows below the window are not
// decompressed.
void ReadJpegRows(jpeg_decompress_struct* cinfo, const JpegWindow& win, bool cmyk, Rgb* out) {
  out->x0 = static_cast<int>(win.x);
  out->y0 = static_cast<int>(win.y);
  out->width = static_cast<int>(cinfo->output_width);  // the cropped width, after jpeg_crop_scanline
  out->height = static_cast<int>(win.h);
  out->pixels.resize(static_cast<size_t>(out->width) * out->height * 3);
  // A CMYK row is read into libjpeg's own memory (freed with cinfo: no
  // C++ object here), then converted.
  JSAMPARRAY cmyk_row = cmyk ? (*cinfo->mem->alloc_sarray)(reinterpret_cast<j_common_ptr>(cinfo), JPOOL_IMAGE,
                                                         cinfo->output_width * 4, 1)
                             : nullptr;
  if (win.y > 0) jpeg_skip_scanlines(cinfo, win.y);
  for (JDIMENSION row_index = 0; row_index < win.h; ++row_index) {
    JSAMPROW row = out->pixels.data() + static_cast<size_t>(row_index) * out->width * 3;
    if (!cmyk) {
      jpeg_read_scanlines(cinfo, &row, 1);
      continue;
    }
    jpeg_read_scanlines(cinfo, cmyk_row, 1);
    CmykToRgb(cmyk_row[0], out->width, row);
  }
  if (cinfo->output_scanline < cinfo->output_height) {
    jpeg_abort_decompress(cinfo);
  } else {
    jpeg_finish_decompress(cinfo);
  }
}

// Decodes into `out` (or, with `header_only`, sets its size alone);
// false with `message` set on an error. No C++ object is made between
// setjmp and the last libjpeg call (the helpers above make none either:
// libjpeg's errors long-jump back here through them).
bool DecodeJpegInto(const std::string& bytes, int min_width, int min_height, bool header_only,
                    const Region& region, int margin, Rgb* out, char* message) {
  jpeg_decompress_struct cinfo;
  JpegErrors errors;
  cinfo.err = jpeg_std_error(&errors.base);
  errors.base.error_exit = OnJpegError;
  errors.base.emit_message = OnJpegWarning;
  if (setjmp(errors.jump)) {
    std::snprintf(message, JMSG_LENGTH_MAX, "%s", errors.message);
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
  jpeg_read_header(&cinfo, TRUE);
  if (header_only) {
    out->width = static_cast<int>(cinfo.image_width);
    out->height = static_cast<int>(cinfo.image_height);
    jpeg_destroy_decompress(&cinfo);
    return true;
  }
  // libjpeg converts only YCbCr and grey to RGB; CMYK and YCCK files
  // (valid: print workflows write them, ImageNet holds some) come out as
  // CMYK, turned into RGB below.
  const bool cmyk = cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK;
  cinfo.out_color_space = cmyk ? JCS_CMYK : JCS_RGB;
  cinfo.dct_method = JDCT_ISLOW;  // exact, and the same on every machine
  ChooseJpegScale(&cinfo, min_width, min_height);
  jpeg_start_decompress(&cinfo);
  out->full_width = static_cast<int>(cinfo.output_width);
  out->full_height = static_cast<int>(cinfo.output_height);
  const JpegWindow win = CropJpeg(&cinfo, region, margin);
  ReadJpegRows(&cinfo, win, cmyk, out);
  jpeg_destroy_decompress(&cinfo);
  return true;
}

absl::Status DecodePng(const std::string& bytes, const std::string& label, bool header_only, Rgb* out) {
  png_image image;
  std::memset(&image, 0, sizeof(image));
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&image, bytes.data(), bytes.size())) {
    return absl::DataLossError(absl::StrCat(label, ": a damaged PNG image (", image.message, ")"));
  }
  out->x0 = out->y0 = 0;
  out->width = out->full_width = static_cast<int>(image.width);
  out->height = out->full_height = static_cast<int>(image.height);
  if (header_only) {
    png_image_free(&image);
    return absl::OkStatus();
  }
  image.format = PNG_FORMAT_RGB;  // grey, palette and 16-bit images converted; alpha composed on black
  out->pixels.resize(PNG_IMAGE_SIZE(image));
  if (!png_image_finish_read(&image, nullptr, out->pixels.data(), 0, nullptr)) {
    const std::string why = image.message;
    png_image_free(&image);
    return absl::DataLossError(absl::StrCat(label, ": a damaged PNG image (", why, ")"));
  }
  return absl::OkStatus();
}

absl::Status Decode(const std::string& bytes, const std::string& label, int min_width, int min_height,
                    bool header_only, const Region& region, int margin, Rgb* out) {
  if (IsJpeg(bytes)) {
    char message[JMSG_LENGTH_MAX] = "";
    if (!DecodeJpegInto(bytes, min_width, min_height, header_only, region, margin, out, message)) {
      return absl::DataLossError(absl::StrCat(label, ": a damaged JPEG image (", message, ")"));
    }
    return absl::OkStatus();
  }
  if (IsPng(bytes)) return DecodePng(bytes, label, header_only, out);
  return absl::DataLossError(absl::StrCat(label, ": neither a JPEG nor a PNG image (", bytes.size(), " bytes)"));
}

}  // namespace

absl::StatusOr<std::pair<int, int>> ImageSize(const std::string& bytes, const std::string& label) {
  Rgb rgb;
  RETURN_IF_ERROR(Decode(bytes, label, 0, 0, /*header_only=*/true, Region{}, 0, &rgb));
  return std::make_pair(rgb.width, rgb.height);
}

absl::Status DecodeImageInto(const std::string& bytes, const std::string& label, int min_width, int min_height,
                             Region region, int margin, Rgb* out) {
  return Decode(bytes, label, min_width, min_height, /*header_only=*/false, region, margin, out);
}

absl::StatusOr<Rgb> DecodeImage(const std::string& bytes, const std::string& label, int min_width,
                                int min_height, Region region, int margin) {
  Rgb out;
  RETURN_IF_ERROR(DecodeImageInto(bytes, label, min_width, min_height, region, margin, &out));
  return out;
}

}  // namespace remora::data

#else  // built without libjpeg and libpng (their -dev packages were missing)

namespace remora::data {
namespace {

absl::Status NoCodecs(const std::string& label) {
  return absl::UnimplementedError(absl::StrCat(
      "cannot decode ", label, ": remora was built without libjpeg and libpng (install libjpeg-dev and "
      "libpng-dev, then rebuild)"));
}

}  // namespace

absl::StatusOr<std::pair<int, int>> ImageSize(const std::string&, const std::string& label) {
  return NoCodecs(label);
}

absl::Status DecodeImageInto(const std::string&, const std::string& label, int, int, Region, int, Rgb*) {
  return NoCodecs(label);
}

absl::StatusOr<Rgb> DecodeImage(const std::string&, const std::string& label, int, int, Region, int) {
  return NoCodecs(label);
}

}  // namespace remora::data

#endif
