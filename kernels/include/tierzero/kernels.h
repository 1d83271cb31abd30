// tierzero/kernels.h: element-wise kernels the engine runs on the device, each
// with a CPU twin that has the same contract (CPU twins run on the Host
// backend and are the reference the CUDA versions are tested against).
//
// The casts convert fp32 to the 16-bit formats the engine stores parameters
// in; the optimizer kernels (below the casts) are what a step on the device
// needs: gradient unscaling with an inf/NaN check, per-tensor squared norms
// over many tensors in one call, and Adam/AdamW on fp32 master weights. Rounding: round-to-nearest-even for finite values, overflow
// to fp16 goes to +-inf as IEEE conversion does; CUDA and CPU agree bit for bit
// there. NaN stays NaN (quiet), but its payload and sign may differ between
// the CPU twin (kept) and CUDA (canonical NaN).
//
//   tz::kernels::cast_fp32_to_bf16_cpu(master.data(), bf16.data(), n);
//   TZ_TRY(tz::kernels::cast_fp32_to_bf16_cuda(d_src, d_dst, n, stream_handle));
//
// Pointers: `src` and `dst` must not overlap; CUDA versions take device
// pointers and a cudaStream_t passed as void* (so this header needs no CUDA):
// tz::Stream::native_handle() of a CUDA-backend stream.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tierzero/common.h"

namespace tz::kernels {

// Scalar conversions (exact for bf16/fp16 -> fp32).
std::uint16_t fp32_to_bf16(float value);
std::uint16_t fp32_to_fp16(float value);
float bf16_to_fp32(std::uint16_t bits);
float fp16_to_fp32(std::uint16_t bits);

// CPU twins.
void cast_fp32_to_bf16_cpu(const float* src, std::uint16_t* dst, std::size_t n);
void cast_fp32_to_fp16_cpu(const float* src, std::uint16_t* dst, std::size_t n);

// True when the build has CUDA kernels (TIERZERO_CUDA=ON).
bool cuda_kernels_built();

// CUDA kernels, asynchronous on `cuda_stream` (a cudaStream_t). Unavailable
// Status in builds without CUDA.
Status cast_fp32_to_bf16_cuda(const float* d_src, std::uint16_t* d_dst, std::size_t n, void* cuda_stream);
Status cast_fp32_to_fp16_cuda(const float* d_src, std::uint16_t* d_dst, std::size_t n, void* cuda_stream);

// ---------------------------------------------------------------- optimizer kernels
//
//   bool bad = tz::kernels::unscale_cpu(grad, n, 1.0F / loss_scale);
//   TZ_TRY(tz::kernels::unscale_cuda(d_grad, n, 1.0F / loss_scale, d_found, stream));
//   TZ_TRY(tz::kernels::squared_norms_cuda(tensors.data(), tensors.size(), d_norms, stream));
//   TZ_TRY(tz::kernels::adam_step_cuda({d_param, d_grad, d_m, d_v, d_param16}, n, hyper, stream));

// g (n,) fp32 *= inv_scale, in place. The CPU twin returns whether any
// element is inf or NaN (before or after scaling); the CUDA kernel sets
// *d_found_non_finite (an int in device memory) to 1 when it finds one and
// never clears it, so one flag can collect several calls: zero it first.
// A power-of-two inv_scale (dynamic loss scaling) is exact.
bool unscale_cpu(float* g, std::size_t n, float inv_scale);
Status unscale_cuda(float* d_g, std::size_t n, float inv_scale, int* d_found_non_finite, void* cuda_stream);

// One fp32 tensor of a multi-tensor call.
struct TensorRef {
  const float* data = nullptr;   // host memory for the CPU twin, device memory for CUDA
  std::size_t numel = 0;
};

// out[t] = the sum of squares of tensors[t], for `count` tensors in one call.
// CPU twin: summed in double, out in host memory. CUDA: fp32 per thread over
// fixed 64 Ki-element chunks, double across threads and chunks, in a fixed
// order, so the same inputs give the same bits; `tensors` is a host array
// (of device pointers) and d_out (count,) doubles in device memory. Both
// agree with an exact sum to ~1e-6 relative. Non-finite elements make the
// sum non-finite (that is the overflow check of the step).
void squared_norms_cpu(const TensorRef* tensors, std::size_t count, double* out);
Status squared_norms_cuda(const TensorRef* tensors, std::size_t count, double* d_out, void* cuda_stream);

// Adam / AdamW on fp32 master weights, torch.optim semantics: with
// g = grad * grad_scale (unscaling and clipping folded into one factor),
//   Adam:  g += weight_decay * p          AdamW: p *= 1 - lr * weight_decay
//   m = beta1 m + (1 - beta1) g,  v = beta2 v + (1 - beta2) g^2
//   p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// in fp32 per element (the bias corrections in double, once per call).
// param16, when not null, receives bf16(p) (the engine's 16-bit copy-out).
struct AdamHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool adamw = true;
  std::int64_t step = 1;         // 1-based: the step being taken
  double grad_scale = 1;
};
struct AdamTensors {
  float* param = nullptr;            // (n,) fp32 master weights, updated
  const float* grad = nullptr;       // (n,) fp32
  float* exp_avg = nullptr;          // (n,) fp32 first moment, updated
  float* exp_avg_sq = nullptr;       // (n,) fp32 second moment, updated
  std::uint16_t* param16 = nullptr;  // (n,) bf16 copy-out, or null
};
// The CPU twin (a plain loop: cpu_adam is the fast CPU optimizer; this is
// the CUDA kernel's reference). Invalid hyper-parameters (step < 1, betas
// outside [0, 1)) are an InvalidArgument naming the value, for both.
Status adam_step_cpu(const AdamTensors& t, std::size_t n, const AdamHyper& h);
Status adam_step_cuda(const AdamTensors& d_t, std::size_t n, const AdamHyper& h, void* cuda_stream);

