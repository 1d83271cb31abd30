// Private to kernels/: one Adam element update, shared by the CPU twin
// (optim_cpu.cpp) and the CUDA kernel (optim_cuda.cu) so the two run the same
// fp32 operations in the same order. Plain C++ (no CUDA headers, and of
// tierzero's only the plain state_math.h): nvcc compiles it for the device too.
#pragma once

#include <math.h>

#include <cstddef>
#include <cstdint>

#include "tierzero/common/state_math.h"

namespace tz::kernels::detail {

// AdamHyper turned into per-element fp32 factors (the bias corrections are
// computed once, in double, by the caller).
struct AdamCoef {
  float step_size = 0;        // lr / (1 - beta1^step)
  float inv_sqrt_bc2 = 1;     // 1 / sqrt(1 - beta2^step)
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0, eps = 0;
  float decay = 1;            // AdamW: 1 - lr * weight_decay
  float weight_decay = 0;     // Adam: added to the gradient as weight_decay * p
  float grad_scale = 1;
  bool adamw = true;
  bool l2 = false;            // Adam with weight_decay != 0 (the compact step's test, as cpu_adam's)
};

TZ_HOST_DEVICE inline void adam_element(float& p, float g, float& m, float& v, const AdamCoef& c) {
  g *= c.grad_scale;
  if (c.adamw) {
    p *= c.decay;
  } else {
    g += c.weight_decay * p;
  }
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  p -= c.step_size * m / (sqrtf(v) * c.inv_sqrt_bc2 + c.eps);
}

// Note [Compact Adam arithmetic]
// The compact step (adam_step_compact_*) must give cpu_adam's bits, because
// cpu_adam is what the engine's references and the state-format tests hold
// the formats to, and a checkpoint moves between the two optimizers. So it
// repeats cpu_adam's element (kernel_impl.h, step_vector), operation for
// operation:
//   g = grad * scale;  Adam: g = fma(wd, p, g)  AdamW: p = p * decay
//   m = fma(b1, m, (1-b1) g);  v = fma(b2, v, ((1-b2) g) g)
//   p = fma(-lr/bc1, m / fma(sqrt(v), 1/sqrt(bc2), eps), p)
// cpu_adam's AVX2 and AVX-512 variants fuse those fma()s; its scalar and
// SSE4.2 variants compute a multiply and an add (two roundings). The CUDA
// kernel always fuses (fmaf), so it matches the fused variants, which are
// what any GPU host runs; the CPU twin does either (CompactStep::fused), so
// it can be checked against every variant. Each operation is spelled with
// the _rn intrinsics on the device, which nvcc never contracts into an fma
// of its own; on the host the twin's source is built with -ffp-contract=off.

TZ_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

TZ_HOST_DEVICE inline float madd(float a, float b, float c, bool fused) {
#if defined(__CUDA_ARCH__)
  return fused ? __fmaf_rn(a, b, c) : __fadd_rn(__fmul_rn(a, b), c);
#else
  return fused ? fmaf(a, b, c) : a * b + c;
#endif
}

TZ_HOST_DEVICE inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

TZ_HOST_DEVICE inline float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return sqrtf(a);
#endif
}

// The int8 codes' tables of one moment (Note [Int8 moments] in
// cpu_adam/src/int8_codes.h; cpu_adam builds them, the caller passes them).
struct Int8Table {
  const float* decode = nullptr;  // (256,) the value of each code byte in units of the scale (NaN: the NaN code)
  const float* mid = nullptr;     // (256,) mid[k] between magnitudes k and k + 1; +inf past the last
  bool is_signed = false;         // exp_avg's code; exp_avg_sq's is unsigned, on sqrt(v)
};

// A run of elements [begin, end) of a call with its own weight decay: the
// AdamCoef fields that weight decay sets (adam_coef with that weight decay).
struct DecayRun {
  std::uint64_t begin = 0, end = 0;
  float decay = 1, weight_decay = 0;
  bool l2 = false;
};

