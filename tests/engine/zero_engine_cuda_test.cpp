// ZeroEngine on a CUDA device: the same MLP training as zero_engine_test.cpp,
// with the states in GPU memory, pinned CPU memory or NVMe and the 16-bit
// parameters gathered into device memory, matches the in-memory reference.
// The MLP's arithmetic stays on the CPU (tz::mlp copies each gathered block
// down and each gradient up), so what is checked is the engine's CUDA data
// path: H2D/D2H copies, the device pools, the NCCL or single-rank
// collectives on device memory, and the GPU optimizer (Note [GPU optimizer]).
// Skips, saying why, without a GPU.
#include <gtest/gtest.h>

#include "tierzero/cpu_adam.h"
#include "tierzero/testing/engine.h"
#include "tierzero/kernels.h"
#include "../nvme/nvme_test_util.h"

namespace tzt {
namespace {

using tz::Tier;

constexpr tz::mlp::MlpConfig kMlp{.layers = 3, .hidden = 96, .batch = 6, .seed = 91};

#define TZ_REQUIRE_CUDA_DEVICE()                                                                            \
  do {                                                                                                      \
    if (!tz::kernels::cuda_kernels_built()) GTEST_SKIP() << "built without CUDA (-DTIERZERO_CUDA=OFF)";     \
    const tz::CudaCapabilities& cuda_ = tz::capabilities().cuda;                                            \
    if (cuda_.device_count == 0) GTEST_SKIP() << "no CUDA device: " << cuda_.status;                        \
  } while (0)

struct Case {
  Placement placement;
  const char* what;
};

const Case kCases[] = {
    {{Tier::kGpu, Tier::kGpu, Tier::kGpu, Tier::kGpu}, "all on the GPU (GPU optimizer)"},
    {{Tier::kGpu, Tier::kCpu, Tier::kCpu, Tier::kCpu}, "optimizer offloaded to the CPU"},
    {{Tier::kCpu, Tier::kCpu, Tier::kCpu, Tier::kCpu}, "params in pinned CPU memory too"},
    {{Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme}, "params and optimizer on NVMe"},
    {{Tier::kCpu, Tier::kGpu, Tier::kGpu, Tier::kGpu}, "params in CPU memory, GPU optimizer"},
    {{Tier::kNvme, Tier::kGpu, Tier::kGpu, Tier::kGpu}, "params on NVMe, GPU optimizer"},
};

TEST(ZeroEngineCuda, EveryPlacementMatchesTheInMemoryReference) {
  TZ_REQUIRE_CUDA_DEVICE();
  for (const Case& c : kCases) {
    for (const char* precision : {"bf16", "fp16", "fp32"}) {
      TempDir nvme;
      const tz::Config config = test_config(nvme.path(), 3, 2, precision, "cuda");
      auto engine = tz::ZeroEngine::create({.config = config, .placement = c.placement}, tz::mlp::model(kMlp),
                                           tz::mlp::init(kMlp));
      ASSERT_TRUE(engine.ok()) << c.what << ", " << precision << ": " << engine.status().to_string();
      EXPECT_EQ((*engine)->device().kind(), tz::BackendKind::kCuda);
      tz::mlp::Reference ref(kMlp, config, 1);
      const std::vector<Compare> by_step = train_and_compare_steps(**engine, ref, kMlp, 4, 2);
      EXPECT_EQ(by_step.size(), 4U) << c.what << ", " << precision;
      if (by_step.size() != 4U) continue;
      double worst = 0;
      std::size_t beyond = 0;
      for (const Compare& s : by_step) {
        worst = std::max(worst, s.max_abs);
        beyond = std::max(beyond, s.beyond_near);
      }
      std::printf("[ cuda   ] %-34s %-5s largest |master - reference| after 4 steps: %.3g (%zu of %zu beyond %.0e)\n",
                  c.what, precision, worst, beyond, by_step.back().elements, Compare::near);
      // Note [16-bit rounding flips]: the engine's fp32 Adam and the
      // reference's double Adam leave masters 1 fp32 ulp apart in about a
      // third of the elements after each step. Where one of them straddles a
      // 16-bit rounding boundary, the next forward sees a parameter one
      // 16-bit ulp apart, and the updates downstream of it move by ~1e-5 from
      // then on. Seen with seed 91 (on the Host backend alike): fp16 from
      // step 2 (42 elements beyond 1e-6 after step 4, largest 7.03e-6), bf16
      // in step 4 (111 elements, 4.88e-6); at 88d33fd fp16 flipped in step 2
      // (1.89e-5) and bf16 not within 4 steps: which element flips hangs on
      // the last bit of the fp32 arithmetic, which later work changed. A
      // wrong term (a bias correction missing, a gradient scaled twice, a
      // stale parameter) moves most weights by ~lr = 1e-3. So: after the
      // first step, whose forward used the initial weights, every master is
      // within 1e-6; after later steps, with 16-bit parameters, at most 1% of
      // them are beyond 1e-6 and none beyond 5e-5; fp32 parameters cannot
      // flip: 1e-6 throughout.
      const bool sixteen = std::string_view(precision) != "fp32";
      EXPECT_LE(by_step.front().max_abs, Compare::near) << c.what << ", " << precision << ": step 1";
      EXPECT_LE(worst, sixteen ? 5e-5 : Compare::near) << c.what << ", " << precision;
      EXPECT_LE(beyond, sixteen ? by_step.back().elements / 100 : 0) << c.what << ", " << precision;
    }
  }
}

TEST(ZeroEngineCuda, ABlockReleasedAfterAStreamIsNotReusedUntilItsReadersAreDone) {
  TZ_REQUIRE_CUDA_DEVICE();
  TempDir nvme;
  const tz::Config config = test_config(nvme.path(), 3, 1, "bf16", "cuda");
  check_stream_ordered_release(config, "none", false);
  for (const char* how : {"stream", "native"}) {
    check_stream_ordered_release(config, how, false);
    check_stream_ordered_release(config, how, true);
  }
}

TEST(ZeroEngineCuda, ACheckpointFromTheGpuOptimizerResumesOnTheCpuOptimizer) {
  TZ_REQUIRE_CUDA_DEVICE();
  TempDir nvme, ckpt;
  const tz::Config config = test_config(nvme.path(), 3, 1, "bf16", "cuda");
  auto run = [&](const Placement& placement, int from, int to, bool load, bool save) -> std::vector<std::vector<float>> {
    auto engine = tz::ZeroEngine::create({.config = config, .placement = placement}, tz::mlp::model(kMlp),
                                         tz::mlp::init(kMlp));
    EXPECT_TRUE(engine.ok()) << engine.status().to_string();
    if (!engine.ok()) return {};
    tz::ZeroEngine& e = **engine;
    if (load) {
      EXPECT_TRUE(e.load_checkpoint(ckpt.path()).ok());
    }
    for (int step = from; step < to; ++step) {
      EXPECT_TRUE(tz::mlp::train_micro_batch(e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step)).ok());
      auto r = e.step();
      EXPECT_TRUE(r.ok() && r->stepped) << (r.ok() ? "" : r.status().to_string());
    }
    if (save) {
      EXPECT_TRUE(e.save_checkpoint(ckpt.path()).ok());
    }
    std::vector<std::vector<float>> masters;
    for (std::size_t b = 0; b < e.layout().blocks.size(); ++b) masters.push_back(*e.gather_master(b));
    return masters;
  };
  const Placement gpu = kCases[0].placement, offload = kCases[1].placement;
  const auto unbroken = run(offload, 0, 6, false, false);
  run(gpu, 0, 3, false, true);
  const auto resumed = run(offload, 3, 6, true, false);
  ASSERT_EQ(unbroken.size(), resumed.size());
  double worst = 0;
  for (std::size_t b = 0; b < unbroken.size(); ++b) {
    for (std::size_t i = 0; i < unbroken[b].size(); ++i) {
      worst = std::max(worst, std::fabs(static_cast<double>(unbroken[b][i]) - resumed[b][i]));
    }
  }
  // Three steps on the GPU optimizer, a checkpoint, three on cpu_adam, against
  // six on cpu_adam: the two compute the same formulas (their fma contraction
  // may differ in the last bit), so the runs agree to rounding.
  EXPECT_LE(worst, 1e-6);
}

TEST(ZeroEngineCuda, MixedGpuAndOffloadedOptimizerStatesAreRefusedNamingThePlacement) {
  TZ_REQUIRE_CUDA_DEVICE();
  TempDir nvme;
  const tz::Config config = test_config(nvme.path(), 3, 1, "bf16", "cuda");
  auto engine = tz::ZeroEngine::create({.config = config, .placement = Placement{Tier::kGpu, Tier::kGpu, Tier::kCpu,
                                                                                 Tier::kCpu}},
                                       tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("grad on gpu, master on cpu, moments on cpu"), std::string::npos)
      << engine.status().to_string();
  tz::Config lion = config;
  lion.optimizer.type = "Lion";
  engine = tz::ZeroEngine::create({.config = lion, .placement = kCases[0].placement}, tz::mlp::model(kMlp),
                                  tz::mlp::init(kMlp));
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("Lion"), std::string::npos) << engine.status().to_string();
}

