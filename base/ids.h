// Identifiers shared by RPC, RRefs and (later) distributed autograd.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace remora::base {

using WorkerId = uint16_t;
inline constexpr WorkerId kUnknownWorker = 0xFFFF;

// Where a process's shared-memory segments can be read (channel/shm/shm.h).
struct ShmEndpoint {
  std::string domain;  // same boot, PID namespace and user; empty: off
  uint32_t pid = 0;
  uint64_t incarnation = 0;  // random per agent: tells restarts apart
};

// A random, non-zero 64-bit number: an agent's incarnation in its
// endpoints (above and below), new at every start.
uint64_t RandomIncarnation();

// A process's GPUs as peers see them (channel/cuda/cuda_channel.h).
struct CudaEndpoint {
  std::vector<std::string> gpus;  // UUIDs by device ordinal; empty: no CUDA channel
  bool nccl = false;              // NCCL is usable
  uint64_t incarnation = 0;       // random per agent: tells restarts apart
};

// A participant in the group: its stable id, name and gRPC address.
struct WorkerInfo {
  WorkerId id = kUnknownWorker;
  std::string name;
  std::string address;
  std::string host_id;  // equal on processes of the same host
  ShmEndpoint shm;
  CudaEndpoint cuda;
  std::string device = "cpu";  // its home device (AgentOptions::device)
};

// A globally unique id as PyTorch builds RRef and fork ids: the creating
// worker's 16-bit id and a 64-bit counter local to that worker.
struct GloballyUniqueId {
  WorkerId worker = kUnknownWorker;
  uint64_t local = 0;

  bool operator==(const GloballyUniqueId& o) const {
    return worker == o.worker && local == o.local;
  }
  bool operator!=(const GloballyUniqueId& o) const { return !(*this == o); }
  bool operator<(const GloballyUniqueId& o) const {
    return worker != o.worker ? worker < o.worker : local < o.local;
  }
  std::string ToString() const { return absl::StrCat("G(", worker, ",", local, ")"); }

  template <typename H>
  friend H AbslHashValue(H h, const GloballyUniqueId& id) {
    return H::combine(std::move(h), id.worker, id.local);
  }
};

using RRefId = GloballyUniqueId;
using ForkId = GloballyUniqueId;

// Names of participants: 1 to 128 characters of [A-Za-z0-9_:-].
bool IsValidWorkerName(const std::string& name);

// Names of registered functions, modules and methods: 1 to 128 characters
// of [A-Za-z0-9_.:-].
bool IsValidRegisteredName(const std::string& name);

}  // namespace remora::base
