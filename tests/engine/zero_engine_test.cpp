// ZeroEngine on one rank: every placement of the states trains the MLP
// workload to the same parameters as the in-memory reference; fp16 overflow
// skips exactly its step; bad input and impossible placements are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <utility>

#include "tierzero/testing/engine.h"
#include "tierzero/kernels.h"
#include "../nvme/nvme_test_util.h"
#include "../offload/faulty_device.h"

namespace tzt {
namespace {

using tz::Tier;

constexpr tz::mlp::MlpConfig kMlp{.layers = 3, .hidden = 96, .batch = 6, .seed = 77};

const Placement kPlacements[] = {
    {Tier::kGpu, Tier::kGpu, Tier::kGpu, Tier::kGpu},     // all on the device
    {Tier::kGpu, Tier::kCpu, Tier::kCpu, Tier::kCpu},     // optimizer offloaded to CPU (ZeRO-Offload)
    {Tier::kCpu, Tier::kCpu, Tier::kCpu, Tier::kCpu},     // params in CPU memory too
    {Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme},  // params and optimizer on NVMe (ZeRO-Infinity)
    {Tier::kNvme, Tier::kNvme, Tier::kNvme, Tier::kNvme},  // everything on NVMe
};

TEST(ZeroEngine, EveryPlacementMatchesTheInMemoryReference) {
  for (const Placement& placement : kPlacements) {
    for (std::optional<tz::DType> grad_type : {std::optional(tz::DType::kFp32), std::optional<tz::DType>()}) {
      TempDir nvme;
      const tz::Config config = test_config(nvme.path());
      auto engine = tz::ZeroEngine::create({.config = config, .grad_type = grad_type, .placement = placement},
                                           tz::mlp::model(kMlp), tz::mlp::init(kMlp));
      ASSERT_TRUE(engine.ok()) << placement_name(placement) << ": " << engine.status().to_string();
      tz::mlp::Reference ref(kMlp, config, 1, grad_type);
      const double worst = train_and_compare(**engine, ref, kMlp, 4, 2);
      const std::string grads = grad_type ? "fp32 grads" : "bf16 grads";
      std::printf("[ engine ] %-60s %-10s largest |master - reference| after 4 steps: %.3g\n",
                  placement_name(placement).c_str(), grads.c_str(), worst);
      // lr 1e-3: an update differing by more than 1e-6 would be a real error.
      EXPECT_LE(worst, 1e-6) << placement_name(placement) << ", " << grads;
    }
  }
}

TEST(ZeroEngine, ABlockReleasedAfterAStreamIsNotReusedUntilItsReadersAreDone) {
  TempDir nvme;
  const tz::Config config = test_config(nvme.path(), 3, 1, "bf16");
  check_stream_ordered_release(config, "none", false);
  check_stream_ordered_release(config, "stream", false);
  check_stream_ordered_release(config, "stream", true);
}

// Note [Stream-ordered release]: a release whose wait the device refuses
// leaves the readers' end unknown, so the engine's later calls all fail with
// that error (a persistent block would otherwise be re-gathered under them).
TEST(ZeroEngine, AFailedStreamOrderedReleaseFailsEveryLaterCall) {
  for (bool persistent : {false, true}) {
    SCOPED_TRACE(persistent ? "persistent block" : "partitioned block");
    tz::FaultyDevice device(tz::create_host_device());
    TempDir nvme;
    tz::Config config = test_config(nvme.path(), 3, 1);
    if (persistent) config.zero.stage3_param_persistence_threshold = 1 << 20;
    auto created = tz::ZeroEngine::create({.config = config, .device = &device}, tz::mlp::model(kMlp),
                                          tz::mlp::init(kMlp));
    ASSERT_TRUE(created.ok()) << created.status().to_string();
    tz::ZeroEngine& engine = **created;
    ASSERT_EQ(engine.layout().blocks[0].persistent, persistent);
    auto reader = device.create_stream();
    ASSERT_TRUE(reader.ok());
    auto p = engine.fetch(0);
    ASSERT_TRUE(p.ok());
    device.fail_stream_wait = true;
    const tz::Status released = p->release_after(**reader);
    device.fail_stream_wait = false;
    const std::string cause = "releasing " + engine.layout().blocks[0].name + " after its readers' stream";
    auto names_the_failure = [&](const tz::Status& s) {
      return !s.ok() && s.message().find("injected stream wait failure") != std::string::npos &&
             s.message().find(cause) != std::string::npos;
    };
    EXPECT_TRUE(names_the_failure(released)) << released.to_string();
    for (int round = 0; round < 2; ++round) {  // not once: every time
      EXPECT_TRUE(names_the_failure(engine.fetch(1).status())) << "fetch, round " << round;
      EXPECT_TRUE(names_the_failure(engine.grad_buffer(1).status())) << "grad_buffer, round " << round;
      EXPECT_TRUE(names_the_failure(engine.step().status())) << "step, round " << round;
      std::vector<float> w(engine.layout().blocks[1].whole_numel);
      EXPECT_TRUE(names_the_failure(engine.set_master(1, w.data(), w.size(), 0))) << "set_master, round " << round;
    }
  }
}

// The one dtype enum names types no gradient path has: creation refuses them.
TEST(ZeroEngine, AGradientTypeWithoutAPathIsRefusedAtCreation) {
  TempDir dir;
  const tz::Config config = test_config(dir.path());
  for (tz::DType bad : {tz::DType::kFp64, tz::DType::kInt32, tz::DType::kUint8}) {
    auto engine = tz::ZeroEngine::create({.config = config, .grad_type = bad}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
    ASSERT_FALSE(engine.ok()) << tz::dtype_name(bad);
    EXPECT_EQ(engine.status().code(), tz::ErrorCode::kInvalidArgument);
    EXPECT_NE(engine.status().message().find(fmt::format("grad_type = {}", tz::dtype_name(bad))), std::string::npos)
        << engine.status().to_string();
  }
}

TEST(ZeroEngine, Fp32TrainingWithoutBf16OrFp16MatchesTheReference) {
  for (const Placement& placement : {kPlacements[1], kPlacements[3]}) {
    TempDir nvme;
    const tz::Config config = test_config(nvme.path(), 3, 2, "fp32");
    auto engine = tz::ZeroEngine::create({.config = config, .placement = placement}, tz::mlp::model(kMlp),
                                         tz::mlp::init(kMlp));
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    EXPECT_EQ((*engine)->param_type(), tz::DType::kFp32);
    EXPECT_EQ((*engine)->grad_type(), tz::DType::kFp32);
    tz::mlp::Reference ref(kMlp, config, 1);
    const double worst = train_and_compare(**engine, ref, kMlp, 4, 2);
    std::printf("[ engine ] fp32 params, %-55s largest |master - reference|: %.3g\n", placement_name(placement).c_str(),
                worst);
    EXPECT_LE(worst, 1e-6);
  }
}

// fp32 training (neither bf16 nor fp16) keeps 4-byte parameters: on NVMe
// they need twice the room of 16-bit ones. The swap store was sized for 2
// bytes, so a model past a few MiB failed at creation with "swap store full".
TEST(ZeroEngine, Fp32ParametersOnNvmeFitTheSwapStore) {
  TempDir nvme;
  const std::vector<tz::BlockSpec> model = {{"a", {{"w", {1024, 1024}}}}, {"b", {{"w", {1024, 1024}}}},
                                            {"c", {{"w", {1024, 1024}}}}, {"d", {{"w", {1024, 1024}}}}};
  const tz::ParamInit init = [](std::size_t b, std::size_t, float* out, std::uint64_t n) {
    std::fill(out, out + n, 0.25F * static_cast<float>(b + 1));
  };
  auto engine = tz::ZeroEngine::create(
      {.config = test_config(nvme.path(), 3, 1, "fp32"), .placement = kPlacements[4]}, model, init);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  EXPECT_EQ((*engine)->param_type(), tz::DType::kFp32);
  for (std::size_t b = 0; b < 4; ++b) {
    auto g = (*engine)->grad_buffer(b);
    ASSERT_TRUE(g.ok());
    ASSERT_TRUE((*engine)->reduce_grads(std::move(*g)).ok());
  }
  auto r = (*engine)->step();
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  auto p = (*engine)->fetch(3);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_NEAR(static_cast<const float*>(p->data())[0], 1.0F, 1e-3F) << "block d read back from NVMe";
}

// Note [Weight decay per parameter] (engine/src/optimizer_step.cpp): each
// parameter steps with its own weight decay (the config's where none was
// set), bit for bit as cpu_adam stepping that parameter alone with it; the
// whole shard is stepped at once, with a segment table. On NVMe (the
// optimizer pass's staging) and over 3 steps (the moments carry the
// decays' effect on).
TEST(ZeroEngine, EachParametersWeightDecayStepsAsCpuAdamOnThatParameterAlone) {
  TempDir nvme;
  tz::Config config = test_config(nvme.path(), 3, 1, "fp32");
  config.gradient_clipping = 0;  // the gradient as given: grad_scale 1
  const std::vector<tz::BlockSpec> model = {{"a", {{"w", {40, 50}}, {"bias", {50}}, {"g", {33}}}},
                                            {"b", {{"w", {3000}}, {"bias", {7}}}}};
  auto value = [](std::size_t b, std::size_t i, std::uint64_t j, int k) {
    return std::sin(static_cast<float>(j * 0.37 + i * 1.3 + b * 2.1 + k * 0.71)) * (k == 0 ? 0.5F : 1.0F);
  };
  const tz::ParamInit init = [&](std::size_t b, std::size_t i, float* out, std::uint64_t n) {
    for (std::uint64_t j = 0; j < n; ++j) out[j] = value(b, i, j, 0);
  };
  auto created = tz::ZeroEngine::create({.config = config, .placement = kPlacements[4]}, model, init);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  tz::ZeroEngine& engine = **created;
  // (block, param) -> weight decay; a.bias and b.bias keep the config's 0.01
  const std::map<std::pair<std::size_t, std::size_t>, double> decays = {{{0, 0}, 0.3}, {{0, 2}, 0.0}, {{1, 0}, 0.5}};
  for (const auto& [at, decay] : decays) ASSERT_TRUE(engine.set_weight_decay(at.first, at.second, decay).ok());
  EXPECT_EQ(engine.weight_decay(0, 0), 0.3);
  EXPECT_EQ(engine.weight_decay(0, 1), 0.01) << "the config's until set";
  const std::pair<tz::Status, std::string> refused[] = {
      {engine.set_weight_decay(2, 0, 0.1), "set_weight_decay: block 2 is out of range (the model has 2 blocks)"},
      {engine.set_weight_decay(0, 3, 0.1), "set_weight_decay: a has 3 parameters, no parameter 3"},
      {engine.set_weight_decay(0, 1, -0.5), "set_weight_decay: a.bias weight_decay = -0.5 must be finite and >= 0"},
      {engine.set_weight_decay(0, 1, NAN), "set_weight_decay: a.bias weight_decay = nan must be finite and >= 0"}};
  for (const auto& [status, message] : refused) {
    EXPECT_EQ(status.code(), tz::ErrorCode::kInvalidArgument) << status.to_string();
    EXPECT_NE(status.message().find(message), std::string::npos) << status.to_string();
  }
  EXPECT_EQ(engine.weight_decay(0, 1), 0.01) << "a refused value changes nothing";

  // The reference: each parameter on its own, in ordinary memory.
  struct Alone {
    std::vector<float> p, m, v;
    double decay;
  };
  std::vector<std::vector<Alone>> alone(model.size());
  for (std::size_t b = 0; b < model.size(); ++b) {
    for (std::size_t i = 0; i < model[b].params.size(); ++i) {
      const std::uint64_t n = model[b].params[i].numel();
      Alone a{.p = std::vector<float>(n), .m = std::vector<float>(n, 0), .v = std::vector<float>(n, 0),
              .decay = decays.contains({b, i}) ? decays.at({b, i}) : 0.01};
      init(b, i, a.p.data(), n);
      alone[b].push_back(std::move(a));
    }
  }
  auto cpu = tz::cpu_adam::CpuOptimizer::create({});
  ASSERT_TRUE(cpu.ok());
  const tz::OptimizerConfig& o = config.optimizer;
  for (int step = 1; step <= 3; ++step) {
    for (std::size_t b = 0; b < model.size(); ++b) {
      auto g = engine.grad_buffer(b);
      ASSERT_TRUE(g.ok()) << g.status().to_string();
      ASSERT_EQ(g->type(), tz::DType::kFp32);
      for (std::size_t i = 0; i < model[b].params.size(); ++i) {
        const std::uint64_t n = model[b].params[i].numel();
        std::vector<float> grad(n);
        for (std::uint64_t j = 0; j < n; ++j) grad[j] = value(b, i, j, step);
        std::memcpy(g->grad(i), grad.data(), n * sizeof(float));
        Alone& a = alone[b][i];
        const tz::cpu_adam::Hyper h{.algorithm = tz::cpu_adam::Algorithm::kAdamW, .lr = o.lr, .beta1 = o.beta1,
                                    .beta2 = o.beta2, .eps = o.eps, .weight_decay = a.decay};
        ASSERT_TRUE((*cpu)->step(h, {.step = step, .grad_scale = 1.0},
                                 {.n = n, .param = a.p.data(), .grad = grad.data(), .exp_avg = a.m.data(),
                                  .exp_avg_sq = a.v.data()})
                        .ok());
      }
      ASSERT_TRUE(engine.reduce_grads(std::move(*g)).ok());
    }
    auto r = engine.step();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ASSERT_TRUE(r->stepped);
  }
  for (std::size_t b = 0; b < model.size(); ++b) {
    auto master = engine.gather_master(b);
    ASSERT_TRUE(master.ok()) << master.status().to_string();
    for (std::size_t i = 0; i < model[b].params.size(); ++i) {
      const tz::ParamLayout& at = engine.layout().blocks[b].params[i];
      EXPECT_EQ(std::memcmp(master->data() + at.offset, alone[b][i].p.data(), at.numel * sizeof(float)), 0)
          << model[b].name << "." << at.name << " (weight decay " << alone[b][i].decay << ") not bit for bit";
    }
  }
}

// The plan counts fp32 parameters at 4 B: a CPU budget that holds a bf16
// model's states (18 B an element) but not an fp32 one's (20 B) starts the
// first and refuses the second at planning, naming the budget.
TEST(ZeroEngine, Fp32ParametersArePlannedAtFourBytes) {
  const std::vector<tz::BlockSpec> model = {{"a", {{"w", {1024, 1024}}}}, {"b", {{"w", {1024, 1024}}}},
                                            {"c", {{"w", {1024, 1024}}}}, {"d", {{"w", {1024, 1024}}}}};
  const tz::ParamInit init = [](std::size_t, std::size_t, float* out, std::uint64_t n) { std::fill(out, out + n, 0.5F); };
  const auto config = [](const char* precision) {
    // 4 Mi elements: bf16 needs 72 MiB of CPU memory for the states and 3 x 2 MiB for arriving
    // gradient shards, 78 MiB; fp32 80 + 3 x 4 = 92 MiB.
    auto c = tz::parse_config(fmt::format(R"({{"train_micro_batch_size_per_gpu": 1, {}
      "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001}}}},
      "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
                            "offload_param": {{"device": "cpu"}}, "offload_optimizer": {{"device": "cpu"}}}},
      "tierzero": {{"backend": "host", "placement": "deepspeed",
                    "tiers": {{"gpu_bytes": "512MiB", "cpu_bytes": "82MiB", "nvme_bytes": 0}}}}}})",
                                          precision),
                              "fp32 plan test");
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    return c.ok() ? *c : tz::Config{};
  };
  auto bf16 = tz::ZeroEngine::create({.config = config(R"("bf16": {"enabled": true},)")}, model, init);
  ASSERT_TRUE(bf16.ok()) << bf16.status().to_string();
  EXPECT_EQ((*bf16)->plan().tier_of(tz::StateClass::kParam16), Tier::kCpu);
  bf16->reset();
  auto fp32 = tz::ZeroEngine::create({.config = config("")}, model, init);
  ASSERT_FALSE(fp32.ok());
  EXPECT_EQ(fp32.status().code(), tz::ErrorCode::kOutOfMemory);
  const std::string msg = fp32.status().message();
  EXPECT_NE(msg.find("cpu needs 92.00 MiB per node but tierzero.tiers.cpu_bytes is 82.00 MiB"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("enable the config's \"bf16\" block"), std::string::npos) << msg;
}

