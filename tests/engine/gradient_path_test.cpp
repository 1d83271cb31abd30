// GradientPath on its own (no engine): gradients of several micro-batches and
// ranks reach the fp32 accumulator as their mean, against a double reference,
// on every grad tier; the NVMe accumulator holds the same bits as the CPU one;
// each block's squared norm is its accumulator's; a non-finite gradient is
// flagged; stages 0-1 (all-reduce) and 2-3 (reduce-scatter) agree.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../../engine/src/gradient_path.h"
#include "../nvme/nvme_test_util.h"
#include "tierzero/testing/ranks.h"

namespace tz::detail {
namespace {

const std::vector<BlockSpec> kModel = {{"a", {{"w", {48, 40}}}}, {"b", {{"w", {300}}, {"bias", {17}}}}};
constexpr int kGas = 3;

// The gradient rank r's micro-batch m gives element i of block b.
float grad_value(int r, int m, std::size_t b, std::uint64_t i) {
  const std::uint64_t h = splitmix64((static_cast<std::uint64_t>(r) << 40) ^ (static_cast<std::uint64_t>(m) << 32) ^
                                     (b << 24) ^ i);
  return static_cast<float>(static_cast<double>(h >> 11) / 9007199254740992.0 - 0.5);
}

// One rank's path and everything it needs, on the Host backend.
struct Rig {
  std::unique_ptr<Device> device = create_host_device();
  std::unique_ptr<Stream> comm_stream = device->create_stream().value();
  std::unique_ptr<Stream> d2h_stream = device->create_stream().value();
  std::unique_ptr<MemoryPool> device_pool = make_device_pool(*device, 64 << 20).value();
  std::unique_ptr<MemoryPool> host_pool = make_host_pool(*device, 64 << 20, {}).value();
  tzt::TempDir dir;
  std::unique_ptr<nvme::SwapStore> swap;
  NvmeTraffic traffic;
  ModelLayout layout;
  std::unique_ptr<TieredStore> grad;
  std::unique_ptr<cpu_adam::CpuOptimizer> cpu_opt = cpu_adam::CpuOptimizer::create({}).value();
  Timeline timeline;
  TaskThread comm_thread{"comm"}, grad_thread{"grad"};
  std::unique_ptr<GradientPath> path;

  Rig(Communicator& comm, Tier tier, int stage) {
    layout = ModelLayout::make(kModel, comm.size(), 0).value();
    swap = nvme::SwapStore::create({.paths = {dir.path()}, .capacity_bytes = 8 << 20, .allow_buffered = true}).value();
    std::vector<ShardSpec> shards;
    for (const BlockLayout& b : layout.blocks) shards.push_back({b.name, b.shard_numel});
    grad = TieredStore::create({.state = StateClass::kGrad, .tier = tier, .elem_bytes = 4, .colour = Colour::kGrad,
                                .device = device.get(), .device_pool = device_pool.get(),
                                .host_pool = host_pool.get(), .swap = swap.get(), .traffic = &traffic},
                               shards)
               .value();
    path = std::make_unique<GradientPath>(GradientPathDeps{
        .device = device.get(), .comm = &comm, .comm_thread = &comm_thread, .grad_thread = &grad_thread,
        .comm_stream = comm_stream.get(), .d2h_stream = d2h_stream.get(), .device_pool = device_pool.get(),
        .host_pool = host_pool.get(), .grad = grad.get(), .cpu_opt = cpu_opt.get(), .layout = &layout,
        .grad_type = DType::kFp32, .stage = stage, .gradient_accumulation_steps = kGas, .timeline = &timeline});
  }
  ~Rig() { (void)path->wait(); }

