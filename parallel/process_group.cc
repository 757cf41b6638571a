#include "parallel/process_group.h"

#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <utility>
#include <vector>

#if REMORA_WITH_GLOO
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "parallel/rpc_store.h"
#include "rpc/agent.h"
#if REMORA_WITH_NCCL_GROUPS
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <fstream>
#include <set>
#include <unistd.h>
#endif
#endif

#include "absl/strings/str_cat.h"
#include "base/status_util.h"

namespace remora::parallel {

std::string HostOf(const std::string& address) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return host;
}

absl::Status Collective::Wait() {
  if (!wait_) return absl::FailedPreconditionError("waited for a collective that was not started");
  absl::Status s = wait_();
  wait_ = nullptr;
  return s;
}

std::string ProcessGroup::Describe() const {
  return absl::StrCat("group '", options_.name, "' (rank ", options_.rank, " of ", options_.size, ")");
}

#if REMORA_WITH_GLOO

namespace {

// See ProcessGroup::Join: a write to a dead peer is an error, not the end
// of the process. A handler the program installed is left as it is.
void IgnoreBrokenPipes() {
  struct sigaction now = {};
  if (sigaction(SIGPIPE, nullptr, &now) != 0 || now.sa_handler != SIG_DFL) return;
  signal(SIGPIPE, SIG_IGN);
}

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// LibTorch 2.4 and later default the store to libuv, which some builds
// (Debian's) lack: the classic backend is in all of them.
template <typename O>
auto ClassicStore(O& o, int) -> decltype(o.useLibUV = false, void()) {
  o.useLibUV = false;
}
template <typename O>
void ClassicStore(O&, long) {}

#if REMORA_WITH_NCCL_GROUPS
// This member's GPU as a number equal on members that use the same one:
// the machine's boot id (else its host name) and the device's PCI address.
int64_t GpuKey(int device) {
  std::string machine;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> machine;
  if (machine.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    machine = host;
  }
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(device);
  return static_cast<int64_t>(std::hash<std::string>()(
      absl::StrCat(machine, "/", p->pciDomainID, ":", p->pciBusID, ":", p->pciDeviceID)));
}

// Whether the members' GPUs are all different (one sum over `gloo`, which
// every member calls with its own key).
bool DistinctGpus(c10d::ProcessGroupGloo& gloo, const GroupOptions& g) {
  at::Tensor keys = at::zeros({g.size}, at::kLong);
  keys.data_ptr<int64_t>()[g.rank] = GpuKey(g.cuda_device);
  std::vector<at::Tensor> tensors = {keys};
  gloo.allreduce(tensors)->wait();
  const int64_t* k = keys.data_ptr<int64_t>();
  return std::set<int64_t>(k, k + g.size).size() == static_cast<size_t>(g.size);
}
#endif

}  // namespace

bool HaveGloo() { return true; }
#if REMORA_WITH_NCCL_GROUPS
bool HaveNcclGroups() { return true; }
#else
bool HaveNcclGroups() { return false; }
#endif

struct StoreServer::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

// One of the two backends; With(f) calls f on the one there is.
struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
#if REMORA_WITH_NCCL_GROUPS
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
#endif
  template <typename F>
  auto With(F&& f) {
#if REMORA_WITH_NCCL_GROUPS
    if (nccl) return f(*nccl);
#endif
    return f(*gloo);
  }
};

StoreServer::StoreServer(std::string host, int port, std::unique_ptr<Impl> impl)
    : host_(std::move(host)), port_(port), impl_(std::move(impl)) {}
StoreServer::~StoreServer() = default;

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(const std::string& host,
                                                                absl::Duration timeout) {
  auto impl = std::make_unique<Impl>();
  try {
    c10d::TCPStoreOptions o;
    o.port = 0;  // the system's choice (29500, c10d's default, is the master's own)
    ClassicStore(o, 0);
    o.isServer = true;
    o.waitWorkers = false;
    o.timeout = Millis(timeout);
    impl->store = c10::make_intrusive<c10d::TCPStore>(host, o);
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat("starting the collectives' TCPStore on ", host));
  }
  const int port = impl->store->getPort();
  return std::unique_ptr<StoreServer>(new StoreServer(host, port, std::move(impl)));
}

