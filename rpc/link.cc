#include "rpc/link.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include <grpcpp/support/slice.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/mutex_lock.h"
#include "base/spin.h"
#include "rpc/auth.h"

namespace remora::rpc {
namespace {

// What each record on a link is; the high bytes tell a stray writer apart.
enum Kind : uint32_t {
  kHello = 0x524c4b01,    // client -> server, body: the token
  kHelloOk = 0x524c4b02,  // server -> client, empty
  kRequest = 0x524c4b03,  // body: a request frame
  kReply = 0x524c4b04,    // body: the reply frame of call `id`
  kPing = 0x524c4b05,     // client -> server, empty: the keepalive's
  kPong = 0x524c4b06,     // server -> client, empty: the answer to a ping
};

struct Record {
  uint32_t kind = 0;
  uint32_t reserved = 0;
  uint64_t length = 0;  // of the body that follows
  uint64_t id = 0;      // the call's, requests and replies
};
static_assert(sizeof(Record) == 24, "a record header is 24 bytes on both ends");

// Frames are at most what gRPC carries (AgentOptions::max_message_bytes),
// a hello's token far less.
constexpr uint64_t kMaxFrameBytes = 0x7fffffff;
constexpr uint64_t kMaxTokenBytes = 4096;

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// Writes the whole of `iov` (sendmsg: no SIGPIPE on a closed link),
// counting the bytes in `*sent` as they go when it is given.
bool SendAll(int fd, std::vector<iovec> iov, std::atomic<uint64_t>* sent) {
  size_t first = 0;
  while (first < iov.size()) {
    msghdr msg{};
    msg.msg_iov = iov.data() + first;
    msg.msg_iovlen = std::min<size_t>(iov.size() - first, 1024);
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    if (sent != nullptr) sent->fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    size_t left = static_cast<size_t>(n);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (left > 0) {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return true;
}

// Writes a record: its header and `frame` (or `body`).
bool WriteRecord(int fd, Kind kind, uint64_t id, const grpc::ByteBuffer* frame,
                 const std::string& body = {}, std::atomic<uint64_t>* sent = nullptr) {
  Record r;
  r.kind = kind;
  r.id = id;
  std::vector<grpc::Slice> slices;
  std::vector<iovec> iov(1);
  if (frame != nullptr && frame->Length() > 0) {
    if (!frame->Dump(&slices).ok()) return false;
    for (const auto& s : slices) {
      iov.push_back({const_cast<uint8_t*>(s.begin()), s.size()});
      r.length += s.size();
    }
  } else if (!body.empty()) {
    iov.push_back({const_cast<char*>(body.data()), body.size()});
    r.length = body.size();
  }
  iov[0] = {&r, sizeof(r)};
  return SendAll(fd, std::move(iov), sent);
}

// Reads exactly `n` bytes; false at the end of the stream or on an error.
bool ReadAll(int fd, void* out, size_t n) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t got = read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

// Reads a body of `length` bytes as a frame.
bool ReadFrame(int fd, uint64_t length, grpc::ByteBuffer* out) {
  // Read into the slice's own bytes: a short one holds them inline, so a
  // copy of its handle would not see them.
  grpc::Slice slice(static_cast<size_t>(length));
  if (!ReadAll(fd, const_cast<uint8_t*>(slice.begin()), length)) return false;
  *out = grpc::ByteBuffer(&slice, 1);
  return true;
}

// Looks for bytes on `fd` for up to `how_long`, yielding the core between
// looks, so that a record that comes meanwhile finds this thread awake
// (AgentOptions::busy_poll). Returns early on bytes, the end or an error,
// which the read that follows sees.
void PollBusily(int fd, absl::Duration how_long) {
  base::SpinUntil(how_long, [fd] {
    char byte;
    const ssize_t got = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    return got >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
  });
}

// `name` as an abstract socket address.
socklen_t Address(const std::string& name, sockaddr_un* addr) {
  *addr = {};
  addr->sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(addr->sun_path));
  std::memcpy(addr->sun_path, name.data(), n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + n);
}

}  // namespace

thread_local bool on_link_reader = false;

bool OnLinkReader() { return on_link_reader; }

std::string LinkName(const base::ShmEndpoint& e) {
  return absl::StrFormat("%cremora-link-%u-%016x", '\0', e.pid, e.incarnation);
}

// ---------------------------------------------------------------------------
// LinkClient.

absl::StatusOr<std::shared_ptr<LinkClient>> LinkClient::Connect(const std::string& name,
                                                                const std::string& token,
                                                                absl::Duration timeout,
                                                                absl::Duration busy_poll) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(Errno("socket"));
  sockaddr_un addr;
  const socklen_t len = Address(name, &addr);
  auto fail = [fd](std::string why) {
    close(fd);
    return absl::UnavailableError(std::move(why));
  };
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) return fail(Errno("connect"));
  if (!WriteRecord(fd, kHello, 0, nullptr, token)) return fail(Errno("hello"));
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout))) != 1) {
    close(fd);  // a process that is there but does not answer: stopped, or hung
    return absl::DeadlineExceededError(
        absl::StrCat("no answer to the hello within ", absl::FormatDuration(timeout)));
  }
  Record r;
  if (!ReadAll(fd, &r, sizeof(r)) || r.kind != kHelloOk || r.length != 0) {
    return fail("the hello was refused (a wrong token?)");
  }
  std::shared_ptr<LinkClient> link(new LinkClient(fd, busy_poll));
  link->reader_ = std::thread([l = link.get()] { l->ReadLoop(); });
  return link;
}

