// The worker side of checkpoints (remora.checkpoint.save_owner_file,
// owner_file_written, load_owner_file, remove) and the files they write: atomic writes, CRC-32, the owner file's
// encoding (torch.save's format: a dict of lists of tensors).
#include "checkpoint/owner_file.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <sstream>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Dict.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/core/List.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "base/mutex_lock.h"
#include "base/status_util.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/protocol.h"
#include "optim/protocol.h"
#include "pipeline/protocol.h"

namespace remora::checkpoint {
namespace {

absl::Status ErrnoError(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

absl::Status FsyncPath(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags);
  if (fd < 0) return ErrnoError("cannot open", path);
  const int rc = ::fsync(fd);
  ::close(fd);
  return rc == 0 ? absl::OkStatus() : ErrnoError("cannot fsync", path);
}

// The local object behind an owner RRef argument, for a method call.
c10::IValue LocalObject(const c10::IValue& v, const char* what) {
  auto rref = rpc::RRef::FromIValue(v);
  if (!rref.ok() || !rref->is_owner()) {
    throw std::invalid_argument(absl::StrCat("checkpoint: the ", what, " RRef is not owned here"));
  }
  auto value = rref->local_value();
  if (!value.ok()) throw std::invalid_argument(std::string(value.status().message()));
  return *value;
}

c10::IValue Call(rpc::CallContext& ctx, const c10::IValue& object, const std::string& method,
                 std::vector<c10::IValue> args = {}) {
  auto out = ctx.agent->registry().InvokeMethod(object, method, ctx, rpc::Args(std::move(args)));
  if (!out.ok()) throw std::runtime_error(std::string(out.status().message()));
  return *out;
}

// An owner file as written: its size and CRC-32.
using Written = absl::StatusOr<std::pair<int64_t, std::string>>;

// Encodes `owned` and writes it atomically to `path`.
Written WriteOwnerFile(const std::string& path, const OwnerFile& owned) {
  const std::string bytes = EncodeOwnerFile(owned);
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  RETURN_IF_ERROR(WriteFileAtomically(path, bytes));
  return std::make_pair(static_cast<int64_t>(bytes.size()), Crc32(bytes));
}

// This process's owner files being written in the background, by path: started
// by save_owner_file, waited for (and forgotten) by owner_file_written.
struct BackgroundWrites {
  absl::Mutex mu;
  std::map<std::string, std::shared_future<Written>> by_path ABSL_GUARDED_BY(mu);
};
BackgroundWrites& Background() {
  static auto* writes = new BackgroundWrites;  // never destroyed: writers may outlive main
  return *writes;
}

// SaveOwnerFileRequest.
c10::IValue SaveOwnerFileFn(rpc::CallContext& ctx, const rpc::Args& a) {
  const auto r = rpc::DecodeCallOrThrow<SaveOwnerFileRequest>(a);
  const std::string& path = r.path;
  OwnerFile owned;
  owned.stages = r.stages;
  for (size_t i = 0; i < r.stage_rrefs.size(); ++i) {
    const c10::IValue object = LocalObject(r.stage_rrefs[i], "stage");
    std::vector<at::Tensor> tensors = Call(ctx, object, "state").toTensorVector();
    std::vector<std::string> names;
    const c10::IValue listed = Call(ctx, object, "state_names");
    for (const c10::IValue& n : listed.toListRef()) names.push_back(n.toStringRef());
    if (i < r.stages.size() && r.stages[i] == r.omit_stage) {
      // (Stored with another stage: a tied weight's last copy.)
      const auto it = std::find(names.begin(), names.end(), r.omit_name);
      const auto at = static_cast<size_t>(it - names.begin());
      if (it != names.end() && at < tensors.size()) {
        tensors.erase(tensors.begin() + static_cast<std::ptrdiff_t>(at));
        names.erase(it);
      }
    }
    owned.tensors.push_back(std::move(tensors));
    owned.names.push_back(std::move(names));
  }
  if (!r.optimizer.isNone()) owned.optimizer = Call(ctx, LocalObject(r.optimizer, "optimizer"), "save_state");
  owned.rng = CpuGeneratorState();
  owned.cuda_rng = CudaGeneratorStates();
  if (r.background) {
    // The state above is copies (StateTensors, the optimizer's state dict):
    // training may go on while they are written.
    std::shared_future<Written> write =
        std::async(std::launch::async, [path, owned = std::move(owned)] { return WriteOwnerFile(path, owned); }).share();
    BackgroundWrites& writes = Background();
    base::MutexLock lock(writes.mu);
    writes.by_path[path] = std::move(write);
    return rpc::EncodeTuple(OwnerFileWrittenReply{-1, ""});
  }
  const Written written = WriteOwnerFile(path, owned);
  if (!written.ok()) throw std::runtime_error(std::string(written.status().message()));
  return rpc::EncodeTuple(OwnerFileWrittenReply{written->first, written->second});
}

// OwnerFileWrittenRequest.
c10::IValue OwnerFileWrittenFn(rpc::CallContext&, const rpc::Args& a) {
  const std::string path = rpc::DecodeCallOrThrow<OwnerFileWrittenRequest>(a).path;
  BackgroundWrites& writes = Background();
  std::shared_future<Written> write;
  {
    base::MutexLock lock(writes.mu);
    auto it = writes.by_path.find(path);
    if (it == writes.by_path.end()) {
      throw std::invalid_argument(absl::StrCat("checkpoint: no owner file is being written to ", path, " here"));
    }
    write = it->second;
  }
  const Written written = write.get();
  {
    base::MutexLock lock(writes.mu);
    writes.by_path.erase(path);
  }
  if (!written.ok()) throw std::runtime_error(std::string(written.status().message()));
  return rpc::EncodeTuple(OwnerFileWrittenReply{written->first, written->second});
}

// LoadOwnerFileRequest.
c10::IValue LoadOwnerFileFn(rpc::CallContext& ctx, const rpc::Args& a) {
  const auto r = rpc::DecodeCallOrThrow<LoadOwnerFileRequest>(a);
  const std::string& path = r.path;
  auto owned = ReadOwnerFile(path, r.bytes, r.crc32);
  if (!owned.ok()) throw std::runtime_error(std::string(owned.status().message()));
  if (owned->stages != r.stages) {
    throw std::invalid_argument(absl::StrCat(path, " holds stages ", c10::str(owned->stages), ", not ",
                                             c10::str(r.stages)));
  }
  const std::vector<c10::IValue>& stages = r.stage_rrefs;
  if (stages.size() != owned->tensors.size()) {
    throw std::invalid_argument(absl::StrCat(path, " holds ", owned->tensors.size(), " stages' state, not ",
                                             stages.size()));
  }
  for (size_t i = 0; i < stages.size(); ++i) {
    pipeline::LoadStateRequest load;
    load.tensors = owned->tensors[i];
    if (!owned->names.empty()) load.names = owned->names[i];
    if (r.stages[i] == r.omitted_stage) load.missing = r.omitted_name;
    Call(ctx, LocalObject(stages[i], "stage"), pipeline::LoadStateRequest::kMethod, rpc::EncodeCall(load));
  }
  if (!r.optimizer.isNone()) {
    if (owned->optimizer.isNone()) {
      throw std::invalid_argument(absl::StrCat(path, " holds no optimizer state"));
    }
    // (A local optimizer's, or a ZeRO-1 gradient group's: the same call.)
    Call(ctx, LocalObject(r.optimizer, "optimizer"), optim::LoadStateRequest::kMethod,
         rpc::EncodeCall(optim::LoadStateRequest{owned->optimizer}));
  }
  SetCpuGeneratorState(owned->rng);
  SetCudaGeneratorStates(owned->cuda_rng);
  return c10::IValue();
}

// RemoveRequest.
c10::IValue RemoveFn(rpc::CallContext&, const rpc::Args& a) {
  RemoveCheckpointFiles(rpc::DecodeCallOrThrow<RemoveRequest>(a).dir, /*all=*/false);
  return c10::IValue();
}

// `v` with every list and dict made generic (elements of type Any), nested
// ones too, so that LibTorch's pickler writes them as plain Python lists and
// dicts rather than through torch.jit._pickle's build_intlist and friends.
c10::IValue Untyped(const c10::IValue& v) {
  if (v.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const c10::IValue& e : v.toListRef()) out.push_back(Untyped(e));
    return out;
  }
  if (v.isGenericDict()) {
    c10::impl::GenericDict out(c10::AnyType::get(), c10::AnyType::get());
    for (const auto& e : v.toGenericDict()) out.insert(Untyped(e.key()), Untyped(e.value()));
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const c10::IValue& e : v.toTupleRef().elements()) elements.push_back(Untyped(e));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  return v;
}

// torch.save's zip format, as torch::jit::pickle_save writes it, but without
// the type tags (torch.jit._pickle.restore_type_tag) LibTorch puts on every
// list and dict: PyTorch 2.6 and later load with weights_only=True by default
// and refuse those globals, so a tagged owner file would need
// torch.load(..., weights_only=False). Untagged, the archive names only what a
// weights-only load allows (tensor rebuilds, storages, OrderedDict).
std::string SaveForTorchLoad(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler([&](const char* bytes, size_t n) { pickled.insert(pickled.end(), bytes, bytes + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
                              /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
                              /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(Untyped(value));
  pickler.stop();
  std::string out;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t n) -> size_t {
      out.append(static_cast<const char*>(bytes), n);
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
    writer.writeEndOfFile();
  }
  return out;
}

// The elements of a list that was saved typed (List[int], List[Tensor]) or
// untyped (as SaveForTorchLoad writes it).
std::vector<int64_t> IntsOf(const c10::IValue& list) {
  std::vector<int64_t> out;
  for (const c10::IValue& e : list.toListRef()) out.push_back(e.toInt());
  return out;
}

std::vector<at::Tensor> TensorsOf(const c10::IValue& list) {
  std::vector<at::Tensor> out;
  for (const c10::IValue& e : list.toListRef()) out.push_back(e.toTensor());
  return out;
}

}  // namespace

at::Tensor CpuGeneratorState() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void SetCpuGeneratorState(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

std::vector<at::Tensor> CudaGeneratorStates() {
  std::vector<at::Tensor> states;
  const int n = static_cast<int>(at::detail::getCUDAHooks().getNumGPUs());
  for (int i = 0; i < n; ++i) {
    at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, i));
    std::lock_guard<std::mutex> lock(gen.mutex());
    states.push_back(gen.get_state());
  }
  return states;
}

void SetCudaGeneratorStates(const std::vector<at::Tensor>& states) {
  const int n = static_cast<int>(at::detail::getCUDAHooks().getNumGPUs());
  for (int i = 0; i < n && i < static_cast<int>(states.size()); ++i) {
    at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, i));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(states[i]);
  }
}

