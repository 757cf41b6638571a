// checkpoint::Relayout (checkpoint/checkpoint.h): a checkpoint written
// again for another cut of the same model, every tensor and optimizer
// entry matched by its name in the whole model.
#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <stdexcept>

#include <ATen/core/Dict.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_util.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/manifest.h"
#include "checkpoint/owner_file.h"
#include "optim/state_dict.h"

namespace remora::checkpoint {
namespace {

namespace fs = std::filesystem;
using c10::impl::GenericDict;

// A stage's tensor names (parameters then buffers, StateNames) and how
// many of them are parameters: from the stage built on the CPU.
struct StageNames {
  std::vector<std::string> names;
  size_t parameters = 0;
};

absl::StatusOr<std::vector<StageNames>> NamesOf(const std::vector<pipeline::StageSpec>& specs,
                                                const std::string& which) {
  std::vector<StageNames> out;
  for (size_t k = 0; k < specs.size(); ++k) {
    auto module = pipeline::BuildStage(specs[k], c10::Device(c10::kCPU));
    RETURN_IF_ERROR(
        base::Annotate(module.status(), absl::StrCat("building ", which, " stage ", k, " to read its names")));
    StageNames s;
    s.names = pipeline::StateNames(**module);
    s.parameters = (*module)->Parameters().size();
    out.push_back(std::move(s));
  }
  return out;
}

// Names, a few of them, for a message.
std::string Some(const std::vector<std::string>& names) {
  constexpr size_t kShown = 6;
  std::vector<std::string> shown(names.begin(), names.begin() + std::min(names.size(), kShown));
  std::string out = absl::StrCat("'", absl::StrJoin(shown, "', '"), "'");
  if (names.size() > kShown) absl::StrAppend(&out, " and ", names.size() - kShown, " more");
  return out;
}

// Everything a checkpoint holds, by name in the whole model.
struct Named {
  std::map<std::string, at::Tensor> tensors;      // parameters and buffers
  std::map<std::string, c10::IValue> optimizer;  // a parameter's state-dict entry
  bool has_optimizer = false;
  c10::IValue group;  // the one parameter group's options (its "params" are renumbered)
  std::vector<OwnerFile> files;  // their generators
};

absl::StatusOr<Named> ReadNamed(const Checkpoint& ck, const std::vector<StageNames>& stages) {
  const Manifest& m = ck.manifest;
  Named out;
  for (size_t f = 0; f < m.files.size(); ++f) {
    const ManifestFile& s = m.files[f];
    const std::string path = absl::StrCat(ck.dir, "/", s.file);
    ASSIGN_OR_RETURN(OwnerFile owned, ReadOwnerFile(path, s.bytes, s.crc32));
    if (owned.names.size() != owned.stages.size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, " was saved before checkpoints named their tensors: resume it under the cut it was written "
                "under (the same workers, no --split-at)"));
    }
    std::vector<std::string> parameters;  // the owner file's, in the optimizer's numbering
    for (size_t i = 0; i < owned.stages.size(); ++i) {
      const int64_t k = owned.stages[i];
      if (k < 0 || k >= static_cast<int64_t>(stages.size())) {
        return absl::DataLossError(absl::StrCat(path, " holds stage ", k, "; the checkpoint has ", stages.size()));
      }
      if (owned.names[i].size() != owned.tensors[i].size()) {
        return absl::DataLossError(absl::StrCat(path, ": stage ", k, " has ", owned.tensors[i].size(),
                                                " tensors and ", owned.names[i].size(), " names"));
      }
      for (size_t j = 0; j < owned.names[i].size(); ++j) {
        if (!out.tensors.emplace(owned.names[i][j], owned.tensors[i][j]).second) {
          return absl::DataLossError(
              absl::StrCat(path, ": the tensor '", owned.names[i][j], "' is held by two stages of ", ck.dir));
        }
      }
      const StageNames& n = stages[static_cast<size_t>(k)];
      parameters.insert(parameters.end(), n.names.begin(), n.names.begin() + static_cast<std::ptrdiff_t>(n.parameters));
    }
    if (f > 0 && owned.optimizer.isNone() != !out.has_optimizer) {
      return absl::DataLossError(absl::StrCat(ck.dir, ": some owner files hold optimizer state and others none"));
    }
    if (owned.optimizer.isNone()) {
      out.files.push_back(std::move(owned));
      continue;
    }
    if (!owned.optimizer.isGenericDict()) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, " holds its optimizer state as LibTorch's archive (written before state dicts): resume it under "
                "the cut it was written under (the same workers, no --split-at)"));
    }
    GenericDict group(c10::StringType::get(), c10::AnyType::get());
    try {
      group = optim::OneParamGroup(owned.optimizer, path.c_str());
    } catch (const std::invalid_argument& e) {
      return absl::DataLossError(e.what());
    }
    const size_t listed = group.at("params").toListRef().size();
    if (listed != parameters.size()) {
      return absl::DataLossError(absl::StrCat(path, ": the optimizer numbers ", listed,
                                              " parameters; the owner file's stages have ", parameters.size()));
    }
    const GenericDict state = owned.optimizer.toGenericDict().at("state").toGenericDict();
    for (const auto& entry : state) {
      const int64_t i = entry.key().toInt();
      if (i < 0 || i >= static_cast<int64_t>(parameters.size())) {
        return absl::DataLossError(absl::StrCat(path, ": optimizer state for parameter ", i, " of ",
                                                parameters.size()));
      }
      out.optimizer[parameters[static_cast<size_t>(i)]] = entry.value();
    }
    if (!out.has_optimizer) out.group = group;
    out.has_optimizer = true;
    out.files.push_back(std::move(owned));
  }
  return out;
}

