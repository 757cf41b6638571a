// A process-wide recorder of timed slices (what a worker did when), for
// timelines. Disabled by default; recording costs a lock and a push.
//
// Times are microseconds of CLOCK_MONOTONIC, which all processes of one host
// share, so slices from several local workers line up without correction.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace remora::trace {

struct Slice {
  std::string name;      // e.g. "forward", "backward", "step"
  int64_t micro_batch;   // -1 when not tied to one
  int64_t start_us;
  int64_t end_us;
  std::string stage;     // which stage of the process, e.g. "blocks [8, 13)"; may be empty
};

int64_t NowUs();
void Enable(bool on);
bool Enabled();
void Record(const std::string& name, int64_t micro_batch, int64_t start_us, int64_t end_us,
            const std::string& stage = "");
// Returns and clears what was recorded.
std::vector<Slice> Drain();

// The micro-batch (and stage) this thread works on, for slices recorded
// deeper down (a backward pass learns them from a mark in the graph).
// -1 and "": unknown.
void SetMicroBatch(int64_t micro_batch, std::string stage = "");
int64_t MicroBatch();
const std::string& Stage();

// Records a slice over its scope (when enabled).
class Scope {
 public:
  Scope(std::string name, int64_t micro_batch, std::string stage = "")
      : name_(std::move(name)),
        micro_batch_(micro_batch),
        stage_(std::move(stage)),
        start_(Enabled() ? NowUs() : -1) {}
  ~Scope() {
    if (start_ >= 0) Record(name_, micro_batch_, start_, NowUs(), stage_);
  }

 private:
  std::string name_;
  int64_t micro_batch_;
  std::string stage_;
  int64_t start_;
};

}  // namespace remora::trace
