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
#include "checkpoint/shard.h"

namespace remora::checkpoint {
namespace {

namespace fs = std::filesystem;

// As checkpoint.cc writes them: the format, file names, step directories,
// the time and model.pt's encoding (LoadStageSpecs reads it back; the
// tests check that it does).
constexpr int kFormat = 1;
constexpr char kManifest[] = "manifest.json";
constexpr char kModelFile[] = "model.pt";
constexpr char kShardFile[] = "shard-0.pt";

std::string NowUtc() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string EncodeSpecs(const std::vector<pipeline::StageSpec>& stages) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (const auto& s : stages) {
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("kind", s.kind);
    d.insert("name", s.name);
    d.insert("payload", s.Payload());
    d.insert("device", s.device);
    list.push_back(d);
  }
  const std::vector<char> bytes = torch::jit::pickle_save(list);
  return std::string(bytes.begin(), bytes.end());
}

// Removes all but the newest `keep` complete checkpoints in `dir`, and
// incomplete ones older than the newest.
void PruneLocal(const std::string& dir, int keep) {
  const std::vector<int64_t> complete = CompleteSteps(dir);
  if (complete.empty()) return;
  const size_t drop = complete.size() > static_cast<size_t>(keep) ? complete.size() - keep : 0;
  const int64_t oldest_kept = complete[drop], newest = complete.back();
  std::error_code ec;
  std::vector<fs::path> doomed;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    int64_t step = -1;
    if (name.rfind("step-", 0) != 0 || !absl::SimpleAtoi(name.substr(5), &step)) continue;
    const bool incomplete = !fs::exists(entry.path() / kManifest, ec);
    if (step < oldest_kept || (incomplete && step < newest)) doomed.push_back(entry.path());
  }
  for (const fs::path& p : doomed) {
    fs::remove(p / kManifest, ec);  // no longer a checkpoint
    RemoveCheckpointFiles(p.string(), /*all=*/true);
  }
}

}  // namespace

absl::StatusOr<LocalSave> SaveLocal(const std::string& dir, const std::vector<pipeline::StageSpec>& stages,
                                    const std::vector<std::vector<at::Tensor>>& tensors,
                                    const at::Tensor& optimizer, const RunIdentity& identity,
                                    const TrainingState& state, bool final, int keep,
                                    const std::string& owner) {
  if (keep < 1) return absl::InvalidArgumentError("checkpoints: keep at least 1");
  if (stages.empty() || stages.size() != tensors.size()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint: ", stages.size(), " stage specs and ",
                                                   tensors.size(), " stages' tensors"));
  }
  std::error_code ec;
  const std::string root = fs::absolute(dir, ec).lexically_normal().string();
  const std::string step_dir = absl::StrFormat("%s/step-%08d", root, state.step);
  fs::create_directories(step_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot make ", step_dir, ": ", ec.message()));

  Shard shard;
  for (size_t k = 0; k < stages.size(); ++k) shard.stages.push_back(static_cast<int64_t>(k));
  shard.tensors = tensors;
  shard.optimizer = optimizer;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    shard.rng = gen.get_state();
  }
  const std::string shard_bytes = EncodeShard(shard);
  RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(step_dir, "/", kShardFile), shard_bytes));
  const std::string specs = EncodeSpecs(stages);
  RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(step_dir, "/", kModelFile), specs));

  wire::Manifest m;
  m.set_format(kFormat);
  m.set_step(state.step);
  m.set_epoch(state.epoch);
  m.set_batch(state.batch);
  m.set_epoch_loss_sum(state.epoch_loss_sum);
  m.set_epoch_images(state.epoch_images);
  for (double l : state.losses) m.add_losses(l);
  m.set_model(identity.model);
  m.set_data(identity.data);
  m.set_optimizer(identity.optimizer);
  m.set_schedule(identity.schedule);
  m.set_micro_batches(identity.micro_batches);
  m.set_replicas(identity.replicas);
  m.set_final(final);
  m.set_created(NowUtc());
  wire::CheckpointShard* s = m.add_shards();
  s->set_file(kShardFile);
  s->set_worker(owner);
  s->set_bytes(static_cast<int64_t>(shard_bytes.size()));
  s->set_crc32(Crc32(shard_bytes));
  for (size_t k = 0; k < stages.size(); ++k) {
    s->add_stages(static_cast<int32_t>(k));
    wire::CheckpointStage* st = m.add_stages();
    st->set_index(static_cast<int32_t>(k));
    st->set_kind(stages[k].kind);
    st->set_name(stages[k].name);
    st->set_shard(0);
  }
  m.set_model_file(kModelFile);
  m.set_model_crc32(Crc32(specs));
  m.set_master_rng(std::string(static_cast<const char*>(shard.rng.contiguous().data_ptr()),
                               static_cast<size_t>(shard.rng.numel())));
  std::string json;
  google::protobuf::util::JsonPrintOptions print;
  print.add_whitespace = true;
  print.preserve_proto_field_names = true;
  print.always_print_primitive_fields = true;
  if (auto st = google::protobuf::util::MessageToJsonString(m, &json, print); !st.ok()) {
    return absl::InternalError(absl::StrCat("cannot write the manifest as JSON: ", st.ToString()));
  }
  // The commit: the manifest, last.
  RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(step_dir, "/", kManifest), json));
  PruneLocal(root, keep);
  return LocalSave{step_dir, static_cast<int64_t>(shard_bytes.size() + specs.size() + json.size())};
}

absl::StatusOr<at::Tensor> ReadLocalOptimizer(const Checkpoint& ck) {
  if (ck.manifest.shards_size() != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", ck.manifest_path, " has ", ck.manifest.shards_size(),
        " shards: it was saved by a pipeline, not by a parameter server (resume it without --mode ps)"));
  }
  const wire::CheckpointShard& s = ck.manifest.shards(0);
  ASSIGN_OR_RETURN(Shard shard, ReadShard(absl::StrCat(ck.dir, "/", s.file()), s.bytes(), s.crc32()));
  return shard.optimizer;
}

}  // namespace remora::checkpoint
