// The MPI rendezvous (Note [MPI rendezvous]) from inside: this program runs
// under `mpirun -np 3` (ctest MpiRendezvousUnderMpirun), every rank running
// every test in the same order, and mpirun fails when any rank does. Ranks
// come from Open MPI's variables, as tierzero-train's do; no rendezvous
// directory is named, so they meet through MPI. Across hosts, a missing rank
// and the trainer's losses: tests/multinode/train_mpirun.sh.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <vector>

#include "tierzero/comm.h"

namespace tz {
namespace {

RankInfo ranks_from_mpirun() {
  auto ranks = rank_info_from_env();
  EXPECT_TRUE(ranks.ok()) << ranks.status().to_string();
  return ranks.ok() ? *ranks : RankInfo{};
}

void expect_rank_sum(Communicator& comm) {
  std::vector<std::int64_t> v(1000, comm.rank() + 1);
  ASSERT_TRUE(comm.all_reduce(v.data(), v.size(), DType::kInt64, ReduceOp::kSum).ok());
  const std::int64_t want = static_cast<std::int64_t>(comm.size()) * (comm.size() + 1) / 2;
  for (std::int64_t x : v) ASSERT_EQ(x, want);
}

TEST(MpiRendezvous, RanksStartedByMpirunMeetThroughMpiAndNoDirectory) {
  const RankInfo ranks = ranks_from_mpirun();
  ASSERT_EQ(ranks.source, "mpirun (Open MPI)");
  ASSERT_EQ(ranks.world_size, 3);
  auto comm = create_communicator({.backend = CommBackend::kGloo, .ranks = ranks, .timeout = std::chrono::seconds(60)});
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  expect_rank_sum(**comm);
  // The directory the file rendezvous would have used is not there.
  EXPECT_FALSE(std::filesystem::exists(
      fmt::format("/tmp/tierzero-rendezvous-{}-{}", ranks.master_addr, ranks.master_port)));
}

// MPI is initialised once per process; each communicator after the first
// meets on a fresh duplicate of MPI_COMM_WORLD, while the first still works.
TEST(MpiRendezvous, ASecondCommunicatorMeetsWhileTheFirstLives) {
  const RankInfo ranks = ranks_from_mpirun();
  auto first = create_communicator({.backend = CommBackend::kGloo, .ranks = ranks, .timeout = std::chrono::seconds(60)});
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  auto second = create_communicator({.backend = CommBackend::kGloo, .ranks = ranks, .timeout = std::chrono::seconds(60)});
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  expect_rank_sum(**second);
  expect_rank_sum(**first);
}

// A rank whose launcher variables disagree with what MPI says is refused,
// naming both, rather than meeting the wrong group.
TEST(MpiRendezvous, VariablesThatDisagreeWithMpiAreRefused) {
  RankInfo ranks = ranks_from_mpirun();
  ranks.rank = (ranks.rank + 1) % ranks.world_size;
  auto comm = create_communicator({.backend = CommBackend::kGloo, .ranks = ranks, .timeout = std::chrono::seconds(10)});
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(comm.status().message().find("the launcher's variables"), std::string::npos) << comm.status().to_string();
}

}  // namespace
}  // namespace tz
