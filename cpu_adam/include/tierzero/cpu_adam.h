// tierzero/cpu_adam.h: the CPU optimizers that update offloaded states.
//
// One fused pass per element does the whole step: gradient scale (1/loss
// scale times the clip coefficient), weight decay, moment updates, parameter
// update and, when asked, the 16-bit copy of the new parameter into a separate
// buffer (the pinned buffer the engine uploads from). Each byte of optimizer
// state is read and written once per step. Semantics follow torch.optim:
//
//   Adam     g += wd * p (L2);  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
//            p -= lr / (1-b1^t) * m / (sqrt(v) / sqrt(1-b2^t) + eps)
//   AdamW    as Adam, but weight decay is decoupled: p *= 1 - lr * wd first
//   amsgrad  vmax = max(vmax, v), and vmax replaces v in the denominator
//   Adagrad  g += wd * p;  s += g^2;  p -= lr / (1 + (t-1) lr_decay) * g / (sqrt(s) + eps)
//   Lion     p *= 1 - lr * wd;  p -= lr * sign(b1 m + (1-b1) g);  m = b2 m + (1-b2) g
//
// Arithmetic is fp32 (as torch's CPU kernels for fp32 params); bias
// corrections are computed once per step in double. Gradients may be fp32,
// bf16 or fp16; moments fp32 or bf16 (bf16: exp_avg rounded to nearest even,
// exp_avg_sq by stochastic rounding, Note [Stochastic rounding of bf16 second
// moments] below). The 16-bit copy-out is bf16 (round to nearest
// even; NaN stays NaN: (bits >> 16) | 0x40) or fp16 (round to nearest even,
// overflow to inf, NaN as F16C converts it); every variant writes the same
// bits. Where the CPU allows (AVX2, AVX-512) the copy-out is written with
// non-temporal stores in whole 64-byte lines: it is not left in the cache,
// and its lines are not read before being written.
//
// Master weights come in two formats (Spans::master_format):
//   fp32       param holds the fp32 master (4 B a parameter), updated in
//              place; param16, when given, receives the 16-bit copy.
//   remainder  no fp32 array (2.125 B a parameter beside the bf16 parameter):
//              the master of element i is rebuilt bit for bit from the bf16
//              parameter h = param16[i], an int16 remainder r and a tie bit t,
//                bits(master) = (h << 16) + sext(r) + (t ? 0x10000 : 0)   (mod 2^32)
//              stepped in fp32 exactly as above, and split again: param16 =
//              the bf16 copy-out of the new master (the same bits), r and t
//              what it lacks. The step's results are bit-identical to the fp32
//              format's on the rebuilt master. NaN masters keep no payload:
//              r = t = 0, so they come back as the bf16 NaN widened.
//              The tie bit is needed because an even bf16 value is the
//              rounding of 65537 fp32 values (both ties round to it), one more
//              than 16 bits can name (Note [Remainder masters] in
//              cpu_adam/src/remainder.h). The bf16 parameters are read, so
//              they are written back with plain stores.
//              encode_remainder_masters/decode_remainder_masters convert
//              between the formats (checkpoints, exports).
//
// SIMD: xsimd kernels compiled once per instruction set (AVX-512, AVX2+FMA,
// SSE4.2, scalar) and picked at run time: the widest the CPU runs, unless
// Options::simd or the TIERZERO_SIMD environment variable ("avx512", "avx2",
// "sse4.2", "scalar") forces one. The choice is logged once.
// Threads: a oneTBB task arena of Options::threads threads (the caller's
// thread takes part), whose workers are pinned with hwloc to the CPUs of one
// NUMA node while they work for it (the caller's thread is left as it is).
// Work is split in cache-sized tiles (automatic ones are a multiple of 64
// elements, so with 64-byte-aligned spans no two threads write one cache line;
// any tile is a multiple of 16, so no two write one tie-bit byte). Results do not
// depend on the thread count or the tile size: every element gets the same
// arithmetic.
//
// Example:
//   TZ_ASSIGN_OR_RETURN(auto opt, tz::cpu_adam::CpuOptimizer::create({.threads = 2}));
//   tz::cpu_adam::Hyper hyper{.algorithm = tz::cpu_adam::Algorithm::kAdamW, .lr = 3e-4, .weight_decay = 0.1};
//   tz::cpu_adam::Spans s{.n = n, .param = master, .grad = grad, .exp_avg = m, .exp_avg_sq = v,
//                         .param16 = bf16_out};
//   TZ_TRY(opt->step(hyper, {.step = t, .grad_scale = clip / loss_scale}, s));
//
// The remainder format steps the same way:
//   tz::cpu_adam::Spans r{.n = n, .grad = grad, .exp_avg = m, .exp_avg_sq = v, .param16 = bf16_params,
//                         .master_format = tz::cpu_adam::MasterFormat::kRemainder,
//                         .remainder = rem, .tie_bits = ties};
//
// Weight decay per element (Spans::weight_decay_segments): the elements of a
// segment step with its weight_decay in place of Hyper::weight_decay, the
// others with Hyper::weight_decay; the results are bit-identical to one step()
// per run of elements with that weight decay (Adam's runs with weight decay 0
// take AdamW's loop, as a whole call would). Runs need not be aligned to
// anything: tiles are cut as without segments, and a tile walks the runs it
// covers (Note [Weight-decay segments] in cpu_adam/src/optimizer.cpp).
//
// Errors: every input is checked before any memory is touched (null spans,
// spans not aligned to their element size or overlapping each other, dtypes a
// span cannot have, a remainder-format call with fp16 parameters or with an
// fp32 param, NaN or out-of-range hyperparameters, step < 1, weight-decay
// segments unsorted, overlapping, empty, past n or with a weight decay that is
// negative, NaN or out of fp32 range); on an
// error nothing is written and the InvalidArgument message names the value and
// its range ("lr = nan is not a number", "beta1 = 1 is outside [0, 1)").
// Hyperparameters and segments are checked even when n == 0 (which is otherwise a no-op).
// Thread safety: one CpuOptimizer may be called from several threads; calls
// run one at a time inside its arena.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "tierzero/common.h"

