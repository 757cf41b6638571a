#include "examples/demo_functions.h"

#include <stdexcept>

#include <ATen/TensorOperators.h>
#include <ATen/core/Dict.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>

#include "absl/strings/str_cat.h"
#include "base/status_util.h"
#include "examples/stock_worker.h"
#include "launch/worker_main.h"
#include "rpc/agent.h"
#include "rpc/call.h"
#include "rpc/rref_args.h"
#include "runtime/process_stats.h"

namespace remora::examples {
namespace {

c10::IValue Value(absl::StatusOr<c10::IValue> v) {
  if (!v.ok()) throw std::runtime_error(std::string(v.status().message()));
  return std::move(*v);
}

struct Scale {
  double factor;
};

struct Affine {
  at::Tensor weight;  // [out, in]
  at::Tensor bias;    // [out]
};

}  // namespace

namespace {
// The modules Scale and Affine.
absl::Status RegisterModules(rpc::Registry& r);

// The demo functions' arguments (rpc/call.h): what rpc_demo and the tests
// pass as plain lists, as PyTorch's examples pass args=(...).
struct TwoValues {  // add(a, b), rref_add(a, b): numbers, tensors or RRefs to tensors
  static constexpr char kFunction[] = "(a, b)";
  c10::IValue a;
  c10::IValue b;
  template <typename Fields>
  void Visit(Fields& f) {
    f("a", a)("b", b);
  }
};
struct OneValue {  // echo, device_of, to_here, make_rref, a module's forward
  static constexpr char kFunction[] = "(x)";
  c10::IValue x;
  template <typename Fields>
  void Visit(Fields& f) {
    f("x", x);
  }
};
struct SinkArgs {
  static constexpr char kFunction[] = "sink";
  at::Tensor x;
  template <typename Fields>
  void Visit(Fields& f) {
    f("x", x);
  }
};
struct ScaleArgs {
  static constexpr char kFunction[] = "Scale";
  double factor = 1.0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("factor", factor, rpc::kMayBeLeftOff);
  }
};
struct AffineArgs {
  static constexpr char kFunction[] = "Affine";
  int64_t in = 0;
  int64_t out = 0;
  int64_t seed = 0;
  template <typename Fields>
  void Visit(Fields& f) {
    f("in", in)("out", out)("seed", seed, rpc::kMayBeLeftOff);
  }
};

c10::IValue OneOf(const rpc::Args& a) { return rpc::DecodeCallOrThrow<OneValue>(a).x; }
}  // namespace

