// The pipeline's calls between processes, one struct each (rpc/call.h):
// what the master sends its workers to build stages and step runners and to
// run a batch, and what the workers send one another within a batch. Both
// sides encode and decode through these structs, so a field is added or
// moved in one place; a call that does not match is an error naming the
// call and the field.
//
// "runner" is a step runner's id (Pipeline's, one per pipeline), "context"
// a batch's distributed autograd context id, an evaluation's id where it
// says so. Values marked "or None" are c10::IValue fields that are None
// when absent. A WorkerRows travels as pipeline::ToIValue's tuple.
//
// Thread-safety: plain structs.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/core/ivalue.h>

#include "absl/strings/str_cat.h"
#include "pipeline/schedule.h"
#include "rpc/call.h"
#include "runtime/compute_lane.h"

namespace remora::pipeline {

// --- worker -> worker: a step's gradient norm ---------------------------------

// This worker's share of batch `context`'s squared gradient norm (the sum
// over its parameters of each one's squared norm), to every other worker
// of the pipeline (PipelineOptions::clip_grad_norm).
struct GradNormRequest {
  static constexpr char kFunction[] = "remora.pipeline.grad_norm";
  int64_t runner = 0;
  int64_t context = 0;
  double squared = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("runner", runner)("context", context)("squared", squared);
  }
};

// --- worker -> worker: a tied weight's gradient -------------------------------

// The gradient that batch `context` gave this worker's copy of the tied
// weight (PipelineOptions::tied_first/tied_last) on stage `stage` (the
// first stage or the last), to the worker of the other copy; None when
// this copy got none.
struct TiedGradRequest {
  static constexpr char kFunction[] = "remora.pipeline.tied_grad";
  int64_t runner = 0;
  int64_t context = 0;
  int64_t stage = 0;
  c10::IValue grad;
  template <typename Fields>
  void Visit(Fields& f) {
    f("runner", runner)("context", context)("stage", stage)("grad", grad);
  }
};

// A worker's actions as make_runner and set_order carry them: [stage,
// micro-batch, kind (0 F, 1 B, 2 W), stage, ...].
inline std::vector<int64_t> EncodeOrder(const std::vector<Action>& actions) {
  std::vector<int64_t> flat;
  for (const Action& a : actions) {
    flat.insert(flat.end(), {a.stage, a.micro_batch,
                             a.kind == Action::kWeight ? 2 : a.kind == Action::kBackward ? 1 : 0});
  }
  return flat;
}

// EncodeOrder's list as the compute lane's actions of batch `context_id`;
// std::invalid_argument naming `call` for a list that is not one.
inline std::vector<runtime::LaneAction> DecodeOrder(const std::vector<int64_t>& flat, int64_t context_id,
                                           const char* call) {
  if (flat.size() % 3 != 0) {
    throw std::invalid_argument(absl::StrCat(call, ": order holds ", flat.size(),
                                             " numbers, not triples of stage, micro-batch and kind"));
  }
  std::vector<runtime::LaneAction> order;
  for (size_t i = 0; i < flat.size(); i += 3) {
    const int64_t kind = flat[i + 2];
    if (kind < 0 || kind > 2) {
      throw std::invalid_argument(absl::StrCat(call, ": action ", i / 3, " of order has kind ", kind,
                                               ", not 0 (forward), 1 (backward) or 2 (weights)"));
    }
    order.push_back(runtime::LaneAction{context_id, flat[i], flat[i + 1], kind != 0, kind == 2});
  }
  return order;
}

// --- master -> worker: setting up --------------------------------------------

