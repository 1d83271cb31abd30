// The optimizer and gradient-arrival kernels, written once over an Ops type
// (simd_ops.h) and instantiated by each kernels_<isa>.cpp for its ISA.
//
// Note [One object per instruction set]
// Each kernels_<isa>.cpp is compiled with that ISA's -m flags and everything
// else in cpu_adam with the baseline ones, so the library runs on any x86-64
// and picks a table at run time. Code built with wider flags must never be
// linked in place of baseline code: a weak (inline or template) symbol emitted
// by two objects is merged by the linker, which keeps one arbitrarily. So
// everything here is a template on the Ops type (distinct symbols per ISA) or
// always inlined, the scalar helpers of convert.h are used only by the scalar
// object, and the kernel objects have no dynamically initialised globals (their
// tables are constinit). std:: and xsimd templates that all objects share are
// inlined at -O1 and above; at -O0 a shared instantiation of one could in
// principle be taken from a wider object.
//
// Note [Tails and unaligned spans]
// The vector loop runs over whole vectors with unaligned loads and stores. A
// part-vector (the tail, or the head before the 16-bit output is aligned for
// non-temporal stores; with remainder masters, part of a group of vectors
// that share tie-bit bytes) is copied into zero-padded stack buffers, run through
// the same vector body, and copied back, so every element gets the same
// arithmetic whatever its position, tile or thread count. Zero padding is
// harmless: every formula maps zero state and gradient to finite values (and
// a zero bf16 parameter, remainder and tie bit are the master +0).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernel_api.h"
#include "simd_ops.h"

