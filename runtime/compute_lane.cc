#include "runtime/compute_lane.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <tuple>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/mutex_lock.h"
#include "trace/trace.h"

namespace remora::runtime {

std::string LaneAction::ToString() const {
  return absl::StrCat(weight ? "W" : backward ? "B" : "F", micro_batch, "@stage", stage);
}

namespace {

using Key = std::tuple<int64_t, int64_t, int>;  // stage, micro-batch, F 0 / B 1 / W 2

Key KeyOf(const LaneAction& a) { return {a.stage, a.micro_batch, a.weight ? 2 : a.backward ? 1 : 0}; }

// One turn asked for: a thread waiting (sync) or a closure to post (async).
struct Waiter {
  uint64_t ticket = 0;
  bool granted = false;
  // Granted as the next action of the order of this generation (0: a
  // plain turn): its end counts in that order only, never in a later one.
  uint64_t order = 0;
  std::function<void()> run;  // async only
  std::function<void(std::function<void()>)> post;
};

// The lane: one turn at a time; the context_id's order first, then arrival order.
class Lane {
 public:
  // Queues `w` (keyed by `action` when it has one) and grants what can run.
  // Returns the async waiter to start, if the grant went to one.
  Waiter* Enqueue(Waiter* w, const LaneAction* action) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    w->ticket = next_ticket_++;
    if (action != nullptr && action->context_id == context_id_) {
      auto it = index_.find(KeyOf(*action));
      if (it != index_.end() && it->second >= pos_ && !ordered_.contains(it->first)) {
        ordered_[it->first] = w;
        return Grant();
      }
    }
    plain_.push_back(w);
    return Grant();
  }

  // Ends the turn of one granted as the next action of order `order` (0:
  // a plain turn). An order abandoned or replaced while its action ran has
  // another generation now: that action's end must not count in the new one.
  Waiter* Release(uint64_t order) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    busy_ = false;
    if (order != 0 && order == generation_) ++pos_;
    return Grant();
  }

  bool WhenDone(int64_t context_id, std::function<void()> done) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (context_id != context_id_) return false;
    on_done_ = std::move(done);
    return true;
  }

  // The order's completion callback, once its last action has ended.
  std::function<void()> TakeDone() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!on_done_) return nullptr;
    while (pos_ < order_.size() && skipped_.contains(order_[pos_])) ++pos_;
    if (pos_ < order_.size()) return nullptr;
    return std::exchange(on_done_, nullptr);
  }

  Waiter* SetOrder(int64_t context_id, std::vector<LaneAction> order) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    on_done_ = nullptr;
    // Waiters of the old order become plain turns, in arrival order.
    std::vector<Waiter*> old;
    for (auto& [key, w] : ordered_) old.push_back(w);
    std::sort(old.begin(), old.end(), [](Waiter* a, Waiter* b) { return a->ticket < b->ticket; });
    plain_.insert(plain_.end(), old.begin(), old.end());
    std::sort(plain_.begin(), plain_.end(),
              [](Waiter* a, Waiter* b) { return a->ticket < b->ticket; });
    ordered_.clear();
    skipped_.clear();
    index_.clear();
    order_.clear();
    for (const LaneAction& a : order) {
      if (index_.try_emplace(KeyOf(a), order_.size()).second) order_.push_back(KeyOf(a));
    }
    context_id_ = context_id;
    pos_ = 0;
    ++generation_;
    return Grant();
  }

  Waiter* Abandon(int64_t context_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (context_id != context_id_) return nullptr;
    return SetOrder(context_id, {});  // an order of nothing: every arrival is plain
  }

  Waiter* Skip(const LaneAction& action) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (action.context_id != context_id_) return nullptr;
    auto it = index_.find(KeyOf(action));
    if (it == index_.end() || it->second < pos_) return nullptr;
    skipped_.insert(it->first);
    return Grant();
  }

  int64_t Queued() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return static_cast<int64_t>(plain_.size() + ordered_.size()) + (busy_ ? 1 : 0);
  }

  absl::Mutex mu;

 private:
  Waiter* Grant() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (busy_) return nullptr;
    while (pos_ < order_.size() && skipped_.contains(order_[pos_])) ++pos_;
    Waiter* w = nullptr;
    if (pos_ < order_.size()) {
      auto it = ordered_.find(order_[pos_]);
      if (it != ordered_.end()) {
        w = it->second;
        w->order = generation_;
        ordered_.erase(it);
      }
    }
    if (w == nullptr && !plain_.empty()) {
      w = plain_.front();
      plain_.pop_front();
    }
    if (w == nullptr) return nullptr;
    busy_ = true;
    w->granted = true;
    return w->run ? w : nullptr;  // sync waiters wake on `granted`
  }

  bool busy_ ABSL_GUARDED_BY(mu) = false;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu) = 0;
  std::deque<Waiter*> plain_ ABSL_GUARDED_BY(mu);
  int64_t context_id_ ABSL_GUARDED_BY(mu) = -1;
  std::vector<Key> order_ ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<Key, size_t> index_ ABSL_GUARDED_BY(mu);
  size_t pos_ ABSL_GUARDED_BY(mu) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu) = 0;  // SetOrder's (and Abandon's) count
  absl::flat_hash_map<Key, Waiter*> ordered_ ABSL_GUARDED_BY(mu);
  absl::flat_hash_set<Key> skipped_ ABSL_GUARDED_BY(mu);  // of the order, never to come
  std::function<void()> on_done_ ABSL_GUARDED_BY(mu);     // see WhenOrderDone
};

