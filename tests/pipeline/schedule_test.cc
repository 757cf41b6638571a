// Schedules as data, without sockets: every generator's orders hold each
// action once, respect the dependencies, and have the bubble and the live
// activations the formulas say.
#include "pipeline/schedule.h"

#include <gtest/gtest.h>

namespace remora::pipeline {
namespace {

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
}

}  // namespace
}  // namespace remora::pipeline
