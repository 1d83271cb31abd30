// The formats the optimizer's states are stored in, and what each costs.
//
// Mixed-precision Adam keeps, beside the 16-bit parameter, an fp32 master
// weight and two fp32 moments: 12 B a parameter. The compact formats
// (issue #21) store the same states in fewer bytes:
//
//   state    format       bytes/elem   what is stored per element
//   master   fp32         4            the fp32 master weight
//            remainder    2.125        an int16 remainder + one tie bit; with
//                                      the bf16 parameter the tiers already
//                                      hold, the fp32 master rebuilt bit for bit
//   moments  fp32         8            exp_avg + exp_avg_sq, fp32 each
//            bf16         4            both in bf16
//            int8         2.03125      both as 8-bit codes, block-wise: one
//                                      fp32 scale per kInt8MomentBlockNumel
//                                      elements of each moment
//   grads    fp32         4            the gradient accumulator in fp32
//            bf16 | fp16  2            in the 16-bit training dtype
//                                      (DeepSpeed's data_types.grad_accum_dtype;
//                                      Note [16-bit gradient accumulators])
//
// Note [Master remainder]: bf16 b = round-to-nearest-even(m) of an fp32
// master m. The fp32 values that round to b lie within half a bf16 step of
// it: 2^16 - 1 of them when b's last mantissa bit is odd (ties go away from
// it), 2^16 + 1 when it is even (both ties come to it). An exact rebuild of m
// from b therefore needs 65537 codes for even b: a 16-bit remainder and one
// more bit, kept packed 8 to a byte beside the remainders.
//
// Note [State formats]: these definitions are the one place the layouts'
// sizes live. The config names them (tierzero.states), the planner sizes
// tiers and traffic with them, and the kernels, stores and checkpoints that
// implement a format must store exactly this many bytes (the block size
// above included), so what the planner promised is what is allocated.
// Defaults (fp32, fp32) are today's layout bit for bit.
#pragma once

#include <cstdint>
#include <string_view>

namespace tz {

enum class MasterFormat : std::uint8_t { kFp32, kRemainder };
enum class MomentFormat : std::uint8_t { kFp32, kBf16, kInt8 };
// The gradient accumulator's dtype. A 16-bit one is the training dtype
// (check_state_formats() in config.h refuses the others).
enum class GradFormat : std::uint8_t { kFp32, kBf16, kFp16 };

// Every format, in the order the config's error messages list them.
inline constexpr MasterFormat kMasterFormats[] = {MasterFormat::kFp32, MasterFormat::kRemainder};
inline constexpr MomentFormat kMomentFormats[] = {MomentFormat::kFp32, MomentFormat::kBf16, MomentFormat::kInt8};
inline constexpr GradFormat kGradFormats[] = {GradFormat::kFp32, GradFormat::kBf16, GradFormat::kFp16};

// Elements of one moment that share one fp32 scale in the int8 format.
inline constexpr std::uint64_t kInt8MomentBlockNumel = 256;
inline constexpr std::uint64_t kInt8MomentScaleBytes = 4;  // fp32

struct StateFormats {
  MasterFormat master = MasterFormat::kFp32;
  MomentFormat moments = MomentFormat::kFp32;
  GradFormat grads = GradFormat::kFp32;  // data_types.grad_accum_dtype

  bool is_default() const {
    return master == MasterFormat::kFp32 && moments == MomentFormat::kFp32 && grads == GradFormat::kFp32;
  }
  friend bool operator==(const StateFormats&, const StateFormats&) = default;
};

// The config's spellings: "fp32" | "remainder", and "fp32" | "bf16" | "int8".
std::string_view master_format_name(MasterFormat format);
std::string_view moment_format_name(MomentFormat format);
std::string_view grad_format_name(GradFormat format);  // "fp32" | "bf16" | "fp16"
// Bytes a gradient accumulator element takes: 4 or 2.
std::uint64_t grad_bytes_per_elem(GradFormat format);

// Bytes that `numel` elements of a shard take in each format, exactly
// (partial tie-bit bytes and partial scale blocks round up).
std::uint64_t master_bytes(MasterFormat format, std::uint64_t numel);
std::uint64_t moments_bytes(MomentFormat format, std::uint64_t numel);  // both moments together
// The same per element, for large shards: 4 or 2.125; 8, 4 or 2.03125.
double master_bytes_per_elem(MasterFormat format);
double moments_bytes_per_elem(MomentFormat format);

// Note [Stored remainder shards]: a stored master shard of `numel` elements
// (numel a multiple of 8) is laid out as numel int16 remainders, then
// numel / 8 tie-bit bytes, then zero padding up to a whole kStoredShardAlign:
// every shard stays an O_DIRECT extent, and shards staged one after another
// start aligned. Layout shards hold a multiple of 2048 elements, so fp32
// masters need no padding and a remainder shard at most 4 KiB less 256 B
// (under 0.2% of a shard of 1M elements; the planner counts the formats'
// bytes without it, and the NVMe store's per-extent slack holds it).
inline constexpr std::uint64_t kStoredShardAlign = 4096;
std::uint64_t stored_master_bytes(MasterFormat format, std::uint64_t numel);

// Note [Stored int8 moment shards]: each moment's stored shard of `numel`
// elements (numel a multiple of 4; layout shards are of 2048) is numel code
// bytes, then ceil(numel / kInt8MomentBlockNumel) fp32 scales, then zero
// padding up to a whole kStoredShardAlign (as Note [Stored remainder shards],
// for O_DIRECT). Both moments' unpadded bytes are moments_bytes(kInt8, numel);
// other formats are numel elements of their dtype, unpadded.
std::uint64_t stored_moment_bytes(MomentFormat format, std::uint64_t numel);  // one moment's shard
// Where a stored int8 moment shard's scales start: after its codes.
inline std::uint64_t int8_moment_scales_offset(std::uint64_t numel) { return numel; }
// Where a stored remainder shard's tie bits start: after its remainders.
inline std::uint64_t remainder_tie_bits_offset(std::uint64_t numel) { return 2 * numel; }

}  // namespace tz
