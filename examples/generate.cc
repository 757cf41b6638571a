// generate: samples text from the GPT that `master --dataset text:PATH`
// trained, loaded from its checkpoint into this process (no workers; any
// stage count): the prompt's bytes (or its tokens under the run's
// SentencePiece model, --tokenizer) are the first tokens, then --tokens
// more, each drawn from the model's next-token distribution at
// --temperature (0: always the likeliest) among the --top-k likeliest
// (0: all of them), by a generator seeded with --seed: the same flags give
// the same text.
//
//   generate --checkpoint-dir ckpt --prompt "The " --tokens 200
//
// The text goes to stdout (bytes that are no UTF-8 as U+FFFD), what was
// loaded to stderr.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/multinomial.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/topk.h>
#include <c10/core/GradMode.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_util.h"
#include "checkpoint/checkpoint.h"
#include "data/text.h"
#include "launch/cli.h"
#include "launch/error_text.h"
#include "runtime/threads.h"
#include "shards/gpt.h"
#include "shards/protocol.h"
#include "shards/stage_types.h"

namespace remora {
namespace {

struct Options {
  std::string dir;
  std::string prompt;  // empty: a newline
  std::string tokenizer;  // the run's SentencePiece model (empty: bytes)
  int tokens = 200;
  double temperature = 0.8;
  int top_k = 0;
  int seed = 0;
  int threads = 1;
  bool verbose = false;  // TorchScript's interpreter traceback in errors
};

// `bytes` with every byte that starts no valid UTF-8 character as U+FFFD.
std::string ValidUtf8(const std::string& bytes) {
  std::string out;
  const auto* s = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = s[i];
    const size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) ok = (s[i + k] & 0xC0) == 0x80;
    if (ok) {
      out.append(bytes, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

// The checkpoint's GPT: its stages built here with their saved tensors,
// and the arguments of its first stage (vocabulary, context).
struct Model {
  std::vector<std::unique_ptr<pipeline::StageModule>> stages;
  shards::GptArgs shape;
};

absl::StatusOr<Model> LoadGpt(const checkpoint::Checkpoint& ck) {
  ASSIGN_OR_RETURN(std::vector<pipeline::StageSpec> specs, checkpoint::LoadStageSpecs(ck));
  std::vector<std::string> names;
  for (const pipeline::StageSpec& s : specs) names.push_back(s.name);
  if (specs.empty() || std::any_of(specs.begin(), specs.end(), [](const pipeline::StageSpec& s) {
        return s.name != shards::GptArgs::kFunction;
      })) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the checkpoint ", ck.dir, " holds stages ", absl::StrJoin(names, ", "),
        ", not master's built-in GPT: generate samples from a model trained with master --dataset text:PATH"));
  }
  Model m;
  ASSIGN_OR_RETURN(m.shape, rpc::DecodeCall<shards::GptArgs>(specs.front().args));
  ASSIGN_OR_RETURN(m.stages, checkpoint::LoadModel(ck, c10::kCPU));
  return m;
}

// The next token after `context` (its last `seq_len` tokens are read).
int64_t NextToken(Model& m, const std::vector<int64_t>& context, const Options& o, at::Generator& gen) {
  const size_t from = context.size() > static_cast<size_t>(m.shape.seq_len) ? context.size() - m.shape.seq_len : 0;
  const std::vector<int64_t> window(context.begin() + static_cast<std::ptrdiff_t>(from), context.end());
  c10::IValue x = at::tensor(window, at::kLong).view({1, -1});
  for (auto& stage : m.stages) x = stage->Forward(x);
  const at::Tensor logits = x.toTensor()[0][-1].to(at::kFloat);
  if (o.temperature == 0) return logits.argmax().item<int64_t>();
  const int64_t k = o.top_k > 0 ? std::min<int64_t>(o.top_k, logits.size(0)) : logits.size(0);
  const auto [values, indices] = (logits / o.temperature).topk(k);
  const at::Tensor drawn = at::multinomial(at::softmax(values, 0), 1, /*replacement=*/false, gen);
  return indices[drawn.item<int64_t>()].item<int64_t>();
}

int Main(int argc, char** argv) {
  Options o;
  launch::FlagParser flags("generate",
                           "Samples text from the GPT of a master --dataset text:PATH run, loaded from its checkpoint "
                           "into this process (no workers needed).");
  flags.JoinsNoGroup();
  flags.AddString("checkpoint-dir", &o.dir,
                  "the run's --checkpoint-dir (its latest checkpoint is read) or one checkpoint's directory (required)");
  flags.AddString("prompt", &o.prompt,
                  "the text the sample goes on from, its UTF-8 bytes the first tokens (not given: a newline, where "
                  "a text's lines begin)");
  flags.AddString("tokenizer", &o.tokenizer,
                  "the SentencePiece model the run was trained with (master --tokenizer); not given: bytes");
  flags.AddInt("tokens", &o.tokens, "tokens (bytes, or the tokenizer's) to draw after the prompt");
  flags.AddDouble("temperature", &o.temperature,
                  "the logits are divided by it before sampling: below 1 surer, above 1 more varied; 0: always the "
                  "likeliest token");
  flags.AddInt("top-k", &o.top_k, "draw among the K likeliest tokens only (0: all)");
  flags.AddInt("seed", &o.seed, "seed of the draws: the same flags and checkpoint give the same text");
  flags.AddInt("threads", &o.threads, "intra-op threads");
  flags.AddBool("verbose", &o.verbose,
                "print a TorchScript error whole, with the interpreter's traceback (without: PyTorch's message and "
                "the line it failed at)");
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  auto fail = [&o](const std::string& msg, int rc) {
    std::cerr << "generate: " << (o.verbose ? msg : launch::WithoutTorchScriptTraceback(msg)) << "\n";
    return rc;
  };
  if (o.dir.empty()) return fail("--checkpoint-dir is required: the directory master --checkpoint-dir wrote", 2);
  if (o.prompt.empty()) o.prompt = "\n";
  if (auto s = launch::CheckAtLeast({{"tokens", o.tokens, 1}, {"top-k", o.top_k, 0}, {"threads", o.threads, 1}});
      !s.ok()) {
    return fail(std::string(s.message()), 2);
  }
  if (!(o.temperature >= 0)) return fail("--temperature must be 0 or more", 2);
  if (o.threads > launch::kMaxThreads) {
    return fail(absl::StrCat("--threads must be at most ", launch::kMaxThreads, "; got ", o.threads), 2);
  }
  runtime::SetComputeThreads(o.threads);
  if (auto s = shards::RegisterStageTypes(); !s.ok()) return fail(std::string(s.message()), 1);
  auto ck = checkpoint::Latest(o.dir);
  if (!ck.ok()) return fail(std::string(ck.status().message()), 1);
  auto model = LoadGpt(*ck);
  if (!model.ok()) return fail(std::string(model.status().message()), 1);
  std::cerr << "generate: " << ck->dir << " (step " << ck->manifest.step << "): a GPT of context "
            << model->shape.seq_len << " tokens in " << model->stages.size() << " stage"
            << (model->stages.size() == 1 ? "" : "s") << "; " << o.tokens << " tokens at temperature " << o.temperature
            << (o.top_k > 0 ? absl::StrCat(", top-k ", o.top_k) : "") << ", seed " << o.seed << std::endl;
  std::vector<int64_t> tokens;
  if (o.tokenizer.empty()) {
    if (model->shape.vocab != 256) {
      return fail(absl::StrCat("the checkpoint's GPT reads a vocabulary of ", model->shape.vocab,
                               ", not bytes: give the SentencePiece model it was trained with as --tokenizer"),
                  2);
    }
    for (unsigned char c : o.prompt) tokens.push_back(c);
  } else {
    auto vocab = data::SentencePieceVocab(o.tokenizer);
    if (!vocab.ok()) return fail(std::string(vocab.status().message()), 2);
    if (*vocab != model->shape.vocab) {
      return fail(absl::StrCat("--tokenizer ", o.tokenizer, " has a vocabulary of ", *vocab, "; the checkpoint's GPT ",
                               model->shape.vocab, ": give the model the run was trained with"),
                  2);
    }
    auto encoded = data::SentencePieceEncode(o.tokenizer, o.prompt);
    if (!encoded.ok()) return fail(std::string(encoded.status().message()), 1);
    tokens = *encoded;
    if (tokens.empty()) return fail("the prompt is no tokens under --tokenizer: give some text", 2);
  }
  const size_t prompt_tokens = tokens.size();
  at::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(o.seed));
  try {
    for (int i = 0; i < o.tokens; ++i) tokens.push_back(NextToken(*model, tokens, o, gen));
  } catch (const std::exception& e) {
    return fail(absl::StrCat("sampling from ", ck->dir, ": ", e.what()), 1);
  }
  std::string text;
  if (o.tokenizer.empty()) {
    text = o.prompt;
    for (size_t i = prompt_tokens; i < tokens.size(); ++i) text += static_cast<char>(tokens[i]);
  } else {
    // (The prompt decoded too, as SentencePiece normalised it: pieces
    // join by what precedes them.)
    auto decoded = data::SentencePieceDecode(o.tokenizer, tokens);
    if (!decoded.ok()) return fail(std::string(decoded.status().message()), 1);
    text = *decoded;
  }
  std::cout << ValidUtf8(text) << std::endl;
  return 0;
}

}  // namespace
}  // namespace remora

int main(int argc, char** argv) { return remora::Main(argc, argv); }
