#include "checkpoint/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <google/protobuf/util/json_util.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status_util.h"
#include "checkpoint/manifest.h"
#include "checkpoint/protocol.h"
#include "checkpoint/owner_file.h"
#include "pipeline/protocol.h"
#include "data/datasets.h"

namespace remora::checkpoint {
namespace {

namespace fs = std::filesystem;

// What holds `worker`'s optimizer state: the pipeline's holder for it
// (ZeRO-1's gradient group), else its per-owner optimizer, else None (a
// worker whose stages have no parameters has none).
c10::IValue OptimizerOf(const pipeline::Pipeline& pipe, const std::string& worker) {
  if (std::optional<rpc::RRef> holder = pipe.optimizer_state_holder(worker)) return holder->ToIValue();
  for (const rpc::RRef& opt : pipe.optimizer().owners()) {
    if (opt.owner_name() == worker) return opt.ToIValue();
  }
  return c10::IValue();
}

// Stage indices and RRefs on pipeline worker i.
std::pair<std::vector<int64_t>, std::vector<c10::IValue>> StagesOn(const pipeline::Pipeline& pipe, size_t i) {
  std::vector<int64_t> indices;
  std::vector<c10::IValue> rrefs;
  for (int k = 0; k < pipe.num_stages(); ++k) {
    if (pipe.schedule().WorkerOf(k) != static_cast<int>(i)) continue;  // (k mod n, or zbv's V)
    indices.push_back(k);
    rrefs.push_back(pipe.stages()[k].ToIValue());
  }
  return {indices, rrefs};
}

// Each stage's owner file: its worker's place in the pipeline.
std::vector<int> FileOf(const pipeline::Pipeline& pipe) {
  std::vector<int> file_of;
  for (int k = 0; k < pipe.num_stages(); ++k) file_of.push_back(pipe.schedule().WorkerOf(k));
  return file_of;
}

absl::StatusOr<Checkpoint> Open(const std::string& dir) {
  Checkpoint ck;
  ck.dir = dir;
  ck.manifest_path = absl::StrCat(dir, "/", kManifestFile);
  ASSIGN_OR_RETURN(std::string json, ReadFile(ck.manifest_path));
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  wire::Manifest read;
  auto parsed = google::protobuf::util::JsonStringToMessage(json, &read, options);
  if (!parsed.ok()) {
    // (Its message's first line: the rest quotes the file's text.)
    const std::string why(parsed.message());
    return absl::DataLossError(absl::StrCat(ck.manifest_path, " is not a remora manifest (",
                                            why.substr(0, why.find('\n')), ")"));
  }
  ck.manifest = ManifestFromWire(read);
  const Manifest& m = ck.manifest;
  if (m.format != kFormat) {
    return absl::InvalidArgumentError(absl::StrCat(ck.manifest_path, ": format ", m.format,
                                                   " is not ", kFormat, " (written by another remora?)"));
  }
  if (m.files.empty() || m.stages.empty()) {
    return absl::DataLossError(absl::StrCat(ck.manifest_path, " lists no owner files or no stages"));
  }
  // (A run goes on from here: a position before any run's start is no
  // checkpoint remora wrote.)
  if (m.step < 0 || m.epoch < 0 || m.batch < 0 || m.epoch_images < 0) {
    return absl::DataLossError(absl::StrCat(ck.manifest_path, ": step ", m.step, ", epoch ", m.epoch, ", batch ",
                                            m.batch, ", images ", m.epoch_images,
                                            " is no position of a run (edited by hand?)"));
  }
  for (const ManifestStage& stage : m.stages) {
    if (stage.owner < 0 || stage.owner >= static_cast<int>(m.files.size())) {
      return absl::DataLossError(absl::StrCat(ck.manifest_path, ": stage ", stage.index,
                                              " names owner file ", stage.owner, " of ", m.files.size()));
    }
  }
  return ck;
}

}  // namespace

TrainingState Checkpoint::state() const {
  TrainingState s;
  s.step = manifest.step;
  s.epoch = manifest.epoch;
  s.batch = manifest.batch;
  s.epoch_loss_sum = manifest.epoch_loss_sum;
  s.epoch_images = manifest.epoch_images;
  s.losses = manifest.losses;
  return s;
}

absl::StatusOr<std::unique_ptr<Checkpointer>> Checkpointer::Create(rpc::Agent& agent, std::string dir, int keep) {
  if (keep < 1) return absl::InvalidArgumentError("checkpoints: keep at least 1");
  std::error_code ec;
  const fs::path abs = fs::absolute(dir, ec);
  if (ec || (!fs::create_directories(abs, ec) && ec) || !fs::is_directory(abs, ec)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot make the checkpoint directory ", dir, ": ",
                                                   ec ? ec.message() : "not a directory"));
  }
  return std::unique_ptr<Checkpointer>(new Checkpointer(agent, abs.lexically_normal().string(), keep));
}

