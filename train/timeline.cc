#include "train/timeline.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "pipeline/schedule.h"

namespace remora::train {
namespace {

std::string Label(const TimelineSlice& s) {
  return s.micro_batch >= 0 ? absl::StrCat(s.name, " mb", s.micro_batch) : s.name;
}

// Compute (forward, backward, its weight part, eval, step, allreduce) on a track's first row;
// copies and waits ("input", "settle", "loss reply", the master's "take
// batch", "send", "wait") on its second, which the SVG leaves out.
bool IsCompute(const TimelineSlice& s) {
  return s.name == "forward" || s.name == "backward" || s.name == "weight" || s.name == "eval" ||
         s.name == "step" || s.name == "allreduce";
}

// The length of the union of `spans` within [from, to).
int64_t CoveredWithin(std::vector<std::pair<int64_t, int64_t>> spans, int64_t from, int64_t to) {
  std::sort(spans.begin(), spans.end());
  int64_t covered = 0, reached = from;
  for (auto [start, end] : spans) {
    start = std::max(start, reached);
    end = std::min(end, to);
    if (end <= start) continue;
    covered += end - start;
    reached = end;
  }
  return covered;
}

// Each track's stages, as its row label says them: "stage 0", or
// "stages 0, 2" when interleaved; empty when its slices name none.
std::vector<std::string> StagesOf(const std::vector<TimelineSlice>& slices, size_t tracks) {
  std::vector<std::set<std::pair<int, std::string>>> stages(tracks);
  for (const auto& s : slices) {
    if (s.track < 0 || static_cast<size_t>(s.track) >= tracks || s.stage.empty()) continue;
    int number = -1;  // ("stage N" sorts by N)
    if (s.stage.rfind("stage ", 0) == 0) number = std::atoi(s.stage.c_str() + 6);
    stages[s.track].insert({number, s.stage});
  }
  std::vector<std::string> out(tracks);
  for (size_t t = 0; t < tracks; ++t) {
    std::vector<std::string> names;
    bool numbered = true;
    for (const auto& [number, name] : stages[t]) {
      names.push_back(number >= 0 ? std::to_string(number) : name);
      numbered = numbered && number >= 0;
    }
    if (names.empty()) continue;
    out[t] = numbered ? absl::StrCat(names.size() == 1 ? "stage " : "stages ", absl::StrJoin(names, ", "))
                      : absl::StrJoin(names, ", ");
  }
  return out;
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

namespace {

// The picture's margins, width and rows, in pixels.
constexpr int kLeft = 130, kWidth = 1100, kRow = 56, kTop = 40, kRight = 110;

// The legend: Fn forward and Bn backward of micro-batch n (a hue per
// micro-batch; under a split backward B its input part and Wn its
// weights' part), the optimizer step, idle time.
void WriteLegend(std::ostream& out, const std::vector<TimelineSlice>& slices) {
  const int legend_y = 8;
  int legend_x = kLeft + 330;
  const bool split =
      std::any_of(slices.begin(), slices.end(), [](const TimelineSlice& s) { return s.name == "weight"; });
  std::vector<std::tuple<std::string, std::string, std::string>> legend = {
      {"hsl(0,70%,72%)", "F0", "forward of micro-batch 0"},
      {"hsl(0,70%,42%)", "B0", split ? "its input's gradient" : "its backward"}};
  if (split) legend.emplace_back("hsl(0,70%,30%)", "W0", "its weights' gradient");
  legend.emplace_back("#999", "", "optimizer step, gradient sum");
  legend.emplace_back("white", "", "idle");
  for (const auto& [fill, text, label] : legend) {
    out << absl::StrFormat(
        "<rect x=\"%d\" y=\"%d\" width=\"22\" height=\"16\" fill=\"%s\" stroke=\"#999\" "
        "stroke-width=\"0.5\"/><text x=\"%d\" y=\"%d\" fill=\"%s\">%s</text>"
        "<text x=\"%d\" y=\"%d\">%s</text>\n",
        legend_x, legend_y, fill, legend_x + 3, legend_y + 12, text == "B0" || text == "W0" ? "white" : "black", text,
        legend_x + 27, legend_y + 12, label);
    legend_x += 40 + 6 * static_cast<int>(label.size());
  }
}

// A row per track: its worker, its stages and its idle share of the
// measured steps (where two were traced).
void WriteRows(std::ostream& out, const std::vector<std::string>& tracks, const std::vector<TimelineSlice>& slices) {
  absl::StatusOr<Bubble> bubble = MeasureBubble(slices, static_cast<int>(tracks.size()));
  const std::vector<std::string> stages = StagesOf(slices, tracks.size());
  for (size_t t = 0; t < tracks.size(); ++t) {
    const int y = kTop + kRow * static_cast<int>(t);
    out << absl::StrFormat(
        "<text x=\"8\" y=\"%d\">%s</text><text x=\"8\" y=\"%d\" fill=\"#555\">%s</text>\n"
        "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#ddd\"/>\n",
        y + kRow / 2 - 2, tracks[t], y + kRow / 2 + 12, stages[t], kLeft, y + kRow, kLeft + kWidth, y + kRow);
    if (bubble.ok() && t < bubble->workers.size()) {
      out << absl::StrFormat("<text x=\"%d\" y=\"%d\">idle %.0f%%</text>\n", kLeft + kWidth + 10,
                             y + kRow / 2 + 4, 100 * bubble->workers[t].idle_fraction());
    }
  }
}

// Each compute slice as a block on its row, labelled F, B or W and its
// micro-batch where it is wide enough.
void WriteBlocks(std::ostream& out, size_t tracks, const std::vector<TimelineSlice>& slices, double scale,
                 int micro_batches) {
  for (const auto& s : slices) {
    if (!IsCompute(s) || s.track >= static_cast<int>(tracks)) continue;
    const int y = kTop + kRow * s.track + 6;
    const double x = kLeft + s.start_us * scale;
    const double w = std::max(1.0, (s.end_us - s.start_us) * scale);
    std::string fill = "#999";
    if (s.micro_batch >= 0) {
      const int hue = static_cast<int>(360.0 * s.micro_batch / std::max(1, micro_batches));
      fill = absl::StrFormat("hsl(%d,70%%,%d%%)", hue, s.name == "forward" ? 72 : s.name == "weight" ? 30 : 42);
    }
    out << absl::StrFormat(
        "<rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\" stroke=\"white\" "
        "stroke-width=\"0.5\"><title>%s: %.1f ms</title></rect>\n",
        x, y, w, kRow - 12, fill, LongLabel(s), (s.end_us - s.start_us) / 1000.0);
    if (w > 26 && s.micro_batch >= 0) {
      out << absl::StrFormat("<text x=\"%.1f\" y=\"%d\" fill=\"%s\">%s%d</text>\n", x + 3,
                             y + (kRow - 12) / 2 + 4, s.name == "forward" ? "black" : "white",
                             s.name == "forward" ? "F" : s.name == "weight" ? "W" : "B", s.micro_batch);
    }
  }
}

// The time axis under `tracks` rows: about ten ticks at a round step.
void WriteAxis(std::ostream& out, size_t tracks, int64_t end, double scale) {
  const int64_t steps[] = {1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000,
                           1000000, 2000000, 5000000, 10000000, 20000000};
  int64_t step = steps[0];
  for (int64_t s : steps) {
    step = s;
    if (end / s <= 10) break;
  }
  const int axis = kTop + kRow * static_cast<int>(tracks) + 8;
  out << absl::StrFormat("<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n",
                         kLeft, axis, kLeft + kWidth, axis);
  for (int64_t t = 0; t <= end; t += step) {
    const double x = kLeft + t * scale;
    out << absl::StrFormat(
        "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"black\"/>"
        "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%g s</text>\n",
        x, axis, x, axis + 5, x, axis + 18, t / 1e6);
  }
}

}  // namespace

absl::Status WriteTimelineSvg(const std::string& path, const std::vector<std::string>& tracks,
                              const std::vector<TimelineSlice>& slices, int micro_batches) {
  std::ofstream out(path);
  if (!out) return absl::InvalidArgumentError(absl::StrCat("cannot write --timeline ", path));
  int64_t end = 1;
  for (const auto& s : slices) end = std::max(end, s.end_us);
  const double scale = double(kWidth) / end;
  const int height = kTop + kRow * static_cast<int>(tracks.size()) + 70;
  out << absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%d\" y=\"20\" font-size=\"14\">remora pipeline timeline: %d micro-batches</text>\n",
      kLeft + kWidth + kRight, height, kLeft, micro_batches);
  WriteLegend(out, slices);
  WriteRows(out, tracks, slices);
  WriteBlocks(out, tracks.size(), slices, scale, micro_batches);
  WriteAxis(out, tracks.size(), end, scale);
  out << "</svg>\n";
  return out.good() ? absl::OkStatus() : absl::DataLossError("writing the timeline failed");
}

absl::StatusOr<Bubble> MeasureBubble(const std::vector<TimelineSlice>& slices, int workers) {
  if (workers <= 0) return absl::InvalidArgumentError("measuring the bubble needs at least one worker");
  // Each worker's optimizer steps (their ends, in order) and compute spans.
  // (Only the steps before the first evaluation: a test set's pass is no
  // step's.)
  int64_t first_eval = INT64_MAX;
  for (const auto& s : slices) {
    if (s.track >= 0 && s.track < workers && s.name == "eval") first_eval = std::min(first_eval, s.start_us);
  }
  std::vector<std::vector<int64_t>> step_ends(workers);
  std::vector<std::vector<std::pair<int64_t, int64_t>>> busy(workers);
  for (const auto& s : slices) {
    if (s.track < 0 || s.track >= workers || !IsCompute(s)) continue;
    busy[s.track].emplace_back(s.start_us, s.end_us);
    if (s.name == "step" && s.end_us <= first_eval) step_ends[s.track].push_back(s.end_us);
  }
  size_t steps = step_ends[0].size();
  for (int w = 0; w < workers; ++w) {
    std::sort(step_ends[w].begin(), step_ends[w].end());
    steps = std::min(steps, step_ends[w].size());
  }
  if (steps < 2) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the bubble needs two traced steps on every worker (the first is left out); a worker traced ", steps));
  }
  // From the first action after a worker's first step (the earliest over
  // the workers) to the last worker's end of step `steps`.
  int64_t from = -1, to = 0;
  for (int w = 0; w < workers; ++w) {
    for (const auto& [start, end] : busy[w]) {
      if (start >= step_ends[w][0] && (from < 0 || start < from)) from = start;
    }
    to = std::max(to, step_ends[w][steps - 1]);
  }
  if (from < 0 || to <= from) {
    return absl::FailedPreconditionError("the bubble needs work traced after the first step; none was");
  }
  Bubble b;
  b.steps = static_cast<int64_t>(steps) - 1;
  const double span_s = (to - from) / 1e6;
  b.step_s = span_s / b.steps;
  double idle = 0;
  for (int w = 0; w < workers; ++w) {
    const double busy_s = CoveredWithin(busy[w], from, to) / 1e6;
    b.workers.push_back({busy_s / b.steps, (span_s - busy_s) / b.steps});
    idle += span_s - busy_s;
  }
  b.fraction = idle / (workers * span_s);
  return b;
}

absl::StatusOr<double> ScheduleBubble(const pipeline::Schedule& schedule) {
  absl::StatusOr<pipeline::Simulation> sim = pipeline::Simulate(schedule);
  if (!sim.ok()) return sim.status();
  if (sim->makespan <= 0 || sim->idle.empty()) return 0.0;
  double idle = 0;
  for (int i : sim->idle) idle += i;
  return idle / (static_cast<double>(sim->idle.size()) * sim->makespan);
}

std::string FormatBubble(const Bubble& b, const std::vector<std::string>& workers) {
  std::string out = absl::StrFormat("bubble: %.1f%% of each step idle over %d step%s after the first (%.3f s a step)",
                                    100 * b.fraction, b.steps, b.steps == 1 ? "" : "s", b.step_s);
  if (b.schedule_fraction >= 0) {
    absl::StrAppendFormat(&out, "; the schedule alone leaves %.1f%% (%s of equal time)", 100 * b.schedule_fraction,
                          b.schedule_split ? "forward, input backward B and weight backward W"
                                           : "forward and backward");
  }
  out += "\n";
  for (size_t w = 0; w < b.workers.size(); ++w) {
    const WorkerTime& t = b.workers[w];
    absl::StrAppendFormat(&out, "  %s: busy %.3f s, idle %.3f s (%.1f%%)\n",
                          w < workers.size() ? workers[w] : absl::StrCat("track ", w), t.busy_s, t.idle_s,
                          100 * t.idle_fraction());
  }
  return out;
}

}  // namespace remora::train
