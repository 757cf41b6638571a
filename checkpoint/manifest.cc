#include "checkpoint/manifest.h"

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <google/protobuf/util/json_util.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_util.h"
#include "checkpoint/owner_file.h"

namespace remora::checkpoint {
namespace {

namespace fs = std::filesystem;

std::string NowUtc() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace

std::string StepDir(const std::string& dir, int64_t step) {
  return absl::StrFormat("%s/step-%08d", dir, step);
}

std::string SaveFailed(int64_t step, const std::string& step_dir) {
  return absl::StrCat("checkpoint of step ", step, " in ", step_dir, " (the previous checkpoint is still the latest)");
}

wire::Manifest NewManifest(const RunIdentity& identity, const TrainingState& state, bool final) {
  Manifest m;
  m.format = kFormat;
  m.step = state.step;
  m.epoch = state.epoch;
  m.batch = state.batch;
  m.epoch_loss_sum = state.epoch_loss_sum;
  m.epoch_images = state.epoch_images;
  m.losses = state.losses;
  m.model = identity.model;
  m.data = identity.data;
  m.optimizer = identity.optimizer;
  m.schedule = identity.schedule;
  m.micro_batches = identity.micro_batches;
  m.replicas = identity.replicas;
  m.checkpoint_every = identity.checkpoint_every;
  m.keep = identity.keep;
  m.final = final;
  m.created = NowUtc();
  const at::Tensor rng = CpuGeneratorState().contiguous();
  m.master_rng = std::string(static_cast<const char*>(rng.data_ptr()), rng.numel());
  return ManifestToWire(m);
}

Manifest ManifestFromWire(const wire::Manifest& w) {
  Manifest m;
  m.format = w.format();
  m.step = w.step();
  m.epoch = w.epoch();
  m.batch = w.batch();
  m.epoch_loss_sum = w.epoch_loss_sum();
  m.epoch_images = w.epoch_images();
  m.losses.assign(w.losses().begin(), w.losses().end());
  m.model = w.model();
  m.data = w.data();
  m.optimizer = w.optimizer();
  m.schedule = w.schedule();
  m.micro_batches = w.micro_batches();
  m.replicas = w.replicas();
  m.checkpoint_every = w.checkpoint_every();
  m.keep = w.keep();
  m.tied_first = w.tied_first();
  m.tied_last = w.tied_last();
  for (const wire::CheckpointStage& s : w.stages()) {
    m.stages.push_back(ManifestStage{s.index(), s.kind(), s.name(), s.owner()});
  }
  for (const wire::CheckpointFile& s : w.files()) {
    m.files.push_back(ManifestFile{s.file(), s.worker(), {s.stages().begin(), s.stages().end()},
                                     s.bytes(), s.crc32()});
  }
  m.model_file = w.model_file();
  m.model_crc32 = w.model_crc32();
  m.master_rng = w.master_rng();
  m.final = w.final();
  m.created = w.created();
  return m;
}

wire::Manifest ManifestToWire(const Manifest& m) {
  wire::Manifest w;
  w.set_format(m.format);
  w.set_step(m.step);
  w.set_epoch(m.epoch);
  w.set_batch(m.batch);
  w.set_epoch_loss_sum(m.epoch_loss_sum);
  w.set_epoch_images(m.epoch_images);
  for (double l : m.losses) w.add_losses(l);
  w.set_model(m.model);
  w.set_data(m.data);
  w.set_optimizer(m.optimizer);
  w.set_schedule(m.schedule);
  w.set_micro_batches(m.micro_batches);
  w.set_replicas(m.replicas);
  w.set_checkpoint_every(m.checkpoint_every);
  w.set_keep(m.keep);
  w.set_tied_first(m.tied_first);
  w.set_tied_last(m.tied_last);
  for (const ManifestStage& s : m.stages) {
    wire::CheckpointStage* o = w.add_stages();
    o->set_index(s.index);
    o->set_kind(s.kind);
    o->set_name(s.name);
    o->set_owner(s.owner);
  }
  for (const ManifestFile& s : m.files) {
    wire::CheckpointFile* o = w.add_files();
    o->set_file(s.file);
    o->set_worker(s.worker);
    for (int k : s.stages) o->add_stages(k);
    o->set_bytes(s.bytes);
    o->set_crc32(s.crc32);
  }
  w.set_model_file(m.model_file);
  w.set_model_crc32(m.model_crc32);
  w.set_master_rng(m.master_rng);
  w.set_final(m.final);
  w.set_created(m.created);
  return w;
}

absl::Status WriteModel(const std::vector<pipeline::StageSpec>& stages, const std::vector<int>& file_of,
                        const std::string& dir, wire::Manifest* m) {
  // model.pt: [{kind, name, payload, device}], as LoadStageSpecs reads it.
  c10::impl::GenericList list(c10::AnyType::get());
  for (size_t k = 0; k < stages.size(); ++k) {
    const pipeline::StageSpec& s = stages[k];
    c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
    d.insert("kind", s.kind);
    d.insert("name", s.name);
    d.insert("payload", s.Payload());
    d.insert("device", s.device);
    list.push_back(d);
    wire::CheckpointStage* stage = m->add_stages();
    stage->set_index(static_cast<int32_t>(k));
    stage->set_kind(s.kind);
    stage->set_name(s.name);
    stage->set_owner(k < file_of.size() ? file_of[k] : 0);
  }
  const std::vector<char> pickled = torch::jit::pickle_save(list);
  const std::string bytes(pickled.begin(), pickled.end());
  RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(dir, "/", kModelFile), bytes));
  m->set_model_file(kModelFile);
  m->set_model_crc32(Crc32(bytes));
  return absl::OkStatus();
}

