// Private to kernels/: the int8 moments' per-element arithmetic (Note [Int8
// moments] in cpu_adam/src/int8_codes.h), shared by the CPU twin
// (optim_cpu.cpp) and the CUDA kernel (optim_cuda.cu) as adam_math.h is.
//
// Note [Int8 moments on the GPU]
// cpu_adam steps int8 moments block by block: decode the block's 256 codes
// with its scale, run the fp32-moment step on the decoded values, encode them
// back with the block's new scale (Note [Int8 block steps] in
// cpu_adam/src/optimizer.cpp). The compact step does the same with the same
// operations, so its codes and scales are cpu_adam's bit for bit:
//   decode  decode[code] * scale, squared for exp_avg_sq (its levels are of
//           sqrt(v)); two correctly rounded multiplies.
//   scale   the largest finite |x| of the block (exp_avg_sq: sqrt of the
//           largest finite v, sqrt being monotone), 0 when none. max is exact
//           and order-independent, so a tree of warp shuffles finds the value
//           cpu_adam's loops (scalar, AVX2, AVX-512) find.
//   encode  y = |x| / scale (sqrt(|x|) / scale), the code is the number of
//           midpoints below y: cpu_adam's bucket table with two comparisons
//           and its AVX-512 search in registers count the same (Note [Int8
//           codes in registers]). Here a binary search over the 256
//           midpoints (+inf past the last level: never below a finite y),
//           eight comparisons. Then cpu_adam's rules (int8_code_of in
//           cpu_adam/src/kernel_impl.h): inf and NaN get the NaN code, a
//           negative x with a non-zero magnitude sets the sign bit, a positive
//           v is never coded 0.
// The tables are cpu_adam's (tz::cpu_adam::int8_code_tables), passed by
// pointer: kernels/ does not depend on cpu_adam, and the GPU reads a copy the
// engine uploads once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "adam_math.h"

namespace tz::kernels::detail {

inline constexpr std::size_t kInt8BlockNumel = 256;  // tz::kInt8MomentBlockNumel (checked in optim_coef.h)

TZ_HOST_DEVICE inline float int8_decode(const Int8Table& t, std::uint8_t code, float scale) {
  const float x = mul_rn(t.decode[code], scale);
  return t.is_signed ? x : mul_rn(x, x);
}

// |x| when finite, else 0: a candidate for the block's scale.
TZ_HOST_DEVICE inline float int8_finite_abs(float x) {
  const float ax = fabsf(x);
  return ax <= 3.40282347e+38F ? ax : 0.0F;
}

TZ_HOST_DEVICE inline float int8_max(float a, float b) { return b > a ? b : a; }

// The block's scale from the largest finite |x| of its elements.
TZ_HOST_DEVICE inline float int8_scale(const Int8Table& t, float amax) { return t.is_signed ? amax : sqrt_rn(amax); }

// x's code in a block of scale `scale`.
TZ_HOST_DEVICE inline std::uint8_t int8_encode(const Int8Table& t, float x, float scale) {
  const float ax = fabsf(x);
  if (!(ax <= 3.40282347e+38F)) return t.is_signed ? 0x80U : 0xffU;  // inf, NaN
  const float y = div_rn(t.is_signed ? ax : sqrt_rn(ax), scale > 0.0F ? scale : 1.0F);
  std::uint32_t k = 0;  // the number of midpoints below y
  for (std::uint32_t half = kInt8BlockNumel / 2; half > 0; half /= 2) {
    if (t.mid[k + half - 1] < y) k += half;
  }
  if (!t.is_signed) return static_cast<std::uint8_t>(k == 0 && y > 0.0F ? 1U : k);
  return static_cast<std::uint8_t>(x < 0.0F && k != 0 ? (0x80U | k) : k);
}

}  // namespace tz::kernels::detail
