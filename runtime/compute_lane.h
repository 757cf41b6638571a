// The process's compute lane: forward passes, backward passes and optimizer
// steps of one process run one at a time (see ComputeTurn).
#pragma once

#include <cstdint>

namespace remora {

// The process's compute lane. A worker process hosts pipeline stages and
// behaves as one device: forward passes, backward passes and optimizer
// steps hold a ComputeTurn, so that they run one at a time, each with all
// the intra-op threads, instead of many at once fighting over the cores
// (measured: 8 concurrent backward passes on a 1-thread worker made a
// ResNet50 step twice as slow). Turns are served first come, first served:
// with interleaved stages the order matters, and a simulation of the
// 2-worker, 4-stage pipeline finished a batch about 1% sooner in arrival
// order than in the arbitrary order of a plain mutex. Never hold a turn
// while waiting on another process.
//
// Thread-safety: a turn is taken and given back on one thread; any number
// of threads may wait.
class ComputeTurn {
 public:
  ComputeTurn();   // blocks until every earlier turn has ended
  ~ComputeTurn();  // lets the next one run
  ComputeTurn(const ComputeTurn&) = delete;
  ComputeTurn& operator=(const ComputeTurn&) = delete;

  // Turns held or waited for right now in this process (tests, diagnostics).
  static int64_t Queued();

 private:
  uint64_t ticket_;
};

}  // namespace remora
