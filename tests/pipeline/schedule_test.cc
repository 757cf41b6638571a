// Schedules as data, without sockets: every generator's orders hold each
// action once, respect the dependencies, and have the bubble and the live
// activations the formulas say; the planner predicts steps from measured
// times and picks the fastest schedule and micro-batch count.
#include "pipeline/schedule.h"

#include <algorithm>
#include <limits>
#include <random>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "pipeline/partition.h"
#include "pipeline/planner.h"
#include "pipeline/protocol.h"

namespace remora::pipeline {
namespace {

using ::testing::HasSubstr;

Simulation Sim(const std::string& name, int workers, int per_worker, int m) {
  auto s = MakeSchedule(name, workers, per_worker, m);
  EXPECT_TRUE(s.ok()) << s.status();
  auto sim = Simulate(*s);
  EXPECT_TRUE(sim.ok()) << name << " n=" << workers << " v=" << per_worker << " m=" << m << ": "
                        << sim.status() << "\n" << s->ToString();
  return sim.ok() ? *sim : Simulation{};
}

TEST(Schedule, GPipeAndOneFOneBHaveTheBubbleOfTheFormula) {
  // Unit-time forwards and backwards: a batch takes 2 (M + S - 1), each
  // worker idles 2 (S - 1) of it.
  for (const std::string name : {"gpipe", "1f1b"}) {
    for (int n : {1, 2, 3, 4}) {
      for (int m : {1, 2, 4, 8, 12}) {
        Simulation sim = Sim(name, n, 1, m);
        EXPECT_EQ(sim.makespan, 2 * (m + n - 1)) << name << " n=" << n << " m=" << m;
        for (int idle : sim.idle) EXPECT_EQ(idle, 2 * (n - 1)) << name;
      }
    }
  }
}

TEST(Schedule, OneFOneBBoundsLiveActivationsAndGPipeDoesNot) {
  for (int n : {2, 3, 4}) {
    for (int m : {1, 4, 8}) {
      Simulation f = Sim("1f1b", n, 1, m), g = Sim("gpipe", n, 1, m);
      for (int s = 0; s < n; ++s) {
        EXPECT_EQ(f.peak_in_flight[s], std::min(n - s, m)) << "1f1b n=" << n << " m=" << m << " s=" << s;
        EXPECT_EQ(g.peak_in_flight[s], m) << "gpipe";
      }
    }
  }
}

TEST(Schedule, OneFOneBAlternatesAfterItsWarmUp) {
  auto s = MakeSchedule("1f1b", 2, 1, 4).value();
  auto str = [](const std::vector<Action>& v) {
    std::string out;
    for (const auto& a : v) out += a.ToString() + " ";
    return out;
  };
  EXPECT_EQ(str(s.actions[0]), "F0@0 F1@0 B0@0 F2@0 B1@0 F3@0 B2@0 B3@0 ");
  EXPECT_EQ(str(s.actions[1]), "F0@1 B0@1 F1@1 B1@1 F2@1 B2@1 F3@1 B3@1 ");
}

TEST(Schedule, InterleavedShrinksTheBubbleByTheStagesPerWorker) {
  // Per virtual stage unit times: a batch takes 2 M V + 2 (n - 1), against
  // 2 M V + 2 V (n - 1) for GPipe over the same virtual stages.
  for (int n : {2, 3, 4}) {
    for (int v : {2, 3}) {
      for (int k : {1, 2, 3}) {
        const int m = k * n;
        Simulation sim = Sim("interleaved", n, v, m);
        EXPECT_EQ(sim.makespan, 2 * m * v + 2 * (n - 1)) << "n=" << n << " v=" << v << " m=" << m;
        Simulation g = Sim("gpipe", n, v, m);
        EXPECT_GE(g.makespan, sim.makespan);
      }
    }
  }
}

TEST(Schedule, EveryActionOnceOnItsStagesWorker) {
  for (const std::string name : {"gpipe", "interleaved"}) {
    auto s = MakeSchedule(name, 2, 2, 4).value();
    int count = 0;
    for (size_t w = 0; w < s.actions.size(); ++w) {
      for (const Action& a : s.actions[w]) {
        EXPECT_EQ(s.WorkerOf(a.stage), static_cast<int>(w));
        ++count;
      }
    }
    EXPECT_EQ(count, 2 * 4 * 4) << name;
  }
}

// ZB-H1 (zb1p): with F, B and W each taking a unit (1F1B's whole backward
// two), every worker idles S - 1 units a batch, a third of 1F1B's 3(S - 1),
// and no stage holds more micro-batches than 1F1B's first stage (S).
TEST(Schedule, ZeroBubbleH1CutsTheBubbleToAThirdAtOneFOneBsPeakMemory) {
  const ActionCosts unit{1, 1, 1};
  for (int S : {2, 3, 4}) {
    for (int M : {4, 8}) {
      SCOPED_TRACE(::testing::Message() << "S=" << S << " M=" << M);
      const Schedule zb = MakeSchedule("zb1p", S, 1, M).value();
      EXPECT_TRUE(zb.SplitsBackward());
      EXPECT_FALSE(MakeSchedule("1f1b", S, 1, M).value().SplitsBackward());
      auto z = Simulate(zb, unit);
      auto o = Simulate(MakeSchedule("1f1b", S, 1, M).value(), unit);
      ASSERT_TRUE(z.ok()) << z.status() << "\n" << zb.ToString();
      ASSERT_TRUE(o.ok()) << o.status();
      EXPECT_EQ(z->makespan, 3 * M + S - 1);
      EXPECT_EQ(o->makespan, 3 * (M + S - 1));
      for (int w = 0; w < S; ++w) {
        EXPECT_EQ(z->idle[w], S - 1) << "worker " << w;
        EXPECT_EQ(o->idle[w], 3 * (S - 1)) << "worker " << w;
        EXPECT_LE(z->peak_in_flight[w], S) << "stage " << w;
      }
      EXPECT_EQ(o->peak_in_flight[0], S);
      // Every W on its stage's worker after its own B (the simulator's
      // dependencies), and with unit times as well.
      EXPECT_TRUE(Simulate(zb).ok());
    }
  }
  EXPECT_EQ(MakeSchedule("zb1p", 3, 1, 4).value().actions[2][6].ToString(), "W0@2");
}

TEST(Schedule, ZeroBubbleVIdlesOnlyWhileTheFirstForwardFillsAtOneFOneBsPeakMemory) {
  // Units of half a 1F1B stage: a zbv worker's two stages are each half
  // as long, so 1F1B's stage takes 2 units for F and 4 for its backward.
  const ActionCosts unit{1, 1, 1}, whole{2, 2, 2};
  for (int n : {1, 2, 3, 4, 6}) {
    for (int M : {1, 2, 3, 4, 8, 16}) {
      SCOPED_TRACE(::testing::Message() << n << " workers, M=" << M);
      auto made = MakeSchedule("zbv", n, 2, M);
      ASSERT_TRUE(made.ok()) << made.status();
      const Schedule& v = *made;
      EXPECT_TRUE(v.SplitsBackward());
      // The V: worker w holds stage w and stage 2n - 1 - w; worker 0 the
      // first and the last.
      for (int k = 0; k < 2 * n; ++k) EXPECT_EQ(v.WorkerOf(k), k < n ? k : 2 * n - 1 - k) << "stage " << k;
      auto z = Simulate(v, unit);
      ASSERT_TRUE(z.ok()) << z.status() << "\n" << v.ToString();
      EXPECT_TRUE(Simulate(v).ok());
      // What a worker holds between a forward and its W, walking its order.
      for (int w = 0; w < n; ++w) {
        int held = 0, most = 0;
        for (const Action& a : v.actions[w]) {
          held += a.kind == Action::kForward ? 1 : a.kind == Action::kWeight ? -1 : 0;
          most = std::max(most, held);
        }
        EXPECT_LE(most, 2 * n) << "worker " << w;  // 1F1B's worker 0: n whole stages
      }
      if (n == 1) continue;
      auto o = Simulate(MakeSchedule("1f1b", n, 1, M).value(), whole);
      ASSERT_TRUE(o.ok()) << o.status();
      EXPECT_LT(z->makespan, o->makespan);
      if (M >= 2 * n) {
        // The floor: the last worker's first forward starts at n - 1.
        EXPECT_EQ(z->makespan, 6 * M + n - 1);
        for (int w = 0; w < n; ++w) {
          EXPECT_EQ(z->idle[w], n - 1) << "worker " << w;
          EXPECT_EQ(o->idle[w], 6 * (n - 1)) << "worker " << w;
        }
      }
    }
  }
  EXPECT_EQ(MakeSchedule("zbv", 2, 2, 4).value().actions[1].front().ToString(), "F0@1");
  EXPECT_THAT(std::string(MakeSchedule("zbv", 2, 1, 4).status().message()),
              HasSubstr("schedule zbv runs two stages per worker (a V), not 1"));
}

TEST(Schedule, BadShapesAndNamesAreClearErrors) {
  auto one = MakeSchedule("1f1b", 2, 2, 4);
  ASSERT_FALSE(one.ok());
  EXPECT_NE(one.status().message().find("interleaved"), std::string::npos) << one.status();
  auto groups = MakeSchedule("interleaved", 2, 2, 3);
  ASSERT_FALSE(groups.ok());
  EXPECT_NE(groups.status().message().find("multiple of 2"), std::string::npos) << groups.status();
  auto unknown = MakeSchedule("zigzag", 2, 1, 4);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("gpipe, 1f1b, interleaved"), std::string::npos);
  EXPECT_FALSE(MakeSchedule("gpipe", 0, 1, 4).ok());
  EXPECT_FALSE(MakeSchedule("zb1p", 2, 2, 4).ok());
  // A W that takes no time is no action.
  EXPECT_FALSE(Simulate(MakeSchedule("zb1p", 2, 1, 4).value(), ActionCosts{1, 1, 0}).ok());
}

TEST(Schedule, SimulateFindsOrdersThatCannotRunAndMissingActions) {
  auto s = MakeSchedule("1f1b", 2, 1, 2).value();
  // Worker 1 wants B1 before F1: F1's backward can never come first.
  std::swap(s.actions[1][2], s.actions[1][3]);
  auto sim = Simulate(s);
  ASSERT_FALSE(sim.ok());
  EXPECT_NE(sim.status().message().find("cannot run"), std::string::npos) << sim.status();
  auto t = MakeSchedule("gpipe", 2, 1, 2).value();
  t.actions[0].pop_back();
  EXPECT_FALSE(Simulate(t).ok());
  auto u = MakeSchedule("gpipe", 2, 1, 2).value();
  u.actions[0].push_back(u.actions[0].front());
  EXPECT_FALSE(Simulate(u).ok());
  // A split schedule without one of its W's, and one whose W comes before
  // its B.
  auto v = MakeSchedule("zb1p", 2, 1, 2).value();
  v.actions[1].pop_back();
  auto missing = Simulate(v);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("a forward, an input backward B and a weight backward W each"),
            std::string::npos)
      << missing.status();
  auto x = MakeSchedule("zb1p", 2, 1, 2).value();
  auto& last = x.actions[1];  // F0 B0 F1 B1 W0 W1, made F0 B0 F1 W1 W0 B1
  std::swap(last[3], last[5]);
  EXPECT_FALSE(Simulate(x).ok()) << x.ToString();
}