// A step runner on a worker: its stages, its share of the schedule, the
// loss (on the last stage's worker) and the optimizer it steps.
struct MakeRunnerRequest {
  static constexpr char kFunction[] = "remora.pipeline.make_runner";
  int64_t runner = 0;
  std::vector<std::string> stage_workers;  // each stage's worker, in order
  int micro_batches = 0;
  std::vector<int64_t> order;  // this worker's actions (EncodeOrder)
  std::vector<c10::IValue> stages;  // RRefs of the stages this worker owns
  std::string loss;  // the registered loss's name
  c10::IValue optimizer;  // an RRef of this worker's optimizer, or None
  double clip_grad_norm = 0;  // PipelineOptions::clip_grad_norm
  std::string tied_first, tied_last;  // PipelineOptions::tied_first, tied_last
  template <typename Fields>
  void Visit(Fields& f) {
    f("runner", runner)("stage_workers", stage_workers)("micro_batches", micro_batches)("order", order)(
        "stages", stages)("loss", loss)("optimizer", optimizer)("clip_grad_norm", clip_grad_norm)(
        "tied_first", tied_first, rpc::kMayBeLeftOff)("tied_last", tied_last, rpc::kMayBeLeftOff);
  }
};

struct DropRunnerRequest {
  static constexpr char kFunction[] = "remora.pipeline.drop_runner";
  int64_t runner = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("runner", runner);
  }
};

// Seeds a worker's random generators, CPU and CUDA.
struct SeedRequest {
  static constexpr char kFunction[] = "remora.pipeline.seed";
  int64_t seed = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("seed", seed);
  }
};

// A stage module (the registered module type "remora.pipeline.Stage"):
// built from its registered type's name and payload, on `device` ("" for
// the worker's own).
struct MakeStageRequest {
  static constexpr char kFunction[] = "remora.pipeline.Stage";
  std::string type;
  std::string name;
  c10::IValue payload;  // the type's arguments, a list
  int64_t index = 0;
  std::string device;
  bool recompute = false;  // StageSpec::recompute
  bool bf16 = false;       // StageSpec::bf16
  template <typename Fields>
  void Visit(Fields& f) {
    f("type", type)("name", name)("payload", payload)("index", index)("device", device)("recompute", recompute)(
        "bf16", bf16, rpc::kMayBeLeftOff);
  }
};

// Times each layer (a stage spec each), each taking the previous one's
// output (the first takes `sample`, a value or an RRef to one); the fastest
// of `repeats` runs counts. Replies with LayerCostsReply.
struct LayerCostsRequest {
  static constexpr char kFunction[] = "remora.pipeline.layer_costs";
  std::vector<std::string> kinds;
  std::vector<std::string> names;
  std::vector<c10::IValue> payloads;
  c10::IValue sample;
  int64_t repeats = 1;
  template <typename Fields>
  void Visit(Fields& f) {
    f("kinds", kinds)("names", names)("payloads", payloads)("sample", sample)("repeats", repeats);
  }
};

// Per layer, in milliseconds: its forward (F), its input's gradient (B) and
// its parameters' gradients (W; 0 where B ran the whole backward).
struct LayerCostsReply {
  static constexpr char kFunction[] = "remora.pipeline.layer_costs (reply)";
  std::vector<double> forward_ms;
  std::vector<double> input_ms;
  std::vector<double> weight_ms;
  template <typename Fields>
  void Visit(Fields& f) {
    f("forward_ms", forward_ms)("input_ms", input_ms)("weight_ms", weight_ms);
  }
};

// --- master -> worker: one batch -----------------------------------------------

// A training batch on one worker: its inputs go to the first stage's worker
// and its targets to the last's, or both read there (rows).
struct RunRequest {
  static constexpr char kFunction[] = "remora.pipeline.run";
  int64_t runner = 0;
  int64_t context = 0;
  int64_t after = -1;  // the previous batch's context, or -1
  c10::IValue inputs;  // or None
  c10::IValue targets;  // or None
  int64_t total_rows = 0;  // the rows the micro-batches are a share of
  c10::IValue rows;  // a WorkerRows, or None
  template <typename Fields>
  void Visit(Fields& f) {
    f("runner", runner)("context", context)("after", after)("inputs", inputs)("targets", targets)(
        "total_rows", total_rows)("rows", rows);
  }
};