// The number of workers `placement` spreads `stages` over; an error when
// the lists differ in length, a worker is below 0 or one is left without
// a stage.
absl::StatusOr<int> WorkersOf(const std::vector<pipeline::StageSpec>& stages, const std::vector<int>& placement) {
  if (stages.empty() || placement.size() != stages.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("relayout: ", stages.size(), " stages and ", placement.size(), " placements"));
  }
  const int num_workers = *std::max_element(placement.begin(), placement.end()) + 1;
  const std::set<int> placed(placement.begin(), placement.end());
  if (*placed.begin() < 0 || static_cast<int>(placed.size()) != num_workers) {
    int w = 0;
    while (placed.count(w)) ++w;
    return absl::InvalidArgumentError(absl::StrCat("relayout: placement ", absl::StrJoin(placement, ","),
                                                   *placed.begin() < 0 ? " names a worker below 0"
                                                                       : absl::StrCat(" leaves worker ", w, " of ",
                                                                                      num_workers, " without a stage")));
  }
  return num_workers;
}

// The saved tensors and optimizer state dealt out to the new owners'
// files by name: the names each took (`used`) and those it lacked.
struct Dealt {
  std::vector<OwnerFile> files;
  std::set<std::string> used;
  std::vector<std::string> missing;
};

// Worker w's file under the new cut. A tied weight (held under two names,
// stored once under the first) is left out of the last stage's file.
void Deal(const Named& saved, const Manifest& m, const std::vector<StageNames>& new_names,
          const std::vector<int>& placement, bool tied, int w, Dealt& out) {
  const int num_stages = static_cast<int>(new_names.size());
  OwnerFile& owned = out.files[static_cast<size_t>(w)];
  int64_t num_parameters = 0;  // the owner file's, in its optimizer's numbering
  GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (int k = 0; k < num_stages; ++k) {
    if (placement[static_cast<size_t>(k)] != w) continue;
    const StageNames& n = new_names[static_cast<size_t>(k)];
    owned.stages.push_back(k);
    owned.tensors.emplace_back();
    owned.names.emplace_back();
    for (size_t j = 0; j < n.names.size(); ++j) {
      const std::string& name = n.names[j];
      const bool omitted = tied && k == num_stages - 1 && name == m.tied_last;
      if (!omitted) {
        const auto it = saved.tensors.find(name);
        if (it == saved.tensors.end()) {
          out.missing.push_back(name);
          continue;
        }
        owned.tensors.back().push_back(it->second);
        owned.names.back().push_back(name);
      }
      out.used.insert(name);
      if (j >= n.parameters || !saved.has_optimizer) continue;
      const int64_t index = num_parameters++;
      auto entry = saved.optimizer.find(name);
      if (entry == saved.optimizer.end() && name == m.tied_last) entry = saved.optimizer.find(m.tied_first);
      if (entry != saved.optimizer.end()) state.insert(index, entry->second);
    }
  }
  if (saved.has_optimizer) owned.optimizer = optim::OneGroupStateDict(state, saved.group, num_parameters);
  // (A worker's generators: the old worker's of the same place, or the
  // last one's where there are more workers now.)
  const OwnerFile& from = saved.files[std::min(static_cast<size_t>(w), saved.files.size() - 1)];
  owned.rng = from.rng;
  owned.cuda_rng = from.cuda_rng;
}