// A worker's order as make_runner and set_order carry it, and back.
TEST(Schedule, OrdersCrossTheWireAsTriplesAndBadOnesAreNamed) {
  const Schedule zb = MakeSchedule("zbv", 2, 2, 4).value();
  const std::vector<int64_t> flat = EncodeOrder(zb.actions[1]);
  ASSERT_EQ(flat.size(), 3 * zb.actions[1].size());
  const std::vector<runtime::LaneAction> lane = DecodeOrder(flat, 7, "remora.pipeline.set_order");
  ASSERT_EQ(lane.size(), zb.actions[1].size());
  for (size_t i = 0; i < lane.size(); ++i) {
    const Action& a = zb.actions[1][i];
    EXPECT_EQ(lane[i],
              (runtime::LaneAction{7, a.stage, a.micro_batch, a.kind != Action::kForward, a.kind == Action::kWeight}))
        << a.ToString();
  }
  try {
    DecodeOrder({1, 0}, -1, "remora.pipeline.make_runner");
    ADD_FAILURE() << "two numbers decoded";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("remora.pipeline.make_runner: order holds 2 numbers, not triples"));
  }
  try {
    DecodeOrder({1, 0, 0, 1, 0, 3}, -1, "remora.pipeline.set_order");
    ADD_FAILURE() << "kind 3 decoded";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("action 1 of order has kind 3, not 0 (forward), 1 (backward) or 2 (weights)"));
  }
}

