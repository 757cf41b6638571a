#include "launch/cluster_env.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace remora::launch {
namespace {

// A job of more hosts than this is a typo in the list, not a cluster.
constexpr size_t kMaxHosts = size_t{1} << 20;

absl::Status BadList(absl::string_view list, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("host list '", list, "': ", why,
                   " (expected names and ranges such as n[1-3,7],gpu-a[01-02])"));
}

// Expands one bracket's contents, "1-3,7" or "01-02", into its numbers as
// text.
absl::StatusOr<std::vector<std::string>> ExpandRanges(absl::string_view list,
                                                      absl::string_view ranges) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(ranges, ',')) {
    if (part.empty()) return BadList(list, absl::StrCat("empty range in [", ranges, "]"));
    absl::string_view lo_text = part, hi_text = part;
    if (auto dash = part.find('-'); dash != absl::string_view::npos) {
      lo_text = part.substr(0, dash);
      hi_text = part.substr(dash + 1);
    }
    auto digits = [](absl::string_view s) {
      return !s.empty() && s.size() <= 9 &&
             std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
    };
    if (!digits(lo_text) || !digits(hi_text)) {
      return BadList(list, absl::StrCat("range '", part, "' in [", ranges,
                                        "] is not N or N-M with N, M of 1 to 9 digits"));
    }
    int lo = 0, hi = 0;
    (void)absl::SimpleAtoi(lo_text, &lo);
    (void)absl::SimpleAtoi(hi_text, &hi);
    if (hi < lo) {
      return BadList(list, absl::StrCat("range '", part, "' runs backwards"));
    }
    if (out.size() + static_cast<size_t>(hi - lo) + 1 > kMaxHosts) {
      return BadList(list, absl::StrCat("more than ", kMaxHosts, " hosts"));
    }
    const size_t width = lo_text.size();
    for (int v = lo; v <= hi; ++v) {
      std::string s = absl::StrCat(v);
      if (s.size() < width) s.insert(0, width - s.size(), '0');
      out.push_back(std::move(s));
    }
  }
  return out;
}

// Expands one host expression ("gpu-a[01-02]" or "r[1-2]n[1-2]").
absl::Status ExpandHost(absl::string_view list, absl::string_view item,
                        std::vector<std::string>* out) {
  std::vector<std::string> names = {""};
  size_t i = 0;
  while (i < item.size()) {
    const size_t open = item.find('[', i);
    const absl::string_view literal =
        item.substr(i, open == absl::string_view::npos ? absl::string_view::npos : open - i);
    if (literal.find(']') != absl::string_view::npos) {
      return BadList(list, absl::StrCat("']' without '[' in '", item, "'"));
    }
    for (auto& n : names) absl::StrAppend(&n, literal);
    if (open == absl::string_view::npos) break;
    const size_t close = item.find(']', open);
    if (close == absl::string_view::npos) {
      return BadList(list, absl::StrCat("'[' without ']' in '", item, "'"));
    }
    const absl::string_view ranges = item.substr(open + 1, close - open - 1);
    if (ranges.find('[') != absl::string_view::npos) {
      return BadList(list, absl::StrCat("nested '[' in '", item, "'"));
    }
    auto numbers = ExpandRanges(list, ranges);
    if (!numbers.ok()) return numbers.status();
    if (names.size() * numbers->size() + out->size() > kMaxHosts) {
      return BadList(list, absl::StrCat("more than ", kMaxHosts, " hosts"));
    }
    std::vector<std::string> next;
    next.reserve(names.size() * numbers->size());
    for (const auto& n : names) {
      for (const auto& v : *numbers) next.push_back(absl::StrCat(n, v));
    }
    names = std::move(next);
    i = close + 1;
  }
  for (auto& n : names) {
    if (n.empty()) return BadList(list, "an empty host name");
    out->push_back(std::move(n));
  }
  return absl::OkStatus();
}

std::string FoundList(const EnvMap& env) {
  std::vector<std::string> found;
  for (const auto& name : kClusterVariables) {
    auto it = env.find(name);
    if (it != env.end()) found.push_back(absl::StrCat(name, "=", it->second));
  }
  return found.empty() ? "none of " + absl::StrJoin(kClusterVariables, ", ")
                       : absl::StrJoin(found, ", ");
}

