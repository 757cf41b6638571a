// TorchScript modules made in C++ for tests (no Python needed): what
// torch.jit.script(...).save(path) writes for a linear layer, for an
// nn.Sequential of them and for a small CNN.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/csrc/jit/api/module.h>

namespace remora::test_support {

// x @ weight.t() + bias (then ReLU with `relu`) as `method`; weights drawn
// from `seed`, scaled by 1/3.
torch::jit::Module ScriptLinear(int64_t in, int64_t out, int64_t seed, bool relu,
                                const std::string& method = "forward");

// Linear layers widths[0] -> widths[1] -> ... (ReLU between them) as the
// children l0, l1, ... of one module whose forward is their chain; with
// `residual` its forward adds 1 at the end (not the chain).
torch::jit::Module ScriptSequential(const std::vector<int64_t>& widths, bool residual = false);

// A small CNN as the children of one module whose forward is their chain
// (so the master cuts it like an nn.Sequential): two 3x3 convolutions of
// stride 2 with ReLU (3 -> 8 -> 16 channels), the mean over the picture,
// a linear layer to `classes`; weights drawn from `seed`.
torch::jit::Module ScriptSmallCnn(int64_t classes, int64_t seed);

// A small GPT over bytes: wte (256 x 16) and a wpe parameter (16 x 16),
// blocks h0 and h1 (x + mlp(layer_norm(x))), a head to 256; weights drawn
// from fixed seeds. `forward` is its forward's TorchScript source (where
// the positions are made and added decides what crosses a cut).
torch::jit::Module ScriptByteGpt(const std::string& forward);

// The losses of `steps` SGD steps (lr 0.05) of the scripted model `bytes`
// in this process on (x, t), cross-entropy over every row (and position:
// the logits' last dimension is the classes').
std::vector<double> ScriptedLossesInOneProcess(const std::string& bytes, const at::Tensor& x, const at::Tensor& t,
                                               int steps);

// A module's bytes as torch.jit.save writes them, and back.
std::string SaveToBytes(torch::jit::Module& m);
torch::jit::Module LoadFromBytes(const std::string& bytes);

}  // namespace remora::test_support