namespace tz::cpu_adam::detail {

template <DType D>
inline constexpr std::size_t kElemBytes = D == DType::kFp32 ? 4 : 2;
// The element type a span of dtype D is stored as.
template <DType D>
using Elem = std::conditional_t<D == DType::kFp32, float, std::uint16_t>;

template <Kind K>
inline constexpr bool kUsesExpAvg = K != Kind::kAdagrad;
template <Kind K>
inline constexpr bool kUsesExpAvgSq = K != Kind::kLion;
template <Kind K>
inline constexpr bool kAmsgrad = K == Kind::kAdamL2Ams || K == Kind::kAdamWAms;
template <Kind K>
inline constexpr bool kAdamL2 = K == Kind::kAdamL2 || K == Kind::kAdamL2Ams;

// The per-call constants, broadcast once per range.
template <class O>
struct VConsts {
  using V = typename O::V;
  explicit VConsts(const StepConsts& c)
      : scale(O::splat(c.scale)), l2(O::splat(c.l2)), decay(O::splat(c.decay)), beta1(O::splat(c.beta1)),
        one_minus_beta1(O::splat(c.one_minus_beta1)), beta2(O::splat(c.beta2)),
        one_minus_beta2(O::splat(c.one_minus_beta2)), eps(O::splat(c.eps)), neg_step(O::splat(c.neg_step)),
        inv_sqrt_bc2(O::splat(c.inv_sqrt_bc2)), sr_key(c.sr_key), sr_base(c.sr_base) {}
  V scale, l2, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, neg_step, inv_sqrt_bc2;
  std::uint32_t sr_key, sr_base;
};

template <class O, DType D>
TZ_ADAM_INLINE typename O::V load_as(const void* base, std::size_t i) {
  if constexpr (D == DType::kFp32) {
    return O::load(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::kBf16) {
    return O::load_bf16(static_cast<const std::uint16_t*>(base) + i);
  } else {
    return O::load_fp16(static_cast<const std::uint16_t*>(base) + i);
  }
}

template <class O, DType D>
TZ_ADAM_INLINE void store_as(void* base, std::size_t i, const typename O::V& x) {
  if constexpr (D == DType::kFp32) {
    O::store(static_cast<float*>(base) + i, x);
  } else if constexpr (D == DType::kBf16) {
    O::store_bf16(static_cast<std::uint16_t*>(base) + i, x);
  } else {
    O::store_fp16(static_cast<std::uint16_t*>(base) + i, x);
  }
}

// The second moment (Adagrad: the sum of squares) at element i, whose index
// in the call is `at`: bf16 by stochastic rounding (Note [Stochastic rounding
// of bf16 second moments]), fp32 as it is.
template <class O, DType M>
TZ_ADAM_INLINE void store_second_moment(const VConsts<O>& k, void* base, std::size_t i, std::size_t at,
                                        const typename O::V& x) {
  if constexpr (M == DType::kBf16) {
    O::store_bf16_sr(static_cast<std::uint16_t*>(base) + i, x, k.sr_base + static_cast<std::uint32_t>(at), k.sr_key);
  } else {
    store_as<O, M>(base, i, x);
  }
}

template <ParamLayout L>
inline constexpr bool kCopiesOut = L == ParamLayout::kFp32CopyBf16 || L == ParamLayout::kFp32CopyFp16;
template <ParamLayout L>
inline constexpr DType kCopyDtype = L == ParamLayout::kFp32CopyBf16 ? DType::kBf16 : DType::kFp16;
template <ParamLayout L>
inline constexpr bool kRemainder = L == ParamLayout::kBf16Remainder;

// Elements the remainder layout steps together: whole bytes of tie bits, read
// and written once (Note [Remainder masters]). Vectors narrower than a byte
// share one: a read-modify-write per vector would make each vector wait for
// the previous one's whole step.
template <class O>
inline constexpr std::size_t kTieGroup = O::kLanes >= 8 ? O::kLanes : 8;

// The tie bits of the kTieGroup elements from i (a multiple of 8: i - begin is
// a multiple of kTieGroup and begin of 8), bit k for element i + k.
template <class O>
TZ_ADAM_INLINE std::uint32_t load_tie_bits(const std::uint8_t* ties, std::size_t i) {
  std::uint32_t bits = 0;
  for (std::size_t b = 0; b < kTieGroup<O> / 8; ++b) bits |= static_cast<std::uint32_t>(ties[i / 8 + b]) << (8 * b);
  return bits;
}

template <class O>
TZ_ADAM_INLINE void store_tie_bits(std::uint8_t* ties, std::size_t i, std::uint32_t bits) {
  for (std::size_t b = 0; b < kTieGroup<O> / 8; ++b) ties[i / 8 + b] = static_cast<std::uint8_t>(bits >> (8 * b));
}

// One vector of the step at element i (tierzero/cpu_adam.h has the formulas):
// updates the master and the state in place and returns the new parameters
// for the copy-out. `at` is the element's index in the call (i itself, except
// where a part-vector runs from stack buffers), for the stochastic rounding. With the remainder layout, *ties holds the vector's tie
// bits (bit k for lane k) on entry and its new ones on return: the caller
// reads and writes them (Note [Remainder masters]).
template <class O, Kind K, DType G, DType M, ParamLayout L>
TZ_ADAM_INLINE typename O::V step_vector(const VConsts<O>& k, const StepPtrs& s, std::size_t i, std::size_t at,
                                         std::uint32_t* ties = nullptr) {
  using V = typename O::V;
  V p;
  if constexpr (kRemainder<L>) {
    p = O::load_master(static_cast<const std::uint16_t*>(s.param16) + i, s.remainder + i, *ties);
  } else {
    p = O::load(s.param + i);
  }
  V g = load_as<O, G>(s.grad, i) * k.scale;
  if constexpr (K == Kind::kLion) {
    V m = load_as<O, M>(s.exp_avg, i);
    p = p * k.decay;
    const V c = O::fma(k.beta1, m, k.one_minus_beta1 * g);
    p = O::fma(k.neg_step, O::sign(c), p);
    m = O::fma(k.beta2, m, k.one_minus_beta2 * g);
    store_as<O, M>(s.exp_avg, i, m);
  } else if constexpr (K == Kind::kAdagrad) {
    V sum = load_as<O, M>(s.exp_avg_sq, i);
    g = O::fma(k.l2, p, g);
    sum = O::fma(g, g, sum);
    p = O::fma(k.neg_step, g / (O::sqrt(sum) + k.eps), p);
    store_second_moment<O, M>(k, s.exp_avg_sq, i, at, sum);
  } else {
    V m = load_as<O, M>(s.exp_avg, i);
    V v = load_as<O, M>(s.exp_avg_sq, i);
    if constexpr (kAdamL2<K>) {
      g = O::fma(k.l2, p, g);
    } else {
      p = p * k.decay;
    }
    m = O::fma(k.beta1, m, k.one_minus_beta1 * g);
    v = O::fma(k.beta2, v, (k.one_minus_beta2 * g) * g);
    V d = v;
    if constexpr (kAmsgrad<K>) {
      d = O::max(O::load(s.max_exp_avg_sq + i), v);
      O::store(s.max_exp_avg_sq + i, d);
    }
    // torch: sqrt(v) / sqrt(bc2) + eps; the division by the per-step constant
    // is a multiply by its reciprocal (one more rounding, well inside fp32).
    const V denom = O::fma(O::sqrt(d), k.inv_sqrt_bc2, k.eps);
    p = O::fma(k.neg_step, m / denom, p);
    store_as<O, M>(s.exp_avg, i, m);
    store_second_moment<O, M>(k, s.exp_avg_sq, i, at, v);
  }
  if constexpr (kRemainder<L>) {
    *ties = O::store_master(static_cast<std::uint16_t*>(s.param16) + i, s.remainder + i, p);
  } else {
    O::store(s.param + i, p);
  }
  return p;
}

// One step of step_plain at i (index `at` in the call): a vector with a plain
// store of its copy-out, or, with the remainder layout, kTieGroup elements and
// their tie bits.
template <class O, Kind K, DType G, DType M, ParamLayout L>
TZ_ADAM_INLINE void step_block(const VConsts<O>& k, const StepPtrs& s, std::size_t i, std::size_t at) {
  if constexpr (kRemainder<L>) {
    const std::uint32_t in = load_tie_bits<O>(s.tie_bits, i);
    std::uint32_t out = 0;
    for (std::size_t v = 0; v < kTieGroup<O>; v += O::kLanes) {
      std::uint32_t ties = in >> v;
      step_vector<O, K, G, M, L>(k, s, i + v, at + v, &ties);
      out |= ties << v;
    }
    store_tie_bits<O>(s.tie_bits, i, out);
  } else {
    const typename O::V p = step_vector<O, K, G, M, L>(k, s, i, at);
    if constexpr (kCopiesOut<L>) store_as<O, kCopyDtype<L>>(s.param16, i, p);
  }
}

// Elements one step_block takes.
template <class O, ParamLayout L>
inline constexpr std::size_t kBlock = kRemainder<L> ? kTieGroup<O> : O::kLanes;

TZ_ADAM_INLINE void copy_elems(void* dst, const void* src, std::size_t offset_elems, std::size_t count, std::size_t bytes) {
  std::memcpy(dst, static_cast<const unsigned char*>(src) + offset_elems * bytes, count * bytes);
}
TZ_ADAM_INLINE void copy_back(void* dst, std::size_t offset_elems, const void* src, std::size_t count, std::size_t bytes) {
  std::memcpy(static_cast<unsigned char*>(dst) + offset_elems * bytes, src, count * bytes);
}

// count tie bits from bit `from` of `src` to bit `to` of `dst`, one by one
// (tails only), leaving dst's other bits as they are.
TZ_ADAM_INLINE void copy_bits(std::uint8_t* dst, std::size_t to, const std::uint8_t* src, std::size_t from,
                              std::size_t count) {
  for (std::size_t b = 0; b < count; ++b) {
    const std::size_t d = to + b, f = from + b;
    const auto bit = static_cast<std::uint8_t>(1U << (d % 8));
    dst[d / 8] = static_cast<std::uint8_t>((src[f / 8] >> (f % 8)) & 1U ? dst[d / 8] | bit : dst[d / 8] & ~bit);
  }
}

// count < kBlock elements at i, through zero-padded buffers (Note [Tails and unaligned spans]).
template <class O, Kind K, DType G, DType M, ParamLayout L>
void step_partial(const VConsts<O>& k, const StepPtrs s, std::size_t i, std::size_t count) {
  constexpr std::size_t kL = kBlock<O, L>;
  constexpr std::size_t kM = kElemBytes<M>;
  alignas(64) float param[kL] = {};
  alignas(64) float vmax[kL] = {};
  alignas(64) Elem<G> grad[kL] = {};
  alignas(64) Elem<M> m[kL] = {};
  alignas(64) Elem<M> v[kL] = {};
  alignas(64) std::uint16_t p16[kL] = {};
  alignas(64) std::int16_t rem[kL] = {};
  alignas(64) std::uint8_t ties[(kL + 7) / 8] = {};
  const StepPtrs t{param, grad, m, v, vmax, p16, rem, ties};
  if constexpr (kRemainder<L>) {
    copy_elems(p16, s.param16, i, count, 2);
    copy_elems(rem, s.remainder, i, count, 2);
    copy_bits(ties, 0, s.tie_bits, i, count);
  } else {
    copy_elems(param, s.param, i, count, 4);
  }
  copy_elems(grad, s.grad, i, count, kElemBytes<G>);
  if constexpr (kUsesExpAvg<K>) copy_elems(m, s.exp_avg, i, count, kM);
  if constexpr (kUsesExpAvgSq<K>) copy_elems(v, s.exp_avg_sq, i, count, kM);
  if constexpr (kAmsgrad<K>) copy_elems(vmax, s.max_exp_avg_sq, i, count, 4);
  step_block<O, K, G, M, L>(k, t, 0, i);
  if constexpr (kRemainder<L>) {
    copy_back(s.remainder, i, rem, count, 2);
    copy_bits(s.tie_bits, i, ties, 0, count);
  } else {
    copy_back(s.param, i, param, count, 4);
  }
  if constexpr (kUsesExpAvg<K>) copy_back(s.exp_avg, i, m, count, kM);
  if constexpr (kUsesExpAvgSq<K>) copy_back(s.exp_avg_sq, i, v, count, kM);
  if constexpr (kAmsgrad<K>) copy_back(s.max_exp_avg_sq, i, vmax, count, 4);
  if constexpr (L != ParamLayout::kFp32) copy_back(s.param16, i, p16, count, 2);
}

// Elements [begin, end) with plain stores.
// With the remainder layout, elements before the first tie-bit byte boundary
// (a run of weight-decay segments may start anywhere) go through the partial
// path, which moves tie bits one by one.
template <class O, Kind K, DType G, DType M, ParamLayout L>
TZ_ADAM_INLINE void step_plain(const VConsts<O>& k, const StepPtrs& s, std::size_t begin, std::size_t end) {
  std::size_t i = begin;
  if constexpr (kRemainder<L>) {
    if (i % 8 != 0) {
      const std::size_t head = end - i < 8 - i % 8 ? end - i : 8 - i % 8;
      step_partial<O, K, G, M, L>(k, s, i, head);
      i += head;
    }
  }
  for (; i + kBlock<O, L> <= end; i += kBlock<O, L>) step_block<O, K, G, M, L>(k, s, i, i);
  if (i < end) step_partial<O, K, G, M, L>(k, s, i, end - i);
}

// A StepFn: elements [begin, end).
template <class O, Kind K, DType G, DType M, ParamLayout L>
void step_range(const StepConsts& consts, const StepPtrs& ptrs, std::size_t begin, std::size_t end) {
  const VConsts<O> k(consts);
  // A local copy whose address never escapes: the vector stores (may-alias
  // types) cannot change it, so the pointers stay in registers.
  const StepPtrs s = ptrs;
  if constexpr (O::kStream && kCopiesOut<L>) {
    // Note [Non-temporal copy-out]: the 16-bit copy is written once and read
    // by the engine's upload, not by us, so it bypasses the cache: whole
    // 64-byte lines of non-temporal stores, which need no read of the line
    // first. Elements before the first line boundary go the plain way.
    auto* p16 = static_cast<std::uint16_t*>(s.param16);
    const std::size_t misalign = reinterpret_cast<std::uintptr_t>(p16 + begin) % 64;
    std::size_t i = begin + (misalign == 0 ? 0 : (64 - misalign) / sizeof(std::uint16_t));
    if (i > end) i = end;
    step_plain<O, K, G, M, L>(k, s, begin, i);
    for (; i + O::kLineElems <= end; i += O::kLineElems) {
      typename O::V line[O::kLineVectors];
      for (std::size_t v = 0; v < O::kLineVectors; ++v) {
        line[v] = step_vector<O, K, G, M, L>(k, s, i + v * O::kLanes, i + v * O::kLanes);
      }
      O::template stream_line<kCopyDtype<L>>(p16 + i, line);
    }
    step_plain<O, K, G, M, L>(k, s, i, end);
    O::fence();
  } else {
    // No non-temporal stores for the remainder layout: its bf16 parameters
    // were just read, so their lines are in the cache already.
    step_plain<O, K, G, M, L>(k, s, begin, end);
  }
}

// One vector of the gradient-arrival pass: acc = (overwrite ? 0 : acc) + scale * g,
// with its squares and a NaN-if-non-finite probe (x * 0) accumulated in lanes.
// A 16-bit accumulator (A) stores the fp32 result rounded to nearest even and
// reads it back, so the statistics are of what was stored.
template <class O, DType A, DType G, bool kOverwrite>
TZ_ADAM_INLINE void acc_block(const AccPtrs& a, const typename O::V& scale, std::size_t i, typename O::V& squares,
                              typename O::V& probe) {
  using V = typename O::V;
  const V g = load_as<O, G>(a.grad, i);
  V x;
  if constexpr (kOverwrite) {
    x = g * scale;
  } else {
    x = O::fma(scale, g, load_as<O, A>(a.acc, i));
  }
  store_as<O, A>(a.acc, i, x);
  if constexpr (A != DType::kFp32) x = load_as<O, A>(a.acc, i);
  squares = O::fma(x, x, squares);
  probe = O::fma(x, O::splat(0.0f), probe);
}

template <class O, DType A, DType G, bool kOverwrite>
void acc_partial(const AccPtrs a, const typename O::V& scale, std::size_t i, std::size_t count,
                 typename O::V& squares, typename O::V& probe) {
  constexpr std::size_t kL = O::kLanes;
  alignas(64) Elem<A> acc[kL] = {};
  alignas(64) Elem<G> grad[kL] = {};
  if constexpr (!kOverwrite) copy_elems(acc, a.acc, i, count, kElemBytes<A>);
  copy_elems(grad, a.grad, i, count, kElemBytes<G>);
  const AccPtrs t{acc, grad, a.scale};
  acc_block<O, A, G, kOverwrite>(t, scale, 0, squares, probe);
  copy_back(a.acc, i, acc, count, kElemBytes<A>);
}

template <DType A>
double sum_squares_f64(const void* base, std::size_t begin, std::size_t count) {
  double s = 0;
  for (std::size_t i = begin; i < begin + count; ++i) {
    double x;
    if constexpr (A == DType::kFp32) {
      x = static_cast<const float*>(base)[i];
    } else if constexpr (A == DType::kBf16) {
      x = bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    } else {
      x = fp16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    }
    s += x * x;
  }
  return s;
}

// An AccFn. Squares are summed in fp32 lanes over chunks of 64 vectors (at
// most 64 roundings per lane, relative error < 4e-6), then in double.
template <class O, DType A, DType G, bool kOverwrite>
TileStat acc_range(const AccPtrs& ptrs, std::size_t begin, std::size_t end) {
  using V = typename O::V;
  const AccPtrs a = ptrs;  // kept in registers, as in step_range
  constexpr std::size_t kL = O::kLanes;
  constexpr std::size_t kChunk = 64 * kL;
  const V scale = O::splat(a.scale);
  TileStat stat;
  for (std::size_t c = begin; c < end;) {
    const std::size_t chunk_end = end - c > kChunk ? c + kChunk : end;
    V squares = O::splat(0.0f), probe = O::splat(0.0f);
    std::size_t i = c;
    for (; i + kL <= chunk_end; i += kL) acc_block<O, A, G, kOverwrite>(a, scale, i, squares, probe);
    if (i < chunk_end) acc_partial<O, A, G, kOverwrite>(a, scale, i, chunk_end - i, squares, probe);
    double sum = O::sum_lanes(squares);
    if (O::sum_lanes(probe) != 0.0) {  // NaN compares unequal: some element was inf or NaN
      stat.non_finite = true;
    } else if (!__builtin_isfinite(sum)) {
      sum = sum_squares_f64<A>(a.acc, c, chunk_end - c);  // finite values whose squares overflow fp32
    }
    stat.sum_squares += sum;
    c = chunk_end;
  }
  return stat;
}

// Note [Int8 moments]: one element's code; every variant's tail and the
// narrow variants' whole loop. Exact or correctly rounded operations only.
template <class O>
TZ_ADAM_INLINE std::uint32_t int8_code_of(const Int8Code& c, float x, float divisor) {
  const float ax = __builtin_fabsf(x);
  if (!(ax <= __FLT_MAX__)) return c.nan_code;  // inf, NaN
  const float y = (c.on_sqrt ? __builtin_sqrtf(ax) : ax) / divisor;
  std::uint32_t key;
  std::memcpy(&key, &y, 4);
  key >>= 16;
  const std::uint32_t idx = key < kBucketKey0 ? 0 : (key - kBucketKey0 < kBucketCount ? key - kBucketKey0 : kBucketCount - 1);
  std::uint32_t k = c.bucket[idx];
  k += c.mid[k] < y ? 1U : 0U;
  k += c.mid[k] < y ? 1U : 0U;
  if (!c.is_signed) return k == 0 && y > 0.0f ? 1U : k;
  return x < 0.0f && k != 0 ? (0x80U | k) : k;
}

template <class O>
TZ_ADAM_INLINE float int8_decode_one(const Int8Code& c, std::uint8_t code, float scale) {
  const float t = c.decode[code] * scale;
  return c.on_sqrt ? t * t : t;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The templates below are not on the Ops type: they exist only in the AVX-512
// object (this #if), so no narrower object emits a symbol the linker could
// pick instead (Note [One object per instruction set]).
// Loops over registers, unrolled so that their arrays stay in registers.
#define TZ_UNROLL _Pragma("GCC unroll 16")

// Note [Int8 codes in registers]: 16 lanes of a 32 * 2^kPairs-entry table
// held in 2 * 2^kPairs registers, read at idx (< 32 * 2^kPairs): two-register
// permutes over each 32 entries, then a selection on idx's higher bits.
template <int kPairs>
struct Table512 {
  __m512 t[2 << kPairs];
  explicit Table512(const float* at) {
    TZ_UNROLL
    for (int r = 0; r < (2 << kPairs); ++r) t[r] = _mm512_load_ps(at + 16 * r);
  }
  TZ_ADAM_INLINE __m512 at(__m512i idx) const {
    __mmask16 high[kPairs > 0 ? kPairs : 1];
    TZ_UNROLL
    for (int bit = 0; bit < kPairs; ++bit) high[bit] = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32 << bit));
    return at(idx, high);
  }
  // high[b]: the lanes whose idx has bit 5 + b set, where the caller knows them.
  TZ_ADAM_INLINE __m512 at(__m512i idx, const __mmask16* high) const {
    __m512 part[1 << kPairs];
    TZ_UNROLL
    for (int p = 0; p < (1 << kPairs); ++p) part[p] = _mm512_permutex2var_ps(t[2 * p], idx, t[2 * p + 1]);
    TZ_UNROLL
    for (int bit = 0; bit < kPairs; ++bit) {
      TZ_UNROLL
      for (int p = 0; p < (1 << kPairs) >> (bit + 1); ++p) {
        part[p] = _mm512_mask_blend_ps(high[bit], part[2 * p], part[2 * p + 1]);
      }
    }
    return part[0];
  }
};

// The count of midpoints below y in each lane (y finite, >= 0): kRounds
// rounds of the binary search over Int8Code::search.
template <int kRounds>
struct Search512 {
  static_assert(kRounds == 7 || kRounds == 8);
  __m512 small[5];          // rounds 0..4: up to 16 candidates, one register each (round 0's broadcast)
  __m512 r5[2];             // round 5: 32 candidates
  Table512<1> r6;           // round 6: 64
  Table512<kRounds == 8 ? 2 : 0> r7;  // round 7: 128 (unused with 7 rounds)
  explicit Search512(const float* s)
      : r5{_mm512_load_ps(s + kInt8SearchOffset[5]), _mm512_load_ps(s + kInt8SearchOffset[5] + 16)},
        r6(s + kInt8SearchOffset[6]), r7(s + kInt8SearchOffset[kRounds == 8 ? 7 : 0]) {
    small[0] = _mm512_set1_ps(s[0]);
    TZ_UNROLL
    for (int r = 1; r < 5; ++r) small[r] = _mm512_load_ps(s + kInt8SearchOffset[r]);
  }
  // i's bits are the rounds' outcomes, round 0's the highest; the selections
  // of rounds 6 and 7 on i's bits 5 and 6 reuse the masks of rounds 0 and 1.
  TZ_ADAM_INLINE __m512i count_below(__m512 y) const {
    const __m512i one = _mm512_set1_epi32(1);
    __mmask16 below[kRounds];
    below[0] = _mm512_cmp_ps_mask(small[0], y, _CMP_LT_OQ);  // one candidate, in every lane
    __m512i i = _mm512_maskz_mov_epi32(below[0], one);
    const auto round = [&](int r, __m512 candidate) {
      below[r] = _mm512_cmp_ps_mask(candidate, y, _CMP_LT_OQ);
      i = _mm512_add_epi32(i, i);
      i = _mm512_mask_add_epi32(i, below[r], i, one);
    };
    TZ_UNROLL
    for (int r = 1; r < 5; ++r) round(r, _mm512_permutexvar_ps(i, small[r]));
    round(5, _mm512_permutex2var_ps(r5[0], i, r5[1]));
    round(6, r6.at(i, &below[0]));
    if constexpr (kRounds == 8) {
      const __mmask16 high[2] = {below[1], below[0]};
      round(7, r7.at(i, high));
    }
    return i;
  }
};

// Note [Int8 codes in registers]: codes of 16 elements, as int8_code_of.
template <bool kSigned, bool kOnSqrt>
void int8_codes_512(const Int8Code& c, const float* in, std::uint8_t* codes, std::size_t count, float divisor) {
  const Search512<kSigned ? 7 : 8> search(c.search);
  const __m512 div = _mm512_set1_ps(divisor), zero = _mm512_setzero_ps();
  const __m512i one = _mm512_set1_epi32(1), nan_code = _mm512_set1_epi32(static_cast<int>(c.nan_code));
  for (std::size_t i = 0; i + 16 <= count; i += 16) {
    const __m512 x = _mm512_loadu_ps(in + i);
    const __m512 ax = _mm512_abs_ps(x);
    const __mmask16 finite = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(__FLT_MAX__), _CMP_LE_OQ);
    // Non-finite lanes search 0 (their code is nan_code whatever the count).
    const __m512 y = _mm512_maskz_div_ps(finite, kOnSqrt ? _mm512_sqrt_ps(ax) : ax, div);
    __m512i k = search.count_below(y);
    if constexpr (kSigned) {
      const __mmask16 neg = _mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ) & _mm512_test_epi32_mask(k, k);
      k = _mm512_mask_or_epi32(k, neg, k, _mm512_set1_epi32(0x80));
    } else {
      const __mmask16 up = _mm512_cmp_ps_mask(y, zero, _CMP_GT_OQ) & _mm512_testn_epi32_mask(k, k);
      k = _mm512_mask_mov_epi32(k, up, one);
    }
    k = _mm512_mask_mov_epi32(nan_code, finite, k);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(k));
  }
}

