// The communicator's front door: names, rank discovery from the environment,
// backend choice, argument checks and the single-rank communicator. The
// multi-rank backends are tested in gloo_test.cpp and fault_test.cpp.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tierzero/testing/ranks.h"
#include "tierzero/comm/communicator.h"

namespace tz {
namespace {

// Every variable rank_info_from_env() or create_communicator() reads.
constexpr const char* kLauncherVars[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "TIERZERO_RENDEZVOUS_DIR",
};

// Clears every launcher variable, sets the given ones, and puts the caller's
// environment back at the end (the test may itself run under torchrun/mpirun).
class ScopedEnv {
 public:
  explicit ScopedEnv(const std::map<std::string, std::string>& vars) {
    for (const char* name : kLauncherVars) {
      const char* value = std::getenv(name);
      if (value != nullptr) saved_[name] = value;
      ::unsetenv(name);
    }
    for (const auto& [name, value] : vars) ::setenv(name.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const char* name : kLauncherVars) ::unsetenv(name);
    for (const auto& [name, value] : saved_) ::setenv(name.c_str(), value.c_str(), 1);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::map<std::string, std::string> saved_;
};

TEST(CommNames, BackendsAndDataTypes) {
  EXPECT_EQ(comm_backend_name(CommBackend::kAuto), "auto");
  EXPECT_EQ(comm_backend_name(CommBackend::kGloo), "gloo");
  EXPECT_EQ(comm_backend_name(CommBackend::kNccl), "nccl");
  const std::vector<std::pair<DType, std::size_t>> sizes = {
      {DType::kFp32, 4}, {DType::kBf16, 2}, {DType::kFp16, 2}, {DType::kFp64, 8},
      {DType::kInt32, 4},   {DType::kInt64, 8},    {DType::kUint8, 1}};
  for (const auto& [type, bytes] : sizes) {
    EXPECT_EQ(dtype_bytes(type), bytes) << dtype_name(type);
    EXPECT_NE(dtype_name(type), "unknown");
  }
  EXPECT_EQ(dtype_name(DType::kBf16), "bf16");
  EXPECT_EQ(dtype_bytes(static_cast<DType>(99)), 0u);
}

TEST(RankInfoFromEnv, DefaultsToRankZeroOfOne) {
  ScopedEnv env({});
  auto info = rank_info_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 0);
  EXPECT_EQ(info->world_size, 1);
  EXPECT_EQ(info->local_rank, 0);
  EXPECT_EQ(info->local_world_size, 1);
  EXPECT_EQ(info->master_addr, "127.0.0.1");
  EXPECT_EQ(info->master_port, 29500);
  EXPECT_EQ(info->source, "default");
}

TEST(RankInfoFromEnv, ReadsTorchrunVariables) {
  ScopedEnv env({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                 {"MASTER_ADDR", "node0.example"}, {"MASTER_PORT", "29611"}});
  auto info = rank_info_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 5);
  EXPECT_EQ(info->world_size, 8);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->local_world_size, 4);
  EXPECT_EQ(info->master_addr, "node0.example");
  EXPECT_EQ(info->master_port, 29611);
  EXPECT_EQ(info->source, "torchrun");
}