ProcessGroup::ProcessGroup(GroupOptions options, std::unique_ptr<Impl> impl)
    : options_(std::move(options)), impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Join(const GroupOptions& g) {
  if (g.size < 1 || g.rank < 0 || g.rank >= g.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("group '", g.name, "': rank ", g.rank, " of ", g.size, " is out of range"));
  }
  IgnoreBrokenPipes();
  auto impl = std::make_unique<Impl>();
  const std::string where =
      g.agent != nullptr ? absl::StrCat("'", g.agent->NameOf(0), "' over the agents")
                         : absl::StrCat("the store at ", g.store_host, ":", g.store_port);
  try {
    c10::intrusive_ptr<c10d::Store> store;
    std::string gloo_host = g.store_host;
    if (g.agent != nullptr) {
      store = c10::make_intrusive<RpcStore>(g.agent, "");
      store->setTimeout(Millis(g.timeout));
      gloo_host = HostOf(g.agent->self().address);
    } else {
      c10d::TCPStoreOptions o;
      o.port = static_cast<std::uint16_t>(g.store_port);
      ClassicStore(o, 0);
      o.isServer = false;
      o.waitWorkers = false;
      o.timeout = Millis(g.timeout);
      store = c10::make_intrusive<c10d::TCPStore>(g.store_host, o);
    }
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(absl::StrCat(g.name, "/"), store);
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->timeout = Millis(g.timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(gloo_host));
    impl->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, g.rank, g.size, options);
#if REMORA_WITH_NCCL_GROUPS
    if (g.cuda_device >= 0 && DistinctGpus(*impl->gloo, g)) {
      // wait() then blocks until the collective ends and throws when it
      // times out (LibTorch 2.x reads this when the group is made; before
      // 2.2 the name was NCCL_BLOCKING_WAIT). The environment may say 0.
      setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
      setenv("NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = Millis(g.timeout);
      impl->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("nccl/", prefixed), g.rank, g.size, nccl_options);
    }
#endif
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat(
        "joining group '", g.name, "' as rank ", g.rank, " of ", g.size, " through ", where,
        " (did every member start within ",
        absl::FormatDuration(g.timeout), "?)"));
  }
  return std::unique_ptr<ProcessGroup>(new ProcessGroup(g, std::move(impl)));
}

Collective ProcessGroup::AllReduceSum(at::Tensor tensor) {
  const std::string what = absl::StrCat("all-reduce of ", tensor.numel(), " values in ", Describe());
  try {
    std::vector<at::Tensor> tensors = {std::move(tensor)};
    auto work = impl_->With([&](auto& pg) { return pg.allreduce(tensors); });
    return Collective([work, what]() -> absl::Status {
      try {
        work->wait();
        return absl::OkStatus();
      } catch (...) {
        return base::StatusFromCurrentException(
            absl::StrCat(what, " (did a replica die, stall, or hold other shapes?)"));
      }
    });
  } catch (...) {
    absl::Status s = base::StatusFromCurrentException(what);
    return Collective([s] { return s; });
  }
}

absl::Status ProcessGroup::Broadcast(at::Tensor tensor, int root) {
  try {
    std::vector<at::Tensor> tensors = {std::move(tensor)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    impl_->With([&](auto& pg) { return pg.broadcast(tensors, o); })->wait();
    return absl::OkStatus();
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat("broadcast from rank ", root, " in ", Describe()));
  }
}

bool ProcessGroup::on_device() const {
#if REMORA_WITH_NCCL_GROUPS
  return impl_->nccl != nullptr;
#else
  return false;
#endif
}

#else  // !REMORA_WITH_GLOO

namespace {

absl::Status NoGloo() {
  return absl::UnimplementedError(
      "this build of remora has no Gloo (c10d's CPU collectives): install libgloo-dev, with a "
      "LibTorch that has torch/csrc/distributed/c10d/ProcessGroupGloo.hpp, and rebuild");
}

}  // namespace

bool HaveGloo() { return false; }
bool HaveNcclGroups() { return false; }

struct StoreServer::Impl {};
struct ProcessGroup::Impl {};

StoreServer::StoreServer(std::string host, int port, std::unique_ptr<Impl> impl)
    : host_(std::move(host)), port_(port), impl_(std::move(impl)) {}
StoreServer::~StoreServer() = default;
ProcessGroup::ProcessGroup(GroupOptions options, std::unique_ptr<Impl> impl)
    : options_(std::move(options)), impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

absl::StatusOr<std::unique_ptr<StoreServer>> StoreServer::Start(const std::string&, absl::Duration) {
  return NoGloo();
}
absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Join(const GroupOptions&) {
  return NoGloo();
}
Collective ProcessGroup::AllReduceSum(at::Tensor) {
  return Collective([] { return NoGloo(); });
}
absl::Status ProcessGroup::Broadcast(at::Tensor, int) { return NoGloo(); }
bool ProcessGroup::on_device() const { return false; }

#endif  // REMORA_WITH_GLOO

}  // namespace remora::parallel
