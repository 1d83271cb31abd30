// Helpers for the engine tests: configs, and training the MLP workload on the
// engine beside its in-memory reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "tierzero/cpu_adam.h"
#include "tierzero/engine.h"
#include "tierzero/testing/mlp.h"

// For runs compared bit for bit with a device kernel's arithmetic (the GPU
// optimizer, the gradient accumulation kernel and its CPU twin): they fuse
// multiply-adds as cpu_adam's AVX2 and AVX-512 kernels do, and cpu_adam's
// scalar and SSE4.2 kernels do not, so on a CPU with neither the two differ
// in the last bit by design (Note [Compact Adam arithmetic]). Skips, saying so.
#define TZ_REQUIRE_FUSED_CPU_ADAM()                                                                               \
  do {                                                                                                            \
    const tz::cpu_adam::Simd simd_ = tz::cpu_adam::best_supported();                                             \
    if (simd_ != tz::cpu_adam::Simd::kAvx2 && simd_ != tz::cpu_adam::Simd::kAvx512) {                             \
      GTEST_SKIP() << "cpu_adam runs " << tz::cpu_adam::simd_name(simd_) << ", which does not fuse multiply-adds"; \
    }                                                                                                             \
  } while (0)

namespace tzt {

// A DeepSpeed-style config for the tests: ZeRO stage, AdamW, clipping,
// accumulation, precision ("bf16", "fp16" or "fp32": neither block, as
// DeepSpeed trains in fp32), explicit budgets and one NVMe path.
inline tz::Config test_config(const std::string& nvme_dir, int stage = 3, int gas = 2,
                              const std::string& precision = "bf16", const std::string& backend = "host") {
  const std::string prec_block =
      precision == "fp16"   ? R"("fp16": {"enabled": true, "initial_scale_power": 12, "hysteresis": 1},)"
      : precision == "bf16" ? R"("bf16": {"enabled": true},)"
                            : "";
  const std::string json = fmt::format(R"({{
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": {gas},
    "gradient_clipping": 1.0,
    {prec}
    "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}}},
    "zero_optimization": {{"stage": {stage}, "stage3_param_persistence_threshold": 0, "sub_group_size": 40000}},
    "tierzero": {{"backend": "{backend}", "tiers": {{"gpu_bytes": "512MiB", "cpu_bytes": "1GiB", "nvme_bytes": "4GiB",
                  "nvme_paths": ["{nvme}"]}}}}
  }})",
                                       fmt::arg("gas", gas), fmt::arg("prec", prec_block), fmt::arg("stage", stage),
                                       fmt::arg("nvme", nvme_dir), fmt::arg("backend", backend));
  auto config = tz::parse_config(json, "test config");
  EXPECT_TRUE(config.ok()) << config.status().to_string();
  return config.ok() ? *config : tz::Config{};
}

// test_config with DeepSpeed's offload keys placing params and optimizer
// states on NVMe (the main job's placement): the plan is the config's.
inline tz::Config deepspeed_nvme_config(const std::string& nvme_dir, int gas = 1) {
  tz::Config config = test_config(nvme_dir, 3, gas, "bf16");
  config.placement = tz::PlacementMode::kDeepSpeed;
  config.zero.has_offload_param = config.zero.has_offload_optimizer = true;
  config.zero.offload_param.device = config.zero.offload_optimizer.device = tz::OffloadDevice::kNvme;
  config.zero.offload_param.nvme_path = config.zero.offload_optimizer.nvme_path = nvme_dir;
  return config;
}

// The budgets an engine planned with, for planning the same model again
// (the planner-counts-what-the-engine-adds tests).
inline tz::ResolvedBudgets budgets_of(const tz::Plan& plan) {
  return {.gpu_bytes = plan.usage_of(tz::Tier::kGpu).budget_bytes,
          .cpu_bytes = plan.usage_of(tz::Tier::kCpu).budget_bytes,
          .nvme_bytes = plan.usage_of(tz::Tier::kNvme).budget_bytes};
}

