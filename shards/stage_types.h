// The models of shards/ as pipeline stage types (pipeline/stage.h), so
// that workers build them by name: "MLPStage" (in, out, seed, relu,
// batchnorm), "SmallCnn" (first block, last block, seed), "ResNetShard"
// (first block, last block, seed), and a GPT's "GptEmbed", "GptBlocks",
// "GptHead" and "Gpt" (shards/gpt.h).
//
// Thread-safety: thread-safe; registers once per process, later calls
// return the first call's result.
#pragma once

#include "absl/status/status.h"

namespace remora::shards {

absl::Status RegisterStageTypes();

}  // namespace remora::shards