namespace {

// Each owner file's size and CRC-32 as its owner replied (an OwnerFileWrittenReply
// per owner file, in order) into `m`; returns their bytes in all.
absl::StatusOr<int64_t> RecordWritten(const std::vector<c10::IValue>& written, Manifest& m) {
  int64_t total = 0;
  for (size_t i = 0; i < written.size(); ++i) {
    ASSIGN_OR_RETURN(const OwnerFileWrittenReply r, rpc::DecodeTuple<OwnerFileWrittenReply>(written[i]));
    m.files[i].bytes = r.bytes;
    m.files[i].crc32 = r.crc32;
    total += r.bytes;
  }
  return total;
}

// Waits for every one of `replies` (`workers[i]` owes `replies[i]`) and
// returns their values, or the first failure, named by `what(i)`. A worker
// that stops answering meanwhile (stopped, or hung in a handler, which no
// keepalive sees; the call's timeout is minutes) is found by the step's
// probes (pipeline::WaitForReplies) within seconds, for elastic recovery
// to replace.
absl::StatusOr<std::vector<c10::IValue>> WaitProbing(rpc::Agent& agent, const std::vector<std::string>& workers,
                                                     std::vector<rpc::Future<c10::IValue>>& replies,
                                                     const std::function<std::string(size_t)>& what) {
  absl::Status status;
  if (const int i = pipeline::WaitForReplies(agent, workers, replies, [] {}, &status); i >= 0) {
    return base::Annotate(status, what(static_cast<size_t>(i)));
  }
  return rpc::WaitAll(replies, what);
}

}  // namespace

