// The largest model that fits a machine, and the drive wear of a plan
// (offload/src/planner_sizing.cpp), against hand-computed numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "tierzero/offload.h"

namespace tz {
namespace {

// n parameters in 32 equal blocks (the first n % 32 one larger), as tierzero-estimate's --layers.
Expected<std::vector<std::uint64_t>> thirty_two_blocks(std::uint64_t n) {
  std::vector<std::uint64_t> blocks(32, n / 32);
  for (std::uint64_t i = 0; i < n % 32; ++i) ++blocks[i];
  return blocks;
}

// The H100 machine's budgets (bench/RESULTS.md): 80 GB of GPU, 112 GB of CPU, 52 GB of NVMe.
PlanInput h100_machine() {
  PlanInput in;
  in.gpu_bytes = 80'000'000'000;
  in.cpu_bytes = 112'000'000'000;
  in.nvme_bytes = 52'000'000'000;
  return in;
}

bool fits(PlanInput in, std::uint64_t params) {
  in.block_numel = thirty_two_blocks(params).value();
  return plan_placement(in).ok();
}

TEST(LargestModel, FitsAndTheNextSizeUpDoesNot) {
  const PlanInput in = h100_machine();
  const Expected<LargestModel> m = find_largest_model(in, thirty_two_blocks, 32, std::uint64_t{1} << 50, 1e-4);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_TRUE(m->plan.fits());
  EXPECT_EQ(m->plan.layout.model_numel, m->params);
  EXPECT_EQ(m->input.block_numel, thirty_two_blocks(m->params).value());
  ASSERT_GT(m->next_params, m->params);
  EXPECT_LE(static_cast<double>(m->next_params - m->params), 1e-4 * static_cast<double>(m->params));
  EXPECT_FALSE(fits(in, m->next_params));
  EXPECT_EQ(m->next_status.code(), ErrorCode::kOutOfMemory);
  // bench/RESULTS.md: 8.1B trained on that machine, 9B found no placement.
  EXPECT_GT(m->params, 8'000'000'000u);
  EXPECT_LT(m->params, 9'000'000'000u);
  std::printf("largest with fp32 states: %llu params\n", static_cast<unsigned long long>(m->params));
}

// remainder + int8 (10.16 B a parameter of states) against fp32 (18 B): more than twice the
// model. Not the 20B issue #21 asks for: off the GPU every parameter still costs 4 B of fp32
// gradient accumulator + 4.16 B of optimizer states, and 112 GB of CPU + 52 GB of NVMe
// (152.7 GiB) hold that, with the staging, for 17.0B; the GPU's room beyond the 16-bit
// parameters and NVMe's beyond the master cannot take a whole class (docs/placement.md).
TEST(LargestModel, CompactFormatsFitMoreThanTwiceTheModelOnTheH100Machine) {
  PlanInput in = h100_machine();
  const Expected<LargestModel> fp32 = find_largest_model(in, thirty_two_blocks, 32, std::uint64_t{1} << 50, 1e-4);
  in.states = {MasterFormat::kRemainder, MomentFormat::kInt8};
  const Expected<LargestModel> m = find_largest_model(in, thirty_two_blocks, 32, std::uint64_t{1} << 50, 1e-4);
  ASSERT_TRUE(fp32.ok() && m.ok()) << m.status().to_string();
  EXPECT_GT(m->params, 2 * fp32->params);
  EXPECT_GT(m->params, 16'900'000'000u);
  EXPECT_LT(m->params, 17'000'000'000u);
  EXPECT_FALSE(fits(in, m->next_params));
  EXPECT_EQ(m->plan.tier, (std::array<Tier, kNumStateClasses>{Tier::kGpu, Tier::kCpu, Tier::kNvme, Tier::kCpu}));
  std::printf("largest with remainder + int8: %llu params\n", static_cast<unsigned long long>(m->params));
}

TEST(LargestModel, TheUpperEndOfTheRangeIsAnAnswer) {
  PlanInput in = h100_machine();
  const Expected<LargestModel> m = find_largest_model(in, thirty_two_blocks, 32, 1'000'000, 1e-4);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->params, 1'000'000u);
  EXPECT_EQ(m->next_params, 0u);
}

TEST(LargestModel, NothingFittingIsTheSmallestModelsOutOfMemory) {
  PlanInput in = h100_machine();
  in.gpu_bytes = 1000;
  const Expected<LargestModel> m = find_largest_model(in, thirty_two_blocks, 1'000'000'000, 2'000'000'000, 1e-4);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), ErrorCode::kOutOfMemory);
  EXPECT_NE(m.status().message().find("no placement of 1.0B parameters"), std::string::npos) << m.status().message();
}

TEST(LargestModel, BadInputIsRefusedNotSearchedThrough) {
  const PlanInput in = h100_machine();
  EXPECT_EQ(find_largest_model(in, thirty_two_blocks, 10, 5).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(find_largest_model(in, thirty_two_blocks, 32, 64, 0.0).status().code(), ErrorCode::kInvalidArgument);
  const BlocksOf refuses = [](std::uint64_t n) -> Expected<std::vector<std::uint64_t>> {
    if (n > 1000) return invalid_argument("{} params: too many blocks", n);
    return std::vector<std::uint64_t>{n};
  };
  const Expected<LargestModel> m = find_largest_model(in, refuses, 1, std::uint64_t{1} << 40);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("too many blocks"), std::string::npos) << m.status().message();
  PlanInput bad = in;
  bad.ranks = 0;
  EXPECT_EQ(find_largest_model(bad, thirty_two_blocks, 32, 64).status().code(), ErrorCode::kInvalidArgument);
}

TEST(DriveEndurance, FromTbwOrFromDwpdCapacityAndYears) {
  const Expected<DriveEndurance> tbw = endurance_from_tbw(1200);
  ASSERT_TRUE(tbw.ok());
  EXPECT_EQ(tbw->rated_bytes, 1.2e15);
  EXPECT_EQ(tbw->source, "1200 TBW");
  // 1 drive write a day of 2 TB over 5 years of 365 days: 3650 TB.
  const Expected<DriveEndurance> dwpd = endurance_from_dwpd(1, 2'000'000'000'000, 5);
  ASSERT_TRUE(dwpd.ok());
  EXPECT_EQ(dwpd->rated_bytes, 3.65e15);
  EXPECT_EQ(dwpd->source, "1 DWPD x 2.00 TB x 365 days x 5 years = 3650 TBW");
  EXPECT_EQ(endurance_from_tbw(0).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(endurance_from_tbw(std::nan("")).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(endurance_from_dwpd(-1, 1, 5).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(endurance_from_dwpd(1, 0, 5).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(endurance_from_dwpd(1, 1, 0).status().code(), ErrorCode::kInvalidArgument);
}

// Params and optimizer on NVMe, two ranks on the node: each rank writes its
// new params (2 B) and master and moments (12 B) per element of its shard.
TEST(DriveWear, EveryRankOnTheNodeWritesToItsDrives) {
  PlanInput in;
  in.block_numel.assign(4, 250'000'000);
  in.ranks = 2;
  in.gpu_bytes = 7'000'000'000;
  in.cpu_bytes = 40'000'000'000;  // the grads stay in CPU memory
  in.nvme_bytes = 1'000'000'000'000;
  in.mode = PlacementMode::kDeepSpeed;
  in.offload_param = OffloadDevice::kNvme;
  in.offload_optimizer = OffloadDevice::kNvme;
  const Plan plan = plan_placement(in).value();
  // Shards: align_up(125e6, 2048) = 125'001'728, 4 of them: O = P = 500'006'912 per rank.
  constexpr std::uint64_t kShards = 500'006'912;
  ASSERT_EQ(plan.traffic.nvme_write_bytes, 14 * kShards);
  const DriveEndurance rating = endurance_from_tbw(600).value();
  const DriveWear w = drive_wear(plan, in, 100.0, rating);
  EXPECT_EQ(w.written_per_step_bytes, 2 * 14 * kShards);  // 14'000'193'536 a step
  EXPECT_DOUBLE_EQ(w.written_per_hour_bytes, 14'000'193'536.0 * 36);
  EXPECT_DOUBLE_EQ(w.days_to_rating, 6e14 / (14'000'193'536.0 * 36 * 24));  // 49.6 days
  EXPECT_DOUBLE_EQ(nvme_bound_seconds(plan, in),
                   static_cast<double>(plan.traffic.nvme_read_bytes + plan.traffic.nvme_write_bytes) / 2e9);
  // Each rank on a node of its own: half the writes on each node's drives.
  in.ranks_per_node = 1;
  EXPECT_EQ(drive_wear(plan, in, 100.0, rating).written_per_step_bytes, 14 * kShards);
}

TEST(DriveWear, APlanThatWritesNothingWearsNothing) {
  PlanInput in;
  in.block_numel.assign(4, 1'000'000);
  in.gpu_bytes = in.cpu_bytes = in.nvme_bytes = 1'000'000'000'000;
  const Plan plan = plan_placement(in).value();
  ASSERT_EQ(plan.traffic.nvme_write_bytes, 0u);
  const DriveWear w = drive_wear(plan, in, 1.0, endurance_from_tbw(1).value());
  EXPECT_EQ(w.written_per_step_bytes, 0u);
  EXPECT_EQ(w.written_per_hour_bytes, 0.0);
  EXPECT_TRUE(std::isinf(w.days_to_rating));
}

}  // namespace
}  // namespace tz
