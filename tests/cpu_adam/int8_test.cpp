// Int8 block-wise moments (Note [Int8 moments] in cpu_adam/src/int8_codes.h):
// the codes against a brute-force nearest-level search, every variant's codes
// and scales bit-identical to the scalar variant's, NaN/inf/zero blocks and
// partial blocks, the step as exactly "decode, fp32-moment step, encode" (also
// with weight-decay runs inside a block), and each step's error against a
// float64 reference within the bound of Note [Int8 step bound] below.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../../cpu_adam/src/dispatch.h"
#include "reference.h"
#include "tierzero/common.h"

namespace tzt {
namespace {

using tz::cpu_adam::Int8Moment;
using tz::cpu_adam::WeightDecaySegment;
using tz::cpu_adam::detail::Int8Code;
using tz::cpu_adam::detail::kernel_table;
constexpr std::size_t kB = 256;
constexpr double kU = 1.0 / (1 << 24);  // fp32 unit roundoff

const Int8Code& code_of(Int8Moment which) {
  return which == Int8Moment::kExpAvg ? tz::cpu_adam::detail::int8_code_exp_avg()
                                      : tz::cpu_adam::detail::int8_code_exp_avg_sq();
}

// Values over many decades, signed or not, with zeros; `specials` adds inf/NaN.
std::vector<float> random_moment(std::size_t n, bool positive, bool specials) {
  std::vector<float> x(n);
  const double decades = uniform(1, 12);
  for (float& v : x) {
    const double r = uniform(0, 1);
    v = r < 0.05 ? 0.0f : static_cast<float>(std::pow(10.0, -uniform(0, decades)) * (positive || r < 0.5 ? 1 : -1));
    if (specials && r > 0.98) v = uniform(0, 1) < 0.5 ? std::numeric_limits<float>::quiet_NaN()
                                                      : (r > 0.99 ? -1.0f : 1.0f) * std::numeric_limits<float>::infinity();
  }
  if (uniform(0, 1) < 0.1) std::fill(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(std::min(n, kB)), 0.0f);
  return x;
}

// The nearest level by brute force (ties to the lower), in the coded domain.
std::uint32_t nearest_code(const Int8Code& c, float x, float scale) {
  const float ax = std::fabs(x);
  if (!std::isfinite(x)) return c.nan_code;
  const float div = scale > 0 ? scale : 1.0f;
  const float y = (c.on_sqrt ? std::sqrt(ax) : ax) / div;
  std::uint32_t best = 0;
  for (std::uint32_t k = 1; k < c.magnitudes; ++k) {
    if (std::fabs(static_cast<double>(c.decode[k]) - y) < std::fabs(static_cast<double>(c.decode[best]) - y)) best = k;
  }
  if (!c.is_signed) return best == 0 && y > 0 ? 1 : best;
  return x < 0 && best != 0 ? (0x80 | best) : best;
}

TEST(CpuAdamInt8, CodesAreTheNearestLevelAndEveryVariantWritesTheScalarBits) {
  std::size_t blocks = 0;
  for (const Int8Moment which : {Int8Moment::kExpAvg, Int8Moment::kExpAvgSq}) {
    const Int8Code& c = code_of(which);
    for (int trial = 0; trial < 300; ++trial) {
      const std::size_t count = trial % 3 == 0 ? 1 + static_cast<std::size_t>(uniform(0, 255)) : kB;
      const std::vector<float> x = random_moment(count, which == Int8Moment::kExpAvgSq, trial % 2 == 1);
      std::vector<std::uint8_t> want(count);
      const float want_scale = kernel_table(Simd::kScalar).int8_encode(c, x.data(), want.data(), count);
      // The scale: the largest finite |x| (its sqrt for exp_avg_sq).
      float amax = 0;
      for (float v : x) amax = std::isfinite(v) ? std::max(amax, std::fabs(v)) : amax;
      ASSERT_EQ(bits_of(want_scale), bits_of(c.on_sqrt ? std::sqrt(amax) : amax));
      for (std::size_t i = 0; i < count; ++i) {
        ASSERT_EQ(want[i], nearest_code(c, x[i], want_scale)) << "element " << i << " = " << x[i] << ", scale " << want_scale;
      }
      std::vector<float> back(count);
      kernel_table(Simd::kScalar).int8_decode(c, want.data(), want_scale, back.data(), count);
      for (std::size_t i = 0; i < count; ++i) {
        if (!std::isfinite(x[i])) {
          EXPECT_TRUE(std::isnan(back[i])) << "a non-finite moment must stay non-finite";
        } else if (x[i] == 0) {
          EXPECT_EQ(back[i], 0.0f);
        } else if (std::fabs(x[i]) == amax) {
          EXPECT_NEAR(back[i], x[i], 2 * kU * amax) << "the block's largest is exact";
        } else if (!c.is_signed) {
          EXPECT_GT(back[i], 0.0f) << "a positive second moment must not decode to 0";
        }
      }
      for (Simd simd : runnable_variants()) {
        std::vector<std::uint8_t> got(count);
        const float scale = kernel_table(simd).int8_encode(c, x.data(), got.data(), count);
        ASSERT_EQ(bits_of(scale), bits_of(want_scale)) << simd_name(simd);
        ASSERT_EQ(got, want) << simd_name(simd);
        std::vector<float> out(count);
        kernel_table(simd).int8_decode(c, got.data(), scale, out.data(), count);
        ASSERT_EQ(std::memcmp(out.data(), back.data(), 4 * count), 0) << simd_name(simd);
      }
      ++blocks;
    }
  }
  std::printf("[ cpu_adam ] int8 codes: %zu blocks, nearest level, every variant bit-identical to scalar\n", blocks);
}

// The values where a search goes wrong first: every level and midpoint and
// their fp32 neighbours, 0, subnormals, the largest and inf/NaN, in blocks
// whose largest finite element is 1 (so y is the element, or its square root,
// exactly). Each variant's codes (Note [Int8 codes in registers]: the AVX-512
// one searches register tables) against the brute-force nearest level.
TEST(CpuAdamInt8, EveryLevelAndMidpointAndTheirNeighboursGetTheNearestCode) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::size_t checked = 0;
  for (const Int8Moment which : {Int8Moment::kExpAvg, Int8Moment::kExpAvgSq}) {
    const Int8Code& c = code_of(which);
    std::vector<float> ys{0.0f, std::numeric_limits<float>::denorm_min(), 1e-40f, std::numeric_limits<float>::min(),
                          1e-30f, 1e-9f, 1.0f};
    for (std::uint32_t k = 0; k < c.magnitudes; ++k) {
      for (const float at : {c.decode[k], c.mid[k]}) {
        if (!std::isfinite(at)) continue;
        ys.insert(ys.end(), {at, std::nextafter(at, 0.0f), std::nextafter(at, 2.0f)});
      }
    }
    std::vector<float> xs;
    for (const float y : ys) {
      if (y > 1.0f) continue;
      if (!c.on_sqrt) {
        xs.insert(xs.end(), {y, -y});
        continue;
      }
      // x with sqrt(x) at or beside y (the square may round either way).
      const float sq = y * y;
      xs.insert(xs.end(), {sq, std::nextafter(sq, 0.0f), std::nextafter(sq, 2.0f)});
    }
    xs.insert(xs.end(), {inf, -inf, nan});
    // Blocks of 255 values and a 1 (the scale), the last one partial.
    for (std::size_t at = 0; at < xs.size(); at += kB - 1) {
      std::vector<float> x(xs.begin() + static_cast<std::ptrdiff_t>(at),
                           xs.begin() + static_cast<std::ptrdiff_t>(std::min(xs.size(), at + kB - 1)));
      x.push_back(1.0f);
      const std::size_t count = x.size();
      for (Simd simd : runnable_variants()) {
        std::vector<std::uint8_t> got(count);
        const float scale = kernel_table(simd).int8_encode(c, x.data(), got.data(), count);
        ASSERT_EQ(scale, 1.0f) << simd_name(simd);
        for (std::size_t i = 0; i < count; ++i) {
          ASSERT_EQ(got[i], nearest_code(c, x[i], scale))
              << simd_name(simd) << ": x = " << x[i] << " (bits " << bits_of(x[i]) << ")";
          ++checked;
        }
      }
    }
  }
  std::printf("[ cpu_adam ] int8 codes: %zu level and midpoint neighbours, nearest level in every variant\n", checked);
}

TEST(CpuAdamInt8, PublicConversionsRoundTripPartialBlocks) {
  const std::size_t n = 1000;  // 3 blocks and a partial one of 232
  for (const Int8Moment which : {Int8Moment::kExpAvg, Int8Moment::kExpAvgSq}) {
    const std::vector<float> x = random_moment(n, which == Int8Moment::kExpAvgSq, false);
    std::vector<std::uint8_t> codes(n);
    std::vector<float> scales(4), back(n), again(n);
    ASSERT_TRUE(tz::cpu_adam::encode_int8_moment(which, x.data(), n, codes.data(), scales.data()).ok());
    ASSERT_TRUE(tz::cpu_adam::decode_int8_moment(which, codes.data(), scales.data(), n, back.data()).ok());
    // Decoded values are fixed points: encoding them again gives the same codes.
    std::vector<std::uint8_t> codes2(n);
    std::vector<float> scales2(4);
    ASSERT_TRUE(tz::cpu_adam::encode_int8_moment(which, back.data(), n, codes2.data(), scales2.data()).ok());
    EXPECT_EQ(codes, codes2);
  }
  std::vector<float> x(10);
  std::vector<std::uint8_t> codes(10);
  const tz::Status s = tz::cpu_adam::encode_int8_moment(Int8Moment::kExpAvg, x.data(), 10, codes.data(), nullptr);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("scales is null"), std::string::npos) << s.message();
}