// Reads cluster variables and collects the first error, which names what
// the environment held.
class EnvReader {
 public:
  explicit EnvReader(const EnvMap& env) : env_(env) {}

  bool Has(const std::string& name) const { return env_.count(name) > 0; }
  std::string Get(const std::string& name) const {
    auto it = env_.find(name);
    return it == env_.end() ? "" : it->second;
  }
  // A non-negative integer, or `fallback` when unset and `fallback` >= 0.
  int Int(const std::string& name, int fallback = -1) {
    auto it = env_.find(name);
    if (it == env_.end()) {
      if (fallback < 0) Fail(absl::StrCat(name, " is not set"));
      return fallback;
    }
    int v = -1;
    const std::string text(absl::StripAsciiWhitespace(it->second));
    if (text.empty() || !std::all_of(text.begin(), text.end(), absl::ascii_isdigit) ||
        !absl::SimpleAtoi(text, &v)) {
      Fail(absl::StrCat(name, "='", it->second, "' is not a non-negative integer"));
      return fallback < 0 ? 0 : fallback;
    }
    return v;
  }
  void Fail(const std::string& why) {
    if (error_.empty()) error_ = why;
  }
  void Check(bool ok, const std::string& why) {
    if (!ok) Fail(why);
  }
  bool failed() const { return !error_.empty(); }
  absl::Status Error(const std::string& source) const {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot tell this process's role from the ", source, " environment: ", error_,
        ". Found: ", FoundList(env_), "."));
  }

 private:
  const EnvMap& env_;
  std::string error_;
};

void CheckMasterPort(EnvReader& r, ClusterRole* role) {
  role->master_port = r.Int("MASTER_PORT", 29500);
  r.Check(role->master_port >= 1 && role->master_port <= 65535,
          absl::StrCat("MASTER_PORT=", r.Get("MASTER_PORT"), " is not a port (1 to 65535)"));
}

absl::StatusOr<ClusterRole> FromTorchrun(const EnvMap& env) {
  EnvReader r(env);
  ClusterRole role;
  role.source = EnvSource::kTorchrun;
  role.rank = r.Int("RANK");
  role.world_size = r.Int("WORLD_SIZE");
  role.local_rank = r.Int("LOCAL_RANK", 0);
  role.master_host = r.Get("MASTER_ADDR");
  role.master_host_origin = "MASTER_ADDR";
  r.Check(r.Has("MASTER_ADDR") && !role.master_host.empty(),
          "MASTER_ADDR is not set (torchrun sets it to rank 0's host)");
  CheckMasterPort(r, &role);
  if (!r.failed()) {
    r.Check(role.world_size >= 2,
            absl::StrCat("WORLD_SIZE=", role.world_size,
                         ": remora needs rank 0 (the master) and at least one worker"));
    r.Check(role.rank < role.world_size,
            absl::StrCat("RANK=", role.rank, " is not below WORLD_SIZE=", role.world_size));
    r.Check(role.local_rank <= role.rank,
            absl::StrCat("LOCAL_RANK=", role.local_rank, " is above RANK=", role.rank));
    if (r.Has("LOCAL_WORLD_SIZE")) {
      const int local_world = r.Int("LOCAL_WORLD_SIZE");
      r.Check(role.local_rank < local_world && local_world <= role.world_size,
              absl::StrCat("LOCAL_RANK=", role.local_rank, " and LOCAL_WORLD_SIZE=",
                           local_world, " do not fit WORLD_SIZE=", role.world_size));
    }
  }
  if (r.failed()) return r.Error("torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)");
  return role;
}

