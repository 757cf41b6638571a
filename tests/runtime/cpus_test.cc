// runtime/cpus.h: --cpus lists parsed (bad ones named), shares of a host's
// cores, and a whole process pinned, its running threads as well.
#include "runtime/cpus.h"

#include <unistd.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/support/proc.h"

namespace remora::runtime {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<int> Cores(int n) {
  std::vector<int> cores;
  for (int c = 0; c < n; ++c) cores.push_back(c);
  return cores;
}

TEST(Cpus, ListsParseAsLinuxWritesThem) {
  EXPECT_THAT(ParseCpuList("0-3,8", Cores(16)).value(), ElementsAre(0, 1, 2, 3, 8));
  EXPECT_THAT(ParseCpuList("7,2", Cores(16)).value(), ElementsAre(2, 7));
  EXPECT_THAT(ParseCpuList("5", Cores(16)).value(), ElementsAre(5));
  EXPECT_EQ(CpuListText({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(CpuListText({4}), "4");
  EXPECT_EQ(CpuListText({}), "");
}

TEST(Cpus, BadListsAreErrorsNamingWhatIsWrong) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "no cores"},
      {"x", "'x' is not a core or a range of cores"},
      {"0-", "'0-' is not a core"},
      {"1,,2", "'' is not a core"},
      {"-1", "'-1' is not a core"},
      {"3-1", "the range 3-1 runs backwards"},
      {"0-2,1", "core 1 is given twice"},
      {"0,9", "core 9 is not one this process may run on (0-3)"},
  };
  for (const auto& [text, why] : bad) {
    auto parsed = ParseCpuList(text, Cores(4));
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_THAT(parsed.status().message(), HasSubstr(absl::StrCat("--cpus '", text, "': ", why))) << text;
  }
}

TEST(Cpus, SharesAreConsecutiveAndEvenAndRoundRobinBeyondTheCores) {
  EXPECT_THAT(ShareOfCpus(Cores(4), 0, 2), ElementsAre(0, 1));
  EXPECT_THAT(ShareOfCpus(Cores(4), 1, 2), ElementsAre(2, 3));
  EXPECT_THAT(ShareOfCpus({2, 5, 6}, 1, 3), ElementsAre(5));
  EXPECT_THAT(ShareOfCpus(Cores(4), 0, 3), ElementsAre(0));
  EXPECT_THAT(ShareOfCpus(Cores(4), 2, 3), ElementsAre(2, 3));
  EXPECT_THAT(ShareOfCpus(Cores(2), 2, 3), ElementsAre(0));  // more workers than cores
  EXPECT_TRUE(ShareOfCpus(Cores(2), 1, 1).empty());  // (an index past the count)
  EXPECT_TRUE(ShareOfCpus({}, 0, 2).empty());
}

// Cpus_allowed_list of each thread of this process, by thread id.
std::map<int, std::string> ThreadCpus() { return test_support::ThreadStatus(getpid(), "Cpus_allowed_list:"); }

TEST(Cpus, PinningMovesEveryRunningThreadAndThoseStartedLater) {
  const std::vector<int> all = AllowedCpus();
  ASSERT_FALSE(all.empty());
  // A thread already running, waiting to be let go.
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  std::thread waiting([&] {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return go; });
  });
  ASSERT_TRUE(PinProcessToCpus({all.back()}).ok());
  const std::string one = CpuListText({all.back()});
  for (const auto& [tid, cpus] : ThreadCpus()) EXPECT_EQ(cpus, one) << "thread " << tid;
  std::vector<int> later_cpus;
  std::thread later([&later_cpus] { later_cpus = AllowedCpus(); });
  later.join();
  EXPECT_EQ(later_cpus, std::vector<int>{all.back()});
  {
    std::lock_guard<std::mutex> lock(mu);
    go = true;
  }
  cv.notify_all();
  waiting.join();
  ASSERT_TRUE(PinProcessToCpus(all).ok());  // (as it was, for the tests after this one)
  for (const auto& [tid, cpus] : ThreadCpus()) EXPECT_EQ(cpus, CpuListText(all)) << "thread " << tid;
}

}  // namespace
}  // namespace remora::runtime
