// Text as byte-level tokens (data/text.h): the token file and its reuse,
// the training windows drawn from (seed, epoch, row), the held-out tail,
// and the errors for text that cannot train a language model; and as a
// SentencePiece model's tokens (where Debian's sentencepiece is installed).
#include "data/text.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include <ATen/ops/arange.h>
#include <ATen/ops/equal.h>
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
  std::string tokens;
  for (int64_t i = 0; i < (*corpus)->size(); ++i) tokens += static_cast<char>((*corpus)->token(i));
  EXPECT_EQ(tokens, want);
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

// A model spm_train made of the text (the program of Debian's sentencepiece,
// which --tokenizer also runs); "" where it is not installed.
std::string TrainSentencePiece(const std::string& text, const std::string& prefix, int vocab) {
  if (std::system("command -v spm_train >/dev/null 2>&1") != 0) return "";
  const std::string command = "spm_train --input=" + text + " --model_prefix=" + prefix +
                              " --vocab_size=" + std::to_string(vocab) + " --model_type=bpe --minloglevel=2";
  if (std::system(command.c_str()) != 0) return "";
  return prefix + ".model";
}

// With a SentencePiece model the tokens are its ids (int32 in the token
// file), the vocabulary is its own, and the cache is written again when the
// model changes; encode and decode go round; a file that is not a model,
// or none, is an error naming it.
TEST(TextCorpus, ASentencePieceModelsTokensAreReadAndTheModelIsPartOfTheCache) {
  const std::string dir = TempPath("text_spm");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::string text;
  for (int i = 0; i < 60; ++i) {
    text += i % 3 == 0 ? "the master splits each batch into micro-batches.\n"
                       : "a worker holds its shard of the model and sends activations on.\n";
  }
  Spit(dir + "/book.txt", text);
  const std::string model = TrainSentencePiece(dir + "/book.txt", dir + "/spm", 100);
  if (model.empty()) GTEST_SKIP() << "spm_train (Debian's sentencepiece) is not installed";
  auto vocab = SentencePieceVocab(model);
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  EXPECT_EQ(*vocab, 100);
  auto corpus = TextCorpus::Open(dir + "/book.txt", dir + "/tokens", model);
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  EXPECT_EQ((*corpus)->vocab(), 100);
  EXPECT_EQ((*corpus)->tokenizer(), model);
  EXPECT_FALSE((*corpus)->reused_cache());
  // The first line's tokens, as spm_encode gives them; fewer than its bytes.
  auto line = SentencePieceEncode(model, "the master splits each batch into micro-batches.");
  ASSERT_TRUE(line.ok()) << line.status();
  ASSERT_GT(line->size(), 2u);
  EXPECT_LT(line->size(), 20u);  // (49 bytes)
  for (size_t i = 0; i < line->size(); ++i) EXPECT_EQ((*corpus)->token(static_cast<int64_t>(i)), (*line)[i]) << i;
  EXPECT_EQ(std::filesystem::file_size(dir + "/tokens"), static_cast<uintmax_t>((*corpus)->size()) * 4);
  EXPECT_LT((*corpus)->size(), static_cast<int64_t>(text.size()) / 3);
  auto back = SentencePieceDecode(model, *line);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, "the master splits each batch into micro-batches.");
  // Windows of ids, their labels one further.
  TextWindows windows(*corpus, {8, 0.0, 1}, true);
  ASSERT_TRUE(windows.Check().ok());
  auto batch = windows.Get(at::arange(3), 0);
  ASSERT_TRUE(batch.ok()) << batch.status();
  EXPECT_LT(batch->images.max().item<int64_t>(), 100);
  EXPECT_TRUE(at::equal(batch->images.slice(1, 1), batch->labels.slice(1, 0, 7)));
  // Reused with the same model; written again as bytes without it, and
  // again under it.
  EXPECT_TRUE((*TextCorpus::Open(dir + "/book.txt", dir + "/tokens", model))->reused_cache());
  auto bytes = TextCorpus::Open(dir + "/book.txt", dir + "/tokens");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_FALSE((*bytes)->reused_cache());
  EXPECT_EQ((*bytes)->size(), static_cast<int64_t>(text.size()));
  EXPECT_EQ((*bytes)->vocab(), 256);
  auto again = TextCorpus::Open(dir + "/book.txt", dir + "/tokens", model);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE((*again)->reused_cache());
  EXPECT_EQ((*again)->size(), (*corpus)->size());

  // Not a model; no such file.
  EXPECT_THAT(Message(TextCorpus::Open(dir + "/book.txt", dir + "/t2", dir + "/book.txt").status()),
              HasSubstr("--tokenizer " + dir + "/book.txt: spm_export_vocab failed"));
  EXPECT_THAT(Message(TextCorpus::Open(dir + "/book.txt", dir + "/t2", dir + "/book.txt").status()),
              HasSubstr("is it a SentencePiece model?"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/t2"));
  EXPECT_THAT(Message(SentencePieceVocab(dir + "/none.model").status()), HasSubstr("none.model: no such file"));
}

}  // namespace
}  // namespace remora::data
