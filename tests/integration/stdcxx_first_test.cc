// Programs bind libstdc++'s own code, not a copy that a library linked
// before it exports (a PyTorch wheel's libtorch_cpu.so exports all of
// std::filesystem; cmake/StdcxxFirst.cmake): this test links a library
// whose std::filesystem::status says every path is a regular file.
#include <filesystem>

#include <gtest/gtest.h>

extern "C" int remora_stdcxx_copy_linked();

TEST(StdcxxFirst, ACopyOfLibstdcxxInALinkedLibraryIsNotTheOneBound) {
  ASSERT_EQ(remora_stdcxx_copy_linked(), 1);  // the library is loaded
  // The copy would say that a path that does not exist does.
  EXPECT_FALSE(std::filesystem::exists("/nonexistent/remora/stdcxx_first"));
  EXPECT_TRUE(std::filesystem::is_directory("/"));
}
