// Note [Accumulating on the device across micro-batches] (gradient_path.cpp),
// forced onto the Host backend (ZeroOptions::grads_on_device_across_micro_batches),
// where device memory is host memory and the accumulation kernel is the CUDA
// kernel's CPU twin: training is the host path's bit for bit (every placement
// the CPU optimizer steps, 2 and 3 micro-batches, clipping biting, 1 and 2
// ranks), the gradients come down once a step (4 B an element instead of 2
// per micro-batch), the GPU budget decides how many blocks take part, a block
// the window's last micro-batch skips is brought down at the step, and a
// checkpoint load forgets a window's partial sums.
#include <gtest/gtest.h>

#include <cstring>

#include "tierzero/cpu_adam.h"
#include "tierzero/testing/engine.h"
#include "../nvme/nvme_test_util.h"

namespace tzt {
namespace {

using tz::Tier;

constexpr tz::mlp::MlpConfig kMlp{.layers = 3, .hidden = 96, .batch = 6, .seed = 57};
constexpr int kSteps = 20;
constexpr double kClip = 0.05;  // small enough that clipping scales most steps (checked)

// The placements the CPU optimizer steps (param16, grad, master, moments).
const Placement kPlacements[] = {
    {Tier::kGpu, Tier::kCpu, Tier::kCpu, Tier::kCpu},
    {Tier::kCpu, Tier::kCpu, Tier::kCpu, Tier::kCpu},
    {Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme},
    {Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kNvme},
};

tz::Config config_for(const std::string& nvme, int gas) {
  tz::Config config = test_config(nvme, 3, gas);
  config.gradient_clipping = kClip;
  return config;
}

struct Run {
  RunBits bits;
  tz::StepReport last;  // of one more step after the recorded ones
};

tz::Expected<Run> train(tz::ZeroEngine& engine, int gas) {
  Run run;
  TZ_ASSIGN_OR_RETURN(run.bits, train_for_bits(engine, kMlp, kSteps, gas));
  for (int micro = 0; micro < gas; ++micro) {
    TZ_TRY(tz::mlp::train_micro_batch(engine, kMlp, tz::mlp::make_batch(kMlp, engine.rank(), micro, kSteps)).status());
    TZ_ASSIGN_OR_RETURN(run.last, engine.step());
  }
  return run;
}

tz::Expected<Run> run(const std::string& nvme, const Placement& placement, bool window, int gas,
                      tz::Communicator* comm = nullptr) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> engine,
                      tz::ZeroEngine::create({.config = config_for(nvme, gas), .comm = comm, .placement = placement,
                                              .grads_on_device_across_micro_batches = window},
                                             tz::mlp::model(kMlp), tz::mlp::init(kMlp)));
  return train(*engine, gas);
}

int clipped_steps(const RunBits& r) {
  int n = 0;
  for (double norm : r.grad_norms) n += norm > kClip;
  return n;
}

std::uint64_t shard_numel(const tz::ZeroEngine& engine) {
  std::uint64_t n = 0;
  for (const tz::BlockLayout& b : engine.layout().blocks) n += b.shard_numel;
  return n;
}

TEST(GradWindow, EveryPlacementTrainsBitForBitAsTheHostPathAndBringsGradientsDownOnce) {
  TZ_REQUIRE_FUSED_CPU_ADAM();
  for (const Placement& placement : kPlacements) {
    for (int gas : {2, 3}) {
      SCOPED_TRACE(fmt::format("{}, {} micro-batches", placement_name(placement), gas));
      TempDir nvme;
      const auto host = run(nvme.path(), placement, false, gas);
      const auto device = run(nvme.path(), placement, true, gas);
      ASSERT_TRUE(host.ok() && device.ok()) << (host.ok() ? device.status() : host.status()).to_string();
      EXPECT_GE(clipped_steps(host->bits), kSteps / 2) << "clipping must bite for this test to mean anything";
      EXPECT_EQ(first_difference(host->bits, device->bits), "");
      EXPECT_EQ(host->last.grad_window_blocks, 0U);
      EXPECT_EQ(device->last.grad_window_blocks, 3U);  // every block: the default budget holds them all
      // bf16 gradients: 2 B an element per micro-batch on the host path, 4 B once through the window.
      TempDir layout_dir;
      auto engine = tz::ZeroEngine::create({.config = config_for(layout_dir.path(), gas), .placement = placement},
                                           tz::mlp::model(kMlp), tz::mlp::init(kMlp));
      ASSERT_TRUE(engine.ok()) << engine.status().to_string();
      const std::uint64_t n = shard_numel(**engine);
      EXPECT_EQ(host->last.d2h_bytes, 2 * n * static_cast<std::uint64_t>(gas));
      EXPECT_EQ(device->last.d2h_bytes, 4 * n);
      const auto per = [n](std::uint64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(n); };
      std::printf("[ window ] %-40s G=%d  B/element a step, host path / device window: D2H %.2f / %.2f, "
                  "NVMe read %.2f / %.2f, write %.2f / %.2f\n",
                  placement_name(placement).c_str(), gas, per(host->last.d2h_bytes), per(device->last.d2h_bytes),
                  per(host->last.nvme_read_bytes), per(device->last.nvme_read_bytes),
                  per(host->last.nvme_write_bytes), per(device->last.nvme_write_bytes));
    }
  }
}