LinkClient::~LinkClient() {
  Close(absl::CancelledError("the local link was closed"));
  if (reader_.joinable()) reader_.join();
  close(fd_);
}

void LinkClient::Send(const grpc::ByteBuffer& frame, absl::Time deadline, Done done) {
  uint64_t id = 0;
  absl::Status closed;
  {
    base::MutexLock lock(mu_);
    if (closed_.load()) {
      closed = closed_why_;
    } else {
      id = next_id_++;
      pending_.emplace(id, Pending{deadline, std::move(done)});
    }
  }
  if (!closed.ok()) return done(closed);
  bool written;
  {
    base::MutexLock lock(write_mu_);
    written = WriteRecord(fd_, kRequest, id, &frame, {}, &sent_bytes_);
  }
  // Fails this call too, unless the reader already did.
  if (!written) Close(absl::UnavailableError(Errno("the local link broke while sending")));
}

void LinkClient::Close(const absl::Status& why) {
  std::vector<Done> failed;
  {
    base::MutexLock lock(mu_);
    if (!closed_.exchange(true)) closed_why_ = why;
    for (auto& [id, p] : pending_) failed.push_back(std::move(p.done));
    pending_.clear();
  }
  shutdown(fd_, SHUT_RDWR);  // wakes the reader; the fd stays ours until destruction
  for (auto& d : failed) d(why);
}

void LinkClient::Expire(absl::Time now) {
  std::vector<Done> expired;
  {
    base::MutexLock lock(mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.deadline <= now) {
        expired.push_back(std::move(it->second.done));
        pending_.erase(it++);
      } else {
        ++it;
      }
    }
  }
  for (auto& d : expired) d(absl::DeadlineExceededError("deadline exceeded on the local link"));
}

void LinkClient::WatchPeer(absl::Time now) {
  bool owed;
  {
    base::MutexLock lock(mu_);
    owed = !pending_.empty();
  }
  if (heard_ || !owed) {  // bytes came since the last look; or nothing is owed,
    heard_ = false;         // and a peer may then sleep as long as it likes
    quiet_since_ = now;
    ping_sent_ = absl::InfiniteFuture();
    return;
  }
  if (ping_sent_ != absl::InfiniteFuture()) {
    if (now - ping_sent_ < kKeepaliveTimeout) return;
    return Close(absl::UnavailableError(absl::StrCat(
        "the peer at the other end of the local link answered no keepalive ping within ",
        absl::FormatDuration(kKeepaliveTimeout), " (is its process stopped or hung?)")));
  }
  if (now - quiet_since_ < kKeepaliveTime) return;
  // A request being written holds the socket, and a full socket takes no
  // ping: ping once there is room. A write that takes bytes is a peer that
  // reads; none taken for as long as a ping may go unanswered is a peer
  // that does not.
  ssize_t sent = -1;
  if (write_mu_.TryLock()) {
    Record ping;
    ping.kind = kPing;
    sent = send(fd_, &ping, sizeof(ping), MSG_NOSIGNAL | MSG_DONTWAIT);  // (a record this small goes whole)
    const int send_errno = errno;  // (before the unlock, which may make a call of its own)
    write_mu_.Unlock();
    if (sent == static_cast<ssize_t>(sizeof(ping))) {
      ping_sent_ = now;
      return;
    }
    if (sent >= 0 || (send_errno != EAGAIN && send_errno != EWOULDBLOCK && send_errno != EINTR)) {
      return Close(absl::UnavailableError(absl::StrCat("the local link broke while sending a keepalive ping: ",
                                                       sent >= 0 ? "a part of it went" : std::strerror(send_errno))));
    }
  }
  if (const uint64_t taken = sent_bytes_.load(std::memory_order_relaxed); taken != sent_seen_) {
    sent_seen_ = taken;
    quiet_since_ = now;
  } else if (now - quiet_since_ >= kKeepaliveTime + kKeepaliveTimeout) {
    Close(absl::UnavailableError(absl::StrCat(
        "the peer at the other end of the local link took no byte of a request for ",
        absl::FormatDuration(now - quiet_since_), " (is its process stopped or hung?)")));
  }
}

