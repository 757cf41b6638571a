// make_fuzz_corpus: writes the seed corpus of request_fuzzer, one valid
// frame per file, covering every request kind, every value kind and the
// response forms. The checked-in tests/fuzz/corpus is this program's output
// (fuzz_corpus_test checks that it still is, and that every seed decodes).
//
//   build/bin/make_fuzz_corpus --out tests/fuzz/corpus
#include <sys/stat.h>

#include <fstream>
#include <iostream>
#include <limits>
#include <map>

#include <ATen/ops/arange.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <grpcpp/support/byte_buffer.h>

#include "launch/cli.h"
#include "base/ids.h"
#include "rpc/message.h"
#include "tests/support/wire_values.h"
#include "tests/fuzz/request_decoder.h"

namespace remora::fuzz {
namespace {

// Builds values, appending tensors to the message's payloads.
// Thread-compatible; the message must outlive it.
class Builder : public WireValues {
 public:
  explicit Builder(rpc::OutMessage* m) : m_(m) {}

  wire::Value Tensor(const at::Tensor& t, bool requires_grad = false) {
    wire::Value v;
    auto* meta = v.mutable_tensor();
    meta->set_dtype(static_cast<int32_t>(t.scalar_type()));
    for (int64_t s : t.sizes()) meta->add_sizes(s);
    meta->set_payload(static_cast<uint32_t>(m_->payloads.size()));
    meta->set_requires_grad(requires_grad);
    m_->payloads.push_back(t.contiguous());
    return v;
  }
 private:
  rpc::OutMessage* m_;
};

rpc::OutMessage Request(uint32_t from = 0) {
  rpc::OutMessage m;
  m.header.mutable_request()->set_from(from);
  return m;
}

std::map<std::string, rpc::OutMessage> Seeds() {
  using B = Builder;
  std::map<std::string, rpc::OutMessage> seeds;
  {
    rpc::OutMessage m = Request();
    wire::CallRequest call_body;
    auto* call = &call_body;
    call->set_function("echo");
    *call->add_args() = B::Int(std::numeric_limits<int64_t>::min());
    *call->add_args() = B::Double(-0.5);
    *call->add_args() = B::Bool(true);
    *call->add_args() = B::Str(std::string("a\0b", 3));
    wire::Value none, complex, device;
    none.set_none(true);
    complex.mutable_c()->set_real(1.5);
    complex.mutable_c()->set_imag(-2);
    device.set_device("cpu");
    *call->add_args() = none;
    *call->add_args() = complex;
    *call->add_args() = device;
    B::SetBody(m.header.mutable_request(), call_body);
    seeds["call_scalars"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request();
    B b(&m);
    wire::CallRequest call_body;
    auto* call = &call_body;
    call->set_function("add");
    *call->add_args() = b.Tensor(at::arange(6, at::kFloat).reshape({2, 3}));
    *call->add_args() = b.Tensor(at::ones({}, at::kLong));
    *call->add_args() = b.Tensor(at::zeros({0, 4}, at::kDouble));
    *call->add_args() = b.Tensor(at::ones({3}, at::kBool));
    *call->add_args() = b.Tensor(at::ones({2, 2}, at::kBFloat16));
    *call->add_args() = b.Tensor(at::ones({2}, at::kComplexFloat));
    *call->add_args() = b.Tensor(at::ones({5}, at::kChar));
    *call->add_args() = b.Tensor(at::ones({300}, at::kHalf));  // a payload of its own
    *call->add_args() = B::Undefined();
    B::SetBody(m.header.mutable_request(), call_body);
    seeds["call_tensors"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request();
    B b(&m);
    wire::CallRequest call_body;
    auto* call = &call_body;
    call->set_function("remora.autograd.propagate");
    *call->add_args() = B::Int(1);
    *call->add_args() = B::Int(2);
    *call->add_args() = B::List(wire::ELEM_TENSOR, {b.Tensor(at::ones({2}), true)});
    m.header.mutable_request()->mutable_autograd()->set_context_id(1);
    m.header.mutable_request()->mutable_autograd()->set_message_id((int64_t{2} << 48) | 3);
    B::SetBody(m.header.mutable_request(), call_body);
    seeds["call_autograd"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request();
    B b(&m);
    wire::CallRequest call_body;
    auto* call = &call_body;
    call->set_function("echo");
    *call->add_args() = B::List(wire::ELEM_INT, {B::Int(1), B::Int(-2)});
    *call->add_args() = B::List(wire::ELEM_DOUBLE, {B::Double(1.25)});
    *call->add_args() = B::List(wire::ELEM_BOOL, {B::Bool(false), B::Bool(true)});
    *call->add_args() = B::List(wire::ELEM_STRING, {B::Str("x"), B::Str("")});
    *call->add_args() = B::List(wire::ELEM_TENSOR, {b.Tensor(at::ones({1}))});
    *call->add_args() = B::List(wire::ELEM_ANY, {B::Int(1), B::Str("two"), B::List(wire::ELEM_ANY, {})});
    *call->add_args() =
        B::List(wire::ELEM_ANY, {B::Int(1), B::List(wire::ELEM_ANY, {B::Bool(true)}, true)}, true);
    *call->add_args() = B::Dict(wire::ELEM_STRING, wire::ELEM_TENSOR,
                                {{B::Str("w"), b.Tensor(at::ones({2, 2}))}});
    *call->add_args() = B::Dict(wire::ELEM_INT, wire::ELEM_DOUBLE, {{B::Int(3), B::Double(0.5)}});
    *call->add_args() = B::Dict(wire::ELEM_ANY, wire::ELEM_ANY,
                                {{B::Bool(true), B::Str("yes")}, {B::Double(2.5), B::Int(1)}});
    B::SetBody(m.header.mutable_request(), call_body);
    seeds["call_containers"] = std::move(m);
  }
  {
    // A method call through a user RRef, with RRef arguments: one the owner
    // sent (confirmed at once), one forwarded by a third worker (pending).
    rpc::OutMessage m = Request(2);
    wire::CallRequest call_body;
    auto* call = &call_body;
    call->set_function("forward");
    *call->add_args() = B::RRefValue(2, B::Guid(2, 10), B::Guid(2, 11), 2);
    *call->add_args() = B::RRefValue(3, B::Guid(0, 20), B::Guid(2, 21), 2);
    *call->mutable_self() = B::RRefValue(kSelf, B::Guid(0, 30), B::Guid(2, 31), 2);
    *call->mutable_caller_fork() = B::Guid(2, 31);
    call->set_seq(1);
    B::SetBody(m.header.mutable_request(), call_body);
    seeds["call_method_with_rrefs"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request(0);
    B b(&m);
    wire::CallRequest call_body;
    auto* call = &call_body;
    call->set_function("MLPStage");
    *call->add_args() = B::Int(4);
    *call->add_args() = B::Int(3);
    *call->mutable_result_rref() = B::Guid(0, 40);
    *call->mutable_result_fork() = B::Guid(0, 40);
    B::SetBody(m.header.mutable_request(), call_body);
    seeds["call_remote"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request(0);
    B::SetBody(m.header.mutable_request(), B::Fetch(B::Guid(0, 40), B::Guid(0, 40)));
    m.header.mutable_request()->mutable_autograd()->set_context_id(7);
    seeds["fetch"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request(2);
    B::SetBody(m.header.mutable_request(), B::Fork(B::Guid(0, 40), B::Guid(3, 41)));
    seeds["fork"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request(3);
    wire::ChildAccept accept;
    *accept.mutable_fork_id() = B::Guid(1, 42);
    B::SetBody(m.header.mutable_request(), accept);
    seeds["child_accept"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request(3);
    B::SetBody(m.header.mutable_request(), B::Delete(B::Guid(0, 40), B::Guid(3, 41)));
    seeds["user_delete"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request(remora::base::kUnknownWorker);
    wire::JoinRequest join;
    join.set_name("worker1");
    join.set_address("127.0.0.1:40001");
    join.set_host_id("host/boot");
    B::SetBody(m.header.mutable_request(), join);
    seeds["join"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request(0);
    wire::ShutdownProbe probe;
    probe.set_release_users(true);
    B::SetBody(m.header.mutable_request(), probe);
    seeds["probe"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request(0);
    B::SetBody(m.header.mutable_request(), wire::ShutdownFinish());
    seeds["finish"] = std::move(m);
  }
  {
    rpc::OutMessage m = Request(2);
    B::SetBody(m.header.mutable_request(), wire::Ping());
    seeds["ping"] = std::move(m);
  }
  {
    rpc::OutMessage m;
    B b(&m);
    *m.header.mutable_response()->mutable_value() =
        B::List(wire::ELEM_ANY, {b.Tensor(at::ones({3, 2}), true),
                                 B::RRefValue(2, B::Guid(2, 50), B::Guid(2, 51), 2)}, true);
    m.header.mutable_response()->mutable_autograd()->set_context_id(1);
    m.header.mutable_response()->mutable_autograd()->set_message_id((int64_t{2} << 48) | 9);
    seeds["response_value"] = std::move(m);
  }
  {
    rpc::OutMessage m;
    auto* e = m.header.mutable_response()->mutable_error();
    e->set_code(5);
    e->set_message("no function or module named 'x'");
    e->set_worker("worker2");
    seeds["response_error"] = std::move(m);
  }
  {
    rpc::OutMessage m;
    auto* r = m.header.mutable_response();
    for (int i = 0; i < 3; ++i) {
      auto* w = r->add_workers();
      w->set_id(i);
      w->set_name(i == 0 ? "master" : absl::StrCat("worker", i));
      w->set_address(absl::StrCat("127.0.0.1:4000", i));
      w->set_host_id("host/boot");
    }
    r->set_your_id(1);
    seeds["response_address_book"] = std::move(m);
  }
  {
    rpc::OutMessage m;
    m.header.mutable_response()->set_active(3);
    seeds["response_probe"] = std::move(m);
  }
  return seeds;
}

std::string FrameBytes(rpc::OutMessage m) {
  grpc::ByteBuffer buffer = rpc::SerializeMessage(std::move(m));
  std::vector<grpc::Slice> slices;
  std::string out;
  if (buffer.Dump(&slices).ok()) {
    for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return out;
}

int Main(int argc, char** argv) {
  std::string out_dir;
  launch::FlagParser flags("make_fuzz_corpus",
                        "Writes request_fuzzer's seed corpus: one valid frame per file.");
  flags.AddString("out", &out_dir, "directory to write the seeds to (created; required)");
  int code = 0;
  if (!flags.Parse(argc, argv, &code)) return code;
  if (out_dir.empty()) {
    std::cerr << "make_fuzz_corpus: --out is required\n";
    return 2;
  }
  mkdir(out_dir.c_str(), 0755);
  for (auto& [name, message] : Seeds()) {
    const std::string bytes = FrameBytes(std::move(message));
    if (absl::Status s = DecodeRequestBytes(bytes); !s.ok()) {
      std::cerr << "make_fuzz_corpus: seed " << name << " does not decode: " << s << "\n";
      return 1;
    }
    const std::string path = out_dir + "/" + name;
    std::ofstream out(path, std::ios::binary);
    out << bytes;
    if (!out.good()) {
      std::cerr << "make_fuzz_corpus: cannot write " << path << "\n";
      return 1;
    }
    std::cout << path << " (" << bytes.size() << " bytes)\n";
  }
  return 0;
}

}  // namespace
}  // namespace remora::fuzz

int main(int argc, char** argv) { return remora::fuzz::Main(argc, argv); }
