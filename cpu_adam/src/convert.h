// Scalar 16-bit <-> fp32 conversions for the scalar kernels. The SIMD
// variants do the same bit manipulations lane-wise (simd_ops.h), so every
// variant produces the same bits:
//   bf16: round to nearest even; NaN keeps its sign and top payload bits and
//         is made quiet ((bits >> 16) | 0x40), as tz::kernels::fp32_to_bf16.
//   fp16: round to nearest even, overflow to +-inf; NaN keeps its sign and
//         top payload bits and is made quiet, as F16C's vcvtps2ph does.
// Exact for bf16/fp16 -> fp32 (subnormal halves included).
//
// Only the scalar kernel object (baseline flags) and baseline code use these;
// the per-ISA objects never call them, so no copy built with wider
// instructions can be picked by the linker for baseline callers.
#pragma once

#include <cstdint>
#include <cstring>

#include "tierzero/common/state_math.h"

namespace tz::cpu_adam::detail {

// bf16 rounding (both ways) and the bit casts are the shared per-element
// math of the compact formats (tierzero/common/state_math.h).
using state_math::bf16_to_float;
using state_math::bits_float;
using state_math::float_bits;
using state_math::float_to_bf16;
using state_math::float_to_bf16_stochastic;

// Half -> float: shift exponent and mantissa into place and rebias; infinity
// and NaN get the full fp32 exponent, subnormal halves are renormalised by one
// exact fp32 subtraction (both operands and the result are normal floats).
inline float fp16_to_float(std::uint16_t h) {
  constexpr std::uint32_t kShiftedExp = 0x7c00U << 13;
  std::uint32_t o = (static_cast<std::uint32_t>(h) & 0x7fffU) << 13;
  const std::uint32_t exp = o & kShiftedExp;
  o += (127U - 15U) << 23;
  if (exp == kShiftedExp) {
    o += (128U - 16U) << 23;
  } else if (exp == 0) {
    o = float_bits(bits_float(o + (1U << 23)) - bits_float(113U << 23));
  }
  return bits_float(o | ((static_cast<std::uint32_t>(h) & 0x8000U) << 16));
}

// Float -> half, round to nearest even. Results below the normal half range
// come from one fp32 addition of a magic constant, which rounds to even in
// the default rounding mode; the rest by integer rounding of the bits.
inline std::uint16_t float_to_fp16(float x) {
  constexpr std::uint32_t kF16Max = (127U + 16U) << 23;               // 65536.0f: inf from here on
  constexpr std::uint32_t kDenormMagic = ((127U - 15U) + (23U - 10U) + 1U) << 23;
  std::uint32_t u = float_bits(x);
  const std::uint32_t sign = u & 0x80000000U;
  u ^= sign;
  std::uint32_t o;
  if (u >= kF16Max) {
    o = u > 0x7f800000U ? (0x7e00U | ((u >> 13) & 0x3ffU)) : 0x7c00U;
  } else if (u < (113U << 23)) {
    o = float_bits(bits_float(u) + bits_float(kDenormMagic)) - kDenormMagic;
  } else {
    const std::uint32_t mant_odd = (u >> 13) & 1U;
    u += (static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffU + mant_odd;
    o = u >> 13;
  }
  return static_cast<std::uint16_t>(o | (sign >> 16));
}

}  // namespace tz::cpu_adam::detail