absl::Status CommitManifest(const wire::Manifest& m, const std::string& dir) {
  std::string json;
  google::protobuf::util::JsonPrintOptions print;
  print.add_whitespace = true;
  print.preserve_proto_field_names = true;
  print.always_print_primitive_fields = true;
  if (auto s = google::protobuf::util::MessageToJsonString(m, &json, print); !s.ok()) {
    return absl::InternalError(absl::StrCat("cannot write the manifest as JSON: ", s.ToString()));
  }
  return WriteFileAtomically(absl::StrCat(dir, "/", kManifestFile), json);
}

namespace {

// N of a directory named `prefix`N, else -1.
int64_t NumberAfter(const fs::path& p, absl::string_view prefix) {
  const std::string name = p.filename().string();
  int64_t n = -1;
  if (!absl::StartsWith(name, prefix) || !absl::SimpleAtoi(name.substr(prefix.size()), &n)) return -1;
  return n;
}

}  // namespace

int64_t StepOf(const fs::path& p) { return NumberAfter(p, "step-"); }

std::vector<int64_t> CompleteSteps(const std::string& dir) {
  std::vector<int64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const int64_t step = StepOf(entry.path());
    if (step >= 0 && fs::exists(entry.path() / kManifestFile, ec)) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::vector<std::string> PrunableDirs(const std::string& dir, int keep) {
  const std::vector<int64_t> complete = CompleteSteps(dir);
  if (complete.empty()) return {};
  const size_t drop = complete.size() > static_cast<size_t>(keep) ? complete.size() - keep : 0;
  const int64_t oldest_kept = complete[drop], newest = complete.back();
  std::vector<std::string> doomed;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const int64_t step = StepOf(entry.path());
    const bool incomplete = !fs::exists(entry.path() / kManifestFile, ec);
    if (step >= 0 && (step < oldest_kept || (incomplete && step < newest))) {
      doomed.push_back(entry.path().string());
    }
    // A checkpoint written again for another cut (relayout-step-N) goes
    // with the step it was written from.
    const int64_t moved = NumberAfter(entry.path(), "relayout-step-");
    if (moved >= 0 && moved < oldest_kept) doomed.push_back(entry.path().string());
  }
  return doomed;
}

}  // namespace remora::checkpoint