// --- the planner (pipeline/planner.h) -------------------------------------------

TEST(Planner, PredictGivesTheSimulatorsRunWithUnitTimes) {
  for (const std::string name : {"gpipe", "1f1b", "interleaved", "zb1p", "zbv"}) {
    const int per_worker = name == "interleaved" || name == "zbv" ? 2 : 1;
    for (int n : {1, 2, 3, 4}) {
      for (int m : {1, 2, 4, 8, 12}) {
        absl::StatusOr<Schedule> s = MakeSchedule(name, n, per_worker, m);
        if (!s.ok()) continue;  // (interleaved: m a multiple of n)
        const Simulation sim = Simulate(*s).value();
        const bool split = s->SplitsBackward();
        const Timing t =
            Predict(*s, std::vector<StageTimes>(s->stages, StageTimes{1, 1, split ? 1.0 : 0.0}), 0).value();
        EXPECT_EQ(t.makespan_ms, sim.makespan) << name << " n=" << n << " m=" << m;
        ASSERT_EQ(t.idle_ms.size(), sim.idle.size());
        for (int w = 0; w < n; ++w) EXPECT_EQ(t.idle_ms[w], sim.idle[w]) << name << " n=" << n << " m=" << m;
        EXPECT_EQ(t.peak_in_flight, sim.peak_in_flight) << name << " n=" << n << " m=" << m;
      }
    }
  }
}