absl::Status Checkpointer::Save(pipeline::Pipeline& pipe, const std::vector<pipeline::StageSpec>& stages,
                                const RunIdentity& identity, const TrainingState& state, bool final,
                                bool background) {
  if (static_cast<int>(stages.size()) != pipe.num_stages()) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint: ", stages.size(), " stage specs for ",
                                                   pipe.num_stages(), " stages"));
  }
  RETURN_IF_ERROR(Flush());  // an earlier background save first
  const std::string dir = StepDir(dir_, state.step);
  if (dir == last_ && final && !last_manifest_.final) {
    last_manifest_.final = true;
    return CommitManifest(ManifestToWire(last_manifest_), dir);
  }
  background &= !final;  // the run's last checkpoint is there when the run ends
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot make ", dir, ": ", ec.message()));

  wire::Manifest m = NewManifest(identity, state, final);
  // A tied weight: stored once, with the first stage.
  m.set_tied_first(pipe.tied_first());
  m.set_tied_last(pipe.tied_last());
  const int64_t last = pipe.num_stages() - 1;

  // Every owner writes its owner file at once (or copies its state and writes
  // it in the background).
  const std::vector<std::string>& workers = pipe.workers();
  std::vector<rpc::Future<c10::IValue>> pending;
  std::vector<std::string> paths;
  for (size_t i = 0; i < workers.size(); ++i) {
    auto [indices, rrefs] = StagesOn(pipe, i);
    const std::string file = absl::StrCat("owner-", i, ".pt");
    wire::CheckpointFile* owned = m.add_files();
    owned->set_file(file);
    owned->set_worker(workers[i]);
    for (int64_t k : indices) owned->add_stages(static_cast<int32_t>(k));
    paths.push_back(absl::StrCat(dir, "/", file));
    SaveOwnerFileRequest save;
    save.path = paths.back();
    save.stages = indices;
    save.stage_rrefs = rrefs;
    save.optimizer = OptimizerOf(pipe, workers[i]);
    save.background = background;
    if (!pipe.tied_last().empty() && std::find(indices.begin(), indices.end(), last) != indices.end()) {
      save.omit_stage = last;
      save.omit_name = pipe.tied_last();
    }
    pending.push_back(agent_.rpc_async(workers[i], SaveOwnerFileRequest::kFunction, rpc::EncodeCall(save)));
  }
  const std::string failed = SaveFailed(state.step, dir);
  absl::StatusOr<std::vector<c10::IValue>> written = WaitProbing(agent_, workers, pending, [&workers](size_t i) {
    return absl::StrCat("saving owner file ", i, " on worker '", workers[i], "'");
  });
  RETURN_IF_ERROR(base::Annotate(written.status(), failed));
  RETURN_IF_ERROR(base::Annotate(WriteModel(stages, FileOf(pipe), dir, &m), failed));
  if (background) {
    auto p = std::make_unique<Pending>();
    p->dir = dir;
    p->manifest = ManifestFromWire(m);
    p->workers = workers;
    for (size_t i = 0; i < workers.size(); ++i) {
      p->written.push_back(
          agent_.rpc_async(workers[i], OwnerFileWrittenRequest::kFunction, rpc::EncodeCall(OwnerFileWrittenRequest{paths[i]})));
    }
    pending_ = std::move(p);
    return absl::OkStatus();
  }
  Manifest done = ManifestFromWire(m);
  absl::StatusOr<int64_t> total = RecordWritten(*written, done);
  RETURN_IF_ERROR(base::Annotate(total.status(), failed));
  return base::Annotate(Commit(done, dir, *total, workers), failed);
}

absl::Status Checkpointer::Commit(const Manifest& m, const std::string& dir, int64_t total,
                                  const std::vector<std::string>& workers) {
  // The commit: the manifest, last.
  RETURN_IF_ERROR(CommitManifest(ManifestToWire(m), dir));
  last_ = dir;
  last_bytes_ = total;
  last_manifest_ = m;
  return Prune(workers);
}

absl::StatusOr<bool> Checkpointer::Poll() {
  if (pending_ == nullptr) return false;
  for (const auto& f : pending_->written) {
    if (!f.ready()) return false;
  }
  RETURN_IF_ERROR(Flush());
  return true;
}

absl::Status Checkpointer::Flush() {
  if (pending_ == nullptr) return absl::OkStatus();
  std::unique_ptr<Pending> p = std::move(pending_);
  const std::vector<std::string>& workers = p->workers;
  absl::StatusOr<std::vector<c10::IValue>> written = WaitProbing(agent_, workers, p->written, [&workers](size_t i) {
    return absl::StrCat("writing owner file ", i, " on worker '", workers[i], "'");
  });
  const std::string failed = SaveFailed(p->manifest.step, p->dir);
  RETURN_IF_ERROR(base::Annotate(written.status(), failed));
  absl::StatusOr<int64_t> total = RecordWritten(*written, p->manifest);
  RETURN_IF_ERROR(base::Annotate(total.status(), failed));
  return base::Annotate(Commit(p->manifest, p->dir, *total, workers), failed);
}

absl::Status Checkpointer::Prune(const std::vector<std::string>& workers) {
  std::error_code ec;
  for (const std::string& dir : PrunableDirs(dir_, keep_)) {
    fs::remove(fs::path(dir) / kManifestFile, ec);  // no longer a checkpoint
    std::vector<rpc::Future<c10::IValue>> removing;
    for (const auto& w : workers) {
      removing.push_back(agent_.rpc_async(w, RemoveRequest::kFunction, rpc::EncodeCall(RemoveRequest{dir})));
    }
    for (auto& r : removing) r.wait().IgnoreError();  // a file left behind is not a failure
    RemoveCheckpointFiles(dir, /*all=*/true);
  }
  return absl::OkStatus();
}