// The plan counts what the engine allocates: with the parameters and the
// optimizer on NVMe, or both in CPU memory, the CPU and device pools' peaks
// over the steps stay within the planner's CPU and GPU needs per rank.
TEST(ZeroEngine, ThePoolsStayWithinThePlan) {
  // Under sub_group_size 10000 each block (a 10240-element shard) is an
  // optimizer sub-group of its own and three are staged at once; under 40000
  // the model is one, staged once (three sets of it before: 1,536,000 B).
  for (const auto& [where, sub_group_size] : {std::pair{tz::OffloadDevice::kNvme, std::int64_t{10000}},
                                              std::pair{tz::OffloadDevice::kCpu, std::int64_t{10000}},
                                              std::pair{tz::OffloadDevice::kNvme, std::int64_t{40000}}}) {
    TempDir nvme;
    tz::Config config = test_config(nvme.path(), 3, 1);
    config.zero.sub_group_size = sub_group_size;
    config.placement = tz::PlacementMode::kDeepSpeed;
    config.zero.has_offload_param = config.zero.has_offload_optimizer = true;
    config.zero.offload_param.device = config.zero.offload_optimizer.device = where;
    config.zero.offload_param.nvme_path = config.zero.offload_optimizer.nvme_path = nvme.path();
    auto engine = tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto& e = **engine;
    ASSERT_EQ(e.plan().tier_of(tz::StateClass::kParam16), where == tz::OffloadDevice::kNvme ? Tier::kNvme : Tier::kCpu);
    std::uint64_t peak = 0, peak_gpu = 0;
    for (int step = 0; step < 4; ++step) {
      ASSERT_TRUE(tz::mlp::train_micro_batch(e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step)).ok());
      auto report = e.step();
      ASSERT_TRUE(report.ok()) << report.status().to_string();
      peak = std::max(peak, report->peak_cpu_bytes);
      peak_gpu = std::max(peak_gpu, report->peak_gpu_bytes);
    }
    EXPECT_EQ(e.plan().layout.sub_groups, sub_group_size == 10000 ? 3u : 1u);
    const std::uint64_t planned_gpu = e.plan().usage_of(Tier::kGpu).per_rank_bytes;
    std::printf("[ engine ] %s, %zu sub-group(s): device pool peak %llu B, planned %llu B\n",
                tz::offload_device_name(where).data(), e.plan().layout.sub_groups,
                static_cast<unsigned long long>(peak_gpu), static_cast<unsigned long long>(planned_gpu));
    EXPECT_LE(peak_gpu, planned_gpu) << tz::format_plan(e.plan(), tz::PlanInput{.ranks = 1});
    const std::uint64_t planned = e.plan().usage_of(Tier::kCpu).per_rank_bytes;
    std::printf("[ engine ] %s, %zu sub-group(s): CPU pool peak %llu B, planned %llu B\n",
                tz::offload_device_name(where).data(), e.plan().layout.sub_groups,
                static_cast<unsigned long long>(peak), static_cast<unsigned long long>(planned));
    EXPECT_GT(peak, 0U);
    EXPECT_LE(peak, planned) << tz::format_plan(e.plan(), tz::PlanInput{.ranks = 1});
  }
}

