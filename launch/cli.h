// Command-line helpers shared by remora's programs: a small flag parser
// with --help, the MASTER_ADDR/MASTER_PORT convention, and child processes.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "launch/program_path.h"
#include "rpc/tls.h"

namespace remora::launch {

// The PEM files of --tls-cert, --tls-key and --tls-ca (see rpc/tls.h).
struct TlsFiles {
  std::string cert;
  std::string key;
  std::string ca;
  // The flags that pass the same files on to a worker program.
  std::vector<std::string> WorkerArgs() const;
};

// What a program that joins a group proves itself with: --token-file and
// the TLS flags (FlagParser::AddSecurityFlags, LoadSecurity).
struct SecurityFiles {
  std::string token_file;
  TlsFiles tls;
  // The flags that pass the same files on to a worker program.
  std::vector<std::string> WorkerArgs() const;
};

// AgentOptions::token and AgentOptions::tls, loaded from SecurityFiles.
struct Security {
  std::string token;
  rpc::TlsOptions tls;
};

// Parses --name value and --name=value; --help prints the usage.
//
// Thread-compatible. Targets must outlive Parse().
class FlagParser {
 public:
  FlagParser(std::string program, std::string summary);

  // An empty value ("--flag=" or --flag "$UNSET") is refused unless
  // `empty_allowed` (a flag whose help gives it a meaning).
  void AddString(const std::string& name, std::string* target, const std::string& help,
                 bool empty_allowed = false);
  void AddInt(const std::string& name, int* target, const std::string& help);
  void AddDouble(const std::string& name, double* target, const std::string& help);
  void AddBool(const std::string& name, bool* target, const std::string& help);
  // --token-file, --tls-cert, --tls-key and --tls-ca, as every program
  // that joins a group takes them (LoadSecurity).
  void AddSecurityFlags(SecurityFiles* target);
  // Only the TLS flags (LoadTls).
  void AddTlsFlags(TlsFiles* target);

  // A program that joins no group: its usage lists no environment
  // variables (they are the group's).
  void JoinsNoGroup() { group_ = Group::kNone; }
  // A program that starts its group itself (rpc_demo): its usage leaves out
  // where a master is found and the group's secret, keeping the channels'
  // variables.
  void StartsItsOwnGroup() { group_ = Group::kOwn; }

  // Parses argv. Returns false after printing the usage (for --help: exit 0)
  // or an error (exit 2: one line, with the closest flag to an unknown
  // one); `exit_code` says which.
  bool Parse(int argc, char** argv, int* exit_code);
  std::string Usage() const;
  // The flags Parse was given (names without "--").
  const std::set<std::string>& given() const { return given_; }

 private:
  // The flag closest to the unknown `name` (a typo's), or "".
  std::string Suggest(const std::string& name) const;

