#include "pipeline/schedule.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_util.h"

namespace remora::pipeline {

std::string Action::ToString() const {
  return absl::StrCat(kind == kForward ? "F" : kind == kBackward ? "B" : "W", micro_batch, "@", stage);
}

bool Schedule::SplitsBackward() const {
  for (const auto& list : actions) {
    for (const Action& a : list) {
      if (a.kind == Action::kWeight) return true;
    }
  }
  return false;
}

std::string Schedule::ToString() const {
  std::string out;
  for (size_t w = 0; w < actions.size(); ++w) {
    absl::StrAppend(&out, "worker ", w, ":");
    for (const Action& a : actions[w]) absl::StrAppend(&out, " ", a.ToString());
    absl::StrAppend(&out, "\n");
  }
  return out;
}

const std::vector<std::string>& ScheduleNames() {
  static const auto* names = new std::vector<std::string>{"gpipe", "1f1b", "interleaved", "zb1p", "zbv"};
  return *names;
}

namespace {

Action F(int stage, int mb) { return Action{Action::kForward, stage, mb}; }
Action B(int stage, int mb) { return Action{Action::kBackward, stage, mb}; }
Action W(int stage, int mb) { return Action{Action::kWeight, stage, mb}; }

// Every forward, ordered by (micro-batch, stage), then every backward,
// ordered by (micro-batch, stage from the last).
std::vector<Action> GPipe(int worker, int workers, int per_worker, int m) {
  std::vector<Action> out;
  for (int i = 0; i < m; ++i) {
    for (int v = 0; v < per_worker; ++v) out.push_back(F(v * workers + worker, i));
  }
  for (int i = 0; i < m; ++i) {
    for (int v = per_worker - 1; v >= 0; --v) out.push_back(B(v * workers + worker, i));
  }
  return out;
}

// PipeDream-flush for stage `s` of `stages` (one stage per worker).
std::vector<Action> OneFOneB(int s, int stages, int m) {
  std::vector<Action> out;
  const int warmup = std::min(stages - s - 1, m);
  for (int i = 0; i < warmup; ++i) out.push_back(F(s, i));
  for (int i = 0; i + warmup < m; ++i) {
    out.push_back(F(s, warmup + i));
    out.push_back(B(s, i));
  }
  for (int i = std::max(0, m - warmup); i < m; ++i) out.push_back(B(s, i));
  return out;
}

// ZB-H1 for stage `s` of `stages`: 1F1B's forwards and input backwards,
// W(i) right after B(i + s) (micro-batches held: at most `stages`), the
// rest after the last B.
std::vector<Action> ZeroBubbleH1(int s, int stages, int m) {
  std::vector<Action> out;
  int next_w = 0;
  for (const Action& a : OneFOneB(s, stages, m)) {
    out.push_back(a);
    if (a.kind == Action::kBackward && a.micro_batch >= s) out.push_back(W(s, next_w++));
  }
  while (next_w < m) out.push_back(W(s, next_w++));
  return out;
}

// Megatron-LM's interleaved 1F1B for pipeline rank `w` of `p`, `v` chunks
// per rank: the k-th forward of the rank is micro-batch
// (k / (p v)) p + k % p through chunk (k % (p v)) / p; backwards go through
// the chunks in reverse.
std::vector<Action> Interleaved(int w, int p, int v, int m) {
  const int total = m * v;
  const int warmup = m == p ? total : std::min((p - w - 1) * 2 + (v - 1) * p, total);
  auto action = [&](int k, bool forward) {
    int chunk = (k % (p * v)) / p;
    if (!forward) chunk = v - 1 - chunk;
    const int mb = (k / (p * v)) * p + k % p;
    return forward ? F(chunk * p + w, mb) : B(chunk * p + w, mb);
  };
  std::vector<Action> out;
  for (int k = 0; k < warmup; ++k) out.push_back(action(k, true));
  for (int i = 0; i < total - warmup; ++i) {
    out.push_back(action(warmup + i, true));
    out.push_back(action(i, false));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(action(k, false));
  return out;
}

// When each action ended: (kind, stage, micro-batch) -> end time.
using EndTimes = std::map<std::tuple<int, int, int>, int>;

// Whether what `a` needs has ended by time `t`, with `stages` stages:
// F(s, i) after F(s - 1, i); B(s, i) after B(s + 1, i), or F(s, i) on the
// last stage; W(s, i) after B(s, i).
bool InputsReady(const Action& a, int stages, const EndTimes& done_at, int t) {
  auto ended = [&](Action::Kind k, int s) {
    auto it = done_at.find({k, s, a.micro_batch});
    return it != done_at.end() && it->second <= t;
  };
  if (a.kind == Action::kForward) return a.stage == 0 || ended(Action::kForward, a.stage - 1);
  if (a.kind == Action::kWeight) return ended(Action::kBackward, a.stage);
  if (a.stage == stages - 1) return ended(Action::kForward, a.stage);
  return ended(Action::kBackward, a.stage + 1);
}

// ZB-V for `workers` workers: worker w holds stages w and 2 workers - 1 - w.
// The orders are what a run with unit F, B and W times does when each
// free worker takes the first ready action of: a forward (its second
// stage's, then its first's) while fewer than 2 workers micro-batches are
// held between F and W, B (its first stage's, then its second's), W; or
// with `forward_first` false, B before the forwards. Each stage's F, B and
// W run in micro-batch order.
absl::StatusOr<std::vector<std::vector<Action>>> ZeroBubbleV(int workers, int m, bool forward_first) {
  const int n = workers, S = 2 * workers, limit = 2 * workers;
  EndTimes done_at;
  std::vector<int> next_f(S, 0), next_b(S, 0), next_w(S, 0), held(n, 0), free_at(n, 0);
  std::vector<std::vector<Action>> out(n);
  int remaining = 3 * S * m;
  for (int t = 0; remaining > 0; ++t) {
    bool moved = false;
    for (int w = 0; w < n; ++w) {
      if (free_at[w] > t) {
        moved = true;
        continue;
      }
      const int first = w, second = S - 1 - w;
      std::optional<Action> pick;
      auto backward = [&] {
        for (int s : {first, second}) {
          const int i = next_b[s];
          if (!pick && i < next_f[s] && InputsReady(B(s, i), S, done_at, t)) pick = B(s, i);
        }
      };
      auto forward = [&] {
        for (int s : {second, first}) {
          const int i = next_f[s];
          if (!pick && i < m && held[w] < limit && InputsReady(F(s, i), S, done_at, t)) pick = F(s, i);
        }
      };
      if (forward_first) forward();
      backward();
      forward();
      for (int s : {first, second}) {  // W
        const int i = next_w[s];
        if (!pick && i < next_b[s] && InputsReady(W(s, i), S, done_at, t)) pick = W(s, i);
      }
      if (!pick) continue;
      done_at[{pick->kind, pick->stage, pick->micro_batch}] = t + 1;
      free_at[w] = t + 1;
      out[w].push_back(*pick);
      --remaining;
      moved = true;
      if (pick->kind == Action::kForward) {
        ++next_f[pick->stage];
        ++held[w];
      } else if (pick->kind == Action::kBackward) {
        ++next_b[pick->stage];
      } else {
        ++next_w[pick->stage];
        --held[w];
      }
    }
    if (!moved) {
      return absl::InternalError(absl::StrCat("schedule zbv: no order found for ", workers, " workers and ", m,
                                              " micro-batches (a bug: please report it)"));
    }
  }
  return out;
}

}  // namespace

std::vector<int> StagePlacement(const std::string& name, int workers, int stages_per_worker) {
  std::vector<int> placement;
  for (int k = 0; k < workers * stages_per_worker; ++k) {
    placement.push_back(name == "zbv" && k >= workers ? 2 * workers - 1 - k : k % workers);
  }
  return placement;
}

absl::StatusOr<Schedule> MakeSchedule(const std::string& name, int workers,
                                      int stages_per_worker, int micro_batches) {
  if (workers < 1 || stages_per_worker < 1 || micro_batches < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule: workers (", workers, "), stages per worker (", stages_per_worker,
        ") and micro-batches (", micro_batches, ") must all be at least 1"));
  }
  Schedule s;
  s.name = name;
  s.workers = workers;
  s.stages = workers * stages_per_worker;
  s.micro_batches = micro_batches;
  s.actions.resize(workers);
  s.placement = StagePlacement(name, workers, stages_per_worker);
  if (name == "gpipe") {
    for (int w = 0; w < workers; ++w) s.actions[w] = GPipe(w, workers, stages_per_worker, micro_batches);
  } else if (name == "1f1b") {
    if (stages_per_worker != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "schedule 1f1b runs one stage per worker, not ", stages_per_worker,
          ": use the interleaved schedule for several stages per worker, or one stage each"));
    }
    for (int w = 0; w < workers; ++w) s.actions[w] = OneFOneB(w, workers, micro_batches);
  } else if (name == "zb1p") {
    if (stages_per_worker != 1) {
      return absl::InvalidArgumentError(absl::StrCat("schedule zb1p runs one stage per worker, not ",
                                                     stages_per_worker));
    }
    for (int w = 0; w < workers; ++w) s.actions[w] = ZeroBubbleH1(w, workers, micro_batches);
  } else if (name == "zbv") {
    if (stages_per_worker != 2) {
      return absl::InvalidArgumentError(absl::StrCat("schedule zbv runs two stages per worker (a V), not ",
                                                     stages_per_worker));
    }
    // (Forwards first reach the floor, workers - 1 idle units, from
    // 2 workers micro-batches on; below, B first is at times shorter.)
    ASSIGN_OR_RETURN(s.actions, ZeroBubbleV(workers, micro_batches, true));
    Schedule other = s;
    ASSIGN_OR_RETURN(other.actions, ZeroBubbleV(workers, micro_batches, false));
    ASSIGN_OR_RETURN(const Simulation a, Simulate(s));
    ASSIGN_OR_RETURN(const Simulation b, Simulate(other));
    if (b.makespan < a.makespan) s.actions = std::move(other.actions);
  } else if (name == "interleaved") {
    if (stages_per_worker < 2) {
      return absl::InvalidArgumentError(
          "schedule interleaved needs at least 2 stages per worker (with one, use 1f1b)");
    }
    if (micro_batches % workers != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "schedule interleaved runs micro-batches in groups of the worker count: ",
          micro_batches, " micro-batches do not divide into groups of ", workers,
          "; use a multiple of ", workers));
    }
    for (int w = 0; w < workers; ++w) {
      s.actions[w] = Interleaved(w, workers, stages_per_worker, micro_batches);
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown schedule '", name, "'; known: ",
                                                   absl::StrJoin(ScheduleNames(), ", ")));
  }
  return s;
}

