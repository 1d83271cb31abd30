// The GPT on in-memory weights (tierzero/train/gpt.h): the whole model's
// backward against finite differences in double, float against double, and
// the model description the engine gets.
#include <algorithm>
#include <cmath>

#include "tierzero/train.h"
#include "train_test_util.h"
#include "../../train/src/passes.h"

namespace tzt {
namespace {

using tz::train::GptConfig;

// Small enough to difference every block; init_std large and every weight
// jittered so LayerNorm weights differ from 1, biases from 0, and no path is idle.
constexpr GptConfig kTiny{.layers = 2, .hidden = 12, .heads = 3, .seq = 6, .batch = 2, .vocab = 10, .init_std = 0.3};

TEST(Gpt, WholeModelBackwardMatchesFiniteDifferences) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const tz::ModelLayout layout = tz::ModelLayout::make(tz::train::model(kTiny), 1, 0).value();
  auto weights = initial_weights<double>(kTiny, layout);
  for (auto& block : weights) {
    const auto jitter = random_vector(rng, block.size(), 0.1);
    for (std::size_t i = 0; i < block.size(); ++i) block[i] += jitter[i];
  }
  const tz::train::TokenBatch batch = random_batch(rng, kTiny.batch, 5, kTiny.vocab);  // shorter than the context
  std::vector<std::vector<double>> grads;
  for (const auto& b : weights) grads.emplace_back(b.size(), 0.0);
  const double loss = tz::train::forward_backward<double>(kTiny, layout, weights, batch, 1.0, &grads);
  EXPECT_GT(loss, 0.0);
  auto objective = [&] { return tz::train::forward_backward<double>(kTiny, layout, weights, batch, 1.0, nullptr); };
  for (std::size_t b = 0; b < weights.size(); ++b) {
    const FdResult fd = fd_check(weights[b], grads[b], objective, 200);
    report(("whole model, block " + layout.blocks[b].name).c_str(), fd);
    EXPECT_LE(fd.max_rel, kFdTolerance) << layout.blocks[b].name << " seed " << seed;
  }
}

TEST(Gpt, FloatModelMatchesTheDoubleModel) {
  std::mt19937_64 rng(fresh_seed());
  const GptConfig cfg{.layers = 2, .hidden = 32, .heads = 4, .seq = 16, .batch = 2, .vocab = 40, .init_std = 0.1};
  const tz::ModelLayout layout = tz::ModelLayout::make(tz::train::model(cfg), 1, 0).value();
  const auto wd = initial_weights<double>(cfg, layout);
  const auto wf = initial_weights<float>(cfg, layout);
  const tz::train::TokenBatch batch = random_batch(rng, cfg.batch, cfg.seq, cfg.vocab);
  std::vector<std::vector<double>> gd;
  std::vector<std::vector<float>> gf;
  for (const auto& b : wd) {
    gd.emplace_back(b.size(), 0.0);
    gf.emplace_back(b.size(), 0.0F);
  }
  const double ld = tz::train::forward_backward<double>(cfg, layout, wd, batch, 1.0, &gd);
  const double lf = tz::train::forward_backward<float>(cfg, layout, wf, batch, 1.0, &gf);
  EXPECT_NEAR(lf, ld, 1e-5 * ld);
  double worst = 0;
  for (std::size_t b = 0; b < gd.size(); ++b) worst = std::max(worst, float_vs_double(gf[b], gd[b]));
  std::printf("[ gpt    ] float vs double: loss %.9g vs %.9g, largest gradient error %.3g of the block's largest\n", lf,
              ld, worst);
  EXPECT_LE(worst, kFloatTolerance);
}

TEST(Gpt, ModelDescriptionCountsAndInitialisesLikeGpt2) {
  const GptConfig cfg{.layers = 3, .hidden = 48, .heads = 4, .seq = 20, .vocab = 256};
  ASSERT_TRUE(cfg.validate().ok());
  const tz::ModelLayout layout = tz::ModelLayout::make(tz::train::model(cfg), 1, 0).value();
  EXPECT_EQ(layout.param_numel, cfg.param_count());
  EXPECT_EQ(layout.blocks.size(), 4U);
  EXPECT_EQ(layout.blocks[0].name, "embed");
  const auto w = initial_weights<double>(cfg, layout);
  auto stddev = [&](std::size_t b, std::size_t p) {
    const tz::ParamLayout& pl = layout.blocks[b].params[p];
    double ss = 0;
    for (std::uint64_t i = 0; i < pl.numel; ++i) ss += w[b][pl.offset + i] * w[b][pl.offset + i];
    return std::sqrt(ss / static_cast<double>(pl.numel));
  };
  EXPECT_NEAR(stddev(0, tz::train::kWte), 0.02, 0.001);
  EXPECT_NEAR(stddev(1, tz::train::kFcW), 0.02, 0.001);
  EXPECT_NEAR(stddev(2, tz::train::kProjW), 0.02 / std::sqrt(6.0), 0.001);
  EXPECT_EQ(stddev(1, tz::train::kLn1W), 1.0);
  EXPECT_EQ(stddev(1, tz::train::kQkvB), 0.0);
  EXPECT_EQ(stddev(0, tz::train::kLnfB), 0.0);
  // Normals come in Box-Muller pairs (elements 2k, 2k+1): the two of a pair
  // must be uncorrelated, and the values centred.
  const tz::ParamLayout& wte = layout.blocks[0].params[tz::train::kWte];
  double sum = 0, lag = 0;
  for (std::uint64_t i = 0; i < wte.numel; ++i) sum += w[0][wte.offset + i];
  for (std::uint64_t i = 0; i + 1 < wte.numel; i += 2) lag += w[0][wte.offset + i] * w[0][wte.offset + i + 1];
  const double n = static_cast<double>(wte.numel);
  EXPECT_LT(std::abs(sum / n), 4 * 0.02 / std::sqrt(n));                      // 4 standard errors
  EXPECT_LT(std::abs(lag / (n / 2) / (0.02 * 0.02)), 4 / std::sqrt(n / 2));  // correlation within 4 SE
  // A parameter of odd length takes pair k's first normal as its last element.
  std::vector<float> even(8), odd(7);
  tz::train::init(cfg)(1, tz::train::kFcW, even.data(), even.size());
  tz::train::init(cfg)(1, tz::train::kFcW, odd.data(), odd.size());
  EXPECT_TRUE(std::equal(odd.begin(), odd.end(), even.begin()));
  EXPECT_NE(even[6], even[7]);
  GptConfig bad = cfg;
  bad.heads = 5;
  const tz::Status s = bad.validate();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("hidden = 48 is not divisible by heads = 5"), std::string::npos) << s.message();
}