template <bool kOnSqrt>
void int8_decode_512(const Int8Code& c, const std::uint8_t* codes, float scale, float* out, std::size_t count) {
  const Table512<3> decode(c.decode);
  const __m512 s = _mm512_set1_ps(scale);
  for (std::size_t i = 0; i + 16 <= count; i += 16) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    __m512 t = _mm512_mul_ps(decode.at(idx), s);
    if constexpr (kOnSqrt) t = _mm512_mul_ps(t, t);
    _mm512_storeu_ps(out + i, t);
  }
}
#endif

template <class O>
void int8_decode(const Int8Code& c, const std::uint8_t* codes, float scale, float* out, std::size_t count) {
  std::size_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (O::kLanes == 16) {
    if (c.on_sqrt) {
      int8_decode_512<true>(c, codes, scale, out, count);
    } else {
      int8_decode_512<false>(c, codes, scale, out, count);
    }
    i = count / 16 * 16;
  }
#endif
#if defined(__AVX2__)
  if constexpr (O::kLanes == 8) {
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= count; i += 8) {
      const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
      __m256 t = _mm256_mul_ps(_mm256_i32gather_ps(c.decode, idx, 4), s);
      if (c.on_sqrt) t = _mm256_mul_ps(t, t);
      _mm256_storeu_ps(out + i, t);
    }
  }
