// The arguments of the built-in models' stage types and module types
// (shards/stage_types.h, the modules of shards/mlp.h and shards/resnet.h),
// one struct each (rpc/call.h): what `StageSpec::Registered("MLPStage",
// {16, 32, 1})` or `remote(w, "ResNetShard", {0, 8})` passes. Trailing
// arguments may be left off (their defaults below); a missing or mistyped
// one is an error naming the type and the field.
//
// Thread-safety: plain structs.
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/ivalue.h>

#include "rpc/call.h"

namespace remora::shards {

// Linear(in, out) [-> BatchNorm1d] [-> ReLU], its weights from `seed`.
struct MLPStageArgs {
  static constexpr char kFunction[] = "MLPStage";
  int64_t in = 0;
  int64_t out = 0;
  int64_t seed = 0;
  bool relu = true;
  bool batchnorm = false;
  template <typename Fields>
  void Visit(Fields& f) {
    f("in", in)("out", out)("seed", seed, rpc::kMayBeLeftOff)("relu", relu, rpc::kMayBeLeftOff)("batchnorm", batchnorm,
                                                                                       rpc::kMayBeLeftOff);
  }
};

// Blocks [first, last) of a model of blocks (SmallCnn, ResNetShard), their
// weights from `seed`; a ResNetShard module may name its device.
struct BlocksArgs {
  static constexpr char kFunction[] = "a stage of blocks";
  int64_t first = 0;
  int64_t last = 0;
  int64_t seed = 0;
  std::string device;  // "" : the worker's home device
  template <typename Fields>
  void Visit(Fields& f) {
    f("first", first)("last", last)("seed", seed, rpc::kMayBeLeftOff)("device", device, rpc::kMayBeLeftOff);
  }
};
struct SmallCnnArgs : BlocksArgs {
  static constexpr char kFunction[] = "SmallCnn";
};
struct ResNetShardArgs : BlocksArgs {
  static constexpr char kFunction[] = "ResNetShard";
};

// A GPT's stages (shards/gpt.h), their weights from `seed`: the token and
// position embedding; decoder blocks [first, last) of the stack; the final
// norm and the head.
struct GptEmbedArgs {
  static constexpr char kFunction[] = "GptEmbed";
  int64_t vocab = 256;
  int64_t seq_len = 0;
  int64_t d_model = 0;
  int64_t seed = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("vocab", vocab)("seq_len", seq_len)("d_model", d_model)("seed", seed, rpc::kMayBeLeftOff);
  }
};
struct GptBlocksArgs {
  static constexpr char kFunction[] = "GptBlocks";
  int64_t d_model = 0;
  int64_t heads = 1;
  int64_t first = 0;
  int64_t last = 0;
  int64_t seed = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("d_model", d_model)("heads", heads)("first", first)("last", last)("seed", seed, rpc::kMayBeLeftOff);
  }
};
// (first and last first: the partitioner cuts a type whose arguments
// begin with them, pipeline::SequentialModel::Registered.)
struct GptArgs {
  static constexpr char kFunction[] = "Gpt";
  int64_t first = 0;
  int64_t last = 0;
  int64_t vocab = 256;
  int64_t seq_len = 0;
  int64_t d_model = 0;
  int64_t heads = 1;
  int64_t layers = 0;
  int64_t seed = 0;
  // 1: the head's weight is the token embedding's (GptImpl).
  int64_t tie = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("first", first)("last", last)("vocab", vocab)("seq_len", seq_len)("d_model", d_model)("heads", heads)(
        "layers", layers)("seed", seed, rpc::kMayBeLeftOff)("tie", tie, rpc::kMayBeLeftOff);
  }
};
struct GptHeadArgs {
  static constexpr char kFunction[] = "GptHead";
  int64_t d_model = 0;
  int64_t vocab = 256;
  int64_t seed = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("d_model", d_model)("vocab", vocab)("seed", seed, rpc::kMayBeLeftOff);
  }
};

// A module's "forward": x, or an RRef to it, and the micro-batch it is
// (-1: none; for the trace).
struct ModuleForwardArgs {
  static constexpr char kFunction[] = "forward";
  c10::IValue x;
  int64_t micro_batch = -1;
  template <typename Fields>
  void Visit(Fields& f) {
    f("x", x)("micro_batch", micro_batch, rpc::kMayBeLeftOff);
  }
};

// A module's "train": training mode on or off.
struct ModuleTrainArgs {
  static constexpr char kFunction[] = "train";
  bool on = true;
  template <typename Fields>
  void Visit(Fields& f) {
    f("on", on, rpc::kMayBeLeftOff);
  }
};

}  // namespace remora::shards
