// soak: trains a small two-stage MLP through the pipeline for many steps
// (remote forward, distributed backward, DistributedOptimizer) and reports
// the resources of the master and every worker at the start and at the end:
// RRef tables, distributed autograd contexts, threads, open file
// descriptors (sockets included) and resident memory. Exits 1 when a table
// or the context count grew, or when threads, descriptors or memory grew
// past the given bounds.
//
//   soak --steps 1000                       # starts two local workers
//   soak --external --workers w1,w2 --listen 127.0.0.1:29500 --steps 100000
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "autograd/dist_autograd.h"
#include "launch/cli.h"
#include "launch/local_group.h"
#include "launch/worker_main.h"
#include "optim/distributed_optimizer.h"
#include "pipeline/pipeline.h"
#include "rpc/agent.h"
#include "base/status_util.h"
#include "examples/demo_functions.h"
#include "runtime/allocator.h"
#include "runtime/process_stats.h"
#include "runtime/threads.h"

namespace remora {
namespace {

struct Config {
  int steps = 1000;
  int warmup = 20;
  int micro_batches = 4;
  int batch_size = 32;
  int hidden = 32;
  int progress = 100;
  double lr = 0.02;
  double max_rss_growth_mib = 64;
  int max_thread_growth = -1;  // -1: 16 + 2 per core
  int max_fd_growth = 16;
  bool external = false;
  std::string workers = "soak1,soak2";
  std::string listen = "127.0.0.1:0";
  int connect_timeout = 60;
};

// One process's figures at one moment.
struct Figures {
  runtime::ProcessStats process;
  rpc::RRefStats rrefs;
  int64_t contexts = 0;
};

constexpr int kIn = 16;
constexpr int kOut = 4;

absl::StatusOr<Figures> WorkerFigures(rpc::Agent& agent, const std::string& worker) {
  Figures f;
  ASSIGN_OR_RETURN(c10::IValue process, agent.rpc_sync(worker, "process_stats"));
  ASSIGN_OR_RETURN(c10::IValue rrefs, agent.rpc_sync(worker, "rref_stats"));
  ASSIGN_OR_RETURN(c10::IValue contexts, agent.rpc_sync(worker, "remora.autograd.num_contexts"));
  std::map<std::string, int64_t> p, r;
  for (const auto& e : process.toGenericDict()) p[e.key().toStringRef()] = e.value().toInt();
  for (const auto& e : rrefs.toGenericDict()) r[e.key().toStringRef()] = e.value().toInt();
  f.process = runtime::ProcessStats{p["pid"], p["threads"], p["fds"], p["rss_kb"]};
  f.rrefs = rpc::RRefStats{r["owners"], r["forks"], r["live_users"], r["pending_users"],
                      r["pending_children"], r["pending_messages"]};
  f.contexts = contexts.toInt();
  return f;
}

Figures MasterFigures(rpc::Agent& agent) {
  Figures f;
  f.process = runtime::ReadProcessStats();
  f.rrefs = agent.rref_stats();
  f.contexts = autograd::num_contexts(agent);
  return f;
}

std::string Tables(const rpc::RRefStats& s) {
  return absl::StrCat("owners=", s.owners, " forks=", s.forks, " live_users=", s.live_users,
                      " pending_users=", s.pending_users,
                      " pending_children=", s.pending_children,
                      " pending_messages=", s.pending_messages);
}

bool SameTables(const rpc::RRefStats& a, const rpc::RRefStats& b) { return Tables(a) == Tables(b); }

std::string Mib(double mib) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", mib);
  return buf;
}

std::string Line(const std::string& name, const std::string& when, const Figures& f) {
  return absl::StrCat(name, " ", when, ": rss_mib=", Mib(f.process.rss_kb / 1024.0),
                      " threads=", f.process.threads, " fds=", f.process.fds,
                      " contexts=", f.contexts, " ", Tables(f.rrefs));
}

// The flags' values checked; the worker names. An error says which.
absl::StatusOr<std::vector<std::string>> CheckConfig(Config& c) {
  const std::vector<std::string> names = launch::SplitList(c.workers);
  if (names.size() != 2 || names[0] == names[1]) {
    return absl::InvalidArgumentError("--workers wants two distinct names, as a,b");
  }
  RETURN_IF_ERROR(launch::CheckAtLeast({{"steps", c.steps, 1},
                                         {"micro-batches", c.micro_batches, 1},
                                         {"hidden", c.hidden, 1},
                                         {"connect-timeout", c.connect_timeout, 1},
                                         {"warmup", c.warmup, 0},
                                         {"progress", c.progress, 0}}));
  if (!(c.lr > 0)) return absl::InvalidArgumentError(absl::StrCat("--lr must be > 0; got ", c.lr));
  if (c.batch_size < c.micro_batches) {
    return absl::InvalidArgumentError(absl::StrCat("--batch-size ", c.batch_size, " is less than --micro-batches ",
                                                   c.micro_batches, ": each micro-batch needs a row"));
  }
  RETURN_IF_ERROR(launch::CheckAddress(c.listen, "--listen"));
  if (c.max_thread_growth < 0) {
    c.max_thread_growth = 16 + 2 * static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  return names;
}

// The master and the two workers: started here (`soak worker ...`), or
// with --external waited for at --listen.
absl::StatusOr<launch::LocalGroup> StartGroup(const Config& c, const std::vector<std::string>& names,
                                              const launch::SecurityFiles& files, const launch::Security& security,
                                              const rpc::Registry* registry) {
  rpc::AgentOptions options;
  options.name = "master";
  options.listen_address = c.listen;
  options.token = security.token;
  options.tls = security.tls;
  options.connect_timeout = absl::Seconds(c.connect_timeout);
  if (!c.external) {
    std::vector<std::string> worker_args = files.WorkerArgs();
    worker_args.insert(worker_args.end(), {"--threads", "1"});
    return launch::StartLocalGroup(names, registry, worker_args, options, examples::DemoWorkerProgram("soak"));
  }
  launch::LocalGroup group;
  options.is_master = true;
  options.workers = names;
  ASSIGN_OR_RETURN(group.master, rpc::Agent::Start(options, registry));
  autograd::Enable(*group.master);
  std::cout << "soak: master at " << group.master->self().address << " waiting for " << c.workers << std::endl;
  RETURN_IF_ERROR(group.master->Join());
  return group;
}

// The model: Linear(16, hidden) + ReLU on the first worker, Linear(hidden,
// 4) on the second, as a 1F1B pipeline.
absl::StatusOr<std::unique_ptr<pipeline::Pipeline>> MakePipeline(rpc::Agent& agent, const Config& c,
                                                                  const std::vector<std::string>& names) {
  pipeline::PipelineOptions o;
  o.stages = {pipeline::StageSpec::Registered("MLPStage", {int64_t{kIn}, int64_t{c.hidden}, int64_t{1}}),
              pipeline::StageSpec::Registered("MLPStage", {int64_t{c.hidden}, int64_t{kOut}, int64_t{2}, false})};
  o.workers = names;
  o.schedule = "1f1b";
  o.micro_batches = c.micro_batches;
  o.loss = pipeline::MseLoss();
  o.optimizer = optim::OptimizerOptions::SGD(c.lr).set_momentum(0.9);
  return pipeline::Pipeline::Create(agent, std::move(o));
}

// The data: a fixed regression problem, 8 batches cycled.
std::vector<std::pair<at::Tensor, at::Tensor>> MakeData(const Config& c) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor truth = at::randn({kIn, kOut}, gen, at::TensorOptions()) / 4.0;
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (int i = 0; i < 8; ++i) {
    at::Tensor x = at::randn({c.batch_size, kIn}, gen, at::TensorOptions());
    data.emplace_back(x, at::matmul(x, truth));
  }
  return data;
}

// Figures of every process once the RRef protocol's messages in flight
// (child accepts, deletes) have landed, which takes milliseconds: a step
// returns before its last control messages do, and a snapshot taken in
// between would differ from the other for no leak. Gives up waiting after
// 10 s and returns what it sees, so that stuck messages still show.
absl::Status Snapshot(rpc::Agent& agent, const std::vector<std::string>& names, std::map<std::string, Figures>* out) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (true) {
    (*out)["master"] = MasterFigures(agent);
    for (const auto& w : names) {
      ASSIGN_OR_RETURN((*out)[w], WorkerFigures(agent, w));
    }
    bool settled = true;
    for (const auto& [name, f] : *out) {
      settled &= f.rrefs.pending_users == 0 && f.rrefs.pending_children == 0 && f.rrefs.pending_messages == 0;
    }
    if (settled || absl::Now() > deadline) return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(10));
  }
}

