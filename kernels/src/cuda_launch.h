// Private to kernels/: the .cu launchers. They return cudaError_t and include
// nothing of tierzero's, because nvcc's host pass cannot compile fmt (and so
// Status); kernels/src/*_cuda.cpp wrap them into Status with TZ_CUDA_CHECK.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tz::kernels::launch {

cudaError_t cast_fp32_to_bf16(const float* d_src, std::uint16_t* d_dst, std::size_t n, cudaStream_t stream);
cudaError_t cast_fp32_to_fp16(const float* d_src, std::uint16_t* d_dst, std::size_t n, cudaStream_t stream);

}  // namespace tz::kernels::launch