bool LinkClient::Receive(void* out, size_t n, absl::Time* next_expiry) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    // Read what is there; wait (checking deadlines every 100 ms) only when
    // nothing is, so that a peer that stops mid-record holds up no deadline.
    const ssize_t got = recv(fd_, p, n, MSG_DONTWAIT);
    if (got > 0) {
      heard_ = true;  // the peer is alive (WatchPeer takes note)
      p += got;
      n -= static_cast<size_t>(got);
      continue;
    }
    if (got == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return false;
    if (const absl::Time now = absl::Now(); now >= *next_expiry) {
      Expire(now);
      WatchPeer(now);
      *next_expiry = now + absl::Milliseconds(100);
    }
    pollfd wait{fd_, POLLIN, 0};
    if (poll(&wait, 1, 100) < 0 && errno != EINTR) return false;
  }
  return true;
}

void LinkClient::ReadLoop() {
  absl::Time next_expiry = absl::Now() + absl::Milliseconds(100);
  while (true) {
    Record r;
    PollBusily(fd_, busy_poll_);
    if (!Receive(&r, sizeof(r), &next_expiry)) {
      Close(absl::UnavailableError("the local link closed (did the process end?)"));
      return;
    }
    if (r.kind == kPong && r.length == 0) continue;  // (Receive took note)
    grpc::ByteBuffer reply;
    bool read = r.kind == kReply && r.length <= kMaxFrameBytes;
    if (read) {
      // Into the slice's own bytes (see ReadFrame).
      grpc::Slice slice(static_cast<size_t>(r.length));
      read = Receive(const_cast<uint8_t*>(slice.begin()), r.length, &next_expiry);
      reply = grpc::ByteBuffer(&slice, 1);
    }
    if (!read) {
      Close(absl::UnavailableError("the local link broke (a bad record, or it closed mid-reply)"));
      return;
    }
    Done done;
    {
      base::MutexLock lock(mu_);
      auto it = pending_.find(r.id);
      if (it != pending_.end()) {
        done = std::move(it->second.done);
        pending_.erase(it);
      }
    }
    if (done) done(std::move(reply));  // (none: its deadline passed, the reply is dropped)
    if (const absl::Time now = absl::Now(); now >= next_expiry) {  // a link never idle
      Expire(now);
      next_expiry = now + absl::Milliseconds(100);
    }
  }
}

// ---------------------------------------------------------------------------
// LinkServer.

// One caller's link: its socket, and the requests read from it whose
// replies are not written yet.
struct LinkServer::Conn {
  explicit Conn(int fd) : fd(fd) {}
  ~Conn() { close(fd); }

  bool Write(Kind kind, uint64_t id, const grpc::ByteBuffer* frame) {
    base::MutexLock lock(write_mu);
    return !closed && WriteRecord(fd, kind, id, frame);
  }
  void Close() {
    base::MutexLock lock(write_mu);
    closed = true;
    shutdown(fd, SHUT_RDWR);
  }
  void Started() {
    base::MutexLock lock(mu);
    ++outstanding;
  }
  void Answered() {
    base::MutexLock lock(mu);
    --outstanding;
  }
  // Waits until every request read has been answered, or `deadline`.
  void AwaitAnswered(absl::Time deadline) {
    base::MutexLock lock(mu);
    auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return outstanding == 0; };
    mu.AwaitWithDeadline(absl::Condition(&none), deadline);
  }

  const int fd;
  absl::Mutex write_mu;
  bool closed ABSL_GUARDED_BY(write_mu) = false;
  absl::Mutex mu;
  int64_t outstanding ABSL_GUARDED_BY(mu) = 0;
};