TEST(Planner, ACrossingDelaysEveryHopBetweenWorkersAndNoOtherAction) {
  // One micro-batch, two workers: F on 0, crossing, F on 1, B on 1,
  // crossing, B on 0.
  const Schedule one = MakeSchedule("1f1b", 2, 1, 1).value();
  const Timing t = Predict(one, {{2, 3, 0}, {2, 3, 0}}, 0.5).value();
  EXPECT_DOUBLE_EQ(t.makespan_ms, 2 + 0.5 + 2 + 3 + 0.5 + 3);
  EXPECT_DOUBLE_EQ(t.idle_ms[0], 11 - 5);
  EXPECT_DOUBLE_EQ(t.bubble(), 6.0 * 2 / (11 * 2));
  // zbv on one worker: both stages there, nothing crosses.
  const Schedule v = MakeSchedule("zbv", 1, 2, 3).value();
  EXPECT_DOUBLE_EQ(Predict(v, {{1, 1, 1}, {1, 1, 1}}, 100).value().makespan_ms, 2 * 3 * 3);
  EXPECT_THAT(Predict(one, {{1, 1, 0}}, 0).status().message(), HasSubstr("1 stage times for the 2 stages"));
  EXPECT_FALSE(Predict(one, {{1, 1, 0}, {1, 1, 0}}, -1).ok());
}

// The predicted step of `schedule` with layers [bounds[k], bounds[k + 1])
// as stage k, each layer's F, B and W a third of `costs`.
double StepOfCut(const Schedule& schedule, const std::vector<double>& costs, const std::vector<int>& bounds) {
  std::vector<StageTimes> stages(schedule.stages);
  for (int k = 0; k < schedule.stages; ++k) {
    for (int i = bounds[k]; i < bounds[k + 1]; ++i) {
      stages[k] = {stages[k].forward_ms + costs[i] / 3, stages[k].input_ms + costs[i] / 3,
                   stages[k].weight_ms + costs[i] / 3};
    }
  }
  return Predict(schedule, stages, 0).value().makespan_ms;
}

