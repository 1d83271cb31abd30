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

namespace tz::cpu_adam::detail {

inline std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

inline float bits_float(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

inline float bf16_to_float(std::uint16_t h) { return bits_float(static_cast<std::uint32_t>(h) << 16); }

inline std::uint16_t float_to_bf16(float x) {
  const std::uint32_t u = float_bits(x);
  if ((u & 0x7fffffffU) > 0x7f800000U) return static_cast<std::uint16_t>((u >> 16) | 0x0040U);
  // Ties to even: add 0x7fff plus the lowest kept bit; a carry into the
  // exponent is the correct rounding up (to infinity past the largest finite).
  return static_cast<std::uint16_t>((u + 0x7fffU + ((u >> 16) & 1U)) >> 16);
}

// bf16 by stochastic rounding: the 16 random bits are added below the bf16's
// last bit and the sum truncated, so x rounds away from zero with probability
// (its distance past the lower bf16) / (one bf16 step): unbiased. NaN as
// float_to_bf16; an inf stays inf (its low half is zero).
inline std::uint16_t float_to_bf16_stochastic(float x, std::uint32_t random16) {
  if (x != x) return float_to_bf16(x);
  return static_cast<std::uint16_t>((float_bits(x) + random16) >> 16);
}

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
