#include "launch/cli.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <malloc.h>
#include <netdb.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "base/status_util.h"
#include "launch/program_path.h"

namespace remora::launch {

FlagParser::FlagParser(std::string program, std::string summary)
    : program_(std::move(program)), summary_(std::move(summary)) {}

void FlagParser::AddString(const std::string& name, std::string* target, const std::string& help,
                           bool empty_allowed) {
  order_.push_back(name);
  flags_[name] = Flag{help, *target, false, [name, target, empty_allowed](const std::string& v) {
                        if (v.empty() && !empty_allowed) {
                          // (Mostly a script's unset variable: taken as "not
                          // given", --token-file would turn checks off.)
                          return absl::InvalidArgumentError(absl::StrCat(
                              "--", name, " is empty (an unset variable?): give a value, or leave the flag out"));
                        }
                        *target = v;
                        return absl::OkStatus();
                      }};
}

void FlagParser::AddInt(const std::string& name, int* target, const std::string& help) {
  order_.push_back(name);
  flags_[name] = Flag{help, absl::StrCat(*target), false, [name, target](const std::string& v) {
                        if (!absl::SimpleAtoi(v, target)) {
                          return absl::InvalidArgumentError(
                              absl::StrCat("--", name, " wants an integer, got '", v, "'"));
                        }
                        return absl::OkStatus();
                      }};
}

void FlagParser::AddDouble(const std::string& name, double* target, const std::string& help) {
  order_.push_back(name);
  flags_[name] = Flag{help, absl::StrCat(*target), false, [name, target](const std::string& v) {
                        // No flag wants inf or nan: nan passes every
                        // range check written as "fail if x < lo".
                        if (!absl::SimpleAtod(v, target) || !std::isfinite(*target)) {
                          return absl::InvalidArgumentError(
                              absl::StrCat("--", name, " wants a finite number, got '", v, "'"));
                        }
                        return absl::OkStatus();
                      }};
}

void FlagParser::AddBool(const std::string& name, bool* target, const std::string& help) {
  order_.push_back(name);
  flags_[name] = Flag{help, *target ? "true" : "false", true,
                      [name, target](const std::string& v) {
                        if (!absl::SimpleAtob(v, target)) {
                          return absl::InvalidArgumentError(
                              absl::StrCat("--", name, " wants true or false, got '", v, "'"));
                        }
                        return absl::OkStatus();
                      }};
}

void FlagParser::AddSecurityFlags(SecurityFiles* target) {
  AddString("token-file", &target->token_file,
            "file holding the group's shared secret (else $REMORA_TOKEN; none: no check)");
  AddTlsFlags(&target->tls);
}

std::vector<std::string> SecurityFiles::WorkerArgs() const {
  std::vector<std::string> out = tls.WorkerArgs();
  if (!token_file.empty()) out.insert(out.end(), {"--token-file", token_file});
  return out;
}

void FlagParser::AddTlsFlags(TlsFiles* target) {
  AddString("tls-cert", &target->cert,
            "PEM certificate of this process (with --tls-key: TLS; every process of the group "
            "needs one)");
  AddString("tls-key", &target->key, "PEM private key of --tls-cert");
  AddString("tls-ca", &target->ca,
            "PEM CA certificate: peers' certificates must be signed by it, clients' too "
            "(mutual TLS)");
}

std::vector<std::string> TlsFiles::WorkerArgs() const {
  std::vector<std::string> out;
  if (!cert.empty()) out.insert(out.end(), {"--tls-cert", cert});
  if (!key.empty()) out.insert(out.end(), {"--tls-key", key});
  if (!ca.empty()) out.insert(out.end(), {"--tls-ca", ca});
  return out;
}

absl::StatusOr<rpc::TlsOptions> LoadTls(const TlsFiles& files) {
  return rpc::LoadTlsFiles(files.cert, files.key, files.ca);
}

absl::StatusOr<Security> LoadSecurity(const SecurityFiles& files) {
  auto token = LoadToken(files.token_file);
  if (!token.ok()) return token.status();
  auto tls = LoadTls(files.tls);
  if (!tls.ok()) return tls.status();
  return Security{*std::move(token), *std::move(tls)};
}

std::string FlagParser::Usage() const {
  std::string out = absl::StrCat("usage: ", program_, " [flags]\n\n", summary_, "\n\nflags:\n");
  for (const auto& name : order_) {
    const Flag& f = flags_.at(name);
    // A help text that gives its default itself (one that depends on other
    // flags) is not followed by the variable's placeholder value.
    const bool says_default = absl::StrContains(f.help, "(default");
    absl::StrAppend(&out, "  --", name, f.is_bool ? "" : " VALUE", "\n      ", f.help,
                    f.default_text.empty() || says_default ? "" : absl::StrCat(" (default: ", f.default_text, ")"),
                    "\n");
  }
  absl::StrAppend(&out, "  --help\n      print this and exit\n");
  if (group_ == Group::kNone) return out;
  absl::StrAppend(&out, "\nenvironment:\n");
  if (group_ == Group::kJoins) {
    absl::StrAppend(&out, "  MASTER_ADDR, MASTER_PORT  where the master listens (as in PyTorch)\n"
                    "  REMORA_TOKEN              the group's shared secret\n");
  }
  absl::StrAppend(&out, "  REMORA_SHM=0              no shared memory: large tensors go through gRPC\n"
                  "  REMORA_DEBUG=channels     log the channel chosen for every peer\n"
                  "  REMORA_HOST_ID=ID         this process's host identity (shared memory only between equal ids)\n"
                  "  REMORA_SYNC_SPIN_US=N     rpc_sync polls N us for its reply before sleeping (200; 0: off)\n"
                  "  REMORA_STREAMS=0          rpc_sync opens a unary gRPC call each time, not a stream\n"
                  "  REMORA_MALLOC=default     keep glibc's default heap settings\n"
                  "  REMORA_CUDA_CHANNEL=0     GPU tensors go through host memory, not CUDA IPC or NCCL\n"
                  "  REMORA_CUDA_STREAM_RECEIVES=0|1  the pipeline's GPU activations and gradients wait on the\n"
                  "                            host / on the GPU (default: on the GPU between GPUs only)\n");
  return out;
}

namespace {

// Edits (insertions, deletions, substitutions) from a to b.
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string FlagParser::Suggest(const std::string& name) const {
  std::string best;
  size_t best_distance = std::max<size_t>(2, name.size() / 4) + 1;
  for (const auto& [flag, unused] : flags_) {
    const size_t d = EditDistance(name, flag);
    if (d < best_distance) {
      best = flag;
      best_distance = d;
    }
  }
  return best;
}

bool FlagParser::Parse(int argc, char** argv, int* exit_code) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << Usage();
      *exit_code = 0;
      return false;
    }
    if (arg.rfind("--", 0) != 0) {
      std::cerr << program_ << ": unexpected argument '" << arg << "' (flags are --NAME VALUE or --NAME=VALUE); see "
                << program_ << " --help\n";
      *exit_code = 2;
      return false;
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    auto it = flags_.find(name);
    if (it == flags_.end()) {
      // (Not the whole usage: the error would scroll off the screen.)
      const std::string close = Suggest(name);
      std::cerr << program_ << ": unknown flag --" << name << (close.empty() ? "" : " (did you mean --" + close + "?)")
                << "; see " << program_ << " --help\n";
      *exit_code = 2;
      return false;
    }
    if (!has_value) {
      if (it->second.is_bool) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        std::cerr << program_ << ": --" << name << " needs a value\n";
        *exit_code = 2;
        return false;
      }
    }
    absl::Status s = it->second.set(value);
    given_.insert(name);
    if (!s.ok()) {
      std::cerr << program_ << ": " << s.message() << "\n";
      *exit_code = 2;
      return false;
    }
  }
  return true;
}