// One shard with int8 moments (and an fp32 or remainder master).
struct Int8State {
  std::size_t n = 0;
  bool remainder = false;
  std::vector<float> param, grad, vmax, m_scale, v_scale;
  std::vector<std::uint8_t> m, v, ties;
  std::vector<std::uint16_t> p16;
  std::vector<std::int16_t> rem;

  Int8State(std::size_t n_in, bool remainder_in) : n(n_in), remainder(remainder_in) {
    param.resize(n);
    grad.resize(n);
    vmax.assign(n, 0.0f);
    m.resize(n);
    v.resize(n);
    m_scale.resize((n + kB - 1) / kB);
    v_scale.resize((n + kB - 1) / kB);
    p16.resize(n);
    rem.resize(n);
    ties.assign((n + 7) / 8, 0);
    for (float& p : param) p = static_cast<float>(log_uniform_signed(-2, 0.3));
    std::vector<float> m0(n), v0(n);
    for (std::size_t i = 0; i < n; ++i) {
      const double g = log_uniform_signed(-4, -1);
      m0[i] = static_cast<float>(0.3 * g);
      v0[i] = static_cast<float>(g * g * uniform(0.5, 2));
      vmax[i] = v0[i];
    }
    EXPECT_TRUE(tz::cpu_adam::encode_int8_moment(Int8Moment::kExpAvg, m0.data(), n, m.data(), m_scale.data()).ok());
    EXPECT_TRUE(tz::cpu_adam::encode_int8_moment(Int8Moment::kExpAvgSq, v0.data(), n, v.data(), v_scale.data()).ok());
    if (remainder) {
      EXPECT_TRUE(tz::cpu_adam::encode_remainder_masters(param.data(), n, p16.data(), rem.data(), ties.data()).ok());
    }
    fresh_grads();
  }
  void fresh_grads() {
    const double decades = uniform(1, 5);
    for (float& g : grad) g = static_cast<float>(std::pow(10.0, -uniform(0, decades)) * (uniform(0, 1) < 0.5 ? -1 : 1));
  }
  Spans spans() {
    Spans s{.n = n, .param = remainder ? nullptr : param.data(), .grad = grad.data(), .exp_avg = m.data(),
            .exp_avg_sq = v.data(), .moment_dtype = DType::kUint8, .max_exp_avg_sq = vmax.data(),
            .param16 = remainder ? p16.data() : nullptr, .exp_avg_scale = m_scale.data(),
            .exp_avg_sq_scale = v_scale.data()};
    if (remainder) {
      s.master_format = tz::MasterFormat::kRemainder;
      s.remainder = rem.data();
      s.tie_bits = ties.data();
    }
    return s;
  }
  std::vector<float> decoded(Int8Moment which) const {
    std::vector<float> out(n);
    const bool first = which == Int8Moment::kExpAvg;
    EXPECT_TRUE(tz::cpu_adam::decode_int8_moment(which, first ? m.data() : v.data(),
                                                 first ? m_scale.data() : v_scale.data(), n, out.data()).ok());
    return out;
  }
  std::vector<float> master() const {
    if (!remainder) return param;
    std::vector<float> out(n);
    EXPECT_TRUE(tz::cpu_adam::decode_remainder_masters(p16.data(), rem.data(), ties.data(), n, out.data()).ok());
    return out;
  }
};

