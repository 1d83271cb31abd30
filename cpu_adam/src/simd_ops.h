// The vector operations the kernels are written in, one "Ops" type per
// instruction set. Arithmetic goes through xsimd; the 16-bit conversions,
// which xsimd 8 does not provide, through the matching intrinsics:
//   AVX-512  vpmovzxwd/vcvtph2ps in, vpmovdw/vcvtps2ph out (16 lanes)
//   AVX2     vpmovzxwd/F16C in, packusdw/F16C out (8 lanes)
//   SSE4.2   pmovzxwd in, packusdw out, fp16 by integer bit manipulation (4 lanes)
//   scalar   convert.h (1 lane)
// Every variant rounds bf16 and fp16 the same way (see convert.h), so the
// copy-out bits do not depend on the variant. The remainder masters (Note
// [Remainder masters]) are split and joined in 32-bit integer lanes with
// xsimd's integer batches; their bf16 rounding is the copy-out's, and their
// 16-bit loads and stores and tie-bit masks use intrinsics (xsimd 8 has no
// widening loads, narrowing stores or mask-to-bits).
//
// Included only by kernel_impl.h, in a translation unit built for one
// instruction set; the intrinsics of the others are compiled out by the
// compiler's ISA macros.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "convert.h"
#include "kernel_api.h"
#include "remainder.h"

#if !defined(TZ_ADAM_SCALAR_ONLY)
#include <immintrin.h>

#include <xsimd/xsimd.hpp>
#endif

#define TZ_ADAM_INLINE [[gnu::always_inline]] inline

namespace tz::cpu_adam::detail {

// The plain loop. V is a float, so the kernels read as scalar code here; the
// compiler may still vectorise them for the baseline ISA.
struct ScalarOps {
  using V = float;
  static constexpr std::size_t kLanes = 1;
  static constexpr bool kStream = false;  // no non-temporal 16-bit stores

  TZ_ADAM_INLINE static V splat(float x) { return x; }
  TZ_ADAM_INLINE static V load(const float* p) { return *p; }
  TZ_ADAM_INLINE static void store(float* p, V x) { *p = x; }
  TZ_ADAM_INLINE static V load_bf16(const std::uint16_t* p) { return bf16_to_float(*p); }
  TZ_ADAM_INLINE static V load_fp16(const std::uint16_t* p) { return fp16_to_float(*p); }
  TZ_ADAM_INLINE static void store_bf16(std::uint16_t* p, V x) { *p = float_to_bf16(x); }
  TZ_ADAM_INLINE static void store_fp16(std::uint16_t* p, V x) { *p = float_to_fp16(x); }
  TZ_ADAM_INLINE static V fma(V a, V b, V c) { return a * b + c; }
  TZ_ADAM_INLINE static V sqrt(V a) { return __builtin_sqrtf(a); }
  // NaN in b wins, as in the vector variants (maxps returns its second operand).
  TZ_ADAM_INLINE static V max(V a, V b) { return a > b ? a : b; }
  // torch.sign: -1, +-0 or 1; NaN stays NaN.
  TZ_ADAM_INLINE static V sign(V c) { return c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : c); }
  TZ_ADAM_INLINE static double sum_lanes(V x) { return static_cast<double>(x); }
  TZ_ADAM_INLINE static void fence() {}
  // Note [Remainder masters]; the tie is bit 0 of `ties`, and of the result.
  TZ_ADAM_INLINE static V load_master(const std::uint16_t* h, const std::int16_t* r, std::uint32_t ties) {
    return join_master(*h, *r, (ties & 1U) != 0);
  }
  TZ_ADAM_INLINE static std::uint32_t store_master(std::uint16_t* h, std::int16_t* r, V x) {
    const SplitMaster split = split_master(x);
    *h = split.bf16;
    *r = split.remainder;
    return split.tie ? 1U : 0U;
  }
};

#if !defined(TZ_ADAM_SCALAR_ONLY)