absl::Status RegisterDemoFunctions(rpc::Registry& r) {
  RETURN_IF_ERROR(r.RegisterFunction("add", [](rpc::CallContext&, const rpc::Args& args) -> c10::IValue {
    const auto [a, b] = rpc::DecodeCallOrThrow<TwoValues>(args);
    if (a.isTensor() || b.isTensor()) return rpc::TensorOrFetch(a) + rpc::TensorOrFetch(b);
    if (a.isInt() && b.isInt()) return a.toInt() + b.toInt();
    if (!(a.isInt() || a.isDouble()) || !(b.isInt() || b.isDouble())) {
      throw std::invalid_argument(absl::StrCat("add: adds numbers or tensors, not a ", a.tagKind(), " and a ",
                                               b.tagKind()));
    }
    return a.toScalar().toDouble() + b.toScalar().toDouble();
  }));
  RETURN_IF_ERROR(
      r.RegisterFunction("echo", [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue { return OneOf(a); }));
  RETURN_IF_ERROR(r.RegisterFunction("sink", [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
    return at::full({1}, static_cast<double>(rpc::DecodeCallOrThrow<SinkArgs>(a).x.numel()));
  }));
  RETURN_IF_ERROR(r.RegisterFunction("device_of", [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
    return rpc::TensorOrFetch(OneOf(a)).device().str();
  }));
  RETURN_IF_ERROR(r.RegisterFunction("rref_stats", [](rpc::CallContext& ctx, const rpc::Args&) -> c10::IValue {
    rpc::RRefStats s = ctx.agent->rref_stats();
    c10::Dict<std::string, int64_t> d;
    d.insert("owners", s.owners);
    d.insert("forks", s.forks);
    d.insert("live_users", s.live_users);
    d.insert("pending_users", s.pending_users);
    d.insert("pending_children", s.pending_children);
    d.insert("pending_messages", s.pending_messages);
    return d;
  }));
  RETURN_IF_ERROR(r.RegisterFunction("process_stats", [](rpc::CallContext&, const rpc::Args&) -> c10::IValue {
    const runtime::ProcessStats s = runtime::ReadProcessStats();
    c10::Dict<std::string, int64_t> d;
    d.insert("pid", s.pid);
    d.insert("threads", s.threads);
    d.insert("fds", s.fds);
    d.insert("rss_kb", s.rss_kb);
    return d;
  }));
  RETURN_IF_ERROR(r.RegisterFunction("to_here", [](rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
    auto rref = rpc::RRef::FromIValue(OneOf(a));
    if (!rref.ok()) throw std::invalid_argument(std::string(rref.status().message()));
    return Value(rref->to_here());
  }));
  RETURN_IF_ERROR(r.RegisterFunction("make_rref", [](rpc::CallContext& ctx, const rpc::Args& a) -> c10::IValue {
    return ctx.agent->local_rref(OneOf(a)).ToIValue();
  }));
  RETURN_IF_ERROR(r.RegisterFunction("rref_add", [](rpc::CallContext&, const rpc::Args& args) -> c10::IValue {
    const auto [a, b] = rpc::DecodeCallOrThrow<TwoValues>(args);
    return rpc::TensorOrFetch(a) + rpc::TensorOrFetch(b);
  }));

  return RegisterModules(r);
}

namespace {
absl::Status RegisterModules(rpc::Registry& r) {
  RETURN_IF_ERROR(r.RegisterModule<Scale>(
      "Scale",
      [](rpc::CallContext&, const rpc::Args& a) {
        return std::make_shared<Scale>(Scale{rpc::DecodeCallOrThrow<ScaleArgs>(a).factor});
      },
      {{"forward",
        [](Scale& s, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
          return rpc::TensorOrFetch(OneOf(a)) * s.factor;
        }},
       {"factor", [](Scale& s, rpc::CallContext&, const rpc::Args&) -> c10::IValue { return s.factor; }}}));

  RETURN_IF_ERROR(r.RegisterModule<Affine>(
      "Affine",
      [](rpc::CallContext&, const rpc::Args& a) {
        const auto r = rpc::DecodeCallOrThrow<AffineArgs>(a);
        const int64_t in = r.in, out = r.out;
        if (in <= 0 || out <= 0) throw std::invalid_argument("Affine: sizes must be positive");
        auto gen = at::make_generator<at::CPUGeneratorImpl>(r.seed);
        auto m = std::make_shared<Affine>();
        m->weight = at::randn({out, in}, gen, at::TensorOptions()) / std::sqrt(double(in));
        m->bias = at::zeros({out});
        return m;
      },
      {{"forward",
        [](Affine& m, rpc::CallContext&, const rpc::Args& a) -> c10::IValue {
          return at::matmul(rpc::TensorOrFetch(OneOf(a)), m.weight.t()) + m.bias;
        }},
       {"weight", [](Affine& m, rpc::CallContext&, const rpc::Args&) -> c10::IValue { return m.weight; }}}));
  return absl::OkStatus();
}
}  // namespace

absl::Status RegisterDemoWorker(rpc::Registry& registry) {
  RETURN_IF_ERROR(RegisterStockWorker(registry));
  return RegisterDemoFunctions(registry);
}

bool IsDemoWorker(int argc, char** argv) { return argc > 1 && std::string(argv[1]) == "worker"; }

int DemoWorkerMain(int argc, char** argv, const std::string& program) {
  return launch::WorkerMain(argc - 1, argv + 1, program + " worker", RegisterDemoWorker);
}

launch::WorkerProgram DemoWorkerProgram(const std::string& program) {
  return launch::WorkerProgram(program, {"worker"});
}

}  // namespace remora::examples