TEST(ZeroEngine, NvmeBytesPerStepAreEachStateOnce) {
  TempDir nvme;
  const tz::Config config = test_config(nvme.path(), 3, 1);
  const Placement placement{Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme};
  auto engine = tz::ZeroEngine::create({.config = config, .placement = placement}, tz::mlp::model(kMlp),
                                       tz::mlp::init(kMlp));
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  auto& e = **engine;
  const std::uint64_t shard = e.layout().shard_numel;
  tz::StepReport r;
  std::uint64_t late_allocations = 0;
  for (int step = 0; step < 8; ++step) {  // step 0 records the trace; then steady state
    ASSERT_TRUE(tz::mlp::train_micro_batch(e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step)).ok());
    auto report = e.step();
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    ASSERT_TRUE(report->stepped);
    r = *report;
    if (step >= 2) late_allocations += r.new_allocations;
  }
  // Reads: the 16-bit params twice per micro-batch (forward and backward; the
  // next micro-batch's are prefetched at the end of the step), master and
  // both moments once. Writes: master and moments once, 16-bit params once.
  EXPECT_EQ(r.nvme_read_bytes, shard * (2 * 2 + 4 + 4 + 4));
  EXPECT_EQ(r.nvme_write_bytes, shard * (4 + 4 + 4 + 2));
  // The time a read (write) was in flight, for the rates the trainer reports (Note [Busy time]).
  EXPECT_GT(r.nvme_read_busy_seconds, 0.0);
  EXPECT_GT(r.nvme_write_busy_seconds, 0.0);
  EXPECT_EQ(r.fetches, 6U);
  EXPECT_EQ(r.prefetched, 6U) << "every fetch of a steady-state step follows the trace";
  EXPECT_EQ(r.blocks_reduced, 3U) << "one reduce_grads per block in the step";
  EXPECT_EQ(r.h2d_bytes, shard * 2 * 2) << "each of a block's two fetches copies its bf16 shard up from staging";
  // Buffers in flight are bounded (prefetch window, gradient backpressure), so
  // the pools reach their high-water mark in the first steps; how soon depends
  // on thread timing only until the pools are warm, hence steps 2-7.
  EXPECT_EQ(late_allocations, 0U) << "steady-state steps allocate nothing from the backends";
  EXPECT_GT(r.peak_cpu_bytes, 0U);
  EXPECT_LE(r.peak_cpu_bytes, r.cpu_budget_bytes);
}

