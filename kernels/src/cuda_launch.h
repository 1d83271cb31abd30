// Private to kernels/: the .cu launchers. They return cudaError_t and include
// nothing of tierzero's, because nvcc's host pass cannot compile fmt (and so
// Status); kernels/src/*_cuda.cpp wrap them into Status with TZ_CUDA_CHECK.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "adam_math.h"

namespace tz::kernels::launch {

cudaError_t cast_fp32_to_bf16(const float* d_src, std::uint16_t* d_dst, std::size_t n, cudaStream_t stream);
cudaError_t cast_fp32_to_fp16(const float* d_src, std::uint16_t* d_dst, std::size_t n, cudaStream_t stream);

cudaError_t unscale(float* d_g, std::size_t n, float inv_scale, int* d_found_non_finite, cudaStream_t stream);

struct Tensor {  // tz::kernels::TensorRef without tierzero's headers
  const float* data;
  std::size_t numel;
};
cudaError_t squared_norms(const Tensor* tensors, std::size_t count, double* d_out, cudaStream_t stream);

cudaError_t adam_step(float* d_param, const float* d_grad, float* d_m, float* d_v, std::uint16_t* d_param16,
                      std::size_t n, const detail::AdamCoef& coef, cudaStream_t stream);

// Note [Compact Adam arithmetic]; always fused. s.runs is a host array (the
// launcher copies it to the device); int8 moments: Note [Int8 moments on the GPU].
cudaError_t adam_step_compact(const detail::CompactStep& s, std::size_t n, cudaStream_t stream);

// format: 0 fp32, 1 bf16, 2 fp16 (tz::DType).
cudaError_t accumulate_grad(float* d_acc, const void* d_grad, int format, std::size_t n, bool overwrite, float scale,
                            cudaStream_t stream);

// One launch for many byte copies on the device (flatten / unflatten).
struct Copy {
  void* dst;
  const void* src;  // nullptr: write zeros
  std::size_t bytes;
};
cudaError_t copy_slices(const Copy* copies, std::size_t count, cudaStream_t stream);

}  // namespace tz::kernels::launch