// The counts of a Slurm role read without errors, checked against each
// other (`list_var`: the variable its nodes came from).
void CheckSlurmRole(EnvReader& r, const ClusterRole& role, const std::string& list_var) {
  r.Check(role.world_size >= 2,
          absl::StrCat("SLURM_NTASKS=", role.world_size,
                       ": remora needs rank 0 (the master) and at least one worker (srun -n 2 "
                       "or more)"));
  r.Check(role.rank < role.world_size, absl::StrCat("SLURM_PROCID=", role.rank,
                                                    " is not below SLURM_NTASKS=",
                                                    role.world_size));
  r.Check(role.local_rank <= role.rank,
          absl::StrCat("SLURM_LOCALID=", role.local_rank, " is above SLURM_PROCID=", role.rank));
  if (!role.nodes.empty()) {
    r.Check(static_cast<size_t>(role.node_id) < role.nodes.size(),
            absl::StrCat("SLURM_NODEID=", role.node_id, " is outside the ", role.nodes.size(),
                         " nodes of ", list_var));
    if (r.Has("SLURM_NNODES") || r.Has("SLURM_JOB_NUM_NODES")) {
      const int nnodes = r.Int(r.Has("SLURM_NNODES") ? "SLURM_NNODES" : "SLURM_JOB_NUM_NODES");
      r.Check(static_cast<size_t>(nnodes) == role.nodes.size(),
              absl::StrCat(r.Has("SLURM_NNODES") ? "SLURM_NNODES=" : "SLURM_JOB_NUM_NODES=",
                           nnodes, " but ", list_var, " lists ", role.nodes.size(), " nodes"));
    }
  }
  // Rank 0 must run where the master host points, when that came from
  // the node list.
  if (role.rank == 0 && role.master_host_origin != "MASTER_ADDR" && !role.node_name.empty() &&
      !role.nodes.empty()) {
    r.Check(role.node_name == role.nodes.front(),
            absl::StrCat("rank 0 runs on node ", role.node_name, ", not on ",
                         role.nodes.front(), ", the first of the node list; set MASTER_ADDR "
                         "to rank 0's host"));
  }
}

absl::StatusOr<ClusterRole> FromSlurm(const EnvMap& env) {
  EnvReader r(env);
  ClusterRole role;
  role.source = EnvSource::kSlurm;
  role.rank = r.Int("SLURM_PROCID");
  const bool has_ntasks = r.Has("SLURM_NTASKS"), has_nprocs = r.Has("SLURM_NPROCS");
  if (!has_ntasks && !has_nprocs) r.Fail("SLURM_NTASKS is not set (start the tasks with srun)");
  if (has_ntasks) role.world_size = r.Int("SLURM_NTASKS");
  if (has_nprocs) {
    const int nprocs = r.Int("SLURM_NPROCS");
    if (!has_ntasks) role.world_size = nprocs;
    r.Check(nprocs == role.world_size,
            absl::StrCat("SLURM_NTASKS=", role.world_size, " and SLURM_NPROCS=", nprocs,
                         " disagree"));
  }
  role.local_rank = r.Int("SLURM_LOCALID", 0);
  role.node_id = r.Int("SLURM_NODEID", 0);
  role.node_name = r.Get("SLURMD_NODENAME");
  // The step's nodes where srun set them (rank 0 runs on the first), else
  // the job's.
  std::string list_var;
  for (const char* v : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    if (r.Has(v)) {
      list_var = v;
      break;
    }
  }
  if (!list_var.empty()) {
    auto nodes = ExpandHostList(r.Get(list_var));
    if (nodes.ok()) {
      role.nodes = *std::move(nodes);
    } else {
      r.Fail(absl::StrCat(list_var, ": ", nodes.status().message()));
    }
  }
  if (r.Has("SLURM_JOB_NODELIST") && r.Has("SLURM_NODELIST") &&
      r.Get("SLURM_JOB_NODELIST") != r.Get("SLURM_NODELIST")) {
    r.Fail("SLURM_JOB_NODELIST and SLURM_NODELIST disagree");
  }
  if (r.Has("MASTER_ADDR") && !r.Get("MASTER_ADDR").empty()) {
    role.master_host = r.Get("MASTER_ADDR");
    role.master_host_origin = "MASTER_ADDR";
  } else if (list_var.empty()) {
    r.Fail("neither MASTER_ADDR nor SLURM_JOB_NODELIST is set, so rank 0's host is unknown");
  } else if (!role.nodes.empty()) {
    role.master_host = role.nodes.front();
    role.master_host_origin =
        absl::StrCat("the first host of ", list_var, "=", r.Get(list_var));
  }
  CheckMasterPort(r, &role);
  if (!r.failed()) CheckSlurmRole(r, role, list_var);
  if (r.failed()) return r.Error("Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST)");
  return role;
}

}  // namespace