// What the steps did: the first and last loss, the timed steps' seconds.
struct Trained {
  double first_loss = 0, last_loss = 0, seconds = 0;
  // The first ten steps' losses (the warm-up's first) and the last ten's
  // (a soak may run for days: not every step's), and the steps counted.
  std::vector<double> first;
  std::deque<double> last;
  size_t steps = 0;
  void Add(double loss) {
    if (first.size() < 10) first.push_back(loss);
    last.push_back(loss);
    if (last.size() > 10) last.pop_front();
    ++steps;
  }
};

// Steps below which the loss is not judged: with momentum it can rise
// before it falls, and one batch's loss differs from the next's.
constexpr size_t kJudgedSteps = 50;

// --warmup steps, the start figures, --steps timed steps (a progress line
// every --progress), the end figures.
absl::StatusOr<Trained> Train(pipeline::Pipeline& pipe, const Config& c, rpc::Agent& agent,
                              const std::vector<std::string>& names, std::map<std::string, Figures>* start,
                              std::map<std::string, Figures>* end) {
  const std::vector<std::pair<at::Tensor, at::Tensor>> data = MakeData(c);
  auto step = [&](int i) -> absl::StatusOr<double> {
    const auto& [x, y] = data[i % data.size()];
    return pipe.start_train_step(x, y).wait();
  };
  Trained t;
  for (int i = 0; i < c.warmup; ++i) {
    ASSIGN_OR_RETURN(double loss, step(i));
    if (i == 0) t.first_loss = loss;
    t.Add(loss);
  }
  RETURN_IF_ERROR(Snapshot(agent, names, start));
  for (const auto& [name, f] : *start) std::printf("%s\n", Line(name, "start", f).c_str());
  std::fflush(stdout);
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < c.steps; ++i) {
    absl::StatusOr<double> loss = step(c.warmup + i);
    if (!loss.ok()) return base::Annotate(loss.status(), absl::StrCat("step ", c.warmup + i + 1));
    if (c.warmup == 0 && i == 0) t.first_loss = *loss;
    t.last_loss = *loss;
    t.Add(*loss);
    if (c.progress > 0 && (i + 1) % c.progress == 0) {
      std::printf("step %d/%d loss=%.5f elapsed_s=%.1f master_rss_mib=%.1f\n", i + 1, c.steps, *loss,
                  absl::ToDoubleSeconds(absl::Now() - t0), runtime::ReadProcessStats().rss_kb / 1024.0);
      std::fflush(stdout);
    }
  }
  t.seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  RETURN_IF_ERROR(Snapshot(agent, names, end));
  for (const auto& [name, f] : *end) std::printf("%s\n", Line(name, "end", f).c_str());
  return t;
}