std::string MasterAddressFromEnv() {
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  return absl::StrCat(addr && *addr ? addr : "127.0.0.1", ":", port && *port ? port : "29500");
}

std::string AddressSource(const std::string& flag, const std::string& value) {
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  if (((addr && *addr) || (port && *port)) && value == MasterAddressFromEnv()) {
    return absl::StrCat(flag, " (from MASTER_ADDR/MASTER_PORT)");
  }
  return flag;
}

absl::StatusOr<std::string> LoadToken(const std::string& token_file) {
  std::string token;
  if (token_file.empty()) {
    const char* env = std::getenv("REMORA_TOKEN");
    token = env ? env : "";
    if (!token.empty() && absl::StripAsciiWhitespace(token).empty()) {
      return absl::InvalidArgumentError("REMORA_TOKEN holds only white space: set a secret, or unset it for no check");
    }
    return token;
  }
  ASSIGN_OR_RETURN(token, base::ReadWholeFile(token_file, "--token-file"));
  while (!token.empty() && (token.back() == '\n' || token.back() == '\r')) token.pop_back();
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("--token-file ", token_file, " is empty"));
  if (absl::StripAsciiWhitespace(token).empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--token-file ", token_file, " holds only white space"));
  }
  return token;
}

absl::Status CheckAtLeast(std::initializer_list<AtLeast> bounds) {
  for (const AtLeast& b : bounds) {
    if (b.value < b.least) {
      return absl::InvalidArgumentError(absl::StrCat("--", b.flag, " must be >= ", b.least, "; got ", b.value));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckBusyPollFlag(int64_t microseconds, int64_t most_us) {
  RETURN_IF_ERROR(CheckAtLeast({{"busy-poll-us", microseconds, 0}}));
  if (microseconds > most_us) {
    return absl::InvalidArgumentError(absl::StrCat("--busy-poll-us ", microseconds, " is above ", most_us, " (",
                                                   most_us / 1000, " ms)"));
  }
  return absl::OkStatus();
}

std::string BusyPollingNote(absl::Duration busy_poll) {
  if (busy_poll <= absl::ZeroDuration()) return "";
  return absl::StrCat(", busy-polling ", absl::ToInt64Microseconds(busy_poll), " us");
}

absl::Status CheckAddress(const std::string& address, const std::string& flag) {
  auto colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " wants HOST:PORT (port 0 to 65535), got '", address, "'"));
  }
  return absl::OkStatus();
}

