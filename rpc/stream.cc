#include "rpc/stream.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rpc/auth.h"
#include "rpc/message.h"
#include "base/mutex_lock.h"

namespace remora::rpc {
namespace {

// The ops of a SyncStream, as completion-queue tags (one bit each).
constexpr uintptr_t kStart = 1, kWrite = 2, kRead = 4, kFinish = 8;

void* Tag(uintptr_t op) { return reinterpret_cast<void*>(op); }

}  // namespace

grpc::CompletionQueue::NextStatus NextPolling(grpc::CompletionQueue* cq, absl::Duration spin,
                                              absl::Time deadline, void** tag, bool* ok) {
  for (const absl::Time until = std::min(absl::Now() + spin, deadline); absl::Now() < until;) {
    auto status = cq->AsyncNext(tag, ok, gpr_time_0(GPR_CLOCK_MONOTONIC));
    if (status != grpc::CompletionQueue::TIMEOUT) return status;
  }
  if (deadline == absl::InfiniteFuture()) {
    return cq->Next(tag, ok) ? grpc::CompletionQueue::GOT_EVENT
                             : grpc::CompletionQueue::SHUTDOWN;
  }
  // gRPC rounds a deadline up to its timer's millisecond: one that has
  // passed must be a zero timeout, or the poll sleeps that millisecond.
  if (deadline <= absl::Now()) return cq->AsyncNext(tag, ok, gpr_time_0(GPR_CLOCK_MONOTONIC));
  return cq->AsyncNext(tag, ok, absl::ToChronoTime(deadline));
}

// ---------------------------------------------------------------------------
// SyncStream

std::unique_ptr<SyncStream> SyncStream::Open(grpc::GenericStub* stub, const std::string& token) {
  std::unique_ptr<SyncStream> stream(new SyncStream);
  AttachToken(&stream->context_, token);
  stream->call_ = stub->PrepareCall(&stream->context_, kStreamMethod, &stream->cq_);
  stream->call_->StartCall(Tag(kStart));
  // The read for the first reply is in flight from the start, as the read
  // for the next one is between calls: a callee that ends the stream while
  // it sits idle fails that read, and usable() sees it.
  stream->call_->Read(&stream->in_, Tag(kRead));
  stream->pending_ = kStart | kRead;
  return stream;
}

SyncStream::~SyncStream() {
  End(/*cancel=*/true).IgnoreError();
  cq_.Shutdown();
  void* tag;
  bool ok;
  while (cq_.Next(&tag, &ok)) {
  }
}

grpc::CompletionQueue::NextStatus SyncStream::Step(absl::Duration spin, absl::Time deadline) {
  void* tag = nullptr;
  bool ok = false;
  auto status = NextPolling(&cq_, spin, deadline, &tag, &ok);
  if (status != grpc::CompletionQueue::GOT_EVENT) return status;
  pending_ &= ~reinterpret_cast<uintptr_t>(tag);
  if (!ok) broken_ = true;
  return status;
}

bool SyncStream::Await(unsigned ops, absl::Duration spin, absl::Time deadline,
                       bool* timed_out) {
  while (!broken_ && pending_ & ops) {
    auto status = Step(spin, deadline);
    if (status == grpc::CompletionQueue::TIMEOUT) *timed_out = true;
    if (status != grpc::CompletionQueue::GOT_EVENT) return false;
  }
  return !broken_;
}

bool SyncStream::usable() {
  // Between calls only the start and the read are in flight; an event for
  // the read means the callee ended the stream (or broke its protocol).
  while (!broken_ && Step(absl::ZeroDuration(), absl::Now()) == grpc::CompletionQueue::GOT_EVENT) {
  }
  if (!(pending_ & kRead)) broken_ = true;
  return !broken_;
}

absl::StatusOr<grpc::ByteBuffer> SyncStream::Call(const grpc::ByteBuffer& frame,
                                                  const std::function<void()>& sent,
                                                  absl::Time deadline, absl::Duration spin) {
  if (broken_ || !(pending_ & kRead)) {
    broken_ = true;
    return absl::FailedPreconditionError("the stream is broken");
  }
  // The start and the writes share gRPC's op set: the first write waits
  // until the start is done.
  bool timed_out = false;
  const bool started = Await(kStart, spin, deadline, &timed_out);
  const uint64_t id = next_id_++;
  if (started) {
    out_ = TagFrame(id, frame);
    call_->Write(out_, Tag(kWrite));
    pending_ |= kWrite;
  }
  if (sent) sent();
  if (started) Await(kWrite | kRead, spin, deadline, &timed_out);
  // The request's slices may hold its tensors: an idle stream keeps none.
  if (!(pending_ & kWrite)) out_.Clear();
  if (timed_out) {
    broken_ = true;
    End(/*cancel=*/true).IgnoreError();
    return absl::DeadlineExceededError("deadline exceeded");
  }
  if (broken_) {
    // An op failed: the call is over, and its status says why.
    absl::Status why = End(/*cancel=*/false);
    if (why.ok()) why = absl::UnavailableError("the peer ended the stream");
    return why;
  }
  grpc::ByteBuffer reply = std::move(in_);
  in_ = grpc::ByteBuffer();
  absl::StatusOr<uint64_t> got = UntagFrame(&reply);
  if (!got.ok() || *got != id) {
    broken_ = true;
    End(/*cancel=*/true).IgnoreError();
    return absl::InternalError(absl::StrCat(
        "stream: a reply for call ", got.ok() ? absl::StrCat(*got) : "?",
        " came where call ", id, "'s was due"));
  }
  call_->Read(&in_, Tag(kRead));
  pending_ |= kRead;
  return reply;
}

absl::Status SyncStream::End(bool cancel) {
  if (!ended_) {
    ended_ = true;
    if (cancel) context_.TryCancel();
    call_->Finish(&final_status_, Tag(kFinish));
    pending_ |= kFinish;
  }
  // Cancelled or over, every op in flight completes promptly.
  while (pending_ != 0 &&
         Step(absl::ZeroDuration(), absl::InfiniteFuture()) == grpc::CompletionQueue::GOT_EVENT) {
  }
  out_.Clear();
  if (final_status_.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(final_status_.error_code()),
                      final_status_.error_message());
}

// ---------------------------------------------------------------------------
// ServerStream

// What a stream's reply slot and the agent share with the reactor: where
// the stream stands, under one lock, and the reactor until gRPC is done
// with it.
class ServerStream::State {
 public:
  explicit State(ServerStream* reactor) : reactor_(reactor) {}

