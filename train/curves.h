// Training curves as an SVG picture (master --curves FILE.svg): panels
// side by side, each a line chart of one or more series (the training loss
// by step, the test accuracy by epoch; a sweep's runs as separate series).
//
//   train::Panel loss{"training loss", "step", {{"splits=8", {{1, 2.3}, {2, 2.1}}}}};
//   RETURN_IF_ERROR(train::WriteCurvesSvg("curves.svg", {loss}));
//
// Thread-compatible free functions.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace remora::train {

struct Series {
  std::string name;                               // the legend's text
  std::vector<std::pair<double, double>> points;  // (x, y), x ascending
};

struct Panel {
  std::string title;
  std::string x_label;
  std::vector<Series> series;
};

// The SVG text of `panels` (panels without points are left out; none at
// all draws a note saying so).
std::string CurvesSvg(const std::vector<Panel>& panels);

// Writes CurvesSvg(panels) to `path`; an error names the file.
absl::Status WriteCurvesSvg(const std::string& path, const std::vector<Panel>& panels);

}  // namespace remora::train