TEST(RankInfoFromEnv, WithoutLocalVariablesTheJobIsOneNode) {
  ScopedEnv env({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  auto info = rank_info_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->local_rank, 2);
  EXPECT_EQ(info->local_world_size, 3);
}

TEST(RankInfoFromEnv, ReadsOpenMpiVariables) {
  ScopedEnv env({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                 {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                 {"MASTER_ADDR", "10.0.0.1"}});
  auto info = rank_info_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 3);
  EXPECT_EQ(info->world_size, 4);
  EXPECT_EQ(info->local_rank, 1);
  EXPECT_EQ(info->local_world_size, 2);
  EXPECT_EQ(info->master_addr, "10.0.0.1");
  EXPECT_EQ(info->master_port, 29500);
  EXPECT_EQ(info->source, "mpirun (Open MPI)");
}

TEST(RankInfoFromEnv, ReadsPmiVariables) {
  ScopedEnv env({{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", "1"}});
  auto info = rank_info_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->rank, 1);
  EXPECT_EQ(info->world_size, 2);
  EXPECT_EQ(info->local_rank, 0);
  EXPECT_EQ(info->local_world_size, 1);
  EXPECT_EQ(info->source, "PMI");
}

TEST(RankInfoFromEnv, TorchrunWinsOverMpi) {
  ScopedEnv env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"}});
  auto info = rank_info_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->source, "torchrun");
  EXPECT_EQ(info->world_size, 2);
}

TEST(RankInfoFromEnv, EmptyValuesCountAsUnset) {
  ScopedEnv env({{"RANK", ""}, {"WORLD_SIZE", ""}, {"MASTER_PORT", ""}});
  auto info = rank_info_from_env();
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->source, "default");
  EXPECT_EQ(info->master_port, 29500);
}

// Each bad environment must be refused with InvalidArgument, and the message
// must name the variable (and its value) so the user knows what to fix.
struct BadEnv {
  std::map<std::string, std::string> vars;
  std::vector<std::string> message_has;
};

class RankInfoFromBadEnv : public ::testing::TestWithParam<BadEnv> {};

TEST_P(RankInfoFromBadEnv, IsInvalidArgumentNamingTheVariable) {
  ScopedEnv env(GetParam().vars);
  auto info = rank_info_from_env();
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), ErrorCode::kInvalidArgument) << info.status().to_string();
  for (const std::string& part : GetParam().message_has) {
    EXPECT_NE(info.status().message().find(part), std::string::npos)
        << "message lacks \"" << part << "\": " << info.status().message();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, RankInfoFromBadEnv,
    ::testing::Values(
        BadEnv{{{"RANK", "two"}, {"WORLD_SIZE", "4"}}, {"RANK", "two"}},
        BadEnv{{{"RANK", "1"}, {"WORLD_SIZE", "4x"}}, {"WORLD_SIZE", "4x"}},
        BadEnv{{{"RANK", " 1"}, {"WORLD_SIZE", "4"}}, {"RANK"}},
        BadEnv{{{"RANK", "4"}, {"WORLD_SIZE", "4"}}, {"RANK=4", "WORLD_SIZE=4"}},
        BadEnv{{{"RANK", "-1"}, {"WORLD_SIZE", "4"}}, {"RANK=-1"}},
        BadEnv{{{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {"WORLD_SIZE=0"}},
        BadEnv{{{"RANK", "1"}}, {"RANK", "WORLD_SIZE"}},
        BadEnv{{{"WORLD_SIZE", "2"}}, {"WORLD_SIZE", "RANK"}},
        BadEnv{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
               {"LOCAL_RANK=2"}},
        BadEnv{{{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}}, {"LOCAL_WORLD_SIZE=3"}},
        BadEnv{{{"MASTER_PORT", "70000"}}, {"MASTER_PORT=70000"}},
        BadEnv{{{"MASTER_PORT", "0"}}, {"MASTER_PORT=0"}},
        BadEnv{{{"MASTER_PORT", "http"}}, {"MASTER_PORT", "http"}},
        BadEnv{{{"OMPI_COMM_WORLD_RANK", "9"}, {"OMPI_COMM_WORLD_SIZE", "8"}}, {"OMPI_COMM_WORLD_RANK=9"}},
        BadEnv{{{"OMPI_COMM_WORLD_RANK", "0"}}, {"OMPI_COMM_WORLD_SIZE"}},
        BadEnv{{{"PMI_RANK", "x"}, {"PMI_SIZE", "2"}}, {"PMI_RANK", "x"}},
        BadEnv{{{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "3"}}, {"MPI_LOCALRANKID=3"}}));

TEST(CreateCommunicator, RefusesInconsistentRankInfo) {
  CommOptions options;
  options.ranks.rank = 2;
  options.ranks.world_size = 2;
  auto comm = create_communicator(options);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), ErrorCode::kInvalidArgument);
  options.ranks.rank = 0;
  options.ranks.master_port = 0;
  EXPECT_EQ(create_communicator(options).status().code(), ErrorCode::kInvalidArgument);
  options.ranks.master_port = 29500;
  options.timeout = std::chrono::milliseconds(0);
  EXPECT_EQ(create_communicator(options).status().code(), ErrorCode::kInvalidArgument);
}

