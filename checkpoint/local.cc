// checkpoint::SaveLocal and ReadLocalOptimizer (checkpoint/checkpoint.h):
// checkpoints of stages held in this process, in the format
// Checkpointer::Save writes (the parameter server's, ps/).
#include <algorithm>
#include <ctime>
#include <filesystem>
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <google/protobuf/util/json_util.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_util.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/manifest.h"
#include "checkpoint/owner_file.h"
#include "optim/distributed_optimizer.h"

namespace remora::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr char kOwnerFile[] = "owner-0.pt";

}  // namespace

absl::StatusOr<LocalSave> SaveLocal(const std::string& dir, const std::vector<pipeline::StageSpec>& stages,
                                    const std::vector<std::vector<at::Tensor>>& tensors,
                                    const std::vector<std::vector<std::string>>& names,
                                    const at::Tensor& optimizer, const RunIdentity& identity,
                                    const TrainingState& state, bool final, int keep,
                                    const std::string& owner) {
  if (keep < 1) return absl::InvalidArgumentError("checkpoints: keep at least 1");
  if (stages.empty() || stages.size() != tensors.size() || names.size() != tensors.size()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint: ", stages.size(), " stage specs and ",
                                                   tensors.size(), " stages' tensors"));
  }
  std::error_code ec;
  const std::string root = fs::absolute(dir, ec).lexically_normal().string();
  const std::string step_dir = StepDir(root, state.step);
  const std::string failed = SaveFailed(state.step, step_dir);
  fs::create_directories(step_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(failed, ": cannot make the directory: ", ec.message()));

  OwnerFile owned;
  for (size_t k = 0; k < stages.size(); ++k) owned.stages.push_back(static_cast<int64_t>(k));
  owned.tensors = tensors;
  owned.names = names;
  if (optimizer.defined()) owned.optimizer = optim::Unpickle(optimizer);
  owned.rng = CpuGeneratorState();
  const std::string file_bytes = EncodeOwnerFile(owned);
  RETURN_IF_ERROR(base::Annotate(WriteFileAtomically(absl::StrCat(step_dir, "/", kOwnerFile), file_bytes), failed));
  wire::Manifest m = NewManifest(identity, state, final);
  wire::CheckpointFile* s = m.add_files();
  s->set_file(kOwnerFile);
  s->set_worker(owner);
  s->set_bytes(static_cast<int64_t>(file_bytes.size()));
  s->set_crc32(Crc32(file_bytes));
  for (size_t k = 0; k < stages.size(); ++k) s->add_stages(static_cast<int32_t>(k));
  RETURN_IF_ERROR(base::Annotate(WriteModel(stages, /*file_of=*/{}, step_dir, &m), failed));
  // The commit: the manifest, last.
  RETURN_IF_ERROR(base::Annotate(CommitManifest(m, step_dir), failed));
  for (const std::string& old : PrunableDirs(root, keep)) {
    fs::remove(fs::path(old) / kManifestFile, ec);  // no longer a checkpoint
    RemoveCheckpointFiles(old, /*all=*/true);
  }
  return LocalSave{step_dir, static_cast<int64_t>(file_bytes.size())};
}

absl::StatusOr<at::Tensor> ReadLocalOptimizer(const Checkpoint& ck) {
  if (ck.manifest.files.size() != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", ck.manifest_path, " has ", ck.manifest.files.size(),
        " owner files: it was saved by a pipeline, not by a parameter server (resume it without --mode ps)"));
  }
  const ManifestFile& s = ck.manifest.files[0];
  ASSIGN_OR_RETURN(OwnerFile owned, ReadOwnerFile(absl::StrCat(ck.dir, "/", s.file), s.bytes, s.crc32));
  if (owned.optimizer.isNone()) return at::Tensor();
  // A state dict as the bytes the parameter server loads (format 1: its archive).
  return owned.optimizer.isTensor() ? owned.optimizer.toTensor() : optim::PickleBytes(owned.optimizer);
}

}  // namespace remora::checkpoint
