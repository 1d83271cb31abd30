// bench/adam_stream.h: the memory-bandwidth limit of each CPU optimizer kernel's
// access pattern, for tierzero-adam-bench.
//
// A limit loop reads and writes exactly the arrays its kernel does, element for
// element, with plain (temporal) loads and stores, and does no arithmetic beyond
// what keeps the compiler from eliding it: each written word is the word read
// XOR (gradient bits AND a mask). The mask is zero, but comes from a volatile,
// so the compiler must load every input and store every output, and the data
// are left bit for bit as they were. The 16-bit copy-out stores the top half of
// the new parameter (bf16 by truncation: a shift) with non-temporal stores, as
// the kernels do: the copy is write-only, so a plain store would first read
// each line (4 B of traffic per param instead of 2) and the limit would flatter
// the kernel (`plain_copy` in stream_range() measures that variant for the
// record). The bf16 gradient is widened by a shift. The remainder master's
// arrays (bf16 parameters, remainders, tie bits) are read and written in
// place with plain stores, as its kernel does: their lines are read anyway.
// Its tie bits (a byte per 8 elements) take a second loop over the tile's
// bytes, so a tile must start at a multiple of 8 elements (the tiles here
// start at multiples of 64).
//
//   pattern        reads                 writes            bytes/param
//   adam           p g m v  (16 B)       p m v   (12 B)    28
//   adam_copy      p g m v  (16 B)       p m v p16 (14 B)  30
//   adam_remainder g m v pb r t          m v pb r t        28.25
//                  (16.125 B)            (12.125 B)        (pb bf16 params, r int16 remainders, t tie bits)
//   adagrad        p g s    (12 B)       p s     (8 B)     20  (+2 with copy)
//   lion           p g m    (12 B)       p m     (8 B)     20  (+2 with copy)
//   acc_fp32       acc g32  (8 B)        acc     (4 B)     12
//   acc_bf16       acc g16  (6 B)        acc     (4 B)     10
//
// The loops are compiled twice, for AVX2 (the attribute target("avx2")) and for
// the baseline ISA, and picked at run time with __builtin_cpu_supports; the
// bench's translation unit is built with -O3 so the plain loops auto-vectorise
// (check with -fopt-info-vec-optimized: every *_body loop must be reported
// "vectorized"). The copy-out loops with non-temporal stores are written with
// intrinsics (AVX2: 16 elements and one 32-byte stream store per iteration;
// baseline SSE2: 8 and 16 bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tzbench {

enum class Pattern : std::uint8_t {
  kAdam, kAdamCopy, kAdamRemainder, kAdagrad, kAdagradCopy, kLion, kLionCopy, kAccFp32, kAccBf16,
  kAdamInt8,           // fp32 master, int8 moments (codes + a scale per 256 elements each)
  kAdamRemainderInt8,  // remainder master, int8 moments: the most compact formats
};

// The arrays, as raw words. For Adagrad `v` is the running sum of squares; for
// the gradient-arrival patterns `acc` is the accumulation buffer.
struct StreamArrays {
  std::uint32_t* p = nullptr;
  const std::uint32_t* g = nullptr;    // fp32 gradient
  const std::uint16_t* g16 = nullptr;  // bf16 gradient
  std::uint32_t* m = nullptr;
  std::uint32_t* v = nullptr;
  std::uint16_t* p16 = nullptr;        // 16-bit copy-out
  std::uint32_t* acc = nullptr;
  std::uint16_t* pb = nullptr;         // remainder master: bf16 parameters
  std::uint16_t* rem = nullptr;        // ... int16 remainders
  std::uint8_t* ties = nullptr;        // ... tie bits, one per element
  std::uint8_t* m8 = nullptr;          // int8 moments: exp_avg codes
  std::uint8_t* v8 = nullptr;          // ... exp_avg_sq codes
  std::uint32_t* ms = nullptr;         // ... exp_avg block scales, one per 256 elements
  std::uint32_t* vs = nullptr;         // ... exp_avg_sq block scales
};

