// tierzero/kernels.h: element-wise kernels the engine runs on the device, each
// with a CPU twin that has the same contract (CPU twins run on the Host
// backend and are the reference the CUDA versions are tested against).
//
// This first set converts fp32 to the 16-bit formats the engine stores
// parameters in. Rounding: round-to-nearest-even for finite values, overflow
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

}  // namespace tz::kernels
