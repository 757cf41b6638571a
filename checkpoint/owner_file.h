// One owner's checkpoint file (checkpoint/checkpoint.h): its encoding
// (torch.save's format, so torch.load reads it too), reading it back with
// its size and CRC-32 checked, and removing a checkpoint's files.
//
// Thread-compatible free functions.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "absl/status/statusor.h"

namespace remora::checkpoint {

// In the file (format 2) a dict: "stages"; "state_dicts", per stage its
// tensors by name (PyTorch's state_dict() keys, parameters then buffers);
// "optimizer", the owner's optimizer state dict (PyTorch's layout, its
// parameters numbered through the owner file's stages in order) or None; "rng"
// and "cuda_rng". Format 1 (unnamed lists, LibTorch's optimizer archive)
// is read too. The same state gives the same bytes.
struct OwnerFile {
  std::vector<int64_t> stages;                   // the pipeline's stage indices
  std::vector<std::vector<at::Tensor>> tensors;  // per stage: parameters then buffers
  std::vector<std::vector<std::string>> names;   // per stage, the tensors' names (format 1: none)
  // The owner's optimizer state: its state dict (optim::OptimizerStateDict;
  // format 1: LibTorch's archive as a uint8 tensor), or None.
  c10::IValue optimizer;
  at::Tensor rng;                                // the owner's CPU generator state
  std::vector<at::Tensor> cuda_rng;              // each of its CUDA devices' generator state
};

std::string EncodeOwnerFile(const OwnerFile& owned);
// InvalidArgument/DataLoss naming `label` for bytes that are not an owner file.
absl::StatusOr<OwnerFile> DecodeOwnerFile(const std::string& bytes, const std::string& label);
// The owner file at `path`, after checking its size and CRC-32 against the
// manifest's; DataLoss naming the file when they differ.
absl::StatusOr<OwnerFile> ReadOwnerFile(const std::string& path, int64_t bytes, const std::string& crc32);

// This process's CPU generator state, and setting it (throws for a state
// that is not one).
at::Tensor CpuGeneratorState();
void SetCpuGeneratorState(const at::Tensor& state);
// The generator state of each CUDA device of this process (none without
// CUDA); and setting them, device by device, as far as both lists go (a
// process resumed with fewer devices sets the ones it has).
std::vector<at::Tensor> CudaGeneratorStates();
void SetCudaGeneratorStates(const std::vector<at::Tensor>& states);

// Removes the owner files (all files with `all`) and their temporaries
// from a checkpoint's directory, then the directory if it is empty.
void RemoveCheckpointFiles(const std::string& dir, bool all);

}  // namespace remora::checkpoint
