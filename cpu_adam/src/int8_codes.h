// The 8-bit block-wise moment codes (MomentFormat::kInt8).
//
// Note [Int8 moments]
// Each moment is stored as one byte per element plus one fp32 scale per
// block of kInt8MomentBlockNumel = 256 elements (tierzero/common/state_format.h:
// 2.03125 B an element for both moments). A block's scale is the largest
// finite |x| of its elements (for exp_avg_sq: of sqrt(x), see below); each
// element is coded as the nearest of a fixed, non-linear set of levels in
// [-1, 1] (exp_avg) or [0, 1] (exp_avg_sq) of x / scale, and decoded as
// level * scale. The level sets follow the shape of bitsandbytes' dynamic
// 8-bit code (the facts: a sign, then decades of magnitude, each decade
// finer than the one below it; the tables here are our own):
//   exp_avg     signed: 0 and 127 magnitudes, decade d = 0..6 ([10^(d-7),
//               10^(d-6)]) holding 2^d levels spaced evenly in its upper 90%,
//               the top one exactly 1 (so the block's largest element is
//               exact); code = sign << 7 | magnitude index. 0x80 (-0) is NaN.
//   exp_avg_sq  unsigned, on sqrt(v): 0 and 254 levels, decades d = 0..7 of
//               2^d levels (the top decade 127), from 1e-7 to 1; 0xff is NaN.
//               The level is of sqrt(v) / sqrt(max v), decoded squared: 8
//               decades of sqrt(v) reach 16 decades of v. A positive value is
//               never coded 0 (it rounds up to the smallest level): a second
//               moment of 0 under a non-zero first moment would divide by eps.
//               Why sqrt(v) and not v itself: Note [Int8 second moment] in
//               int8_codes.cpp has the measurements.
// Rounding is to the nearest level in the coded domain (ties to the lower).
// Non-finite elements (inf or NaN) are coded NaN and left out of the scale:
// they stay NaN, and the rest of their block stays finite and exact to the
// code. A block with no finite non-zero element has scale 0 (decodes to 0).
//
// Encoding finds the nearest level without a search: y = x / scale is in
// [0, 1], so its top 16 bits (sign, exponent and 7 mantissa bits: a bucket
// 2^-7 wide relative to y) index a table of the first candidate code, and at
// most two comparisons with the midpoints between levels finish it (every
// bucket holds at most two midpoints; checked when the tables are built). The
// arithmetic is a division, a square root, comparisons and table reads, all
// exact or correctly rounded, so every instruction-set variant writes the
// same codes and scales, bit for bit (tests/cpu_adam/int8_test.cpp). That is
// the scalar, SSE and AVX2 path; AVX-512 counts the same midpoints below y by
// a search over tables in registers (Note [Int8 codes in registers]).
//
// Note [Int8 codes in registers]
// Memory gathers (the bucket table, then two midpoints, per 16 elements; the
// decode table) made the fused int8 step about nine times slower than the
// fp32 one. On the AMD EPYC (Zen 5) measured, encoding and decoding both
// moments took 4.3 ns per element with AVX-512 gathers, against 0.15 ns for
// the whole fp32 step on cached data (bench/RESULTS.md "The fused int8 kernel,
// made fast"). The AVX-512 variant keeps the tables in registers instead and
// reads them with permutes (one register is 16 floats, a two-register permute
// 32); the codes then take 1.6 ns per element:
//   encode: the code is the number of midpoints below y (mid[] is increasing,
//           +inf past the last, so this is the count the bucket table and its
//           comparisons find), by binary search over the midpoints padded to
//           N = 128 (signed) or 256 (unsigned) entries: log2(N) rounds, round r
//           comparing y with one of 2^r candidates, mid[(2i + 1) * N / 2^(r+1)
//           - 1] for the index i so far (`search`, laid out by round).
//   decode: decode[code], a 256-entry lookup by eight two-register permutes
//           and a selection on the code's top three bits.
// Both are comparisons and copies of the same fp32 values the scalar variant
// reads, so the codes and the decoded values stay bit for bit the scalar ones.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tierzero/common/state_format.h"

namespace tz::cpu_adam::detail {

inline constexpr std::size_t kInt8Block = kInt8MomentBlockNumel;
static_assert(kInt8Block == 256);

// y values whose top 16 bits are below kBucketKey0 share bucket 0 (y < 2^-33,
// far below the smallest level, 1e-7 of the scale).
inline constexpr std::uint32_t kBucketKey0 = (127 - 33) << 7;
inline constexpr std::uint32_t kBucketCount = 0x3f80 - kBucketKey0 + 1;  // up to y = 1.0

// Where each binary-search round's candidates start in Int8Code::search.
inline constexpr std::uint32_t kInt8SearchOffset[9] = {0, 16, 32, 48, 64, 80, 112, 176, 304};
inline constexpr std::size_t kInt8SearchFloats = kInt8SearchOffset[8];

struct Int8Code {
  alignas(64) float decode[256] = {};  // value of each code byte (NaN for the NaN code)
  alignas(64) float mid[256] = {};     // mid[k]: between magnitudes k and k + 1; +inf past the last
  alignas(64) std::uint8_t bucket[kBucketCount + 4] = {};  // first candidate magnitude; +4: 32-bit gathers
  // Note [Int8 codes in registers]: round r's 2^r candidates from search +
  // kInt8SearchOffset[r], each round padded to at least 16 floats.
  alignas(64) float search[kInt8SearchFloats] = {};
  std::uint32_t search_rounds = 0;     // log2(N): 7 (signed) or 8 (unsigned)
  std::uint32_t magnitudes = 0;        // 128 (signed) or 255 (unsigned)
  std::uint32_t nan_code = 0;          // 0x80 or 0xff
  bool is_signed = false;              // exp_avg's code
  bool on_sqrt = false;                // exp_avg_sq's: levels of sqrt(v)
};

// The two codes, built on first use (thread-safe); the kernels take them by pointer.
const Int8Code& int8_code_exp_avg();
const Int8Code& int8_code_exp_avg_sq();

}  // namespace tz::cpu_adam::detail