std::string Crc32(const std::string& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  size_t at = 0;
  while (at < bytes.size()) {  // crc32 takes a uInt length
    const size_t n = std::min<size_t>(bytes.size() - at, 1u << 30);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + at), static_cast<uInt>(n));
    at += n;
  }
  return absl::StrFormat("%08x", static_cast<uint32_t>(crc));
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& bytes) {
  const std::filesystem::path target(path);
  const std::string dir = target.parent_path().empty() ? "." : target.parent_path().string();
  const std::string tmp = absl::StrCat(dir, "/.", target.filename().string(), ".tmp-", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("cannot create", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      absl::Status s = ErrnoError("cannot write", tmp);
      ::close(fd);
      ::unlink(tmp.c_str());
      return s;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    absl::Status s = ErrnoError("cannot fsync", tmp);
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status s = ErrnoError(absl::StrCat("cannot rename ", tmp, " to"), path);
    ::unlink(tmp.c_str());
    return s;
  }
  return FsyncPath(dir, O_RDONLY | O_DIRECTORY);
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("cannot read ", path));
  return out.str();
}

std::string EncodeOwnerFile(const OwnerFile& owned) {
  if (!owned.names.empty() && owned.names.size() != owned.tensors.size()) {
    throw std::invalid_argument(absl::StrCat("checkpoint owner file: ", owned.tensors.size(), " stages' tensors but ",
                                             owned.names.size(), " stages' names"));
  }
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("format", int64_t{2});
  d.insert("stages", c10::List<int64_t>(owned.stages));
  c10::impl::GenericList state_dicts(c10::AnyType::get());
  for (size_t k = 0; k < owned.tensors.size(); ++k) {
    const auto& tensors = owned.tensors[k];
    std::vector<std::string> names;  // numbered when the owner file names none
    if (owned.names.empty()) {
      for (size_t i = 0; i < tensors.size(); ++i) names.push_back(absl::StrCat(i));
    } else {
      names = owned.names[k];
    }
    if (names.size() != tensors.size()) {
      throw std::invalid_argument(absl::StrCat("checkpoint owner file: stage ", owned.stages[k], " has ",
                                               tensors.size(), " tensors but ", names.size(), " names"));
    }
    c10::Dict<std::string, at::Tensor> state;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!state.insert(names[i], tensors[i]).second) {
        throw std::invalid_argument(absl::StrCat("checkpoint owner file: stage ", owned.stages[k],
                                                 " names two tensors '", names[i], "'"));
      }
    }
    state_dicts.push_back(state);
  }
  d.insert("state_dicts", state_dicts);
  d.insert("optimizer", owned.optimizer);
  d.insert("rng", owned.rng);
  d.insert("cuda_rng", c10::List<at::Tensor>(owned.cuda_rng));
  return SaveForTorchLoad(d);
}

