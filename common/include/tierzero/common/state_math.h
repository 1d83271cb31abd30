// tierzero/common/state_math.h: the per-element arithmetic of the compact
// state formats (tierzero/common/state_format.h), written once for the two
// optimizers that store them: cpu_adam's scalar kernels and conversions, and
// the kernels module's compact Adam step (its CPU twin and its CUDA kernel).
//
//   bf16 round to nearest even     float_to_bf16          (NaN: (bits >> 16) | 0x40, quiet)
//   bf16 stochastic rounding       float_to_bf16_stochastic, with sr_hash's bits
//   remainder masters              split_master / join_master
//
// Plain C++ with no tierzero or CUDA headers: nvcc compiles it for the device
// too (TZ_HOST_DEVICE), and the host pass of a .cu file can include it. The
// SIMD kernels of cpu_adam do the same bit manipulations lane-wise in their
// own vector code (cpu_adam/src/simd_ops.h); tests/cpu_adam check every
// variant against these, bit for bit.
//
// Note [One object per instruction set] (cpu_adam/src/kernel_impl.h) applies:
// these are inline functions, so only baseline-ISA code may call them.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TZ_HOST_DEVICE __host__ __device__
#else
#define TZ_HOST_DEVICE
#endif

namespace tz::state_math {

TZ_HOST_DEVICE inline std::uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

TZ_HOST_DEVICE inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

TZ_HOST_DEVICE inline float bf16_to_float(std::uint16_t h) { return bits_float(static_cast<std::uint32_t>(h) << 16); }

TZ_HOST_DEVICE inline bool is_nan_bits(std::uint32_t u) { return (u & 0x7fffffffU) > 0x7f800000U; }

// Round to nearest even on the bit pattern. NaN keeps its sign and top
// payload bits and is made quiet.
TZ_HOST_DEVICE inline std::uint16_t float_to_bf16(float x) {
  const std::uint32_t u = float_bits(x);
  if (is_nan_bits(u)) return static_cast<std::uint16_t>((u >> 16) | 0x0040U);
  // Ties to even: add 0x7fff plus the lowest kept bit; a carry into the
  // exponent is the correct rounding up (to infinity past the largest finite).
  return static_cast<std::uint16_t>((u + 0x7fffU + ((u >> 16) & 1U)) >> 16);
}

// bf16 by stochastic rounding: the 16 random bits are added below the bf16's
// last bit and the sum truncated, so x rounds away from zero with probability
// (its distance past the lower bf16) / (one bf16 step): unbiased. NaN as
// float_to_bf16; an inf stays inf (its low half is zero).
TZ_HOST_DEVICE inline std::uint16_t float_to_bf16_stochastic(float x, std::uint32_t random16) {
  if (is_nan_bits(float_bits(x))) return float_to_bf16(x);
  return static_cast<std::uint16_t>((float_bits(x) + random16) >> 16);
}

// The stochastic-rounding hash (Note [Stochastic rounding of bf16 second
// moments] in tierzero/cpu_adam.h): a multiply to spread consecutive indices,
// then murmur3's 32-bit finalizer (a bijection that mixes every input bit into
// every output bit). Its high 16 bits are the rounding's random bits.
TZ_HOST_DEVICE constexpr std::uint32_t sr_mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bU;
  x ^= x >> 13;
  x *= 0xc2b2ae35U;
  x ^= x >> 16;
  return x;
}
TZ_HOST_DEVICE constexpr std::uint32_t sr_hash(std::uint32_t index, std::uint32_t key) {
  return sr_mix32((index * 0x9e3779b1U) ^ key);
}

// The key of one step of one span (cpu_adam's Spans::rounding_key and
// rounding_index, the 1-based step): it folds in the tensor, the step and the
// index's high half; element i of the span then takes
// sr_hash(uint32(rounding_index) + i, key). Every optimizer that stores bf16
// second moments derives its bits here, so they round alike.
constexpr std::uint32_t sr_step_key(std::uint64_t rounding_key, std::int64_t step, std::uint64_t rounding_index) {
  const auto lo = [](std::uint64_t x) { return static_cast<std::uint32_t>(x); };
  return sr_mix32(lo(rounding_key) ^
                  sr_mix32(lo(rounding_key >> 32) ^ sr_mix32(lo(static_cast<std::uint64_t>(step)) ^
                                                             sr_mix32(lo(rounding_index >> 32) + 0x632be5abU))));
}

// Note [Remainder masters] (cpu_adam/src/remainder.h): an fp32 master as its
// bf16 parameter, an int16 remainder and a tie bit.
inline constexpr std::uint32_t kTieStep = 0x10000;  // what a set tie bit adds to the rebuilt bits
inline constexpr std::uint32_t kTie = 0x8000;       // d of the tie above an even h

struct SplitMaster {
  std::uint16_t bf16 = 0;
  std::int16_t remainder = 0;
  bool tie = false;
};

TZ_HOST_DEVICE inline SplitMaster split_master(float master) {
  const std::uint32_t bits = float_bits(master);
  const std::uint16_t h = float_to_bf16(master);
  if (is_nan_bits(bits)) return {h, 0, false};
  const std::uint32_t d = bits - (static_cast<std::uint32_t>(h) << 16);
  return {h, static_cast<std::int16_t>(static_cast<std::uint16_t>(d)), d == kTie};
}

TZ_HOST_DEVICE inline float join_master(std::uint16_t bf16, std::int16_t remainder, bool tie) {
  return bits_float((static_cast<std::uint32_t>(bf16) << 16) +
                    static_cast<std::uint32_t>(static_cast<std::int32_t>(remainder)) + (tie ? kTieStep : 0U));
}

}  // namespace tz::state_math