constexpr double pattern_bytes_per_param(Pattern pattern) {
  switch (pattern) {
    case Pattern::kAdam: return 28;
    case Pattern::kAdamCopy: return 30;
    case Pattern::kAdamRemainder: return 28.25;
    case Pattern::kAdamInt8: return 4 + 2 * (4 + 1 + 1 + 8.0 / 256);           // g; p, codes, scales read + written
    case Pattern::kAdamRemainderInt8: return 4 + 2 * (2 + 2 + 0.125 + 1 + 1 + 8.0 / 256);
    case Pattern::kAdagrad: return 20;
    case Pattern::kAdagradCopy: return 22;
    case Pattern::kLion: return 20;
    case Pattern::kLionCopy: return 22;
    case Pattern::kAccFp32: return 12;
    case Pattern::kAccBf16: return 10;
  }
  return 0;
}

namespace detail {

#define TZB_RESTRICT __restrict__
#define TZB_INLINE [[gnu::always_inline]] inline

TZB_INLINE std::uint16_t top_half(std::uint32_t x) { return static_cast<std::uint16_t>(x >> 16); }

// The bodies: one pass over [begin, end), inlined into each ISA's entry point.
TZB_INLINE void adam_body(std::uint32_t* TZB_RESTRICT p, const std::uint32_t* TZB_RESTRICT g,
                          std::uint32_t* TZB_RESTRICT m, std::uint32_t* TZB_RESTRICT v, std::size_t begin,
                          std::size_t end, std::uint32_t mask) {
  for (std::size_t i = begin; i < end; ++i) {
    const std::uint32_t x = g[i] & mask;
    p[i] ^= x;
    m[i] ^= x;
    v[i] ^= x;
  }
}

TZB_INLINE void adam_copy_body(std::uint32_t* TZB_RESTRICT p, const std::uint32_t* TZB_RESTRICT g,
                               std::uint32_t* TZB_RESTRICT m, std::uint32_t* TZB_RESTRICT v,
                               std::uint16_t* TZB_RESTRICT p16, std::size_t begin, std::size_t end,
                               std::uint32_t mask) {
  for (std::size_t i = begin; i < end; ++i) {
    const std::uint32_t x = g[i] & mask;
    const std::uint32_t np = p[i] ^ x;
    p[i] = np;
    m[i] ^= x;
    v[i] ^= x;
    p16[i] = top_half(np);
  }
}

TZB_INLINE void adam_remainder_body(std::uint16_t* TZB_RESTRICT pb, std::uint16_t* TZB_RESTRICT rem,
                                    std::uint8_t* TZB_RESTRICT ties, const std::uint32_t* TZB_RESTRICT g,
                                    std::uint32_t* TZB_RESTRICT m, std::uint32_t* TZB_RESTRICT v, std::size_t begin,
                                    std::size_t end, std::uint32_t mask) {
  for (std::size_t i = begin; i < end; ++i) {
    const std::uint32_t x = g[i] & mask;
    m[i] ^= x;
    v[i] ^= x;
    pb[i] ^= static_cast<std::uint16_t>(x);
    rem[i] ^= static_cast<std::uint16_t>(x);
  }
  for (std::size_t b = begin / 8; b < (end + 7) / 8; ++b) ties[b] ^= static_cast<std::uint8_t>(mask);
}

// Int8 moments: one byte of each moment per element, one 4-byte scale per
// 256 elements of each; with an fp32 master (pb == nullptr) or a remainder one.
TZB_INLINE void adam_int8_body(const StreamArrays& a, std::size_t begin, std::size_t end, std::uint32_t mask) {
  std::uint32_t* TZB_RESTRICT p = a.p;
  std::uint16_t* TZB_RESTRICT pb = a.pb;
  std::uint16_t* TZB_RESTRICT rem = a.rem;
  const std::uint32_t* TZB_RESTRICT g = a.g;
  std::uint8_t* TZB_RESTRICT m8 = a.m8;
  std::uint8_t* TZB_RESTRICT v8 = a.v8;
  if (pb == nullptr) {
    for (std::size_t i = begin; i < end; ++i) {
      const std::uint32_t x = g[i] & mask;
      p[i] ^= x;
      m8[i] ^= static_cast<std::uint8_t>(x);
      v8[i] ^= static_cast<std::uint8_t>(x);
    }
  } else {
    for (std::size_t i = begin; i < end; ++i) {
      const std::uint32_t x = g[i] & mask;
      pb[i] ^= static_cast<std::uint16_t>(x);
      rem[i] ^= static_cast<std::uint16_t>(x);
      m8[i] ^= static_cast<std::uint8_t>(x);
      v8[i] ^= static_cast<std::uint8_t>(x);
    }
    for (std::size_t b = begin / 8; b < (end + 7) / 8; ++b) a.ties[b] ^= static_cast<std::uint8_t>(mask);
  }
  for (std::size_t b = (begin + 255) / 256; b < (end + 255) / 256; ++b) {  // the blocks starting in the range
    a.ms[b] ^= mask;
    a.vs[b] ^= mask;
  }
}

// Adagrad (p, g, s) and Lion (p, g, m) have the same shape: one state array.
TZB_INLINE void one_state_body(std::uint32_t* TZB_RESTRICT p, const std::uint32_t* TZB_RESTRICT g,
                               std::uint32_t* TZB_RESTRICT s, std::size_t begin, std::size_t end,
                               std::uint32_t mask) {
  for (std::size_t i = begin; i < end; ++i) {
    const std::uint32_t x = g[i] & mask;
    p[i] ^= x;
    s[i] ^= x;
  }
}

TZB_INLINE void one_state_copy_body(std::uint32_t* TZB_RESTRICT p, const std::uint32_t* TZB_RESTRICT g,
                                    std::uint32_t* TZB_RESTRICT s, std::uint16_t* TZB_RESTRICT p16,
                                    std::size_t begin, std::size_t end, std::uint32_t mask) {
  for (std::size_t i = begin; i < end; ++i) {
    const std::uint32_t x = g[i] & mask;
    const std::uint32_t np = p[i] ^ x;
    p[i] = np;
    s[i] ^= x;
    p16[i] = top_half(np);
  }
}

TZB_INLINE void acc_fp32_body(std::uint32_t* TZB_RESTRICT acc, const std::uint32_t* TZB_RESTRICT g,
                              std::size_t begin, std::size_t end, std::uint32_t mask) {
  for (std::size_t i = begin; i < end; ++i) acc[i] ^= g[i] & mask;
}

TZB_INLINE void acc_bf16_body(std::uint32_t* TZB_RESTRICT acc, const std::uint16_t* TZB_RESTRICT g16,
                              std::size_t begin, std::size_t end, std::uint32_t mask) {
  for (std::size_t i = begin; i < end; ++i) acc[i] ^= (static_cast<std::uint32_t>(g16[i]) << 16) & mask;
}

TZB_INLINE void dispatch_body(Pattern pattern, const StreamArrays& a, std::size_t begin, std::size_t end,
                              std::uint32_t mask) {
  switch (pattern) {
    case Pattern::kAdam: adam_body(a.p, a.g, a.m, a.v, begin, end, mask); break;
    case Pattern::kAdamCopy: adam_copy_body(a.p, a.g, a.m, a.v, a.p16, begin, end, mask); break;
    case Pattern::kAdamRemainder: adam_remainder_body(a.pb, a.rem, a.ties, a.g, a.m, a.v, begin, end, mask); break;
    case Pattern::kAdagrad: one_state_body(a.p, a.g, a.v, begin, end, mask); break;
    case Pattern::kAdagradCopy: one_state_copy_body(a.p, a.g, a.v, a.p16, begin, end, mask); break;
    case Pattern::kLion: one_state_body(a.p, a.g, a.m, begin, end, mask); break;
    case Pattern::kLionCopy: one_state_copy_body(a.p, a.g, a.m, a.p16, begin, end, mask); break;
    case Pattern::kAccFp32: acc_fp32_body(a.acc, a.g, begin, end, mask); break;
    case Pattern::kAccBf16: acc_bf16_body(a.acc, a.g16, begin, end, mask); break;
    case Pattern::kAdamInt8: {
      StreamArrays fp32 = a;
      fp32.pb = nullptr;
      adam_int8_body(fp32, begin, end, mask);
      break;
    }
    case Pattern::kAdamRemainderInt8: adam_int8_body(a, begin, end, mask); break;
  }
}


#if defined(__x86_64__)
// The copy-out patterns with non-temporal 16-bit stores. kTwo: Adam (states m
// and v); otherwise one state s passed as m (Adagrad, Lion). Elements before
// p16 is aligned for the stream store, and the tail, take the scalar loop.
// srai + packs keeps the top 16 bits exactly (no saturation is possible).
template <bool kTwo>
TZB_INLINE void copy_scalar_part(std::uint32_t* p, const std::uint32_t* g, std::uint32_t* m, std::uint32_t* v,
                                 std::uint16_t* p16, std::size_t i, std::size_t end, std::uint32_t mask) {
  for (; i < end; ++i) {
    const std::uint32_t x = g[i] & mask;
    const std::uint32_t np = p[i] ^ x;
    p[i] = np;
    m[i] ^= x;
    if constexpr (kTwo) v[i] ^= x;
    p16[i] = top_half(np);
  }
}

template <bool kTwo>
[[gnu::target("avx2")]] void copy_nt_avx2(std::uint32_t* p, const std::uint32_t* g, std::uint32_t* m,
                                          std::uint32_t* v, std::uint16_t* p16, std::size_t begin, std::size_t end,
                                          std::uint32_t mask) {
  std::size_t i = begin;
  std::size_t head = (32 - reinterpret_cast<std::uintptr_t>(p16 + i) % 32) % 32 / 2;
  if (head > end - i) head = end - i;
  copy_scalar_part<kTwo>(p, g, m, v, p16, i, i + head, mask);
  i += head;
  const __m256i k = _mm256_set1_epi32(static_cast<int>(mask));
#define TZB_LD(a) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))
#define TZB_ST(a, x) _mm256_storeu_si256(reinterpret_cast<__m256i*>(a), x)
  for (; i + 16 <= end; i += 16) {
    const __m256i x0 = _mm256_and_si256(TZB_LD(g + i), k), x1 = _mm256_and_si256(TZB_LD(g + i + 8), k);
    const __m256i p0 = _mm256_xor_si256(TZB_LD(p + i), x0), p1 = _mm256_xor_si256(TZB_LD(p + i + 8), x1);
    TZB_ST(p + i, p0);
    TZB_ST(p + i + 8, p1);
    TZB_ST(m + i, _mm256_xor_si256(TZB_LD(m + i), x0));
    TZB_ST(m + i + 8, _mm256_xor_si256(TZB_LD(m + i + 8), x1));
    if constexpr (kTwo) {
      TZB_ST(v + i, _mm256_xor_si256(TZB_LD(v + i), x0));
      TZB_ST(v + i + 8, _mm256_xor_si256(TZB_LD(v + i + 8), x1));
    }
    const __m256i h = _mm256_packs_epi32(_mm256_srai_epi32(p0, 16), _mm256_srai_epi32(p1, 16));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p16 + i), _mm256_permute4x64_epi64(h, 0xD8));
  }
