// Where library code's console lines go: a LineSink that the program
// gives. The libraries print nothing themselves; what they have to say as
// they go (a warning that a run goes on without its event files, a
// worker's note of a setting the master asked for) is one line handed to
// the sink, which may write it to a terminal, a log or nowhere.
//
//   train::RegisterWorkerFunctions(registry, LinesTo(std::cout));
//   auto log = train::RunLog::Open(dir, LinesTo(std::cerr));
//
// Thread-safety: a sink may be called from any thread (a worker's calls
// are served on several); LinesTo's writes one whole line per call and
// flushes it.
#pragma once

#include <functional>
#include <ostream>
#include <string>
#include <string_view>

namespace remora::base {

// One line, without its '\n'. Empty: the lines are dropped.
using LineSink = std::function<void(std::string_view line)>;

// A sink writing each line to `out` (which must outlive the sink) with a
// '\n', flushed at once: std::cout, std::cerr.
inline LineSink LinesTo(std::ostream& out) {
  return [&out](std::string_view line) {
    std::string whole(line);
    whole += '\n';
    out << whole << std::flush;
  };
}

// Hands `line` to `sink` when there is one.
inline void Say(const LineSink& sink, std::string_view line) {
  if (sink) sink(line);
}

}  // namespace remora::base