// Parameters in device memory cross no host-to-device link when gathered: the
// report counts none (the H200 run counted 51.6 GB a step under that name).
TEST(ZeroEngine, ParametersOnTheDeviceCountNoHostToDeviceBytes) {
  TempDir nvme;
  const tz::Config config = test_config(nvme.path(), 3, 1);
  for (const Placement& placement : {Placement{Tier::kGpu, Tier::kCpu, Tier::kCpu, Tier::kCpu},
                                     Placement{Tier::kCpu, Tier::kCpu, Tier::kCpu, Tier::kCpu}}) {
    auto engine = tz::ZeroEngine::create({.config = config, .placement = placement}, tz::mlp::model(kMlp),
                                         tz::mlp::init(kMlp));
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto& e = **engine;
    tz::StepReport r;
    for (int step = 0; step < 3; ++step) {
      ASSERT_TRUE(tz::mlp::train_micro_batch(e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step)).ok());
      r = e.step().value();
    }
    // Two fetches of every block (forward, backward), a bf16 shard each.
    const std::uint64_t want = placement[0] == Tier::kGpu ? 0 : 2 * e.layout().shard_numel * 2;
    EXPECT_EQ(r.h2d_bytes, want) << "params on " << tz::tier_name(placement[0]);
  }
}

TEST(ZeroEngine, Fp16OverflowSkipsExactlyThatStepAndHalvesTheScale) {
  TempDir nvme;
  const tz::Config config = test_config(nvme.path(), 3, 1, "fp16");
  auto engine = tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  auto& e = **engine;
  tz::mlp::Reference ref(kMlp, config, 1);
  EXPECT_EQ(e.loss_scale(), 4096.0);
  // Step 0 trains normally; step 1 overflows (skipped); step 2 trains with the
  // data the reference sees as its second step.
  for (int step = 0; step < 3; ++step) {
    const bool overflow = step == 1;
    auto l = tz::mlp::train_micro_batch(e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, overflow ? 99 : step - (step > 1)),
                                        {}, overflow);
    ASSERT_TRUE(l.ok()) << l.status().to_string();
    auto r = e.step();
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->overflow, overflow) << "step " << step;
    EXPECT_EQ(r->stepped, !overflow) << "step " << step;
    if (overflow) {
      EXPECT_EQ(r->loss_scale, 2048.0) << "hysteresis 1: halved at the first overflow";
      EXPECT_EQ(r->step, 1);
    } else {
      ref.train_step(step - (step > 1));
    }
  }
  // The reference ran 2 steps at scale 4096; the engine's second good step
  // ran at 2048, which only changes the (exact, power-of-two) scaling.
  auto c = compare_masters(e, ref);
  ASSERT_TRUE(c.ok());
  EXPECT_LE(c->max_abs, 1e-6);
}

