// pipeline_bench: what the pipeline's step protocol costs. S stages of a
// small MLP on S local workers (one intra-op thread each) train for --steps
// steps at each micro-batch count of --micro-batches; the same model trains
// in this process (one thread), micro-batch by micro-batch, for comparison.
// Per micro-batch count it prints steps per second of both, the requests
// sent per step, and the overhead per micro-batch per stage boundary: the
// step time beyond one process's, divided by M (S - 1); then the median
// round trip of a small rpc_sync to the first worker, measured right after,
// and the overhead over it (the yardstick: at most 2x at M=8, 4x at M=1). With a small
// --hidden the compute is negligible and the overhead is the protocol's.
//
//   pipeline_bench --stages 2 --micro-batches 1,2,8 --steps 200
//   pipeline_bench --master-centred          # the earlier protocol, to compare
//   pipeline_bench --micro-batches 1 --hops 100   # where a step's time goes
//
// --hops N traces N more steps at each count (runtime/trace.h: every
// request's send, arrival, wait for the pool, every turn on the compute lane,
// the passes) and prints the chain of one step: each event's median time
// from the step's start and the gap from the event before it.
#include <algorithm>
#include <cstring>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/randn.h>
#include <torch/optim/sgd.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "autograd/dist_autograd.h"
#include "base/status_util.h"
#include "examples/stock_worker.h"
#include "launch/cli.h"
#include "launch/local_group.h"
#include "pipeline/microbatch.h"
#include "pipeline/pipeline.h"
#include "pipeline/stage.h"
#include "rpc/agent.h"
#include "runtime/allocator.h"
#include "runtime/threads.h"
#include "trace/trace.h"
#include "train/tracing.h"