TEST(CreateCommunicator, NcclNeedsACudaDeviceAndABuildWithNccl) {
  auto host = create_host_device();
  CommOptions options;
  options.backend = CommBackend::kNccl;
  options.device = host.get();
  auto comm = create_communicator(options);
  ASSERT_FALSE(comm.ok());
  // Unavailable in builds without NCCL (saying why), InvalidArgument in builds
  // with it (the device is not CUDA).
  EXPECT_TRUE(comm.status().code() == ErrorCode::kUnavailable || comm.status().code() == ErrorCode::kInvalidArgument)
      << comm.status().to_string();
  EXPECT_NE(comm.status().message().find("NCCL"), std::string::npos) << comm.status().message();
  std::printf("kNccl on the host device: %s\n", comm.status().to_string().c_str());
}

TEST(CreateCommunicator, AutoOnAHostDevicePicksGloo) {
  auto host = create_host_device();
  auto comm = create_communicator({.backend = CommBackend::kAuto, .device = host.get()});
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  EXPECT_EQ((*comm)->backend(), CommBackend::kGloo);
  EXPECT_EQ((*comm)->rank(), 0);
  EXPECT_EQ((*comm)->size(), 1);
  EXPECT_NE((*comm)->describe().find("rank 0 of 1"), std::string::npos) << (*comm)->describe();
}

TEST(SingleRank, CollectivesAreCopies) {
  auto created = create_communicator({});
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  Communicator& comm = **created;
  std::vector<float> send = {1.5F, -2.0F, 3.25F};
  std::vector<float> recv(3, 0.0F);
  ASSERT_TRUE(comm.all_gather(send.data(), recv.data(), 3, DType::kFp32).ok());
  EXPECT_EQ(recv, send);
  std::fill(recv.begin(), recv.end(), 0.0F);
  ASSERT_TRUE(comm.reduce_scatter(send.data(), recv.data(), 3, DType::kFp32, ReduceOp::kSum).ok());
  EXPECT_EQ(recv, send);
  ASSERT_TRUE(comm.all_reduce(send.data(), 3, DType::kFp32, ReduceOp::kMax).ok());
  EXPECT_EQ(send, (std::vector<float>{1.5F, -2.0F, 3.25F}));
  ASSERT_TRUE(comm.broadcast(send.data(), sizeof(float) * 3, 0).ok());
  ASSERT_TRUE(comm.all_gather(send.data(), send.data(), 3, DType::kFp32).ok());  // in place
  EXPECT_TRUE(comm.barrier().ok());
  EXPECT_TRUE(comm.all_gather(nullptr, nullptr, 0, DType::kInt64).ok());
}

TEST(SingleRank, RefusesBadArguments) {
  auto created = create_communicator({});
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  Communicator& comm = **created;
  std::vector<float> buf(8, 0.0F);
  Status bad_root = comm.broadcast(buf.data(), 4, 1);
  EXPECT_EQ(bad_root.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(bad_root.message().find("root 1"), std::string::npos) << bad_root.message();
  Status null_buffer = comm.all_reduce(nullptr, 4, DType::kFp32, ReduceOp::kSum);
  EXPECT_EQ(null_buffer.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(null_buffer.message().find("all_reduce of 4 fp32 (rank 0 of 1)"), std::string::npos)
      << null_buffer.message();
  Status overlap = comm.all_gather(buf.data() + 1, buf.data(), 4, DType::kFp32);
  EXPECT_EQ(overlap.code(), ErrorCode::kInvalidArgument) << overlap.to_string();
  EXPECT_EQ(comm.all_reduce(buf.data(), 4, static_cast<DType>(42), ReduceOp::kSum).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(comm.all_reduce(buf.data(), 4, DType::kFp32, static_cast<ReduceOp>(7)).code(),
            ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace tz