// Prints each process's growth; returns what grew past its bound (and a
// loss that did not go down).
std::vector<std::string> Problems(const Config& c, const std::map<std::string, Figures>& start,
                                  const std::map<std::string, Figures>& end, const Trained& t) {
  std::vector<std::string> problems;
  for (const auto& [name, s] : start) {
    const Figures& e = end.at(name);
    const double rss_growth = (e.process.rss_kb - s.process.rss_kb) / 1024.0;
    std::printf("%s growth: rss_mib=%+.1f threads=%+lld fds=%+lld contexts=%+lld\n", name.c_str(), rss_growth,
                static_cast<long long>(e.process.threads - s.process.threads),
                static_cast<long long>(e.process.fds - s.process.fds), static_cast<long long>(e.contexts - s.contexts));
    if (!SameTables(s.rrefs, e.rrefs)) {
      problems.push_back(absl::StrCat(name, ": RRef tables changed from ", Tables(s.rrefs), " to ", Tables(e.rrefs)));
    }
    if (e.contexts != s.contexts) {
      problems.push_back(absl::StrCat(name, ": autograd contexts ", s.contexts, " -> ", e.contexts));
    }
    if (rss_growth > c.max_rss_growth_mib) {
      problems.push_back(absl::StrCat(name, ": resident memory grew by ", Mib(rss_growth), " MiB (bound ",
                                      c.max_rss_growth_mib, ", --max-rss-growth-mib)"));
    }
    if (e.process.threads - s.process.threads > c.max_thread_growth) {
      problems.push_back(absl::StrCat(name, ": threads ", s.process.threads, " -> ", e.process.threads,
                                      " (bound +", c.max_thread_growth, ", --max-thread-growth)"));
    }
    if (e.process.fds - s.process.fds > c.max_fd_growth) {
      problems.push_back(absl::StrCat(name, ": file descriptors ", s.process.fds, " -> ", e.process.fds,
                                      " (bound +", c.max_fd_growth, ", --max-fd-growth)"));
    }
  }
  // The mean of the first ten steps' losses against the last ten's.
  if (t.steps < kJudgedSteps) {
    std::printf("loss not judged: %zu steps, fewer than %zu\n", t.steps, kJudgedSteps);
  } else {
    const auto mean = [](const auto& v) { return std::accumulate(v.begin(), v.end(), 0.0) / v.size(); };
    const double first = mean(t.first), last = mean(t.last);
    if (!(last < first)) {
      problems.push_back(absl::StrCat("the loss did not go down (mean of the first 10 steps ", first,
                                      ", of the last 10 ", last, "): training is broken"));
    }
  }
  return problems;
}

