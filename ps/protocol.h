// The parameter server's calls, one struct each (rpc/call.h): the replica
// module each worker holds (ps/replica.h) and the partitions that hold the
// parameters with --ps-partitions (ps/partitions.h). Both sides encode and decode
// through these structs; a call that does not match is an error naming the
// call and the field.
//
// Thread-safety: plain structs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "rpc/call.h"

namespace remora::ps {

// One stage spec (pipeline::StageSpec), as a tuple inside a call.
struct StageSpecValue {
  static constexpr char kFunction[] = "remora.ps stage spec";
  std::string kind;  // "script" or "type"
  std::string name;
  c10::IValue payload;  // the file's bytes (uint8), or the type's arguments (a list)
  std::string device;
  template <typename Fields>
  void Visit(Fields& f) {
    f("kind", kind)("name", name)("payload", payload)("device", device);
  }
};

// --- the replica, on each worker ---------------------------------------------------

// The module: a copy of the model built from its stage specs, with the loss
// by name; with partitions, their RRefs and each one's parameter indices.
struct MakeReplicaRequest {
  static constexpr char kFunction[] = "remora.ps.Replica";
  std::vector<c10::IValue> stages;  // StageSpecValue tuples
  std::string loss;
  std::vector<c10::IValue> partitions;  // RRefs, or empty without partitions
  std::vector<c10::IValue> partition_params;  // a list of ints per partition
  bool bf16 = false;  // PsOptions::bf16
  template <typename Fields>
  void Visit(Fields& f) {
    f("stages", stages)("loss", loss)("partitions", partitions)("partition_params", partition_params)("bf16", bf16, rpc::kMayBeLeftOff);
  }
};

// "compute": the gradients of `params` on a share of the batch (inputs and
// targets, or a WorkerRows as `inputs` with targets None), the loss
// weighted by its rows / total_rows.
struct ComputeRequest {
  static constexpr char kFunction[] = "remora.ps.Replica.compute";
  static constexpr char kMethod[] = "compute";
  std::vector<at::Tensor> params;
  c10::IValue inputs;
  c10::IValue targets;  // or None
  int64_t total_rows = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("params", params)("inputs", inputs)("targets", targets)("total_rows", total_rows);
  }
};

// "compute_partitioned": the same with the parameters pulled from the partitions,
// and the gradients pushed to them for `round`.
struct ComputePartitionedRequest {
  static constexpr char kFunction[] = "remora.ps.Replica.compute_partitioned";
  static constexpr char kMethod[] = "compute_partitioned";
  int64_t round = 0;
  c10::IValue inputs;
  c10::IValue targets;
  int64_t total_rows = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("round", round)("inputs", inputs)("targets", targets)("total_rows", total_rows);
  }
};

// What both compute calls answer (grads empty when pushed to the partitions).
struct ComputeReply {
  static constexpr char kFunction[] = "remora.ps.Replica.compute (reply)";
  std::vector<at::Tensor> grads;
  double loss = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("grads", grads)("loss", loss);
  }
};

// --- the partitions, on the servers -------------------------------------------------------

// The module: a partition holding copies of `params` with an optimizer over them.
struct MakePartitionRequest {
  static constexpr char kFunction[] = "remora.ps.Partition";
  std::vector<at::Tensor> params;
  c10::IValue optimizer_options;  // optim::OptionsToDict's
  template <typename Fields>
  void Visit(Fields& f) {
    f("params", params)("optimizer_options", optimizer_options);
  }
};

// "push": a worker's gradients of this partition's parameters for `round`;
// replies whether they were kept (false when late: that round was applied).
struct PartitionPushRequest {
  static constexpr char kFunction[] = "remora.ps.Partition.push";
  static constexpr char kMethod[] = "push";
  int64_t round = 0;
  std::string worker;
  std::vector<at::Tensor> grads;
  template <typename Fields>
  void Visit(Fields& f) {
    f("round", round)("worker", worker)("grads", grads);
  }
};

// "apply": steps with the gradients `workers` pushed for `round`, summed in
// that order and multiplied by `scale`.
struct PartitionApplyRequest {
  static constexpr char kFunction[] = "remora.ps.Partition.apply";
  static constexpr char kMethod[] = "apply";
  int64_t round = 0;
  std::vector<std::string> workers;
  double scale = 1;
  double clip = 1;  // the clipping's coefficient (PartitionNormRequest), applied after `scale`
  template <typename Fields>
  void Visit(Fields& f) {
    f("round", round)("workers", workers)("scale", scale)("clip", clip, rpc::kMayBeLeftOff);
  }
};

// The squared norm of the gradients "apply" would step with (the same
// workers' pushes for the round, summed and scaled), over the partition's
// parameters: its share of the whole model's norm, for clipping.
struct PartitionNormRequest {
  static constexpr char kFunction[] = "remora.ps.Partition.norm";
  static constexpr char kMethod[] = "norm";
  int64_t round = 0;
  std::vector<std::string> workers;
  double scale = 1;
  template <typename Fields>
  void Visit(Fields& f) {
    f("round", round)("workers", workers)("scale", scale);
  }
};

// "load": the parameters' saved values and the optimizer's saved state
// (optim::SaveOptimizerState's archive), when there is one.
struct PartitionLoadRequest {
  static constexpr char kFunction[] = "remora.ps.Partition.load";
  static constexpr char kMethod[] = "load";
  std::vector<at::Tensor> params;
  std::optional<at::Tensor> optimizer;
  template <typename Fields>
  void Visit(Fields& f) {
    f("params", params)("optimizer", optimizer);
  }
};

}  // namespace remora::ps