// An error when the new stages name a tensor the checkpoint lacks, or
// leave one of its tensors out.
absl::Status CheckEveryTensorDealt(const Checkpoint& ck, const Named& saved, const Dealt& dealt) {
  if (!dealt.missing.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "checkpoint ", ck.manifest_path, " holds no tensor named ", Some(dealt.missing),
        ", which the new stages have: it is of another model, or of a stage type that names its tensors by "
        "stage, not as the whole model does (resume it under the cut it was written under)"));
  }
  std::vector<std::string> extra;
  for (const auto& [name, tensor] : saved.tensors) {
    if (!dealt.used.count(name)) extra.push_back(name);
  }
  if (!extra.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", ck.manifest_path, " holds ", Some(extra),
        ", which none of the new stages has: the new cut leaves part of the model out (cut the whole model)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Checkpoint> Relayout(const Checkpoint& ck, const std::vector<pipeline::StageSpec>& stages,
                                    const std::vector<int>& placement, const std::string& dir) {
  const Manifest& m = ck.manifest;
  const int num_stages = static_cast<int>(stages.size());
  ASSIGN_OR_RETURN(const int num_workers, WorkersOf(stages, placement));
  ASSIGN_OR_RETURN(std::vector<pipeline::StageSpec> old_specs, LoadStageSpecs(ck));
  ASSIGN_OR_RETURN(std::vector<StageNames> old_names, NamesOf(old_specs, "the checkpoint's"));
  ASSIGN_OR_RETURN(std::vector<StageNames> new_names, NamesOf(stages, "the new"));
  ASSIGN_OR_RETURN(Named saved, ReadNamed(ck, old_names));

  // A tied weight: with two stages or more its last copy is left out of
  // the last stage's file again; one stage holds it once, under the first
  // name.
  const bool tied = !m.tied_last.empty() && num_stages >= 2;
  Dealt dealt;
  dealt.files.resize(static_cast<size_t>(num_workers));
  for (int w = 0; w < num_workers; ++w) Deal(saved, m, new_names, placement, tied, w, dealt);
  RETURN_IF_ERROR(CheckEveryTensorDealt(ck, saved, dealt));

  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir, ec);
  const std::string failed = absl::StrCat("writing checkpoint ", ck.dir, " again for ", num_stages,
                                          " stages over ", num_workers, " workers in ", dir);
  if (ec) return absl::InternalError(absl::StrCat(failed, ": cannot make the directory: ", ec.message()));
  wire::Manifest w = ManifestToWire(m);
  w.clear_stages();
  w.clear_files();
  w.set_tied_first(tied ? m.tied_first : "");
  w.set_tied_last(tied ? m.tied_last : "");
  for (size_t i = 0; i < dealt.files.size(); ++i) {
    const std::string file = absl::StrCat("owner-", i, ".pt");
    const std::string bytes = EncodeOwnerFile(dealt.files[i]);
    RETURN_IF_ERROR(base::Annotate(WriteFileAtomically(absl::StrCat(dir, "/", file), bytes), failed));
    wire::CheckpointFile* s = w.add_files();
    s->set_file(file);
    s->set_worker(i < m.files.size() ? m.files[i].worker : m.files.back().worker);
    s->set_bytes(static_cast<int64_t>(bytes.size()));
    s->set_crc32(Crc32(bytes));
    for (int64_t k : dealt.files[i].stages) s->add_stages(static_cast<int32_t>(k));
  }
  RETURN_IF_ERROR(base::Annotate(WriteModel(stages, placement, dir, &w), failed));
  RETURN_IF_ERROR(base::Annotate(CommitManifest(w, dir), failed));
  return Latest(dir);
}

}  // namespace remora::checkpoint
