// Status wrappers around the optimizer kernels' launchers (see cuda_launch.h
// for why the .cu files stay free of tierzero's headers).
#include <cuda_runtime.h>

#include <vector>

#include "cuda_launch.h"
#include "optim_coef.h"
#include "tierzero/common/checks.h"
#include "tierzero/kernels.h"

namespace tz::kernels {

Status unscale_cuda(float* d_g, std::size_t n, float inv_scale, int* d_found_non_finite, void* cuda_stream) {
  if (n > 0 && d_found_non_finite == nullptr) return invalid_argument("unscale_cuda: no inf/NaN flag given");
  TZ_CUDA_CHECK(launch::unscale(d_g, n, inv_scale, d_found_non_finite, static_cast<cudaStream_t>(cuda_stream)));
  return ok_status();
}

Status squared_norms_cuda(const TensorRef* tensors, std::size_t count, double* d_out, void* cuda_stream) {
  std::vector<launch::Tensor> list(count);
  for (std::size_t t = 0; t < count; ++t) list[t] = {tensors[t].data, tensors[t].numel};
  TZ_CUDA_CHECK(launch::squared_norms(list.data(), count, d_out, static_cast<cudaStream_t>(cuda_stream)));
  return ok_status();
}

Status adam_step_cuda(const AdamTensors& d_t, std::size_t n, const AdamHyper& h, void* cuda_stream) {
  TZ_ASSIGN_OR_RETURN(detail::AdamCoef c, detail::adam_coef(h));
  TZ_CUDA_CHECK(launch::adam_step(d_t.param, d_t.grad, d_t.exp_avg, d_t.exp_avg_sq, d_t.param16, n, c,
                                  static_cast<cudaStream_t>(cuda_stream)));
  return ok_status();
}

Status adam_step_compact_cuda(const AdamCompactTensors& d_t, std::size_t n, const AdamHyper& h, void* cuda_stream) {
  std::vector<detail::DecayRun> runs;  // host memory; the launcher uploads them
  TZ_ASSIGN_OR_RETURN(detail::CompactStep s, detail::compact_step_of(d_t, n, h, true, runs));
  TZ_CUDA_CHECK(launch::adam_step_compact(s, n, static_cast<cudaStream_t>(cuda_stream)));
  return ok_status();
}

Status accumulate_grad_cuda(float* d_acc, const void* d_grad, DType format, std::size_t n, bool overwrite,
                            float scale, void* cuda_stream) {
  // The launch takes the format as its ordinal: 0 fp32, 1 bf16, 2 fp16.
  static_assert(static_cast<int>(DType::kFp32) == 0 && static_cast<int>(DType::kBf16) == 1 &&
                static_cast<int>(DType::kFp16) == 2);
  if (format != DType::kFp32 && format != DType::kBf16 && format != DType::kFp16) {
    return invalid_argument("accumulate_grad_cuda: gradients in {}; fp32, bf16 or fp16 only", dtype_name(format));
  }
  TZ_CUDA_CHECK(launch::accumulate_grad(d_acc, d_grad, static_cast<int>(format), n, overwrite, scale,
                                        static_cast<cudaStream_t>(cuda_stream)));
  return ok_status();
}

}  // namespace tz::kernels