using Placement = std::array<tz::Tier, tz::kNumStateClasses>;  // param16, grad, master, moments

inline std::string placement_name(const Placement& p) {
  std::string out;
  for (std::size_t s = 0; s < p.size(); ++s) {
    out += fmt::format("{}{}={}", s == 0 ? "" : ",", tz::state_class_name(static_cast<tz::StateClass>(s)),
                       tz::tier_name(p[s]));
  }
  return out;
}

// Largest |engine - reference| over every block's master weights, and how
// many of them differ by more than `near` (Note [16-bit rounding flips] in
// zero_engine_cuda_test.cpp).
struct Compare {
  double max_abs = 0;
  double max_ref = 0;
  std::size_t elements = 0;
  std::size_t beyond_near = 0;
  static constexpr double near = 1e-6;
};

inline tz::Expected<Compare> compare_masters(tz::ZeroEngine& engine, const tz::mlp::Reference& ref) {
  Compare c;
  for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) {
    TZ_ASSIGN_OR_RETURN(std::vector<float> got, engine.gather_master(b));
    const std::vector<float> want = ref.master(b);
    if (got.size() != want.size()) return tz::internal_error("block {}: {} vs {} elements", b, got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double d = std::fabs(static_cast<double>(got[i]) - want[i]);
      c.max_abs = std::max(c.max_abs, d);
      c.beyond_near += d > Compare::near ? 1 : 0;
      ++c.elements;
      c.max_ref = std::max(c.max_ref, std::fabs(static_cast<double>(want[i])));
    }
  }
  return c;
}

// Trains `steps` optimizer steps on the engine and the reference side by side
// and returns each step's comparison of the master weights.
inline std::vector<Compare> train_and_compare_steps(tz::ZeroEngine& engine, tz::mlp::Reference& ref,
                                                    const tz::mlp::MlpConfig& mlp, int steps, int gas) {
  std::vector<Compare> out;
  for (int step = 0; step < steps; ++step) {
    double loss = 0;
    for (int micro = 0; micro < gas; ++micro) {
      auto l = tz::mlp::train_micro_batch(engine, mlp, tz::mlp::make_batch(mlp, engine.rank(), micro, step));
      EXPECT_TRUE(l.ok()) << l.status().to_string();
      if (!l.ok()) return out;
      loss += *l;
      auto r = engine.step();
      EXPECT_TRUE(r.ok()) << r.status().to_string();
      if (!r.ok()) return out;
      EXPECT_EQ(r->stepped, micro == gas - 1);
    }
    const double ref_loss = ref.train_step(step);
    EXPECT_NEAR(loss / gas, ref_loss, 1e-4 * std::fabs(ref_loss)) << "step " << step;
    auto c = compare_masters(engine, ref);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    out.push_back(c.ok() ? *c : Compare{.max_abs = INFINITY});
  }
  return out;
}

// The same, returning the largest master-weight difference over the steps.
inline double train_and_compare(tz::ZeroEngine& engine, tz::mlp::Reference& ref, const tz::mlp::MlpConfig& mlp,
                                int steps, int gas) {
  const std::vector<Compare> by_step = train_and_compare_steps(engine, ref, mlp, steps, gas);
  double worst = by_step.size() == static_cast<std::size_t>(steps) ? 0 : INFINITY;
  for (const Compare& c : by_step) worst = std::max(worst, c.max_abs);
  return worst;
}

// One run, recorded for bit-for-bit comparisons: every block's gathered fp32
// master after each optimizer step (as bits, blocks one after another), each
// block's gathered 16-bit parameters at the end (Host backend only, where
// device memory is host memory; on CUDA they are the masters' copy-out), and
// each step's gradient norm before clipping.
struct RunBits {
  std::vector<std::vector<std::uint32_t>> masters;
  std::vector<std::vector<std::uint8_t>> params;
  std::vector<double> grad_norms;
};