#endif
  for (; i < count; ++i) out[i] = int8_decode_one<O>(c, codes[i], scale);
}

// The scale's source: the largest finite |x| of the block, exactly (max is
// order-independent, so every instruction set finds the same value).
template <class O>
float int8_finite_amax(const float* in, std::size_t count) {
  float amax = 0.0f;
  std::size_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (O::kLanes == 16) {
    __m512 m = _mm512_setzero_ps();
    for (; i + 16 <= count; i += 16) {
      const __m512 ax = _mm512_abs_ps(_mm512_loadu_ps(in + i));
      const __mmask16 finite = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(__FLT_MAX__), _CMP_LE_OQ);
      m = _mm512_mask_max_ps(m, finite, m, ax);
    }
    amax = _mm512_reduce_max_ps(m);
  }
#endif
#if defined(__AVX2__)
  if constexpr (O::kLanes == 8) {
    __m256 m = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; i + 8 <= count; i += 8) {
      const __m256 ax = _mm256_and_ps(_mm256_loadu_ps(in + i), abs_mask);
      const __m256 finite = _mm256_cmp_ps(ax, _mm256_set1_ps(__FLT_MAX__), _CMP_LE_OQ);
      m = _mm256_max_ps(m, _mm256_and_ps(ax, finite));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m);
    for (float l : lanes) amax = l > amax ? l : amax;
  }