// Note [16-bit gradient accumulators]: the GPU optimizer accumulates in fp32;
// a 16-bit data_types.grad_accum_dtype is refused there, naming the key.
TEST(ZeroEngineCuda, A16BitGradAccumulatorWithTheGpuOptimizerIsRefusedNamingTheKey) {
  TZ_REQUIRE_CUDA_DEVICE();
  TempDir nvme;
  tz::Config config = test_config(nvme.path(), 3, 1, "bf16", "cuda");
  config.states.grads = tz::GradFormat::kBf16;
  auto engine = tz::ZeroEngine::create({.config = config, .placement = kCases[0].placement}, tz::mlp::model(kMlp),
                                       tz::mlp::init(kMlp));
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("data_types.grad_accum_dtype = \"bf16\""), std::string::npos)
      << engine.status().to_string();
  // Offloaded, the CPU optimizer accumulates in bf16.
  engine = tz::ZeroEngine::create({.config = config, .placement = kCases[1].placement}, tz::mlp::model(kMlp),
                                  tz::mlp::init(kMlp));
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
}

// ---------------------------------------------------------------- compact states on the GPU optimizer
// Note [Compact states on the GPU optimizer]: the GPU optimizer steps
// remainder masters and bf16 and int8 moments with cpu_adam's arithmetic.