namespace tz::cpu_adam {

enum class Simd : std::uint8_t { kScalar, kSse4_2, kAvx2, kAvx512 };
std::string_view simd_name(Simd simd);            // "scalar" | "sse4.2" | "avx2" | "avx512"
Expected<Simd> parse_simd(std::string_view name);  // the names above; error lists them
std::vector<Simd> compiled_variants();             // in this build, narrowest first
bool cpu_supports(Simd simd);                      // this CPU (and OS) can run it
Simd best_supported();                             // widest compiled variant the CPU runs


enum class Algorithm : std::uint8_t { kAdam, kAdamW, kAdagrad, kLion };
std::string_view algorithm_name(Algorithm algorithm);

struct Hyper {
  Algorithm algorithm = Algorithm::kAdamW;
  double lr = 1e-3;            // > 0
  double beta1 = 0.9;          // [0, 1); Lion: interpolation for the update sign
  double beta2 = 0.999;        // [0, 1); Lion: momentum decay
  double eps = 1e-8;           // > 0 (Adam, AdamW, Adagrad)
  double weight_decay = 0.0;   // >= 0
  bool amsgrad = false;        // Adam/AdamW only
  double lr_decay = 0.0;       // Adagrad only, >= 0
};

struct StepArgs {
  std::int64_t step = 1;       // 1-based number of this step (bias correction, Adagrad's lr decay)
  double grad_scale = 1.0;     // every gradient is multiplied by this first; finite, > 0
};

// How the master weights are stored (the formulas above describe both): the
// config's tz::MasterFormat (tierzero/common/state_format.h, which also has
// tz::master_format_name and the bytes each format takes).
using MasterFormat = tz::MasterFormat;

// A run of elements with their own weight decay (torch parameter groups with
// different weight_decay).
struct WeightDecaySegment {
  std::size_t begin = 0;      // first element, relative to the spans' first element
  std::size_t end = 0;        // one past the last
  double weight_decay = 0.0;  // >= 0, replaces Hyper::weight_decay for these elements
};

// One shard's state as spans of n elements. Which spans an algorithm needs:
//   Adam/AdamW  master, grad, exp_avg, exp_avg_sq (+ max_exp_avg_sq with amsgrad)
//   Adagrad     master, grad, exp_avg_sq (the running sum of squares; the caller
//               fills it with torch's initial_accumulator_value, 0 by default)
//   Lion        master, grad, exp_avg (the momentum)
// where the master is param (fp32 format), or param16 (bf16) + remainder +
// tie_bits (remainder format; param must then be null: there is no fp32
// master to update, and a caller that passes one expects it to move).
// Spans may start anywhere aligned to their element (4 bytes for fp32, 2 for
// 16-bit); they must not overlap each other. tie_bits holds element i in bit
// i % 8 of byte i / 8, so a span that starts inside a shard's arrays must
// start at a multiple of 8 elements of them; the bits of the last byte past n
// are left as they are. Spans an algorithm or format does not use are ignored.
struct Spans {
  std::size_t n = 0;
  float* param = nullptr;              // (n,) fp32 master weights, updated in place; fp32 format only
  const void* grad = nullptr;          // (n,) grad_dtype
  DType grad_dtype = DType::kFp32;     // fp32 | bf16 | fp16
  void* exp_avg = nullptr;             // (n,) moment_dtype
  void* exp_avg_sq = nullptr;          // (n,) moment_dtype
  DType moment_dtype = DType::kFp32;   // fp32 | bf16 | uint8 (the int8 format's codes, with the scales below)
  float* max_exp_avg_sq = nullptr;     // (n,) fp32, amsgrad only
  void* param16 = nullptr;             // (n,) fp32 format: optional copy of the new param in param16_dtype;
                                       //      remainder format: the bf16 parameters, read and rewritten
  DType param16_dtype = DType::kBf16;  // bf16 | fp16 (remainder format: bf16 only)
  MasterFormat master_format = MasterFormat::kFp32;
  std::int16_t* remainder = nullptr;   // (n,) int16, remainder format only
  std::uint8_t* tie_bits = nullptr;    // (ceil(n / 8),) bytes, remainder format only
  float* exp_avg_scale = nullptr;      // (ceil(n / 256),) fp32, int8 moments only: exp_avg's block scales
  float* exp_avg_sq_scale = nullptr;   // (ceil(n / 256),) fp32, int8 moments only: exp_avg_sq's block scales
  std::span<const WeightDecaySegment> weight_decay_segments;  // empty: Hyper::weight_decay for all n elements;
                                                              // else sorted, disjoint, begin < end <= n; elements
                                                              // outside every segment use Hyper::weight_decay
  // bf16 moments only (Note [Stochastic rounding of bf16 second moments]):
  // which tensor or block the spans belong to, and element 0's index in it.
  std::uint64_t rounding_key = 0;
  std::uint64_t rounding_index = 0;
};

// Note [Stochastic rounding of bf16 second moments]
// Stored round-to-nearest, a bf16 second moment stops moving: bf16 keeps 8
// significant bits, so v = b2 v + (1-b2) g^2 rounds back to the old v unless
// it moved by more than half a bf16 step (2^-9 of v). With torch's default
// b2 = 0.999 that takes g^2 > 4.9 v to go up, and v never comes down: even
// with g = 0, 0.999 v rounds back to v. As gradients shrink in training, v stays
// at its peak and Adam's steps shrink with it. Measured (numpy simulation of
// the kernel's arithmetic, gradients shrinking 20x over 6000 steps, b2 =
// 0.999; bench/results/bf16_moment_rounding/): round-to-nearest ends with v
// 29x its float64 value and the update 81% off; stochastic rounding ends
// with v within 0.4% and the update 4.4% off (fp32 moments: 0%). At b2 =
// 0.95 (the README's main job) neither stalls: 0.47% (round-to-nearest) and
// 0.54% (stochastic v) off, a price worth the b2 = 0.999 case. Adagrad's
// running sum of squares stalls the same way once it is 256 squares deep.
// So exp_avg_sq is stored by stochastic rounding: its fp32 bits plus 16
// random bits, truncated (unbiased: the expected stored value is the fp32
// one). exp_avg moves by (1-b1) = 10% of its gap a step, far above half a
// step, and stays round-to-nearest-even (stochastic there measured no better).
// The random bits are a hash of (Spans::rounding_key, StepArgs::step,
// Spans::rounding_index + i), so an element rounds the same way at the same
// step whatever the tiles, threads, ISA, shard boundaries or tier, and a
// resumed run repeats the bits of the run it resumes. Indices are taken
// modulo 2^32 (elements 2^32 apart in one key share random bits).
//

// Int8 moments (moment_dtype = uint8, tz::MomentFormat::kInt8): each moment
// is n code bytes plus one fp32 scale per block of 256 elements
// (tz::kInt8MomentBlockNumel; the last block may be partial), kept in
// separate arrays. The spans' element 0 starts a block (a sub-span of a shard
// must start at a multiple of 256 elements). Per block the step decodes the
// moments to fp32, steps exactly as with fp32 moments, and encodes them again
// (Note [Int8 moments] in cpu_adam/src/int8_codes.h: the codes, the
// rounding, NaN and zero blocks): one pass over memory. Every variant
// writes the same codes and scales for the same fp32 moments. amsgrad's
// max_exp_avg_sq stays fp32.
enum class Int8Moment : std::uint8_t { kExpAvg, kExpAvgSq };
// fp32 <-> int8 codes and block scales (checkpoints, state dicts), the step's
// own encoding: codes (n,), scales (ceil(n / 256),). n == 0 is a no-op.
// Errors: InvalidArgument naming a null, misaligned or overlapping array.
Status encode_int8_moment(Int8Moment which, const float* x, std::size_t n, std::uint8_t* codes, float* scales);
Status decode_int8_moment(Int8Moment which, const std::uint8_t* codes, const float* scales, std::size_t n, float* x);
// A code's tables, for an optimizer elsewhere (the GPU's, tz::kernels) that
// must write the same codes: decode[c], the value of code byte c in units of
// the block's scale (its square for exp_avg_sq; NaN for the NaN code), and
// mid[k], the fp32 midpoint between magnitudes k and k + 1 (+inf past the
// last); a value's magnitude is the number of midpoints below it. 256 floats
// each, built on first use, valid for the life of the process.
struct Int8CodeTables {
  const float* decode = nullptr;
  const float* mid = nullptr;
};
Int8CodeTables int8_code_tables(Int8Moment which);

// Conversions between the master formats, for checkpoints and exports; the
// bits are the step's (bf16 = round to nearest even, NaN as the copy-out).
// fp32 -> (bf16, remainder, tie bits), and back, bit for bit except NaN
// payloads. Arrays as in Spans (tie_bits: ceil(n / 8) bytes, bits past n in
// the last byte left as they are); they must not overlap. Single-threaded
// plain loops, 1 to 2 ns an element; n == 0 is a no-op. Errors:
// InvalidArgument naming a null, misaligned or overlapping array.
Status encode_remainder_masters(const float* master, std::size_t n, std::uint16_t* bf16, std::int16_t* remainder,
                                std::uint8_t* tie_bits);
Status decode_remainder_masters(const std::uint16_t* bf16, const std::int16_t* remainder,
                                const std::uint8_t* tie_bits, std::size_t n, float* master);

// What a gradient-arrival pass saw in the accumulated buffer.
struct GradStats {
  double sum_squares = 0;   // sum of acc[i]^2 after accumulation: fp32 lanes over 64 vectors at a time,
                            // then fp64 (relative error < 4e-6; squares beyond fp32 range are redone in fp64)
  bool non_finite = false;  // some acc[i] is inf or NaN (sum_squares is then inf or NaN)
};

struct Options {
  int threads = 0;                 // 0: every CPU of the NUMA node (or of the machine); at most the CPUs
                                   // this process may use (more would only queue)
  int numa_node = -1;              // pin workers to this node's CPUs; -1: the node of CPU 0, no pinning on 1-node machines
  std::optional<Simd> simd;        // force a variant (must be compiled and supported); else TIERZERO_SIMD
  std::size_t tile_elems = 0;      // elements per task, a multiple of 16; 0: half of L2 over the pass's
                                   // arrays, 16K-64K elements
};

class CpuOptimizer {
 public:
  static Expected<std::unique_ptr<CpuOptimizer>> create(const Options& options);
  virtual ~CpuOptimizer() = default;