// Note [Default warm-up]: ceil(lr x layers x hidden^2 / 100) steps, none at 1 or below.
TEST(Gpt, DefaultWarmupGrowsWithDepthTimesWidthSquaredTimesLr) {
  using tz::train::default_warmup_steps;
  const GptConfig cpu{.layers = 6, .hidden = 384, .heads = 6};      // the default preset, lr 3e-4
  EXPECT_EQ(default_warmup_steps(cpu, 3e-4), 3);                    // 265.4 / 100
  const GptConfig wide{.layers = 2, .hidden = 4096, .heads = 32};   // the width test of issue #25
  EXPECT_EQ(default_warmup_steps(wide, 3e-4), 101);                 // 10066.3 / 100
  EXPECT_EQ(default_warmup_steps(GptConfig{.layers = 40, .hidden = 4096, .heads = 32}, 5e-6), 34);
  // Twice the layers or the lr doubles it; twice the width, four times.
  EXPECT_EQ(default_warmup_steps(GptConfig{.layers = 4, .hidden = 4096, .heads = 32}, 3e-4), 202);
  EXPECT_EQ(default_warmup_steps(GptConfig{.layers = 2, .hidden = 2048, .heads = 32}, 3e-4), 26);
  // Small models and tiny rates need none; a zero, negative or NaN lr none either.
  EXPECT_EQ(default_warmup_steps(GptConfig{.layers = 2, .hidden = 64, .heads = 4}, 3e-4), 0);
  EXPECT_EQ(default_warmup_steps(wide, 0.0), 0);
  EXPECT_EQ(default_warmup_steps(wide, -1.0), 0);
  EXPECT_EQ(default_warmup_steps(wide, std::nan("")), 0);
  EXPECT_EQ(default_warmup_steps(wide, 1e30), 1000000000);  // capped, no overflow
}

// activation_bytes is what the trainer's Workspace holds after resize, plus
// its fp32 copies of the embedding block and one transformer block (weights
// and gradients): every buffer counted, none twice.
TEST(Gpt, ActivationBytesAreTheWorkspacesBuffers) {
  const GptConfig cfg{.layers = 3, .hidden = 48, .heads = 4, .seq = 24, .batch = 5};
  auto workspace_floats = [&](int layers) {
    tz::train::detail::Workspace<float> ws;
    ws.resize(tz::train::detail::shape_of(cfg, cfg.batch, cfg.seq), layers);
    std::uint64_t floats = 0;
    for (const auto& a : ws.layers) {
      for (const auto* v : {&a.x_in, &a.ln1, &a.ln1_mean, &a.ln1_rstd, &a.qkv, &a.probs, &a.att, &a.x_mid, &a.ln2,
                            &a.ln2_mean, &a.ln2_rstd, &a.fc, &a.gelu}) {
        floats += v->size();
      }
    }
    for (const auto* v : {&ws.x_final, &ws.lnf, &ws.lnf_mean, &ws.lnf_rstd, &ws.logits, &ws.dlogits, &ws.dx,
                          &ws.dx_next, &ws.d_mid, &ws.d_tmp, &ws.d_att, &ws.d_qkv, &ws.d_ffn}) {
      floats += v->size();
    }
    return floats;
  };
  const std::vector<tz::BlockSpec> blocks = tz::train::model(cfg);
  auto numel = [](const tz::BlockSpec& b) {
    std::uint64_t n = 0;
    for (const auto& p : b.params) {
      std::uint64_t k = 1;
      for (auto d : p.shape) k *= static_cast<std::uint64_t>(d);
      n += k;
    }
    return n;
  };
  EXPECT_EQ(cfg.activation_bytes(), 4 * (workspace_floats(cfg.layers) + 2 * numel(blocks[0]) + 2 * numel(blocks[1])));

  // Evaluation (GptTrainer::eval_loss) resizes a workspace for one layer and
  // keeps each batch's residual stream and one gathered block's master.
  const std::uint64_t streams = 3ULL * cfg.batch * cfg.seq * cfg.hidden;
  EXPECT_EQ(cfg.evaluation_bytes(3),
            4 * (workspace_floats(1) + streams + std::max(numel(blocks[0]), numel(blocks[1]))));
  EXPECT_EQ(cfg.evaluation_bytes(0), 0U);
}

}  // namespace
}  // namespace tzt
