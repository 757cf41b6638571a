#include "launch/local_group.h"

#include <csignal>

#include "absl/strings/str_cat.h"
#include "autograd/dist_autograd.h"

namespace remora::launch {

absl::StatusOr<LocalGroup> StartLocalGroup(const std::vector<std::string>& names,
                                           const Registry* registry,
                                           const std::vector<std::string>& extra_args,
                                           AgentOptions options,
                                           const WorkerProgram& program) {
  if (options.name.empty()) options.name = "master";
  options.is_master = true;
  options.workers = names;
  LocalGroup group;
  auto master = Agent::Start(options, registry);
  if (!master.ok()) return master.status();
  group.master = std::move(*master);
  dist_autograd::Enable(*group.master);
  const std::string worker_bin = SiblingProgram(program.name);
  for (const auto& name : names) {
    std::vector<std::string> argv = {worker_bin};
    argv.insert(argv.end(), program.leading_args.begin(), program.leading_args.end());
    argv.insert(argv.end(), {"--name", name, "--master", group.master->self().address});
    argv.insert(argv.end(), extra_args.begin(), extra_args.end());
    auto p = Subprocess::Spawn(argv, /*output=*/"", program.env);
    if (!p.ok()) return p.status();
    group.workers.push_back(std::move(*p));
  }
  if (auto s = group.master->Join(); !s.ok()) return s;
  return group;
}

absl::Status LocalGroup::Shutdown(absl::Duration timeout) {
  absl::Status status = master ? master->Shutdown() : absl::OkStatus();
  for (size_t i = 0; i < workers.size(); ++i) {
    auto code = workers[i]->Wait(timeout);
    if (!code.ok() || *code != 0) {
      if (code.ok()) {
        status.Update(absl::InternalError(absl::StrCat("worker ", i + 1, " exited with ", *code)));
      } else {
        workers[i]->Signal(SIGKILL);
        status.Update(absl::DeadlineExceededError(absl::StrCat("worker ", i + 1, " did not exit")));
      }
    }
  }
  return status;
}

}  // namespace remora::launch