// The int8 step is, bit for bit, decoding every block, the fp32-moment step
// of the same variant (weight-decay runs included) and encoding again.
TEST(CpuAdamInt8, TheStepIsDecodeThenTheFp32StepThenEncode) {
  std::size_t cases = 0;
  for (Simd simd : runnable_variants()) {
    for (const ThreadsAndTile tt : {ThreadsAndTile{1, 0}, ThreadsAndTile{2, 16}}) {
      const auto opt = make_optimizer(simd, tt.threads, tt.tile);
      for (const AlgorithmConfig& c : kEveryElementLoop) {
        for (const bool remainder : {false, true}) {
          const std::size_t n = 600 + static_cast<std::size_t>(uniform(0, 2000));
          Int8State st(n, remainder);
          const Hyper hyper = random_hyper(c.algorithm, c.amsgrad, c.weight_decay);
          // Runs that start inside blocks, at multiples of 32 and not.
          const WeightDecaySegment segs[] = {{32, 200, 0.0}, {200, 301, 0.05}, {517, n - 3, 0.2}};
          // The control: decoded moments through the fp32-moment step.
          std::vector<float> m = st.decoded(Int8Moment::kExpAvg), v = st.decoded(Int8Moment::kExpAvgSq);
          Int8State ctl = st;
          Spans s32 = ctl.spans();
          s32.moment_dtype = DType::kFp32;
          s32.exp_avg = m.data();
          s32.exp_avg_sq = v.data();
          s32.weight_decay_segments = segs;
          const StepArgs args{.step = 4, .grad_scale = 0.5};
          ASSERT_TRUE(make_optimizer(simd, 1)->step(hyper, args, s32).ok());
          const bool uses_m = c.algorithm != Algorithm::kAdagrad, uses_v = c.algorithm != Algorithm::kLion;
          if (uses_m) {
            for (std::size_t b = 0; b < n; b += kB) {
              ctl.m_scale[b / kB] = kernel_table(Simd::kScalar).int8_encode(code_of(Int8Moment::kExpAvg), m.data() + b,
                                                                            ctl.m.data() + b, std::min(kB, n - b));
            }
          }
          if (uses_v) {
            for (std::size_t b = 0; b < n; b += kB) {
              ctl.v_scale[b / kB] = kernel_table(Simd::kScalar).int8_encode(
                  code_of(Int8Moment::kExpAvgSq), v.data() + b, ctl.v.data() + b, std::min(kB, n - b));
            }
          }
          Spans s = st.spans();
          s.weight_decay_segments = segs;
          ASSERT_TRUE(opt->step(hyper, args, s).ok());
          const std::string what = fmt::format("{} {} threads tile {}, {}{} wd {}, {} master, n {}", simd_name(simd),
                                               tt.threads, tt.tile, algorithm_name(c.algorithm),
                                               c.amsgrad ? " amsgrad" : "", c.weight_decay,
                                               remainder ? "remainder" : "fp32", n);
          EXPECT_EQ(std::memcmp(st.param.data(), ctl.param.data(), 4 * n), 0) << what;
          EXPECT_EQ(st.p16, ctl.p16) << what;
          EXPECT_EQ(st.rem, ctl.rem) << what;
          EXPECT_EQ(st.ties, ctl.ties) << what;
          EXPECT_EQ(std::memcmp(st.vmax.data(), ctl.vmax.data(), 4 * n), 0) << what;
          EXPECT_EQ(st.m, ctl.m) << what;
          EXPECT_EQ(st.v, ctl.v) << what;
          EXPECT_EQ(std::memcmp(st.m_scale.data(), ctl.m_scale.data(), 4 * st.m_scale.size()), 0) << what;
          EXPECT_EQ(std::memcmp(st.v_scale.data(), ctl.v_scale.data(), 4 * st.v_scale.size()), 0) << what;
          ++cases;
        }
      }
    }
  }
  std::printf("[ cpu_adam ] int8 step = decode, fp32 step, encode: %zu cases bit for bit\n", cases);
}