// A block that gets no gradient in a step (a module the model skipped) steps
// with a zero gradient, not the last step's, on every gradient tier.
TEST(ZeroEngine, ABlockWithoutGradientsInAStepStepsWithZeroNotTheLastStepsGradient) {
  // Step 0: the MLP, every block. Step 1: blocks 1 and 2 get a constant
  // gradient; block 0 gets none, or (the expectation) an explicit zero
  // gradient. Returns block 0's master weights after step 1.
  auto run = [](Tier grad_tier, bool zeros_for_block0) -> std::vector<float> {
    TempDir nvme;
    const tz::Config config = test_config(nvme.path(), 3, 1);
    const Placement placement{Tier::kCpu, grad_tier, Tier::kCpu, Tier::kCpu};
    auto engine = tz::ZeroEngine::create({.config = config, .grad_type = tz::DType::kFp32, .placement = placement},
                                         tz::mlp::model(kMlp), tz::mlp::init(kMlp));
    EXPECT_TRUE(engine.ok()) << engine.status().to_string();
    if (!engine.ok()) return {};
    tz::ZeroEngine& e = **engine;
    EXPECT_TRUE(tz::mlp::train_micro_batch(e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, 0)).ok());
    EXPECT_TRUE(e.step().ok());
    for (std::size_t b = e.layout().blocks.size(); b-- > 0;) {
      if (b == 0 && !zeros_for_block0) continue;
      auto p = e.fetch(b);  // the protocol: a block's backward holds its parameters
      auto g = e.grad_buffer(b);
      EXPECT_TRUE(p.ok() && g.ok());
      if (!p.ok() || !g.ok()) return {};
      auto* grad = static_cast<float*>(g->data());
      for (std::size_t i = 0; i < e.layout().blocks[b].used_numel; ++i) grad[i] = b == 0 ? 0.0F : 0.25F;
      EXPECT_TRUE(e.reduce_grads(std::move(*g)).ok());
    }
    auto r = e.step();
    EXPECT_TRUE(r.ok() && r->stepped);
    return *e.gather_master(0);
  };
  const std::vector<float> want = run(Tier::kCpu, true);
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(run(Tier::kCpu, false), want) << "grads in CPU memory";
  EXPECT_EQ(run(Tier::kGpu, false), want) << "grads on the (Host) device tier";
  EXPECT_EQ(run(Tier::kNvme, false), want) << "grads on NVMe";
}

