#include "train/timeline.h"

#include <algorithm>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace remora::train {
namespace {

std::string Label(const TimelineSlice& s) {
  return s.micro_batch >= 0 ? absl::StrCat(s.name, " mb", s.micro_batch) : s.name;
}

// Compute (forward, backward, eval, step, allreduce) on a track's first row;
// copies and waits ("input", "settle", "loss reply", the master's "take
// batch", "send", "wait") on its second, which the SVG leaves out.
bool IsCompute(const TimelineSlice& s) {
  return s.name == "forward" || s.name == "backward" || s.name == "eval" || s.name == "step" ||
         s.name == "allreduce";
}

// The label with the stage, for tooltips.
std::string LongLabel(const TimelineSlice& s) {
  return s.stage.empty() ? Label(s) : absl::StrCat(Label(s), ", ", s.stage);
}

}  // namespace

absl::Status WriteChromeTrace(const std::string& path, const std::vector<std::string>& tracks,
                              const std::vector<TimelineSlice>& slices) {
  std::ofstream out(path);
  if (!out) return absl::InvalidArgumentError(absl::StrCat("cannot write --trace ", path));
  out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  for (size_t t = 0; t < tracks.size(); ++t) {
    out << (first ? "" : ",\n") << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << t
        << ", \"args\": {\"name\": \"" << tracks[t] << "\"}}";
    for (const auto& [tid, row] : {std::pair<int, const char*>{0, "compute"}, {1, "copies and waits"}}) {
      out << ",\n{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << t << ", \"tid\": " << tid
          << ", \"args\": {\"name\": \"" << row << "\"}}";
    }
    first = false;
  }
  for (const auto& s : slices) {
    out << ",\n{\"name\": \"" << Label(s) << "\", \"cat\": \"" << s.name
        << "\", \"ph\": \"X\", \"pid\": " << s.track << ", \"tid\": " << (IsCompute(s) ? 0 : 1)
        << ", \"ts\": " << s.start_us
        << ", \"dur\": " << std::max<int64_t>(1, s.end_us - s.start_us)
        << ", \"args\": {\"micro_batch\": " << s.micro_batch << ", \"stage\": \"" << s.stage
        << "\"}}";
  }
  out << "\n]}\n";
  return out.good() ? absl::OkStatus() : absl::DataLossError("writing the trace failed");
}

absl::Status WriteTimelineSvg(const std::string& path, const std::vector<std::string>& tracks,
                              const std::vector<TimelineSlice>& slices, int micro_batches) {
  std::ofstream out(path);
  if (!out) return absl::InvalidArgumentError(absl::StrCat("cannot write --timeline ", path));
  constexpr int kLeft = 110, kWidth = 1100, kRow = 56, kTop = 40;
  int64_t end = 1;
  for (const auto& s : slices) end = std::max(end, s.end_us);
  const double scale = double(kWidth) / end;
  const int height = kTop + kRow * static_cast<int>(tracks.size()) + 70;
  out << absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%d\" y=\"20\" font-size=\"14\">remora pipeline timeline: %d micro-batches; "
      "forward light, backward dark, optimizer step grey</text>\n",
      kLeft + kWidth + 20, height, kLeft, micro_batches);
  for (size_t t = 0; t < tracks.size(); ++t) {
    const int y = kTop + kRow * static_cast<int>(t);
    out << absl::StrFormat(
        "<text x=\"8\" y=\"%d\">%s</text>\n<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" "
        "stroke=\"#ddd\"/>\n",
        y + kRow / 2 + 4, tracks[t], kLeft, y + kRow, kLeft + kWidth, y + kRow);
  }
  for (const auto& s : slices) {
    if (!IsCompute(s) || s.track >= static_cast<int>(tracks.size())) continue;
    const int y = kTop + kRow * s.track + 6;
    const double x = kLeft + s.start_us * scale;
    const double w = std::max(1.0, (s.end_us - s.start_us) * scale);
    std::string fill = "#999";
    if (s.micro_batch >= 0) {
      const int hue = static_cast<int>(360.0 * s.micro_batch / std::max(1, micro_batches));
      fill = absl::StrFormat("hsl(%d,70%%,%d%%)", hue, s.name == "forward" ? 72 : 42);
    }
    out << absl::StrFormat(
        "<rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\" stroke=\"white\" "
        "stroke-width=\"0.5\"><title>%s: %.1f ms</title></rect>\n",
        x, y, w, kRow - 12, fill, LongLabel(s), (s.end_us - s.start_us) / 1000.0);
    if (w > 26 && s.micro_batch >= 0) {
      out << absl::StrFormat("<text x=\"%.1f\" y=\"%d\" fill=\"%s\">%s%d</text>\n", x + 3,
                             y + (kRow - 12) / 2 + 4, s.name == "forward" ? "black" : "white",
                             s.name == "forward" ? "F" : "B", s.micro_batch);
    }
  }
  // Time axis: about ten ticks at a round step.
  const int64_t steps[] = {1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000,
                           1000000, 2000000, 5000000, 10000000, 20000000};
  int64_t step = steps[0];
  for (int64_t s : steps) {
    step = s;
    if (end / s <= 10) break;
  }
  const int axis = kTop + kRow * static_cast<int>(tracks.size()) + 8;
  out << absl::StrFormat("<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n",
                         kLeft, axis, kLeft + kWidth, axis);
  for (int64_t t = 0; t <= end; t += step) {
    const double x = kLeft + t * scale;
    out << absl::StrFormat(
        "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"black\"/>"
        "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%g s</text>\n",
        x, axis, x, axis + 5, x, axis + 18, t / 1e6);
  }
  out << "</svg>\n";
  return out.good() ? absl::OkStatus() : absl::DataLossError("writing the timeline failed");
}

}  // namespace remora::train
