// CUDA casts fp32 -> bf16/fp16. The conversion intrinsics round to nearest
// even, matching the CPU twins bit for bit except for NaN payloads
// (tests/kernels compare them).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda_launch.h"

namespace tz::kernels::launch {
namespace {

constexpr int kThreads = 256;

__global__ void cast_bf16_kernel(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    dst[i] = __float2bfloat16_rn(src[i]);
  }
}

__global__ void cast_fp16_kernel(const float* __restrict__ src, __half* __restrict__ dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    dst[i] = __float2half_rn(src[i]);
  }
}

// Grid-stride loops: enough blocks to fill an H100/H200 several times over.
unsigned grid_for(std::size_t n) {
  constexpr std::size_t kMaxBlocks = 65535 * 8;
  const std::size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks));
}

}  // namespace

cudaError_t cast_fp32_to_bf16(const float* d_src, std::uint16_t* d_dst, std::size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  cast_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(d_src, reinterpret_cast<__nv_bfloat16*>(d_dst), n);
  return cudaGetLastError();
}

cudaError_t cast_fp32_to_fp16(const float* d_src, std::uint16_t* d_dst, std::size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  cast_fp16_kernel<<<grid_for(n), kThreads, 0, stream>>>(d_src, reinterpret_cast<__half*>(d_dst), n);
  return cudaGetLastError();
}

}  // namespace tz::kernels::launch