bool IsCheckpointDir(const std::string& path) {
  std::error_code ec;
  return fs::exists(fs::path(path) / kManifestFile, ec);
}

absl::StatusOr<Checkpoint> Latest(const std::string& given) {
  std::string path = given;
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  std::error_code ec;
  if (IsCheckpointDir(path)) return Open(path);
  if (!fs::is_directory(path, ec)) {
    return absl::NotFoundError(absl::StrCat("no checkpoint at ", path, ": ",
                                            fs::exists(path, ec) ? "not a directory" : "no such directory"));
  }
  const std::vector<int64_t> steps = CompleteSteps(path);
  if (steps.empty()) {
    return absl::NotFoundError(absl::StrCat("no complete checkpoint in ", path,
                                            " (one is complete once its manifest.json is written)"));
  }
  // (A manifest garbled on disk leaves the one before it to go on from.)
  const std::string root = fs::path(path).lexically_normal().string();
  std::vector<std::string> passed_over;
  absl::Status newest;
  for (auto step = steps.rbegin(); step != steps.rend(); ++step) {
    absl::StatusOr<Checkpoint> ck = Open(StepDir(root, *step));
    if (ck.ok()) {
      ck->passed_over = std::move(passed_over);
      return ck;
    }
    if (newest.ok()) newest = ck.status();
    passed_over.push_back(std::string(ck.status().message()));
  }
  return newest;
}

namespace {

// A data identity ("imagefolder:DIR batch-size=8 ...") as runs compare it:
// its dataset's directory absolute (a run saved before names were made
// absolute recorded it as typed, relative to where it started: resolved
// from here), and without `image-size=` tokens when `drop_image_size` (a
// run that did not record one yet).
std::string ComparableData(const std::string& data, bool drop_image_size) {
  std::vector<std::string> tokens = absl::StrSplit(data, ' ');
  if (!tokens.empty()) tokens[0] = data::AbsoluteDatasetName(tokens[0]);
  if (drop_image_size) {
    tokens.erase(std::remove_if(tokens.begin(), tokens.end(),
                                [](const std::string& t) { return absl::StartsWith(t, "image-size="); }),
                 tokens.end());
  }
  return absl::StrJoin(tokens, " ");
}

}  // namespace

absl::Status CheckMatches(const Checkpoint& ck, const RunIdentity& id) {
  const Manifest& m = ck.manifest;
  std::vector<std::string> diffs;
  auto check = [&diffs](const char* what, const std::string& saved, const std::string& now) {
    if (saved != now) diffs.push_back(absl::StrCat(what, " was '", saved, "', this run's is '", now, "'"));
  };
  check("the model", m.model, id.model);
  const bool older = !absl::StrContains(m.data, " image-size=");
  if (ComparableData(m.data, older) != ComparableData(id.data, older)) check("the data", m.data, id.data);
  check("the optimizer", m.optimizer, id.optimizer);
  check("the schedule", m.schedule, id.schedule);
  check("the micro-batch count", absl::StrCat(m.micro_batches), absl::StrCat(id.micro_batches));
  if (diffs.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint ", ck.manifest_path, " is of another run: ", absl::StrJoin(diffs, "; "),
      ". Resume with the flags of the run that wrote it"));
}

absl::StatusOr<std::vector<pipeline::StageSpec>> LoadStageSpecs(const Checkpoint& ck) {
  const std::string path = absl::StrCat(ck.dir, "/", ck.manifest.model_file);
  ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  if (Crc32(bytes) != ck.manifest.model_crc32) {
    return absl::DataLossError(absl::StrCat(path, " has CRC-32 ", Crc32(bytes), "; the manifest says ",
                                            ck.manifest.model_crc32, ": the file is corrupt"));
  }
  std::vector<pipeline::StageSpec> specs;
  try {
    const c10::IValue v = torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
    for (const c10::IValue& e : v.toListRef()) {
      const c10::impl::GenericDict d = e.toGenericDict();
      pipeline::StageSpec spec;
      if (d.at("kind").toStringRef() == "script") {
        const at::Tensor b = d.at("payload").toTensor().contiguous();
        spec = pipeline::StageSpec::TorchScript(
            std::string(static_cast<const char*>(b.data_ptr()), b.numel()), d.at("name").toStringRef());
      } else {
        std::vector<c10::IValue> args;
        for (const c10::IValue& a : d.at("payload").toListRef()) args.push_back(a);
        spec = pipeline::StageSpec::Registered(d.at("name").toStringRef(), std::move(args));
      }
      spec.device = d.at("device").toStringRef();
      specs.push_back(std::move(spec));
    }
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat(path, ": not a remora model file"));
  }
  if (specs.size() != ck.manifest.stages.size()) {
    return absl::DataLossError(absl::StrCat(path, " has ", specs.size(), " stages; ", ck.manifest_path,
                                            " lists ", ck.manifest.stages.size()));
  }
  return specs;
}

