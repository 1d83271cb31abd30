// What the per-instruction-set kernel objects export to the rest of cpu_adam.
//
// Each kernels_<isa>.cpp is compiled with its own -m flags and exports one
// table of function pointers, one entry per (algorithm kind, gradient dtype,
// moment dtype, parameter layout) combination, so every dtype branch is taken
// once per tile, outside the element loop. See Note [One object per instruction set]
// in kernel_impl.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "int8_codes.h"
#include "tierzero/common/state_math.h"
#include "tierzero/cpu_adam.h"

namespace tz::cpu_adam::detail {

// The element loops the table holds. Adam with weight_decay 0 runs the kAdamW
// loop (p * 1 is exact), so kAdamL2 only ever sees a non-zero L2 term.
enum class Kind : std::uint8_t { kAdamL2, kAdamL2Ams, kAdamW, kAdamWAms, kAdagrad, kLion };
inline constexpr std::size_t kKinds = 6;

// Where the master lives and what is written beside it.
enum class ParamLayout : std::uint8_t {
  kFp32,           // fp32 master in param, no 16-bit copy
  kFp32CopyBf16,   // fp32 master, bf16 copy-out to param16
  kFp32CopyFp16,   // fp32 master, fp16 copy-out to param16
  kBf16Remainder,  // bf16 param16 + remainder + tie bits (Note [Remainder masters])
};
inline constexpr std::size_t kParamLayouts = 4;
inline constexpr std::size_t kGradDtypes = 3;    // fp32, bf16, fp16 (DType order)
inline constexpr std::size_t kMomentDtypes = 2;  // fp32, bf16 (DType order)

// Per-call scalars, already in fp32 (the kernels' arithmetic precision);
// bias corrections and learning-rate schedules were computed in double.
struct StepConsts {
  float scale = 1;           // gradient multiplier (1/loss scale times the clip coefficient)
  float l2 = 0;              // L2 weight decay added to the gradient (Adam, Adagrad)
  float decay = 1;           // decoupled decay factor 1 - lr * wd (AdamW, Lion)
  float beta1 = 0, one_minus_beta1 = 1;
  float beta2 = 0, one_minus_beta2 = 1;
  float eps = 0;
  float neg_step = 0;        // -lr / bc1 (Adam), -clr (Adagrad), -lr (Lion)
  float inv_sqrt_bc2 = 1;    // 1 / sqrt(1 - beta2^t) (Adam)
  // Note [Stochastic rounding of bf16 second moments]: element i's random
  // bits are sr_hash(sr_base + i, sr_key) (uint32 arithmetic, wrapping).
  std::uint32_t sr_key = 0;
  std::uint32_t sr_base = 0;
};

// The stochastic-rounding hash (tierzero/common/state_math.h, shared with the
// GPU optimizer's compact Adam): its high 16 bits are the rounding's random bits.
using state_math::sr_hash;
using state_math::sr_mix32;

// Base pointers of one call's spans (element i is base + i). Spans the kind
// does not use may be null.
struct StepPtrs {
  float* param = nullptr;         // (n,) fp32, the kFp32* layouts only
  const void* grad = nullptr;     // (n,) grad dtype
  void* exp_avg = nullptr;        // (n,) moment dtype
  void* exp_avg_sq = nullptr;     // (n,) moment dtype
  float* max_exp_avg_sq = nullptr;  // (n,) fp32, amsgrad kinds only
  void* param16 = nullptr;        // (n,) copy-out dtype, or the bf16 parameters of kBf16Remainder; null for kFp32
  std::int16_t* remainder = nullptr;  // (n,), kBf16Remainder only
  std::uint8_t* tie_bits = nullptr;   // (ceil(n / 8),) bytes, kBf16Remainder only
};

struct AccPtrs {
  void* acc = nullptr;            // (n,) accumulator dtype (fp32, bf16, fp16)
  const void* grad = nullptr;     // (n,) grad dtype
  float scale = 1;
};

// One tile's share of a gradient-arrival pass. Padded to a cache line: each
// task writes its own slot.
struct alignas(64) TileStat {
  double sum_squares = 0;
  bool non_finite = false;
};

// Updates elements [begin, end) of the spans; begin may be any element. With
// kBf16Remainder, calls whose ranges share a tie-bit byte must not run at
// once (they are one tile's, in order: Note [Weight-decay segments]).
using StepFn = void (*)(const StepConsts& consts, const StepPtrs& ptrs, std::size_t begin, std::size_t end);
// Accumulates elements [begin, end) and reports their statistics.
using AccFn = TileStat (*)(const AccPtrs& ptrs, std::size_t begin, std::size_t end);

// Note [Int8 moments]: one block (count <= kInt8Block elements) of a moment
// decoded to fp32, or encoded from fp32 (returning the block's scale).
using Int8DecodeFn = void (*)(const Int8Code& code, const std::uint8_t* codes, float scale, float* out,
                              std::size_t count);
using Int8EncodeFn = float (*)(const Int8Code& code, const float* in, std::uint8_t* codes, std::size_t count);

struct KernelTable {
  Simd simd = Simd::kScalar;
  StepFn step[kKinds][kGradDtypes][kMomentDtypes][kParamLayouts] = {};
  AccFn accumulate[kGradDtypes][kGradDtypes][2] = {};  // [accumulator dtype][grad dtype][overwrite]
  Int8DecodeFn int8_decode = nullptr;
  Int8EncodeFn int8_encode = nullptr;
};

// One per compiled variant; call only those the CPU supports.
const KernelTable& kernels_scalar();
#if defined(TZ_CPU_ADAM_X86)
const KernelTable& kernels_sse4_2();
const KernelTable& kernels_avx2();
const KernelTable& kernels_avx512();
#endif

}  // namespace tz::cpu_adam::detail
