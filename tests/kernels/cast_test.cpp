// fp32 -> bf16/fp16 casts: the CPU twins against an independent reference
// (nearest representable value found in double precision, ties to even), and
// the CUDA kernels against the CPU twins bit for bit where a GPU is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "tierzero/kernels.h"
#if defined(TIERZERO_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace tz::kernels {
namespace {

// Exact value of a bf16 / fp16 bit pattern, decoded by formula (not by the code under test).
double decode(std::uint16_t bits, int exp_bits, int man_bits) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const int sign = bits >> (exp_bits + man_bits);
  const int exponent = (bits >> man_bits) & ((1 << exp_bits) - 1);
  const int mantissa = bits & ((1 << man_bits) - 1);
  double magnitude;
  if (exponent == (1 << exp_bits) - 1) {
    magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa, 1 - bias - man_bits);
  } else {
    magnitude = std::ldexp(mantissa + (1 << man_bits), exponent - bias - man_bits);
  }
  return sign ? -magnitude : magnitude;
}

// All finite non-negative values of a format, sorted, with their bit patterns.
std::vector<std::pair<double, std::uint16_t>> finite_values(int exp_bits, int man_bits) {
  std::vector<std::pair<double, std::uint16_t>> values;
  const int max_positive = ((1 << (exp_bits - 1 + 1)) - 1) << man_bits;  // the +inf pattern
  for (int b = 0; b < max_positive; ++b) values.emplace_back(decode(static_cast<std::uint16_t>(b), exp_bits, man_bits), b);
  return values;
}

// Round-to-nearest-even by search: the reference the twins must match.
std::uint16_t reference_round(float x, const std::vector<std::pair<double, std::uint16_t>>& table, int exp_bits,
                              int man_bits) {
  const std::uint16_t sign = std::signbit(x) ? static_cast<std::uint16_t>(1U << (exp_bits + man_bits)) : 0;
  const double a = std::fabs(static_cast<double>(x));
  const std::uint16_t inf = static_cast<std::uint16_t>(((1 << exp_bits) - 1) << man_bits);
  if (std::isinf(a)) return sign | inf;
  const double max_finite = table.back().first;
  const double half_ulp_above = (max_finite - table[table.size() - 2].first) / 2;
  if (a >= max_finite + half_ulp_above) return sign | inf;  // rounds past the largest finite value
  auto hi = std::lower_bound(table.begin(), table.end(), std::make_pair(a, std::uint16_t{0}));
  if (hi == table.end()) return sign | table.back().second;
  if (hi->first == a || hi == table.begin()) return sign | hi->second;
  auto lo = hi - 1;
  const double dlo = a - lo->first, dhi = hi->first - a;
  if (dlo < dhi) return sign | lo->second;
  if (dhi < dlo) return sign | hi->second;
  return sign | ((lo->second & 1) == 0 ? lo->second : hi->second);
}

std::vector<float> fresh_inputs(std::size_t n, float scale) {
  std::mt19937 rng(std::random_device{}());
  std::vector<float> v(n);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::normal_distribution<float> normal(0.0F, scale);
  for (std::size_t i = 0; i < n; ++i) {
    if (i % 4 == 0) {
      // Arbitrary finite bit patterns: every exponent, subnormals included.
      float f;
      do f = std::bit_cast<float>(any_bits(rng)); while (!std::isfinite(f));
      v[i] = f;
    } else {
      v[i] = normal(rng);
    }
  }
  // Ties, overflow edges, signed zero.
  for (float edge : {0.0F, -0.0F, 1.0F + 0x1p-8F, 1.0F + 3 * 0x1p-8F, 65504.0F, 65519.99F, 65520.0F, -70000.0F,
                     std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min()}) {
    v.push_back(edge);
  }
  return v;
}

