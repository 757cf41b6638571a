#include "parallel/process_group.h"

#include <chrono>
#include <utility>
#include <vector>

#if REMORA_WITH_GLOO
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif

#include "absl/strings/str_cat.h"
#include "base/status_util.h"

namespace remora::parallel {

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

}  // namespace

bool HaveGloo() { return true; }

struct StoreServer::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
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
    return StatusFromCurrentException(absl::StrCat("starting the collectives' TCPStore on ", host));
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
  auto impl = std::make_unique<Impl>();
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<std::uint16_t>(g.store_port);
    ClassicStore(o, 0);
    o.isServer = false;
    o.waitWorkers = false;
    o.timeout = Millis(g.timeout);
    auto store = c10::make_intrusive<c10d::TCPStore>(g.store_host, o);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(absl::StrCat(g.name, "/"), store);
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->timeout = Millis(g.timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(g.store_host));
    impl->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, g.rank, g.size, options);
  } catch (...) {
    return StatusFromCurrentException(absl::StrCat(
        "joining group '", g.name, "' as rank ", g.rank, " of ", g.size, " through the store at ",
        g.store_host, ":", g.store_port, " (did every member start within ",
        absl::FormatDuration(g.timeout), "?)"));
  }
  return std::unique_ptr<ProcessGroup>(new ProcessGroup(g, std::move(impl)));
}

Collective ProcessGroup::AllReduceSum(at::Tensor tensor) {
  const std::string what = absl::StrCat("all-reduce of ", tensor.numel(), " values in ", Describe());
  try {
    std::vector<at::Tensor> tensors = {std::move(tensor)};
    auto work = impl_->pg->allreduce(tensors);
    return Collective([work, what]() -> absl::Status {
      try {
        work->wait();
        return absl::OkStatus();
      } catch (...) {
        return StatusFromCurrentException(
            absl::StrCat(what, " (did a replica die, stall, or hold other shapes?)"));
      }
    });
  } catch (...) {
    absl::Status s = StatusFromCurrentException(what);
    return Collective([s] { return s; });
  }
}

absl::Status ProcessGroup::Broadcast(at::Tensor tensor, int root) {
  try {
    std::vector<at::Tensor> tensors = {std::move(tensor)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    impl_->pg->broadcast(tensors, o)->wait();
    return absl::OkStatus();
  } catch (...) {
    return StatusFromCurrentException(absl::StrCat("broadcast from rank ", root, " in ", Describe()));
  }
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

#endif  // REMORA_WITH_GLOO

}  // namespace remora::parallel
