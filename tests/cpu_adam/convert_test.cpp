// The 16-bit conversions of every variant: gradients decode exactly, and the
// 16-bit copy-out is round-to-nearest-even of the fp32 result bit for bit,
// infinities and NaNs included.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "reference.h"

namespace tzt {
namespace {

using tz::cpu_adam::simd_name;

// What F16C's vcvtps2ph makes of a NaN: quiet, sign and top payload bits kept.
std::uint16_t fp16_nan(std::uint32_t bits) {
  return static_cast<std::uint16_t>(((bits >> 16) & 0x8000) | 0x7e00 | ((bits >> 13) & 0x3ff));
}

TEST(CpuAdamConvert, EveryBf16AndFp16GradientDecodesExactly) {
  constexpr std::size_t kN = 65536;
  for (Simd simd : runnable_variants()) {
    const auto opt = make_optimizer(simd, 2, 4096);
    for (DType dtype : {DType::kBf16, DType::kFp16}) {
      Buffer acc(DType::kFp32, kN, true), grad(dtype, kN, true);
      for (std::size_t i = 0; i < kN; ++i) grad.set_bits16(i, static_cast<std::uint16_t>(i));
      const auto stats = opt->accumulate_grad(acc.f32(), grad.data(), dtype, kN, true, 1.0);
      ASSERT_TRUE(stats.ok());
      EXPECT_TRUE(stats->non_finite);
      std::size_t bad = 0;
      for (std::size_t i = 0; i < kN; ++i) {
        const auto h = static_cast<std::uint16_t>(i);
        const float want = dtype == DType::kBf16 ? bf16_to_float(h) : fp16_to_float(h);
        const float got = acc.get_f32(i);
        const bool ok = std::isnan(want) ? std::isnan(got) : bits_of(got) == bits_of(want);
        if (!ok && ++bad <= 5) {
          ADD_FAILURE() << simd_name(simd) << " " << tz::dtype_name(dtype) << " " << std::hex << h
                        << " decoded to " << bits_of(got) << ", want " << bits_of(want);
        }
      }
    }
  }
}

// Parameters whose step leaves them unchanged (zero gradient and moments,
// no weight decay), so chosen bit patterns reach the copy-out as they are.
std::vector<std::uint32_t> interesting_floats() {
  std::vector<std::uint32_t> out = {
      0x00000000, 0x80000000, 0x7f800000, 0xff800000,  // zeros, infinities
      0x7fc00000, 0xffc00000, 0x7fc12345, 0x7f812345,  // NaNs (quiet, signalling, payloads)
      0x7f7fffff, 0xff7fffff, 0x7f7f8000, 0x7f7f7fff,  // near the largest float: bf16 rounds up to inf
      0x00000001, 0x807fffff, 0x00008000, 0x00018000,  // subnormals, ties among them
      0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001,  // 1.0 + ties to even / just below / above
      0x477fe000, 0x477ff000, 0x477fefff, 0x38800000,  // fp16: 65504, 65520 (ties to inf), smallest normal
      0x33800000, 0x33000000, 0x33000001, 0x337fffff,  // fp16: smallest subnormal, half of it (tie to 0)
  };
  for (int i = 0; i < 20000; ++i) {
    const auto r = static_cast<std::uint32_t>(rng()());
    out.push_back(r);                                   // anything
    out.push_back((r & 0xffff0000U) | 0x8000U);         // a bf16 tie
    out.push_back((r & 0x8fffe000U) | 0x30001000U);     // an fp16 tie near the fp16 range
  }
  return out;
}

TEST(CpuAdamConvert, CopyOutIsRoundToNearestEvenBitForBitIncludingInfAndNan) {
  const std::vector<std::uint32_t> patterns = interesting_floats();
  const std::size_t n = patterns.size();
  for (Simd simd : runnable_variants()) {
    const auto opt = make_optimizer(simd, 2, 1024);
    for (DType copy : {DType::kBf16, DType::kFp16}) {
      StepSetup setup;
      setup.hyper = random_hyper(Algorithm::kAdamW, false, 0.0);
      setup.n = n;
      setup.copy = copy;
      setup.unaligned = true;
      StepProblem p(setup);
      for (std::size_t i = 0; i < n; ++i) {
        std::memcpy(p.param.f32() + i, &patterns[i], 4);
        p.exp_avg.set(i, 0);
        p.exp_avg_sq.set(i, 0);
      }
      ASSERT_TRUE(opt->step(setup.hyper, {.step = 3}, p.spans()).ok());
      std::size_t bad = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const float out = p.param.get_f32(i);
        const std::uint32_t in = patterns[i];
        // Unchanged, but arithmetic quiets a signalling NaN.
        const std::uint32_t want_param = std::isnan(float_of(in)) ? in | 0x00400000U : in;
        const std::uint16_t want = copy == DType::kBf16 ? bf16_rne(out)
                                   : std::isnan(out)   ? fp16_nan(bits_of(out))
                                                       : fp16_rne(out);
        const std::uint16_t got = p.param16.bits16(i);
        if ((bits_of(out) != want_param || got != want) && ++bad <= 5) {
          ADD_FAILURE() << simd_name(simd) << " " << tz::dtype_name(copy) << std::hex << ": param "
                        << in << " -> " << bits_of(out) << ", copy " << got << ", want " << want;
        }
      }
    }
  }
}

TEST(CpuAdamConvert, InfAndNanGradientsReachTheCopyOutRoundedLikeTheParam) {
  constexpr std::size_t kN = 777;
  for (Simd simd : runnable_variants()) {
    const auto opt = make_optimizer(simd, 2, 64);
    for (Algorithm a : {Algorithm::kAdamW, Algorithm::kAdagrad, Algorithm::kLion}) {
      for (DType grad : {DType::kFp32, DType::kBf16, DType::kFp16}) {
        StepSetup setup;
        setup.hyper = random_hyper(a, false, 0.01);
        setup.grad_dtype = grad;
        setup.n = kN;
        setup.copy = DType::kBf16;
        setup.unaligned = true;
        StepProblem p(setup);
        p.fresh_grads();
        for (std::size_t i = 3; i < kN; i += 97) {
          p.grad.set(i, i % 2 == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN());
        }
        ASSERT_TRUE(opt->step(setup.hyper, {.step = 5}, p.spans()).ok());
        for (std::size_t i = 0; i < kN; ++i) {
          const float out = p.param.get_f32(i);
          ASSERT_EQ(p.param16.bits16(i), bf16_rne(out)) << simd_name(simd) << " " << algorithm_name(a) << " i=" << i;
          if (i >= 3 && (i - 3) % 97 == 0 && a != Algorithm::kLion) {
            EXPECT_TRUE(std::isnan(out)) << simd_name(simd) << " " << algorithm_name(a) << " i=" << i;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace tzt
