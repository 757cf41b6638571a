#include "channel/shm/shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

#include <ATen/Parallel.h>

#include "absl/strings/str_cat.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "runtime/buffer_cache.h"

namespace remora::channel {
namespace {

constexpr uint64_t kMagic = 0x52454d4f52415348ULL;  // "REMORASH": a remora segment
constexpr size_t kHeaderBytes = 4096;              // data starts page-aligned
constexpr size_t kMinCapacity = size_t{1} << 20;
constexpr uint64_t kFree = 0, kBusy = 1, kReady = 2;
constexpr unsigned kRequiredSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

// The start of every segment. Written once by its creator, except `word`.
struct SegmentHeader {
  uint64_t magic;
  uint64_t incarnation;
  uint64_t id;
  uint64_t capacity;
  std::atomic<uint64_t> word;     // sequence << 2 | state
  std::atomic<uint64_t> written;  // bytes filled in so far (while BUSY)
};
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "segment state words are shared between processes");

uint64_t Word(uint64_t seq, uint64_t state) { return seq << 2 | state; }

std::string ErrnoText() { return std::strerror(errno); }

// Whether process `pid` has ended (gone, or a zombie its parent has not
// reaped yet): a sender that died mid-payload never fills the rest.
bool Ended(int64_t pid) {
  if (pid <= 0) return false;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');  // (the name may hold spaces and parentheses)
  return paren != std::string::npos && paren + 2 < line.size() &&
         (line[paren + 2] == 'Z' || line[paren + 2] == 'X');
}

size_t RoundUpPow2(size_t n) {
  size_t c = kMinCapacity;
  while (c < n) c <<= 1;
  return c;
}

}  // namespace

void ParallelMemcpy(void* dst, const void* src, size_t n) {
  constexpr size_t kChunk = size_t{2} << 20;
  if (n < 4 * kChunk) {
    std::memcpy(dst, src, n);
    return;
  }
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  const int64_t chunks = static_cast<int64_t>((n + kChunk - 1) / kChunk);
  at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const size_t off = static_cast<size_t>(i) * kChunk;
      std::memcpy(d + off, s + off, std::min(kChunk, n - off));
    }
  });
}

std::string BootId() {
  std::string boot_id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot_id);
  return boot_id;
}

std::string ShmDomain() {
  const std::string boot_id = BootId();
  char ns[128] = {0};
  const ssize_t len = readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  if (boot_id.empty() || len <= 0) return "";
  return absl::StrCat(boot_id, "/", std::string(ns, len), "/uid", getuid());
}

// One of this process's segments.
struct ShmChannel::Segment {
  int fd = -1;
  void* base = nullptr;
  size_t capacity = 0;
  SegmentHeader* header = nullptr;
  uint8_t* data = nullptr;
  absl::Time ready_since;  // when it was last published (guarded by mu_)
  bool reclaim_when_filled = false;  // guarded by mu_

  ~Segment() {
    if (base != nullptr) munmap(base, kHeaderBytes + capacity);
    if (fd >= 0) close(fd);
  }
};

// A peer's segment mapped into this process.
struct ShmChannel::Mapping {
  void* base = nullptr;
  size_t capacity = 0;
  SegmentHeader* header = nullptr;
  const uint8_t* data = nullptr;

  ~Mapping() {
    if (base != nullptr) munmap(base, kHeaderBytes + capacity);
  }
};