// An evaluation batch (forward only): replies with the last stage's outputs,
// or with EvalCorrectReply when labels were given.
struct EvalRequest {
  static constexpr char kFunction[] = "remora.pipeline.eval";
  int64_t runner = 0;
  int64_t eval = 0;  // the evaluation's id
  c10::IValue inputs;  // or None
  int micro_batches = 1;
  c10::IValue labels;  // or None
  c10::IValue rows;  // a WorkerRows, or None
  template <typename Fields>
  void Visit(Fields& f) {
    f("runner", runner)("eval", eval)("inputs", inputs)("micro_batches", micro_batches)("labels", labels)(
        "rows", rows);
  }
};

// The last stage's worker's count of an evaluation with labels.
struct EvalCorrectReply {
  static constexpr char kFunction[] = "remora.pipeline.eval (reply)";
  int64_t top1 = 0;
  int64_t top5 = 0;
  int64_t rows = 0;
  int64_t items = 0;    // labels counted (a language model's: a position each)
  double loss_sum = 0;  // their cross-entropy, summed
  template <typename Fields>
  void Visit(Fields& f) {
    f("top1", top1)("top5", top5)("rows", rows)("items", items)("loss_sum", loss_sum);
  }
};

// A failed batch or evaluation: what waits for it is dropped.
struct AbandonRequest {
  static constexpr char kFunction[] = "remora.pipeline.abandon";
  int64_t runner = 0;
  int64_t context = 0;  // or the evaluation's id
  template <typename Fields>
  void Visit(Fields& f) {
    f("runner", runner)("context", context);
  }
};

// The master-driven schedule (Pipeline::forward_backward): this worker's
// actions for the batch `context`, as MakeRunnerRequest::order.
struct SetOrderRequest {
  static constexpr char kFunction[] = "remora.pipeline.set_order";
  int64_t context = 0;
  std::vector<int64_t> order;
  template <typename Fields>
  void Visit(Fields& f) {
    f("context", context)("order", order);
  }
};

struct AbandonOrderRequest {
  static constexpr char kFunction[] = "remora.pipeline.abandon_order";
  int64_t context = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("context", context);
  }
};

// --- a stage module's methods ---------------------------------------------------

// "forward" (with autograd, recorded in `context`) and "eval": `x` is a
// value or an RRef to one.
struct StageForwardRequest {
  static constexpr char kFunction[] = "remora.pipeline.Stage.forward";
  static constexpr char kMethod[] = "forward";
  c10::IValue x;
  int64_t micro_batch = 0;
  int64_t context = -1;
  template <typename Fields>
  void Visit(Fields& f) {
    f("x", x)("micro_batch", micro_batch)("context", context);
  }
};

struct StageEvalRequest {
  static constexpr char kFunction[] = "remora.pipeline.Stage.eval";
  static constexpr char kMethod[] = "eval";
  c10::IValue x;
  int64_t micro_batch = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("x", x)("micro_batch", micro_batch);
  }
};

// The stage's peak saved activations in bytes (-1 where not measured),
// starting a new peak when `reset`.
struct ActivationBytesRequest {
  static constexpr char kFunction[] = "remora.pipeline.Stage.activation_bytes";
  static constexpr char kMethod[] = "activation_bytes";
  bool reset = false;
  template <typename Fields>
  void Visit(Fields& f) {
    f("reset", reset);
  }
};

// Loads the stage's parameters and buffers, in "state"'s order; with names
// (those "state_names" gives) each is checked against its own.
struct LoadStateRequest {
  static constexpr char kFunction[] = "remora.pipeline.Stage.load_state";
  static constexpr char kMethod[] = "load_state";
  std::vector<at::Tensor> tensors;
  std::vector<std::string> names;  // or empty
  std::string missing;  // with names: one the saved state may lack (kept as it is)
  template <typename Fields>
  void Visit(Fields& f) {
    f("tensors", tensors)("names", names)("missing", missing, rpc::kMayBeLeftOff);
  }
};

