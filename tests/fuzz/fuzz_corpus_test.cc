// The fuzzer's seed corpus: every seed is a valid frame that decodes, the
// checked-in seeds are make_fuzz_corpus's output, and truncated or
// bit-flipped seeds are errors, not crashes (a small deterministic fuzz that
// runs with the normal build; request_fuzzer does the real one).
#include <dirent.h>

#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/fuzz/request_decoder.h"
#include "tests/support/test_group.h"

namespace remora::fuzz {
namespace {

const std::string kCorpus = REMORA_FUZZ_CORPUS;

std::map<std::string, std::string> ReadDir(const std::string& dir) {
  std::map<std::string, std::string> files;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") files[name] = ReadFile(dir + "/" + name);
    }
    closedir(d);
  }
  return files;
}

TEST(FuzzCorpus, EverySeedDecodesInOneSliceAndInMany) {
  const auto seeds = ReadDir(kCorpus);
  EXPECT_GE(seeds.size(), 18u);
  for (const auto& [name, bytes] : seeds) {
    EXPECT_TRUE(DecodeRequestBytes(bytes).ok()) << name << ": " << DecodeRequestBytes(bytes);
    for (size_t slice : {1, 7, 64}) {
      absl::Status s = DecodeRequestBytes(bytes, slice);
      EXPECT_TRUE(s.ok()) << name << " in " << slice << "-byte slices: " << s;
    }
  }
}

TEST(FuzzCorpus, CheckedInSeedsAreTheGeneratorsOutput) {
  const std::string dir = TempPath("corpus");
  auto [code, out] = RunProgram({BinDir() + "/make_fuzz_corpus", "--out", dir});
  ASSERT_EQ(code, 0) << out;
  const auto made = ReadDir(dir), checked_in = ReadDir(kCorpus);
  ASSERT_EQ(made.size(), checked_in.size())
      << "regenerate: build/bin/make_fuzz_corpus --out tests/fuzz/corpus";
  for (const auto& [name, bytes] : made) {
    auto it = checked_in.find(name);
    ASSERT_NE(it, checked_in.end()) << name << " is not checked in";
    EXPECT_EQ(it->second, bytes) << name << " differs; regenerate the corpus";
  }
}

TEST(FuzzCorpus, TruncatedAndFlippedSeedsAreErrorsNotCrashes) {
  int decoded = 0, failed = 0;
  for (const auto& [name, bytes] : ReadDir(kCorpus)) {
    for (size_t n = 0; n < bytes.size(); ++n) {
      (DecodeRequestBytes(bytes.substr(0, n)).ok() ? decoded : failed)++;
    }
    for (size_t i = 0; i < bytes.size(); ++i) {
      for (unsigned char mask : {0x01, 0x80, 0xff}) {
        std::string flipped = bytes;
        flipped[i] = static_cast<char>(flipped[i] ^ mask);
        absl::Status whole = DecodeRequestBytes(flipped);
        absl::Status sliced = DecodeRequestBytes(flipped, 7);
        EXPECT_EQ(whole.code(), sliced.code()) << name << " byte " << i;
        (whole.ok() ? decoded : failed)++;
      }
    }
  }
  EXPECT_GT(failed, 0);
  std::cout << decoded << " variants decoded, " << failed << " were errors\n";
}

}  // namespace
}  // namespace remora::fuzz
