// The placement planner against hand-computed numbers (docs/placement.md has
// the formulas). Shorthands used in the arithmetic below:
//   A(x)  = align_up(x, 2048)
//   P     = per-rank 16-bit param shard numel, Gd = grad numel, O = optimizer numel
//   ws    = stage-3 GPU working set = 2 B x (L + max(L, prefetch)) + 2 B x 4 x L + 2 B x 3 x L / ranks,
//           L = largest gathered block (ranks x shard)
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>

#include <string>
#include <vector>

#include "tierzero/offload.h"

namespace tz {
namespace {

constexpr std::uint64_t kHuge = 1'000'000'000'000'000;  // 1 PB: never the constraint

// 1e9 params in 4 blocks of 250e6: A(250e6) = 122071 x 2048 = 250'001'408 per block,
// so with 1 rank P = Gd = O = 4 x 250'001'408 = 1'000'005'632.
constexpr std::uint64_t kBlock1B = 250'001'408;
constexpr std::uint64_t kP1B = 1'000'005'632;
// ws for it: L = 250'001'408; window = L + max(L, 50e6) = 500'002'816,
// gather 2 x 500'002'816 = 1'000'005'632; gradients: the block in backward and 3 pending,
// whole, 4 x 2 x L = 2'000'011'264, and their reduced shards (1 rank: L) 3 x 2 x L = 1'500'008'448.
constexpr std::uint64_t kWs1B = 4'500'025'344;  // 1'000'005'632 + 2'000'011'264 + 1'500'008'448

PlanInput one_billion(std::uint64_t gpu, std::uint64_t cpu, std::uint64_t nvme) {
  PlanInput in;
  in.block_numel.assign(4, 250'000'000);
  in.gpu_bytes = gpu;
  in.cpu_bytes = cpu;
  in.nvme_bytes = nvme;
  return in;
}

std::string placement_text_for_test(const Plan& plan) {
  return fmt::format("params {}, master {}", tier_name(plan.tier_of(StateClass::kParam16)),
                     tier_name(plan.tier_of(StateClass::kMaster)));
}

Plan must_plan(const PlanInput& in) {
  Expected<Plan> plan = plan_placement(in);
  EXPECT_TRUE(plan.ok()) << plan.status().to_string();
  return plan.ok() ? *std::move(plan) : Plan{};
}

using Tiers = std::array<Tier, kNumStateClasses>;  // param16, grad, master, moments
constexpr Tier G = Tier::kGpu, C = Tier::kCpu, N = Tier::kNvme;

TEST(PlanPlacement, HugeBudgetsKeepEverythingOnGpu) {
  const Plan plan = must_plan(one_billion(kHuge, kHuge, kHuge));
  EXPECT_EQ(plan.tier, (Tiers{G, G, G, G}));
  EXPECT_EQ(plan.layout.param_numel, kP1B);
  EXPECT_EQ(plan.layout.gathered_block_numel, kBlock1B);
  EXPECT_EQ(plan.bytes_of(StateClass::kParam16), 2 * kP1B);  // 2'000'011'264
  EXPECT_EQ(plan.bytes_of(StateClass::kGrad), 4 * kP1B);     // fp32 accumulators (the GPU optimizer's)
  EXPECT_EQ(plan.bytes_of(StateClass::kMaster), 4 * kP1B);
  EXPECT_EQ(plan.bytes_of(StateClass::kMoments), 8 * kP1B);
  // 18 x P + ws = 18'000'101'376 + 4'500'025'344
  EXPECT_EQ(plan.usage_of(Tier::kGpu).need_bytes, 22'500'126'720u);
  EXPECT_EQ(plan.usage_of(Tier::kCpu).need_bytes, 0u);
  EXPECT_EQ(plan.usage_of(Tier::kNvme).need_bytes, 0u);
  EXPECT_EQ(plan.traffic.h2d_bytes + plan.traffic.d2h_bytes + plan.traffic.nvme_read_bytes, 0u);
  EXPECT_EQ(plan.traffic.estimated_seconds, 0.0);
  EXPECT_EQ(plan.candidates, 27u);  // 3 param tiers x (1 GPU optimizer + 2 x 2 x 2 CPU ones)
  EXPECT_TRUE(plan.fits());
}

TEST(PlanPlacement, SmallGpuMovesOptimizerToCpu) {
  // GPU 7e9: params 2P + ws = 6'500'036'608 fit, any GPU optimizer (14 P more) does not.
  const Plan plan = must_plan(one_billion(7'000'000'000, kHuge, kHuge));
  for (StateClass s : {StateClass::kGrad, StateClass::kMaster, StateClass::kMoments}) EXPECT_NE(plan.tier_of(s), G);
  EXPECT_EQ(plan.usage_of(Tier::kGpu).need_bytes, 2 * kP1B + kWs1B);
  EXPECT_EQ(plan.bytes_of(StateClass::kGrad), 4 * kP1B);  // fp32 off the GPU
  // 4 + 4 + 8 B, plus the CPU optimizer's 16-bit copy-out staging for its sub-groups: sub_group_size
  // 1e9 holds three 250'001'408-element shards, not four, so the model is two groups (three blocks,
  // then one) and two are staged, each of the largest's size, 2 x 750'004'224 x 2 B; and up to three
  // arriving gradient shards 3 x 2 B x 250'001'408: 16'000'090'112 + 3'000'016'896 + 1'500'008'448.
  EXPECT_EQ(plan.layout.largest_sub_group_numel, 750'004'224u);
  EXPECT_EQ(plan.layout.sub_groups, 2u);
  EXPECT_EQ(plan.usage_of(Tier::kCpu).need_bytes, 20'500'115'456u);
  // H2D: new params after the step, 2P; D2H: grads, 2P x 1 micro-batch; CPU Adam 30 P.
  EXPECT_EQ(plan.traffic.h2d_bytes, 2 * kP1B);
  EXPECT_EQ(plan.traffic.d2h_bytes, 2 * kP1B);
  EXPECT_EQ(plan.traffic.cpu_optimizer_bytes, 30 * kP1B);
  // 4'000'022'528 / 25e9 + 30'000'168'960 / 40e9 = 0.16000090112 + 0.750004224
  EXPECT_NEAR(plan.traffic.estimated_seconds, 0.91000512512, 1e-12);
}

TEST(PlanPlacement, SmallCpuMovesOptimizerStatesToNvme) {
  PlanInput in = one_billion(7'000'000'000, 16'500'000'000, kHuge);
  in.sub_group_size = 100'000'000;  // under a block's shard: each block is a sub-group of its own, L
  // CPU options with params on GPU (staging = 3 x L x bytes of the NVMe classes, + the 16-bit
  // copy-out 3 x L x 2 = 1'500'008'448, + three arriving gradient shards 3 x 2 B x L = 1'500'008'448,
  // or one of (2 + 4) B x L with grads on NVMe), L = 250'001'408:
  //   grad cpu, master cpu, moments nvme:  8P + 3L x 8  + 1'500'008'448 x 2 = 17'000'095'744  > 16.5e9
  //   grad cpu, master nvme, moments nvme: 4P + 3L x 12 + 1'500'008'448 x 2 = 16'000'090'112  fits <- chosen
  //   grad nvme, master cpu, moments nvme: 4P + 3L x 12 + 1'500'008'448 x 2 = 16'000'090'112  fits, same
  //     traffic, same NVMe bytes (12 P): the tie goes to grads on the faster tier.
  const Plan plan = must_plan(in);
  EXPECT_EQ(plan.tier, (Tiers{G, C, N, N}));
  EXPECT_EQ(plan.usage_of(Tier::kNvme).need_bytes, 12 * kP1B);  // 12'000'067'584
  ASSERT_EQ(plan.usage_of(Tier::kCpu).breakdown.size(), 4u);
  EXPECT_EQ(plan.usage_of(Tier::kCpu).breakdown[0].bytes, 4 * kP1B);             // fp32 grads
  EXPECT_EQ(plan.usage_of(Tier::kCpu).breakdown[1].bytes, 9'000'050'688u);        // 3 x L x 12 B
  EXPECT_EQ(plan.usage_of(Tier::kCpu).breakdown[2].bytes, 1'500'008'448u);        // 3 x L x 2 B copy-out
  EXPECT_EQ(plan.usage_of(Tier::kCpu).breakdown[3].bytes, 1'500'008'448u);        // 3 x 2 B x L, arriving
  EXPECT_EQ(plan.usage_of(Tier::kCpu).need_bytes, 16'000'090'112u);
  EXPECT_EQ(plan.traffic.nvme_read_bytes, 12 * kP1B);
  EXPECT_EQ(plan.traffic.nvme_write_bytes, 12 * kP1B);
  // 2 x 12'000'067'584 / 2e9 + 4'000'022'528 / 25e9 + 30'000'168'960 / 40e9
  EXPECT_NEAR(plan.traffic.estimated_seconds, 12.000067584 + 0.16000090112 + 0.750004224, 1e-9);
}

PlanInput zero_infinity() {
  PlanInput in = one_billion(7'000'000'000, 20'000'000'000, kHuge);
  in.mode = PlacementMode::kDeepSpeed;
  in.offload_param = OffloadDevice::kNvme;
  in.offload_optimizer = OffloadDevice::kNvme;
  in.gradient_accumulation_steps = 2;
  in.sub_group_size = 100'000'000;
  return in;
}

TEST(PlanDeepSpeed, ZeroInfinityNeeds) {
  const Plan plan = must_plan(zero_infinity());
  EXPECT_EQ(plan.tier, (Tiers{N, C, N, N}));
  EXPECT_EQ(plan.mode, PlacementMode::kDeepSpeed);
  EXPECT_EQ(plan.usage_of(Tier::kGpu).need_bytes, kWs1B);  // nothing resident, only the working set
  // CPU: fp32 grads 4P = 4'000'022'528, param staging = the gather window's shards (1 rank:
  // the window, 500'002'816 elements) x 2 B = 1'000'005'632, optimizer staging for three
  // sub-groups of one block each (sub_group_size 1e8 is under a block's 250'001'408-element
  // shard) 3 x 250'001'408 x (4 + 8) = 9'000'050'688, their 16-bit copy-out 3 x 250'001'408 x 2
  // = 1'500'008'448, up to three arriving gradient shards 3 x 2 B x 250'001'408 = 1'500'008'448.
  // No staging buffers or cache of DeepSpeed's
  // (offload_param.buffer_count x buffer_size, max_in_cpu): the engine allocates none.
  const TierUsage& cpu = plan.usage_of(Tier::kCpu);
  ASSERT_EQ(cpu.breakdown.size(), 5u);
  EXPECT_EQ(cpu.breakdown[0].bytes, 4 * kP1B);
  EXPECT_EQ(cpu.breakdown[1].bytes, 1'000'005'632u);
  EXPECT_EQ(cpu.breakdown[2].bytes, 9'000'050'688u);
  EXPECT_EQ(cpu.breakdown[3].bytes, 1'500'008'448u);
  EXPECT_EQ(cpu.breakdown[4].bytes, 1'500'008'448u);
  EXPECT_EQ(cpu.need_bytes, 17'000'095'744u);
  // NVMe: params 2P + master 4P + moments 8P = 14P.
  EXPECT_EQ(plan.usage_of(Tier::kNvme).need_bytes, 14 * kP1B);  // 14'000'078'848
}

TEST(PlanTraffic, ZeroInfinityStepHandComputed) {
  const Plan plan = must_plan(zero_infinity());  // G = 2 micro-batches
  const StepTraffic& t = plan.traffic;
  // params: H2D 2P x 2 passes x 2 = 8P; NVMe read 2P x 2 passes x 2 = 8P (every fetch reads its
  // shard: no CPU cache); NVMe write 2P after the step.
  // master + moments: read 12P, write 12P. grads (CPU): D2H 2P x 2 = 4P.
  EXPECT_EQ(t.h2d_bytes, 8 * kP1B);                                 // 8'000'045'056
  EXPECT_EQ(t.d2h_bytes, 4 * kP1B);                                 // 4'000'022'528
  EXPECT_EQ(t.nvme_read_bytes, 8 * kP1B + 12 * kP1B);               // 20'000'112'640
  EXPECT_EQ(t.nvme_write_bytes, 2 * kP1B + 12 * kP1B);              // 14'000'078'848
  EXPECT_EQ(t.cpu_optimizer_bytes, 30 * kP1B);                      // 30'000'168'960
  // 20'000'112'640/2e9 + 14'000'078'848/2e9 + 12'000'067'584/25e9 + 30'000'168'960/40e9
  EXPECT_NEAR(t.estimated_seconds, 10.00005632 + 7.000039424 + 0.48000270336 + 0.750004224, 1e-9);
}

TEST(PlanTraffic, GradsOnNvmeAreReadBackEachAccumulation) {
  PlanInput in = zero_infinity();
  // With grads on CPU the need is 17'000'095'744 > 16.5e9, so DeepSpeed mode moves them to NVMe:
  // 1'000'005'632 + 3 x L x (4 + 4 + 8) + 3 x L x 2 + one arriving shard (2 + 4) B x L
  // (accumulations into NVMe run one at a time), L = 250'001'408: 16'000'090'112.
  in.cpu_bytes = 16'500'000'000;
  const Plan plan = must_plan(in);
  EXPECT_EQ(plan.tier, (Tiers{N, N, N, N}));
  EXPECT_EQ(plan.usage_of(Tier::kCpu).need_bytes, 16'000'090'112u);
  EXPECT_EQ(plan.usage_of(Tier::kNvme).need_bytes, 18 * kP1B);  // 2 + 4 + 4 + 8 B
  // grads add NVMe write 4P x 2 and read 4P x (2 - 1) + 4P (the step).
  EXPECT_EQ(plan.traffic.nvme_write_bytes, 14 * kP1B + 8 * kP1B);
  EXPECT_EQ(plan.traffic.nvme_read_bytes, 8 * kP1B + 12 * kP1B + 8 * kP1B);
}

// fp32 training (neither bf16 nor fp16): the parameters, their gradient in
// backward and everything that moves them are 4 B an element, not 2.
TEST(PlanTraffic, Fp32ParamsZeroInfinityHandComputed) {
  PlanInput in = zero_infinity();
  in.param_bytes = 4;
  in.gpu_bytes = 10'000'000'000;  // the working set doubles: 2 x 4'500'025'344
  const Plan plan = must_plan(in);
  EXPECT_EQ(plan.tier, (Tiers{N, C, N, N}));
  EXPECT_EQ(plan.elem_bytes_of(StateClass::kParam16), 4.0);
  EXPECT_EQ(plan.bytes_of(StateClass::kParam16), 4 * kP1B);
  EXPECT_EQ(plan.usage_of(Tier::kGpu).need_bytes, 2 * kWs1B);  // gather and backward gradient both 4 B
  // CPU: fp32 grads 4P, param staging 500'002'816 x 4 = 2'000'011'264, optimizer staging
  // 9'000'050'688 (as for bf16), three arriving gradient shards 3 x 4 B x 250'001'408 =
  // 3'000'016'896 (no 16-bit copy-out for fp32).
  const TierUsage& cpu = plan.usage_of(Tier::kCpu);
  ASSERT_EQ(cpu.breakdown.size(), 4u);
  EXPECT_EQ(cpu.breakdown[1].bytes, 2'000'011'264u);
  EXPECT_EQ(cpu.breakdown[3].bytes, 3'000'016'896u);
  EXPECT_EQ(cpu.need_bytes, 18'000'101'376u);
  EXPECT_EQ(plan.usage_of(Tier::kNvme).need_bytes, 16 * kP1B);  // params 4P + master 4P + moments 8P
  const StepTraffic& t = plan.traffic;
  // params: H2D 4P x 2 passes x 2 = 16P; NVMe read the same 16P;
  // NVMe write 4P. Grads: D2H 4P x 2 = 8P. CPU Adam: 28 + 4 = 32 B x P.
  EXPECT_EQ(t.h2d_bytes, 16 * kP1B);
  EXPECT_EQ(t.d2h_bytes, 8 * kP1B);
  EXPECT_EQ(t.nvme_read_bytes, 16 * kP1B + 12 * kP1B);
  EXPECT_EQ(t.nvme_write_bytes, 4 * kP1B + 12 * kP1B);
  EXPECT_EQ(t.cpu_optimizer_bytes, 32 * kP1B);
  const std::string text = format_plan(plan, in);
  for (const char* part : {"precision  fp32 params (4 B", "fp32 params (4 B x 1.0B elem)",
                           "gathered fp32 params, current + prefetch (4 B x"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << "\n" << text;
  }
}

// A GPU budget that holds a bf16 model's params but not an fp32 one's: the
// fp32 plan does not fit, and the message says the params are what to shrink.
TEST(PlanDeepSpeed, Fp32ParamsNeedTwiceTheRoom) {
  PlanInput in = one_billion(8'000'000'000, kHuge, kHuge);
  in.mode = PlacementMode::kDeepSpeed;
  in.offload_optimizer = OffloadDevice::kCpu;
  // bf16: 2P + ws = 2'000'011'264 + 4'500'025'344 = 6'500'036'608 fits 8e9.
  EXPECT_EQ(must_plan(in).usage_of(Tier::kGpu).need_bytes, 6'500'036'608u);
  in.param_bytes = 4;  // 4P + 2 ws = 13'000'073'216
  const Expected<Plan> plan = plan_placement(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), ErrorCode::kOutOfMemory);
  const std::string msg = plan.status().message();
  EXPECT_NE(msg.find("gpu needs 12.11 GiB per rank"), std::string::npos) << msg;
  EXPECT_NE(msg.find("enable the config's \"bf16\" block"), std::string::npos) << msg;
}

TEST(PlanDeepSpeed, OverBudgetNamesTierBudgetKeyAndAlternative) {
  PlanInput in = one_billion(7'000'000'000, 16'500'000'000, kHuge);
  in.sub_group_size = 100'000'000;
  in.mode = PlacementMode::kDeepSpeed;
  // CPU needs 16P + copy-out 3 x L x 2 + three arriving shards 3 x 2 B x L = 19'000'107'008 = 17.70 GiB
  in.offload_optimizer = OffloadDevice::kCpu;
  const Expected<Plan> plan = plan_placement(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), ErrorCode::kOutOfMemory);
  const std::string msg = plan.status().message();
  EXPECT_NE(msg.find("cpu needs 17.70 GiB per node"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tierzero.tiers.cpu_bytes is 15.37 GiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("zero_optimization.offload_optimizer.device to \"nvme\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("placement 'auto' would fit: params gpu, grads cpu, master nvme, moments nvme"),
            std::string::npos)
      << msg;
}

TEST(PlanDeepSpeed, ParamOffloadNeedsStage3) {
  PlanInput in = one_billion(kHuge, kHuge, kHuge);
  in.mode = PlacementMode::kDeepSpeed;
  in.offload_param = OffloadDevice::kCpu;
  in.stage = 2;
  const Expected<Plan> plan = plan_placement(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("stage is 2"), std::string::npos) << plan.status().message();
}

TEST(PlanAuto, NothingFitsReportsLeastNeedsAndKeys) {
  // GPU 1e9 < the working set alone (4'500'025'344 = 4.19 GiB), whatever is offloaded.
  const Expected<Plan> plan = plan_placement(one_billion(1'000'000'000, kHuge, kHuge));
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), ErrorCode::kOutOfMemory);
  const std::string msg = plan.status().message();
  EXPECT_NE(msg.find("no placement of 1.0B parameters fits"), std::string::npos) << msg;
  EXPECT_NE(msg.find("params nvme, grads nvme, master nvme, moments nvme"), std::string::npos) << msg;
  EXPECT_NE(msg.find("gpu needs 4.19 GiB per rank but tierzero.tiers.gpu_bytes is 953.67 MiB"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("gpu 4.19 GiB per rank (budget 953.67 MiB, tierzero.tiers.gpu_bytes)"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("cpu: no placement where the gpu fits (budget"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tierzero.tiers.cpu_bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("To fit: raise tierzero.tiers.gpu_bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tierzero.tiers.nvme_bytes"), std::string::npos) << msg;
}

TEST(PlanAuto, PicksTheFasterOfTwoFeasiblePlans) {
  // GPU 21e9: the GPU optimizer with params on CPU needs 16P + ws = 20'500'115'456 (fits);
  // params on GPU with CPU Adam needs 2P + ws = 6'500'036'608 (fits); all on GPU
  // (22'500'126'720) does not. No NVMe.
  PlanInput in = one_billion(21'000'000'000, kHuge, 0);
  // Default links: X = params cpu, rest gpu: H2D 4P + D2H 2P = 6'000'033'792 / 25e9 = 0.24 s;
  // Y = params gpu, CPU Adam: 4P / 25e9 + 30P / 40e9 = 0.91 s.  X wins.
  Plan plan = must_plan(in);
  EXPECT_EQ(plan.tier, (Tiers{C, G, G, G}));
  EXPECT_NEAR(plan.traffic.estimated_seconds, 0.24000135168, 1e-12);
  // A slow PCIe (1 GB/s) and fast CPU memory (1 TB/s): X = 6.0 s, Y = 4.0 + 0.03 s. Y wins.
  in.links.pcie_Bps = 1e9;
  in.links.cpu_mem_Bps = 1e12;
  plan = must_plan(in);
  for (StateClass s : {StateClass::kGrad, StateClass::kMaster, StateClass::kMoments}) EXPECT_NE(plan.tier_of(s), G);
  EXPECT_NEAR(plan.traffic.estimated_seconds, 4.000022528 + 0.03000016896, 1e-9);
}

// Blocks 1e6 and 3e6 over 4 ranks:
//   shards: A(250'000) = 251'904, A(750'000) = 751'616 -> 1'003'520 per rank
//   whole:  A(1e6) = 1'001'472,   A(3e6) = 3'000'320   -> 4'001'792
PlanInput four_ranks(int stage) {
  PlanInput in;
  in.block_numel = {1'000'000, 3'000'000};
  in.ranks = 4;
  in.stage = stage;
  in.gpu_bytes = in.cpu_bytes = in.nvme_bytes = kHuge;
  return in;
}

TEST(PlanLayout, ShardSizesPerStage) {
  const PlanLayout s3 = must_plan(four_ranks(3)).layout;
  EXPECT_EQ(s3.param_numel, 1'003'520u);
  EXPECT_EQ(s3.grad_numel, 1'003'520u);
  EXPECT_EQ(s3.optimizer_numel, 1'003'520u);
  EXPECT_EQ(s3.gathered_block_numel, 4 * 751'616u);
  const PlanLayout s2 = must_plan(four_ranks(2)).layout;
  EXPECT_EQ(s2.param_numel, 4'001'792u);
  EXPECT_EQ(s2.grad_numel, 1'003'520u);
  EXPECT_EQ(s2.optimizer_numel, 1'003'520u);
  EXPECT_EQ(s2.gathered_block_numel, 0u);
  const PlanLayout s1 = must_plan(four_ranks(1)).layout;
  EXPECT_EQ(s1.param_numel, 4'001'792u);
  EXPECT_EQ(s1.grad_numel, 4'001'792u);
  EXPECT_EQ(s1.optimizer_numel, 1'003'520u);
  const PlanLayout s0 = must_plan(four_ranks(0)).layout;
  EXPECT_EQ(s0.optimizer_numel, 4'001'792u);
}

TEST(PlanLayout, GpuNeedPerStage) {
  // Stage 3: 18 x 1'003'520 = 18'063'360 of states; L = 3'006'464, window
  // L + max(L, 50e6) = 53'006'464, but the model's gathered blocks are 4 x 1'003'520 = 4'014'080 in
  // all -> gather 8'028'160; gradients 4 x 2 x L = 24'051'712, their shards 3 x 2 x 751'616 = 4'509'696.
  EXPECT_EQ(must_plan(four_ranks(3)).usage_of(Tier::kGpu).need_bytes, 54'652'928u);
  // Stage 1, no working set: 2 x 4'001'792 (params) + 4 x 4'001'792 (fp32 grads) + 12 x 1'003'520.
  EXPECT_EQ(must_plan(four_ranks(1)).usage_of(Tier::kGpu).need_bytes, 36'052'992u);
}

TEST(PlanLayout, ShardsArePaddedTo2048Elements) {
  PlanInput in;
  in.block_numel = {1, 2048, 2049};
  in.persistence_threshold = 0;
  in.gpu_bytes = in.cpu_bytes = in.nvme_bytes = kHuge;
  EXPECT_EQ(must_plan(in).layout.param_numel, 2048u + 2048u + 4096u);
  in.block_numel = {6145};
  in.ranks = 3;  // ceil(6145 / 3) = 2049 -> 4096 per shard, 12288 gathered
  const Plan plan = must_plan(in);
  EXPECT_EQ(plan.layout.param_numel, 4096u);
  EXPECT_EQ(plan.layout.gathered_block_numel, 12'288u);
}

TEST(PlanLayout, PersistenceThresholdKeepsSmallBlocksWholeOnGpu) {
  PlanInput in = four_ranks(3);
  in.block_numel = {50'000, 1'000'000};  // 50'000 < threshold 100'000
  in.mode = PlacementMode::kDeepSpeed;
  in.offload_param = OffloadDevice::kCpu;
  in.offload_optimizer = OffloadDevice::kCpu;
  const Plan plan = must_plan(in);
  // Persistent: A(50'000) = 51'200 whole, shard A(12'500) = 14'336. Others: 251'904.
  EXPECT_EQ(plan.layout.persistent_blocks, 1u);
  EXPECT_EQ(plan.layout.persistent_numel, 51'200u);
  EXPECT_EQ(plan.layout.param_numel, 251'904u);
  EXPECT_EQ(plan.layout.optimizer_numel, 251'904u + 14'336u);
  EXPECT_EQ(plan.bytes_of(StateClass::kParam16), 2 * 251'904u);  // on CPU
  // GPU: persistent 4 B x 51'200 = 204'800; L = 4 x 251'904 = 1'007'616, the only gathered block,
  // so the window is L (not L + 50e6): gather 2 x L = 2'015'232; gradients 4 x 2 x L = 8'060'928,
  // their shards 3 x 2 x 251'904 = 1'511'424.
  EXPECT_EQ(plan.usage_of(Tier::kGpu).need_bytes, 204'800u + 2'015'232u + 8'060'928u + 1'511'424u);
  // H2D: params 2 x 251'904 x 2 passes + the persistent shard's new values 2 x 14'336.
  EXPECT_EQ(plan.traffic.h2d_bytes, 1'007'616u + 28'672u);
}

TEST(PlanLayout, RanksPerNodeScalesCpuNeed) {
  PlanInput in;
  in.block_numel = {8'000'000};
  // shard A(1e6) = 1'001'472; CPU Adam: 16 B x 1'001'472 = 16'023'552 per rank, + the 16-bit copy-out
  // of its one sub-group 1'001'472 x 2 = 2'002'944 + three arriving gradient shards 3 x 2 x 1'001'472
  // = 6'008'832: 24'035'328.
  in.ranks = 8;
  in.gpu_bytes = in.cpu_bytes = in.nvme_bytes = kHuge;
  in.mode = PlacementMode::kDeepSpeed;
  in.offload_optimizer = OffloadDevice::kCpu;
  Plan plan = must_plan(in);  // ranks_per_node 0 = all 8
  EXPECT_EQ(plan.usage_of(Tier::kCpu).per_rank_bytes, 24'035'328u);
  EXPECT_EQ(plan.usage_of(Tier::kCpu).need_bytes, 8 * 24'035'328u);
  const std::uint64_t gpu_need = plan.usage_of(Tier::kGpu).need_bytes;
  in.ranks_per_node = 4;
  plan = must_plan(in);
  EXPECT_EQ(plan.usage_of(Tier::kCpu).ranks_sharing, 4);
  EXPECT_EQ(plan.usage_of(Tier::kCpu).need_bytes, 4 * 24'035'328u);
  EXPECT_EQ(plan.usage_of(Tier::kGpu).need_bytes, gpu_need);  // per rank either way
}

void expect_invalid(const PlanInput& in, const std::string& fragment) {
  const Expected<Plan> plan = plan_placement(in);
  ASSERT_FALSE(plan.ok()) << fragment;
  EXPECT_EQ(plan.status().code(), ErrorCode::kInvalidArgument) << plan.status().to_string();
  EXPECT_NE(plan.status().message().find(fragment), std::string::npos) << plan.status().message();
}

TEST(PlanInvalid, InputsAreRefusedWithTheValue) {
  const PlanInput good = one_billion(kHuge, kHuge, kHuge);
  PlanInput in = good;
  in.ranks = 0;
  expect_invalid(in, "ranks is 0");
  in = good;
  in.block_numel.clear();
  expect_invalid(in, "no blocks");
  in = good;
  in.block_numel[2] = 0;
  expect_invalid(in, "block 2 has 0 elements");
  in = good;
  in.stage = 4;
  expect_invalid(in, "stage is 4");
  in = good;
  in.ranks = 4;
  in.ranks_per_node = 3;
  expect_invalid(in, "ranks_per_node is 3");
  in.ranks_per_node = 8;
  expect_invalid(in, "ranks_per_node is 8");
  in = good;
  in.gradient_accumulation_steps = 0;
  expect_invalid(in, "gradient_accumulation_steps is 0");
  in = good;
  in.sub_group_size = 0;
  expect_invalid(in, "zero_optimization.sub_group_size is 0");
  in = good;
  in.links.pcie_Bps = 0;
  expect_invalid(in, "pcie_Bps");
  in = good;
  in.param_bytes = 3;
  expect_invalid(in, "param_bytes is 3");
}

// Blocks larger than the prefetch bucket: the engine still prefetches one
// whole block behind the one in use, so two are gathered at once, whatever
// stage3_max_live_parameters says (the engine does not honour it; the plan
// once capped the window at it, 1e9 here, under the 1.2e9 the engine holds).
TEST(PlanPlacement, TheGatherWindowIsTwoBlocksWhenABlockExceedsTheBucket) {
  PlanInput in = one_billion(kHuge, kHuge, kHuge);
  in.block_numel.assign(4, 600'000'000);  // A(600e6) = 292'969 x 2048 = 600'000'512
  const Plan plan = must_plan(in);
  ASSERT_EQ(plan.layout.gathered_block_numel, 600'000'512u);
  const TierUsage& gpu = plan.usage_of(Tier::kGpu);
  const auto gathered = std::find_if(gpu.breakdown.begin(), gpu.breakdown.end(),
                                     [](const auto& item) { return item.what.find("gathered") != std::string::npos; });
  ASSERT_NE(gathered, gpu.breakdown.end());
  EXPECT_EQ(gathered->bytes, 2u * 2 * 600'000'512);  // 2 B x (L + max(L, 5e7))
}

// ---- state formats (Note [State formats], Note [Remainder traffic]) ----------

// The compact formats' bytes of P = kP1B elements (a multiple of 2048, so of
// 8 tie bits and of 256-element scale blocks): remainder 2P + P/8, int8
// moments 2 x (P + 4 P/256), bf16 moments 4P.
constexpr std::uint64_t kRemainder1B = 2 * kP1B + kP1B / 8;          // 2'125'011'968
constexpr std::uint64_t kInt8Moments1B = 2 * kP1B + 8 * (kP1B / 256);  // 2'031'261'440

TEST(PlanFormats, ClassBytesFollowTheFormats) {
  PlanInput in = one_billion(kHuge, kHuge, kHuge);
  in.states = {MasterFormat::kRemainder, MomentFormat::kInt8};
  const Plan plan = must_plan(in);
  // The GPU optimizer steps int8 moments too: with room for everything
  // everything is on the GPU, as with fp32 states, or remainder masters and
  // bf16 moments.
  EXPECT_EQ(plan.tier, (Tiers{G, G, G, G}));
  EXPECT_EQ(must_plan(one_billion(kHuge, kHuge, kHuge)).tier, (Tiers{G, G, G, G}));
  PlanInput gpu_formats = in;
  gpu_formats.states.moments = MomentFormat::kBf16;
  EXPECT_EQ(must_plan(gpu_formats).tier, (Tiers{G, G, G, G}));
  EXPECT_EQ(plan.bytes_of(StateClass::kParam16), 2 * kP1B);
  EXPECT_EQ(plan.bytes_of(StateClass::kGrad), 4 * kP1B);
  EXPECT_EQ(plan.bytes_of(StateClass::kMaster), kRemainder1B);
  EXPECT_EQ(plan.bytes_of(StateClass::kMoments), kInt8Moments1B);
  EXPECT_EQ(plan.elem_bytes_of(StateClass::kMaster), 2.125);
  EXPECT_EQ(plan.elem_bytes_of(StateClass::kMoments), 2.03125);
  in.states.moments = MomentFormat::kBf16;
  EXPECT_EQ(must_plan(in).bytes_of(StateClass::kMoments), 4 * kP1B);
  EXPECT_EQ(state_format_name(StateClass::kMaster, 2, in.states), "remainder");
  EXPECT_EQ(state_format_name(StateClass::kMoments, 2, in.states), "bf16");
  EXPECT_EQ(state_format_name(StateClass::kParam16, 2, in.states), "bf16/fp16");
  EXPECT_EQ(state_format_name(StateClass::kGrad, 2, in.states), "fp32");
  EXPECT_EQ(state_bytes(StateClass::kMaster, 8, 2, in.states), 17u);  // 2 x 8 + one byte of tie bits
}

TEST(PlanFormats, ZeroInfinityWithRemaindersAndInt8MomentsHandComputed) {
  PlanInput in = zero_infinity();  // params and optimizer on NVMe, grads in CPU memory, G = 2
  in.states = {MasterFormat::kRemainder, MomentFormat::kInt8};
  const Plan plan = must_plan(in);
  EXPECT_EQ(plan.tier, (Tiers{N, C, N, N}));
  // NVMe: params 2P, master 2.125 P, moments 2.03125 P.
  EXPECT_EQ(plan.usage_of(Tier::kNvme).need_bytes, 2 * kP1B + kRemainder1B + kInt8Moments1B);  // 6'156'284'672
  // CPU: as ZeroInfinityNeeds but the sub-group staging holds 3 x L x (2.125 + 2.03125) B,
  // L = 250'001'408: 3 x (531'252'992 + 507'815'360) = 3'117'205'056; the 16-bit staging now
  // brings the parameter in (for the rebuild) and takes the new one out: the same 3 x L x 2 B.
  const TierUsage& cpu = plan.usage_of(Tier::kCpu);
  ASSERT_EQ(cpu.breakdown.size(), 5u);
  EXPECT_EQ(cpu.breakdown[2].bytes, 3'117'205'056u);
  EXPECT_NE(cpu.breakdown[2].what.find("x 4.15625 B: master + moments"), std::string::npos) << cpu.breakdown[2].what;
  EXPECT_EQ(cpu.breakdown[3].bytes, 1'500'008'448u);
  EXPECT_NE(cpu.breakdown[3].what.find("copy-in/out"), std::string::npos) << cpu.breakdown[3].what;
  EXPECT_EQ(cpu.need_bytes, 4 * kP1B + 1'000'005'632u + 3'117'205'056u + 2 * 1'500'008'448u);  // 11'117'250'112
  const StepTraffic& t = plan.traffic;
  // params as before (H2D 8P, NVMe read 8P, write 2P), plus the optimizer's read of the
  // parameter shard it rebuilds the master from: NVMe read 2P. Master and moments move
  // once each way in their formats. CPU Adam: grad 4 + param write 2 + param read 2 B, and
  // master and moments read and written.
  EXPECT_EQ(t.h2d_bytes, 8 * kP1B);
  EXPECT_EQ(t.d2h_bytes, 4 * kP1B);
  EXPECT_EQ(t.nvme_read_bytes, 10 * kP1B + kRemainder1B + kInt8Moments1B);  // 14'156'329'728
  EXPECT_EQ(t.nvme_write_bytes, 2 * kP1B + kRemainder1B + kInt8Moments1B);  // 6'156'284'672
  EXPECT_EQ(t.cpu_optimizer_bytes, 8 * kP1B + 2 * kRemainder1B + 2 * kInt8Moments1B);  // 16'312'591'872
}

// The main job's placement (params and optimizer on NVMe, grads in CPU
// memory, one micro-batch): NVMe bytes per parameter per step in each format.
TEST(PlanFormats, NvmeBytesPerParamPerStepOfEachFormat) {
  struct Case {
    StateFormats states;
    double read, write;  // B per padded parameter
  };
  const Case cases[] = {
      {{MasterFormat::kFp32, MomentFormat::kFp32}, 4 + 12, 2 + 12},            // 30: today's
      {{MasterFormat::kRemainder, MomentFormat::kFp32}, 4 + 2 + 10.125, 2 + 10.125},  // 28.25
      {{MasterFormat::kRemainder, MomentFormat::kBf16}, 4 + 2 + 6.125, 2 + 6.125},    // 20.25
      {{MasterFormat::kRemainder, MomentFormat::kInt8}, 4 + 2 + 4.15625, 2 + 4.15625},  // 16.3125
      {{MasterFormat::kFp32, MomentFormat::kInt8}, 4 + 6.03125, 2 + 6.03125},   // 18.0625
  };
  for (const Case& c : cases) {
    PlanInput in = zero_infinity();
    in.gradient_accumulation_steps = 1;
    in.states = c.states;
    const Plan plan = must_plan(in);
    SCOPED_TRACE(fmt::format("{} + {}", master_format_name(c.states.master), moment_format_name(c.states.moments)));
    EXPECT_EQ(plan.tier, (Tiers{N, C, N, N}));
    // Per model parameter: the padded shard (P) over the 1e9 parameters.
    const double padding = static_cast<double>(kP1B) / 1e9;
    EXPECT_DOUBLE_EQ(bytes_per_param(plan.traffic.nvme_read_bytes, plan.layout, in.ranks), c.read * padding);
    EXPECT_DOUBLE_EQ(bytes_per_param(plan.traffic.nvme_write_bytes, plan.layout, in.ranks), c.write * padding);
  }
}

// Note [Remainder traffic]: where the parameter shard comes from for the
// rebuild, per placement (pinned with DeepSpeed mode), against the same plan
// with an fp32 master.
TEST(PlanFormats, TheRemainderReadsTheParameterFromItsTier) {
  struct Case {
    OffloadDevice param, optimizer;
    std::uint64_t h2d, d2h, nvme_read;  // extra bytes, in units of 2 B x P
  };
  const Case cases[] = {
      {OffloadDevice::kNone, OffloadDevice::kNone, 0, 0, 0},  // GPU Adam beside the params
      {OffloadDevice::kCpu, OffloadDevice::kNone, 1, 0, 0},   // GPU Adam: up from CPU memory
      {OffloadDevice::kNvme, OffloadDevice::kNone, 1, 0, 1},  // GPU Adam: from NVMe, up
      {OffloadDevice::kNone, OffloadDevice::kCpu, 0, 1, 0},   // CPU Adam: down from the GPU
      {OffloadDevice::kCpu, OffloadDevice::kCpu, 0, 0, 0},    // CPU Adam beside the params
      {OffloadDevice::kNvme, OffloadDevice::kNvme, 0, 0, 1},  // CPU Adam: from NVMe
  };
  for (const Case& c : cases) {
    PlanInput in = one_billion(kHuge, kHuge, kHuge);
    in.mode = PlacementMode::kDeepSpeed;
    in.offload_param = c.param;
    in.offload_optimizer = c.optimizer;
    const Plan fp32 = must_plan(in);
    in.states.master = MasterFormat::kRemainder;
    const Plan remainder = must_plan(in);
    SCOPED_TRACE(placement_text_for_test(remainder));
    EXPECT_EQ(remainder.traffic.h2d_bytes - fp32.traffic.h2d_bytes, c.h2d * 2 * kP1B);
    EXPECT_EQ(remainder.traffic.d2h_bytes - fp32.traffic.d2h_bytes, c.d2h * 2 * kP1B);
    const std::uint64_t master_saved = c.optimizer == OffloadDevice::kNvme ? 4 * kP1B - kRemainder1B : 0;
    EXPECT_EQ(remainder.traffic.nvme_read_bytes + master_saved - fp32.traffic.nvme_read_bytes,
              c.nvme_read * 2 * kP1B);
  }
}

TEST(PlanFormats, PersistentBlocksShardsComeDownForTheRebuild) {
  PlanInput in = one_billion(kHuge, kHuge, kHuge);
  in.mode = PlacementMode::kDeepSpeed;  // params on the GPU, the optimizer on the CPU
  in.offload_optimizer = OffloadDevice::kCpu;
  in.block_numel.push_back(50'000);  // under the threshold: whole on every GPU
  const Plan fp32 = must_plan(in);
  in.states.master = MasterFormat::kRemainder;
  const Plan remainder = must_plan(in);
  ASSERT_EQ(remainder.tier, (Tiers{G, C, C, C}));
  EXPECT_EQ(remainder.layout.persistent_shard_numel, 51'200u);  // A(50'000)
  EXPECT_EQ(remainder.traffic.d2h_bytes - fp32.traffic.d2h_bytes, 2 * (kP1B + 51'200));
}

TEST(PlanFormats, CompactFormatsFitWhereFp32StatesDoNot) {
  // 7 GB of GPU holds the params and the working set. 11 GB of CPU and 6 GB of NVMe cannot
  // hold 4 + 4 + 8 B of grads, master and moments a parameter whichever way they are split
  // (no class fits beside another), but hold 4 + 2.125 + 2.03125 B: the grads and the staging
  // in CPU memory, master and moments (4.16 GB) on NVMe.
  PlanInput in = one_billion(7'000'000'000, 11'000'000'000, 6'000'000'000);
  in.sub_group_size = 100'000'000;
  const Expected<Plan> fp32 = plan_placement(in);
  ASSERT_FALSE(fp32.ok());
  EXPECT_EQ(fp32.status().code(), ErrorCode::kOutOfMemory);
  in.states = {MasterFormat::kRemainder, MomentFormat::kInt8};
  const Plan compact = must_plan(in);
  EXPECT_TRUE(compact.fits());
  EXPECT_EQ(compact.tier_of(StateClass::kParam16), G);
}

// data_types.grad_accum_dtype "bf16": the accumulator is 2 B a parameter
// wherever it lives, never on the GPU (the GPU optimizer accumulates in fp32).
TEST(PlanFormats, Bf16GradsAreTwoBytesAndNeverPlanTheGpuOptimizer) {
  PlanInput in = one_billion(kHuge, kHuge, kHuge);
  in.states.grads = GradFormat::kBf16;
  const Plan plan = must_plan(in);
  for (StateClass s : {StateClass::kGrad, StateClass::kMaster, StateClass::kMoments}) EXPECT_NE(plan.tier_of(s), G);
  EXPECT_EQ(plan.bytes_of(StateClass::kGrad), 2 * kP1B);
  EXPECT_EQ(plan.elem_bytes_of(StateClass::kGrad), 2.0);
  EXPECT_EQ(state_format_name(StateClass::kGrad, 2, in.states), "bf16");
  EXPECT_NE(format_plan(plan, in).find("bf16 grads (data_types.grad_accum_dtype)"), std::string::npos)
      << format_plan(plan, in);
}

// As PlanTraffic.GradsOnNvmeAreReadBackEachAccumulation with 2 B grads. CPU:
// 1'000'005'632 + 3 x L x (2 + 4 + 8) + 3 x L x 2 + one arriving shard
// (2 + 2) B x L, L = 250'001'408: 14'000'078'848 (with the grads in CPU
// memory it would be 17'000'095'744 - 2P = 15'000'084'480, over 14.5e9).
TEST(PlanFormats, Bf16GradsOnNvmeMoveTwoBytesEachAccumulation) {
  PlanInput in = zero_infinity();
  in.cpu_bytes = 14'500'000'000;
  in.states.grads = GradFormat::kBf16;
  const Plan plan = must_plan(in);
  EXPECT_EQ(plan.tier, (Tiers{N, N, N, N}));
  EXPECT_EQ(plan.usage_of(Tier::kCpu).need_bytes, 14'000'078'848u);
  EXPECT_EQ(plan.usage_of(Tier::kNvme).need_bytes, 16 * kP1B);  // 2 + 2 + 4 + 8 B
  // grads add NVMe write 2P x 2 and read 2P x (2 - 1) + 2P (the step).
  EXPECT_EQ(plan.traffic.nvme_write_bytes, 14 * kP1B + 4 * kP1B);
  EXPECT_EQ(plan.traffic.nvme_read_bytes, 8 * kP1B + 12 * kP1B + 4 * kP1B);
  // CPU Adam reads 2 B of gradient instead of 4: 30P - 2P.
  EXPECT_EQ(plan.traffic.cpu_optimizer_bytes, 28 * kP1B);
}

TEST(PlanFormats, ARemainderMasterWithFp32ParametersIsRefused) {
  PlanInput in = one_billion(kHuge, kHuge, kHuge);
  in.param_bytes = 4;
  in.states.master = MasterFormat::kRemainder;
  const Expected<Plan> plan = plan_placement(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("\"remainder\" needs bf16 parameters"), std::string::npos)
      << plan.status().message();
}

// The engine's GPU optimizer steps int8 moments (Note [Int8 moments on the
// GPU optimizer]); a DeepSpeed placement that keeps the optimizer on the GPU
// plans them there, at 2.03125 B/param instead of bf16's 4 (as
// tierzero-estimate shows).
TEST(PlanFormats, Int8MomentsWithTheOptimizerOnTheGpuArePlannedThere) {
  PlanInput in = one_billion(kHuge, kHuge, kHuge);
  in.mode = PlacementMode::kDeepSpeed;
  in.offload_optimizer = OffloadDevice::kNone;
  in.states = {MasterFormat::kRemainder, MomentFormat::kInt8};
  const Plan int8 = must_plan(in);
  for (StateClass s : {StateClass::kGrad, StateClass::kMaster, StateClass::kMoments}) {
    EXPECT_EQ(int8.tier_of(s), Tier::kGpu);
  }
  EXPECT_EQ(int8.bytes_of(StateClass::kMoments), kInt8Moments1B);
  in.states.moments = MomentFormat::kBf16;
  const Plan bf16 = must_plan(in);
  EXPECT_EQ(bf16.tier_of(StateClass::kMoments), Tier::kGpu);
  EXPECT_EQ(bf16.usage_of(Tier::kGpu).need_bytes - int8.usage_of(Tier::kGpu).need_bytes, 4 * kP1B - kInt8Moments1B);
}

TEST(PlanFormats, TheReportNamesEachClassesFormatAndBytesPerParameter) {
  PlanInput in = zero_infinity();
  in.gradient_accumulation_steps = 1;
  in.states = {MasterFormat::kRemainder, MomentFormat::kInt8};
  const Plan plan = must_plan(in);
  const std::string text = format_plan(plan, in);
  for (const char* part :
       {"master remainder (2.125 B), moments int8 (2.03125 B)", "master       remainder       2.125  nvme",
        "moments      int8          2.03125  nvme", "\ntotal                     10.15625",
        "master weights as int16 remainders + tie bits (2.125 B x 1.0B elem)",
        "Adam moments exp_avg + exp_avg_sq in int8 + fp32 block scales (2.03125 B x 1.0B elem)",
        "per parameter per step: NVMe 16.313 B (read 10.156 + write 6.156), PCIe 6.000 B"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << "\n" << text;
  }
}

TEST(PlanInput, FromConfigTakesTheStateFormats) {
  Config config;
  config.precision.bf16 = true;
  EXPECT_TRUE(PlanInput::from_config(config, {10}, 1, 0, {}).states.is_default());
  config.states = {MasterFormat::kRemainder, MomentFormat::kBf16};
  EXPECT_EQ(PlanInput::from_config(config, {10}, 1, 0, {}).states, config.states);
}

TEST(PlanFormat, ReportHasTablesAndSummary) {
  const PlanInput in = zero_infinity();
  const Plan plan = must_plan(in);
  const std::string text = format_plan(plan, in);
  for (const char* part : {"state class", "bytes/elem", "headroom", "moments", "nvme need per node",
                           "optimizer sub-group staging",
                           "param NVMe staging, the gather window's shards (2 B x 500.0M elem)",
                           "estimated data movement: 18.23 s"}) {
    EXPECT_NE(text.find(part), std::string::npos) << part << "\n" << text;
  }
  EXPECT_NE(plan.summary.find("params nvme, grads cpu, master nvme, moments nvme"), std::string::npos)
      << plan.summary;
  EXPECT_EQ(tier_name(Tier::kNvme), "nvme");
  EXPECT_EQ(state_class_name(StateClass::kMoments), "moments");
}

TEST(PlanInput, FromConfigCopiesZeroSettings) {
  Config config;
  config.zero.stage = 3;
  config.zero.offload_param.device = OffloadDevice::kNvme;
  config.zero.offload_param.max_in_cpu = 123;  // inert (Note [Inert keys]): the plan does not read it
  config.zero.offload_optimizer.device = OffloadDevice::kCpu;
  config.zero.sub_group_size = 456;
  config.gradient_accumulation_steps = 8;
  config.placement = PlacementMode::kDeepSpeed;
  ResolvedBudgets budgets;
  budgets.gpu_bytes = 1;
  budgets.cpu_bytes = 2;
  budgets.nvme_bytes = 3;
  const PlanInput in = PlanInput::from_config(config, {10, 20}, 4, 2, budgets);
  EXPECT_EQ(in.block_numel, (std::vector<std::uint64_t>{10, 20}));
  EXPECT_EQ(in.ranks, 4);
  EXPECT_EQ(in.effective_ranks_per_node(), 2);
  EXPECT_EQ(in.gradient_accumulation_steps, 8);
  EXPECT_EQ(in.mode, PlacementMode::kDeepSpeed);
  EXPECT_EQ(in.offload_param, OffloadDevice::kNvme);
  EXPECT_EQ(in.offload_optimizer, OffloadDevice::kCpu);
  EXPECT_EQ(in.sub_group_size, 456);
  EXPECT_EQ(in.gpu_bytes + in.cpu_bytes + in.nvme_bytes, 6u);
}

TEST(PlanInput, FromConfigTakesTheTrainingPrecision) {
  Config config;
  const auto param_bytes = [&config] { return PlanInput::from_config(config, {10}, 1, 0, {}).param_bytes; };
  EXPECT_EQ(param_bytes(), 4u);  // neither bf16 nor fp16: fp32 training
  config.precision.bf16 = true;
  EXPECT_EQ(param_bytes(), 2u);
  ASSERT_TRUE(set_training_precision(config, "fp16").ok());
  EXPECT_FALSE(config.precision.bf16);
  EXPECT_EQ(param_bytes(), 2u);
  ASSERT_TRUE(set_training_precision(config, "fp32").ok());
  EXPECT_EQ(param_bytes(), 4u);
  const Status bad = set_training_precision(config, "fp8");
  EXPECT_EQ(bad.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("precision 'fp8'"), std::string::npos) << bad.message();
}

TEST(ResolveBudgets, ExplicitBudgetsPassThrough) {
  TierConfig tiers;
  tiers.gpu = ByteBudget::of(80'000'000'000);
  tiers.cpu = ByteBudget::of(120'000'000'000);
  tiers.nvme = ByteBudget::of(2'000'000'000'000);
  const Expected<ResolvedBudgets> b = resolve_budgets(tiers, Capabilities{}, {});
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(b->gpu_bytes, 80'000'000'000u);
  EXPECT_EQ(b->cpu_bytes, 120'000'000'000u);
  EXPECT_EQ(b->nvme_bytes, 2'000'000'000'000u);
  EXPECT_EQ(b->gpu_source, "config");
  EXPECT_EQ(b->nvme_source, "config");
}

TEST(ResolveBudgets, AutoCpuIsNinetyPercentOfMemAvailable) {
  TierConfig tiers;  // all auto
  tiers.gpu = ByteBudget::of(1);
  Capabilities caps;
  caps.memory.available_bytes = 100'000'000'005;
  const Expected<ResolvedBudgets> b = resolve_budgets(tiers, caps, {});
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(b->cpu_bytes, 90'000'000'004u);  // floor(0.9 x 100'000'000'005)
  EXPECT_NE(b->cpu_source.find("90% of MemAvailable"), std::string::npos) << b->cpu_source;
  EXPECT_EQ(b->nvme_bytes, 0u);  // no paths
  EXPECT_NE(b->nvme_source.find("no NVMe paths"), std::string::npos) << b->nvme_source;
}

TEST(ResolveBudgets, AutoGpuUsesDeviceZeroOrSaysThereIsNone) {
  TierConfig tiers;
  tiers.cpu = ByteBudget::of(1);
  tiers.nvme = ByteBudget::of(1);
  Capabilities caps;
  caps.cuda.status = "built without CUDA";
  Expected<ResolvedBudgets> b = resolve_budgets(tiers, caps, {});
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), ErrorCode::kUnavailable);
  EXPECT_NE(b.status().message().find("tierzero.tiers.gpu_bytes"), std::string::npos) << b.status().message();
  EXPECT_NE(b.status().message().find("built without CUDA"), std::string::npos) << b.status().message();
  GpuDevice h100;
  h100.name = "NVIDIA H100";
  h100.total_memory_bytes = 80'000'000'000;
  caps.cuda.devices.push_back(h100);
  b = resolve_budgets(tiers, caps, {});
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(b->gpu_bytes, 72'000'000'000u);
  EXPECT_NE(b->gpu_source.find("NVIDIA H100"), std::string::npos) << b->gpu_source;
}

TEST(ResolveBudgets, AutoNvmeSumsFreeSpaceOrNamesTheBadPath) {
  TierConfig tiers;
  tiers.gpu = ByteBudget::of(1);
  tiers.cpu = ByteBudget::of(1);
  const std::string missing = ::testing::TempDir() + "tierzero_planner_no_such_dir";
  Expected<ResolvedBudgets> b = resolve_budgets(tiers, Capabilities{}, {missing});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find(missing), std::string::npos) << b.status().message();
  EXPECT_NE(b.status().message().find("tierzero.tiers.nvme_bytes"), std::string::npos) << b.status().message();
  const std::string dir = ::testing::TempDir();
  b = resolve_budgets(tiers, Capabilities{}, {dir});
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_GT(b->nvme_bytes, 0u);
  EXPECT_NE(b->nvme_source.find(dir), std::string::npos) << b->nvme_source;
}

}  // namespace
}  // namespace tz

namespace tz {
namespace {

TEST(PlanTraffic, SaturatesInsteadOfWrapping) {
  // 10^13 parameters with 2^20 micro-batches: the true host-to-device traffic
  // (~4 x 10^13 x 2^20 bytes) is past 2^64; the count must pin at the maximum,
  // not wrap to a small number that would make this placement look cheap.
  PlanInput in;
  in.block_numel.assign(1000, 10'000'000'000);
  in.gradient_accumulation_steps = 1 << 20;
  in.mode = PlacementMode::kDeepSpeed;
  in.offload_param = OffloadDevice::kCpu;
  in.offload_optimizer = OffloadDevice::kCpu;
  in.gpu_bytes = in.cpu_bytes = in.nvme_bytes = std::numeric_limits<std::uint64_t>::max() / 2;
  const Plan plan = must_plan(in);
  EXPECT_EQ(plan.traffic.h2d_bytes, std::numeric_limits<std::uint64_t>::max());
  EXPECT_EQ(plan.traffic.d2h_bytes, std::numeric_limits<std::uint64_t>::max());
  EXPECT_GT(plan.traffic.estimated_seconds, 1e8);
}


// ---- Note [Stepping under backward] (engine/src/step_ahead.h), "Cost, per rank"

// ZeRO-Infinity's placement (master and moments on NVMe, grads in CPU memory)
// with room for everything; only PlanInput::step_under_backward differs.
std::pair<Plan, Plan> without_and_with_step_ahead(std::uint64_t cpu, std::uint64_t nvme) {
  PlanInput off = zero_infinity();
  off.cpu_bytes = cpu;
  off.nvme_bytes = nvme;
  PlanInput on = off;
  on.step_under_backward = StepUnderBackward::kAuto;
  return {must_plan(off), must_plan(on)};
}

constexpr std::uint64_t kShard1B = 250'001'408;  // each block's shard (1 rank), aligned

TEST(PlanStepAhead, CountsTheSecondNvmeCopyAndTheCpuSlotsAndStaging) {
  const auto [off, on] = without_and_with_step_ahead(100'000'000'000, kHuge);
  EXPECT_EQ(on.tier, off.tier);
  EXPECT_EQ(off.ahead_blocks, 0U);
  EXPECT_EQ(on.ahead_blocks, 4U);
  EXPECT_EQ(on.ahead_off, "");
  // A second fp32 master and two fp32 moments: 12 B per element.
  EXPECT_EQ(on.usage_of(Tier::kNvme).need_bytes - off.usage_of(Tier::kNvme).need_bytes, 12 * 4 * kShard1B);
  // Three blocks' NVMe master + moments as staging, and each block's new 16-bit shard.
  EXPECT_EQ(on.usage_of(Tier::kCpu).need_bytes - off.usage_of(Tier::kCpu).need_bytes,
            3 * 12 * kShard1B + 4 * 2 * kShard1B);
  EXPECT_NE(format_plan(on, zero_infinity()).find("steps under backward"), std::string::npos);
}

TEST(PlanStepAhead, TheCpuHeadroomBoundsTheBlocksThatMay) {
  const std::uint64_t base = without_and_with_step_ahead(100'000'000'000, kHuge).first.usage_of(Tier::kCpu).need_bytes;
  // Staging and two and a half slots.
  const auto [off, on] = without_and_with_step_ahead(base + 3 * 12 * kShard1B + 5 * kShard1B, kHuge);
  EXPECT_EQ(on.tier, off.tier);
  EXPECT_EQ(on.ahead_blocks, 2U);
  EXPECT_NE(on.ahead_off.find("2 of 4 blocks"), std::string::npos) << on.ahead_off;
  EXPECT_TRUE(on.fits());
}

TEST(PlanStepAhead, WhereTheNvmeHeadroomDoesNotHoldTheSecondCopyItIsOffAndSaysWhy) {
  const std::uint64_t base = without_and_with_step_ahead(100'000'000'000, kHuge).first.usage_of(Tier::kNvme).need_bytes;
  const auto [off, on] = without_and_with_step_ahead(100'000'000'000, base + 12 * 4 * kShard1B - 1);
  EXPECT_EQ(on.tier, off.tier);
  EXPECT_EQ(on.ahead_blocks, 0U);
  EXPECT_NE(on.ahead_off.find("NVMe headroom"), std::string::npos) << on.ahead_off;
  EXPECT_EQ(on.usage_of(Tier::kNvme).need_bytes, off.usage_of(Tier::kNvme).need_bytes);
  EXPECT_EQ(on.usage_of(Tier::kCpu).need_bytes, off.usage_of(Tier::kCpu).need_bytes);
  EXPECT_TRUE(on.fits());
}

}  // namespace
}  // namespace tz
