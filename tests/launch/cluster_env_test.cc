// launch/cluster_env.h: Slurm host lists, roles from torchrun's and Slurm's
// variables, their errors, and the command line each role gets. No
// processes, no LibTorch.
#include "launch/cluster_env.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace remora::launch {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<std::string> Expand(const std::string& list) {
  auto hosts = ExpandHostList(list);
  EXPECT_TRUE(hosts.ok()) << list << ": " << hosts.status();
  return hosts.ok() ? *hosts : std::vector<std::string>{};
}

std::string ExpandError(const std::string& list) {
  auto hosts = ExpandHostList(list);
  EXPECT_FALSE(hosts.ok()) << list << " expanded";
  return std::string(hosts.status().message());
}

TEST(HostList, ExpandsLikeScontrolShowHostnames) {
  EXPECT_THAT(Expand("n[1-3,7],gpu-a[01-02]"),
              ElementsAre("n1", "n2", "n3", "n7", "gpu-a01", "gpu-a02"));
  EXPECT_THAT(Expand("node1"), ElementsAre("node1"));
  EXPECT_THAT(Expand("a,b,c"), ElementsAre("a", "b", "c"));
  EXPECT_THAT(Expand("n[8-11]"), ElementsAre("n8", "n9", "n10", "n11"));
  EXPECT_THAT(Expand("n[08-11]"), ElementsAre("n08", "n09", "n10", "n11"));
  EXPECT_THAT(Expand("n[098-101]"), ElementsAre("n098", "n099", "n100", "n101"));
  EXPECT_THAT(Expand("rack[1-2]-n[1-2]"),
              ElementsAre("rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"));
  EXPECT_THAT(Expand("n[5]"), ElementsAre("n5"));
  EXPECT_THAT(Expand("[1-2]x"), ElementsAre("1x", "2x"));
  EXPECT_THAT(Expand("gpu-a01,n[1-2]"), ElementsAre("gpu-a01", "n1", "n2"));
  EXPECT_THAT(Expand(" n[1-2] "), ElementsAre("n1", "n2"));
  EXPECT_THAT(Expand("a,,b,"), ElementsAre("a", "b"));
  EXPECT_EQ(Expand("n[1-1000]").size(), 1000u);
}

TEST(HostList, MalformedListsAreErrorsNamingThePart) {
  EXPECT_THAT(ExpandError(""), HasSubstr("empty"));
  EXPECT_THAT(ExpandError("n[1-3"), HasSubstr("'[' without ']'"));
  EXPECT_THAT(ExpandError("n1-3]"), HasSubstr("']' without '['"));
  EXPECT_THAT(ExpandError("n[3-1]"), HasSubstr("'3-1' runs backwards"));
  EXPECT_THAT(ExpandError("n[a-b]"), HasSubstr("'a-b'"));
  EXPECT_THAT(ExpandError("n[1,,2]"), HasSubstr("empty range"));
  EXPECT_THAT(ExpandError("n[[1-2]]"), HasSubstr("nested"));
  EXPECT_THAT(ExpandError("n[1-2] m"), HasSubstr("white space"));
  EXPECT_THAT(ExpandError("n[0-99999999]"), HasSubstr("more than"));
  EXPECT_THAT(ExpandError(","), HasSubstr("no host"));
  EXPECT_THAT(ExpandError("n[1-3"), HasSubstr("host list 'n[1-3'"));
}

EnvMap Torchrun(int rank, int world) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(rank % 2)},
          {"MASTER_ADDR", "10.1.2.3"},
          {"MASTER_PORT", "29511"}};
}

EnvMap Slurm(int rank) {
  return {{"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_NTASKS", "4"},
          {"SLURM_NPROCS", "4"},
          {"SLURM_LOCALID", std::to_string(rank % 2)},
          {"SLURM_NODEID", std::to_string(rank / 2)},
          {"SLURM_NNODES", "2"},
          {"SLURM_JOB_NODELIST", "n[1-2]"},
          {"SLURMD_NODENAME", rank < 2 ? "n1" : "n2"}};
}

