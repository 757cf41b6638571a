#include "tests/support/script_models.h"

#include <cmath>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/optim/sgd.h>

namespace remora::test_support {

torch::jit::Module ScriptLinear(int64_t in, int64_t out, int64_t seed, bool relu,
                                const std::string& method) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::jit::Module m("Linear");
  m.register_parameter("weight", at::randn({out, in}, gen, at::TensorOptions()) / 3.0, false);
  m.register_parameter("bias", at::randn({out}, gen, at::TensorOptions()) / 3.0, false);
  m.define("def " + method + "(self, x):\n  y = torch.matmul(x, self.weight.t()) + self.bias\n" +
           (relu ? "  return torch.relu(y)\n" : "  return y\n"));
  return m;
}

torch::jit::Module ScriptSequential(const std::vector<int64_t>& widths, bool residual) {
  torch::jit::Module m("Sequential");
  std::string code = "def forward(self, x):\n";
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    const std::string name = "l" + std::to_string(i);
    m.register_module(name, ScriptLinear(widths[i], widths[i + 1], 10 + static_cast<int64_t>(i),
                                         i + 2 < widths.size()));
    code += "  x = self." + name + ".forward(x)\n";
  }
  code += residual ? "  return x + 1.0\n" : "  return x\n";
  m.define(code);
  return m;
}

torch::jit::Module ScriptByteGpt(const std::string& forward) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  torch::jit::Module wte("Embedding");
  wte.register_parameter("weight", at::randn({256, 16}, gen, at::TensorOptions()) * 0.1, false);
  wte.define("def forward(self, idx):\n  return torch.embedding(self.weight, idx)\n");
  torch::jit::Module gpt("Gpt");
  gpt.register_module("wte", wte);
  gpt.register_parameter("wpe", at::randn({16, 16}, gen, at::TensorOptions()) * 0.1, false);
  for (int i = 0; i < 2; ++i) {
    torch::jit::Module block("Block");
    block.register_module("mlp", ScriptLinear(16, 16, 60 + i, true));
    block.define("def forward(self, x):\n  return x + self.mlp.forward(torch.layer_norm(x, [16]))\n");
    gpt.register_module("h" + std::to_string(i), block);
  }
  gpt.register_module("head", ScriptLinear(16, 256, 70, false));
  gpt.define(forward);
  return gpt;
}

torch::jit::Module ScriptSmallCnn(int64_t classes, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::jit::Module m("Sequential");
  const int64_t widths[] = {3, 8, 16};
  for (int i = 0; i < 2; ++i) {
    torch::jit::Module conv("Conv2d");
    const double scale = std::sqrt(2.0 / (widths[i] * 9));
    conv.register_parameter("weight", at::randn({widths[i + 1], widths[i], 3, 3}, gen, at::TensorOptions()) * scale,
                            false);
    conv.register_parameter("bias", at::zeros({widths[i + 1]}), false);
    conv.define(
        "def forward(self, x):\n  return torch.relu(torch.conv2d(x, self.weight, self.bias, [2, 2], [1, 1]))\n");
    m.register_module("c" + std::to_string(i), conv);
  }
  torch::jit::Module pool("Pool");
  pool.define("def forward(self, x):\n  return x.mean([2, 3])\n");
  m.register_module("pool", pool);
  m.register_module("fc", ScriptLinear(widths[2], classes, seed + 1, false));
  m.define("def forward(self, x):\n  x = self.c0.forward(x)\n  x = self.c1.forward(x)\n  x = self.pool.forward(x)\n"
           "  return self.fc.forward(x)\n");
  return m;
}

std::string SaveToBytes(torch::jit::Module& m) {
  std::ostringstream bytes;
  m.save(bytes);
  return bytes.str();
}

torch::jit::Module LoadFromBytes(const std::string& bytes) {
  std::istringstream in(bytes);
  return torch::jit::load(in);
}

std::vector<double> ScriptedLossesInOneProcess(const std::string& bytes, const at::Tensor& x, const at::Tensor& t,
                                               int steps) {
  torch::jit::Module local = LoadFromBytes(bytes);
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : local.parameters()) params.push_back(p.requires_grad_(true));
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05));
  std::vector<double> losses;
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    const at::Tensor logits = local.forward({x}).toTensor();
    at::Tensor l = at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), t.reshape({-1}));
    l.backward();
    opt.step();
    losses.push_back(l.item<double>());
  }
  return losses;
}

}  // namespace remora::test_support
