// A GPT as pipeline stages: the token and position embedding, pre-LayerNorm
// decoder blocks (causal self-attention, then an MLP, each added to the
// residual stream), and the final norm with the head. Each is built
// deterministically from a seed (block i of the stack from (seed, i),
// wherever the stack is cut), so that workers and a local reference build
// the same weights. Trained with the causal language-model loss,
// pipeline::LossFn::Named("causal_lm"): cross-entropy over every position.
//
//   stage types (RegisterStageTypes, shards/stage_types.h; arguments in
//   shards/protocol.h):
//     "GptEmbed"(vocab, seq_len, d_model, seed): tokens int64 [N, T] -> [N, T, D]
//     "GptBlocks"(d_model, heads, first, last, seed): blocks [first, last)
//     "GptHead"(d_model, vocab, seed): [N, T, D] -> logits [N, T, vocab]
//     "Gpt"(first, last, vocab, seq_len, d_model, heads, layers, seed, tie):
//       parts [first, last) of the whole model's layers + 2 parts (0: the
//       embedding, 1 .. layers: the blocks, layers + 1: the head), the same
//       weights as the three above; what master cuts over its workers.
//       With tie (left off: 0) the head's weight is the token embedding's:
//       one parameter where both parts are in the stage, else the head's
//       copy built equal to the embedding's (the pipeline keeps the copies
//       equal: PipelineOptions::tied_first/tied_last, kGptTiedFirst/Last)
//
// Thread-safety: modules, used by one thread at a time (the stage's).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

namespace remora::shards {

class GptEmbedImpl : public torch::nn::Module {
 public:
  GptEmbedImpl(int64_t vocab, int64_t seq_len, int64_t d_model, int64_t seed);
  // tokens int64 [N, T], T <= seq_len (an error otherwise).
  at::Tensor forward(const at::Tensor& tokens);
  const at::Tensor& token_weight() const { return tokens_->weight; }

 private:
  int64_t seq_len_;
  torch::nn::Embedding tokens_{nullptr}, positions_{nullptr};
};

// One pre-LayerNorm decoder block.
class GptBlockImpl : public torch::nn::Module {
 public:
  GptBlockImpl(int64_t d_model, int64_t heads, uint64_t seed);
  at::Tensor forward(const at::Tensor& x);

 private:
  int64_t heads_;
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, up_{nullptr}, down_{nullptr};
};
TORCH_MODULE(GptBlock);

class GptBlocksImpl : public torch::nn::Module {
 public:
  GptBlocksImpl(int64_t d_model, int64_t heads, int64_t first, int64_t last, int64_t seed);
  at::Tensor forward(const at::Tensor& x);

 private:
  // Registered under their index in the whole model ("5.qkv.weight" for
  // block 5 wherever the stage begins): a checkpoint moves to another cut
  // by name (checkpoint::Relayout).
  std::vector<GptBlock> blocks_;
};

class GptHeadImpl : public torch::nn::Module {
 public:
  // `tied`: the weight is the token embedding's of a GptEmbed of the same
  // seed: `embedding`, a parameter of another module, where given (the head
  // then has no weight of its own); else a copy built equal to it.
  GptHeadImpl(int64_t d_model, int64_t vocab, int64_t seed, bool tied = false, at::Tensor embedding = {});
  at::Tensor forward(const at::Tensor& x);

 private:
  torch::nn::LayerNorm norm_{nullptr};
  torch::nn::Linear head_{nullptr};  // null where the weight is `embedding_`
  at::Tensor embedding_;
};

// Parts [first, last) of a GPT of `layers` blocks (GptParts(layers) parts
// in all: the embedding, each block, the head), built as the three types
// above build them: a stage of master's built-in GPT.
class GptImpl : public torch::nn::Module {
 public:
  GptImpl(int64_t vocab, int64_t seq_len, int64_t d_model, int64_t heads, int64_t layers, int64_t first,
          int64_t last, int64_t seed, bool tie = false);
  at::Tensor forward(const at::Tensor& x);

 private:
  std::shared_ptr<GptEmbedImpl> embed_;    // null where part 0 is not here
  std::shared_ptr<GptBlocksImpl> blocks_;  // null where no block is here
  std::shared_ptr<GptHeadImpl> head_;      // null where the last part is not here
};

// The parts a GPT of `layers` blocks is cut in: the embedding, the blocks
// and the head.
inline int64_t GptParts(int64_t layers) { return layers + 2; }

// The state_dict names of a tied GPT's two copies of its token embedding,
// on the stage of part 0 and on the stage of the head.
inline constexpr char kGptTiedFirst[] = "embed.tokens.weight";
inline constexpr char kGptTiedLast[] = "head.head.weight";

// FLOPs of one training step per token of a GPT (forward and backward, 3x
// the forward's multiply-adds x 2), counting its matrix products: the
// blocks' projections (12 d^2 per layer), attention's scores and mixing
// (2 T d per layer: half of T, causal, counted whole as nanoGPT and
// PaLM's appendix do) and the head (d x vocab).
double GptTrainFlopsPerToken(int64_t vocab, int64_t seq_len, int64_t d_model, int64_t layers);

}  // namespace remora::shards