int Main(int argc, char** argv) {
  Config c;
  launch::FlagParser flags(
      "soak",
      "Trains a small two-stage MLP through the pipeline with the DistributedOptimizer for\n"
      "--steps steps and compares resources at the start (after --warmup steps) and the end:\n"
      "RRef tables, autograd contexts, threads, file descriptors, resident memory of the\n"
      "master and every worker. Exits 1 when any of them grew past its bound.");
  flags.StartsItsOwnGroup();
  flags.AddInt("steps", &c.steps, "training steps after the warm-up");
  flags.AddInt("warmup", &c.warmup, "steps before the start figures are taken");
  flags.AddInt("micro-batches", &c.micro_batches, "micro-batches per step");
  flags.AddInt("batch-size", &c.batch_size, "samples per step");
  flags.AddInt("hidden", &c.hidden, "width of the hidden layer");
  flags.AddDouble("lr", &c.lr, "SGD learning rate (momentum 0.9)");
  flags.AddInt("progress", &c.progress, "print a progress line every this many steps (0: never)");
  flags.AddDouble("max-rss-growth-mib", &c.max_rss_growth_mib,
                  "largest resident memory growth allowed per process, MiB");
  flags.AddInt("max-thread-growth", &c.max_thread_growth,
               "largest thread count growth allowed (-1: 16 + 2 per core of this machine; gRPC's "
               "executor adds threads under load, up to twice the cores)");
  flags.AddInt("max-fd-growth", &c.max_fd_growth, "largest file descriptor growth allowed");
  flags.AddString("workers", &c.workers,
                  "two distinct worker names; stage 0 runs on the first, stage 1 on the second");
  flags.AddBool("external", &c.external,
                "do not start the workers: wait for them to register at --listen");
  flags.AddString("listen", &c.listen, "HOST:PORT of this master (port 0: a free one)");
  flags.AddInt("connect-timeout", &c.connect_timeout, "seconds to wait for the workers");
  launch::SecurityFiles security_files;
  flags.AddSecurityFlags(&security_files);
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  auto fail = [](const absl::Status& s) {
    std::cerr << "soak: " << s.message() << "\n";
    return 2;
  };
  auto security = launch::LoadSecurity(security_files);
  if (!security.ok()) return fail(security.status());
  auto names = CheckConfig(c);
  if (!names.ok()) return fail(names.status());
  runtime::TuneAllocator();
  runtime::SetComputeThreads(1);

  rpc::Registry registry;
  if (auto s = examples::RegisterDemoWorker(registry); !s.ok()) return fail(s);
  auto group = StartGroup(c, *names, security_files, *security, &registry);
  if (!group.ok()) {  // (not a bad flag: the workers did not come, or could not start)
    std::cerr << "soak: " << group.status().message() << "\n";
    return 1;
  }
  rpc::Agent& agent = *group->master;
  auto die = [&](const absl::Status& s) {
    std::cerr << "soak: " << s.message() << "\n";
    agent.Shutdown(/*graceful=*/false).IgnoreError();
    return 1;
  };
  auto pipe = MakePipeline(agent, c, *names);
  if (!pipe.ok()) return die(pipe.status());
  std::printf("soak: %d warm-up + %d steps, %d micro-batches of %d samples, MLP %d-%d-%d on %s\n", c.warmup,
              c.steps, c.micro_batches, c.batch_size / c.micro_batches, kIn, c.hidden, kOut, c.workers.c_str());
  std::map<std::string, Figures> start, end;
  auto trained = Train(**pipe, c, agent, *names, &start, &end);
  if (!trained.ok()) return die(trained.status());
  std::printf("steps=%d seconds=%.1f steps_per_second=%.1f first_loss=%.5f last_loss=%.5f\n", c.steps,
              trained->seconds, c.steps / trained->seconds, trained->first_loss, trained->last_loss);
  std::vector<std::string> problems = Problems(c, start, end, *trained);
  pipe->reset();  // frees the stages and the optimizer on the workers
  absl::Status down = group->Shutdown();
  if (!down.ok()) problems.push_back(absl::StrCat("shutdown: ", down.message()));
  if (!problems.empty()) {
    std::printf("soak: FAILED\n  %s\n", absl::StrJoin(problems, "\n  ").c_str());
    return 1;
  }
  std::printf("soak: OK (no table or context growth; threads, descriptors and memory in bounds)\n");
  return 0;
}

}  // namespace
}  // namespace remora

int main(int argc, char** argv) {
  if (remora::examples::IsDemoWorker(argc, argv)) {
    remora::launch::ExitProgram(remora::examples::DemoWorkerMain(argc, argv, "soak"));
  }
  return remora::Main(argc, argv);
}