  // One optimizer step over the spans (see the formulas above).
  virtual Status step(const Hyper& hyper, const StepArgs& args, const Spans& spans) = 0;

  // The gradient-arrival pass: acc[i] = (overwrite ? 0 : acc[i]) + scale * grad[i],
  // returning the squared L2 norm and non-finite flag of the new acc in the same read.
  // acc is (n,) fp32, grad (n,) grad_dtype; they must not overlap; scale must be
  // finite in fp32. With overwrite, acc is only written (old inf/NaN are forgotten).
  Expected<GradStats> accumulate_grad(float* acc, const void* grad, DType grad_dtype, std::size_t n,
                                      bool overwrite, double scale = 1.0) {
    return accumulate_grad(acc, DType::kFp32, grad, grad_dtype, n, overwrite, scale);
  }
  // The same into an accumulator of acc_dtype (fp32, bf16 or fp16; Note
  // [16-bit gradient accumulators], engine/src/gradient_path.h): each new
  // acc[i] is the fp32 result above rounded to nearest even in acc_dtype, and
  // the statistics are of the values stored.
  virtual Expected<GradStats> accumulate_grad(void* acc, DType acc_dtype, const void* grad, DType grad_dtype,
                                              std::size_t n, bool overwrite, double scale = 1.0) = 0;

  // Copies each job's bytes (dst and src must not overlap) on the optimizer's
  // threads, in chunks: a step under backward keeps a block's old states this
  // way (Note [Stepping under backward], engine/src/step_ahead.h), and one
  // thread's memcpy there ran at a fifth of the step's own speed.
  struct CopyJob {
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t bytes = 0;
  };
  virtual Status copy(std::span<const CopyJob> jobs) = 0;

  virtual Simd simd() const = 0;
  virtual int threads() const = 0;
};

}  // namespace tz::cpu_adam