#endif
  for (; i < count; ++i) {
    const float ax = __builtin_fabsf(in[i]);
    if (ax <= __FLT_MAX__ && ax > amax) amax = ax;
  }
  return amax;
}

// AVX2's codes for elements [0, count / 8 * 8): a table lookup of the
// bucket, then two midpoint comparisons (Note [Int8 codes in registers] has
// AVX-512's way without gathers). Returns how many elements it coded.
template <class O>
std::size_t int8_codes_256(const Int8Code& c, const float* in, std::uint8_t* codes, std::size_t count,
                           float divisor) {
  std::size_t i = 0;
#if defined(__AVX2__)
  if constexpr (O::kLanes == 8) {
    const __m256 div = _mm256_set1_ps(divisor), zero = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i key0 = _mm256_set1_epi32(static_cast<int>(kBucketKey0));
    const __m256i last = _mm256_set1_epi32(static_cast<int>(kBucketCount - 1));
    const __m256i izero = _mm256_setzero_si256();
    for (; i + 8 <= count; i += 8) {
      const __m256 x = _mm256_loadu_ps(in + i);
      const __m256 ax = _mm256_and_ps(x, abs_mask);
      const __m256 finite = _mm256_cmp_ps(ax, _mm256_set1_ps(__FLT_MAX__), _CMP_LE_OQ);
      const __m256 y = _mm256_div_ps(c.on_sqrt ? _mm256_sqrt_ps(ax) : ax, div);
      __m256i idx = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(y), 16), key0);
      idx = _mm256_min_epi32(_mm256_max_epi32(idx, izero), last);
      __m256i k = _mm256_and_si256(_mm256_i32gather_epi32(reinterpret_cast<const int*>(c.bucket), idx, 1),
                                   _mm256_set1_epi32(0xff));
      for (int r = 0; r < 2; ++r) {
        const __m256 lt = _mm256_cmp_ps(_mm256_i32gather_ps(c.mid, k, 4), y, _CMP_LT_OQ);
        k = _mm256_sub_epi32(k, _mm256_castps_si256(lt));  // true lanes are -1
      }
      if (c.is_signed) {
        const __m256i neg = _mm256_andnot_si256(_mm256_cmpeq_epi32(k, izero),
                                                _mm256_castps_si256(_mm256_cmp_ps(x, zero, _CMP_LT_OQ)));
        k = _mm256_or_si256(k, _mm256_and_si256(neg, _mm256_set1_epi32(0x80)));
      } else {
        const __m256i up = _mm256_and_si256(_mm256_cmpeq_epi32(k, izero),
                                            _mm256_castps_si256(_mm256_cmp_ps(y, zero, _CMP_GT_OQ)));
        k = _mm256_sub_epi32(k, up);
      }
      k = _mm256_blendv_epi8(_mm256_set1_epi32(static_cast<int>(c.nan_code)), k, _mm256_castps_si256(finite));
      const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packus_epi16(w, w));
    }
  }
