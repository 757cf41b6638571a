// The process's compute lane: forward passes, backward passes and optimizer
// steps of one process run one at a time (see ComputeTurn), first come,
// first served, or in the order of a pipeline schedule (see LaneAction).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace remora::runtime {

// One action of a pipeline schedule as the lane sees it: the forward or
// backward pass of micro-batch `micro_batch` through stage `stage`, in
// batch `context_id` (the pipeline uses the batch's autograd context id).
struct LaneAction {
  int64_t context_id = -1;
  int64_t stage = -1;
  int64_t micro_batch = -1;
  bool backward = false;
  // With backward: the weights' part (W) of a backward pass split in two;
  // the other part (B, the input's gradient) is then the backward action.
  bool weight = false;

  friend bool operator==(const LaneAction& a, const LaneAction& b) {
    return a.context_id == b.context_id && a.stage == b.stage && a.micro_batch == b.micro_batch &&
           a.backward == b.backward && a.weight == b.weight;
  }
  // The W of this B.
  LaneAction Weight() const { return LaneAction{context_id, stage, micro_batch, true, true}; }
  std::string ToString() const;  // e.g. "F3@stage1", "B0@stage2", "W0@stage2"
};

// The process's compute lane. A worker process hosts pipeline stages and
// behaves as one device: forward passes, backward passes and optimizer
// steps hold a ComputeTurn, so that they run one at a time, each with all
// the intra-op threads, instead of many at once fighting over the cores
// (measured: 8 concurrent backward passes on a 1-thread worker made a
// ResNet50 step twice as slow).
//
// Plain turns are served first come, first served. Turns for a LaneAction
// of the context set by SetOrder are served in that order: the lane is given
// to the next action of the order as soon as it is waiting, and to plain
// turns (and actions of other contexts, or not in the order) only while the
// next action of the order has not arrived. That is how a worker runs its
// stages' forward and backward passes exactly in its schedule's order,
// whatever order the requests arrive in. Never hold a turn while waiting on
// another process.
//
// Thread-safety: a turn is taken and given back on one thread; any number
// of threads may wait. The static functions are thread-safe.
class ComputeTurn {
 public:
  ComputeTurn();  // blocks until every earlier plain turn has ended
  // Blocks until `action`'s place in the order (see above).
  explicit ComputeTurn(const LaneAction& action);
  ~ComputeTurn();  // lets the next one run
  ComputeTurn(const ComputeTurn&) = delete;
  ComputeTurn& operator=(const ComputeTurn&) = delete;

  // Runs `run` holding `action`'s turn, without a thread waiting for it:
  // once the turn comes, `post` is called (under no lock) with a closure
  // that runs `run` and then ends the turn. `post` must hand the closure to
  // another thread (an executor), never run it inline.
  static void RunInTurn(const LaneAction& action, std::function<void()> run,
                        const std::function<void(std::function<void()>)>& post);

  // Makes `order` the order of `context_id`'s actions in this process, from its
  // first. Actions of earlier contexts that still wait are served as plain
  // turns from then on (a failed batch cannot hold the lane).
  static void SetOrder(int64_t context_id, std::vector<LaneAction> order);

  // Counts `action` (of the current order) as done without running it: a
  // backward pass that will never come, because the forward pass's outputs
  // need no gradient (a first stage without parameters). Later actions of
  // the order do not wait for it.
  static void Skip(const LaneAction& action);
  // Gives up `context_id`'s order (its batch failed, so some of its actions
  // will never come): the actions of the order still waiting, and those
  // of `context_id` that arrive later, are served as plain turns. Does nothing
  // when another context's order is the current one.
  static void Abandon(int64_t context_id);
  // Calls `done` (on the thread that ends the order's last action, under no
  // lock; it must not block) once every action of `context_id`'s order has run
  // or been skipped, at once when that is so already. Returns false, and
  // never calls `done`, when `context_id`'s order is not the current one; a
  // later SetOrder or Abandon drops `done` uncalled.
  static bool WhenOrderDone(int64_t context_id, std::function<void()> done);
  // Turns held or waited for right now in this process (tests, diagnostics).
  static int64_t Queued();

 private:
  uint64_t order_ = 0;  // the order (its generation) it was granted in as the next action; 0: none
};

}  // namespace remora::runtime
