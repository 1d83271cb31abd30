// OptimizerPass on its own (no engine): the CPU pass over states on any tier
// and in any number of sub-groups leaves the same bits as cpu_adam stepping
// each block's shard in ordinary memory: the staging, the offsets in a
// sub-group, the pipelined reads and writes and the 16-bit copy-out move
// exactly what the kernel computed. Each NVMe state is read once and written
// once per step (gradients read only).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "../../engine/src/optimizer_pass.h"
#include "../nvme/nvme_test_util.h"
#include "tierzero/kernels.h"

namespace tz::detail {
namespace {

const std::vector<BlockSpec> kModel = {{"a", {{"w", {64, 70}}}}, {"b", {{"w", {3000}}}}, {"c", {{"w", {40, 40}}}},
                                       {"d", {{"w", {5000}}, {"bias", {10}}}}};
const cpu_adam::Hyper kHyper{.algorithm = cpu_adam::Algorithm::kAdamW, .lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999,
                             .eps = 1e-8, .weight_decay = 0.01};

float value(int state, std::size_t b, std::uint64_t i) {
  std::mt19937 rng(static_cast<unsigned>(state * 1000003 + b * 7919 + i));
  const float x = std::uniform_real_distribution<float>(-1, 1)(rng);
  return state == 3 ? x * x : x;  // exp_avg_sq >= 0
}

struct States {
  std::vector<std::vector<float>> master, grad, exp_avg, exp_avg_sq;
  std::vector<std::vector<std::uint16_t>> param16;
};

// Every state of every block, as fresh values (state: 0 master, 1 grad, 2 exp_avg, 3 exp_avg_sq).
States initial(const ModelLayout& layout) {
  States s;
  for (std::size_t b = 0; b < layout.blocks.size(); ++b) {
    const std::uint64_t n = layout.blocks[b].shard_numel;
    auto fill = [&](int k) {
      std::vector<float> v(n);
      for (std::uint64_t i = 0; i < n; ++i) v[i] = value(k, b, i);
      return v;
    };
    s.master.push_back(fill(0));
    s.grad.push_back(fill(1));
    s.exp_avg.push_back(fill(2));
    s.exp_avg_sq.push_back(fill(3));
    s.param16.emplace_back(n, 0);
  }
  return s;
}

// The pass over stores on the given tiers, after `steps` steps; the states read back.
States run_pass(Tier param_tier, Tier state_tier, std::uint64_t sub_group_size, int steps, NvmeTraffic* traffic_out) {
  auto device = create_host_device();
  auto stream = device->create_stream().value();
  auto device_pool = make_device_pool(*device, 64 << 20).value();
  auto host_pool = make_host_pool(*device, 64 << 20, {}).value();
  tzt::TempDir dir;
  auto swap = nvme::SwapStore::create({.paths = {dir.path()}, .capacity_bytes = 16 << 20, .allow_buffered = true}).value();
  NvmeTraffic traffic;
  const ModelLayout layout = ModelLayout::make(kModel, 1, 0).value();
  std::vector<ShardSpec> shards;
  for (const BlockLayout& b : layout.blocks) shards.push_back({b.name, b.shard_numel});
  auto store = [&](StateClass cls, Tier tier, std::size_t bytes, Colour colour) {
    return TieredStore::create({.state = cls, .tier = tier, .elem_bytes = bytes, .colour = colour,
                                .device = device.get(), .device_pool = device_pool.get(),
                                .host_pool = host_pool.get(), .swap = swap.get(), .traffic = &traffic},
                               shards)
        .value();
  };
  auto param16 = store(StateClass::kParam16, param_tier, 2, Colour::kParam16);
  auto grad = store(StateClass::kGrad, state_tier, 4, Colour::kGrad);
  auto master = store(StateClass::kMaster, state_tier, 4, Colour::kMaster);
  auto exp_avg = store(StateClass::kMoments, state_tier, 4, Colour::kExpAvg);
  auto exp_avg_sq = store(StateClass::kMoments, state_tier, 4, Colour::kExpAvgSq);
  States s = initial(layout);
  for (std::size_t b = 0; b < layout.blocks.size(); ++b) {
    EXPECT_TRUE(master->put(b, s.master[b].data(), *stream).ok());
    EXPECT_TRUE(grad->put(b, s.grad[b].data(), *stream).ok());
    EXPECT_TRUE(exp_avg->put(b, s.exp_avg[b].data(), *stream).ok());
    EXPECT_TRUE(exp_avg_sq->put(b, s.exp_avg_sq[b].data(), *stream).ok());
  }
  auto cpu_opt = cpu_adam::CpuOptimizer::create({}).value();
  Timeline timeline;
  auto pass = OptimizerPass::make({.device = device.get(), .stream = stream.get(), .device_pool = device_pool.get(),
                                   .host_pool = host_pool.get(), .param16 = param16.get(), .grad = grad.get(),
                                   .master = master.get(), .exp_avg = exp_avg.get(), .exp_avg_sq = exp_avg_sq.get(),
                                   .cpu_opt = cpu_opt.get(), .layout = &layout, .param_type = DType::kBf16,
                                   .sub_group_size = sub_group_size, .timeline = &timeline},
                                  /*on_gpu=*/false);
  traffic.reset();
  for (int step = 1; step <= steps; ++step) EXPECT_TRUE(pass->run(kHyper, step, 0.5).ok());
  if (traffic_out != nullptr) {
    traffic_out->read_bytes = traffic.read_bytes.load();
    traffic_out->write_bytes = traffic.write_bytes.load();
  }
  for (std::size_t b = 0; b < layout.blocks.size(); ++b) {
    EXPECT_TRUE(master->get(b, s.master[b].data(), *stream).ok());
    EXPECT_TRUE(exp_avg->get(b, s.exp_avg[b].data(), *stream).ok());
    EXPECT_TRUE(exp_avg_sq->get(b, s.exp_avg_sq[b].data(), *stream).ok());
    EXPECT_TRUE(param16->get(b, s.param16[b].data(), *stream).ok());
  }
  return s;
}

// cpu_adam on each block's shard in ordinary memory: what the pass must leave.
States in_memory(int steps) {
  const ModelLayout layout = ModelLayout::make(kModel, 1, 0).value();
  States s = initial(layout);
  auto cpu_opt = cpu_adam::CpuOptimizer::create({}).value();
  for (int step = 1; step <= steps; ++step) {
    for (std::size_t b = 0; b < layout.blocks.size(); ++b) {
      const cpu_adam::Spans spans{.n = layout.blocks[b].shard_numel, .param = s.master[b].data(),
                                  .grad = s.grad[b].data(), .grad_dtype = DType::kFp32,
                                  .exp_avg = s.exp_avg[b].data(), .exp_avg_sq = s.exp_avg_sq[b].data(),
                                  .param16 = s.param16[b].data(), .param16_dtype = DType::kBf16};
      EXPECT_TRUE(cpu_opt->step(kHyper, {.step = step, .grad_scale = 0.5}, spans).ok());
    }
  }
  return s;
}

void expect_same_bits(const States& got, const States& want, const std::string& what) {
  for (std::size_t b = 0; b < want.master.size(); ++b) {
    const std::size_t n = want.master[b].size();
    EXPECT_EQ(std::memcmp(got.master[b].data(), want.master[b].data(), n * 4), 0) << what << ": master of " << b;
    EXPECT_EQ(std::memcmp(got.exp_avg[b].data(), want.exp_avg[b].data(), n * 4), 0) << what << ": exp_avg of " << b;
    EXPECT_EQ(std::memcmp(got.exp_avg_sq[b].data(), want.exp_avg_sq[b].data(), n * 4), 0)
        << what << ": exp_avg_sq of " << b;
    EXPECT_EQ(std::memcmp(got.param16[b].data(), want.param16[b].data(), n * 2), 0) << what << ": param16 of " << b;
  }
}

TEST(OptimizerPass, EveryTierAndSubGroupingLeavesTheBitsOfCpuAdamInMemory) {
  const States want = in_memory(2);
  struct Case {
    Tier params, states;
    std::uint64_t sub_group_size;
    const char* what;
  };
  for (const Case& c : {Case{Tier::kCpu, Tier::kCpu, 1 << 20, "all in CPU memory, one sub-group"},
                        Case{Tier::kCpu, Tier::kNvme, 1 << 20, "states on NVMe, one sub-group"},
                        Case{Tier::kNvme, Tier::kNvme, 4096, "everything on NVMe, a sub-group a block"},
                        Case{Tier::kGpu, Tier::kNvme, 9000, "params on the device, states on NVMe, 2-3 blocks a group"},
                        Case{Tier::kGpu, Tier::kCpu, 1, "params on the device, one block a group"}}) {
    expect_same_bits(run_pass(c.params, c.states, c.sub_group_size, 2, nullptr), want, c.what);
  }
}

TEST(OptimizerPass, EachNvmeStateIsReadOnceAndWrittenOncePerStep) {
  NvmeTraffic traffic;
  (void)run_pass(Tier::kNvme, Tier::kNvme, 4096, 3, &traffic);
  const ModelLayout layout = ModelLayout::make(kModel, 1, 0).value();
  std::uint64_t numel = 0;
  for (const BlockLayout& b : layout.blocks) numel += b.shard_numel;
  // Read: master, grad, two moments (4 B each). Written: master, two moments, the bf16 parameters.
  EXPECT_EQ(traffic.read_bytes, 3 * numel * 16);
  EXPECT_EQ(traffic.write_bytes, 3 * numel * (12 + 2));
}

}  // namespace
}  // namespace tz::detail