absl::StatusOr<OwnerFile> DecodeOwnerFile(const std::string& bytes, const std::string& label) {
  try {
    const c10::IValue v = torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
    const c10::impl::GenericDict d = v.toGenericDict();
    const int64_t format = d.at("format").toInt();
    if (format != 1 && format != 2) {
      return absl::InvalidArgumentError(absl::StrCat(label, ": owner file format ", format,
                                                     " is not 1 or 2 (written by a newer remora?)"));
    }
    OwnerFile owned;
    owned.stages = IntsOf(d.at("stages"));
    if (format == 1) {
      for (const c10::IValue& t : d.at("tensors").toListRef()) owned.tensors.push_back(TensorsOf(t));
      // LibTorch's optimizer archive, as optim::LoadOptimizerState still takes.
      owned.optimizer = d.at("optimizer");
    } else {
      for (const c10::IValue& sd : d.at("state_dicts").toListRef()) {
        std::vector<at::Tensor> tensors;
        std::vector<std::string> names;
        for (const auto& entry : sd.toGenericDict()) {
          names.push_back(entry.key().toStringRef());
          tensors.push_back(entry.value().toTensor());
        }
        owned.tensors.push_back(std::move(tensors));
        owned.names.push_back(std::move(names));
      }
      owned.optimizer = d.at("optimizer");
    }
    owned.rng = d.at("rng").toTensor();
    // (Owner files written before CUDA generators were saved lack the entry.)
    if (d.contains("cuda_rng")) owned.cuda_rng = TensorsOf(d.at("cuda_rng"));
    if (owned.tensors.size() != owned.stages.size()) {
      return absl::DataLossError(absl::StrCat(label, ": ", owned.stages.size(), " stages but ",
                                              owned.tensors.size(), " tensor lists"));
    }
    return owned;
  } catch (...) {
    return base::StatusFromCurrentException(absl::StrCat(label, ": not a remora checkpoint owner file"));
  }
}