// One of the stage's parameters by name (its state_dict name): read
// (`value` None; the reply is the tensor) or set (copied into it).
struct StageParameterRequest {
  static constexpr char kFunction[] = "remora.pipeline.Stage.parameter";
  static constexpr char kMethod[] = "parameter";
  std::string name;
  c10::IValue value;
  template <typename Fields>
  void Visit(Fields& f) {
    f("name", name)("value", value, rpc::kMayBeLeftOff);
  }
};

// --- worker -> worker, within a batch -------------------------------------------

// Stage `stage`'s input of `micro_batch`, from the previous stage's worker.
struct PushRequest {
  static constexpr char kFunction[] = "remora.pipeline.push";
  int64_t runner = 0;
  int64_t context = 0;
  int64_t stage = 0;
  int64_t micro_batch = 0;
  c10::IValue value;
  template <typename Fields>
  void Visit(Fields& f) {
    f("runner", runner)("context", context)("stage", stage)("micro_batch", micro_batch)("value", value);
  }
};

// The same within an evaluation (`context` is the evaluation's id).
struct EvalPushRequest : PushRequest {
  static constexpr char kFunction[] = "remora.pipeline.eval_push";
};

// The batch's labels, from the first stage's worker (which read them) to
// the last's; `total_rows` as RunRequest's.
struct TargetsRequest {
  static constexpr char kFunction[] = "remora.pipeline.targets";
  int64_t runner = 0;
  int64_t context = 0;
  c10::IValue labels;
  double total_rows = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("runner", runner)("context", context)("labels", labels)("total_rows", total_rows);
  }
};

struct EvalTargetsRequest {
  static constexpr char kFunction[] = "remora.pipeline.eval_targets";
  int64_t runner = 0;
  int64_t eval = 0;
  at::Tensor labels;
  template <typename Fields>
  void Visit(Fields& f) {
    f("runner", runner)("eval", eval)("labels", labels);
  }
};

// --- data read on the workers (pipeline/worker_data.h) ---------------------------

// Opens a source (data::SourceSpec's fields); replies with its rows.
struct OpenDataRequest {
  static constexpr char kFunction[] = "remora.data.open";
  int64_t source = 0;
  std::string dataset;
  bool train = true;
  int64_t rows = 0;
  int64_t image_size = 0;
  int threads = 0;
  int64_t seed = 0;
  bool skip_bad_images = false;
  std::string listing_cache;
  double val_fraction = 0;
  int64_t seq_len = 0;
  std::string token_cache;
  std::string tokenizer;
  template <typename Fields>
  void Visit(Fields& f) {
    f("source", source)("dataset", dataset)("train", train)("rows", rows)("image_size", image_size)(
        "threads", threads)("seed", seed)("skip_bad_images", skip_bad_images)("listing_cache", listing_cache)(
        "val_fraction", val_fraction)("seq_len", seq_len)("token_cache", token_cache)("tokenizer", tokenizer);
  }
};

// "remora.data.skipped" (the rows left out so far) and "remora.data.close".
struct DataSkippedRequest {
  static constexpr char kFunction[] = "remora.data.skipped";
  int64_t source = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("source", source);
  }
};
struct CloseDataRequest : DataSkippedRequest {
  static constexpr char kFunction[] = "remora.data.close";
};

// A WorkerRows as a value of its own (pipeline::ToIValue): tagged, so that
// it is told apart from a batch's tensors.
struct WorkerRowsValue {
  static constexpr char kFunction[] = "remora.rows";
  std::string tag;  // kFunction
  int64_t source = -1;
  at::Tensor rows;
  int epoch = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("tag", tag)("source", source)("rows", rows)("epoch", epoch);
  }
};

}  // namespace remora::pipeline
