// The trainer's peak host memory as tierzero-estimate predicts it (Note [Peak
// RSS estimate] in train/src/host_memory.cpp): every byte the plan puts in
// host memory counted once, split into states and buffers; the activations
// and evaluation's buffers the CPU trainer's; neither, nor the device's, on CUDA.
#include "tierzero/train/host_memory.h"

#include <gtest/gtest.h>

#include <vector>

namespace tzt {
namespace {

using tz::train::GptConfig;

tz::Plan plan_for(const GptConfig& cfg, tz::OffloadDevice offload) {
  tz::Config config;
  config.zero.stage = 3;
  config.precision.bf16 = true;
  config.placement = tz::PlacementMode::kDeepSpeed;
  config.zero.offload_param.device = offload;
  config.zero.offload_optimizer.device = offload;
  std::vector<std::uint64_t> blocks;
  for (const tz::BlockSpec& b : tz::train::model(cfg)) {
    std::uint64_t n = 0;
    for (const tz::ParamSpec& p : b.params) n += p.numel();
    blocks.push_back(n);
  }
  const tz::ResolvedBudgets budgets{.gpu_bytes = 64ULL << 20, .cpu_bytes = 4ULL << 30, .nvme_bytes = 16ULL << 30};
  return tz::plan_placement(tz::PlanInput::from_config(config, blocks, 1, 0, budgets)).value();
}

TEST(HostMemory, CountsTheHostTiersActivationsCorpusAndBaseline) {
  const GptConfig cfg{.layers = 3, .hidden = 96, .heads = 4, .seq = 64, .batch = 3};
  for (tz::OffloadDevice offload : {tz::OffloadDevice::kCpu, tz::OffloadDevice::kNvme}) {
    const tz::Plan plan = plan_for(cfg, offload);
    const tz::train::HostMemoryEstimate m = tz::train::estimate_host_memory(cfg, plan, tz::BackendKind::kHost, 12345, 3);
    // The device tier is host memory on the CPU backend: both tiers, whole.
    EXPECT_EQ(m.state_bytes + m.buffer_bytes,
              plan.usage_of(tz::Tier::kGpu).per_rank_bytes + plan.usage_of(tz::Tier::kCpu).per_rank_bytes);
    std::uint64_t states = 0;
    for (auto s : {tz::StateClass::kParam16, tz::StateClass::kGrad, tz::StateClass::kMaster, tz::StateClass::kMoments}) {
      if (plan.tier_of(s) != tz::Tier::kNvme) states += plan.bytes_of(s);
    }
    EXPECT_EQ(m.state_bytes, states);
    EXPECT_GT(m.buffer_bytes, 0U);  // at least the gather window and the gradients in flight
    EXPECT_EQ(m.activation_bytes, cfg.activation_bytes());
    EXPECT_EQ(m.evaluation_bytes, cfg.evaluation_bytes(3));
    EXPECT_EQ(m.corpus_bytes, 12345U);
    EXPECT_EQ(m.runtime_bytes, tz::train::kRuntimeBaselineBytes);
    EXPECT_EQ(m.total_bytes(),
              m.state_bytes + m.buffer_bytes + m.activation_bytes + m.evaluation_bytes + m.corpus_bytes +
                  m.runtime_bytes);
    // A run that never evaluates holds no evaluation buffers.
    EXPECT_EQ(tz::train::estimate_host_memory(cfg, plan, tz::BackendKind::kHost, 12345, 0).evaluation_bytes, 0U);
  }
}

// States on NVMe are not resident, but need staging: offloading them moves
// bytes from states to buffers (for a model this small the staging, sized by
// whole sub-groups, can outweigh what it saves).
TEST(HostMemory, NvmeStatesCountOnlyThroughTheirStaging) {
  const GptConfig cfg{.layers = 3, .hidden = 96, .heads = 4, .seq = 64, .batch = 3};
  const tz::Plan cpu = plan_for(cfg, tz::OffloadDevice::kCpu);
  const tz::Plan nvme = plan_for(cfg, tz::OffloadDevice::kNvme);
  ASSERT_EQ(nvme.tier_of(tz::StateClass::kMaster), tz::Tier::kNvme);
  const auto on_cpu = tz::train::estimate_host_memory(cfg, cpu, tz::BackendKind::kHost, 0, 0);
  const auto on_nvme = tz::train::estimate_host_memory(cfg, nvme, tz::BackendKind::kHost, 0, 0);
  EXPECT_LT(on_nvme.state_bytes, on_cpu.state_bytes);
  EXPECT_GT(on_nvme.buffer_bytes, on_cpu.buffer_bytes);  // the NVMe staging
}

// On CUDA the device tier and the activations are GPU memory.
TEST(HostMemory, OnCudaOnlyTheCpuTierIsHostMemory) {
  const GptConfig cfg{.layers = 2, .hidden = 64, .heads = 4, .seq = 32, .batch = 2};
  const tz::Plan plan = plan_for(cfg, tz::OffloadDevice::kCpu);
  const auto m = tz::train::estimate_host_memory(cfg, plan, tz::BackendKind::kCuda, 0, 4);
  EXPECT_EQ(m.state_bytes + m.buffer_bytes, plan.usage_of(tz::Tier::kCpu).per_rank_bytes);
  EXPECT_EQ(m.activation_bytes, 0U);
  EXPECT_EQ(m.evaluation_bytes, 0U);
}

}  // namespace
}  // namespace tzt
