// GptTrainer through ZeroEngine with the parameters and optimizer states on
// NVMe: step by step the same losses and weights as the in-memory reference
// for 20 steps; evaluation between steps reads the current weights and keeps
// prefetching on; an engine of another model and bad tokens are refused.
#include "tierzero/testing/engine.h"
#include "../nvme/nvme_test_util.h"
#include "tierzero/train.h"
#include "train_test_util.h"
#include "trainer_test_util.h"

namespace tzt {
namespace {

using tz::Tier;
using tz::train::GptConfig;

constexpr GptConfig kGpt{.layers = 2, .hidden = 32, .heads = 4, .seq = 16, .batch = 4, .seed = 21};
// ZeRO-Infinity: 16-bit params, fp32 master and moments on NVMe; gradients in CPU memory.
constexpr std::array<Tier, tz::kNumStateClasses> kNvmePlacement{Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme};

// bf16 parameters, or fp32 ones (neither "bf16" nor "fp16" enabled).
tz::Config gpt_config(const std::string& nvme_dir, int gas, bool bf16 = true) {
  auto config = tz::parse_config(fmt::format(R"({{
    "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": {}, "gradient_clipping": 1.0,
    "bf16": {{"enabled": {}}},
    "optimizer": {{"type": "AdamW", "params": {{"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}}},
    "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 20000}},
    "tierzero": {{"backend": "host", "tiers": {{"gpu_bytes": "64MiB", "cpu_bytes": "256MiB", "nvme_bytes": "1GiB",
                  "nvme_paths": ["{}"]}}}}
  }})", gas, bf16, nvme_dir), "gpt test config");
  EXPECT_TRUE(config.ok()) << config.status().to_string();
  return config.ok() ? *config : tz::Config{};
}

// lr 1e-3: a wrong update moves a weight by ~1e-3 in one step. With fp32
// gradients the engine's fp32 Adam and the reference's double Adam differ by
// float rounding, up to about one ulp of a weight a step (LayerNorm weights
// sit near 1, ulp 1.2e-7: 20 steps can add up to 2.4e-6), and now and then
// that flips a 16-bit weight's rounding; seen: 0.9e-6 to 1.4e-6 here (the
// Release and the ASan build differ). Bound: 5e-6. With bf16 gradients the
// same flips move gradients across bf16 rounding boundaries (a 2^-8 jump),
// which Adam turns into update differences of up to ~1e-5 a step: two
// references whose initial weights differ by 1e-7 relative drift 7e-5 apart
// in 20 steps that way; seen here: 3.2e-5 to 3.5e-5. Bound: 2e-4, still a
// fifth of one wrong step.
double master_tolerance(std::optional<tz::DType> grad_type, bool bf16 = true) {
  return grad_type == tz::DType::kFp32 || !bf16 ? 5e-6 : 2e-4;
}
constexpr double kLossTolerance = 1e-5;  // relative

TEST(GptTrainer, MatchesTheInMemoryReferenceStepByStepFor20StepsWithStatesOnNvme) {
  const int steps = 20, gas = 2;
  struct Case {
    bool bf16;
    std::optional<tz::DType> grad_type;
  };
  // bf16 params with bf16 or fp32 gradients; fp32 params (and so fp32 gradients).
  for (const Case& c : {Case{true, {}}, Case{true, tz::DType::kFp32}, Case{false, {}}}) {
    const std::optional<tz::DType> grad_type = c.grad_type;
    TempDir nvme;
    const tz::Config config = gpt_config(nvme.path(), gas, c.bf16);
    auto engine = tz::ZeroEngine::create({.config = config, .grad_type = grad_type, .placement = kNvmePlacement},
                                         tz::train::model(kGpt), tz::train::init(kGpt));
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto gpt = tz::train::GptTrainer::create(**engine, kGpt);
    ASSERT_TRUE(gpt.ok()) << gpt.status().to_string();
    tz::train::Reference ref(kGpt, config, 1, corpus_batches(kGpt), grad_type);
    const std::string what = fmt::format("{} params, {} grads", c.bf16 ? "bf16" : "fp32",
                                         grad_type == tz::DType::kFp32 || !c.bf16 ? "fp32" : "bf16");
    const RunAgainstReference run = run_against_reference(**engine, **gpt, ref, corpus_batches(kGpt), steps, gas,
                                                          kLossTolerance, master_tolerance(grad_type, c.bf16), what);
    std::printf("[ gpt    ] %s, 20 steps on NVMe: loss %.4f -> %.4f; largest relative loss difference %.3g, "
                "largest |master - reference| %.3g\n", what.c_str(), run.first_loss, run.last_loss, run.worst_loss,
                run.worst_master.worst);
    EXPECT_LT(run.last_loss, run.first_loss) << "the loss falls";
  }
}

// One rank of a 2-rank run (Gloo, forked processes): each rank trains its own
// micro-batches; the reference computes both ranks' and the sum over ranks.
int train_rank(const tz::RankInfo& info, const std::string& dir, int steps) {
  const std::string nvme_dir = dir + "/rank" + std::to_string(info.rank);
  std::filesystem::create_directories(nvme_dir);
  const tz::Config config = gpt_config(nvme_dir, 2);
  auto comm = tz::create_communicator({.ranks = info, .timeout = std::chrono::seconds(60)});
  if (!comm.ok()) return std::fprintf(stderr, "rank %d: %s\n", info.rank, comm.status().to_string().c_str()), 1;
  auto engine = tz::ZeroEngine::create({.config = config, .comm = comm->get(), .grad_type = tz::DType::kFp32,
                                        .placement = kNvmePlacement},
                                       tz::train::model(kGpt), tz::train::init(kGpt));
  if (!engine.ok()) return std::fprintf(stderr, "rank %d: %s\n", info.rank, engine.status().to_string().c_str()), 1;
  auto gpt = tz::train::GptTrainer::create(**engine, kGpt);
  if (!gpt.ok()) return 1;
  tz::train::Reference ref(kGpt, config, info.world_size, corpus_batches(kGpt), tz::DType::kFp32);
  const tz::train::BatchFn batches = corpus_batches(kGpt);
  double worst = 0;
  for (int step = 0; step < steps; ++step) {
    for (int micro = 0; micro < 2; ++micro) {
      auto loss = (*gpt)->train_micro_batch(batches(info.rank, micro, step));
      auto report = loss.ok() ? (*engine)->step() : tz::Expected<tz::StepReport>(loss.status());
      if (!report.ok()) {
        std::fprintf(stderr, "rank %d step %d: %s\n", info.rank, step, report.status().to_string().c_str());
        return 1;
      }
    }
    ref.train_step(step);
    worst = std::max(worst, master_diff(**engine, ref).worst);  // a collective: every rank calls it
  }
  if (info.rank == 0) {
    std::printf("[ gpt    ] 2 ranks, %d steps on NVMe: largest |master - reference| %.3g\n", steps, worst);
  }
  return worst <= master_tolerance(tz::DType::kFp32) ? 0 : 2;
}

TEST(GptTrainer, TwoRanksMatchTheInMemoryReference) {
  TempDir dir;
  const std::vector<int> codes =
      run_ranks(2, dir.path() + "/rendezvous", [&](const tz::RankInfo& info) { return train_rank(info, dir.path(), 10); });
  for (std::size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

TEST(GptTrainer, EvaluationReadsTheCurrentWeightsAndLeavesPrefetchingOn) {
  TempDir nvme;
  const tz::Config config = gpt_config(nvme.path(), 1);
  auto engine = tz::ZeroEngine::create({.config = config, .placement = kNvmePlacement}, tz::train::model(kGpt),
                                       tz::train::init(kGpt));
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  auto gpt = tz::train::GptTrainer::create(**engine, kGpt);
  ASSERT_TRUE(gpt.ok());
  // The evaluation of a batch is the training loss of the same batch with the
  // same weights, to the bit: the same arithmetic on the same values.
  expect_evaluation_matches_training(**engine, **gpt, kGpt, 0.0, "CPU");
}

TEST(GptTrainer, RefusesAnotherModelsEngineAndTokensOutsideTheVocabulary) {
  TempDir nvme;
  const tz::Config config = gpt_config(nvme.path(), 1);
  auto engine = tz::ZeroEngine::create({.config = config, .placement = kNvmePlacement}, tz::train::model(kGpt),
                                       tz::train::init(kGpt));
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  GptConfig wider = kGpt;
  wider.hidden = 64;
  auto refused = tz::train::GptTrainer::create(**engine, wider);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("wte"), std::string::npos) << refused.status().message();
  GptConfig deeper = kGpt;
  deeper.layers = 3;
  EXPECT_FALSE(tz::train::GptTrainer::create(**engine, deeper).ok());
  auto gpt = tz::train::GptTrainer::create(**engine, kGpt);
  ASSERT_TRUE(gpt.ok());
  tz::train::TokenBatch batch = corpus_batches(kGpt)(0, 0, 0);
  batch.targets[5] = 256;
  auto bad = (*gpt)->train_micro_batch(batch);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("token 256 at position 5"), std::string::npos) << bad.status().message();
  batch.seq = kGpt.seq + 1;
  EXPECT_FALSE((*gpt)->train_micro_batch(batch).ok());
}

}  // namespace
}  // namespace tzt