// One call of the compact step: base pointers (element i is base + i) and
// what each format needs. A plain struct, passed to the CUDA kernel by value.
struct CompactStep {
  AdamCoef coef;
  bool fused = true;               // Note [Compact Adam arithmetic]
  bool remainder_master = false;   // master as param16 + remainder + tie bits
  bool bf16_moments = false;
  bool int8_moments = false;       // exp_avg, exp_avg_sq: codes; element 0 starts a 256-element block
  float* master = nullptr;         // (n,) fp32, !remainder_master
  std::uint16_t* param16 = nullptr;  // (n,) bf16: the copy-out (or null), or the master's bf16 half
  std::int16_t* remainder = nullptr; // (n,) remainder_master
  std::uint8_t* tie_bits = nullptr;  // element i's tie: bit (tie_bit_offset + i) of this array
  std::uint64_t tie_bit_offset = 0;
  const float* grad = nullptr;     // (n,) fp32
  void* exp_avg = nullptr;         // (n,) fp32, bf16 or int8 codes
  void* exp_avg_sq = nullptr;      // (n,) fp32, bf16 (stochastic rounding) or int8 codes
  std::uint32_t sr_key = 0, sr_base = 0;  // element i's random bits: sr_hash(sr_base + i, sr_key) >> 16
  float* exp_avg_scale = nullptr;     // (ceil(n / 256),) int8 moments' block scales
  float* exp_avg_sq_scale = nullptr;
  Int8Table exp_avg_code, exp_avg_sq_code;
  const DecayRun* runs = nullptr;  // sorted, disjoint; host memory for the twin, device memory in the kernel
  std::uint32_t run_count = 0;
};

// Element i's coefficients: the call's, or its weight-decay run's.
TZ_HOST_DEVICE inline AdamCoef coef_at(const CompactStep& s, std::uint64_t i) {
  AdamCoef c = s.coef;
  std::uint32_t lo = 0, hi = s.run_count;  // the first run that ends after i
  while (lo < hi) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (s.runs[mid].end <= i) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo < s.run_count && s.runs[lo].begin <= i) {
    c.decay = s.runs[lo].decay;
    c.weight_decay = s.runs[lo].weight_decay;
    c.l2 = s.runs[lo].l2;
  }
  return c;
}

TZ_HOST_DEVICE inline float load_moment(const void* base, std::size_t i, bool bf16) {
  return bf16 ? state_math::bf16_to_float(static_cast<const std::uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
}

// Steps element i's master with its moments m and v (updated in place, in
// fp32: the caller loads and stores them in their format). `tie` is its tie
// bit (remainder masters; false otherwise); returns the new one. The caller
// reads and writes the packed tie bits.
TZ_HOST_DEVICE inline bool adam_compact_update(const CompactStep& s, std::size_t i, float& m, float& v, bool tie) {
  namespace sm = state_math;
  const AdamCoef c = coef_at(s, i);
  float p = s.remainder_master ? sm::join_master(s.param16[i], s.remainder[i], tie) : s.master[i];
  float g = mul_rn(s.grad[i], c.grad_scale);
  if (c.l2) {
    g = madd(c.weight_decay, p, g, s.fused);
  } else {
    p = mul_rn(p, c.decay);
  }
  m = madd(c.beta1, m, mul_rn(c.one_minus_beta1, g), s.fused);
  v = madd(c.beta2, v, mul_rn(mul_rn(c.one_minus_beta2, g), g), s.fused);
  const float denom = madd(sqrt_rn(v), c.inv_sqrt_bc2, c.eps, s.fused);
  p = madd(-c.step_size, div_rn(m, denom), p, s.fused);
  if (s.remainder_master) {
    const sm::SplitMaster split = sm::split_master(p);
    s.param16[i] = split.bf16;
    s.remainder[i] = split.remainder;
    return split.tie;
  }
  s.master[i] = p;
  if (s.param16 != nullptr) s.param16[i] = sm::float_to_bf16(p);
  return false;
}

// Steps element i with fp32 or bf16 moments (int8 moments step by block:
// int8_math.h).
TZ_HOST_DEVICE inline bool adam_compact_element(const CompactStep& s, std::size_t i, bool tie) {
  namespace sm = state_math;
  float m = load_moment(s.exp_avg, i, s.bf16_moments);
  float v = load_moment(s.exp_avg_sq, i, s.bf16_moments);
  tie = adam_compact_update(s, i, m, v, tie);
  if (s.bf16_moments) {
    static_cast<std::uint16_t*>(s.exp_avg)[i] = sm::float_to_bf16(m);
    static_cast<std::uint16_t*>(s.exp_avg_sq)[i] =
        sm::float_to_bf16_stochastic(v, sm::sr_hash(s.sr_base + static_cast<std::uint32_t>(i), s.sr_key) >> 16);
  } else {
    static_cast<float*>(s.exp_avg)[i] = m;
    static_cast<float*>(s.exp_avg_sq)[i] = v;
  }
  return tie;
}

}  // namespace tz::kernels::detail