ShmChannel::ShmChannel(Options options) : options_(options) {
  self_.pid = static_cast<uint32_t>(getpid());
  self_.incarnation = base::RandomIncarnation();
  // Offer shared memory only where memfd segments can be made and sealed.
  if (!options_.enabled) return;
  const int probe = memfd_create("remora-probe", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (probe >= 0) {
    if (fcntl(probe, F_ADD_SEALS, kRequiredSeals) == 0) self_.domain = ShmDomain();
    close(probe);
  }
}

ShmChannel::~ShmChannel() = default;

std::optional<wire::ShmPayload> ShmChannel::Reserve(size_t n) {
  if (self_.domain.empty() || stopped_.load()) return std::nullopt;
  Segment* seg = nullptr;
  uint64_t id = 0, seq = 0;
  {
    base::MutexLock lock(mu_);
    const absl::Time now = absl::Now();
    size_t best_capacity = 0;
    for (size_t i = 0; i < segments_.size(); ++i) {
      Segment* s = segments_[i].get();
      if (s->capacity < n || s->capacity > std::max(4 * n, kMinCapacity)) continue;
      uint64_t w = s->header->word.load(std::memory_order_acquire);
      if ((w & 3) == kReady && now - s->ready_since > options_.reclaim_after) {
        // Nobody read it in time: its message died with a call or a peer.
        if (s->header->word.compare_exchange_strong(w, Word(w >> 2, kFree))) w = Word(w >> 2, kFree);
      }
      if ((w & 3) != kFree) continue;
      if (seg == nullptr || s->capacity < best_capacity) {
        seg = s;
        id = i;
        best_capacity = s->capacity;
      }
    }
    if (seg == nullptr) {
      const size_t capacity = RoundUpPow2(n);
      if (total_bytes_ + capacity > options_.max_bytes) return std::nullopt;
      auto s = std::make_unique<Segment>();
      s->fd = memfd_create("remora-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING);
      if (s->fd < 0 || ftruncate(s->fd, kHeaderBytes + capacity) != 0 ||
          fcntl(s->fd, F_ADD_SEALS, kRequiredSeals) != 0) {
        return std::nullopt;
      }
      s->base = mmap(nullptr, kHeaderBytes + capacity, PROT_READ | PROT_WRITE, MAP_SHARED,
                     s->fd, 0);
      if (s->base == MAP_FAILED) {
        s->base = nullptr;
        return std::nullopt;
      }
      s->capacity = capacity;
      s->header = new (s->base) SegmentHeader{kMagic, self_.incarnation, segments_.size(),
                                              capacity, {Word(0, kFree)}, {0}};
      s->data = static_cast<uint8_t*>(s->base) + kHeaderBytes;
      seg = s.get();
      id = segments_.size();
      total_bytes_ += capacity;
      segments_.push_back(std::move(s));
    }
    seq = (seg->header->word.load(std::memory_order_relaxed) >> 2) + 1;
    seg->header->written.store(0, std::memory_order_relaxed);
    seg->header->word.store(Word(seq, kBusy), std::memory_order_release);
    seg->reclaim_when_filled = false;
    ++writes_;
  }

  wire::ShmPayload d;
  d.set_pid(self_.pid);
  d.set_incarnation(self_.incarnation);
  d.set_fd(seg->fd);
  d.set_segment(id);
  d.set_capacity(seg->capacity);
  d.set_seq(seq);
  return d;
}

void ShmChannel::Fill(const wire::ShmPayload& d, const at::Tensor& payload) {
  Segment* seg;
  {
    base::MutexLock lock(mu_);
    if (d.incarnation() != self_.incarnation || d.segment() >= segments_.size()) return;
    seg = segments_[d.segment()].get();
  }
  const size_t n = std::min<size_t>(payload.nbytes(), seg->capacity);
  const auto* src = static_cast<const uint8_t*>(payload.data_ptr());
  // Chunks small enough that the reader starts early, large enough that
  // publishing costs nothing.
  constexpr size_t kChunk = size_t{1} << 20;
  for (size_t off = 0; off < n; off += kChunk) {
    const size_t len = std::min(kChunk, n - off);
    std::memcpy(seg->data + off, src + off, len);
    seg->header->written.store(off + len, std::memory_order_release);
  }
  base::MutexLock lock(mu_);
  seg->ready_since = absl::Now();
  seg->header->word.store(Word(d.seq(), kReady), std::memory_order_release);
  if (seg->reclaim_when_filled) {
    uint64_t expect = Word(d.seq(), kReady);
    seg->header->word.compare_exchange_strong(expect, Word(d.seq(), kFree));
  }
}

std::optional<wire::ShmPayload> ShmChannel::Write(const at::Tensor& payload) {
  auto d = Reserve(payload.nbytes());
  if (d) Fill(*d, payload);
  return d;
}

std::optional<wire::ShmPayload> ShmChannel::Send(base::WorkerId peer, const at::Tensor& payload,
                                                  int dst_device) {
  return Write(payload);
}

absl::StatusOr<at::Tensor> ShmChannel::Receive(base::WorkerId peer, const wire::ShmPayload& d,
                                               uint64_t length) {
  return Read(d, length, [](size_t n) { return runtime::AllocateReceiveBuffer(n); });
}

void ShmChannel::Reclaim(const wire::ShmPayload& d) {
  base::MutexLock lock(mu_);
  if (d.incarnation() != self_.incarnation || d.segment() >= segments_.size()) return;
  Segment* seg = segments_[d.segment()].get();
  uint64_t expect = Word(d.seq(), kReady);
  if (seg->header->word.compare_exchange_strong(expect, Word(d.seq(), kFree))) return;
  if (expect == Word(d.seq(), kBusy)) seg->reclaim_when_filled = true;
}

absl::StatusOr<std::shared_ptr<ShmChannel::Mapping>> ShmChannel::Map(
    const wire::ShmPayload& d) {
  const auto key = std::make_pair(d.incarnation(), d.segment());
  {
    base::MutexLock lock(mu_);
    // A request sent right after rendezvous may come before this process
    // has the group's membership: wait for it rather than refuse a member.
    if (!members_known_) {
      mu_.AwaitWithTimeout(absl::Condition(&members_known_), absl::Seconds(10));
    }
    auto allowed = allowed_.find(d.incarnation());
    if (allowed == allowed_.end() || allowed->second != d.pid()) {
      return absl::PermissionDeniedError(absl::StrCat(
          "shared-memory payload from process ", d.pid(),
          ", which is not a group member on this host"));
    }
    auto it = mappings_.find(key);
    if (it != mappings_.end()) return it->second;
  }
  const std::string path = absl::StrCat("/proc/", d.pid(), "/fd/", d.fd());
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot open the sender's shared-memory segment ", path, ": ", ErrnoText(),
        "; processes must run as the same user in one PID namespace (or set "
        "REMORA_SHM=0 on every process to send everything through gRPC)"));
  }
  // The sender sealed the size: it cannot shrink the file under our mapping
  // (a SIGBUS here) after we checked it.
  struct stat st;
  const int seals = fcntl(fd, F_GET_SEALS);
  const bool sealed = seals >= 0 && (static_cast<unsigned>(seals) & kRequiredSeals) == kRequiredSeals;
  if (!sealed || fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kHeaderBytes) ||
      static_cast<uint64_t>(st.st_size) - kHeaderBytes != d.capacity()) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory segment ", d.segment(), " of process ", d.pid(),
        " is not a sealed remora segment of ", d.capacity(), " bytes"));
  }
  void* base = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot map shared-memory segment ", path, ": ", ErrnoText()));
  }
  auto m = std::make_shared<Mapping>();
  m->base = base;
  m->capacity = d.capacity();
  m->header = static_cast<SegmentHeader*>(base);
  m->data = static_cast<const uint8_t*>(base) + kHeaderBytes;
  if (m->header->magic != kMagic || m->header->incarnation != d.incarnation() ||
      m->header->id != d.segment() || m->header->capacity != d.capacity()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory segment ", path, " does not match its descriptor"));
  }
  base::MutexLock lock(mu_);
  if (!allowed_.contains(d.incarnation())) {
    return absl::UnavailableError("the sender left the group while its payload was read");
  }
  return mappings_.emplace(key, std::move(m)).first->second;
}