absl::Status Restore(pipeline::Pipeline& pipe, const Checkpoint& ck) {
  const Manifest& m = ck.manifest;
  const std::vector<std::string>& workers = pipe.workers();
  if (static_cast<int>(m.stages.size()) != pipe.num_stages() || m.files.size() != workers.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", ck.manifest_path, " holds ", m.stages.size(), " stages in ", m.files.size(),
        " owner files (one per pipeline worker); this run has ", pipe.num_stages(), " stages over ",
        workers.size(), " workers: give ", m.files.size(), " workers per replica"));
  }
  std::vector<rpc::Future<c10::IValue>> pending;
  for (size_t i = 0; i < workers.size(); ++i) {
    const ManifestFile& owned = m.files[i];
    auto [indices, rrefs] = StagesOn(pipe, i);
    if (std::vector<int64_t>(owned.stages.begin(), owned.stages.end()) != indices) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", ck.manifest_path, " keeps stages ", absl::StrJoin(owned.stages, ", "), " in owner file ", i,
          ", but this run places stages ", absl::StrJoin(indices, ", "), " on its worker '", workers[i],
          "' (schedule ", pipe.schedule().name, "): resume with the schedule the checkpoint was written under "
          "(zbv places stages in a V, the others stage k on worker k mod n)"));
    }
    LoadOwnerFileRequest load;
    load.path = absl::StrCat(ck.dir, "/", owned.file);
    load.bytes = owned.bytes;
    load.crc32 = owned.crc32;
    load.stages = indices;
    load.stage_rrefs = rrefs;
    load.optimizer = OptimizerOf(pipe, workers[i]);
    if (!m.tied_last.empty()) {
      load.omitted_stage = pipe.num_stages() - 1;
      load.omitted_name = m.tied_last;
    }
    pending.push_back(pipe.agent().rpc_async(workers[i], LoadOwnerFileRequest::kFunction, rpc::EncodeCall(load)));
  }
  RETURN_IF_ERROR(WaitProbing(pipe.agent(), workers, pending, [&workers](size_t i) {
                    return absl::StrCat("restoring owner file ", i, " on worker '", workers[i], "'");
                  }).status());
  if (!m.tied_last.empty()) {
    // The tied weight's last copy: the first stage's, as stored.
    const std::string where = absl::StrCat("restoring the tied weight '", m.tied_last, "' of ", ck.manifest_path);
    absl::StatusOr<c10::IValue> weight = pipe.stages().front().rpc_sync(
        pipeline::StageParameterRequest::kMethod, rpc::EncodeCall(pipeline::StageParameterRequest{m.tied_first, {}}));
    RETURN_IF_ERROR(base::Annotate(weight.status(), where));
    RETURN_IF_ERROR(base::Annotate(pipe.stages().back()
                                 .rpc_sync(pipeline::StageParameterRequest::kMethod,
                                           rpc::EncodeCall(pipeline::StageParameterRequest{m.tied_last, *weight}))
                                 .status(),
                             where));
  }
  return RestoreCpuGenerator(ck);
}