#undef TZB_LD
#undef TZB_ST
  copy_scalar_part<kTwo>(p, g, m, v, p16, i, end, mask);
  _mm_sfence();
}

template <bool kTwo>
void copy_nt_sse2(std::uint32_t* p, const std::uint32_t* g, std::uint32_t* m, std::uint32_t* v, std::uint16_t* p16,
                  std::size_t begin, std::size_t end, std::uint32_t mask) {
  std::size_t i = begin;
  std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(p16 + i) % 16) % 16 / 2;
  if (head > end - i) head = end - i;
  copy_scalar_part<kTwo>(p, g, m, v, p16, i, i + head, mask);
  i += head;
  const __m128i k = _mm_set1_epi32(static_cast<int>(mask));
#define TZB_LD(a) _mm_loadu_si128(reinterpret_cast<const __m128i*>(a))
#define TZB_ST(a, x) _mm_storeu_si128(reinterpret_cast<__m128i*>(a), x)
  for (; i + 8 <= end; i += 8) {
    const __m128i x0 = _mm_and_si128(TZB_LD(g + i), k), x1 = _mm_and_si128(TZB_LD(g + i + 4), k);
    const __m128i p0 = _mm_xor_si128(TZB_LD(p + i), x0), p1 = _mm_xor_si128(TZB_LD(p + i + 4), x1);
    TZB_ST(p + i, p0);
    TZB_ST(p + i + 4, p1);
    TZB_ST(m + i, _mm_xor_si128(TZB_LD(m + i), x0));
    TZB_ST(m + i + 4, _mm_xor_si128(TZB_LD(m + i + 4), x1));
    if constexpr (kTwo) {
      TZB_ST(v + i, _mm_xor_si128(TZB_LD(v + i), x0));
      TZB_ST(v + i + 4, _mm_xor_si128(TZB_LD(v + i + 4), x1));
    }
    _mm_stream_si128(reinterpret_cast<__m128i*>(p16 + i), _mm_packs_epi32(_mm_srai_epi32(p0, 16), _mm_srai_epi32(p1, 16)));
  }
