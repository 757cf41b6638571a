// master's flags for the built-in GPT (--dataset text:PATH), in this
// process: what sizes it, its defaults, its parts over the stages, and the
// errors for what does not fit it.
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "master/flags.h"
#include "optim/distributed_optimizer.h"
#include "rpc/call.h"
#include "shards/protocol.h"
#include "tests/master/flag_cases.h"

namespace remora::master {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using flag_cases::ExpectErrors;

// --dataset text:PATH trains the built-in GPT: its flags size it, Adam and
// a held-out tail are its defaults, its parts are spread over the stages,
// and what does not fit it is an error naming the flag.
TEST(GptFlags, TextTrainsTheBuiltInGptSizedByItsFlags) {
  auto text = ParseCommandLine({"--workers", "a,b", "--dataset", "text:book.txt", "--layers", "4", "--d-model", "32",
                                "--heads", "4", "--seq-len", "16"});
  ASSERT_TRUE(text.ok()) << text.status();
  const RunOptions& c = text->config;
  EXPECT_TRUE(TrainsGpt(c));
  EXPECT_FALSE(TrainsSmallCnn(c));
  EXPECT_EQ(c.optimizer, "adam");
  EXPECT_DOUBLE_EQ(c.lr, 0.001);
  EXPECT_DOUBLE_EQ(c.val_fraction, 0.05);
  EXPECT_EQ(TokensPerRow(c), 16);
  EXPECT_EQ(text->note, "");
  // 6 parts (embedding, 4 blocks, head), cut where the partitioner says;
  // a stage is parts [first, last).
  EXPECT_EQ(LayersToCut(c), 6);
  const pipeline::StageSpec part = GptPart(c, 2, 5);
  EXPECT_EQ(part.name, "Gpt");
  EXPECT_EQ(part.args.at(0).toInt(), 2);
  EXPECT_EQ(part.args.at(1).toInt(), 5);
  // Tied embeddings unless told otherwise: in the model's identity, so a
  // checkpoint of the other kind is not resumed.
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_EQ(rpc::DecodeCall<shards::GptArgs>(part.args).value().tie, 1);
  EXPECT_THAT(IdentityOf(c, 1).model, HasSubstr(" tie-embeddings"));
  auto untied = ParseCommandLine({"--local", "--dataset", "text:book.txt", "--tie-embeddings=false"});
  ASSERT_TRUE(untied.ok()) << untied.status();
  EXPECT_EQ(rpc::DecodeCall<shards::GptArgs>(GptPart(untied->config, 0, 6).args).value().tie, 0);
  EXPECT_THAT(IdentityOf(untied->config, 1).model, Not(HasSubstr("tie")));
  EXPECT_THAT(ParseCommandLine({"--local", "--dataset", "fashion-mnist", "--tie-embeddings=false"})->note,
              HasSubstr("tie-embeddings without --dataset text:PATH"));
  auto split = ParseCommandLine({"--workers", "a,b", "--dataset", "text:book.txt", "--split-at", "2"});
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_EQ(WholeModelStages(c).size(), 1u);
  auto sgd = ParseCommandLine({"--local", "--dataset", "text:book.txt", "--optimizer", "sgd", "--val-fraction", "0"});
  ASSERT_TRUE(sgd.ok()) << sgd.status();
  EXPECT_EQ(sgd->config.optimizer, "sgd");
  EXPECT_DOUBLE_EQ(sgd->config.val_fraction, 0);
  // AdamW: Adam's rates, decoupled weight decay (0.1 unless given).
  auto adamw = ParseCommandLine({"--local", "--dataset", "text:book.txt", "--optimizer", "adamw"});
  ASSERT_TRUE(adamw.ok()) << adamw.status();
  EXPECT_DOUBLE_EQ(adamw->config.lr, 0.001);
  const optim::OptimizerOptions o = OptimizerOf(adamw->config);
  EXPECT_EQ(o.kind, optim::OptimizerOptions::Kind::kAdamW);
  EXPECT_DOUBLE_EQ(o.weight_decay, 0.1);
  EXPECT_FALSE(o.decay_all);  // the matrices decay; biases and norm weights do not
  EXPECT_EQ(IdentityOf(adamw->config, 1).optimizer, "adamw lr=0.001 weight-decay=0.1");
  auto all = ParseCommandLine({"--local", "--dataset", "text:book.txt", "--optimizer", "adamw", "--decay-all"});
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_TRUE(OptimizerOf(all->config).decay_all);
  EXPECT_EQ(IdentityOf(all->config, 1).optimizer, "adamw lr=0.001 weight-decay=0.1 decay-all");
  EXPECT_THAT(ParseCommandLine({"--local", "--decay-all"})->note,
              HasSubstr("--decay-all without --optimizer adamw"));
  // --clip-grad-norm: part of the checkpoint's identity; with the
  // parameter server and ZeRO-1 too.
  auto clipped = ParseCommandLine({"--local", "--dataset", "text:book.txt", "--clip-grad-norm", "1"});
  ASSERT_TRUE(clipped.ok()) << clipped.status();
  EXPECT_DOUBLE_EQ(clipped->config.clip_grad_norm, 1.0);
  EXPECT_EQ(IdentityOf(clipped->config, 1).optimizer, "adam lr=0.001 clip-grad-norm=1");
  EXPECT_THAT(std::string(ParseCommandLine({"--local", "--clip-grad-norm", "-1"}).status().message()),
              HasSubstr("--clip-grad-norm must be 0 (no clipping) or more"));
  EXPECT_TRUE(ParseCommandLine({"--workers", "w1,w2", "--mode", "ps", "--clip-grad-norm", "1"}).ok());
  EXPECT_DOUBLE_EQ(
      OptimizerOf(ParseCommandLine({"--local", "--optimizer", "adamw", "--weight-decay", "0.02"})->config).weight_decay,
      0.02);
  EXPECT_THAT(ParseCommandLine({"--local", "--weight-decay", "0.02"})->note,
              HasSubstr("--weight-decay without --optimizer adamw"));
  auto cnn = ParseCommandLine({"--local", "--dataset", "fashion-mnist", "--layers", "2", "--seq-len", "8"});
  ASSERT_TRUE(cnn.ok()) << cnn.status();
  EXPECT_THAT(cnn->note, HasSubstr("--layers, --seq-len without --dataset text:PATH"));

  ExpectErrors({
      {{"--local", "--dataset", "text:book.txt", "--d-model", "30", "--heads", "4"},
       "--d-model 30 must be a multiple of --heads 4"},
      {{"--local", "--dataset", "text:book.txt", "--seq-len", "0"}, "--seq-len"},
      {{"--local", "--dataset", "text:book.txt", "--layers", "0"}, "--layers"},
      {{"--workers", "a,b,c,d,e,f,g", "--dataset", "text:book.txt", "--layers", "4"},
       "more stages than the 6 layers there are to cut"},
      {{"--workers", "a,b", "--dataset", "text:book.txt", "--partition", "tutorial"}, "--partition tutorial"},
      {{"--local", "--dataset", "text:book.txt", "--model", "m.pt"}, "cannot read the TorchScript file m.pt"},
      {{"--local", "--dataset", "text:book.txt", "--peak-tflops", "-1"}, "--peak-tflops"},
      {{"--local", "--dataset", "fashion-mnist", "--tie-embeddings"}, "this run trains no GPT"},
      {{"--local", "--precision", "fp16"}, "--precision must be fp32 or bf16; got 'fp16'"},
      {{"--local", "--dataset", "fashion-mnist", "--val-fraction", "0.1"}, "--val-fraction"},
      {{"--local", "--optimizer", "lamb"}, "--optimizer must be sgd, adam or adamw; got 'lamb'"},
      {{"--local", "--optimizer", "adamw", "--weight-decay", "-1"}, "--weight-decay must be 0 or more"},
  });
}

}  // namespace
}  // namespace remora::master