// Lane k of a tie-bit vector tests bit k (Note [Remainder masters]).
alignas(64) inline constexpr std::uint32_t kLaneBits[16] = {1U << 0,  1U << 1,  1U << 2,  1U << 3, 1U << 4,  1U << 5,
                                                            1U << 6,  1U << 7,  1U << 8,  1U << 9, 1U << 10, 1U << 11,
                                                            1U << 12, 1U << 13, 1U << 14, 1U << 15};

// 16-bit conversions, loads and stores per architecture. Specialised below
// for the ISA this translation unit is compiled for. bf16_lanes rounds to
// bf16 in the low halves of 32-bit lanes (convert.h's recipe lane-wise), for
// the copy-out and the remainder masters alike; load_u16/load_i16 widen to
// 32-bit lanes (zero-, sign-extended); store_halves stores the high and the
// low halves of the lanes to two arrays; mask_bits packs a lane mask to bit k
// for lane k. (The rounding is written in intrinsics, not in xsimd's integer
// batches: those made every kernel object a quarter slower to compile.)
template <class A>
struct Cvt;

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <>
struct Cvt<xsimd::avx512bw> {
  using V = xsimd::batch<float, xsimd::avx512bw>;
  static constexpr bool kStream = true;
  TZ_ADAM_INLINE static __m256i load16(const std::uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  TZ_ADAM_INLINE static V load_bf16(const std::uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(load_u16(p), 16));
  }
  TZ_ADAM_INLINE static V load_fp16(const std::uint16_t* p) { return _mm512_cvtph_ps(load16(p)); }
  TZ_ADAM_INLINE static __m512i load_u16(const std::uint16_t* p) { return _mm512_cvtepu16_epi32(load16(p)); }
  TZ_ADAM_INLINE static __m512i load_i16(const std::int16_t* p) {
    return _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // vpmovdw keeps the low halves.
  TZ_ADAM_INLINE static void store_halves(std::uint16_t* hi, std::int16_t* lo, __m512i x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), _mm512_cvtepi32_epi16(x));
  }
  TZ_ADAM_INLINE static std::uint32_t mask_bits(const xsimd::batch_bool<std::uint32_t, xsimd::avx512bw>& b) {
    return static_cast<__mmask16>(b);
  }
  TZ_ADAM_INLINE static __m512i bf16_lanes(const V& x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(bits, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  }
  // 16 bf16 values, rounded to nearest even.
  TZ_ADAM_INLINE static __m256i bf16(const V& x) { return _mm512_cvtepi32_epi16(bf16_lanes(x)); }
  TZ_ADAM_INLINE static __m256i fp16(const V& x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  TZ_ADAM_INLINE static void store_bf16(std::uint16_t* p, const V& x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16(x));
  }
  TZ_ADAM_INLINE static void store_fp16(std::uint16_t* p, const V& x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), fp16(x));
  }
  // One 64-byte line (2 vectors) with non-temporal stores; p is 64-byte aligned.
  template <DType D>
  TZ_ADAM_INLINE static void stream_line(std::uint16_t* p, const V* x) {
    for (int k = 0; k < 2; ++k) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p) + k, D == DType::kBf16 ? bf16(x[k]) : fp16(x[k]));
    }
  }
};
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
template <>
struct Cvt<xsimd::fma3<xsimd::avx2>> {
  using V = xsimd::batch<float, xsimd::fma3<xsimd::avx2>>;
  static constexpr bool kStream = true;
  TZ_ADAM_INLINE static __m128i load16(const std::uint16_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  TZ_ADAM_INLINE static V load_bf16(const std::uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(load_u16(p), 16));
  }
  TZ_ADAM_INLINE static V load_fp16(const std::uint16_t* p) { return _mm256_cvtph_ps(load16(p)); }
  TZ_ADAM_INLINE static __m256i load_u16(const std::uint16_t* p) { return _mm256_cvtepu16_epi32(load16(p)); }
  TZ_ADAM_INLINE static __m256i load_i16(const std::int16_t* p) {
    return _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // The unsigned-saturating pack is exact on lanes below 0x10000.
  TZ_ADAM_INLINE static void store_u16(std::uint16_t* p, __m256i x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
  }
  // Each 128-bit half gathered to its 4 low halves then its 4 high halves,
  // and the quadwords reordered: the 8 low halves, then the 8 high ones.
  TZ_ADAM_INLINE static void store_halves(std::uint16_t* hi, std::int16_t* lo, __m256i x) {
    const __m256i split = _mm256_shuffle_epi8(
        x, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7,
                            10, 11, 14, 15));
    const __m256i halves = _mm256_permute4x64_epi64(split, 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(halves));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(halves, 1));
  }
  TZ_ADAM_INLINE static std::uint32_t mask_bits(const xsimd::batch_bool<std::uint32_t, xsimd::fma3<xsimd::avx2>>& b) {
    return static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(b)));
  }
  TZ_ADAM_INLINE static __m256i bf16_lanes(const V& x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(bits, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
  }
  TZ_ADAM_INLINE static __m256i bf16_pair(const V& a, const V& b) {  // 16 values: a's then b's
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_lanes(a), bf16_lanes(b)), 0xd8);
  }
  TZ_ADAM_INLINE static __m128i fp16(const V& x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  TZ_ADAM_INLINE static void store_bf16(std::uint16_t* p, const V& x) { store_u16(p, bf16_lanes(x)); }
  TZ_ADAM_INLINE static void store_fp16(std::uint16_t* p, const V& x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), fp16(x));
  }
  // One 64-byte line (4 vectors) with non-temporal stores; p is 64-byte aligned.
  template <DType D>
  TZ_ADAM_INLINE static void stream_line(std::uint16_t* p, const V* x) {
    for (int k = 0; k < 2; ++k) {
      const __m256i h = D == DType::kBf16 ? bf16_pair(x[2 * k], x[2 * k + 1])
                                          : _mm256_set_m128i(fp16(x[2 * k + 1]), fp16(x[2 * k]));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p) + k, h);
    }
  }
};
#endif

