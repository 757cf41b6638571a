// StageSpec (pipeline.h): what a stage is built from, a registered type's
// arguments or TorchScript bytes, read from --model's files.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <ATen/ops/empty.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status_util.h"
#include "pipeline/pipeline.h"

namespace remora::pipeline {

StageSpec StageSpec::Registered(std::string type, std::vector<c10::IValue> args) {
  StageSpec s;
  s.kind = "type";
  s.name = std::move(type);
  s.args = std::move(args);
  return s;
}

StageSpec StageSpec::TorchScript(std::string bytes, std::string label) {
  StageSpec s;
  s.kind = "script";
  s.name = std::move(label);
  s.script = std::move(bytes);
  return s;
}

absl::StatusOr<StageSpec> StageSpec::TorchScriptFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot read the TorchScript file ", path,
                                            " (does it exist, and may this user read it?)"));
  }
  std::stringstream bytes;
  bytes << in.rdbuf();
  if (bytes.str().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the TorchScript file ", path, " is empty"));
  }
  return TorchScript(bytes.str(), path);
}

absl::StatusOr<std::vector<StageSpec>> TorchScriptStages(const std::string& model) {
  std::vector<std::string> paths;
  std::error_code ec;
  if (std::filesystem::is_directory(model, ec)) {
    for (int k = 0;; ++k) {
      const std::string p = (std::filesystem::path(model) / absl::StrCat("stage", k, ".pt")).string();
      if (!std::filesystem::exists(p, ec)) break;
      paths.push_back(p);
    }
    if (paths.empty()) {
      return absl::NotFoundError(absl::StrCat(
          "--model ", model, " is a directory without stage0.pt (it should hold stage0.pt, "
          "stage1.pt, ... in pipeline order)"));
    }
    // A stage file past a gap in the numbers would be left out silently,
    // and the model cut short would still train.
    for (const auto& entry : std::filesystem::directory_iterator(model, ec)) {
      const std::string file = entry.path().filename().string();
      absl::string_view name = file;
      int64_t k = 0;
      if (absl::ConsumePrefix(&name, "stage") && absl::ConsumeSuffix(&name, ".pt") && absl::SimpleAtoi(name, &k) &&
          k >= static_cast<int64_t>(paths.size())) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--model ", model, " holds ", entry.path().filename().string(), " but no stage", paths.size(),
            ".pt: stage files are numbered from 0 without gaps (stage0.pt to stage", paths.size() - 1,
            ".pt were found); rename them, or move the extra file out"));
      }
    }
  } else {
    for (absl::string_view p : absl::StrSplit(model, ',', absl::SkipEmpty())) paths.emplace_back(p);
    if (paths.empty()) return absl::InvalidArgumentError("--model names no TorchScript file");
  }
  std::vector<StageSpec> specs;
  for (const auto& p : paths) {
    ASSIGN_OR_RETURN(StageSpec s, StageSpec::TorchScriptFile(p));
    specs.push_back(std::move(s));
  }
  return specs;
}

c10::IValue StageSpec::Payload() const {
  if (kind == "script") {
    at::Tensor bytes = at::empty({static_cast<int64_t>(script.size())}, at::kByte);
    std::memcpy(bytes.data_ptr(), script.data(), script.size());
    return bytes;
  }
  c10::impl::GenericList list(c10::AnyType::get());
  for (const auto& a : args) list.push_back(a);
  return list;
}

}  // namespace remora::pipeline