Lane& TheLane() {
  static Lane* lane = new Lane;  // never destroyed
  return *lane;
}

// Hands a granted async waiter its turn: `run`, then the turn ends.
void Start(Waiter* w) {
  if (w == nullptr) return;
  std::function<void(std::function<void()>)> post = std::move(w->post);
  post([w] {
    std::unique_ptr<Waiter> owned(w);
    owned->run();
    Lane& lane = TheLane();
    Waiter* next;
    std::function<void()> done;
    {
      base::MutexLock lock(lane.mu);
      next = lane.Release(owned->order);
      done = lane.TakeDone();
    }
    if (done) done();
    Start(next);
  });
}

// Blocks until `w` (a sync waiter) is granted.
void Await(Lane& lane, Waiter& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(lane.mu) {
  lane.mu.Await(absl::Condition(&w.granted));
}

}  // namespace

ComputeTurn::ComputeTurn() {
  Lane& lane = TheLane();
  Waiter w;
  Waiter* start;
  {
    base::MutexLock lock(lane.mu);
    start = lane.Enqueue(&w, nullptr);
    Await(lane, w);
  }
  Start(start);
  order_ = w.order;
}

ComputeTurn::ComputeTurn(const LaneAction& action) {
  Lane& lane = TheLane();
  Waiter w;
  Waiter* start;
  {
    base::MutexLock lock(lane.mu);
    start = lane.Enqueue(&w, &action);
    Await(lane, w);
  }
  Start(start);
  order_ = w.order;
}

ComputeTurn::~ComputeTurn() {
  Lane& lane = TheLane();
  Waiter* next;
  std::function<void()> done;
  {
    base::MutexLock lock(lane.mu);
    next = lane.Release(order_);
    done = lane.TakeDone();
  }
  if (done) done();
  Start(next);
}

void ComputeTurn::RunInTurn(const LaneAction& action, std::function<void()> run,
                            const std::function<void(std::function<void()>)>& post) {
  auto* w = new Waiter;
  if (trace::Enabled()) {
    // Traced: from the ask to the run (the lane's turn, the executor's hop).
    run = [run = std::move(run), asked_us = trace::NowUs(), action] {
      trace::Record(absl::StrCat("turn ", action.ToString()), -1, asked_us, trace::NowUs());
      run();
    };
  }
  w->run = std::move(run);
  w->post = post;
  Lane& lane = TheLane();
  Waiter* start;
  {
    base::MutexLock lock(lane.mu);
    start = lane.Enqueue(w, &action);
  }
  Start(start);
}

void ComputeTurn::Skip(const LaneAction& action) {
  Lane& lane = TheLane();
  Waiter* start;
  std::function<void()> done;
  {
    base::MutexLock lock(lane.mu);
    start = lane.Skip(action);
    done = lane.TakeDone();
  }
  if (done) done();
  Start(start);
}

bool ComputeTurn::WhenOrderDone(int64_t context_id, std::function<void()> done) {
  Lane& lane = TheLane();
  std::function<void()> now;
  {
    base::MutexLock lock(lane.mu);
    if (!lane.WhenDone(context_id, std::move(done))) return false;
    now = lane.TakeDone();
  }
  if (now) now();
  return true;
}

void ComputeTurn::Abandon(int64_t context_id) {
  Lane& lane = TheLane();
  Waiter* start;
  {
    base::MutexLock lock(lane.mu);
    start = lane.Abandon(context_id);
  }
  Start(start);
}

void ComputeTurn::SetOrder(int64_t context_id, std::vector<LaneAction> order) {
  Lane& lane = TheLane();
  Waiter* start;
  {
    base::MutexLock lock(lane.mu);
    start = lane.SetOrder(context_id, std::move(order));
  }
  Start(start);
}

int64_t ComputeTurn::Queued() {
  Lane& lane = TheLane();
  base::MutexLock lock(lane.mu);
  return lane.Queued();
}

}  // namespace remora::runtime