using tz::MasterFormat;
using tz::MomentFormat;

constexpr int kCompactSteps = 20;
constexpr double kClip = 0.05;  // small enough that clipping scales most steps (checked)

tz::Config compact_config(const std::string& nvme, tz::StateFormats states, double clip) {
  tz::Config config = test_config(nvme, 3, 2, "bf16", "cuda");
  config.gradient_clipping = clip;
  config.states = states;
  return config;
}

tz::Expected<RunBits> run_formats(tz::StateFormats states, const Placement& placement, double clip) {
  TempDir nvme;
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> engine,
                      tz::ZeroEngine::create({.config = compact_config(nvme.path(), states, clip), .placement = placement},
                                             tz::mlp::model(kMlp), tz::mlp::init(kMlp)));
  return train_for_bits(*engine, kMlp, kCompactSteps, 2);
}

// The masters' first difference, leaving the gradient norms aside (the two
// optimizers' paths sum them in different orders).
std::string first_master_difference(RunBits a, RunBits b) {
  a.grad_norms.clear();
  b.grad_norms.clear();
  return first_difference(a, b);
}

const tz::StateFormats kGpuFormats[] = {{MasterFormat::kRemainder, MomentFormat::kFp32},
                                        {MasterFormat::kFp32, MomentFormat::kBf16},
                                        {MasterFormat::kRemainder, MomentFormat::kBf16},
                                        {MasterFormat::kFp32, MomentFormat::kInt8},
                                        {MasterFormat::kRemainder, MomentFormat::kInt8}};

std::string formats_name(tz::StateFormats f) {
  return fmt::format("master {}, moments {}", tz::master_format_name(f.master), tz::moment_format_name(f.moments));
}

// With clipping on, 20 steps: the remainder master on the GPU optimizer is
// the fp32 master bit for bit (as with cpu_adam), with fp32 or bf16 moments.
// The parameters in GPU memory, CPU memory or on NVMe: a remainder master
// reads its bf16 half from wherever they are.
TEST(ZeroEngineCuda, RemainderMastersOnTheGpuOptimizerTrainBitForBitAsFp32MastersWithClipping) {
  TZ_REQUIRE_CUDA_DEVICE();
  for (const Placement& gpu : {kCases[0].placement, kCases[4].placement, kCases[5].placement}) {
    for (MomentFormat moments : {MomentFormat::kFp32, MomentFormat::kBf16}) {
      SCOPED_TRACE(fmt::format("{}, moments {}", placement_name(gpu), tz::moment_format_name(moments)));
      const auto fp32 = run_formats({MasterFormat::kFp32, moments}, gpu, kClip);
      const auto remainder = run_formats({MasterFormat::kRemainder, moments}, gpu, kClip);
      ASSERT_TRUE(fp32.ok() && remainder.ok()) << (fp32.ok() ? remainder.status() : fp32.status()).to_string();
      int clipped = 0;
      for (double norm : fp32->grad_norms) clipped += norm > kClip;
      EXPECT_GE(clipped, kCompactSteps / 2) << "clipping must bite for this test to mean anything";
      EXPECT_EQ(first_difference(*fp32, *remainder), "");
      EXPECT_NE(fp32->masters[kCompactSteps - 1], fp32->masters[kCompactSteps - 2]);  // the control
    }
  }
}