const std::vector<std::string> kClusterVariables = {
    "RANK",          "WORLD_SIZE",          "LOCAL_RANK",          "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",   "MASTER_PORT",         "SLURM_PROCID",        "SLURM_NTASKS",
    "SLURM_NPROCS",  "SLURM_LOCALID",       "SLURM_NODEID",        "SLURM_NNODES",
    "SLURM_JOB_NUM_NODES", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
    "SLURMD_NODENAME"};

absl::StatusOr<std::vector<std::string>> ExpandHostList(absl::string_view list) {
  std::vector<std::string> out;
  const absl::string_view trimmed = absl::StripAsciiWhitespace(list);
  if (trimmed.empty()) return BadList(list, "it is empty");
  // Split at the commas outside brackets.
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= trimmed.size(); ++i) {
    const char c = i < trimmed.size() ? trimmed[i] : ',';
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (depth < 0) return BadList(list, "']' without '['");
    if (c == ' ' || c == '\t' || c == '\n') return BadList(list, "white space inside it");
    if (c == ',' && depth == 0) {
      const absl::string_view item = trimmed.substr(start, i - start);
      if (!item.empty()) {
        if (absl::Status s = ExpandHost(list, item, &out); !s.ok()) return s;
      }
      start = i + 1;
    }
  }
  if (depth != 0) return BadList(list, "'[' without ']'");
  if (out.empty()) return BadList(list, "it names no host");
  return out;
}

EnvMap ReadClusterEnvironment() {
  EnvMap env;
  for (const auto& name : kClusterVariables) {
    if (const char* v = std::getenv(name.c_str())) env[name] = v;
  }
  return env;
}

const char* EnvSourceName(EnvSource source) {
  return source == EnvSource::kSlurm ? "slurm" : "torchrun";
}

std::string ClusterRole::name() const {
  return rank == 0 ? "master" : absl::StrCat("worker", rank);
}

std::vector<std::string> ClusterRole::worker_names() const {
  std::vector<std::string> out;
  for (int r = 1; r < world_size; ++r) out.push_back(absl::StrCat("worker", r));
  return out;
}

std::string ClusterRole::Describe() const {
  std::string where = EnvSourceName(source);
  if (source == EnvSource::kSlurm && node_id >= 0 &&
      static_cast<size_t>(node_id) < nodes.size()) {
    absl::StrAppend(&where, ", node ", nodes[node_id]);
  }
  return absl::StrCat("rank ", rank, " of ", world_size, " (", where, ", local rank ", local_rank,
                      ")");
}

absl::StatusOr<EnvChoice> ParseEnvChoice(absl::string_view text) {
  if (text == "auto") return EnvChoice::kAuto;
  if (text == "torchrun") return EnvChoice::kTorchrun;
  if (text == "slurm") return EnvChoice::kSlurm;
  return absl::InvalidArgumentError(
      absl::StrCat("--env wants auto, torchrun or slurm, got '", text, "'"));
}

absl::StatusOr<ClusterRole> RoleFromEnvironment(const EnvMap& env, EnvChoice choice) {
  if (choice == EnvChoice::kAuto) {
    if (env.count("RANK") || env.count("WORLD_SIZE")) {
      choice = EnvChoice::kTorchrun;
    } else if (env.count("SLURM_PROCID")) {
      choice = EnvChoice::kSlurm;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "no cluster environment: set torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, "
          "or start each task with Slurm's srun (SLURM_PROCID, SLURM_NTASKS, "
          "SLURM_JOB_NODELIST). Found: ",
          FoundList(env), "."));
    }
  }
  return choice == EnvChoice::kTorchrun ? FromTorchrun(env) : FromSlurm(env);
}

absl::StatusOr<std::string> NodeAddrFromScontrol(absl::string_view output) {
  for (absl::string_view field : absl::StrSplit(output, absl::ByAnyChar(" \t\n"), absl::SkipEmpty())) {
    if (absl::ConsumePrefix(&field, "NodeAddr=") && !field.empty()) return std::string(field);
  }
  return absl::NotFoundError(
      absl::StrCat("no NodeAddr= in scontrol's output '", absl::StripAsciiWhitespace(output), "'"));
}

