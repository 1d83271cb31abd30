// The int8 moment codes' tables (Note [Int8 moments] in int8_codes.h).
//
// Note [Int8 second moment]
// exp_avg_sq is non-negative and spans many decades inside one block (v ~ g^2:
// a gradient range of 10^4 is 10^8 of v), and the step reads it only as
// sqrt(v) in the denominator. Measured (bench/int8_moment_codes.py, output in
// bench/results/int8_moment_codes.txt, bench/RESULTS.md "Int8 block-wise
// moments"), with exp_avg in its signed code throughout, over 300 Adam steps on
// 16384 parameters with gradient scales over 4 decades, against float64 Adam
// without quantization (relative error of each step's update; of the
// parameters at the end), and by a small MLP's loss after 300 AdamW steps:
//   code on v, positive v never 0      update error 0.378 (max 0.404), params 0.328, loss +1.73%
//   code on v, nearest (v may be 0)    update error 90 (max 560), params 22.5, loss +1.72%
//   code on sqrt(v), never 0 (chosen)  update error 0.215 (max 0.231), params 0.136, loss +1.67%
// The code on sqrt(v) has half the error of the code on v: its 8 decades of
// sqrt(v) cover 16 of v, and its relative steps in sqrt(v) are half those in
// v. A small positive v coded 0 under a non-zero m divides by eps, hence the
// never-zero rule. The remaining error is mostly exp_avg's code.
#include "int8_codes.h"

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

namespace tz::cpu_adam::detail {
namespace {

// Magnitudes in [0, 1]: 0, then decades of 2^d levels from the lowest up
// (d = 0 .. decades - 1; the top decade reaches 10^0), each decade's levels
// spaced evenly over its upper 90% and ending at the decade's top. The top
// decade may hold fewer (top_levels).
std::vector<double> dynamic_magnitudes(int decades, int top_levels) {
  std::vector<double> out{0.0};
  for (int d = 0; d < decades; ++d) {
    const int levels = d == decades - 1 ? top_levels : 1 << d;
    const double top = std::pow(10.0, d - (decades - 1));
    for (int j = 1; j <= levels; ++j) out.push_back(top * (0.1 + 0.9 * j / levels));
  }
  return out;
}

void fail(const char* what) {
  std::fprintf(stderr, "tierzero cpu_adam: int8 code tables: %s\n", what);
  std::abort();
}

// Note [Int8 codes in registers]: with the midpoints padded by +inf to N
// entries, round r's candidate for index i (the outcome of rounds 0..r-1 as
// bits, first round highest) is the midpoint in the middle of i's part,
// mid[(2i + 1) * N / 2^(r+1) - 1].
void build_search(Int8Code& c) {
  const std::uint32_t n = c.is_signed ? 128 : 256;
  c.search_rounds = c.is_signed ? 7 : 8;
  const float inf = std::numeric_limits<float>::infinity();
  for (float& x : c.search) x = inf;
  for (std::uint32_t r = 0; r < c.search_rounds; ++r) {
    const std::uint32_t half = n >> (r + 1);
    for (std::uint32_t i = 0; i < (1U << r); ++i) {
      const std::uint32_t k = (2 * i + 1) * half - 1;
      c.search[kInt8SearchOffset[r] + i] = k < 256 ? c.mid[k] : inf;
    }
  }
  for (std::uint32_t k = c.magnitudes - 1; k < n; ++k) {
    if (c.mid[k] != inf) fail("a midpoint past the last level");
  }
}

Int8Code build(bool is_signed, bool on_sqrt) {
  Int8Code c;
  c.is_signed = is_signed;
  c.on_sqrt = on_sqrt;
  const std::vector<double> mags = is_signed ? dynamic_magnitudes(7, 64) : dynamic_magnitudes(8, 127);
  c.magnitudes = static_cast<std::uint32_t>(mags.size());
  c.nan_code = is_signed ? 0x80 : 0xff;
  if (mags.size() != (is_signed ? 128U : 255U) || static_cast<float>(mags.back()) != 1.0f) fail("level count");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float& x : c.decode) x = nan;
  for (std::size_t k = 0; k < mags.size(); ++k) {
    c.decode[k] = static_cast<float>(mags[k]);
    if (is_signed) c.decode[0x80 | k] = k == 0 ? nan : -static_cast<float>(mags[k]);
  }
  for (float& x : c.mid) x = std::numeric_limits<float>::infinity();
  for (std::size_t k = 0; k + 1 < mags.size(); ++k) {
    // The exact midpoint of the fp32 levels, rounded down to fp32: for an
    // fp32 y, y > mid[k] exactly when y is past the true midpoint (ties, only
    // possible when the midpoint is an fp32 value, stay with the lower level).
    const double exact = (static_cast<double>(c.decode[k]) + static_cast<double>(c.decode[k + 1])) / 2;
    c.mid[k] = static_cast<float>(exact);
    if (static_cast<double>(c.mid[k]) > exact) c.mid[k] = std::nextafter(c.mid[k], 0.0f);
    if (!(c.mid[k] > c.decode[k] && c.mid[k] < c.decode[k + 1])) fail("levels not increasing in fp32");
  }
  // bucket[i]: the number of midpoints below the bucket's lowest y (the code
  // of that y); at most two more midpoints inside the bucket.
  for (std::uint32_t i = 0; i < kBucketCount; ++i) {
    const float lo = i == 0 ? 0.0f : std::bit_cast<float>((kBucketKey0 + i) << 16);
    const float hi = std::bit_cast<float>((kBucketKey0 + i + 1) << 16);
    std::uint32_t below = 0, inside = 0;
    for (std::uint32_t k = 0; k + 1 < mags.size(); ++k) {
      if (c.mid[k] < lo) ++below;
      else if (c.mid[k] < hi) ++inside;
    }
    if (inside > 2) fail("more than two midpoints in a bucket");
    c.bucket[i] = static_cast<std::uint8_t>(below);
  }
  build_search(c);
  return c;
}

}  // namespace

const Int8Code& int8_code_exp_avg() {
  static const Int8Code code = build(true, false);
  return code;
}

const Int8Code& int8_code_exp_avg_sq() {
  static const Int8Code code = build(false, true);
  return code;
}

}  // namespace tz::cpu_adam::detail