  // Every micro-batch of one window through the path, blocks in backward order.
  Status run_window(int rank, float poison = 0) {
    for (int m = 0; m < kGas; ++m) {
      for (std::size_t b = layout.blocks.size(); b-- > 0;) {
        const BlockLayout& bl = layout.blocks[b];
        TZ_ASSIGN_OR_RETURN(PoolBlock whole, device_pool->allocate(bl.whole_numel * 4));
        auto* g = whole.as<float>();
        for (std::uint64_t i = 0; i < bl.whole_numel; ++i) g[i] = grad_value(rank, m, b, i);
        if (poison != 0 && m == 1 && b == 1) g[5] = poison;
        TZ_TRY(path->reduce(b, std::move(whole), m == 0));
      }
    }
    return path->wait();
  }
  std::vector<float> shard(std::size_t b) {
    std::vector<float> out(layout.blocks[b].shard_numel);
    EXPECT_TRUE(grad->get(b, out.data(), *d2h_stream).ok());
    return out;
  }
};

// The accumulator of `rank` (of `world`) against the mean in double; the
// squared norm against the accumulator's. "" when all hold.
std::string check_rank(Rig& rig, int rank, int world) {
  for (std::size_t b = 0; b < rig.layout.blocks.size(); ++b) {
    const BlockLayout& bl = rig.layout.blocks[b];
    const std::vector<float> got = rig.shard(b);
    double sum_squares = 0;
    for (std::uint64_t j = 0; j < bl.shard_numel; ++j) {
      const std::uint64_t i = static_cast<std::uint64_t>(rank) * bl.shard_numel + j;
      double want = 0;
      for (int r = 0; r < world; ++r) {
        for (int m = 0; m < kGas; ++m) want += grad_value(r, m, b, i);
      }
      want /= world * kGas;
      if (std::fabs(got[j] - want) > 1e-6) return fmt::format("block {} element {}: {} vs {}", b, i, got[j], want);
      sum_squares += static_cast<double>(got[j]) * got[j];
    }
    // cpu_adam sums the squares in fp32 lanes: a few fp32 ulps of the total.
    if (std::fabs(rig.path->sum_squares(b) - sum_squares) > 1e-6 * sum_squares) {
      return fmt::format("block {}: squared norm {} vs {}", b, rig.path->sum_squares(b), sum_squares);
    }
    if (rig.path->non_finite(b)) return fmt::format("block {} flagged non-finite", b);
  }
  return "";
}

TEST(GradientPath, OneRankAccumulatesTheMeanOnEveryTierAndNvmeHoldsTheSameBits) {
  auto comm = create_communicator({}).value();
  std::vector<std::vector<float>> cpu_bits;
  for (Tier tier : {Tier::kCpu, Tier::kNvme, Tier::kGpu}) {
    SCOPED_TRACE(tier_name(tier));
    Rig rig(*comm, tier, 3);
    ASSERT_TRUE(rig.run_window(0).ok());
    const std::uint64_t read = rig.traffic.read_bytes, written = rig.traffic.write_bytes;
    EXPECT_EQ(check_rank(rig, 0, 1), "");
    for (std::size_t b = 0; b < rig.layout.blocks.size(); ++b) {
      if (tier == Tier::kCpu) {
        cpu_bits.push_back(rig.shard(b));
      } else {
        const std::vector<float> got = rig.shard(b);
        EXPECT_EQ(std::memcmp(got.data(), cpu_bits[b].data(), got.size() * 4), 0) << "block " << b;
      }
    }
    // NVMe: each micro-batch but the first reads the accumulator, each writes it.
    std::uint64_t shard_bytes = 0;
    for (const BlockLayout& b : rig.layout.blocks) shard_bytes += b.shard_numel * 4;
    EXPECT_EQ(written, tier == Tier::kNvme ? kGas * shard_bytes : 0);
    EXPECT_EQ(read, tier == Tier::kNvme ? (kGas - 1) * shard_bytes : 0);
  }
}

TEST(GradientPath, ANonFiniteGradientIsFlaggedForItsBlockOnly) {
  auto comm = create_communicator({}).value();
  Rig rig(*comm, Tier::kCpu, 3);
  ASSERT_TRUE(rig.run_window(0, std::numeric_limits<float>::infinity()).ok());
  EXPECT_FALSE(rig.path->non_finite(0));
  EXPECT_TRUE(rig.path->non_finite(1));
  rig.path->set_zero(1);
  EXPECT_FALSE(rig.path->non_finite(1));
  EXPECT_EQ(rig.path->sum_squares(1), 0);
}

// Two ranks over Gloo: the reduce-scatter (stage 3) and the all-reduce
// (stage 1) both leave each rank the mean over ranks and micro-batches.
TEST(GradientPath, TwoRanksReduceToTheMeanAtEveryStage) {
  for (const int stage : {1, 3}) {
    test::TempDir dir;
    const int port = test::next_port();
    const auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
      auto comm = create_communicator(test::test_options(rank, 2, dir.path(), port));
      if (!comm.ok()) return comm.status().to_string();
      Rig rig(**comm, Tier::kCpu, stage);
      if (Status s = rig.run_window(rank); !s.ok()) return s.to_string();
      return check_rank(rig, rank, 2);
    });
    SCOPED_TRACE(fmt::format("stage {}", stage));
    EXPECT_ALL_RANKS_PASS(outcomes);
  }
}

}  // namespace
}  // namespace tz::detail