TEST(GradWindow, TwoRanksTrainBitForBitAsTheHostPath) {
  TZ_REQUIRE_FUSED_CPU_ADAM();
  for (const Placement& placement : {kPlacements[1], kPlacements[3]}) {
    TempDir dir;
    const auto codes = run_engine_ranks(2, dir.path(), [&](const tz::RankInfo& info, tz::Communicator* comm, const std::string& nvme) {
      const auto host = run(nvme, placement, false, 3, comm);
      const auto device = run(nvme, placement, true, 3, comm);
      if (!host.ok() || !device.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", info.rank, (host.ok() ? device.status() : host.status()).to_string().c_str());
        return 1;
      }
      const std::string diff = first_difference(host->bits, device->bits);
      if (!diff.empty()) std::fprintf(stderr, "rank %d: %s\n", info.rank, diff.c_str());
      if (clipped_steps(host->bits) < kSteps / 2) return 3;
      if (device->last.grad_window_blocks != 3) return 4;
      return diff.empty() ? 0 : 2;
    });
    for (int r = 0; r < 2; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << ", " << placement_name(placement);
  }
}

// With room for one block's accumulator beyond what the plan needs, only the
// block backward reaches first (the last) takes part; the run is still the
// host path's, and the plan lists what the accumulators take.
TEST(GradWindow, OnlyTheBlocksTheGpuBudgetHoldsAccumulateOnTheDevice) {
  TZ_REQUIRE_FUSED_CPU_ADAM();
  const Placement placement = kPlacements[1];
  TempDir nvme;
  tz::Config config = config_for(nvme.path(), 3);
  auto probe = tz::ZeroEngine::create({.config = config, .placement = placement,
                                       .grads_on_device_across_micro_batches = false},
                                      tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(probe.ok()) << probe.status().to_string();
  const std::uint64_t need = (*probe)->plan().usage_of(Tier::kGpu).need_bytes;
  const std::uint64_t last_block = (*probe)->layout().blocks.back().shard_numel * 4;
  probe->reset();
  config.tiers.gpu = tz::ByteBudget::of(need + last_block + last_block / 2);
  auto engine = tz::ZeroEngine::create({.config = config, .placement = placement,
                                        .grads_on_device_across_micro_batches = true},
                                       tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  bool listed = false;
  for (const auto& item : (*engine)->plan().usage_of(Tier::kGpu).breakdown) {
    listed = listed || (item.what.find("1 of 3 blocks") != std::string::npos && item.bytes >= last_block);
  }
  EXPECT_TRUE(listed) << "the plan lists the device accumulators";
  const auto some = train(**engine, 3);
  const auto host = run(nvme.path(), placement, false, 3);
  ASSERT_TRUE(some.ok() && host.ok()) << (some.ok() ? host.status() : some.status()).to_string();
  EXPECT_EQ(some->last.grad_window_blocks, 1U);
  EXPECT_EQ(first_difference(host->bits, some->bits), "");
}

// The planner (tierzero-estimate) counts what the engine adds to its plan:
// the same blocks, the same bytes, and the traffic it saves. A config on the
// Host backend turns the planner's count off, as the engine's "unset".
TEST(GradWindow, ThePlannerCountsWhatTheEngineAddsToItsPlan) {
  TempDir nvme;
  // The config's own placement (the plan's numbers are its): params and optimizer on NVMe.
  tz::Config config = deepspeed_nvme_config(nvme.path(), 3);
  config.gradient_clipping = kClip;
  auto e = tz::ZeroEngine::create({.config = config, .grads_on_device_across_micro_batches = true},
                                  tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  const tz::Plan& engine_plan = (*e)->plan();
  const tz::ResolvedBudgets budgets = budgets_of(engine_plan);
  const auto plan_with = [&](bool window) {
    tz::PlanInput in = tz::PlanInput::from_config(config, (*e)->layout().block_numel(), 1, 0, budgets);
    in.grads_on_device_across_micro_batches = window;
    return tz::plan_placement(in);
  };
  const auto planned = plan_with(true), without = plan_with(false);
  ASSERT_TRUE(planned.ok() && without.ok()) << (planned.ok() ? without.status() : planned.status()).to_string();
  ASSERT_EQ(planned->tier, engine_plan.tier);
  const auto item = [](const tz::Plan& plan) -> std::uint64_t {
    for (const tz::NeedItem& i : plan.usage_of(Tier::kGpu).breakdown) {
      if (i.what.find("gradient accumulators across micro-batches") != std::string::npos) return i.bytes;
    }
    return 0;
  };
  EXPECT_EQ(planned->grad_window_blocks, 3U);
  EXPECT_GT(item(*planned), 0U);
  EXPECT_EQ(item(*planned), item(engine_plan));
  EXPECT_EQ(item(*without), 0U);
  // bf16 gradients, G = 3: D2H 2 B x 3 -> 4 B per element (grads on NVMe would
  // also be written and read once instead of three times: GradWindow.Every* measures it).
  const std::uint64_t n = planned->grad_window_numel;
  EXPECT_EQ(n, shard_numel(**e));
  EXPECT_EQ(without->traffic.d2h_bytes - planned->traffic.d2h_bytes, 2 * n);
  EXPECT_EQ(without->traffic.nvme_read_bytes - planned->traffic.nvme_read_bytes,
            planned->tier_of(tz::StateClass::kGrad) == Tier::kNvme ? 8 * n : 0);
  config.backend = tz::BackendChoice::kHost;
  EXPECT_FALSE(tz::PlanInput::from_config(config, (*e)->layout().block_numel(), 1, 0, budgets)
                   .grads_on_device_across_micro_batches);
}

// Windows by hand (2 micro-batches). A micro-batch through the MLP, then a
// checkpoint load (from before it): its partial sums must be forgotten.
// Window A reduces only block 0, in both micro-batches: blocks 1 and 2 have
// no gradient this step (a stale device sum brought down would give them
// one). Window B reduces every block first and only block 0 last, so blocks 1
// and 2 are still on the device when step() comes (window_norms() brings
// them down).
tz::Status reduce_block0(tz::ZeroEngine& engine, int seed) {
  TZ_ASSIGN_OR_RETURN(tz::GradBlock g, engine.grad_buffer(0));
  auto* data = static_cast<std::uint16_t*>(g.data());
  for (std::size_t i = 0; i < engine.layout().blocks[0].whole_numel; ++i) {
    data[i] = static_cast<std::uint16_t>(0x3c00 + (i * 37 + seed) % 512);  // bf16 values around 0.01
  }
  TZ_TRY(engine.reduce_grads(std::move(g)));
  return engine.step().status();
}

tz::Expected<std::vector<std::uint32_t>> hand_windows(bool window, const std::string& nvme) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> engine,
                      tz::ZeroEngine::create({.config = config_for(nvme, 2), .placement = kPlacements[1],
                                              .grads_on_device_across_micro_batches = window},
                                             tz::mlp::model(kMlp), tz::mlp::init(kMlp)));
  const std::string ckpt = nvme + "/ckpt-" + (window ? "device" : "host");
  TZ_TRY(engine->save_checkpoint(ckpt, tz::CheckpointSave{.tag = "start"}).status());
  TZ_TRY(tz::mlp::train_micro_batch(*engine, kMlp, tz::mlp::make_batch(kMlp, 0, 0, 99)).status());
  TZ_TRY(engine->step().status());
  TZ_TRY(engine->load_checkpoint(ckpt, tz::CheckpointLoad{.tag = "start"}).status());
  TZ_TRY(reduce_block0(*engine, 1));  // window A
  TZ_TRY(reduce_block0(*engine, 2));
  TZ_TRY(tz::mlp::train_micro_batch(*engine, kMlp, tz::mlp::make_batch(kMlp, 0, 0, 3)).status());  // window B
  TZ_TRY(engine->step().status());
  TZ_TRY(reduce_block0(*engine, 4));
  return master_bits(*engine);
}

TEST(GradWindow, BlocksTheLastMicroBatchSkipsAndALoadMidWindowStepAsTheHostPath) {
  TZ_REQUIRE_FUSED_CPU_ADAM();
  TempDir nvme;
  const auto host = hand_windows(false, nvme.path());
  const auto device = hand_windows(true, nvme.path());
  ASSERT_TRUE(host.ok() && device.ok()) << (host.ok() ? device.status() : host.status()).to_string();
  ASSERT_EQ(host->size(), device->size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < host->size(); ++i) differ += (*host)[i] != (*device)[i];
  EXPECT_EQ(differ, 0U) << "master elements that differ from the host path";
}

}  // namespace
}  // namespace tzt