absl::StatusOr<OwnerFile> ReadOwnerFile(const std::string& path, int64_t bytes, const std::string& crc32) {
  ASSIGN_OR_RETURN(std::string data, ReadFile(path));
  if (static_cast<int64_t>(data.size()) != bytes) {
    return absl::DataLossError(absl::StrCat(path, " has ", data.size(), " bytes; the manifest says ", bytes,
                                            ": the file is truncated or was replaced"));
  }
  if (const std::string crc = Crc32(data); crc != crc32) {
    return absl::DataLossError(absl::StrCat(path, " has CRC-32 ", crc, "; the manifest says ", crc32,
                                            ": the file is corrupt"));
  }
  return DecodeOwnerFile(data, path);
}

void RemoveCheckpointFiles(const std::string& dir, bool all) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    // (Older checkpoints' files, and their temporaries, began with "shard-".)
    bool owners = false;
    for (const char* prefix : {"owner-", ".owner-", "shard-", ".shard-"}) owners = owners || name.rfind(prefix, 0) == 0;
    if (all || owners) std::filesystem::remove(entry.path(), ec);
  }
  std::filesystem::remove(dir, ec);  // only when empty
}

absl::Status RegisterFunctions(rpc::Registry& registry) {
  RETURN_IF_ERROR(registry.RegisterFunction(SaveOwnerFileRequest::kFunction, SaveOwnerFileFn));
  RETURN_IF_ERROR(registry.RegisterFunction(LoadOwnerFileRequest::kFunction, LoadOwnerFileFn));
  RETURN_IF_ERROR(registry.RegisterFunction(OwnerFileWrittenRequest::kFunction, OwnerFileWrittenFn));
  return registry.RegisterFunction(RemoveRequest::kFunction, RemoveFn);
}

}  // namespace remora::checkpoint