// Every compact format on the GPU optimizer steps as the same formats with
// the optimizer in CPU memory, bit for bit over 20 steps. Clipping is off:
// its coefficient comes from the gradient norm, which the device sums in
// another order (Note [Deterministic norms]), so with clipping the two runs
// are the same formulas on gradients scaled a rounding apart.
TEST(ZeroEngineCuda, CompactStatesOnTheGpuOptimizerStepAsInCpuMemoryBitForBit) {
  TZ_REQUIRE_CUDA_DEVICE();
  TZ_REQUIRE_FUSED_CPU_ADAM();
  for (const tz::StateFormats& f : kGpuFormats) {
    SCOPED_TRACE(formats_name(f));
    const auto gpu = run_formats(f, kCases[0].placement, 0.0);
    const auto cpu = run_formats(f, kCases[1].placement, 0.0);
    ASSERT_TRUE(gpu.ok() && cpu.ok()) << (gpu.ok() ? cpu.status() : gpu.status()).to_string();
    EXPECT_EQ(first_master_difference(*gpu, *cpu), "");
    for (std::size_t s = 0; s < gpu->grad_norms.size(); ++s) {
      EXPECT_NEAR(gpu->grad_norms[s], cpu->grad_norms[s], 1e-6 * cpu->grad_norms[s]) << "step " << s + 1;
    }
  }
  // The controls: bf16 moments are in effect on the GPU (an fp32-moment run
  // differs), and so are int8 moments (a bf16-moment run differs).
  const auto fp32 = run_formats({}, kCases[0].placement, 0.0);
  const auto bf16 = run_formats(kGpuFormats[1], kCases[0].placement, 0.0);
  const auto int8 = run_formats(kGpuFormats[3], kCases[0].placement, 0.0);
  ASSERT_TRUE(fp32.ok() && bf16.ok() && int8.ok());
  EXPECT_NE(first_master_difference(*fp32, *bf16), "");
  EXPECT_NE(first_master_difference(*bf16, *int8), "");
}

// A checkpoint of compact states saved by either optimizer loads into the
// other, and both go on as the unbroken run (clipping off, as above).
TEST(ZeroEngineCuda, CompactCheckpointsMoveBetweenTheGpuAndCpuOptimizersBitForBit) {
  TZ_REQUIRE_CUDA_DEVICE();
  TZ_REQUIRE_FUSED_CPU_ADAM();
  const Placement gpu = kCases[0].placement, cpu = kCases[1].placement;
  for (const tz::StateFormats& f : {kGpuFormats[2], kGpuFormats[4]}) {  // bf16 and int8 moments
    for (bool from_gpu : {true, false}) {
      SCOPED_TRACE(fmt::format("{}, saved on the {} optimizer", formats_name(f), from_gpu ? "GPU" : "CPU"));
      TempDir nvme, ckpt;
      auto make = [&](const Placement& p) {
        return tz::ZeroEngine::create({.config = compact_config(nvme.path(), f, 0.0), .placement = p},
                                      tz::mlp::model(kMlp), tz::mlp::init(kMlp));
      };
      auto a = make(from_gpu ? gpu : cpu);
      ASSERT_TRUE(a.ok()) << a.status().to_string();
      ASSERT_TRUE(train_for_bits(**a, kMlp, 3, 2).ok());
      ASSERT_TRUE((*a)->save_checkpoint(ckpt.path()).ok());
      auto b = make(from_gpu ? cpu : gpu);
      ASSERT_TRUE(b.ok()) << b.status().to_string();
      const tz::Status loaded = (*b)->load_checkpoint(ckpt.path());
      ASSERT_TRUE(loaded.ok()) << loaded.to_string();
      const auto going_on = train_for_bits(**a, kMlp, 4, 2);
      const auto resumed = train_for_bits(**b, kMlp, 4, 2);
      ASSERT_TRUE(going_on.ok() && resumed.ok());
      EXPECT_EQ(first_master_difference(*going_on, *resumed), "");
    }
  }
}

