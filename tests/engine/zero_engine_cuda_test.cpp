// ZeroEngine on a CUDA device: the same MLP training as zero_engine_test.cpp,
// with the states in GPU memory, pinned CPU memory or NVMe and the 16-bit
// parameters gathered into device memory, matches the in-memory reference.
// The MLP's arithmetic stays on the CPU (tz::mlp copies each gathered block
// down and each gradient up), so what is checked is the engine's CUDA data
// path: H2D/D2H copies, the device pools, the NCCL or single-rank
// collectives on device memory, and the GPU optimizer (Note [GPU optimizer]).
// Skips, saying why, without a GPU.
#include <gtest/gtest.h>

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
      const double worst = train_and_compare(**engine, ref, kMlp, 4, 2);
      std::printf("[ cuda   ] %-34s %-5s largest |master - reference| after 4 steps: %.3g\n", c.what, precision, worst);
      // Note [fp16 rounding flips]: the engine's fp32 Adam and the reference's
      // double Adam leave masters 1 fp32 ulp apart in about a fifth of the
      // elements after one step; with fp16's finer steps one of them (seed 91)
      // straddles a rounding boundary, so one 16-bit parameter differs by one
      // fp16 ulp in step 2 and later updates move by ~1e-5 (seen: 1.89e-5 on
      // every placement and on the Host backend alike). A wrong term would
      // move many weights by ~lr = 1e-3.
      const double tolerance = std::string_view(precision) == "fp16" ? 5e-5 : 1e-6;
      EXPECT_LE(worst, tolerance) << c.what << ", " << precision;
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

}  // namespace
}  // namespace tzt