#else
  (void)c, (void)in, (void)codes, (void)count, (void)divisor;
#endif
  return i;
}

template <class O>
float int8_encode(const Int8Code& c, const float* in, std::uint8_t* codes, std::size_t count) {
  // The scale: the largest finite |x| (of sqrt(x) with on_sqrt: the same
  // element, sqrt being monotone).
  const float amax = int8_finite_amax<O>(in, count);
  const float scale = c.on_sqrt ? __builtin_sqrtf(amax) : amax;
  const float divisor = scale > 0.0f ? scale : 1.0f;
  std::size_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (O::kLanes == 16) {
    if (c.is_signed) {
      int8_codes_512<true, false>(c, in, codes, count, divisor);
    } else if (c.on_sqrt) {
      int8_codes_512<false, true>(c, in, codes, count, divisor);
    } else {
      int8_codes_512<false, false>(c, in, codes, count, divisor);
    }
    i = count / 16 * 16;
  }
#endif
  if constexpr (O::kLanes == 8) i = int8_codes_256<O>(c, in, codes, count, divisor);
  for (; i < count; ++i) codes[i] = static_cast<std::uint8_t>(int8_code_of<O>(c, in[i], divisor));
  return scale;
}

template <class O, std::size_t... I>
constexpr void fill_steps(KernelTable& t, std::index_sequence<I...>) {
  constexpr std::size_t kPerKind = kGradDtypes * kMomentDtypes * kParamLayouts;
  constexpr std::size_t kPerGrad = kMomentDtypes * kParamLayouts;
  ((t.step[I / kPerKind][I / kPerGrad % kGradDtypes][I / kParamLayouts % kMomentDtypes][I % kParamLayouts] =
        &step_range<O, static_cast<Kind>(I / kPerKind), static_cast<DType>(I / kPerGrad % kGradDtypes),
                    static_cast<DType>(I / kParamLayouts % kMomentDtypes), static_cast<ParamLayout>(I % kParamLayouts)>),
   ...);
}

template <class O, std::size_t... I>
constexpr void fill_accumulates(KernelTable& t, std::index_sequence<I...>) {
  ((t.accumulate[I / (2 * kGradDtypes)][I / 2 % kGradDtypes][I % 2] =
        &acc_range<O, static_cast<DType>(I / (2 * kGradDtypes)), static_cast<DType>(I / 2 % kGradDtypes), I % 2 == 1>),
   ...);
}

template <class O>
constexpr KernelTable make_table(Simd simd) {
  KernelTable t{};
  t.simd = simd;
  fill_steps<O>(t, std::make_index_sequence<kKinds * kGradDtypes * kMomentDtypes * kParamLayouts>{});
  fill_accumulates<O>(t, std::make_index_sequence<kGradDtypes * kGradDtypes * 2>{});
  t.int8_decode = &int8_decode<O>;
  t.int8_encode = &int8_encode<O>;
  return t;
}

}  // namespace tz::cpu_adam::detail
