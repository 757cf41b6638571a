// The shared-memory channel: bulk CPU payloads between processes on one host.
//
// gRPC carries a descriptor; the bytes go through a segment of the sender:
//
//   sender                               receiver
//   Reserve(): claim a free segment      Read(): map the segment once
//            (memfd, mapped once,                (/proc/<pid>/fd/<fd>), copy
//            reused across calls)                out into memory the
//   descriptor --------- gRPC ---------->        receiver's tensor owns as
//   Fill(): copy in, chunk by chunk,             the chunks arrive, mark
//           publishing progress                  the segment free
//
// The sender copies in after the descriptor has left, so both copies run
// at once: a large payload costs about one copy, not two.
//
// Segments are anonymous memory files (memfd_create): they never appear in
// /dev/shm, so a process that exits or is killed leaves nothing behind; the
// kernel frees a segment when its last mapping goes. Receivers drop their
// mappings of a peer when it leaves the group.
//
// Each segment starts with a header whose state word is (sequence << 2 |
// state). The sender claims a FREE segment by bumping the sequence (BUSY),
// copies while publishing how many bytes are in, and publishes READY; the
// descriptor names the sequence. The receiver copies what is published and
// then swaps READY->FREE for exactly that sequence; if
// the word changed meanwhile (the sender took the segment back after its
// call failed), the receiver reports the payload lost instead of using torn
// bytes. No state is ever trusted without that check, so a confused or
// hostile peer can make a call fail but cannot corrupt memory: every size,
// offset and identity in a descriptor is checked against the mapped header.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/ids.h"
#include "channel/channel.h"
#include "channel/stats.h"
#include "proto/channel.pb.h"

namespace remora::channel {

// Copies n bytes, on LibTorch's intra-op threads when n is large.
void ParallelMemcpy(void* dst, const void* src, size_t n);

// This boot of this machine (/proc/sys/kernel/random/boot_id); empty when
// unknown.
std::string BootId();

// What processes must share for one to read the other's segments: the same
// kernel boot, PID namespace and user. Empty when this process cannot
// offer shared memory at all.
std::string ShmDomain();

// Both ends of the channel for one agent: its own segments (sending) and
// the mappings of its peers' segments (receiving). As a Channel: Send is
// Write, Receive is Read into a buffer of runtime/buffer_cache.h, Reclaim
// takes the segment back, Abandon leaves an unread segment to the sender's
// reclaim (reclaim_after), and Stop makes Send and Reserve decline.
//
// Thread-safe. Owned by the agent; unmaps and closes everything when
// destroyed.
class ShmChannel final : public Channel<wire::ShmPayload> {
 public:
  struct Options {
    // False: offer no shared memory (an empty domain); peers send inline.
    bool enabled = true;
    // All segments together stay below this; beyond it payloads go inline.
    size_t max_bytes = size_t{1} << 30;
    // A READY segment nobody read for this long is taken back (its message
    // was lost with a failed call or a dead peer).
    absl::Duration reclaim_after = absl::Minutes(2);
    // A reader gives up on a payload whose sender made no progress for this
    // long.
    absl::Duration stall_timeout = absl::Seconds(30);
  };

  // Counters for tests and logs.
  using Stats = ShmStats;  // channel/stats.h

  explicit ShmChannel(Options options);
  ~ShmChannel() override;
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  // This process's endpoint: domain, pid, incarnation.
  const base::ShmEndpoint& endpoint() const { return self_; }

  // Sending, first step: claims a free segment for `n` bytes and describes
  // it (payload index left 0). nullopt when the segment budget is spent or
  // a segment cannot be made: send the payload inline instead.
  std::optional<wire::ShmPayload> Reserve(size_t n);

  // Sending, second step, after the descriptor has been sent: copies
  // `payload` (contiguous CPU bytes, the size reserved) into its segment.
  void Fill(const wire::ShmPayload& d, const at::Tensor& payload);

  // Both steps at once (tests, and callers that cannot send in between).
  std::optional<wire::ShmPayload> Write(const at::Tensor& payload);

  // Takes back a segment whose message was never read (its call failed);
  // one still being filled is taken back when its Fill ends. Safe when the
  // receiver reads it after all: it then sees the loss.
  void Reclaim(const wire::ShmPayload& payload);

  // Receiving: checks the payload that `d` describes, `length` bytes, then
  // copies it into a tensor from `allocate(length)` (contiguous, at least
  // `length` bytes) as the sender fills it, and frees the sender's segment.
  // The sender must be an allowed peer (see Allow). A sender whose process
  // ended (killed mid-payload) fails the read within milliseconds, as does
  // Stop() meanwhile; one that stops filling for `stall_timeout` fails it
  // too.
  absl::StatusOr<at::Tensor> Read(const wire::ShmPayload& d, uint64_t length,
                                  const std::function<absl::StatusOr<at::Tensor>(size_t)>& allocate);

  // Channel (see above).
  std::optional<wire::ShmPayload> Send(base::WorkerId peer, const at::Tensor& payload,
                                       int dst_device) override;
  absl::StatusOr<at::Tensor> Receive(base::WorkerId peer, const wire::ShmPayload& d,
                                     uint64_t length) override;
  void Reclaim(base::WorkerId peer, const wire::ShmPayload& d) override { Reclaim(d); }
  void Abandon(base::WorkerId peer, const wire::ShmPayload& d, const std::string& why) override {}
  void Stop() override { stopped_.store(true); }

  // Peers whose segments may be mapped: exactly `peers` from now on; the
  // mappings of every other process are dropped. Until the first Allow, a
  // payload waits up to 10 s for it (a request may arrive before this
  // process has read the group's membership at rendezvous).
  void Allow(const std::vector<base::ShmEndpoint>& peers);

  Stats stats() const;

 private:
  struct Segment;  // one of ours
  struct Mapping;  // one of a peer's

  absl::StatusOr<std::shared_ptr<Mapping>> Map(const wire::ShmPayload& d);

  const Options options_;
  base::ShmEndpoint self_;

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Segment>> segments_ ABSL_GUARDED_BY(mu_);
  size_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t writes_ ABSL_GUARDED_BY(mu_) = 0;
  // Allowed peers: incarnation -> pid.
  absl::flat_hash_map<uint64_t, uint32_t> allowed_ ABSL_GUARDED_BY(mu_);
  bool members_known_ ABSL_GUARDED_BY(mu_) = false;  // Allow has been called
  // Peer segments mapped here, by (incarnation, segment id).
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Mapping>> mappings_
      ABSL_GUARDED_BY(mu_);
  std::atomic<int64_t> reads_{0};
  std::atomic<bool> stopped_{false};
};

}  // namespace remora::channel