namespace {

// Why opening `path` to write fails ("" when it opens): a regular file
// opened for appending (its bytes untouched), a missing one created and
// removed again. Tried rather than asked of access(), which tells root yes
// for any mode bits and for places no file can be made (/proc).
std::string WhyOpenFails(const std::string& path, bool exists) {
  const int fd = exists ? open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC)
                        : open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    switch (errno) {
      case EACCES:
      case EPERM: return "no permission";
      case EROFS: return "a read-only file system";
      case ENOENT: return "the file system there takes no new files";
      case ENOSPC:
      case EDQUOT: return "no space left";
      default: return std::strerror(errno);
    }
  }
  close(fd);
  if (!exists) unlink(path.c_str());
  return "";
}

}  // namespace

std::string WhyCannotWrite(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : fs::path(".");
  std::error_code error;
  fs::create_directories(dir, error);
  if (fs::is_directory(path, error)) return "it is a directory";
  if (!fs::is_directory(dir, error)) return absl::StrCat("no directory ", dir.string(), " and none could be made");
  const fs::file_status status = fs::status(path, error);
  // (A device or pipe, /dev/stdout say, is not opened here: that could block.)
  if (fs::exists(status) && !fs::is_regular_file(status)) return access(path.c_str(), W_OK) == 0 ? "" : "no permission";
  return WhyOpenFails(path, fs::exists(status));
}

std::string WhyCannotWriteDir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code error, made;
  if (fs::exists(dir, error) && !fs::is_directory(dir, error)) return "a file of that name exists";
  fs::create_directories(dir, made);
  if (!fs::is_directory(dir, error)) return absl::StrCat("it cannot be made: ", made.message());
  return WhyOpenFails(absl::StrCat(dir, "/.remora-write-check-", getpid()), /*exists=*/false);
}

