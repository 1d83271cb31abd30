// bf16 second moments by stochastic rounding (Note [Stochastic rounding of
// bf16 second moments], tierzero/cpu_adam.h): they keep moving where
// round-to-nearest stalls, the rounding is unbiased, and its bits depend on
// the element, the step and the key only, not on tiles, threads, ISA or where
// a call's spans start.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "reference.h"
#include "tierzero/common.h"

namespace tzt {
namespace {

using tz::cpu_adam::compiled_variants;
using tz::cpu_adam::CpuOptimizer;
using tz::cpu_adam::cpu_supports;

std::uint16_t to_bf16_bits(float x) { return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(x) >> 16); }
float from_bf16_bits(std::uint16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

std::vector<Simd> runnable_variants() {
  std::vector<Simd> out;
  for (Simd s : compiled_variants()) {
    if (cpu_supports(s)) out.push_back(s);
  }
  return out;
}

std::unique_ptr<CpuOptimizer> make_optimizer(Simd simd, int threads, std::size_t tile = 0) {
  auto opt = CpuOptimizer::create({.threads = threads, .simd = simd, .tile_elems = tile});
  EXPECT_TRUE(opt.ok()) << opt.status().message();
  return opt.ok() ? std::move(*opt) : nullptr;
}

// n elements of AdamW state: fp32 masters, bf16 moments, fp32 gradients.
struct State {
  explicit State(std::size_t n) : param(n), grad(n), m(n), v(n) {}
  std::vector<float> param, grad;
  std::vector<std::uint16_t> m, v;
  Spans spans(std::size_t begin, std::size_t end, std::uint64_t key) {
    Spans s;
    s.n = end - begin;
    s.param = param.data() + begin;
    s.grad = grad.data() + begin;
    s.exp_avg = m.data() + begin;
    s.exp_avg_sq = v.data() + begin;
    s.moment_dtype = DType::kBf16;
    s.rounding_key = key;
    s.rounding_index = begin;
    return s;
  }
};

// The stall the Note measures: v = 1, then zero gradients. In fp64 v decays
// as 0.999^t; stored round-to-nearest it would stay 1 forever (0.999 rounds
// back to 1 in bf16). Stochastically rounded, the mean over many elements
// follows the fp64 decay.
TEST(StochasticRounding, SecondMomentsDecayWhereRoundToNearestWouldStall) {
  constexpr std::size_t kN = 8192;
  constexpr int kSteps = 1500;
  const Hyper hyper{.algorithm = Algorithm::kAdamW, .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
  for (Simd simd : runnable_variants()) {
    auto opt = make_optimizer(simd, 2);
    ASSERT_NE(opt, nullptr);
    State st(kN);
    std::fill(st.v.begin(), st.v.end(), to_bf16_bits(1.0f));
    for (int t = 1; t <= kSteps; ++t) {
      ASSERT_TRUE(opt->step(hyper, {.step = t}, st.spans(0, kN, 7)).ok());
    }
    double mean = 0;
    for (std::uint16_t h : st.v) mean += from_bf16_bits(h);
    mean /= kN;
    const double want = std::pow(0.999, kSteps);  // 0.223
    // Each store's error is unbiased with a standard deviation under one bf16
    // step (2^-8 of v); over 1500 geometric steps and 8192 elements the mean
    // is off by far less than 2%.
    EXPECT_NEAR(mean, want, 0.02 * want) << simd_name(simd);
    // Round to nearest would have left every v at 1.
    EXPECT_LT(mean, 0.5) << simd_name(simd);
  }
}

// Unbiased: a value a quarter of the way between two bf16 values rounds up
// about a quarter of the time, and each result is one of the two neighbours.
TEST(StochasticRounding, RoundsUpInProportionToTheDistancePastTheLowerNeighbour) {
  constexpr std::size_t kN = 1 << 16;
  const Hyper hyper{.algorithm = Algorithm::kAdagrad, .lr = 1e-3, .eps = 1e-8};
  for (Simd simd : runnable_variants()) {
    auto opt = make_optimizer(simd, 1);
    ASSERT_NE(opt, nullptr);
    for (double frac : {0.25, 0.5, 0.875}) {
      // Adagrad: s = 0 + g^2 with g^2 = 1 + frac * 2^-7 (bf16 step at 1 is 2^-7).
      State st(kN);
      const float target = static_cast<float>(1.0 + frac * 0x1p-7);
      std::fill(st.grad.begin(), st.grad.end(), std::sqrt(target));
      ASSERT_TRUE(opt->step(hyper, {.step = 1}, st.spans(0, kN, 11)).ok());
      const double g2 = static_cast<double>(st.grad[0]) * st.grad[0];
      const float fp32_sum = static_cast<float>(g2);  // the kernel's fp32 square, as stored before rounding
      const std::uint16_t lo = to_bf16_bits(fp32_sum), hi = static_cast<std::uint16_t>(lo + 1);
      const double want_up = (std::bit_cast<std::uint32_t>(fp32_sum) & 0xffffU) / 65536.0;
      std::size_t up = 0;
      for (std::uint16_t h : st.v) {
        ASSERT_TRUE(h == lo || h == hi) << simd_name(simd) << " frac " << frac << ": " << h;
        up += h == hi ? 1 : 0;
      }
      const double got_up = static_cast<double>(up) / kN;
      // Binomial: sd <= 0.5 / sqrt(65536) = 0.002.
      EXPECT_NEAR(got_up, want_up, 0.01) << simd_name(simd) << " frac " << frac;
    }
  }
}

// The same (key, step, index) rounds the same way: spans cut anywhere
// (rounding_index set to where they start), any tile size and thread count
// give the whole-span single-thread run's bits, for each ISA. (Across ISAs the
// fp32 values before rounding may differ in their last bit where one variant
// fuses a multiply-add the scalar loop does not; the next test compares the
// rounding itself across ISAs on values every variant computes exactly.)
TEST(StochasticRounding, BitsDependOnTheElementNotOnTilesThreadsOrCuts) {
  constexpr std::size_t kN = 5000;
  constexpr int kSteps = 5;
  const Hyper hyper{.algorithm = Algorithm::kAdamW, .lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                    .weight_decay = 0.01};
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  State init(kN);
  for (std::size_t i = 0; i < kN; ++i) {
    init.param[i] = dist(rng());
    init.grad[i] = dist(rng());
    init.m[i] = to_bf16_bits(0.1f * dist(rng()));
    init.v[i] = to_bf16_bits(std::fabs(dist(rng())));
  }
  auto run = [&](Simd simd, int threads, std::size_t tile, const std::vector<std::size_t>& cuts, std::uint64_t key) {
    auto opt = make_optimizer(simd, threads, tile);
    State st = init;
    for (int t = 1; t <= kSteps; ++t) {
      std::size_t begin = 0;
      for (std::size_t cut : cuts) {
        EXPECT_TRUE(opt->step(hyper, {.step = t}, st.spans(begin, cut, key)).ok());
        begin = cut;
      }
    }
    return st;
  };
  for (Simd simd : runnable_variants()) {
    const State want = run(simd, 1, 0, {kN}, 3);
    // Another key is another stream (so the equalities below are not trivial).
    EXPECT_NE(run(simd, 1, 0, {kN}, 4).v, want.v) << simd_name(simd);
    for (int threads : {1, 2}) {
      for (std::size_t tile : {std::size_t{0}, std::size_t{48}}) {
        for (const std::vector<std::size_t>& cuts : {std::vector<std::size_t>{kN},
                                                     std::vector<std::size_t>{7, 1031, 1032, 4099, kN}}) {
          const State got = run(simd, threads, tile, cuts, 3);
          EXPECT_EQ(got.v, want.v) << simd_name(simd) << " threads " << threads << " tile " << tile << " cuts "
                                   << cuts.size();
          EXPECT_EQ(got.m, want.m) << simd_name(simd);
          EXPECT_EQ(0, std::memcmp(got.param.data(), want.param.data(), kN * sizeof(float))) << simd_name(simd);
        }
      }
    }
  }
}

// Across ISAs: Adagrad's first sum of squares is g^2, exact in fp32 for g of
// at most 12 significant bits, so every variant rounds the same fp32 value;
// the stochastic bits (the hash, lane by lane) must then agree bit for bit,
// including part-vectors at cut points.
TEST(StochasticRounding, EveryIsaDrawsTheSameBits) {
  constexpr std::size_t kN = 3001;
  const Hyper hyper{.algorithm = Algorithm::kAdagrad, .lr = 1e-3, .eps = 1e-8};
  std::uniform_int_distribution<int> mant(1, 4095), expo(-20, 5);
  State init(kN);
  for (std::size_t i = 0; i < kN; ++i) init.grad[i] = std::ldexp(static_cast<float>(mant(rng())), expo(rng()));
  auto run = [&](Simd simd, const std::vector<std::size_t>& cuts) {
    auto opt = make_optimizer(simd, 2, 64);
    State st = init;
    std::size_t begin = 0;
    for (std::size_t cut : cuts) {
      EXPECT_TRUE(opt->step(hyper, {.step = 9}, st.spans(begin, cut, 0x1234567890ULL)).ok());
      begin = cut;
    }
    return st;
  };
  const State want = run(Simd::kScalar, {kN});
  std::size_t inexact = 0;  // values the rounding had to round (the others are trivially equal)
  for (std::size_t i = 0; i < kN; ++i) {
    const float g2 = init.grad[i] * init.grad[i];
    inexact += (std::bit_cast<std::uint32_t>(g2) & 0xffffU) != 0 ? 1 : 0;
  }
  EXPECT_GT(inexact, kN / 2);
  for (Simd simd : runnable_variants()) {
    EXPECT_EQ(run(simd, {kN}).v, want.v) << simd_name(simd);
    EXPECT_EQ(run(simd, {5, 17, 1000, 2999, kN}).v, want.v) << simd_name(simd) << " cut";
  }
}

// NaN stays NaN and inf stays inf through the stochastic store.
TEST(StochasticRounding, NonFiniteSecondMomentsStayNonFinite) {
  constexpr std::size_t kN = 64;
  const Hyper hyper{.algorithm = Algorithm::kAdagrad, .lr = 1e-3, .eps = 1e-8};
  for (Simd simd : runnable_variants()) {
    auto opt = make_optimizer(simd, 1);
    State st(kN);
    for (std::size_t i = 0; i < kN; ++i) {
      st.grad[i] = i % 3 == 0 ? std::nanf("") : (i % 3 == 1 ? INFINITY : 1.0f);
    }
    ASSERT_TRUE(opt->step(hyper, {.step = 1}, st.spans(0, kN, 1)).ok());
    for (std::size_t i = 0; i < kN; ++i) {
      const float v = from_bf16_bits(st.v[i]);
      if (i % 3 == 0) {
        EXPECT_TRUE(std::isnan(v)) << simd_name(simd) << " " << i;
      } else if (i % 3 == 1) {
        EXPECT_TRUE(std::isinf(v)) << simd_name(simd) << " " << i;
      } else {
        EXPECT_EQ(v, 1.0f) << simd_name(simd) << " " << i;
      }
    }
  }
}

}  // namespace
}  // namespace tzt