// The export rebuilds the fp32 master from the GPU's remainders: the same
// file as an fp32-master run on the GPU optimizer, byte for byte.
TEST(ZeroEngineCuda, TheExportOfGpuRemainderMastersIsTheFp32RunsByteForByte) {
  TZ_REQUIRE_CUDA_DEVICE();
  std::string files[2];
  for (MasterFormat master : {MasterFormat::kFp32, MasterFormat::kRemainder}) {
    TempDir nvme, out;
    auto file = exported_after_training(
        {.config = compact_config(nvme.path(), {master, MomentFormat::kBf16}, kClip), .placement = kCases[0].placement},
        kMlp, 3, 2, out.path());
    ASSERT_TRUE(file.ok()) << file.status().to_string();
    files[static_cast<int>(master)] = std::move(*file);
  }
  ASSERT_GT(files[0].size(), 1000u);
  EXPECT_TRUE(files[0] == files[1]);
}

// Int8 moments train on the GPU optimizer (Note [Int8 moments on the GPU
// optimizer]) with the parameters in GPU memory, CPU memory or on NVMe, with
// clipping on: the optimizer's arithmetic does not depend on where the
// parameters live, so the three runs are one run, bit for bit, and it moves.
TEST(ZeroEngineCuda, Int8MomentsOnTheGpuOptimizerTrainAlikeWhereverTheParametersLive) {
  TZ_REQUIRE_CUDA_DEVICE();
  const tz::StateFormats f{MasterFormat::kRemainder, MomentFormat::kInt8};
  const auto on_gpu = run_formats(f, kCases[0].placement, kClip);
  ASSERT_TRUE(on_gpu.ok()) << on_gpu.status().to_string();
  EXPECT_NE(on_gpu->masters[kCompactSteps - 1], on_gpu->masters[kCompactSteps - 2]);
  for (const Placement& p : {kCases[4].placement, kCases[5].placement}) {
    SCOPED_TRACE(placement_name(p));
    const auto run = run_formats(f, p, kClip);
    ASSERT_TRUE(run.ok()) << run.status().to_string();
    EXPECT_EQ(first_difference(*on_gpu, *run), "");
  }
}

// ---------------------------------------------------------------- gradients across micro-batches on the GPU
// Note [Accumulating on the device across micro-batches]: with the CPU
// optimizer and 3 micro-batches a step, the default on CUDA keeps every
// block's fp32 accumulator on the GPU (the test budget holds them) and brings
// the sum down once; the run is the host path's (the switch off) bit for bit,
// norms included, and the gradients move 4 B an element down instead of 6.
TEST(ZeroEngineCuda, GradientsAccumulatedOnTheGpuAcrossMicroBatchesTrainAsOnTheHostBitForBit) {
  TZ_REQUIRE_CUDA_DEVICE();
  TZ_REQUIRE_FUSED_CPU_ADAM();
  constexpr int kGas = 3;
  for (const Case& c : {kCases[1], kCases[2], kCases[3]}) {
    SCOPED_TRACE(c.what);
    struct Arm {
      RunBits bits;
      tz::StepReport last;
      std::uint64_t numel = 0;
    };
    const auto arm = [&](std::optional<bool> window) -> tz::Expected<Arm> {
      TempDir nvme;
      tz::Config config = test_config(nvme.path(), 3, kGas, "bf16", "cuda");
      config.gradient_clipping = kClip;
      TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> engine,
                          tz::ZeroEngine::create({.config = config, .placement = c.placement,
                                                  .grads_on_device_across_micro_batches = window},
                                                 tz::mlp::model(kMlp), tz::mlp::init(kMlp)));
      Arm a;
      TZ_ASSIGN_OR_RETURN(a.bits, train_for_bits(*engine, kMlp, kCompactSteps, kGas));
      for (int micro = 0; micro < kGas; ++micro) {
        TZ_TRY(tz::mlp::train_micro_batch(*engine, kMlp, tz::mlp::make_batch(kMlp, 0, micro, kCompactSteps)).status());
        TZ_ASSIGN_OR_RETURN(a.last, engine->step());
      }
      for (const tz::BlockLayout& b : engine->layout().blocks) a.numel += b.shard_numel;
      return a;
    };
    const auto host = arm(false), device = arm(std::nullopt);
    ASSERT_TRUE(host.ok() && device.ok()) << (host.ok() ? device.status() : host.status()).to_string();
    EXPECT_EQ(device->last.grad_window_blocks, 3U) << "on CUDA by default, where the budget allows";
    EXPECT_EQ(first_difference(host->bits, device->bits), "");
    EXPECT_EQ(host->last.d2h_bytes, 2 * kGas * host->numel);
    EXPECT_EQ(device->last.d2h_bytes, 4 * device->numel);
  }
}

}  // namespace
}  // namespace tzt