// Note [Int8 step bound]
// Each step is checked against a float64 step from the same (decoded) state:
//  - the master: the fp32 step's own rounding, a few units u = 2^-24 of each
//    term: |p' - p'64| <= 4u (|p| + |p'|) + 16u |update| (the update's
//    divide, square root and fused operations, and the hyperparameters'
//    rounding to fp32, about 6u together, doubled), plus 8u |update| times
//    (b1 |m| + (1 - b1) |g|) / |m'| where m's update cancels;
//  - each stored moment x' (decoded) against the float64 x'64: the code's
//    rounding, at most half the gap between the two levels around
//    y = x'/scale, times the scale (a full gap for a positive exp_avg_sq below
//    the smallest level, which rounds up), on sqrt(x) for exp_avg_sq; the
//    gap is taken as the widest of the three intervals around y, since the
//    fp32 value being coded may lie across a level from the float64 one; plus
//    8u (|x'| + the magnitudes of the terms of its update, b1 |m| and
//    (1 - b1) |g|: the fp32 rounding is relative to them when they cancel)
//    for the fp32 arithmetic before the encoding.
// With the levels of Note [Int8 moments] the half-gap is at most 0.7% of the
// scale in the top decade of exp_avg, 0.35% for sqrt(exp_avg_sq).
double level_gap(const Int8Code& c, double y) {
  std::uint32_t k = 0;
  while (k + 1 < c.magnitudes && c.decode[k + 1] < y) ++k;
  double gap = 0;
  for (std::uint32_t j = k > 0 ? k - 1 : 0; j <= k + 1 && j + 1 < c.magnitudes; ++j) {
    gap = std::max(gap, static_cast<double>(c.decode[j + 1]) - c.decode[j]);
  }
  return gap;
}