TEST(ZeroEngine, TheLearningRateCanChangeBetweenSteps) {
  TempDir nvme;
  const tz::Config config = test_config(nvme.path(), 3, 1);
  auto engine = tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  EXPECT_EQ((*engine)->set_learning_rate(-1).code(), tz::ErrorCode::kInvalidArgument);
  EXPECT_EQ((*engine)->set_learning_rate(NAN).code(), tz::ErrorCode::kInvalidArgument);
  EXPECT_TRUE((*engine)->set_learning_rate(0).ok()) << "0 is a rate (a warm-up's start)";
  tz::mlp::Reference ref(kMlp, config, 1);
  for (int step = 0; step < 3; ++step) {
    const double lr = 1e-3 * (step + 1) / 3;  // a warmup
    ASSERT_TRUE((*engine)->set_learning_rate(lr).ok());
    ASSERT_TRUE(tz::mlp::train_micro_batch(**engine, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step)).ok());
    ASSERT_TRUE((*engine)->step().ok());
    ref.set_learning_rate(lr);
    ref.train_step(step);
  }
  EXPECT_EQ((*engine)->optimizer_steps(), 3);
  auto c = compare_masters(**engine, ref);
  ASSERT_TRUE(c.ok());
  EXPECT_LE(c->max_abs, 1e-6);
}

// The config's scheduler sets each step's learning rate (the reference is
// handed the same rates, worked out here by hand); a checkpoint resumes the
// schedule where it was, because it follows the optimizer step count.
TEST(ZeroEngine, TheConfigsSchedulerSetsEachStepsRateAndACheckpointResumesIt) {
  TempDir nvme, ckpt;
  tz::Config config = test_config(nvme.path(), 3, 1);
  config.optimizer.lr = 2e-3;
  config.scheduler.type = tz::SchedulerType::kWarmupCosineLR;
  config.scheduler.warmup_type = tz::WarmupType::kLinear;
  config.scheduler.warmup_num_steps = 2;
  config.scheduler.warmup_min_ratio = 0.2;
  config.scheduler.cos_min_ratio = 0.1;
  config.scheduler.total_num_steps = 6;
  // t = 0, 1: 0.2 + 0.8 t/2; t >= 2: 0.1 + 0.9 (1 + cos(pi min(1, (t - 1)/4))) / 2.
  const double pi = 3.14159265358979323846;
  const std::vector<double> ratio = {0.2, 0.6, 0.1 + 0.45 * (1 + std::cos(pi / 4)), 0.55,
                                     0.1 + 0.45 * (1 + std::cos(3 * pi / 4)), 0.1, 0.1};
  auto create = [&] { return tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp)); };
  auto engine = create();
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  const tz::Status refused = (*engine)->set_learning_rate(1e-3);
  EXPECT_EQ(refused.code(), tz::ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("scheduler (WarmupCosineLR)"), std::string::npos) << refused.message();
  tz::mlp::Reference ref(kMlp, config, 1);
  auto train = [&](tz::ZeroEngine& e, int step) {
    EXPECT_NEAR(e.learning_rate(), 2e-3 * ratio[step], 1e-15) << "step " << step;
    ASSERT_TRUE(tz::mlp::train_micro_batch(e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step)).ok());
    auto r = e.step();
    ASSERT_TRUE(r.ok() && r->stepped);
    EXPECT_NEAR(r->lr, 2e-3 * ratio[step], 1e-15) << "step " << step;
    ref.set_learning_rate(2e-3 * ratio[step]);
    ref.train_step(step);
  };
  for (int step = 0; step < 3; ++step) train(**engine, step);
  ASSERT_TRUE((*engine)->save_checkpoint(ckpt.path()).ok());
  engine->reset();
  auto resumed = create();
  ASSERT_TRUE(resumed.ok()) << resumed.status().to_string();
  ASSERT_TRUE((*resumed)->load_checkpoint(ckpt.path()).ok());
  for (int step = 3; step < 7; ++step) train(**resumed, step);
  auto c = compare_masters(**resumed, ref);
  ASSERT_TRUE(c.ok());
  // fp32 engine against the double reference drifts by up to ~1e-5 over 7
  // steps at these rates (the same with a constant rate); one step at the
  // wrong rate moves weights by lr x the ratio change, >= 1e-4 here.
  EXPECT_LE(c->max_abs, 3e-5);
}

TEST(ZeroEngine, AnAutoStepCountInTheSchedulerIsRefusedByName) {
  TempDir nvme;
  tz::Config config = test_config(nvme.path(), 3, 1);
  config.scheduler.type = tz::SchedulerType::kWarmupLR;
  config.unresolved_auto = {"scheduler.params.warmup_num_steps"};
  auto engine = tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("scheduler.params.warmup_num_steps = \"auto\""), std::string::npos)
      << engine.status().message();
}

// Note [State formats]: every master and moment format the planner knows, the engine makes.
TEST(ZeroEngine, EveryStateFormatCombinationIsCreated) {
  TempDir nvme;
  using tz::MasterFormat, tz::MomentFormat;
  // Every combination trains (tests/engine/state_formats_test.cpp has how).
  for (MasterFormat master : {MasterFormat::kFp32, MasterFormat::kRemainder}) {
    for (MomentFormat moments : {MomentFormat::kFp32, MomentFormat::kBf16, MomentFormat::kInt8}) {
      tz::Config config = test_config(nvme.path(), 3, 1);
      config.states = {.master = master, .moments = moments};
      auto engine = tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
      EXPECT_TRUE(engine.ok()) << engine.status().to_string();
    }
  }
}

// Trains one optimizer step (gas micro-batches) of the MLP workload; false on an error (printed).
bool train_step(tz::ZeroEngine& engine, int step, int gas) {
  for (int micro = 0; micro < gas; ++micro) {
    auto loss = tz::mlp::train_micro_batch(engine, kMlp, tz::mlp::make_batch(kMlp, engine.rank(), micro, step));
    auto report = loss.ok() ? engine.step() : tz::Expected<tz::StepReport>(loss.status());
    EXPECT_TRUE(report.ok()) << "step " << step << ": " << report.status().to_string();
    if (!report.ok()) return false;
  }
  return true;
}

