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
#include "runtime/trace.h"
#include "train/protocol.h"
#include "train/tracing.h"

namespace remora::train {
namespace {

// TraceEnableRequest, and kTraceCollect's TraceSliceValues.
absl::Status RegisterTraceFunctions(Registry& r) {
  RETURN_IF_ERROR(r.RegisterFunction(TraceEnableRequest::kFunction, [](CallContext&, const Args& a) -> c10::IValue {
    trace::Enable(DecodeCallOrThrow<TraceEnableRequest>(a).on);
    return c10::IValue();
  }));
  return r.RegisterFunction(kTraceCollect, [](CallContext&, const Args&) -> c10::IValue {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const auto& s : trace::Drain()) {
      out.push_back(EncodeTuple(TraceSliceValue{s.name, s.micro_batch, s.start_us, s.end_us, s.stage}));
    }
    return out;
  });
}

// use_deterministic_algorithms(): the master's --deterministic, here
// (runtime::UseDeterministicAlgorithms); says so on the first call.
absl::Status RegisterDeterminism(Registry& r, LineSink say) {
  auto said = std::make_shared<std::atomic<bool>>(false);
  return r.RegisterFunction(kUseDeterministicAlgorithms,
                            [said, say = std::move(say)](CallContext& ctx, const Args&) -> c10::IValue {
                              runtime::UseDeterministicAlgorithms();
                              if (!said->exchange(true)) {
                                Say(say, absl::StrCat("worker '", ctx.agent->self().name,
                                                      "': deterministic algorithms (the master's --deterministic)"));
                              }
                              return c10::IValue();
                            });
}

}  // namespace

void StartTracing(Agent& agent, const std::vector<std::string>& workers) {
  for (const auto& w : workers) {
    agent.rpc_sync(w, TraceEnableRequest::kFunction, EncodeCall(TraceEnableRequest{true})).IgnoreError();
    agent.rpc_sync(w, kTraceCollect).IgnoreError();  // drop older slices
  }
}

void StopTracing(Agent& agent, const std::vector<std::string>& workers) {
  for (const auto& w : workers) {
    agent.rpc_sync(w, TraceEnableRequest::kFunction, EncodeCall(TraceEnableRequest{false})).IgnoreError();
  }
}

absl::StatusOr<std::vector<TraceSliceValue>> TakeTrace(Agent& agent, const std::string& worker) {
  auto slices = agent.rpc_sync(worker, kTraceCollect);
  StopTracing(agent, {worker});
  if (!slices.ok()) return slices.status();
  if (!slices->isList()) {
    return absl::InternalError(absl::StrCat("worker '", worker, "' answered ", kTraceCollect, " with a ",
                                            slices->tagKind(), ", not a list of slices"));
  }
  std::vector<TraceSliceValue> out;
  for (const c10::IValue& s : slices->toListRef()) {
    absl::StatusOr<TraceSliceValue> t = DecodeTuple<TraceSliceValue>(s);
    if (!t.ok()) return Annotate(t.status(), absl::StrCat("worker '", worker, "'"));
    out.push_back(*std::move(t));
  }
  return out;
}

absl::Status RegisterWorkerFunctions(Registry& registry, LineSink say) {
  RETURN_IF_ERROR(dist_autograd::RegisterFunctions(registry));
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