// Every block's gathered fp32 master as bits, blocks one after another.
inline tz::Expected<std::vector<std::uint32_t>> master_bits(tz::ZeroEngine& engine) {
  std::vector<std::uint32_t> bits;
  for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) {
    TZ_ASSIGN_OR_RETURN(std::vector<float> master, engine.gather_master(b));
    const std::size_t at = bits.size();
    bits.resize(at + master.size());
    std::memcpy(bits.data() + at, master.data(), master.size() * 4);
  }
  return bits;
}

// Every block's gathered 16-bit (or fp32) parameters as bytes, fetched for
// evaluation (Host backend: device memory is host memory).
inline tz::Expected<std::vector<std::vector<std::uint8_t>>> gathered_params(tz::ZeroEngine& engine) {
  std::vector<std::vector<std::uint8_t>> params;
  const std::size_t elem = tz::dtype_bytes(engine.param_type());
  for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) {
    TZ_ASSIGN_OR_RETURN(tz::GatheredBlock gathered, engine.fetch(b, tz::FetchFor::kEvaluation));
    const auto* data = static_cast<const std::uint8_t*>(gathered.data());
    params.emplace_back(data, data + engine.layout().blocks[b].whole_numel * elem);
  }
  return params;
}

inline tz::Expected<RunBits> train_for_bits(tz::ZeroEngine& engine, const tz::mlp::MlpConfig& mlp, int steps,
                                            int gas) {
  RunBits run;
  for (int step = 0; step < steps; ++step) {
    for (int micro = 0; micro < gas; ++micro) {
      TZ_TRY(tz::mlp::train_micro_batch(engine, mlp, tz::mlp::make_batch(mlp, engine.rank(), micro, step)).status());
      TZ_ASSIGN_OR_RETURN(tz::StepReport report, engine.step());
      if (report.stepped) run.grad_norms.push_back(report.grad_norm);
    }
    TZ_ASSIGN_OR_RETURN(run.masters.emplace_back(), master_bits(engine));
  }
  if (engine.device().kind() == tz::BackendKind::kHost) {
    TZ_ASSIGN_OR_RETURN(run.params, gathered_params(engine));
  }
  return run;
}

// The bytes of the safetensors file an engine made with `options` exports
// into `dir` after train_for_bits(mlp, steps, micro_batches).
inline tz::Expected<std::string> exported_after_training(const tz::ZeroOptions& options, const tz::mlp::MlpConfig& mlp,
                                                         int steps, int micro_batches, const std::string& dir) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::ZeroEngine> engine,
                      tz::ZeroEngine::create(options, tz::mlp::model(mlp), tz::mlp::init(mlp)));
  TZ_TRY(train_for_bits(*engine, mlp, steps, micro_batches).status());
  const std::string path = dir + "/model.safetensors";
  TZ_TRY(engine->export_safetensors(path));
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The median of a run's gradient norms: as a max norm it clips about half
// the steps (the clipping-bites-on-some-steps tests).
inline double median_grad_norm(std::vector<double> norms) {
  if (norms.empty()) return 1.0;
  std::nth_element(norms.begin(), norms.begin() + static_cast<std::ptrdiff_t>(norms.size() / 2), norms.end());
  return norms[norms.size() / 2];
}

// The first difference between two recorded runs, or "" when they are the same bit for bit.
inline std::string first_difference(const RunBits& a, const RunBits& b) {
  if (a.masters.size() != b.masters.size()) return fmt::format("{} vs {} steps", a.masters.size(), b.masters.size());
  for (std::size_t s = 0; s < a.masters.size(); ++s) {
    if (a.masters[s].size() != b.masters[s].size()) return fmt::format("step {}: master sizes differ", s + 1);
    for (std::size_t i = 0; i < a.masters[s].size(); ++i) {
      if (a.masters[s][i] != b.masters[s][i]) {
        return fmt::format("after step {}, master element {}: bits {:08x} vs {:08x}", s + 1, i, a.masters[s][i],
                           b.masters[s][i]);
      }
    }
  }
  if (a.params != b.params) return "the gathered 16-bit parameters differ";
  if (a.grad_norms != b.grad_norms) return "the gradient norms differ";
  return "";
}

}  // namespace tzt

#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <random>