namespace {

// Every action once, on its stage's worker: an error naming the first
// that is not.
absl::Status CheckActions(const Schedule& schedule) {
  const int n = schedule.workers, S = schedule.stages, M = schedule.micro_batches;
  std::set<std::tuple<int, int, int>> seen;
  for (int w = 0; w < n; ++w) {
    for (const Action& a : schedule.actions[w]) {
      if (a.stage < 0 || a.stage >= S || a.micro_batch < 0 || a.micro_batch >= M) {
        return absl::FailedPreconditionError(
            absl::StrCat("schedule: ", a.ToString(), " on worker ", w, " is out of range"));
      }
      if (schedule.WorkerOf(a.stage) != w) {
        return absl::FailedPreconditionError(absl::StrCat(
            "schedule: ", a.ToString(), " is on worker ", w, ", its stage is on worker ",
            schedule.WorkerOf(a.stage)));
      }
      if (!seen.insert({a.kind, a.stage, a.micro_batch}).second) {
        return absl::FailedPreconditionError(
            absl::StrCat("schedule: ", a.ToString(), " appears twice"));
      }
    }
  }
  const int kinds = schedule.SplitsBackward() ? 3 : 2;
  if (static_cast<int>(seen.size()) != kinds * S * M) {
    return absl::FailedPreconditionError(absl::StrCat(
        "schedule: ", seen.size(), " actions, but ", S, " stages x ", M, " micro-batches need ", kinds * S * M,
        kinds == 3 ? " (a forward, an input backward B and a weight backward W each)" : ""));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Simulation> Simulate(const Schedule& schedule) {
  return Simulate(schedule, ActionCosts{1, 1, schedule.SplitsBackward() ? 1 : 0});
}

absl::StatusOr<Simulation> Simulate(const Schedule& schedule, const ActionCosts& costs) {
  const int n = schedule.workers, S = schedule.stages, M = schedule.micro_batches;
  if (n < 1 || S < n || S % n != 0 || M < 1 || static_cast<int>(schedule.actions.size()) != n ||
      !(schedule.placement.empty() || static_cast<int>(schedule.placement.size()) == S) ||
      std::any_of(schedule.placement.begin(), schedule.placement.end(), [n](int w) { return w < 0 || w >= n; })) {
    return absl::FailedPreconditionError("schedule: inconsistent worker, stage, micro-batch or placement counts");
  }
  const bool split = schedule.SplitsBackward();
  if (costs.forward < 1 || costs.input < 1 || costs.weight < (split ? 1 : 0)) {
    return absl::InvalidArgumentError("schedule: every action takes at least one time unit");
  }
  RETURN_IF_ERROR(CheckActions(schedule));
  auto duration = [&](const Action& a) {
    if (a.kind == Action::kForward) return costs.forward;
    if (a.kind == Action::kWeight) return costs.weight;
    return split ? costs.input : costs.input + costs.weight;
  };
  EndTimes done_at;
  Simulation sim;
  sim.idle.assign(n, 0);
  sim.peak_in_flight.assign(S, 0);
  std::vector<int> in_flight(S, 0);
  std::vector<size_t> next(n, 0);
  std::vector<int> busy_until(n, 0), busy(n, 0);
  size_t remaining = (split ? 3 : 2) * static_cast<size_t>(S) * M;
  for (int t = 0; remaining > 0; ++t) {
    bool running = false;
    for (int w = 0; w < n; ++w) {
      if (busy_until[w] > t) {
        running = true;
        continue;
      }
      if (next[w] >= schedule.actions[w].size()) continue;
      const Action& a = schedule.actions[w][next[w]];
      if (!InputsReady(a, S, done_at, t)) continue;
      const int d = duration(a);
      done_at[{a.kind, a.stage, a.micro_batch}] = t + d;
      busy_until[w] = t + d;
      busy[w] += d;
      ++next[w];
      --remaining;
      running = true;
      // (Held from the forward to the end of the backward: its W where split.)
      int& f = in_flight[a.stage];
      if (a.kind == Action::kForward) {
        ++f;
      } else if (a.kind == (split ? Action::kWeight : Action::kBackward)) {
        --f;
      }
      sim.peak_in_flight[a.stage] = std::max(sim.peak_in_flight[a.stage], f);
      sim.makespan = std::max(sim.makespan, t + d);
    }
    if (!running) {
      std::vector<std::string> stuck;
      for (int w = 0; w < n; ++w) {
        if (next[w] < schedule.actions[w].size()) {
          stuck.push_back(absl::StrCat("worker ", w, " at ", schedule.actions[w][next[w]].ToString()));
        }
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "schedule ", schedule.name, " cannot run: every worker waits (",
          absl::StrJoin(stuck, ", "), ")"));
    }
  }
  for (int w = 0; w < n; ++w) sim.idle[w] = sim.makespan - busy[w];
  return sim;
}

}  // namespace remora::pipeline