  // The request just read (the stream is handling it from now on), or
  // nothing when the stream is ending: its caller has had its status (a
  // request handled now could run after the caller was told it failed).
  std::optional<grpc::ByteBuffer> TakeRequest() {
    base::MutexLock lock(mu_);
    if (ending_) return std::nullopt;
    handling_ = true;
    grpc::ByteBuffer frame = std::move(in_);
    in_ = grpc::ByteBuffer();
    return frame;
  }

  // The reply to the request in hand.
  bool Write(grpc::ByteBuffer frame) {
    base::MutexLock lock(mu_);
    handling_ = false;
    if (reactor_ == nullptr || finished_) return false;
    out_ = std::move(frame);
    writing_ = true;
    reactor_->StartWrite(&out_);
    return true;
  }

  void OnWriteDone(bool ok) {
    base::MutexLock lock(mu_);
    writing_ = false;
    out_.Clear();
    if (!ok) EndLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the caller is gone"), false);
    if (ending_) return MaybeFinishLocked();
    reactor_->StartRead(&in_);
  }

  void StartFirstRead() {
    base::MutexLock lock(mu_);
    reactor_->StartRead(&in_);
  }

  // Ends the stream with `status`: at once, or, when `graceful`, once the
  // request in hand has had its reply written.
  void End(const grpc::Status& status, bool graceful) {
    base::MutexLock lock(mu_);
    EndLocked(status, graceful);
  }

  void Detach() {
    base::MutexLock lock(mu_);
    reactor_ = nullptr;
  }

 private:
  void EndLocked(const grpc::Status& status, bool graceful) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!ending_) {
      ending_ = true;
      status_ = status;
      graceful_ = graceful;
    } else if (!graceful) {
      graceful_ = false;
    }
    MaybeFinishLocked();
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!ending_ || writing_ || finished_ || reactor_ == nullptr) return;
    if (handling_ && graceful_) return;  // Write() comes back here
    finished_ = true;
    reactor_->Finish(status_);
  }

  absl::Mutex mu_;
  ServerStream* reactor_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer in_;   // the read in flight (only gRPC touches it then)
  grpc::ByteBuffer out_;  // the write in flight, likewise
  bool handling_ ABSL_GUARDED_BY(mu_) = false;  // a request is with a handler
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;
  bool graceful_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

namespace {

// The reply slot of the call a stream is handling: replies once, tagged
// with the request's id.
class StreamSlot final : public ReplySlot {
 public:
  StreamSlot(std::shared_ptr<ServerStream::State> state, uint64_t id)
      : state_(std::move(state)), id_(id) {}
  ~StreamSlot() override {
    // Dropped without a reply: the stream must not wait for one.
    if (!replied_) state_->End(grpc::Status(grpc::StatusCode::INTERNAL, "no reply"), false);
  }
  bool Reply(grpc::ByteBuffer frame) override {
    if (replied_) return false;
    replied_ = true;
    return state_->Write(TagFrame(id_, frame));
  }

 private:
  const std::shared_ptr<ServerStream::State> state_;
  const uint64_t id_;
  bool replied_ = false;  // one handler replies, once
};

}  // namespace

ServerStream::ServerStream(Dispatch dispatch,
                           std::function<void(const std::shared_ptr<State>&)> on_done)
    : dispatch_(std::move(dispatch)),
      on_done_(std::move(on_done)),
      state_(std::make_shared<State>(this)) {
  state_->StartFirstRead();
}

void ServerStream::Close(const std::shared_ptr<State>& state, const grpc::Status& status) {
  state->End(status, /*graceful=*/true);
}

void ServerStream::OnReadDone(bool ok) {
  if (!ok) {
    state_->End(grpc::Status::OK, false);  // the caller closed its side
    return;
  }
  std::optional<grpc::ByteBuffer> request = state_->TakeRequest();
  if (!request) return;
  grpc::ByteBuffer message = std::move(*request);
  absl::StatusOr<uint64_t> id = UntagFrame(&message);
  if (!id.ok()) {
    state_->End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(id.status().message())),
                false);
    return;
  }
  dispatch_(std::move(message), std::make_shared<StreamSlot>(state_, *id));
}

void ServerStream::OnWriteDone(bool ok) { state_->OnWriteDone(ok); }

void ServerStream::OnCancel() {
  state_->End(grpc::Status(grpc::StatusCode::CANCELLED, "the caller cancelled the stream"), false);
}

void ServerStream::OnDone() {
  state_->Detach();
  if (on_done_) on_done_(state_);
  delete this;
}

}  // namespace remora::rpc