#if defined(__SSE4_2__)
// No F16C here: fp16 is converted with the integer recipes of convert.h,
// lane-wise, so results match the other variants bit for bit.
template <>
struct Cvt<xsimd::sse4_2> {
  using V = xsimd::batch<float, xsimd::sse4_2>;
  static constexpr bool kStream = false;
  TZ_ADAM_INLINE static __m128i load_u16(const std::uint16_t* p) {
    return _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  TZ_ADAM_INLINE static __m128i load_i16(const std::int16_t* p) {
    return _mm_cvtepi16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  TZ_ADAM_INLINE static void store_u16(std::uint16_t* p, __m128i r) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(r, r));
  }
  TZ_ADAM_INLINE static void store_halves(std::uint16_t* hi, std::int16_t* lo, __m128i x) {
    const __m128i split = _mm_shuffle_epi8(x, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(lo), split);
    _mm_storeh_pi(reinterpret_cast<__m64*>(hi), _mm_castsi128_ps(split));
  }
  TZ_ADAM_INLINE static std::uint32_t mask_bits(const xsimd::batch_bool<std::uint32_t, xsimd::sse4_2>& b) {
    return static_cast<std::uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(b)));
  }
  TZ_ADAM_INLINE static V load_bf16(const std::uint16_t* p) { return _mm_castsi128_ps(_mm_slli_epi32(load_u16(p), 16)); }
  TZ_ADAM_INLINE static V load_fp16(const std::uint16_t* p) {
    const __m128i h = load_u16(p);
    const __m128i shifted_exp = _mm_set1_epi32(0x7c00 << 13);
    __m128i o = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x7fff)), 13);
    const __m128i exp = _mm_and_si128(o, shifted_exp);
    o = _mm_add_epi32(o, _mm_set1_epi32((127 - 15) << 23));
    const __m128i inf_nan = _mm_add_epi32(o, _mm_set1_epi32((128 - 16) << 23));
    const __m128i sub = _mm_castps_si128(_mm_sub_ps(_mm_castsi128_ps(_mm_add_epi32(o, _mm_set1_epi32(1 << 23))),
                                                    _mm_castsi128_ps(_mm_set1_epi32(113 << 23))));
    o = _mm_blendv_epi8(o, inf_nan, _mm_cmpeq_epi32(exp, shifted_exp));
    o = _mm_blendv_epi8(o, sub, _mm_cmpeq_epi32(exp, _mm_setzero_si128()));
    return _mm_castsi128_ps(_mm_or_si128(o, _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16)));
  }
  TZ_ADAM_INLINE static __m128i bf16_lanes(V x) {
    const __m128i bits = _mm_castps_si128(x);
    const __m128i hi = _mm_srli_epi32(bits, 16);
    const __m128i bias = _mm_add_epi32(_mm_and_si128(hi, _mm_set1_epi32(1)), _mm_set1_epi32(0x7fff));
    const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(bits, bias), 16);
    const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(x, x));
    return _mm_blendv_epi8(rounded, _mm_or_si128(hi, _mm_set1_epi32(0x40)), nan);
  }
  TZ_ADAM_INLINE static void store_bf16(std::uint16_t* p, V x) { store_u16(p, bf16_lanes(x)); }
  TZ_ADAM_INLINE static void store_fp16(std::uint16_t* p, V x) {
    const __m128i bits = _mm_castps_si128(x);
    const __m128i sign = _mm_and_si128(bits, _mm_set1_epi32(static_cast<int>(0x80000000U)));
    const __m128i u = _mm_xor_si128(bits, sign);  // |x|; signed compares are safe from here on
    const __m128i inf_nan = _mm_blendv_epi8(
        _mm_set1_epi32(0x7c00),
        _mm_or_si128(_mm_set1_epi32(0x7e00), _mm_and_si128(_mm_srli_epi32(u, 13), _mm_set1_epi32(0x3ff))),
        _mm_cmpgt_epi32(u, _mm_set1_epi32(0x7f800000)));
    const __m128i magic = _mm_set1_epi32(((127 - 15) + (23 - 10) + 1) << 23);
    const __m128i sub = _mm_sub_epi32(
        _mm_castps_si128(_mm_add_ps(_mm_castsi128_ps(u), _mm_castsi128_ps(magic))), magic);
    const __m128i odd = _mm_and_si128(_mm_srli_epi32(u, 13), _mm_set1_epi32(1));
    const __m128i normal = _mm_srli_epi32(
        _mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(static_cast<int>(0xc8000fffU))), odd), 13);
    __m128i o = _mm_blendv_epi8(normal, sub, _mm_cmplt_epi32(u, _mm_set1_epi32(113 << 23)));
    o = _mm_blendv_epi8(o, inf_nan, _mm_cmpgt_epi32(u, _mm_set1_epi32(((127 + 16) << 23) - 1)));
    store_u16(p, _mm_or_si128(o, _mm_srli_epi32(sign, 16)));
  }
};
#endif