TEST(CpuAdamInt8, EachStepIsWithinItsBoundOfAFloat64Step) {
  const auto opt = make_optimizer(tz::cpu_adam::best_supported(), 2, 0);
  for (const AlgorithmConfig& c : kEveryElementLoop) {
    for (const bool remainder : {false, true}) {
      const std::size_t n = 1000;
      Int8State st(n, remainder);
      const Hyper h = random_hyper(c.algorithm, c.amsgrad, c.weight_decay);
      double worst_p = 0, worst_m = 0, worst_v = 0;
      for (std::int64_t t = 1; t <= 20; ++t) {
        st.fresh_grads();
        const std::vector<float> p0 = st.master(), m0 = st.decoded(Int8Moment::kExpAvg),
                                 v0 = st.decoded(Int8Moment::kExpAvgSq);
        const std::vector<float> vmax0 = st.vmax;
        ASSERT_TRUE(opt->step(h, {.step = t, .grad_scale = 0.5}, st.spans()).ok());
        const std::vector<float> p1 = st.master(), m1 = st.decoded(Int8Moment::kExpAvg),
                                 v1 = st.decoded(Int8Moment::kExpAvgSq);
        for (std::size_t i = 0; i < n; ++i) {
          // The float64 step from the decoded state (the formulas of tierzero/cpu_adam.h).
          double p = p0[i], g = 0.5 * st.grad[i], m = m0[i], v = v0[i], update = 0;
          double m_terms = 0;  // |the terms of m's update|: its fp32 rounding is relative to them (cancellation)
          const double td = static_cast<double>(t);
          if (c.algorithm == Algorithm::kLion) {
            p *= 1 - h.lr * h.weight_decay;
            const double d = h.beta1 * m + (1 - h.beta1) * g;
            update = -h.lr * (d > 0 ? 1 : (d < 0 ? -1 : 0));
            m_terms = std::fabs(h.beta2 * m) + std::fabs((1 - h.beta2) * g);
            m = h.beta2 * m + (1 - h.beta2) * g;
          } else if (c.algorithm == Algorithm::kAdagrad) {
            g += h.weight_decay * p;
            v += g * g;
            update = -h.lr / (1 + (td - 1) * h.lr_decay) * g / (std::sqrt(v) + h.eps);
          } else {
            if (c.algorithm == Algorithm::kAdam) g += h.weight_decay * p;
            else p *= 1 - h.lr * h.weight_decay;
            m_terms = std::fabs(h.beta1 * m) + std::fabs((1 - h.beta1) * g);
            m = h.beta1 * m + (1 - h.beta1) * g;
            v = h.beta2 * v + (1 - h.beta2) * g * g;
            const double d = c.amsgrad ? std::max<double>(vmax0[i], v) : v;
            update = -h.lr / (1 - std::pow(h.beta1, td)) * m / (std::sqrt(d) / std::sqrt(1 - std::pow(h.beta2, td)) + h.eps);
          }
          const double p64 = p + update;
          double bound_p = 4 * kU * (std::fabs(p0[i]) + std::fabs(p64)) + 16 * kU * std::fabs(update) + 1e-30;
          if (m_terms > 0 && m != 0 && c.algorithm != Algorithm::kLion) {
            // m's fp32 rounding is relative to its terms (cancellation), and the update is proportional to m.
            bound_p += 8 * kU * std::fabs(update) * m_terms / std::fabs(m);
          }
          if (c.algorithm == Algorithm::kLion) {
            // A sign within the fp32 rounding of b1 m + (1 - b1) g may flip: 2 lr.
            const double d = h.beta1 * m0[i] + (1 - h.beta1) * 0.5 * st.grad[i];
            if (std::fabs(d) <= 4 * kU * (std::fabs(h.beta1 * m0[i]) + std::fabs(0.5 * st.grad[i]))) bound_p += 2 * h.lr;
          }
          if (!(std::fabs(p1[i] - p64) <= bound_p)) {
            ADD_FAILURE() << algorithm_name(c.algorithm) << " step " << t << " element " << i << ": master " << p1[i]
                          << " vs float64 " << p64 << ", bound " << bound_p;
            return;
          }
          worst_p = std::max(worst_p, std::fabs(p1[i] - p64) / bound_p);
          const std::size_t blk = i / kB;
          if (c.algorithm != Algorithm::kAdagrad) {
            const Int8Code& cm = code_of(Int8Moment::kExpAvg);
            const double s = st.m_scale[blk];
            const double bound = s * level_gap(cm, std::fabs(m) / s) / 2 + 8 * kU * (std::fabs(m) + m_terms) + 1e-30;
            ASSERT_LE(std::fabs(m1[i] - m), bound) << algorithm_name(c.algorithm) << " exp_avg, step " << t << " element " << i;
            worst_m = std::max(worst_m, std::fabs(m1[i] - m) / bound);
          }
          if (c.algorithm != Algorithm::kLion) {
            const Int8Code& cv = code_of(Int8Moment::kExpAvgSq);
            const double s = st.v_scale[blk], y = std::sqrt(v) / s;
            const double gap = level_gap(cv, y);
            const double bound = s * (y < cv.decode[1] ? 2 * gap : gap) / 2 + 8 * kU * std::sqrt(v) + 1e-30;
            ASSERT_LE(std::fabs(std::sqrt(static_cast<double>(v1[i])) - std::sqrt(v)), bound)
                << algorithm_name(c.algorithm) << " exp_avg_sq, step " << t << " element " << i;
            worst_v = std::max(worst_v, std::fabs(std::sqrt(static_cast<double>(v1[i])) - std::sqrt(v)) / bound);
          }
        }
      }
      std::printf("[ cpu_adam ] int8 %-7s%s %s master, 20 steps: worst error / bound: master %.3f exp_avg %.3f "
                  "sqrt(exp_avg_sq) %.3f\n", std::string(algorithm_name(c.algorithm)).c_str(),
                  c.amsgrad ? " ams" : "    ", remainder ? "remainder" : "fp32     ", worst_p, worst_m, worst_v);
    }
  }
}

TEST(CpuAdamInt8, BadSpansAreRefusedByName) {
  const auto opt = make_optimizer(tz::cpu_adam::best_supported(), 1);
  Int8State st(300, false);
  Spans s = st.spans();
  s.exp_avg_sq_scale = nullptr;
  tz::Status status = opt->step(random_hyper(Algorithm::kAdamW, false, 0.1), {.step = 1}, s);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("spans.exp_avg_sq_scale is null"), std::string::npos) << status.message();
  s = st.spans();
  s.exp_avg_scale = reinterpret_cast<float*>(st.m.data());  // overlaps the codes
  status = opt->step(random_hyper(Algorithm::kAdamW, false, 0.1), {.step = 1}, s);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("overlap"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace tzt