absl::Status CheckCanListen(const std::string& address, const std::string& flag) {
  if (absl::Status s = CheckAddress(address, flag); !s.ok()) return s;
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (port == "0") return absl::OkStatus();
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() || host == "*" ? nullptr : host.c_str(), port.c_str(), &hints, &found) != 0) {
    return absl::OkStatus();
  }
  absl::Status status;
  for (addrinfo* a = found; a != nullptr && status.ok(); a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));  // as gRPC's server does
    const int error = bind(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (error == EADDRINUSE) {
      status = absl::UnavailableError(absl::StrCat(
          flag, " ", address, ": the port is in use (another master or worker, or a run that did not exit?); "
          "pick another port or stop that process"));
    } else if (error == EADDRNOTAVAIL) {
      status = absl::InvalidArgumentError(absl::StrCat(
          flag, " ", address, ": no network interface of this host has that address; give one of its own "
          "addresses, or 0.0.0.0 for all"));
    }
    close(fd);
  }
  freeaddrinfo(found);
  return status;
}

std::vector<std::string> SplitList(const std::string& list) {
  return absl::StrSplit(list, ',', absl::SkipWhitespace());
}

bool HasEmptyPart(const std::string& list) {
  return !list.empty() && static_cast<size_t>(std::count(list.begin(), list.end(), ',')) + 1 != SplitList(list).size();
}

absl::StatusOr<DeviceMapFlag> ParseDeviceMapFlag(const std::string& text) {
  DeviceMapFlag out;
  for (const auto& item : SplitList(text)) {
    if (item == "auto") {
      out.to_peer_devices = true;
      continue;
    }
    if (item == "none") continue;
    const auto slash = item.find('/');
    const auto eq = item.find('=', slash == std::string::npos ? 0 : slash);
    if (slash == std::string::npos || eq == std::string::npos || slash == 0 ||
        eq == slash + 1 || eq + 1 == item.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--device-map: '", item, "' is not auto, none or PEER/cuda:I=DEVICE "
          "(e.g. worker2/cuda:0=cuda:1 or master/cuda:0=cpu)"));
    }
    const std::string peer = item.substr(0, slash);
    const std::string src = item.substr(slash + 1, eq - slash - 1);
    auto& entries = out.maps[peer];
    if (!entries.emplace(src, item.substr(eq + 1)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device-map: ", peer, "/", src, " is mapped twice"));
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Spawn(
    const std::vector<std::string>& argv, const std::string& output, const std::vector<std::string>& env) {
  if (argv.empty()) return absl::InvalidArgumentError("empty command");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The child's environment, made here: between fork and exec only
  // async-signal-safe calls are allowed.
  std::vector<std::string> names;
  for (const auto& e : env) {
    const size_t eq = e.find('=');
    if (eq == std::string::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat("environment entry '", e, "' is not NAME=VALUE"));
    }
    names.push_back(e.substr(0, eq + 1));
  }
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    const bool replaced = std::any_of(names.begin(), names.end(),
                                      [e](const std::string& n) { return absl::StartsWith(*e, n); });
    if (!replaced) envp.push_back(*e);
  }
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork failed for ", argv[0]));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);  // the parent died already
    signal(SIGPIPE, SIG_DFL);  // (ignored here once a process group is joined; an ignore is inherited)
    if (!output.empty()) {
      int fd = open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd < 0) _exit(126);
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    execve(args[0], args.data(), envp.data());
    std::perror(args[0]);
    _exit(127);
  }
  return std::unique_ptr<Subprocess>(new Subprocess(pid));
}

Subprocess::~Subprocess() {
  if (!reaped_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

void Subprocess::Signal(int sig) {
  if (!reaped_) kill(pid_, sig);
}

bool Subprocess::running() {
  if (reaped_) return false;
  int status = 0;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    reaped_ = true;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    killed_by_signal_ = WIFSIGNALED(status);
    return false;
  }
  return true;
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (running()) {
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("process ", pid_, " still running"));
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  return exit_code_;
}

}  // namespace remora::launch