  struct Flag {
    std::string help;
    std::string default_text;
    bool is_bool = false;
    std::function<absl::Status(const std::string&)> set;
  };
  std::string program_;
  std::string summary_;
  // Which of the group's environment variables the usage lists: all, the
  // channels' alone, or none.
  enum class Group { kJoins, kOwn, kNone } group_ = Group::kJoins;
  std::map<std::string, Flag> flags_;
  std::vector<std::string> order_;
  std::set<std::string> given_;
};

// "MASTER_ADDR:MASTER_PORT" from the environment, each part defaulting to
// 127.0.0.1 and 29500 as in PyTorch.
std::string MasterAddressFromEnv();
// How an error names an address flag whose value is `value`: `flag`, or
// "FLAG (from MASTER_ADDR/MASTER_PORT)" when the value came from those.
std::string AddressSource(const std::string& flag, const std::string& value);

// The shared secret for AgentOptions::token: the contents of `token_file`
// (trailing newline dropped) when given, else $REMORA_TOKEN, else empty.
// An error when the file cannot be read (or is a directory), or the secret
// is empty (a file) or only white space.
absl::StatusOr<std::string> LoadToken(const std::string& token_file);

// AgentOptions::tls from the files of AddTlsFlags: all empty is plaintext;
// an error names the flag and file that is missing, unreadable or not PEM,
// or the flag that is missing beside another (a cert without its key).
absl::StatusOr<rpc::TlsOptions> LoadTls(const TlsFiles& files);

// LoadToken and LoadTls together; the first error wins.
absl::StatusOr<Security> LoadSecurity(const SecurityFiles& files);

// Checks HOST:PORT (port 0 to 65535).
absl::Status CheckAddress(const std::string& address, const std::string& flag);

// Numeric flags' lower bounds: the first flag below its least is the
// error "--NAME must be >= LEAST; got VALUE".
struct AtLeast {
  const char* flag;  // without "--"
  int64_t value;
  int64_t least;
};
absl::Status CheckAtLeast(std::initializer_list<AtLeast> bounds);
// --busy-poll-us (rpc::AgentOptions::busy_poll): 0 to `most_us`
// microseconds (rpc::kMaxBusyPoll's), else the error naming the flag.
absl::Status CheckBusyPollFlag(int64_t microseconds, int64_t most_us);
// ", busy-polling N us" where `busy_poll` is positive (an agent's
// rpc::AgentOptions::busy_poll, as a program's start line says it), else "".
std::string BusyPollingNote(absl::Duration busy_poll);
// Whether this process could listen on HOST:PORT now (binds a socket and
// closes it): a port in use is an error naming `flag` before a program
// spends time loading data. Port 0, or a host that does not resolve here,
// passes (the server reports those itself).
absl::Status CheckCanListen(const std::string& address, const std::string& flag);

// Why this process could not write the file `path` (its directory made
// first where missing): "it is a directory", "no directory D and none could
// be made", "no permission", "a read-only file system", ...; empty when it
// could. The file is opened to find out (appended to, nothing written; a
// missing one made and removed; a device or pipe only asked about). For
// output files a program writes at its end, checked at its start.
std::string WhyCannotWrite(const std::string& path);
// The same for a directory a program writes into (made where missing, a
// file made in it and removed): "a file of that name exists", "it cannot
// be made: WHY", "no permission", ...; empty when it can.
std::string WhyCannotWriteDir(const std::string& dir);

// The most threads a --threads or --rpc-threads flag may ask for: more is
// a typo (a hundred thousand threads exhaust the process long before they
// help), refused as a bad value.
inline constexpr int kMaxThreads = 1024;

// Splits "a,b,c", dropping empty parts.
std::vector<std::string> SplitList(const std::string& list);
// Whether the non-empty `list` has an empty part ("a,,b", "a,", ",a"): a
// typo that SplitList would hide, which a flag's parser refuses.
bool HasEmptyPart(const std::string& list);

// The --device-map flag of the programs: "none" (or empty), "auto" (a CUDA
// tensor lands on the receiving peer's home device: its --device, the CPU
// for the master), and/or entries PEER/cuda:I=DEVICE separated by commas,
// for example "worker2/cuda:0=cuda:1,master/cuda:0=cpu". Entries win over
// auto. Devices are checked later, by Agent::Start.
struct DeviceMapFlag {
  bool to_peer_devices = false;
  std::map<std::string, std::map<std::string, std::string>> maps;
};
absl::StatusOr<DeviceMapFlag> ParseDeviceMapFlag(const std::string& text);

// A child process started from argv. The child gets SIGTERM when this
// process dies, so no child outlives its parent. The destructor kills (SIGKILL)
// and reaps a child that is still running.
class Subprocess {
 public:
  // Starts argv[0] (a path) with argv. When `output` is not empty, the
  // child's stdout and stderr go to that file. `env`: NAME=VALUE entries
  // the child gets on top of this process's environment (which is left
  // as it is: nothing calls setenv while other threads may read it).
  static absl::StatusOr<std::unique_ptr<Subprocess>> Spawn(const std::vector<std::string>& argv,
                                                           const std::string& output = "",
                                                           const std::vector<std::string>& env = {});
  ~Subprocess();

  pid_t pid() const { return pid_; }
  void Signal(int sig);
  // The exit code (128 + signal when killed by one), or DEADLINE_EXCEEDED.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  bool running();
  // Whether the child, once reaped, was killed by a signal (rather than
  // exiting with 128 + its number).
  bool killed_by_signal() const { return killed_by_signal_; }

 private:
  explicit Subprocess(pid_t pid) : pid_(pid) {}
  pid_t pid_;
  bool reaped_ = false;
  int exit_code_ = -1;
  bool killed_by_signal_ = false;
};

}  // namespace remora::launch