TEST(Planner, AVsCutBalancesWorkersWhereBalancedStagesLeaveOneBusier) {
  // (Few layers: PredictedSplit tries every cut.) Stages balanced one by
  // one, [4] [1 4] [2 3] [3], put 10 on the middle worker of zbv's V
  // (stages 1 and 2) and 7 on the other; [4 1] [4] [2 3] [3] puts 9 and 8.
  const std::vector<double> costs = {4, 1, 4, 2, 3, 3};
  const Schedule v = MakeSchedule("zbv", 2, 2, 4).value();
  std::vector<StageTimes> layers;
  for (double c : costs) layers.push_back({c / 3, c / 3, c / 3});
  const std::vector<int> balanced = BalancedSplit(costs, 4).value();
  ASSERT_EQ(balanced, (std::vector<int>{0, 1, 3, 5, 6}));
  const std::vector<int> cut = PredictedSplit(v, layers, 0).value();
  EXPECT_EQ(cut, (std::vector<int>{0, 2, 3, 5, 6}));
  EXPECT_LT(StepOfCut(v, costs, cut), 0.95 * StepOfCut(v, costs, balanced));
  // No cut one layer from it is predicted shorter, and on uniform layers
  // it stays the balanced one.
  const double best = StepOfCut(v, costs, cut);
  for (int k = 1; k < 4; ++k) {
    for (int by : {-1, 1}) {
      std::vector<int> b = cut;
      b[k] += by;
      if (b[k] > b[k - 1] && b[k] < b[k + 1]) EXPECT_GE(StepOfCut(v, costs, b), best) << k << " " << by;
    }
  }
  const std::vector<StageTimes> even(8, StageTimes{1, 1, 1});
  EXPECT_EQ(PredictedSplit(v, even, 0).value(), (std::vector<int>{0, 2, 4, 6, 8}));
  EXPECT_FALSE(PredictedSplit(v, std::vector<StageTimes>(3, StageTimes{1, 1, 1}), 0).ok());  // (4 stages)
}

TEST(Planner, AVsCutOfManyLayersClimbsToNearTheBestOne) {
  // 40 layers in four stages have 9,139 cuts, beyond what PredictedSplit
  // tries one by one: it climbs from the balanced stages. Every cut, tried
  // here, says how near it gets.
  std::mt19937 random(11);
  const Schedule v = MakeSchedule("zbv", 2, 2, 4).value();
  for (int model = 0; model < 3; ++model) {
    std::vector<double> costs;
    std::vector<StageTimes> layers;
    for (int i = 0; i < 40; ++i) {
      costs.push_back(3.0 + static_cast<double>(random() % 30));
      layers.push_back({costs.back() / 3, costs.back() / 3, costs.back() / 3});
    }
    double best = std::numeric_limits<double>::infinity();
    for (int a = 1; a < 40; ++a) {
      for (int b = a + 1; b < 40; ++b) {
        for (int c = b + 1; c < 40; ++c) best = std::min(best, StepOfCut(v, costs, {0, a, b, c, 40}));
      }
    }
    const double climbed = StepOfCut(v, costs, PredictedSplit(v, layers, 0).value());
    EXPECT_LE(climbed, StepOfCut(v, costs, BalancedSplit(costs, 4).value())) << model;
    EXPECT_LE(climbed, 1.03 * best) << model;
  }
}