std::vector<std::string> RoleCommand(const ClusterRole& role, const LaunchOptions& o) {
  std::vector<std::string> argv;
  if (role.is_master()) {
    argv.push_back(o.master_program);
    argv.insert(argv.end(), o.master_args.begin(), o.master_args.end());
    argv.insert(argv.end(), o.shared_args.begin(), o.shared_args.end());
    std::vector<std::string> workers = role.worker_names();
    const size_t spares = std::min(workers.size(), static_cast<size_t>(std::max(o.spares, 0)));
    const std::vector<std::string> standing_by(workers.end() - static_cast<std::ptrdiff_t>(spares), workers.end());
    workers.resize(workers.size() - spares);
    argv.insert(argv.end(), {"--listen", o.master_address, "--workers", absl::StrJoin(workers, ",")});
    if (!standing_by.empty()) argv.insert(argv.end(), {"--spares", absl::StrJoin(standing_by, ",")});
  } else {
    argv.push_back(o.worker_program);
    argv.insert(argv.end(), o.shared_args.begin(), o.shared_args.end());
    argv.insert(argv.end(), o.worker_args.begin(), o.worker_args.end());
    argv.insert(argv.end(), {"--name", role.name(), "--master", o.master_address, "--listen",
                             o.worker_listen});
  }
  return argv;
}

std::string JoinHostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                               : absl::StrCat(host, ":", port);
}

bool IsIpLiteral(const std::string& host) {
  in_addr v4;
  in6_addr v6;
  return inet_pton(AF_INET, host.c_str(), &v4) == 1 || inet_pton(AF_INET6, host.c_str(), &v6) == 1;
}

absl::StatusOr<std::string> ResolveHost(const std::string& host) {
  if (IsIpLiteral(host)) return host;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) {
    return absl::NotFoundError(
        absl::StrCat("cannot resolve host '", host, "': ", gai_strerror(rc)));
  }
  std::string v4, v6;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char text[INET6_ADDRSTRLEN] = {0};
    if (a->ai_family == AF_INET && v4.empty()) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, text, sizeof(text));
      v4 = text;
    } else if (a->ai_family == AF_INET6 && v6.empty()) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, text,
                sizeof(text));
      v6 = text;
    }
  }
  freeaddrinfo(res);
  if (v4.empty() && v6.empty()) {
    return absl::NotFoundError(absl::StrCat("host '", host, "' has no IPv4 or IPv6 address"));
  }
  return v4.empty() ? v6 : v4;
}

namespace {

// A socket address for ip:port; false when ip is not a literal.
bool MakeAddress(const std::string& ip, int port, sockaddr_storage* out, socklen_t* len) {
  *out = {};
  auto* v4 = reinterpret_cast<sockaddr_in*>(out);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(out);
  if (inet_pton(AF_INET, ip.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    *len = sizeof(sockaddr_in);
    return true;
  }
  if (inet_pton(AF_INET6, ip.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    *len = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<std::string> LocalAddressToward(const std::string& ip, int port) {
  sockaddr_storage addr;
  socklen_t len = 0;
  if (!MakeAddress(ip, port, &addr, &len)) {
    return absl::InvalidArgumentError(absl::StrCat("'", ip, "' is not an IP address"));
  }
  const int fd = socket(addr.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(): ", std::strerror(errno)));
  // Connecting a datagram socket only asks the routing table; nothing is sent.
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("no route from this host to ", ip, ": ",
                                               std::strerror(err)));
  }
  sockaddr_storage local{};
  socklen_t local_len = sizeof(local);
  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len);
  close(fd);
  char text[INET6_ADDRSTRLEN] = {0};
  if (local.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&local)->sin_addr, text, sizeof(text));
  } else {
    inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&local)->sin6_addr, text, sizeof(text));
  }
  return std::string(text);
}

absl::Status CheckLocalAddress(const std::string& ip) {
  sockaddr_storage addr;
  socklen_t len = 0;
  if (!MakeAddress(ip, 0, &addr, &len)) {
    return absl::InvalidArgumentError(absl::StrCat("'", ip, "' is not an IP address"));
  }
  const int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(): ", std::strerror(errno)));
  const int rc = bind(fd, reinterpret_cast<sockaddr*>(&addr), len);
  const int err = errno;
  close(fd);
  if (rc != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(ip, " is not an address of this host (bind: ", std::strerror(err), ")"));
  }
  return absl::OkStatus();
}

}  // namespace remora::launch
