#include "train/curves.h"

#include <algorithm>
#include <cmath>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace remora::train {
namespace {

constexpr double kPanelWidth = 420, kPanelHeight = 260;
constexpr double kPanelLeft = 56, kPanelRight = 12, kPanelTop = 28, kPanelBottom = 40;
constexpr const char* kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};

std::string Escape(const std::string& text) {
  return absl::StrReplaceAll(text, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}});
}

std::string Number(double v) { return absl::StrFormat("%.4g", v); }

// One panel, its top left corner at (x0, 0).
std::string DrawPanel(const Panel& p, double x0) {
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  for (const Series& s : p.series) {
    for (const auto& [x, y] : s.points) {
      if (!std::isfinite(x) || !std::isfinite(y)) continue;
      xmin = std::min(xmin, x), xmax = std::max(xmax, x);
      ymin = std::min(ymin, y), ymax = std::max(ymax, y);
    }
  }
  if (xmax == xmin) xmax = xmin + 1;
  if (ymax == ymin) ymax = ymin + 1;
  const double w = kPanelWidth - kPanelLeft - kPanelRight, h = kPanelHeight - kPanelTop - kPanelBottom;
  auto px = [&](double x) { return x0 + kPanelLeft + (x - xmin) / (xmax - xmin) * w; };
  auto py = [&](double y) { return kPanelTop + (1 - (y - ymin) / (ymax - ymin)) * h; };
  std::string svg = absl::StrFormat(
      "<text x=\"%.1f\" y=\"18\" font-weight=\"bold\">%s</text>\n"
      "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#999\"/>\n",
      x0 + kPanelLeft, Escape(p.title), x0 + kPanelLeft, kPanelTop, w, h);
  // The axes' ends, and the x axis's label.
  absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n", x0 + kPanelLeft - 4,
                        kPanelTop + 10, Number(ymax));
  absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n", x0 + kPanelLeft - 4,
                        kPanelTop + h, Number(ymin));
  absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\">%s</text>\n", x0 + kPanelLeft, kPanelTop + h + 16, Number(xmin));
  absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n", x0 + kPanelLeft + w,
                        kPanelTop + h + 16, Number(xmax));
  absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                        x0 + kPanelLeft + w / 2, kPanelTop + h + 32, Escape(p.x_label));
  for (size_t i = 0; i < p.series.size(); ++i) {
    const Series& s = p.series[i];
    const char* colour = kColours[i % std::size(kColours)];
    std::string points;
    for (const auto& [x, y] : s.points) {
      if (std::isfinite(x) && std::isfinite(y)) absl::StrAppendFormat(&points, "%.1f,%.1f ", px(x), py(y));
    }
    absl::StrAppendFormat(&svg, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" points=\"%s\"/>\n",
                          colour, points);
    if (s.points.size() == 1) {  // a lone point draws no line
      absl::StrAppendFormat(&svg, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n",
                            px(s.points[0].first), py(s.points[0].second), colour);
    }
    if (!s.name.empty()) {
      absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" fill=\"%s\" text-anchor=\"end\">%s</text>\n",
                            x0 + kPanelLeft + w - 4, kPanelTop + 14 + 14 * i, colour, Escape(s.name));
    }
  }
  return svg;
}

}  // namespace

std::string CurvesSvg(const std::vector<Panel>& panels) {
  std::vector<const Panel*> drawn;
  for (const Panel& p : panels) {
    const bool any = std::any_of(p.series.begin(), p.series.end(), [](const Series& s) { return !s.points.empty(); });
    if (any) drawn.push_back(&p);
  }
  const double width = std::max<size_t>(drawn.size(), 1) * kPanelWidth;
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      width, kPanelHeight);
  if (drawn.empty()) svg += "<text x=\"20\" y=\"40\">no training steps to draw</text>\n";
  for (size_t i = 0; i < drawn.size(); ++i) svg += DrawPanel(*drawn[i], i * kPanelWidth);
  return svg + "</svg>\n";
}

absl::Status WriteCurvesSvg(const std::string& path, const std::vector<Panel>& panels) {
  std::ofstream out(path);
  out << CurvesSvg(panels);
  out.close();
  if (!out) return absl::InvalidArgumentError(absl::StrCat("cannot write the curves to ", path));
  return absl::OkStatus();
}

}  // namespace remora::train
