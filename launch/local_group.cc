#include "launch/local_group.h"

#include <unistd.h>

#include <csignal>
#include <iostream>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "autograd/dist_autograd.h"

namespace remora::launch {
namespace {

// The workers' addresses, checked before any starts: one per worker (or
// none), each HOST:PORT, no two alike, each port free now.
absl::Status CheckWorkerAddresses(const std::vector<std::string>& names,
                                  const std::vector<std::string>& addresses) {
  if (addresses.empty()) return absl::OkStatus();
  if (addresses.size() != names.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "StartLocalGroup: ", addresses.size(), " worker addresses (LocalGroupOptions::worker_addresses) for ",
        names.size(), " workers: give one HOST:PORT per worker, in the order of the names, or none"));
  }
  std::set<std::string> seen;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string what =
        absl::StrCat("the address of worker '", names[i], "' (LocalGroupOptions::worker_addresses[", i, "])");
    if (!seen.insert(addresses[i]).second && !absl::EndsWith(addresses[i], ":0")) {
      return absl::InvalidArgumentError(
          absl::StrCat("StartLocalGroup: ", what, ", ", addresses[i], ", is another worker's too: give each its own"));
    }
    if (absl::Status s = CheckCanListen(addresses[i], what); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("StartLocalGroup: ", s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LocalGroup> StartLocalGroup(const std::vector<std::string>& names, const rpc::Registry* registry,
                                           const std::vector<std::string>& extra_args, rpc::AgentOptions options,
                                           const WorkerProgram& program) {
  LocalGroupOptions o;
  o.worker_args = extra_args;
  o.master = std::move(options);
  o.program = program;
  return StartLocalGroup(names, registry, o);
}

absl::StatusOr<LocalGroup> StartLocalGroup(const std::vector<std::string>& names, const rpc::Registry* registry,
                                           const LocalGroupOptions& o) {
  if (registry == nullptr) {
    return absl::InvalidArgumentError(
        "StartLocalGroup: no registry for the master (give a Registry that outlives the group, filled first: "
        "train::RegisterWorkerFunctions(registry) for a training group's master)");
  }
  RETURN_IF_ERROR(CheckWorkerAddresses(names, o.worker_addresses));
  rpc::AgentOptions options = o.master;
  if (options.name.empty()) options.name = "master";
  options.is_master = true;
  options.workers = names;
  LocalGroup group;
  auto master = rpc::Agent::Start(options, registry);
  if (!master.ok()) return master.status();
  group.master = std::move(*master);
  autograd::Enable(*group.master);
  const WorkerProgram& program = o.program;
  const bool beside = !absl::StartsWith(program.name, "/");
  const std::string worker_bin = beside ? SiblingProgram(program.name) : program.name;
  // Before the group has formed, a failure stops what was started at once
  // (the workers killed, the master stopped): none of it is a group to end.
  auto fail = [&group](absl::Status status) {
    group.workers.clear();
    group.master.reset();
    return status;
  };
  if (access(worker_bin.c_str(), X_OK) != 0) {
    if (!beside) {
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "no worker program ", worker_bin, " to start (launch::WorkerProgram names it): give the path of an "
          "executable (remora's worker, or a program of yours that calls launch::WorkerMain)")));
    }
    return fail(absl::FailedPreconditionError(absl::StrCat(
        "no worker program ", worker_bin, " to start: a local group runs '", program.name,
        "' from the directory of this program; build it there (remora's worker, or a program of yours that "
        "calls launch::WorkerMain) or name another with launch::WorkerProgram")));
  }
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<std::string> argv = {worker_bin};
    argv.insert(argv.end(), program.leading_args.begin(), program.leading_args.end());
    argv.insert(argv.end(), {"--name", names[i], "--master", group.master->self().address});
    if (!o.worker_addresses.empty()) argv.insert(argv.end(), {"--listen", o.worker_addresses[i]});
    argv.insert(argv.end(), o.worker_args.begin(), o.worker_args.end());
    auto p = Subprocess::Spawn(argv, /*output=*/"", program.env);
    if (!p.ok()) return fail(p.status());
    group.workers.push_back(std::move(*p));
    group.names.push_back(names[i]);
  }
  // A worker that exits before the group forms (a crash, a bad flag among
  // the worker arguments) ends the wait at once, naming it.
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
  if (!joined_status.ok()) return fail(joined_status);
  return group;
}

LocalGroup& LocalGroup::operator=(LocalGroup&& other) {
  if (this != &other) {
    if (absl::Status s = Shutdown(); !s.ok()) std::cerr << "remora: ending a local group: " << s.message() << "\n";
    master = std::move(other.master);
    workers = std::move(other.workers);
    names = std::move(other.names);
    ended_ = other.ended_;
    other.master.reset();
    other.workers.clear();
    other.names.clear();
  }
  return *this;
}

LocalGroup::~LocalGroup() {
  if (ended_ || (master == nullptr && workers.empty())) return;
  if (absl::Status s = Shutdown(); !s.ok()) {
    std::cerr << "remora: ending the local group of '" << (master ? master->self().name : std::string("master"))
              << "': " << s.message() << "\n";
  }
}

absl::Status LocalGroup::Shutdown(absl::Duration timeout) {
  if (ended_) return absl::OkStatus();
  ended_ = true;
  absl::Status status = master ? master->Shutdown() : absl::OkStatus();
  for (size_t i = 0; i < workers.size(); ++i) {
    const std::string who =
        i < names.size() ? absl::StrCat("worker '", names[i], "'") : absl::StrCat("worker ", i + 1);
    auto code = workers[i]->Wait(timeout);
    if (!code.ok() || *code != 0) {
      if (code.ok()) {
        status.Update(absl::InternalError(absl::StrCat(who, " (pid ", workers[i]->pid(), ") exited with code ",
                                                       *code, ": its output above says why")));
      } else {
        workers[i]->Signal(SIGKILL);
        status.Update(absl::DeadlineExceededError(absl::StrCat(
            who, " (pid ", workers[i]->pid(), ") did not exit within ", absl::FormatDuration(timeout),
            " of the group's end; it was killed")));
      }
    }
  }
  return status;
}

}  // namespace remora::launch