// Adam / AdamW on the compact state formats (tierzero/common/state_format.h,
// issue #21), decoded, stepped and encoded in one pass: the master fp32 or
// "remainder" (its bf16 parameter + an int16 remainder + a tie bit, Note
// [Remainder masters] in cpu_adam/src/remainder.h), the moments fp32 or bf16
// (exp_avg round-to-nearest-even, exp_avg_sq by stochastic rounding: Note
// [Stochastic rounding of bf16 second moments] in tierzero/cpu_adam.h).
// Every element gets cpu_adam's arithmetic, so the results are cpu_adam's
// bits (Note [Compact Adam arithmetic] in kernels/src/adam_math.h: the CUDA
// kernel matches cpu_adam's fused-multiply-add variants, AVX2 and AVX-512).
// int8 moments (codes and one fp32 scale per 256 elements, Note [Int8
// moments] in cpu_adam/src/int8_codes.h) step block by block, decoded,
// stepped in fp32 and encoded as cpu_adam does (Note [Int8 moments on the
// GPU] in kernels/src/int8_math.h), with cpu_adam's code tables passed in:
// element 0 of an int8 call starts a 256-element block (its scales are
// exp_avg_scale[0], ...), and a remainder master's tie_bit_offset is a
// multiple of 8. A block's elements must step in one call (its scale is of
// all of them): weight_decay_runs give parts of a call their own weight
// decay, so a weight-decay segment needs no launch of its own.
//
//   AdamCompactTensors t{.master_format = MasterFormat::kRemainder, .param16 = d_bf16, .remainder = d_rem,
//                        .tie_bits = d_ties, .grad = d_grad, .moment_format = MomentFormat::kBf16,
//                        .exp_avg = d_m, .exp_avg_sq = d_v,
//                        .sr_key = state_math::sr_step_key(key, step, index), .sr_base = uint32_t(index)};
//   TZ_TRY(tz::kernels::adam_step_compact_cuda(t, n, hyper, stream));
// Elements [begin, end) of a call (indices from the call's element 0) step
// with this weight decay instead of AdamHyper::weight_decay (and Adam's L2
// term or AdamW's decay as that weight decay gives them).
struct WeightDecayRun {
  std::uint64_t begin = 0, end = 0;
  double weight_decay = 0;
};
// One int8 code's tables (tz::cpu_adam::int8_code_tables): 256 fp32 each,
// host memory for the CPU twin, device memory for CUDA.
struct Int8CodeTables {
  const float* decode = nullptr;  // the value of each code byte, in units of the block's scale
  const float* mid = nullptr;     // midpoints between the levels, +inf past the last
};
struct AdamCompactTensors {
  MasterFormat master_format = MasterFormat::kFp32;
  float* master = nullptr;            // (n,) fp32 master (kFp32), updated
  std::uint16_t* param16 = nullptr;   // (n,) bf16: kFp32: the copy-out, or null; kRemainder: the master's bf16 half
  std::int16_t* remainder = nullptr;  // (n,) kRemainder, updated
  // kRemainder: element i's tie bit is bit (tie_bit_offset + i) % 8 of byte
  // (tie_bit_offset + i) / 8; the array's other bits are left as they are.
  std::uint8_t* tie_bits = nullptr;
  std::uint64_t tie_bit_offset = 0;
  const float* grad = nullptr;        // (n,) fp32
  MomentFormat moment_format = MomentFormat::kFp32;
  void* exp_avg = nullptr;            // (n,) fp32, bf16 or int8 codes (uint8), updated
  void* exp_avg_sq = nullptr;         // (n,) fp32, bf16 or int8 codes (uint8), updated
  // bf16 moments: element i's exp_avg_sq rounds with the random bits
  // state_math::sr_hash(sr_base + i, sr_key) >> 16 (uint32, wrapping).
  std::uint32_t sr_key = 0;
  std::uint32_t sr_base = 0;
  // int8 moments: the block scales, (ceil(n / 256),) fp32 each, updated, and the codes' tables.
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  Int8CodeTables exp_avg_code, exp_avg_sq_code;
  // Sorted, disjoint, inside [0, n); a host array for both twins (the CUDA
  // call copies what it needs to the device, stream-ordered).
  const WeightDecayRun* weight_decay_runs = nullptr;
  std::size_t weight_decay_run_count = 0;
};
struct AdamCompactCpuOptions {
  // Note [Compact Adam arithmetic]: true (the CUDA kernel's) matches
  // cpu_adam's AVX2/AVX-512 kernels; false its scalar and SSE4.2 kernels.
  bool fused_multiply_add = true;
};
// Errors: InvalidArgument for a missing array of the chosen formats (the
// scales and tables of int8 moments included), an int8 call with tie bits not
// starting a byte, weight-decay runs unsorted, overlapping or past n, or the
// hyper-parameters adam_step_cpu refuses.
Status adam_step_compact_cpu(const AdamCompactTensors& t, std::size_t n, const AdamHyper& h,
                             const AdamCompactCpuOptions& options = {});