// Ops over xsimd::batch<float, A>. Only the 16-bit conversions differ by A.
template <class A>
struct XsimdOps {
  using V = xsimd::batch<float, A>;
  using U = xsimd::batch<std::uint32_t, A>;
  using C = Cvt<A>;
  static constexpr std::size_t kLanes = V::size;
  // Non-temporal copy-out: whole 64-byte lines of 16-bit values per group of
  // kLineVectors vectors (partial lines would be flushed half-written).
  static constexpr bool kStream = C::kStream;
  static constexpr std::size_t kLineElems = 64 / sizeof(std::uint16_t);
  static constexpr std::size_t kLineVectors = kLineElems / kLanes;

  TZ_ADAM_INLINE static V splat(float x) { return V(x); }
  TZ_ADAM_INLINE static V load(const float* p) { return V::load_unaligned(p); }
  TZ_ADAM_INLINE static void store(float* p, const V& x) { x.store_unaligned(p); }
  TZ_ADAM_INLINE static V load_bf16(const std::uint16_t* p) { return C::load_bf16(p); }
  TZ_ADAM_INLINE static V load_fp16(const std::uint16_t* p) { return C::load_fp16(p); }
  TZ_ADAM_INLINE static void store_bf16(std::uint16_t* p, const V& x) { C::store_bf16(p, x); }
  TZ_ADAM_INLINE static void store_fp16(std::uint16_t* p, const V& x) { C::store_fp16(p, x); }
  template <DType D>
  TZ_ADAM_INLINE static void stream_line(std::uint16_t* p, const V* x) { C::template stream_line<D>(p, x); }
  // xsimd 8 has no AVX-512 fma (its generic one is a multiply and an add):
  // vfmadd there, as AVX2's is, so the fused variants round alike.
  TZ_ADAM_INLINE static V fma(const V& a, const V& b, const V& c) {
#if defined(__AVX512F__)
    if constexpr (V::size == 16) return _mm512_fmadd_ps(a, b, c);
#endif
    return xsimd::fma(a, b, c);
  }
  TZ_ADAM_INLINE static V sqrt(const V& a) { return xsimd::sqrt(a); }
  // maxps: NaN in the second operand wins (the new v in amsgrad).
  TZ_ADAM_INLINE static V max(const V& a, const V& b) { return xsimd::max(a, b); }
  TZ_ADAM_INLINE static V sign(const V& c) {
    const V zero(0.0f), one(1.0f);
    return xsimd::select(c > zero, one, xsimd::select(c < zero, -one, c));
  }
  TZ_ADAM_INLINE static double sum_lanes(const V& x) {
    alignas(64) float lanes[kLanes];
    x.store_aligned(lanes);
    double s = 0;
    for (std::size_t i = 0; i < kLanes; ++i) s += static_cast<double>(lanes[i]);
    return s;
  }
  // Non-temporal stores are weakly ordered: fence them before the task ends.
  TZ_ADAM_INLINE static void fence() {
    if constexpr (kStream) _mm_sfence();
  }
  // Note [Remainder masters], lane-wise; bit k of `ties` (and of the result) is lane k's tie.
  TZ_ADAM_INLINE static V load_master(const std::uint16_t* h, const std::int16_t* r, std::uint32_t ties) {
    const U lane_bits = U::load_aligned(kLaneBits);
    // Lane k's bit of `ties` as 0 or kTieStep without an integer select (xsimd's
    // AVX-512BW select on 32-bit lanes does not compile unoptimised, as in the
    // sanitizer build): x | -x has its top bit set exactly when x != 0.
    const U bit = U(ties) & lane_bits;
    static_assert(kTieStep == 1U << 16);
    const U tie = ((bit | (U(0) - bit)) >> 31) << 16;
    return xsimd::bitwise_cast<V>((U(C::load_u16(h)) << 16) + U(C::load_i16(r)) + tie);
  }
  // h and int16(d) (the tie's +0x8000 becomes -0x8000) are the high and low
  // halves of (h << 16) | (d & 0xffff).
  TZ_ADAM_INLINE static std::uint32_t store_master(std::uint16_t* h, std::int16_t* r, const V& x) {
    const U high = U(C::bf16_lanes(x)) << 16;
    const V diff = xsimd::bitwise_cast<V>(xsimd::bitwise_cast<U>(x) - high);
    const U d = xsimd::bitwise_cast<U>(xsimd::select(xsimd::isnan(x), V(0.0f), diff));
    C::store_halves(h, r, high | (d & U(0xffff)));
    return C::mask_bits(d == U(kTie));
  }
};

#endif  // !TZ_ADAM_SCALAR_ONLY

}  // namespace tz::cpu_adam::detail