// Where the reply to request `id` goes: back on its link, once.
class LinkServer::Slot final : public ReplySlot {
 public:
  Slot(std::shared_ptr<Conn> conn, uint64_t id) : conn_(std::move(conn)), id_(id) {
    conn_->Started();
  }
  ~Slot() override {
    if (!replied_.exchange(true)) conn_->Answered();
  }
  bool Reply(grpc::ByteBuffer frame) override {
    if (replied_.exchange(true)) return false;
    const bool written = conn_->Write(kReply, id_, &frame);
    conn_->Answered();
    return written;
  }

 private:
  const std::shared_ptr<Conn> conn_;
  const uint64_t id_;
  std::atomic<bool> replied_{false};
};

absl::StatusOr<std::unique_ptr<LinkServer>> LinkServer::Listen(const std::string& name,
                                                               std::string token,
                                                               Dispatch dispatch,
                                                               absl::Duration busy_poll) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(Errno("socket"));
  sockaddr_un addr;
  const socklen_t len = Address(name, &addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 64) != 0) {
    absl::Status s = absl::UnavailableError(Errno("listening for local links"));
    close(fd);
    return s;
  }
  std::unique_ptr<LinkServer> server(new LinkServer(fd, std::move(token), std::move(dispatch), busy_poll));
  server->acceptor_ = std::thread([s = server.get()] { s->AcceptLoop(); });
  return server;
}

LinkServer::~LinkServer() {
  Stop(absl::ZeroDuration());
  close(fd_);
}

void LinkServer::AcceptLoop() {
  while (!stopping_.load()) {
    const int fd = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        absl::SleepFor(absl::Milliseconds(50));  // callers fall back on gRPC meanwhile
        continue;
      }
      return;  // the listener was shut down (Stop)
    }
    auto conn = std::make_shared<Conn>(fd);
    base::MutexLock lock(mu_);
    if (stopped_) return;  // `conn` closes its socket
    conns_.push_back(conn);
    threads_.emplace_back([this, conn] { Serve(conn); });
  }
}

void LinkServer::Serve(std::shared_ptr<Conn> conn) {
  on_link_reader = true;
  // The hello: the caller's token, within a second of connecting.
  Record r;
  std::string token;
  timeval hello_wait{1, 0};
  setsockopt(conn->fd, SOL_SOCKET, SO_RCVTIMEO, &hello_wait, sizeof(hello_wait));
  if (!ReadAll(conn->fd, &r, sizeof(r)) || r.kind != kHello || r.length > kMaxTokenBytes) {
    return conn->Close();
  }
  token.resize(r.length);
  if (!ReadAll(conn->fd, token.data(), token.size()) || !TokenEquals(token, token_)) {
    return conn->Close();  // the caller goes over gRPC, which says why
  }
  timeval no_wait{0, 0};
  setsockopt(conn->fd, SOL_SOCKET, SO_RCVTIMEO, &no_wait, sizeof(no_wait));
  {
    base::MutexLock lock(conn->write_mu);
    if (conn->closed || !WriteRecord(conn->fd, kHelloOk, 0, nullptr)) return;
  }
  while (true) {
    grpc::ByteBuffer frame;
    PollBusily(conn->fd, busy_poll_);
    if (!ReadAll(conn->fd, &r, sizeof(r))) return conn->Close();
    if (r.kind == kPing && r.length == 0) {  // the caller's keepalive: answered here, at once
      if (!conn->Write(kPong, 0, nullptr)) return conn->Close();
      continue;
    }
    if (r.kind != kRequest || r.length > kMaxFrameBytes || !ReadFrame(conn->fd, r.length, &frame) ||
        stopping_.load()) {
      return conn->Close();
    }
    dispatch_(std::move(frame), std::make_shared<Slot>(conn, r.id));
  }
}

void LinkServer::Stop(absl::Duration grace) {
  if (stopping_.exchange(true)) return;
  shutdown(fd_, SHUT_RDWR);  // accept() returns
  if (acceptor_.joinable()) acceptor_.join();
  std::vector<std::shared_ptr<Conn>> conns;
  std::vector<std::thread> threads;
  {
    base::MutexLock lock(mu_);
    stopped_ = true;
    conns.swap(conns_);
    threads.swap(threads_);
  }
  const absl::Time deadline = absl::Now() + grace;
  for (const auto& c : conns) c->AwaitAnswered(deadline);
  for (const auto& c : conns) c->Close();
  for (auto& t : threads) t.join();
}

}  // namespace remora::rpc