Status adam_step_compact_cuda(const AdamCompactTensors& d_t, std::size_t n, const AdamHyper& h, void* cuda_stream);

// The gradient-arrival pass of an optimizer on the device: the reduced
// gradient shard (fp32, bf16 or fp16) into the fp32 accumulator,
//   acc[i] = (overwrite ? 0 : acc[i]) + scale * grad[i]   (one fused multiply-add)
// scale is 1 / (ranks x accumulation steps): the mean. acc and grad must not
// overlap. Follow with squared_norms_* on acc for the norm and overflow check.
void accumulate_grad_cpu(float* acc, const void* grad, DType format, std::size_t n, bool overwrite, float scale);
Status accumulate_grad_cuda(float* d_acc, const void* d_grad, DType format, std::size_t n, bool overwrite,
                            float scale, void* cuda_stream);

// ---------------------------------------------------------------- flatten / unflatten
//
// Many tensors into one flat buffer at their offsets (a block's gradients into
// its GradBlock, in one launch instead of one copy per parameter), and back.
// Byte copies, so any element type: `bytes` and `offset` are in bytes. The
// tensors must not overlap each other or the flat buffer's other slices.
// A slice whose tensor is nullptr is a gap: flatten writes `bytes` zero bytes
// there (a missing gradient, the padding between parameters), unflatten
// skips it; so a whole buffer is filled in one launch.
//
//   std::vector<tz::kernels::Slice> s = {{grad_w, 0, w_bytes}, {grad_b, w_off, b_bytes}};
//   TZ_TRY(tz::kernels::flatten_cuda(s.data(), s.size(), d_flat, stream));
struct Slice {
  void* tensor = nullptr;       // the tensor's memory (read by flatten, written by unflatten); nullptr: zeros
  std::size_t offset = 0;       // where it lies in the flat buffer, bytes
  std::size_t bytes = 0;
};
void flatten_cpu(const Slice* slices, std::size_t count, void* flat);
void unflatten_cpu(const void* flat, const Slice* slices, std::size_t count);
// `slices` is a host array (of device pointers); asynchronous on the stream.
Status flatten_cuda(const Slice* slices, std::size_t count, void* d_flat, void* cuda_stream);
Status unflatten_cuda(const void* d_flat, const Slice* slices, std::size_t count, void* cuda_stream);

}  // namespace tz::kernels