namespace tzt {

// Runs `body(rank, ranks)` in `world` forked processes that meet through a
// fresh rendezvous directory; returns the exit codes (0 = passed). A child
// prints its own failures. Must be called before this process starts threads
// that a child would need (fork keeps only the calling thread).
inline std::vector<int> run_ranks(int world, const std::string& rendezvous_dir,
                                  const std::function<int(const tz::RankInfo&)>& body) {
  static std::mt19937 rng(std::random_device{}());
  const int port = 20000 + static_cast<int>(rng() % 20000);
  std::vector<pid_t> pids;
  std::fflush(nullptr);  // nothing buffered is written twice, by parent and child
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::alarm(240);  // a hung rank dies of SIGALRM (code 128 + 14) and fails its test, not hangs it
      tz::RankInfo info{.rank = r, .world_size = world, .local_rank = r, .local_world_size = world,
                        .master_addr = "127.0.0.1", .master_port = port, .source = "test"};
      ::setenv("TIERZERO_RENDEZVOUS_DIR", rendezvous_dir.c_str(), 1);
      int code = 3;
      try {
        code = body(info);
      } catch (...) {
        code = 4;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

// run_ranks with what each engine test's rank does first: its own NVMe
// directory, `dir`/rank<r>, and a communicator (60 s timeout); a rank that
// cannot make one exits 1.
inline std::vector<int> run_engine_ranks(
    int world, const std::string& dir,
    const std::function<int(const tz::RankInfo&, tz::Communicator* comm, const std::string& nvme)>& body) {
  return run_ranks(world, dir + "/rendezvous", [&](const tz::RankInfo& info) {
    const std::string nvme = dir + "/rank" + std::to_string(info.rank);
    std::filesystem::create_directories(nvme);
    auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(60)});
    if (!comm.ok()) return 1;
    return body(info, comm->get(), nvme);
  });
}

}  // namespace tzt

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