absl::Status RestoreCpuGenerator(const Checkpoint& ck) {
  const std::string& rng = ck.manifest.master_rng;
  at::Tensor state = at::empty({static_cast<int64_t>(rng.size())}, at::kByte);
  std::memcpy(state.data_ptr(), rng.data(), rng.size());
  try {
    SetCpuGeneratorState(state);
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat(ck.manifest_path, ": master_rng"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::vector<at::Tensor>>> ReadStageTensors(const Checkpoint& ck,
                                                                       std::vector<std::vector<std::string>>* names) {
  const Manifest& m = ck.manifest;
  std::vector<std::vector<at::Tensor>> out(m.stages.size());
  if (names != nullptr) names->assign(m.stages.size(), {});
  std::vector<bool> seen(m.stages.size(), false);
  for (const ManifestFile& s : m.files) {
    ASSIGN_OR_RETURN(OwnerFile owned, ReadOwnerFile(absl::StrCat(ck.dir, "/", s.file), s.bytes, s.crc32));
    for (size_t i = 0; i < owned.stages.size(); ++i) {
      const int64_t k = owned.stages[i];
      if (k < 0 || k >= static_cast<int64_t>(m.stages.size()) || seen[k]) {
        return absl::DataLossError(absl::StrCat(ck.dir, "/", s.file, " holds stage ", k,
                                                ", which is out of range or in another owner file too"));
      }
      seen[k] = true;
      out[k] = std::move(owned.tensors[i]);
      if (names != nullptr && !owned.names.empty()) (*names)[k] = std::move(owned.names[i]);
    }
  }
  for (size_t k = 0; k < m.stages.size(); ++k) {
    if (!seen[k]) return absl::DataLossError(absl::StrCat(ck.manifest_path, ": no owner file holds stage ", k));
  }
  return out;
}

namespace {

// The tied weight's last copy (Manifest::tied_last) set in `last` from the
// first stage's saved tensors.
absl::Status FillTied(const Checkpoint& ck, const std::vector<at::Tensor>& first,
                      const std::vector<std::string>& first_names, pipeline::StageModule& last) {
  const Manifest& m = ck.manifest;
  const auto saved = std::find(first_names.begin(), first_names.end(), m.tied_first);
  absl::StatusOr<at::Tensor> copy = pipeline::ParameterNamed(last, m.tied_last, absl::StrCat(ck.dir, ": the last stage"));
  if (saved == first_names.end() || !copy.ok() || static_cast<size_t>(saved - first_names.begin()) >= first.size()) {
    return absl::DataLossError(absl::StrCat(ck.manifest_path, ": the tied weight '", m.tied_first,
                                            "' of stage 0 or its copy '", m.tied_last, "' in the last stage is not there"));
  }
  const at::Tensor& weight = first[static_cast<size_t>(saved - first_names.begin())];
  if (weight.sizes() != copy->sizes()) {
    return absl::DataLossError(absl::StrCat(ck.manifest_path, ": the tied weight '", m.tied_first, "' is ",
                                            c10::str(weight.sizes()), ", its copy '", m.tied_last, "' ",
                                            c10::str(copy->sizes())));
  }
  c10::NoGradGuard no_grad;
  copy->copy_(weight);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<pipeline::StageModule>>> LoadModel(const Checkpoint& ck,
                                                                              c10::Device device) {
  ASSIGN_OR_RETURN(std::vector<pipeline::StageSpec> specs, LoadStageSpecs(ck));
  std::vector<std::vector<std::string>> names;
  ASSIGN_OR_RETURN(auto tensors, ReadStageTensors(ck, &names));
  std::vector<std::unique_ptr<pipeline::StageModule>> model;
  for (size_t k = 0; k < specs.size(); ++k) {
    ASSIGN_OR_RETURN(auto stage, pipeline::BuildStage(specs[k], device));
    try {
      const bool tied_here = !ck.manifest.tied_last.empty() && k + 1 == specs.size() && k > 0;
      pipeline::LoadState(*stage, tensors[k], absl::StrCat(ck.dir, ": stage ", k), names[k],
                          tied_here ? ck.manifest.tied_last : "");
      if (tied_here) RETURN_IF_ERROR(FillTied(ck, tensors.front(), names.front(), *stage));
    } catch (...) {
      return base::StatusFromCurrentException("loading the checkpoint's parameters");
    }
    stage->Train(false);
    model.push_back(std::move(stage));
  }
  return model;
}

}  // namespace remora::checkpoint
