#include "shards/gpt.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/triu.h>

namespace remora::shards {
namespace {

// GPT-2's initialisation, drawn from a generator of the module's own
// (LibTorch's default draws from the process-wide one, which other
// threads use): weights N(0, 0.02), biases 0.
void Init(torch::nn::Module& m, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::NoGradGuard no_grad;
  for (auto& p : m.named_parameters(/*recurse=*/false)) {
    if (p.key() == "bias") {
      p.value().zero_();
    } else {
      p.value().normal_(0.0, 0.02, gen);
    }
  }
}

}  // namespace

GptEmbedImpl::GptEmbedImpl(int64_t vocab, int64_t seq_len, int64_t d_model, int64_t seed) : seq_len_(seq_len) {
  if (vocab <= 0 || seq_len <= 0 || d_model <= 0) {
    throw std::invalid_argument("GptEmbed: vocab, seq_len and d_model must be positive");
  }
  tokens_ = register_module("tokens", torch::nn::Embedding(vocab, d_model));
  positions_ = register_module("positions", torch::nn::Embedding(seq_len, d_model));
  Init(*tokens_, static_cast<uint64_t>(seed) * 2);
  Init(*positions_, static_cast<uint64_t>(seed) * 2 + 1);
}

at::Tensor GptEmbedImpl::forward(const at::Tensor& tokens) {
  if (tokens.dim() != 2 || tokens.size(1) > seq_len_) {
    throw std::invalid_argument("GptEmbed: tokens must be int64 [N, T] with T at most the model's seq_len " +
                                std::to_string(seq_len_) + "; got " + std::to_string(tokens.dim()) +
                                " dimensions, T = " + std::to_string(tokens.dim() == 2 ? tokens.size(1) : -1));
  }
  const at::Tensor positions = at::arange(tokens.size(1), tokens.options().dtype(at::kLong));
  return tokens_(tokens) + positions_(positions).unsqueeze(0);
}

GptBlockImpl::GptBlockImpl(int64_t d_model, int64_t heads, uint64_t seed) : heads_(heads) {
  if (d_model <= 0 || heads <= 0 || d_model % heads != 0) {
    throw std::invalid_argument("GptBlocks: d_model " + std::to_string(d_model) +
                                " must be a positive multiple of heads " + std::to_string(heads));
  }
  norm1_ = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  qkv_ = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  proj_ = register_module("proj", torch::nn::Linear(d_model, d_model));
  norm2_ = register_module("norm2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  up_ = register_module("up", torch::nn::Linear(d_model, 4 * d_model));
  down_ = register_module("down", torch::nn::Linear(4 * d_model, d_model));
  Init(*qkv_, seed * 8);
  Init(*proj_, seed * 8 + 1);
  Init(*up_, seed * 8 + 2);
  Init(*down_, seed * 8 + 3);
}

at::Tensor GptBlockImpl::forward(const at::Tensor& x) {
  const int64_t n = x.size(0), t = x.size(1), d = x.size(2), dh = d / heads_;
  // Causal self-attention: each position attends to itself and those before.
  const std::vector<at::Tensor> qkv = qkv_(norm1_(x)).split(d, /*dim=*/2);
  auto heads = [&](const at::Tensor& a) { return a.view({n, t, heads_, dh}).transpose(1, 2); };  // [N, H, T, dh]
  const at::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(dh)));
  const at::Tensor later = at::triu(at::ones({t, t}, x.options().dtype(at::kBool)), /*diagonal=*/1);
  scores = scores.masked_fill(later, -std::numeric_limits<double>::infinity());
  const at::Tensor attended = at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({n, t, d});
  const at::Tensor h = x + proj_(attended);
  return h + down_(at::gelu(up_(norm2_(h))));
}

GptBlocksImpl::GptBlocksImpl(int64_t d_model, int64_t heads, int64_t first, int64_t last, int64_t seed) {
  if (first < 0 || last <= first) {
    throw std::invalid_argument("GptBlocks: blocks [" + std::to_string(first) + ", " + std::to_string(last) +
                                ") is no range of blocks");
  }
  for (int64_t i = first; i < last; ++i) {
    const uint64_t block_seed = static_cast<uint64_t>(seed) * 1000003u + static_cast<uint64_t>(i);
    blocks_.push_back(register_module(std::to_string(i), GptBlock(d_model, heads, block_seed)));
  }
}

at::Tensor GptBlocksImpl::forward(const at::Tensor& x) {
  at::Tensor h = x;
  for (GptBlock& block : blocks_) h = block->forward(h);
  return h;
}

GptHeadImpl::GptHeadImpl(int64_t d_model, int64_t vocab, int64_t seed, bool tied, at::Tensor embedding)
    : embedding_(std::move(embedding)) {
  if (d_model <= 0 || vocab <= 0) throw std::invalid_argument("GptHead: d_model and vocab must be positive");
  norm_ = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  if (embedding_.defined()) {
    if (embedding_.sizes() != at::IntArrayRef{vocab, d_model}) {
      throw std::invalid_argument("GptHead: the tied embedding is " + c10::str(embedding_.sizes()) +
                                  ", not [vocab, d_model]");
    }
    return;
  }
  head_ = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(d_model, vocab).bias(false)));
  // (Tied: drawn as GptEmbed draws its token table, the same shape.)
  Init(*head_, static_cast<uint64_t>(seed) * 2 + (tied ? 0 : 7));
}

at::Tensor GptHeadImpl::forward(const at::Tensor& x) {
  return head_ ? head_(norm_(x)) : at::linear(norm_(x), embedding_);
}

GptImpl::GptImpl(int64_t vocab, int64_t seq_len, int64_t d_model, int64_t heads, int64_t layers, int64_t first,
                 int64_t last, int64_t seed, bool tie) {
  if (layers < 0 || first < 0 || last > GptParts(layers) || first >= last) {
    throw std::invalid_argument("Gpt: parts [" + std::to_string(first) + ", " + std::to_string(last) +
                                ") of a GPT of " + std::to_string(layers) + " blocks (" +
                                std::to_string(GptParts(layers)) + " parts: the embedding, the blocks, the head)");
  }
  if (first == 0) embed_ = register_module("embed", std::make_shared<GptEmbedImpl>(vocab, seq_len, d_model, seed));
  const int64_t first_block = std::max<int64_t>(first, 1) - 1, end_block = std::min(last, layers + 1) - 1;
  if (first_block < end_block) {
    blocks_ = register_module("blocks", std::make_shared<GptBlocksImpl>(d_model, heads, first_block, end_block, seed));
  } else if (d_model <= 0 || heads <= 0 || d_model % heads != 0) {
    throw std::invalid_argument("Gpt: d_model " + std::to_string(d_model) + " must be a positive multiple of heads " +
                                std::to_string(heads));
  }
  if (last == GptParts(layers)) {
    head_ = register_module("head", std::make_shared<GptHeadImpl>(
                                        d_model, vocab, seed, tie, tie && embed_ ? embed_->token_weight() : at::Tensor()));
  }
}

at::Tensor GptImpl::forward(const at::Tensor& x) {
  at::Tensor h = embed_ ? embed_->forward(x) : x;
  if (blocks_) h = blocks_->forward(h);
  return head_ ? head_->forward(h) : h;
}

double GptTrainFlopsPerToken(int64_t vocab, int64_t seq_len, int64_t d_model, int64_t layers) {
  const double d = static_cast<double>(d_model);
  const double forward = 2.0 * (layers * (12.0 * d * d + 2.0 * seq_len * d) + d * vocab);
  return 3.0 * forward;
}

}  // namespace remora::shards
