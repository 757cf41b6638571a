// The data-parallel calls, one struct each (rpc/call.h): the collectives'
// key-value store that the master keeps for its replicas' gradient groups
// (parallel/rpc_store.h), and the gradient group module each worker holds
// with its methods (parallel/gradient_group.h). Both sides encode and
// decode through these structs; a call that does not match is an error
// naming the call and the field.
//
// Thread-safety: plain structs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "rpc/call.h"

namespace remora::parallel {

// --- the store, on the master ----------------------------------------------------

struct StoreSetRequest {
  static constexpr char kFunction[] = "remora.store.set";
  std::string key;
  std::string value;
  template <typename Fields>
  void Visit(Fields& f) {
    f("key", key)("value", value);
  }
};

// "get" replies with the value, or None while there is none; "delete"
// with whether there was one.
struct StoreGetRequest {
  static constexpr char kFunction[] = "remora.store.get";
  std::string key;
  template <typename Fields>
  void Visit(Fields& f) {
    f("key", key);
  }
};
struct StoreDeleteRequest : StoreGetRequest {
  static constexpr char kFunction[] = "remora.store.delete";
};

// Adds `n` to the key's number (0 when absent; kept in decimal, as c10d's
// stores keep it) and replies with the sum.
struct StoreAddRequest {
  static constexpr char kFunction[] = "remora.store.add";
  std::string key;
  int64_t n = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("key", key)("n", n);
  }
};

// Whether every key is there.
struct StoreCheckRequest {
  static constexpr char kFunction[] = "remora.store.check";
  std::vector<std::string> keys;
  template <typename Fields>
  void Visit(Fields& f) {
    f("keys", keys);
  }
};

// The number of keys that start with `prefix`.
struct StoreCountRequest {
  static constexpr char kFunction[] = "remora.store.count";
  std::string prefix;
  template <typename Fields>
  void Visit(Fields& f) {
    f("prefix", prefix);
  }
};

// --- the gradient group, on each worker -------------------------------------------

// The module: joins rank `rank` of `size` in the group `name`, meeting
// over the store at store_host:store_port (or the master's, over the
// agents, when store_host is empty), for the stages whose parameters
// (RRefs owned here, one list per stage index) it sums.
struct MakeGradientGroupRequest {
  static constexpr char kFunction[] = "remora.parallel.GradientGroup";
  std::string store_host;
  int store_port = 0;
  std::string name;
  int rank = 0;
  int size = 0;
  int64_t timeout_ms = 0;
  int64_t bucket_bytes = 0;
  bool overlap = true;
  std::vector<int64_t> stage_indices;
  std::vector<c10::IValue> stage_params;  // a list of parameter RRefs per stage index
  bool zero = false;  // ZeRO-1: each rank keeps and steps its share of the optimizer state
  c10::IValue optimizer_options;  // optim::OptionsToDict's, or None without zero
  template <typename Fields>
  void Visit(Fields& f) {
    f("store_host", store_host)("store_port", store_port)("name", name)("rank", rank)("size", size)(
        "timeout_ms", timeout_ms)("bucket_bytes", bucket_bytes)("overlap", overlap)("stage_indices",
                                                                                      stage_indices)(
        "stage_params", stage_params)("zero", zero)("optimizer_options", optimizer_options);
  }
};

// Methods: "begin" (a batch of `micro_batches`), "finish" (replies with
// the number of buckets summed), "discard" (-1 does nothing), all by the
// batch's context id; "attach" joins a step runner's batches.
struct GroupBeginRequest {
  static constexpr char kFunction[] = "remora.parallel.GradientGroup.begin";
  static constexpr char kMethod[] = "begin";
  int64_t context = 0;
  int64_t micro_batches = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("context", context)("micro_batches", micro_batches);
  }
};

struct GroupFinishRequest {
  static constexpr char kFunction[] = "remora.parallel.GradientGroup.finish";
  static constexpr char kMethod[] = "finish";
  int64_t context = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("context", context);
  }
};
struct GroupDiscardRequest : GroupFinishRequest {
  static constexpr char kFunction[] = "remora.parallel.GradientGroup.discard";
  static constexpr char kMethod[] = "discard";
};

struct GroupAttachRequest {
  static constexpr char kFunction[] = "remora.parallel.GradientGroup.attach";
  static constexpr char kMethod[] = "attach";
  int64_t runner = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("runner", runner);
  }
};

// ("load_state", the whole optimizer state "save_state" gave after
// "consolidate" on every rank, is optim::LoadStateRequest: each rank keeps
// its share.)

}  // namespace remora::parallel