#undef TZB_LD
#undef TZB_ST
  copy_scalar_part<kTwo>(p, g, m, v, p16, i, end, mask);
  _mm_sfence();
}
#define TZB_HAVE_NT_COPY 1
#endif

#undef TZB_INLINE
#undef TZB_RESTRICT

#if defined(__x86_64__) || defined(__i386__)
[[gnu::target("avx2"), gnu::noinline]] inline void stream_avx2(Pattern pattern, const StreamArrays& a,
                                                                std::size_t begin, std::size_t end,
                                                                std::uint32_t mask) {
  dispatch_body(pattern, a, begin, end, mask);
}
#define TZB_HAVE_AVX2_LOOPS 1
#endif

[[gnu::noinline]] inline void stream_baseline(Pattern pattern, const StreamArrays& a, std::size_t begin,
                                              std::size_t end, std::uint32_t mask) {
  dispatch_body(pattern, a, begin, end, mask);
}

// Zero, but the compiler cannot know it.
inline volatile std::uint32_t g_zero_mask = 0;

}  // namespace detail

// The loop variant this CPU runs: "avx2" or "baseline".
inline std::string_view stream_isa() {
#ifdef TZB_HAVE_AVX2_LOOPS
  if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
  return "baseline";
}

// One limit pass over elements [begin, end) of the arrays. Thread-safe for
// disjoint ranges. plain_copy: the copy-out patterns store p16 with plain
// stores instead of non-temporal ones (for comparison only).
inline void stream_range(Pattern pattern, const StreamArrays& a, std::size_t begin, std::size_t end,
                         bool plain_copy = false) {
  const std::uint32_t mask = detail::g_zero_mask;
#ifdef TZB_HAVE_AVX2_LOOPS
  static const bool avx2 = __builtin_cpu_supports("avx2");
#else
  constexpr bool avx2 = false;
#endif
#ifdef TZB_HAVE_NT_COPY
  if (!plain_copy) {
    switch (pattern) {
      case Pattern::kAdamCopy:
        return avx2 ? detail::copy_nt_avx2<true>(a.p, a.g, a.m, a.v, a.p16, begin, end, mask)
                    : detail::copy_nt_sse2<true>(a.p, a.g, a.m, a.v, a.p16, begin, end, mask);
      case Pattern::kAdagradCopy:
        return avx2 ? detail::copy_nt_avx2<false>(a.p, a.g, a.v, nullptr, a.p16, begin, end, mask)
                    : detail::copy_nt_sse2<false>(a.p, a.g, a.v, nullptr, a.p16, begin, end, mask);
      case Pattern::kLionCopy:
        return avx2 ? detail::copy_nt_avx2<false>(a.p, a.g, a.m, nullptr, a.p16, begin, end, mask)
                    : detail::copy_nt_sse2<false>(a.p, a.g, a.m, nullptr, a.p16, begin, end, mask);
      default: break;
    }
  }
#else
  (void)plain_copy;
#endif
#ifdef TZB_HAVE_AVX2_LOOPS
  if (avx2) return detail::stream_avx2(pattern, a, begin, end, mask);
#endif
  detail::stream_baseline(pattern, a, begin, end, mask);
}

}  // namespace tzbench