namespace tzt {

// Note [Stream-ordered release], caused. A reader stream sleeps 300 ms and
// then copies gathered block 0 (bf16, all 1.0) into scratch memory; block 0
// is given back while that is queued, and the engine then reuses memory: it
// gathers block 1 (all 2.0), or, when block 0 is persistent, steps and
// re-gathers it with new values. The reader must still see 1.0. `how`:
// "stream" (release_after the reader), "native" (release_after_native with
// its handle: CUDA only, as the Host backend has no foreign streams), or
// "none": plain destruction, the control, which must find block 1 gathered
// straight into block 0's buffer (so the other cases would see 2.0 if
// release_after did nothing). `config` trains bf16.
inline void check_stream_ordered_release(tz::Config config, const std::string& how, bool persistent) {
  SCOPED_TRACE(fmt::format("release: {}, {} block", how, persistent ? "persistent" : "gathered"));
  constexpr std::int64_t kNumel = 8192;
  constexpr std::uint16_t kOne = 0x3F80, kTwo = 0x4000;  // bf16
  if (persistent) {
    config.zero.stage3_param_persistence_threshold = 2 * kNumel;
    config.optimizer.lr = 0.05;  // a step of 1e-3 would leave 1.0 the nearest bf16
  }
  const std::vector<tz::BlockSpec> model = {{"a", {{"w", {kNumel}}}}, {"b", {{"w", {kNumel}}}}};
  const tz::ParamInit init = [](std::size_t b, std::size_t, float* out, std::uint64_t numel) {
    std::fill(out, out + numel, static_cast<float>(b + 1));
  };
  const Placement on_device{tz::Tier::kGpu, tz::Tier::kGpu, tz::Tier::kGpu, tz::Tier::kGpu};
  // fp32 gradients: their buffers are twice the size, so the pool never hands one out for a block's parameters.
  auto created = tz::ZeroEngine::create({.config = config, .grad_type = tz::DType::kFp32, .placement = on_device},
                                        model, init);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  tz::ZeroEngine& engine = **created;
  ASSERT_EQ(engine.param_type(), tz::DType::kBf16);
  tz::Device& device = engine.device();
  auto reader = device.create_stream();
  auto other = device.create_stream();
  ASSERT_TRUE(reader.ok() && other.ok());
  constexpr std::size_t kBytes = kNumel * 2;
  auto scratch = device.allocate(kBytes, nullptr);
  ASSERT_TRUE(scratch.ok()) << scratch.status().to_string();

  auto p0 = engine.fetch(0);
  ASSERT_TRUE(p0.ok()) << p0.status().to_string();
  void* const first = p0->data();
  ASSERT_TRUE(device.launch_host_func(**reader, [] { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }).ok());
  if (how == "none") {
    *p0 = tz::GatheredBlock();
    auto p1 = engine.fetch(1);
    ASSERT_TRUE(p1.ok()) << p1.status().to_string();
    EXPECT_EQ(p1->data(), first) << "a plain release leaves the buffer to the next gather at once";
    EXPECT_TRUE(device.synchronize_stream(**reader).ok());
    (void)device.deallocate(*scratch, kBytes, nullptr);
    return;
  }
  ASSERT_TRUE(device.copy_async(*scratch, first, kBytes, **reader).ok());
  const tz::Status released =
      how == "stream" ? p0->release_after(**reader) : p0->release_after_native((*reader)->native_handle());
  ASSERT_TRUE(released.ok()) << released.to_string();
  EXPECT_FALSE(p0->valid());
  if (persistent) {
    for (std::size_t b : {1, 0}) {  // gradients for a step that moves every weight
      auto g = engine.grad_buffer(b);
      ASSERT_TRUE(g.ok()) << g.status().to_string();
      ASSERT_TRUE(device.memset_async(g->data(), 0x3F, kNumel * 4, **other).ok());
      ASSERT_TRUE(device.synchronize_stream(**other).ok());
      ASSERT_TRUE(engine.reduce_grads(std::move(*g)).ok());
    }
    auto r = engine.step();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_TRUE(r->stepped);
  }
  std::optional<tz::Expected<tz::GatheredBlock>> p1;
  if (!persistent) {
    p1 = engine.fetch(1);
    ASSERT_TRUE(p1->ok()) << p1->status().to_string();
  }
  std::vector<std::uint16_t> seen(kNumel);
  ASSERT_TRUE(device.copy_async(seen.data(), *scratch, kBytes, **reader).ok());
  ASSERT_TRUE(device.synchronize_stream(**reader).ok());
  if (!persistent) {
    // And once the readers are done, the buffer is the engine's again: the
    // release stream marks it reusable just after the reader's end, so allow
    // it a moment (the pool hands a still-pending buffer to no one).
    bool back = false;
    std::vector<tz::GatheredBlock> misses;  // held, so the next fetch cannot take their buffers instead
    for (int attempt = 0; attempt < 50 && !back; ++attempt) {
      auto again = engine.fetch(0);
      ASSERT_TRUE(again.ok()) << again.status().to_string();
      back = again->data() == first;
      if (!back) {
        misses.push_back(std::move(*again));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    EXPECT_TRUE(back) << "block 0's buffer never came back to the pool after its reader was done";
  }
  const auto ones = static_cast<std::size_t>(std::count(seen.begin(), seen.end(), kOne));
  EXPECT_EQ(ones, seen.size()) << "the reader saw " << std::count(seen.begin(), seen.end(), kTwo)
                               << " elements of block 1 and " << seen.size() - ones << " not 1.0";
  if (persistent) {  // and the step did change the block, after the reader was done
    auto again = engine.fetch(0);
    ASSERT_TRUE(again.ok()) << again.status().to_string();
    std::vector<std::uint16_t> now(kNumel);
    ASSERT_TRUE(device.copy_async(now.data(), again->data(), kBytes, **other).ok());
    ASSERT_TRUE(device.synchronize_stream(**other).ok());
    EXPECT_EQ(std::count(now.begin(), now.end(), kOne), 0) << "the step should have moved every weight of block 0";
  }
  (void)device.deallocate(*scratch, kBytes, nullptr);
}

}  // namespace tzt