namespace remora {
namespace {

constexpr int64_t kIn = 16, kOut = 4;

struct Config {
  int stages = 2;
  std::string micro_batches = "1,2,8";
  int steps = 200;
  int warmup = 20;
  int batch_size = 64;
  int hidden = 32;
  bool master_centred = false;
  int hops = 0;
  std::string worker_cpus;
  int cold_mib = 0;
  int busy_poll_us = 0;
  int round_trips = 1000;
};

// Stage k of the model: MLPStage(in, out, seed, relu).
std::vector<pipeline::StageSpec> Stages(const Config& c) {
  std::vector<pipeline::StageSpec> specs;
  for (int k = 0; k < c.stages; ++k) {
    const int64_t in = k == 0 ? kIn : c.hidden, out = k + 1 == c.stages ? kOut : c.hidden;
    specs.push_back(pipeline::StageSpec::Registered(
        "MLPStage", {in, out, int64_t{k + 1}, k + 1 < c.stages}));
  }
  return specs;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Seconds per step (median) of the model trained in this process; with
// `touch_mib`, each step timed after that much other memory traffic (a
// process's caches as it finds them when others ran on its core).
absl::StatusOr<double> LocalStepSeconds(const Config& c, int m, const at::Tensor& x,
                                        const at::Tensor& y, int touch_mib = 0) {
  std::vector<char> other(static_cast<size_t>(touch_mib) << 20);
  std::vector<std::unique_ptr<pipeline::StageModule>> stages;
  std::vector<at::Tensor> params;
  for (const auto& spec : Stages(c)) {
    ASSIGN_OR_RETURN(auto s, pipeline::BuildStage(spec, c10::kCPU));
    for (const at::Tensor& p : s->Parameters()) params.push_back(p);
    s->Train(true);
    stages.push_back(std::move(s));
  }
  torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.01).momentum(0.9));
  ASSIGN_OR_RETURN(auto xs, pipeline::SplitMicroBatches(x, m));
  ASSIGN_OR_RETURN(auto ys, pipeline::SplitMicroBatches(y, m));
  std::vector<double> seconds;
  for (int step = 0; step < c.warmup + c.steps; ++step) {
    if (!other.empty()) std::memset(other.data(), step, other.size());
    const int64_t t0 = trace::NowUs();
    sgd.zero_grad();
    for (int i = 0; i < m; ++i) {
      c10::IValue v = xs[i];
      for (auto& s : stages) v = s->Forward(v);
      const double share = static_cast<double>(xs[i].toTensor().size(0)) / x.size(0);
      (at::mse_loss(v.toTensor(), ys[i].toTensor()) * share).backward();
    }
    sgd.step();
    if (step >= c.warmup) seconds.push_back((trace::NowUs() - t0) / 1e6);
  }
  return Median(seconds);
}

// The micro-batch counts of --micro-batches, the flags checked.
absl::StatusOr<std::vector<int>> CheckConfig(const Config& c) {
  std::vector<int> counts;
  for (absl::string_view part : absl::StrSplit(c.micro_batches, ',', absl::SkipEmpty())) {
    int m = 0;
    if (!absl::SimpleAtoi(part, &m) || m < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--micro-batches wants counts like 1,2,8; got '", c.micro_batches, "'"));
    }
    counts.push_back(m);
  }
  if (counts.empty()) return absl::InvalidArgumentError("--micro-batches is empty");
  RETURN_IF_ERROR(launch::CheckAtLeast(
      {{"stages", c.stages, 2}, {"steps", c.steps, 1}, {"hidden", c.hidden, 1}, {"warmup", c.warmup, 0},
       {"hops", c.hops, 0}, {"cold-mib", c.cold_mib, 0},
       {"round-trips", c.round_trips, 1}}));
  RETURN_IF_ERROR(launch::CheckBusyPollFlag(c.busy_poll_us, absl::ToInt64Microseconds(rpc::kMaxBusyPoll)));
  if (c.round_trips > 1000000) {
    return absl::InvalidArgumentError(absl::StrCat("--round-trips ", c.round_trips, " is above 1000000"));
  }
  for (int m : counts) {
    if (m > c.batch_size) {
      return absl::InvalidArgumentError(absl::StrCat("--batch-size ", c.batch_size, " < ", m, " micro-batches"));
    }
  }
  return counts;
}

// A traced slice of one process.
struct TracedSlice {
  std::string process;
  trace::Slice slice;
};

// The slices `names` recorded since their tracing began (their tracing
// stopped), and this process's.
absl::StatusOr<std::vector<TracedSlice>> CollectTraces(rpc::Agent& agent, const std::vector<std::string>& names) {
  std::vector<TracedSlice> out;
  trace::Enable(false);
  for (trace::Slice& s : trace::Drain()) out.push_back({"master", std::move(s)});
  for (const std::string& w : names) {
    ASSIGN_OR_RETURN(std::vector<train::TraceSliceValue> slices, train::TakeTrace(agent, w));
    for (train::TraceSliceValue& t : slices) {
      out.push_back({w, trace::Slice{std::move(t.name), t.micro_batch, t.start_us, t.end_us, std::move(t.stage)}});
    }
  }
  return out;
}

// Prints the chain of a step: every slice's start and end as an event
// ("bench1: recv remora.pipeline.push ["), numbered when it repeats within
// a step, at its median time from the step's start over the `steps`
// windows, in that order, with the gap from the event before.
void PrintChain(const std::vector<TracedSlice>& slices, const std::vector<std::pair<int64_t, int64_t>>& steps,
                int m) {
  std::map<std::string, std::vector<double>> at;  // event -> offsets in the steps that had it
  for (const auto& [t0, t1] : steps) {
    std::vector<std::pair<int64_t, std::string>> events;
    for (const TracedSlice& s : slices) {
      if (s.slice.start_us < t0 || s.slice.start_us > t1) continue;
      const std::string name = absl::StrCat(s.process, ": ", s.slice.name);
      events.emplace_back(s.slice.start_us, name + " [");
      events.emplace_back(s.slice.end_us, name + " ]");
    }
    events.emplace_back(t1, "master: step ends");
    std::sort(events.begin(), events.end());
    std::map<std::string, int> seen;
    for (const auto& [t, name] : events) {
      const int n = ++seen[name];
      at[n == 1 ? name : absl::StrCat(name, " #", n)].push_back(static_cast<double>(t - t0));
    }
  }
  std::vector<std::tuple<double, std::string, size_t>> chain;  // median offset, event, steps with it
  for (auto& [name, offsets] : at) chain.emplace_back(Median(offsets), name, offsets.size());
  std::sort(chain.begin(), chain.end());
  std::printf("\nthe chain of a step at M=%d, over %zu traced steps (median us from the step's start):\n", m,
              steps.size());
  std::printf("%9s %8s %6s  %s\n", "at_us", "gap_us", "steps", "event ([ begins, ] ends)");
  double before = 0;
  for (const auto& [offset, name, count] : chain) {
    std::printf("%9.0f %8.0f %6zu  %s\n", offset, offset - before, count, name.c_str());
    before = offset;
  }
  std::printf("\n");
  std::fflush(stdout);
}

// The median round trip (us) of `calls` small rpc_sync calls to `to`: a
// 4-element tensor to the workers' liveness probe, a function run on their
// pool as rpc_bench's echo (latency_us_median) is, on gRPC's streams (the
// pipeline's messages go on local links); the yardstick of the boundary's
// overhead, measured beside it.
absl::StatusOr<double> RoundTripUs(rpc::Agent& agent, const std::string& to, int calls) {
  const at::Tensor small = at::ones({4});
  std::vector<double> us;
  for (int i = 0; i < calls + calls / 10; ++i) {
    const int64_t t0 = trace::NowUs();
    RETURN_IF_ERROR(agent.rpc_sync(to, "remora.pipeline.alive", {small}).status());
    if (i >= calls / 10) us.push_back(static_cast<double>(trace::NowUs() - t0));
  }
  return Median(us);
}

// The pipeline over `names` at `m` micro-batches against one process: a
// line of figures.
absl::Status Measure(rpc::Agent& agent, const Config& c, const std::vector<std::string>& names, int m,
                     const at::Tensor& x, const at::Tensor& y) {
  pipeline::PipelineOptions o;
  o.stages = Stages(c);
  o.workers = names;
  o.schedule = "1f1b";
  o.micro_batches = m;
  o.loss = pipeline::MseLoss();
  if (c.master_centred) {
    o.loss = pipeline::LossFn([](const c10::IValue& out, const c10::IValue& target) {
      return at::mse_loss(out.toTensor(), target.toTensor());
    });
  }
  o.optimizer = optim::OptimizerOptions::SGD(0.01).set_momentum(0.9);
  auto pipe = pipeline::Pipeline::Create(agent, std::move(o));
  if (!pipe.ok()) return pipe.status();
  std::vector<double> seconds;
  std::map<std::string, int64_t> before;
  for (int step = 0; step < c.warmup + c.steps; ++step) {
    if (step == c.warmup) {
      auto sent = (*pipe)->sent_messages();
      if (!sent.ok()) return sent.status();
      before = *sent;
    }
    const int64_t t0 = trace::NowUs();
    if (auto loss = (*pipe)->start_train_step(x, y).wait(); !loss.ok()) return loss.status();
    if (step >= c.warmup) seconds.push_back((trace::NowUs() - t0) / 1e6);
  }
  auto after = (*pipe)->sent_messages();
  if (!after.ok()) return after.status();
  std::vector<TracedSlice> traced;
  std::vector<std::pair<int64_t, int64_t>> traced_steps;
  if (c.hops > 0) {
    train::StartTracing(agent, names);
    trace::Drain();
    trace::Enable(true);
    for (int step = 0; step < c.hops; ++step) {
      const int64_t t0 = trace::NowUs();
      if (auto loss = (*pipe)->start_train_step(x, y).wait(); !loss.ok()) return loss.status();
      traced_steps.emplace_back(t0, trace::NowUs());
    }
    ASSIGN_OR_RETURN(traced, CollectTraces(agent, names));
  }
  int64_t requests = 0;
  for (const auto& [kind, n] : pipeline::MessagesBetween(before, *after)) requests += n;
  pipe->reset();
  auto local = LocalStepSeconds(c, m, x, y);
  if (!local.ok()) return local.status();
  const double step_s = Median(seconds);
  const double overhead_us = (step_s - *local) * 1e6 / (m * (c.stages - 1));
  ASSIGN_OR_RETURN(const double rtt_us, RoundTripUs(agent, names[0], c.round_trips));
  std::printf("%6d %4d %16.1f %16.1f %7.2fx %10.1f %26.1f %8.1f %17.2f\n", c.stages, m, 1 / step_s, 1 / *local,
              step_s / *local, static_cast<double>(requests) / c.steps, overhead_us, rtt_us, overhead_us / rtt_us);
  std::fflush(stdout);
  if (c.hops > 0) PrintChain(traced, traced_steps, m);
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  Config c;
  launch::FlagParser flags(
      "pipeline_bench",
      "Trains --stages stages of a small MLP on as many local workers (one thread each) and\n"
      "the same model in this process (one thread), at each micro-batch count, and prints\n"
      "steps per second of both, the requests per step, the overhead per micro-batch per\n"
      "stage boundary (the step time beyond one process's, over M (S - 1)), and that overhead\n"
      "over a small rpc_sync's round trip to a worker, measured right after (rtt_us).");
  flags.StartsItsOwnGroup();
  flags.AddInt("stages", &c.stages, "pipeline stages, one per worker (>= 2)");
  flags.AddString("micro-batches", &c.micro_batches, "micro-batch counts to measure, e.g. 1,2,8");
  flags.AddInt("steps", &c.steps, "measured steps per micro-batch count");
  flags.AddInt("warmup", &c.warmup, "steps before the measured ones");
  flags.AddInt("batch-size", &c.batch_size, "rows per step");
  flags.AddInt("hidden", &c.hidden, "width of the hidden layers");
  flags.AddInt("hops", &c.hops,
               "trace this many more steps at each count and print where a step's time goes (0: none)");
  flags.AddBool("master-centred", &c.master_centred,
                "an unnamed loss: the earlier protocol, with the master in the data path");
  flags.AddInt("cold-mib", &c.cold_mib,
               "also time one process's step at M=1 after this many MiB of other memory traffic, beside "
               "back to back (the caches a pass finds after other processes ran; 0: not)");
  flags.AddInt("busy-poll-us", &c.busy_poll_us,
               "the workers' and this process's --busy-poll-us (rpc::AgentOptions::busy_poll; 0: off)");
  flags.AddInt("round-trips", &c.round_trips,
               "small rpc_sync calls to the first worker after each count's steps, whose median round trip "
               "(rtt_us) the overhead is also given over");
  flags.AddString("worker-cpus", &c.worker_cpus,
                  "the workers' --cpus: auto pins each to its share of this machine's cores (default: "
                  "none, the system places them)");
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  auto fail = [](const std::string& message) {
    std::cerr << "pipeline_bench: " << message << "\n";
    return 2;
  };
  auto checked = CheckConfig(c);
  if (!checked.ok()) return fail(std::string(checked.status().message()));
  const std::vector<int> counts = *checked;
  runtime::TuneAllocator();
  runtime::SetComputeThreads(1);
  rpc::Registry registry;
  if (auto s = examples::RegisterStockWorker(registry); !s.ok()) return fail(std::string(s.message()));
  std::vector<std::string> names;
  for (int k = 0; k < c.stages; ++k) names.push_back(absl::StrCat("bench", k + 1));
  rpc::AgentOptions options;
  options.name = "master";
  options.listen_address = "127.0.0.1:0";
  std::vector<std::string> worker_args = {"--threads", "1"};
  if (!c.worker_cpus.empty()) worker_args.insert(worker_args.end(), {"--cpus", c.worker_cpus});
  if (c.busy_poll_us > 0) worker_args.insert(worker_args.end(), {"--busy-poll-us", absl::StrCat(c.busy_poll_us)});
  options.busy_poll = absl::Microseconds(c.busy_poll_us);
  auto started = launch::StartLocalGroup(names, &registry, worker_args, options);
  if (!started.ok()) return fail(std::string(started.status().message()));
  launch::LocalGroup group = std::move(*started);
  rpc::Agent& agent = *group.master;
  auto die = [&](const absl::Status& s) {
    std::cerr << "pipeline_bench: " << s.message() << "\n";
    agent.Shutdown(/*graceful=*/false).IgnoreError();
    return 1;
  };
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor x = at::randn({c.batch_size, kIn}, gen, at::TensorOptions());
  const at::Tensor y = at::randn({c.batch_size, kOut}, gen, at::TensorOptions());
  if (c.cold_mib > 0) {
    auto warm = LocalStepSeconds(c, 1, x, y), cold = LocalStepSeconds(c, 1, x, y, c.cold_mib);
    if (!warm.ok() || !cold.ok()) return die(!warm.ok() ? warm.status() : cold.status());
    std::printf("one process's step at M=1: %.1f us back to back, %.1f us after %d MiB of other memory traffic "
                "(%.2fx)\n", *warm * 1e6, *cold * 1e6, c.cold_mib, *cold / *warm);
  }
  std::printf("%6s %4s %16s %16s %8s %10s %26s %8s %17s\n", "stages", "M", "steps_per_s", "local_steps_per_s",
              "ratio", "requests", "overhead_us_per_mb_boundary", "rtt_us", "overhead_over_rtt");
  for (int m : counts) {
    if (auto s = Measure(agent, c, names, m, x, y); !s.ok()) return die(s);
  }
  if (auto s = group.Shutdown(); !s.ok()) {
    std::cerr << "pipeline_bench: " << s.message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace remora

int main(int argc, char** argv) { return remora::Main(argc, argv); }