TEST(Cast, Bf16TwinMatchesReference) {
  const auto table = finite_values(8, 7);
  const std::vector<float> in = fresh_inputs(200'000, 3.0F);
  std::vector<std::uint16_t> out(in.size());
  cast_fp32_to_bf16_cpu(in.data(), out.data(), in.size());
  std::size_t mismatches = 0;
  double max_rel_err = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const std::uint16_t want = reference_round(in[i], table, 8, 7);
    if (out[i] != want && ++mismatches < 5) ADD_FAILURE() << "x=" << in[i] << " got " << out[i] << " want " << want;
    if (std::isfinite(bf16_to_fp32(out[i])) && in[i] != 0 && std::fabs(in[i]) > 1e-30F) {
      max_rel_err = std::max(max_rel_err, std::fabs((bf16_to_fp32(out[i]) - in[i]) / static_cast<double>(in[i])));
    }
  }
  EXPECT_EQ(mismatches, 0u);
  EXPECT_LE(max_rel_err, 0x1p-8);  // half an ulp of an 8-bit significand
  std::printf("bf16: %zu values, max relative error %.3g (bound %.3g)\n", in.size(), max_rel_err, 0x1p-8);
}

TEST(Cast, Fp16TwinMatchesReference) {
  const auto table = finite_values(5, 10);
  const std::vector<float> in = fresh_inputs(200'000, 100.0F);
  std::vector<std::uint16_t> out(in.size());
  cast_fp32_to_fp16_cpu(in.data(), out.data(), in.size());
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const std::uint16_t want = reference_round(in[i], table, 5, 10);
    if (out[i] != want && ++mismatches < 5) ADD_FAILURE() << "x=" << in[i] << " got " << out[i] << " want " << want;
  }
  EXPECT_EQ(mismatches, 0u);
  std::printf("fp16: %zu values checked against the nearest-even reference\n", in.size());
}

TEST(Cast, NanStaysNanAndInfinityStaysInfinity) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(nan))));
  EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(std::bit_cast<float>(0x7f800001U)))));  // signalling NaN
  EXPECT_TRUE(std::isnan(fp16_to_fp32(fp32_to_fp16(nan))));
  EXPECT_EQ(bf16_to_fp32(fp32_to_bf16(-inf)), -inf);
  EXPECT_EQ(fp16_to_fp32(fp32_to_fp16(inf)), inf);
  EXPECT_EQ(fp16_to_fp32(fp32_to_fp16(1e6F)), inf);  // overflow
}

TEST(Cast, CudaKernelsMatchTheCpuTwins) {
#if !defined(TIERZERO_WITH_CUDA)
  GTEST_SKIP() << "built without CUDA (-DTIERZERO_CUDA=OFF)";
#else
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    const char* why = cudaGetErrorString(cudaGetLastError());
    GTEST_SKIP() << "no CUDA device: " << why;
  }
  std::vector<float> in = fresh_inputs(1 << 22, 10.0F);
  for (float special : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                        std::bit_cast<float>(0x7f800001U), std::numeric_limits<float>::infinity(),
                        -std::numeric_limits<float>::infinity()}) {
    in.push_back(special);
  }
  const std::size_t n = in.size();
  float* d_in = nullptr;
  std::uint16_t* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_in, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, n * sizeof(std::uint16_t)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_in, in.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  std::vector<std::uint16_t> gpu(n), cpu(n);
  for (bool bf16 : {true, false}) {
    Status s = bf16 ? cast_fp32_to_bf16_cuda(d_in, d_out, n, nullptr) : cast_fp32_to_fp16_cuda(d_in, d_out, n, nullptr);
    ASSERT_TRUE(s.ok()) << s.to_string();
    ASSERT_EQ(cudaMemcpy(gpu.data(), d_out, n * sizeof(std::uint16_t), cudaMemcpyDeviceToHost), cudaSuccess);
    if (bf16) cast_fp32_to_bf16_cpu(in.data(), cpu.data(), n);
    else cast_fp32_to_fp16_cpu(in.data(), cpu.data(), n);
    // Bit for bit, except that a NaN only has to stay a NaN (payloads differ).
    auto is_nan = [bf16](std::uint16_t v) { return bf16 ? std::isnan(bf16_to_fp32(v)) : std::isnan(fp16_to_fp32(v)); };
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < n; ++i) {
      mismatches += is_nan(cpu[i]) ? !is_nan(gpu[i]) : gpu[i] != cpu[i];
    }
    EXPECT_EQ(mismatches, 0u) << (bf16 ? "bf16" : "fp16");
  }
  cudaFree(d_in);
  cudaFree(d_out);
#endif
}

}  // namespace
}  // namespace tz::kernels