std::string RoleError(const EnvMap& env, EnvChoice choice = EnvChoice::kAuto) {
  auto role = RoleFromEnvironment(env, choice);
  EXPECT_FALSE(role.ok()) << "accepted: " << role->Describe();
  EXPECT_EQ(role.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(role.status().message());
}

TEST(ClusterEnv, ReadsTorchrunsVariables) {
  auto role = RoleFromEnvironment(Torchrun(3, 4)).value();
  EXPECT_EQ(role.source, EnvSource::kTorchrun);
  EXPECT_EQ(role.rank, 3);
  EXPECT_EQ(role.world_size, 4);
  EXPECT_EQ(role.local_rank, 1);
  EXPECT_EQ(role.master_host, "10.1.2.3");
  EXPECT_EQ(role.master_port, 29511);
  EXPECT_EQ(role.name(), "worker3");
  EXPECT_FALSE(role.is_master());
  EXPECT_EQ(role.Describe(), "rank 3 of 4 (torchrun, local rank 1)");
  auto master = RoleFromEnvironment(Torchrun(0, 4)).value();
  EXPECT_TRUE(master.is_master());
  EXPECT_EQ(master.name(), "master");
  EXPECT_THAT(master.worker_names(), ElementsAre("worker1", "worker2", "worker3"));
  // MASTER_PORT and LOCAL_RANK have defaults.
  EnvMap bare = {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}};
  auto defaults = RoleFromEnvironment(bare).value();
  EXPECT_EQ(defaults.master_port, 29500);
  EXPECT_EQ(defaults.local_rank, 0);
}

TEST(ClusterEnv, ReadsSlurmsVariablesAndTheFirstNodeIsTheMaster) {
  auto role = RoleFromEnvironment(Slurm(3)).value();
  EXPECT_EQ(role.source, EnvSource::kSlurm);
  EXPECT_EQ(role.rank, 3);
  EXPECT_EQ(role.world_size, 4);
  EXPECT_EQ(role.local_rank, 1);
  EXPECT_EQ(role.node_id, 1);
  EXPECT_THAT(role.nodes, ElementsAre("n1", "n2"));
  EXPECT_EQ(role.master_host, "n1");
  EXPECT_THAT(role.master_host_origin, HasSubstr("first host of SLURM_JOB_NODELIST=n[1-2]"));
  EXPECT_EQ(role.master_port, 29500);
  EXPECT_EQ(role.Describe(), "rank 3 of 4 (slurm, node n2, local rank 1)");
  // MASTER_ADDR and MASTER_PORT win over the node list.
  EnvMap env = Slurm(0);
  env["MASTER_ADDR"] = "192.168.7.7";
  env["MASTER_PORT"] = "4000";
  auto master = RoleFromEnvironment(env).value();
  EXPECT_EQ(master.master_host, "192.168.7.7");
  EXPECT_EQ(master.master_host_origin, "MASTER_ADDR");
  EXPECT_EQ(master.master_port, 4000);
  // The step's node list wins over the job's.
  env = Slurm(1);
  env["SLURM_STEP_NODELIST"] = "gpu-a[01-02]";
  env.erase("SLURM_NNODES");
  EXPECT_EQ(RoleFromEnvironment(env).value().master_host, "gpu-a01");
}

TEST(ClusterEnv, TorchrunWinsInAutoAndEachCanBeChosen) {
  EnvMap env = Slurm(2);
  for (const auto& [k, v] : Torchrun(1, 2)) env[k] = v;
  EXPECT_EQ(RoleFromEnvironment(env).value().source, EnvSource::kTorchrun);
  EXPECT_EQ(RoleFromEnvironment(env, EnvChoice::kSlurm).value().rank, 2);
  EXPECT_EQ(RoleFromEnvironment(env, EnvChoice::kTorchrun).value().rank, 1);
  EXPECT_THAT(RoleError(Slurm(1), EnvChoice::kTorchrun), HasSubstr("RANK is not set"));
  EXPECT_EQ(ParseEnvChoice("slurm").value(), EnvChoice::kSlurm);
  EXPECT_THAT(ParseEnvChoice("mpi").status().message(), HasSubstr("auto, torchrun or slurm"));
}