TEST(Planner, FitsALineThroughTwoTimingsAndNeverANegativeCost) {
  const std::vector<LayerCost> fit = FitLayerCosts({3, 1}, 4, {9, 0.5}, 16).value();
  ASSERT_EQ(fit.size(), 2u);
  EXPECT_DOUBLE_EQ(fit[0].per_row_ms, 0.5);
  EXPECT_DOUBLE_EQ(fit[0].fixed_ms, 1);
  EXPECT_DOUBLE_EQ(fit[0].at(32), 17);
  EXPECT_DOUBLE_EQ(fit[1].per_row_ms, 0);  // (cheaper at more rows: noise)
  EXPECT_DOUBLE_EQ(fit[1].fixed_ms, 1);
  // Dearer per row than in all (a negative fixed cost): through 0.
  const LayerCost steep = FitLayerCosts({9}, 16, {1}, 4).value()[0];
  EXPECT_DOUBLE_EQ(steep.fixed_ms, 0);
  EXPECT_DOUBLE_EQ(steep.per_row_ms, 9.0 / 16);
  EXPECT_THAT(FitLayerCosts({1}, 4, {1, 2}, 8).status().message(), HasSubstr("1 timings at 4 rows but 2 at 8"));
  EXPECT_FALSE(FitLayerCosts({1}, 4, {2}, 4).ok());
}

TEST(Planner, TimedPartsGiveEachLayersSharesOfForwardBAndW) {
  // Layer 0: F 2, B 1, W 1 at 4 rows and F 4, B 2, W 2 at 8; layer 1 has
  // no weights to take gradients of (W 0); layer 2 was timed at 0.
  const LayerTimes at_4{{2, 1, 0}, {1, 3, 0}, {1, 0, 0}};
  const LayerTimes at_8{{4, 2, 0}, {2, 6, 0}, {2, 0, 0}};
  EXPECT_EQ(at_8.Total(), (std::vector<double>{8, 8, 0}));
  const std::vector<LayerCost> fit = FitLayerCosts(at_4, 4, at_8, 8).value();
  ASSERT_EQ(fit.size(), 3u);
  EXPECT_DOUBLE_EQ(fit[0].per_row_ms, 1);  // (the line through the totals)
  EXPECT_DOUBLE_EQ(fit[0].fixed_ms, 0);
  EXPECT_DOUBLE_EQ(fit[0].forward_share, 0.5);
  EXPECT_DOUBLE_EQ(fit[0].input_share, 0.25);
  EXPECT_DOUBLE_EQ(fit[0].weight_share(), 0.25);
  EXPECT_DOUBLE_EQ(fit[1].forward_share, 0.25);
  EXPECT_DOUBLE_EQ(fit[1].weight_share(), 0);
  EXPECT_DOUBLE_EQ(fit[2].forward_share, 1.0 / 3);  // (nothing timed: a third each)
  EXPECT_THAT(FitLayerCosts(LayerTimes{{1}, {1}, {}}, 4, at_8, 8).status().message(),
              HasSubstr("1 forward timings but 1 of B and 0 of W"));
  EXPECT_THAT(FitLayerCosts(LayerTimes{{1}, {-1}, {1}}, 4, LayerTimes{{1}, {1}, {1}}, 8).status().message(),
              HasSubstr("layer 0 timed below 0 ms"));
}

TEST(Planner, WeightGradientsTheZeroBubbleSchedulesCanMoveAreWhatTheyGain) {
  // The same cost per layer, once with a third of it in W and once with
  // none (a backward that does not split): 1F1B runs B and W as one
  // backward and predicts the same step either way; ZB-H1 fills its
  // bubble with W, so it gains only where there is W to move.
  PlanOptions o;
  o.workers = 2;
  o.batch_rows = 16;
  o.micro_batches = {4};
  o.schedules = {"1f1b", "zb1p"};
  LayerCost thirds{0, 0.75};
  LayerCost no_w = thirds;
  no_w.input_share = 2.0 / 3;
  const Plan split = MakePlan(std::vector<LayerCost>(4, thirds), o).value();
  const Plan whole = MakePlan(std::vector<LayerCost>(4, no_w), o).value();
  ASSERT_EQ(split.candidates.size(), 2u);
  EXPECT_NEAR(split.candidates[0].step_ms, whole.candidates[0].step_ms, 1e-9);
  EXPECT_LT(split.candidates[1].step_ms, split.candidates[0].step_ms) << split.Describe();
  EXPECT_LT(split.candidates[1].step_ms, whole.candidates[1].step_ms) << whole.Describe();
  EXPECT_EQ(split.best().schedule, "zb1p");
}