// An evaluation pass between steps (every block fetched in forward order, no
// gradients): as tz::FetchFor::kEvaluation it leaves prefetching on and the
// training where it was; as training fetches (the control) it breaks the
// recorded order, and the next micro-batch (step 3) records it again
// (tests/engine/prefetch_test.cpp has the rest of that story).
TEST(ZeroEngine, AnEvaluationBetweenStepsLeavesPrefetchingOn) {
  for (tz::FetchFor purpose : {tz::FetchFor::kEvaluation, tz::FetchFor::kTraining}) {
    const bool evaluation = purpose == tz::FetchFor::kEvaluation;
    SCOPED_TRACE(evaluation ? "evaluation fetches" : "training fetches (control)");
    TempDir nvme;
    const tz::Config config = test_config(nvme.path(), 3, 1);
    auto created = tz::ZeroEngine::create({.config = config, .placement = kPlacements[3]}, tz::mlp::model(kMlp),
                                          tz::mlp::init(kMlp));
    ASSERT_TRUE(created.ok());
    tz::ZeroEngine& engine = **created;
    tz::mlp::Reference ref(kMlp, config, 1);
    std::uint64_t fetches_after = 0, prefetched_after = 0;
    for (int step = 0; step < 5; ++step) {
      if (step == 2) {
        for (std::size_t b = 0; b < engine.layout().blocks.size(); ++b) {
          auto p = engine.fetch(b, purpose);
          ASSERT_TRUE(p.ok()) << p.status().to_string();
        }
      }
      auto loss = tz::mlp::train_micro_batch(engine, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step));
      ASSERT_TRUE(loss.ok()) << loss.status().to_string();
      auto r = engine.step();
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      ref.train_step(step);
      if (step == 3) {
        fetches_after += r->fetches;
        prefetched_after += r->prefetched;
      }
    }
    std::printf("[ engine ] %-36s the step after the evaluation: %llu of %llu fetches prefetched\n",
                evaluation ? "evaluation fetches" : "training fetches (control)",
                static_cast<unsigned long long>(prefetched_after), static_cast<unsigned long long>(fetches_after));
    if (evaluation) {
      EXPECT_EQ(prefetched_after, fetches_after) << "prefetching should still be on";
    } else {
      EXPECT_EQ(prefetched_after, 0u) << "the control should be recording the order again";
    }
    auto c = compare_masters(engine, ref);
    ASSERT_TRUE(c.ok());
    EXPECT_LE(c->max_abs, 1e-6) << "an evaluation pass must not change training";
  }
}

TEST(ZeroEngine, SetMasterReplacesTheWeightsAndKeepsTheOptimizerState) {
  for (const char* precision : {"bf16", "fp32"}) {
    for (const Placement& placement : {kPlacements[0], kPlacements[3]}) {
      SCOPED_TRACE(fmt::format("{}, {}", precision, placement_name(placement)));
      TempDir nvme_a, nvme_b;
      auto make = [&](const TempDir& dir) {
        return tz::ZeroEngine::create({.config = test_config(dir.path(), 3, 2, precision), .placement = placement},
                                      tz::mlp::model(kMlp), tz::mlp::init(kMlp));
      };
      auto a = make(nvme_a), b = make(nvme_b);
      ASSERT_TRUE(a.ok() && b.ok());
      tz::ZeroEngine& edited = **a;
      tz::ZeroEngine& plain = **b;
      ASSERT_TRUE(train_step(edited, 0, 2) && train_step(plain, 0, 2));
      // Writing back the weights as they are changes nothing: the next steps match the untouched engine's bit
      // for bit (moments, step count and the prefetcher's trace all kept).
      for (std::size_t blk = 0; blk < edited.layout().blocks.size(); ++blk) {
        auto w = edited.gather_master(blk);
        ASSERT_TRUE(w.ok());
        ASSERT_TRUE(edited.set_master(blk, w->data(), w->size(), 0).ok());
      }
      for (int step = 1; step < 3; ++step) ASSERT_TRUE(train_step(edited, step, 2) && train_step(plain, step, 2));
      for (std::size_t blk = 0; blk < edited.layout().blocks.size(); ++blk) {
        EXPECT_EQ(edited.gather_master(blk).value(), plain.gather_master(blk).value()) << "block " << blk;
      }
      // An edited weight is the new master, the 16-bit parameter is its rounding, and Adam steps from it.
      const tz::BlockLayout& first = edited.layout().blocks[0];
      std::vector<float> w = edited.gather_master(0).value();
      const std::vector<float> before = w;
      const float target = before[5] + 0.5F;
      w[5] = target;
      w[6] = 0.1F;  // not a bf16 value: the master keeps it, the 16-bit copy rounds it
      ASSERT_TRUE(edited.set_master(0, w.data(), w.size(), 0).ok());
      EXPECT_EQ(edited.gather_master(0).value(), w);
      {
        auto p = edited.fetch(0);
        ASSERT_TRUE(p.ok()) << p.status().to_string();
        if (edited.param_type() == tz::DType::kBf16) {
          const auto* got = static_cast<const std::uint16_t*>(p->data());
          for (std::size_t i = 0; i < first.used_numel; ++i) {
            ASSERT_EQ(got[i], tz::kernels::fp32_to_bf16(w[i])) << "element " << i;
          }
        } else {
          EXPECT_EQ(std::memcmp(p->data(), w.data(), first.used_numel * 4), 0);
        }
      }
      ASSERT_TRUE(train_step(edited, 3, 2));
      const std::vector<float> after = edited.gather_master(0).value();
      EXPECT_LE(std::fabs(after[5] - target), 1.1e-3) << "lr 1e-3: Adam moves a weight by about lr per step";
      EXPECT_LE(std::fabs(after[6] - 0.1F), 1.1e-3);
    }
  }
}