TEST(ClusterEnv, MissingVariablesAreErrorsListingWhatWasFound) {
  const std::string none = RoleError({});
  EXPECT_THAT(none, HasSubstr("no cluster environment"));
  EXPECT_THAT(none, HasSubstr("Found: none of RANK, WORLD_SIZE"));
  const std::string only_addr = RoleError({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_THAT(only_addr, HasSubstr("Found: MASTER_ADDR=h, MASTER_PORT=1."));
  const std::string no_world = RoleError({{"RANK", "1"}, {"MASTER_ADDR", "h"}});
  EXPECT_THAT(no_world, HasSubstr("WORLD_SIZE is not set"));
  EXPECT_THAT(no_world, HasSubstr("Found: RANK=1, MASTER_ADDR=h."));
  EXPECT_THAT(RoleError({{"RANK", "1"}, {"WORLD_SIZE", "2"}}), HasSubstr("MASTER_ADDR is not set"));
  EnvMap slurm = Slurm(1);
  slurm.erase("SLURM_NTASKS");
  slurm.erase("SLURM_NPROCS");
  EXPECT_THAT(RoleError(slurm), HasSubstr("SLURM_NTASKS is not set"));
  slurm = Slurm(1);
  slurm.erase("SLURM_JOB_NODELIST");
  const std::string no_list = RoleError(slurm);
  EXPECT_THAT(no_list, HasSubstr("neither MASTER_ADDR nor SLURM_JOB_NODELIST"));
  EXPECT_THAT(no_list, HasSubstr("SLURM_PROCID=1"));
  slurm["MASTER_ADDR"] = "10.0.0.1";  // enough without a node list
  EXPECT_EQ(RoleFromEnvironment(slurm).value().master_host, "10.0.0.1");
}

TEST(ClusterEnv, ContradictoryOrMalformedVariablesAreErrors) {
  EXPECT_THAT(RoleError(Torchrun(4, 4)), HasSubstr("RANK=4 is not below WORLD_SIZE=4"));
  EXPECT_THAT(RoleError(Torchrun(0, 1)), HasSubstr("at least one worker"));
  EnvMap env = Torchrun(1, 4);
  env["RANK"] = "one";
  EXPECT_THAT(RoleError(env), HasSubstr("RANK='one' is not a non-negative integer"));
  env = Torchrun(1, 4);
  env["RANK"] = "-1";
  EXPECT_THAT(RoleError(env), HasSubstr("RANK='-1'"));
  env = Torchrun(1, 4);
  env["MASTER_PORT"] = "70000";
  EXPECT_THAT(RoleError(env), HasSubstr("MASTER_PORT=70000 is not a port"));
  env = Torchrun(0, 4);
  env["LOCAL_RANK"] = "2";
  EXPECT_THAT(RoleError(env), HasSubstr("LOCAL_RANK=2 is above RANK=0"));
  env = Torchrun(3, 4);
  env["LOCAL_WORLD_SIZE"] = "1";
  EXPECT_THAT(RoleError(env), HasSubstr("do not fit"));

  env = Slurm(1);
  env["SLURM_NPROCS"] = "3";
  EXPECT_THAT(RoleError(env), HasSubstr("SLURM_NTASKS=4 and SLURM_NPROCS=3 disagree"));
  env = Slurm(3);
  env["SLURM_NODEID"] = "2";
  EXPECT_THAT(RoleError(env), HasSubstr("SLURM_NODEID=2 is outside the 2 nodes"));
  env = Slurm(1);
  env["SLURM_NNODES"] = "3";
  EXPECT_THAT(RoleError(env), HasSubstr("SLURM_NNODES=3 but SLURM_JOB_NODELIST lists 2 nodes"));
  env = Slurm(1);
  env["SLURM_JOB_NODELIST"] = "n[2-1]";
  EXPECT_THAT(RoleError(env), HasSubstr("runs backwards"));
  env = Slurm(0);
  env["SLURMD_NODENAME"] = "n2";
  const std::string elsewhere = RoleError(env);
  EXPECT_THAT(elsewhere, HasSubstr("rank 0 runs on node n2, not on n1"));
  EXPECT_THAT(elsewhere, HasSubstr("SLURMD_NODENAME=n2"));  // what was found
  env = Slurm(1);
  env["SLURM_NODELIST"] = "n[1-3]";
  EXPECT_THAT(RoleError(env), HasSubstr("disagree"));
  env = Slurm(5);
  EXPECT_THAT(RoleError(env), HasSubstr("SLURM_PROCID=5 is not below SLURM_NTASKS=4"));
}

TEST(ClusterEnv, NodeAddrFromScontrolOutput) {
  EXPECT_EQ(NodeAddrFromScontrol("NodeName=n1 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 "
                                 "NodeHostName=localhost Port=6818\n")
                .value(),
            "127.0.0.1");
  EXPECT_EQ(NodeAddrFromScontrol("Node n9 not found\n").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_THAT(NodeAddrFromScontrol("NodeAddr= x").status().message(), HasSubstr("no NodeAddr="));
}

TEST(ClusterEnv, EachRoleGetsItsCommandLine) {
  LaunchOptions o;
  o.master_program = "/bin/master";
  o.worker_program = "/bin/worker";
  o.master_args = {"--batches", "2"};
  o.shared_args = {"--token-file", "t"};
  o.worker_args = {"--threads", "1"};
  o.master_address = "10.0.0.1:29500";
  o.worker_listen = "10.0.0.2:0";
  auto master = RoleFromEnvironment(Torchrun(0, 3)).value();
  EXPECT_THAT(RoleCommand(master, o),
              ElementsAre("/bin/master", "--batches", "2", "--token-file", "t", "--listen",
                          "10.0.0.1:29500", "--workers", "worker1,worker2"));
  o.spares = 1;  // the last worker rank stands by
  EXPECT_THAT(RoleCommand(master, o),
              ElementsAre("/bin/master", "--batches", "2", "--token-file", "t", "--listen",
                          "10.0.0.1:29500", "--workers", "worker1", "--spares", "worker2"));
  auto worker = RoleFromEnvironment(Torchrun(2, 3)).value();
  EXPECT_THAT(RoleCommand(worker, o),
              ElementsAre("/bin/worker", "--token-file", "t", "--threads", "1", "--name",
                          "worker2", "--master", "10.0.0.1:29500", "--listen", "10.0.0.2:0"));
}

TEST(ClusterEnv, AddressesOfThisHost) {
  EXPECT_EQ(JoinHostPort("10.0.0.1", 5), "10.0.0.1:5");
  EXPECT_EQ(JoinHostPort("fe80::1", 5), "[fe80::1]:5");
  EXPECT_TRUE(IsIpLiteral("127.0.0.1"));
  EXPECT_TRUE(IsIpLiteral("::1"));
  EXPECT_FALSE(IsIpLiteral("n1"));
  EXPECT_EQ(ResolveHost("127.0.0.1").value(), "127.0.0.1");
  EXPECT_EQ(ResolveHost("localhost").value(), "127.0.0.1");
  EXPECT_THAT(ResolveHost("no-such-host.invalid").status().message(),
              HasSubstr("cannot resolve host 'no-such-host.invalid'"));
  EXPECT_EQ(LocalAddressToward("127.0.0.1", 29500).value(), "127.0.0.1");
  EXPECT_TRUE(CheckLocalAddress("127.0.0.1").ok());
  // 192.0.2.0/24 is TEST-NET-1: never an address of this host.
  EXPECT_THAT(CheckLocalAddress("192.0.2.1").message(), HasSubstr("not an address of this host"));
}

}  // namespace
}  // namespace remora::launch