TEST(Planner, FixedCostsPerActionChooseFewMicroBatchesAndRowCostsMany) {
  PlanOptions o;
  o.workers = 2;
  o.batch_rows = 64;
  o.micro_batches = {1, 2, 4, 8};
  o.crossing_ms = 1;
  // Each action mostly a fixed cost: more micro-batches only add to it.
  const Plan fixed = MakePlan(std::vector<LayerCost>(8, LayerCost{10, 0.001}), o).value();
  EXPECT_EQ(fixed.best().micro_batches, 1) << fixed.Describe();
  // Costs in proportion to rows and nothing to cross: the most
  // micro-batches, and the schedule that idles least; each schedule's
  // steps shrink with more of them.
  o.crossing_ms = 0;
  const Plan rows = MakePlan(std::vector<LayerCost>(8, LayerCost{0, 0.1}), o).value();
  EXPECT_EQ(rows.best().micro_batches, 8) << rows.Describe();
  EXPECT_EQ(rows.best().schedule, "zbv") << rows.Describe();
  for (const Candidate& c : rows.candidates) {
    if (c.schedule == "interleaved" && c.micro_batches == 1) {
      EXPECT_THAT(c.why_not, HasSubstr("do not divide into groups of 2"));
      continue;
    }
    ASSERT_TRUE(c.why_not.empty()) << c.why_not;
    EXPECT_LE(rows.best().step_ms, c.step_ms) << rows.Describe();
    if (c.schedule == "1f1b" && c.micro_batches == 8) {
      EXPECT_LT(rows.best().bubble, c.bubble);
    }
    if (c.micro_batches > 1 && !(c.schedule == "interleaved" && c.micro_batches == 2)) {
      const Candidate& fewer = rows.candidates[&c - rows.candidates.data() - 1];
      EXPECT_LT(c.step_ms, fewer.step_ms) << c.schedule << " at " << c.micro_batches;
    }
  }
  // The cut is the balanced one: four stages of two layers each for zbv.
  EXPECT_EQ(rows.best().bounds, (std::vector<int>{0, 2, 4, 6, 8}));
  // Its busiest stage holds 3 micro-batches of 8 rows (each worker at most
  // 2n = 4 over its two stages).
  EXPECT_EQ(rows.best().peak_rows, 3 * 8) << rows.Describe();
  EXPECT_THAT(rows.Describe(), HasSubstr("* zbv"));
}

TEST(Planner, PairsThatCannotRunSayWhyAndNoneAtAllIsAnError) {
  PlanOptions o;
  o.workers = 2;
  o.batch_rows = 4;
  o.micro_batches = {3, 8};
  const Plan plan = MakePlan(std::vector<LayerCost>(3, LayerCost{1, 1}), o).value();
  ASSERT_EQ(plan.candidates.size(), 8u);
  // (zb1p: its W's fill 1F1B's drain.)
  EXPECT_EQ(plan.best().schedule, "zb1p") << plan.Describe();
  EXPECT_EQ(plan.best().micro_batches, 3);
  const std::string table = plan.Describe();
  EXPECT_THAT(table, HasSubstr("interleaved       3  cannot run: 4 stages need 4 layers; the model has 3"));
  EXPECT_THAT(table, HasSubstr("1f1b              8  cannot run: more micro-batches than the batch's 4 rows"));
  // Stages per worker given: every schedule cut so (zbv takes only two).
  o.micro_batches = {2};
  o.stages_per_worker = 3;
  const Plan three = MakePlan(std::vector<LayerCost>(6, LayerCost{1, 1}), o).value();
  EXPECT_EQ(three.best().bounds.size(), 7u) << three.Describe();
  EXPECT_THAT(three.Describe(), HasSubstr("zbv               2  cannot run: "));
  o.stages_per_worker = 0;
  o.micro_batches = {3, 8};
  const absl::StatusOr<Plan> none = MakePlan({LayerCost{1, 1}}, o);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("no schedule and micro-batch count can run: 1f1b at 3 micro-batches: "
                                                 "2 stages need 2 layers; the model has 1"));
}

}  // namespace
}  // namespace remora::pipeline
