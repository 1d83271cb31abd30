// Status wrappers around the .cu launchers (see cuda_launch.h for why).
#include <cuda_runtime.h>

#include "cuda_launch.h"
#include "tierzero/common/checks.h"
#include "tierzero/kernels.h"

namespace tz::kernels {

bool cuda_kernels_built() { return true; }

Status cast_fp32_to_bf16_cuda(const float* d_src, std::uint16_t* d_dst, std::size_t n, void* cuda_stream) {
  TZ_CUDA_CHECK(launch::cast_fp32_to_bf16(d_src, d_dst, n, static_cast<cudaStream_t>(cuda_stream)));
  return ok_status();
}

Status cast_fp32_to_fp16_cuda(const float* d_src, std::uint16_t* d_dst, std::size_t n, void* cuda_stream) {
  TZ_CUDA_CHECK(launch::cast_fp32_to_fp16(d_src, d_dst, n, static_cast<cudaStream_t>(cuda_stream)));
  return ok_status();
}

}  // namespace tz::kernels