// set_master between a micro-batch's backward and its step (a DeepSpeed
// user's edit before optimizer.step()): the prefetched blocks are dropped and
// issued again, so training goes on as without it and prefetching stays on.
TEST(ZeroEngine, SetMasterAfterBackwardKeepsPrefetchingOn) {
  TempDir nvme_a, nvme_b;
  auto make = [&](const TempDir& dir) {
    return tz::ZeroEngine::create({.config = test_config(dir.path(), 3, 1), .placement = kPlacements[3]},
                                  tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  };
  auto a = make(nvme_a), b = make(nvme_b);
  ASSERT_TRUE(a.ok() && b.ok());
  std::uint64_t fetches = 0, prefetched = 0;
  for (int step = 0; step < 5; ++step) {
    for (tz::ZeroEngine* e : {a->get(), b->get()}) {
      auto loss = tz::mlp::train_micro_batch(*e, kMlp, tz::mlp::make_batch(kMlp, 0, 0, step));
      ASSERT_TRUE(loss.ok()) << loss.status().to_string();
      if (e == a->get() && (step == 0 || step == 2)) {  // in the recording micro-batch, and in a prefetched one
        for (std::size_t blk = 0; blk < e->layout().blocks.size(); ++blk) {
          std::vector<float> w = e->gather_master(blk).value();
          ASSERT_TRUE(e->set_master(blk, w.data(), w.size(), 0).ok());
        }
      }
      auto r = e->step();
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      if (e == a->get() && step >= 1) {
        fetches += r->fetches;
        prefetched += r->prefetched;
      }
    }
  }
  EXPECT_EQ(prefetched, fetches) << "set_master mid-micro-batch switched prefetching off";
  for (std::size_t blk = 0; blk < (*a)->layout().blocks.size(); ++blk) {
    EXPECT_EQ((*a)->gather_master(blk).value(), (*b)->gather_master(blk).value()) << "block " << blk;
  }
}

TEST(ZeroEngine, SetMasterIsRefusedWhileBlocksAreOutAndForBadArguments) {
  TempDir nvme;
  auto created = tz::ZeroEngine::create({.config = test_config(nvme.path())}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(created.ok());
  tz::ZeroEngine& engine = **created;
  std::vector<float> w = engine.gather_master(1).value();
  const std::vector<float> before = w;
  auto fails_with = [&](const tz::Status& s, tz::ErrorCode code, const std::string& text) {
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_NE(s.message().find(text), std::string::npos) << s.to_string();
  };
  fails_with(engine.set_master(9, w.data(), w.size(), 0), tz::ErrorCode::kInvalidArgument, "block 9 does not exist");
  fails_with(engine.set_master(1, w.data(), w.size() - 1, 0), tz::ErrorCode::kInvalidArgument,
             fmt::format("{} values for block '{}', which has {}", w.size() - 1, engine.layout().blocks[1].name,
                         w.size()));
  fails_with(engine.set_master(1, w.data(), w.size(), 1), tz::ErrorCode::kInvalidArgument,
             "root rank 1 is not one of the 1 rank(s)");
  {
    auto held = engine.fetch(0);
    ASSERT_TRUE(held.ok());
    w[0] += 1;
    fails_with(engine.set_master(1, w.data(), w.size(), 0), tz::ErrorCode::kFailedPrecondition,
               fmt::format("set_master({}): 1 gathered block(s) still out", engine.layout().blocks[1].name));
  }
  EXPECT_EQ(engine.gather_master(1).value(), before) << "a refused set_master must change nothing";
  EXPECT_TRUE(engine.set_master(1, w.data(), w.size(), 0).ok()) << "once the block is back";
  EXPECT_EQ(engine.gather_master(1).value(), w);
}

TEST(ZeroEngine, BadBlocksAndAModelThatFitsNowhereAreRefusedWithTheNumbers) {
  TempDir nvme;
  tz::Config config = test_config(nvme.path());
  auto engine = tz::ZeroEngine::create({.config = config}, tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  auto f = (*engine)->fetch(17);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("block 17"), std::string::npos);
  // 3 x (4096 x 4096) parameters need ~800 MB of states; give the tiers 10 MB each.
  config.tiers.gpu = tz::ByteBudget::of(10'000'000);
  config.tiers.cpu = tz::ByteBudget::of(10'000'000);
  config.tiers.nvme = tz::ByteBudget::of(10'000'000);
  const tz::mlp::MlpConfig big{.layers = 3, .hidden = 4096, .batch = 1};
  auto refused = tz::ZeroEngine::create({.config = config}, tz::mlp::model(big), tz::mlp::init(big));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), tz::ErrorCode::kOutOfMemory) << refused.status().to_string();
  EXPECT_NE(refused.status().message().find("nvme_bytes"), std::string::npos) << refused.status().message();
  // A shape whose element count overflows 64 bits once wrapped to 0 and shared its offset with the next
  // parameter; anything above 2^50 elements is refused by name.
  const std::vector<tz::BlockSpec> huge = {{"a", {{"w", {std::int64_t{1} << 32, std::int64_t{1} << 32}}, {"b", {4}}}}};
  auto overflow = tz::ZeroEngine::create({.config = test_config(nvme.path())}, huge, tz::mlp::init(kMlp));
  ASSERT_FALSE(overflow.ok());
  EXPECT_NE(overflow.status().message().find("a.w of shape (4294967296, 4294967296) has more than 2^50 elements"),
            std::string::npos)
      << overflow.status().message();
}

}  // namespace
}  // namespace tzt
