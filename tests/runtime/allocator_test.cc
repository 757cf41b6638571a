// The caching CPU allocator that master and worker install: it counts the
// bytes alive and per tag, hands a freed block out again for the same size,
// and puts blocks of 2 MiB and more on mappings of their own, 2 MiB-aligned
// and advised onto transparent huge pages.
#include "runtime/allocator.h"

#include <cstdint>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <gtest/gtest.h>

namespace remora::runtime {
namespace {

// The allocator is process-wide: installed once for this program's tests.
void Install() {
  static const bool installed = [] {
    InstallCachingCpuAllocator();
    return true;
  }();
  (void)installed;
}

// The lines of /proc/self/smaps for the mapping that holds `address`.
std::string MappingOf(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const uintptr_t at = reinterpret_cast<uintptr_t>(address);
  std::string line, block;
  bool in = false;
  while (std::getline(smaps, line)) {
    uintptr_t from = 0, to = 0;
    char dash = 0;
    std::istringstream head(line);
    // A mapping's first line: "from-to perms offset dev inode [path]".
    if (head >> std::hex >> from >> dash >> to && dash == '-' && line.find(':') > line.find(' ')) {
      if (in) break;
      in = from <= at && at < to;
    }
    if (in) block += line + "\n";
  }
  return block;
}

// The kernel's transparent huge page mode: "always", "madvise" or "never"
// (the bracketed one); empty where the kernel has none.
std::string HugePageMode() {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string text;
  std::getline(file, text);
  const size_t open = text.find('['), close = text.find(']');
  return open == std::string::npos || close == std::string::npos ? "" : text.substr(open + 1, close - open - 1);
}

TEST(CachingCpuAllocator, CountsTheBytesAliveAndPerTag) {
  Install();
  const int64_t before = CpuBytesInUse();
  ASSERT_GE(before, 0);
  int64_t during = 0;
  {
    ScopedAllocationTag tag(7);
    at::Tensor t = at::empty({1 << 18}, at::kFloat);  // 1 MiB
    during = CpuBytesInUse();
    EXPECT_GE(during - before, int64_t{1} << 20);
    EXPECT_GE(TaggedBytes(7), int64_t{1} << 20);
  }
  EXPECT_EQ(TaggedBytes(7), 0);
  EXPECT_EQ(CpuBytesInUse(), before);
}

TEST(CachingCpuAllocator, AFreedBlockIsHandedOutAgainForTheSameSize) {
  Install();
  const void* first = nullptr;
  {
    at::Tensor t = at::empty({3 << 18}, at::kFloat);  // 3 MiB
    first = t.data_ptr();
  }
  at::Tensor again = at::empty({3 << 18}, at::kFloat);
  EXPECT_EQ(again.data_ptr(), first);
}

TEST(CachingCpuAllocator, BlocksOf2MiBAndMoreAreOnHugePages) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "under AddressSanitizer large blocks stay its allocator's";
#endif
  Install();
  at::Tensor big = at::ones({5 << 18}, at::kFloat);  // 5 MiB, written
  // The block's header sits 64 bytes before the data, at the mapping's start.
  const uintptr_t data = reinterpret_cast<uintptr_t>(big.data_ptr());
  EXPECT_EQ((data - 64) % (uintptr_t{2} << 20), 0u) << std::hex << data;
  const std::string mapping = MappingOf(big.data_ptr());
  ASSERT_FALSE(mapping.empty()) << "no mapping in /proc/self/smaps holds the tensor";
  const std::string mode = HugePageMode();
  if (mode.empty() || mode == "never") GTEST_SKIP() << "transparent huge pages are off here (" << mode << ")";
  // Advised (VmFlags "hg"), and the kernel would back it with huge pages.
  EXPECT_TRUE(std::regex_search(mapping, std::regex("\nVmFlags:.* hg( |\n)"))) << mapping;
  EXPECT_TRUE(std::regex_search(mapping, std::regex("\nTHPeligible: +1\n"))) << mapping;
}

}  // namespace
}  // namespace remora::runtime
