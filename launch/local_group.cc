#include "launch/local_group.h"

#include <unistd.h>

#include <csignal>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
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
  if (access(worker_bin.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no worker program ", worker_bin, " to start: a local group runs '", program.name,
        "' from the directory of this program; build it there (remora's worker, or a program of yours that "
        "calls launch::WorkerMain) or name another with launch::WorkerProgram"));
  }
  for (const auto& name : names) {
    std::vector<std::string> argv = {worker_bin};
    argv.insert(argv.end(), program.leading_args.begin(), program.leading_args.end());
    argv.insert(argv.end(), {"--name", name, "--master", group.master->self().address});
    argv.insert(argv.end(), extra_args.begin(), extra_args.end());
    auto p = Subprocess::Spawn(argv, /*output=*/"", program.env);
    if (!p.ok()) return p.status();
    group.workers.push_back(std::move(*p));
  }
  // A worker that exits before the group forms (a crash, a bad flag among
  // extra_args) ends the wait at once, naming it.
  absl::Notification joined;
  std::thread watcher([&group, &joined, &names, &worker_bin] {
    while (!joined.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
      for (size_t i = 0; i < group.workers.size(); ++i) {
        if (group.workers[i]->running()) continue;
        const absl::StatusOr<int> code = group.workers[i]->Wait(absl::ZeroDuration());
        group.master->StopJoining(absl::FailedPreconditionError(absl::StrCat(
            "the worker program ", worker_bin, " for '", names[i], "' exited",
            code.ok() ? absl::StrCat(" with code ", *code) : "", " before the group formed: its output above says why")));
        return;
      }
    }
  });
  absl::Status joined_status = group.master->Join();
  joined.Notify();
  watcher.join();
  if (!joined_status.ok()) return joined_status;
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