absl::StatusOr<at::Tensor> ShmChannel::Read(const wire::ShmPayload& d, uint64_t length,
                                            const std::function<absl::StatusOr<at::Tensor>(size_t)>& allocate) {
  auto m = Map(d);
  if (!m.ok()) return m.status();
  Mapping& seg = **m;
  if (length > seg.capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory payload of ", length, " bytes exceeds its segment of ", seg.capacity));
  }
  const uint64_t busy = Word(d.seq(), kBusy), ready = Word(d.seq(), kReady);
  const uint64_t first = seg.header->word.load(std::memory_order_acquire);
  if (first != busy && first != ready) {
    return absl::DataLossError(absl::StrCat(
        "shared-memory payload (segment ", d.segment(), ", sequence ", d.seq(),
        ") is no longer there: the sender took it back after the call failed"));
  }
  ASSIGN_OR_RETURN(at::Tensor out, allocate(length));
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  // Copy what the sender has published so far, until all of it is in and
  // the segment is READY.
  uint64_t done = 0;
  absl::Time last_progress = absl::Now();
  for (int spins = 0;; ++spins) {
    const uint64_t written = seg.header->written.load(std::memory_order_acquire);
    const uint64_t word = seg.header->word.load(std::memory_order_acquire);
    if (word != busy && word != ready) {
      return absl::DataLossError(absl::StrCat(
          "shared-memory payload (segment ", d.segment(),
          ") was taken back by the sender while it was read"));
    }
    const uint64_t avail = word == ready ? length : std::min(written, length);
    if (avail > done) {
      ParallelMemcpy(dst + done, seg.data + done, avail - done);
      done = avail;
      last_progress = absl::Now();
      spins = 0;
    }
    if (done == length && word == ready) break;
    if (spins < 64) continue;
    std::this_thread::yield();
    if (spins % 1024 != 0) continue;
    // (every few milliseconds while the sender makes no progress)
    auto payload = [&d] {
      return absl::StrCat("shared-memory payload (segment ", d.segment(), " of process ", d.pid(), ")");
    };
    if (stopped_.load()) return absl::CancelledError(absl::StrCat(payload(), ": this process is stopping"));
    if (Ended(d.pid())) {
      return absl::UnavailableError(absl::StrCat(payload(), ": the sender ended before it had written it all"));
    }
    if (absl::Now() - last_progress > options_.stall_timeout) {
      return absl::DeadlineExceededError(absl::StrCat(payload(), ": the sender made no progress for ",
                                                      absl::FormatDuration(options_.stall_timeout), " (did it die?)"));
    }
  }
  uint64_t expect = ready;
  if (!seg.header->word.compare_exchange_strong(expect, Word(d.seq(), kFree),
                                                std::memory_order_acq_rel)) {
    return absl::DataLossError(absl::StrCat(
        "shared-memory payload (segment ", d.segment(),
        ") was taken back by the sender while it was read"));
  }
  reads_.fetch_add(1, std::memory_order_relaxed);
  return out;
}

void ShmChannel::Allow(const std::vector<base::ShmEndpoint>& peers) {
  base::MutexLock lock(mu_);
  members_known_ = true;
  allowed_.clear();
  for (const auto& p : peers) {
    if (!p.domain.empty() && p.domain == self_.domain) allowed_[p.incarnation] = p.pid;
  }
  for (auto it = mappings_.begin(); it != mappings_.end();) {
    it = allowed_.contains(it->first.first) ? std::next(it) : mappings_.erase(it);
  }
}

ShmChannel::Stats ShmChannel::stats() const {
  base::MutexLock lock(mu_);
  Stats s;
  s.segments = static_cast<int64_t>(segments_.size());
  s.segment_bytes = static_cast<int64_t>(total_bytes_);
  for (const auto& seg : segments_) {
    s.busy += (seg->header->word.load(std::memory_order_acquire) & 3) != kFree;
  }
  s.mapped_peers = static_cast<int64_t>(mappings_.size());
  s.writes = writes_;
  s.reads = reads_.load();
  return s;
}

}  // namespace remora::channel
