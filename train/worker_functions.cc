#include "train/worker_functions.h"

#include <atomic>
#include <memory>
#include <utility>

#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>

#include "autograd/dist_autograd.h"
#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "checkpoint/checkpoint.h"
#include "optim/distributed_optimizer.h"
#include "parallel/gradient_group.h"
#include "parallel/rpc_store.h"
#include "pipeline/stage.h"
#include "ps/replica.h"
#include "rpc/agent.h"
#include "runtime/threads.h"
#include "trace/trace.h"
#include "train/protocol.h"
#include "train/tracing.h"

namespace remora::train {
namespace {

// TraceEnableRequest, and kTraceCollect's TraceSliceValues.
absl::Status RegisterTraceFunctions(rpc::Registry& r) {
  RETURN_IF_ERROR(
      r.RegisterFunction(TraceEnableRequest::kFunction, [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
        trace::Enable(rpc::DecodeCallOrThrow<TraceEnableRequest>(a).on);
        return c10::IValue();
      }));
  return r.RegisterFunction(kTraceCollect, [](rpc::CallContext&, const rpc::Args&) -> c10::IValue {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const auto& s : trace::Drain()) {
      out.push_back(rpc::EncodeTuple(TraceSliceValue{s.name, s.micro_batch, s.start_us, s.end_us, s.stage}));
    }
    return out;
  });
}

// use_deterministic_algorithms(): the master's --deterministic, here
// (runtime::UseDeterministicAlgorithms); says so on the first call.
absl::Status RegisterDeterminism(rpc::Registry& r, base::LineSink say) {
  auto said = std::make_shared<std::atomic<bool>>(false);
  return r.RegisterFunction(kUseDeterministicAlgorithms,
                            [said, say = std::move(say)](rpc::CallContext& ctx, const rpc::Args&) -> c10::IValue {
                              runtime::UseDeterministicAlgorithms();
                              if (!said->exchange(true)) {
                                base::Say(say, absl::StrCat("worker '", ctx.worker_name(),
                                                      "': deterministic algorithms (the master's --deterministic)"));
                              }
                              return c10::IValue();
                            });
}

}  // namespace

void StartTracing(rpc::Agent& agent, const std::vector<std::string>& workers) {
  for (const auto& w : workers) {
    agent.rpc_sync(w, TraceEnableRequest::kFunction, rpc::EncodeCall(TraceEnableRequest{true})).IgnoreError();
    agent.rpc_sync(w, kTraceCollect).IgnoreError();  // drop older slices
  }
}

absl::Status UseDeterministicAlgorithmsOn(rpc::Agent& agent, const std::vector<std::string>& workers) {
  for (const auto& w : workers) {
    if (absl::Status s = agent.rpc_sync(w, kUseDeterministicAlgorithms).status(); !s.ok()) {
      return base::Annotate(s, absl::StrCat("--deterministic: worker '", w, "' could not switch to deterministic "
                                            "algorithms (a worker program must register remora's worker functions)"));
    }
  }
  return absl::OkStatus();
}

void StopTracing(rpc::Agent& agent, const std::vector<std::string>& workers) {
  for (const auto& w : workers) {
    agent.rpc_sync(w, TraceEnableRequest::kFunction, rpc::EncodeCall(TraceEnableRequest{false})).IgnoreError();
  }
}

absl::StatusOr<std::vector<TraceSliceValue>> TakeTrace(rpc::Agent& agent, const std::string& worker) {
  auto slices = agent.rpc_sync(worker, kTraceCollect);
  StopTracing(agent, {worker});
  if (!slices.ok()) return slices.status();
  if (!slices->isList()) {
    return absl::InternalError(absl::StrCat("worker '", worker, "' answered ", kTraceCollect, " with a ",
                                            slices->tagKind(), ", not a list of slices"));
  }
  std::vector<TraceSliceValue> out;
  for (const c10::IValue& s : slices->toListRef()) {
    absl::StatusOr<TraceSliceValue> t = rpc::DecodeTuple<TraceSliceValue>(s);
    if (!t.ok()) return base::Annotate(t.status(), absl::StrCat("worker '", worker, "'"));
    out.push_back(*std::move(t));
  }
  return out;
}

absl::Status RegisterWorkerFunctions(rpc::Registry& registry, base::LineSink say) {
  RETURN_IF_ERROR(autograd::RegisterFunctions(registry));
  RETURN_IF_ERROR(optim::RegisterFunctions(registry));
  RETURN_IF_ERROR(pipeline::RegisterFunctions(registry));
  RETURN_IF_ERROR(parallel::RegisterFunctions(registry));
  // (A master hosts the gradient groups' rendezvous keys: parallel/rpc_store.h.)
  RETURN_IF_ERROR(parallel::RegisterStoreFunctions(registry));
  RETURN_IF_ERROR(checkpoint::RegisterFunctions(registry));
  RETURN_IF_ERROR(ps::RegisterFunctions(registry));
  RETURN_IF_ERROR(RegisterDeterminism(registry, std::move(say)));
  return RegisterTraceFunctions(registry);
}

}  // namespace remora::train
