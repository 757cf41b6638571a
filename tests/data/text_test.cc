// Text as byte-level tokens (data/text.h): the token file and its reuse,
// the training windows drawn from (seed, epoch, row), the held-out tail,
// and the errors for text that cannot train a language model.
#include "data/text.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include <ATen/ops/arange.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/support/test_group.h"

namespace remora::data {
namespace {

using ::testing::HasSubstr;

void Spit(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(TextCorpus, TokensAreTheFilesBytesAndTheCacheIsReusedUntilTheTextChanges) {
  const std::string dir = TempPath("text_corpus");
  std::filesystem::create_directories(dir + "/books");
  Spit(dir + "/books/b.txt", "second");
  Spit(dir + "/books/a.txt", "h\xC3\xA9llo");  // (a two-byte character)
  Spit(dir + "/books/skip.md", "not text");
  auto corpus = TextCorpus::Open(dir + "/books", dir + "/tokens");
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_FALSE((*corpus)->reused_cache());
  const std::string want = "h\xC3\xA9llo\nsecond";  // name order, a newline between
  ASSERT_EQ((*corpus)->size(), static_cast<int64_t>(want.size()));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*corpus)->tokens()), want.size()), want);
  EXPECT_EQ((*corpus)->vocab(), 256);
  auto again = TextCorpus::Open(dir + "/books", dir + "/tokens");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE((*again)->reused_cache());
  Spit(dir + "/books/b.txt", "second, longer");
  auto changed = TextCorpus::Open(dir + "/books", dir + "/tokens");
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_FALSE((*changed)->reused_cache());
  EXPECT_EQ((*changed)->size(), static_cast<int64_t>(want.size() + 8));
}

TEST(TextWindows, TrainingWindowsComeFromSeedEpochAndRowAndLabelsAreTheNextTokens) {
  const std::string dir = TempPath("text_windows");
  std::filesystem::create_directories(dir);
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>('a' + i % 26);
  Spit(dir + "/t.txt", text);
  auto corpus = TextCorpus::Open(dir + "/t.txt", dir + "/tokens");
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  TextWindows train(*corpus, {/*seq_len=*/16, /*val_fraction=*/0.1, /*seed=*/7}, /*train=*/true);
  TextWindows val(*corpus, {16, 0.1, 7}, /*train=*/false);
  ASSERT_TRUE(train.Check().ok());
  EXPECT_EQ(train.size(), (900 - 1) / 16);
  EXPECT_EQ(val.size(), (100 - 1) / 16);
  const at::Tensor rows = at::arange(train.size());
  auto b = train.Get(rows, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->images.sizes(), (std::vector<int64_t>{train.size(), 16}));
  EXPECT_TRUE(b->labels.narrow(1, 0, 15).equal(b->images.narrow(1, 1, 15)));
  std::set<int64_t> starts;
  for (int64_t r = 0; r < train.size(); ++r) {
    const int64_t s = train.Start(r, 1);
    EXPECT_GE(s, 0);
    EXPECT_LE(s + 16, 900);  // its labels too stay out of the held-out tail
    EXPECT_EQ(b->images[r][0].item<int64_t>(), 'a' + s % 26);
    starts.insert(s);
  }
  EXPECT_GT(starts.size(), static_cast<size_t>(train.size()) / 2);  // spread, not one place
  EXPECT_TRUE(train.Get(rows, 1)->images.equal(b->images));         // the same whenever asked
  EXPECT_FALSE(train.Get(rows, 2)->images.equal(b->images));        // another epoch, other windows
  TextWindows other_seed(*corpus, {16, 0.1, 8}, true);
  EXPECT_FALSE(other_seed.Get(rows, 1)->images.equal(b->images));
  // The held-out windows tile the tail, alike every epoch.
  for (int64_t r = 0; r < val.size(); ++r) EXPECT_EQ(val.Start(r, 3), 900 + 16 * r);
  EXPECT_TRUE(val.Get(at::arange(val.size()), 1)->images.equal(val.Get(at::arange(val.size()), 5)->images));
  EXPECT_THAT(Message(train.Get(at::arange(train.size() + 1), 1).status()), HasSubstr("window 56 of 56"));
}

TEST(TextCorpus, TextThatCannotTrainIsAnErrorSayingWhy) {
  const std::string dir = TempPath("text_errors");
  std::filesystem::create_directories(dir + "/none");
  Spit(dir + "/empty.txt", "");
  Spit(dir + "/latin1.txt", "caf\xE9 au lait");
  Spit(dir + "/cut.txt", "ok \xE2\x82");
  Spit(dir + "/short.txt", "tiny");
  EXPECT_THAT(Message(TextCorpus::Open(dir + "/empty.txt", dir + "/t1").status()), HasSubstr("is empty"));
  EXPECT_THAT(Message(TextCorpus::Open(dir + "/latin1.txt", dir + "/t2").status()),
              HasSubstr("is not UTF-8: byte 3 "));
  EXPECT_THAT(Message(TextCorpus::Open(dir + "/cut.txt", dir + "/t3").status()), HasSubstr("byte 3 "));
  EXPECT_THAT(Message(TextCorpus::Open(dir + "/missing.txt", dir + "/t4").status()),
              HasSubstr("no such file or directory"));
  EXPECT_THAT(Message(TextCorpus::Open(dir + "/none", dir + "/t5").status()), HasSubstr("without .txt files"));
  auto tiny = TextCorpus::Open(dir + "/short.txt", dir + "/t6");
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  TextWindows long_windows(*tiny, {16, 0.0, 0}, true);
  EXPECT_THAT(Message(long_windows.Check()), HasSubstr("--seq-len 16 needs 17 tokens in the training part"));
  EXPECT_FALSE(long_windows.Get(at::arange(1), 1).ok());
  TextWindows no_tail(*tiny, {2, 0.1, 0}, false);
  EXPECT_THAT(Message(no_tail.Check()), HasSubstr("the held-out tail (--val-fraction)"));
}

}  // namespace
}  // namespace remora::data
