// The optimizer kernels' CPU twins (tierzero/kernels.h), and the CUDA entry
// points of builds without CUDA.
#include <cmath>

#include "adam_math.h"
#include "optim_coef.h"
#include "tierzero/kernels.h"

namespace tz::kernels {

bool unscale_cpu(float* g, std::size_t n, float inv_scale) {
  bool non_finite = false;
  for (std::size_t i = 0; i < n; ++i) {
    non_finite |= !std::isfinite(g[i]);
    g[i] *= inv_scale;
    non_finite |= !std::isfinite(g[i]);
  }
  return non_finite;
}

void squared_norms_cpu(const TensorRef* tensors, std::size_t count, double* out) {
  for (std::size_t t = 0; t < count; ++t) {
    double sum = 0;
    for (std::size_t i = 0; i < tensors[t].numel; ++i) {
      const double x = tensors[t].data[i];
      sum += x * x;
    }
    out[t] = sum;
  }
}

Status adam_step_cpu(const AdamTensors& t, std::size_t n, const AdamHyper& h) {
  TZ_ASSIGN_OR_RETURN(detail::AdamCoef c, detail::adam_coef(h));
  for (std::size_t i = 0; i < n; ++i) {
    detail::adam_element(t.param[i], t.grad[i], t.exp_avg[i], t.exp_avg_sq[i], c);
    if (t.param16 != nullptr) t.param16[i] = fp32_to_bf16(t.param[i]);
  }
  return ok_status();
}

Status adam_step_compact_cpu(const AdamCompactTensors& t, std::size_t n, const AdamHyper& h,
                             const AdamCompactCpuOptions& options) {
  TZ_ASSIGN_OR_RETURN(detail::CompactStep s, detail::compact_step_of(t, n, h, options.fused_multiply_add));
  for (std::size_t i = 0; i < n; ++i) {
    if (!s.remainder_master) {
      (void)detail::adam_compact_element(s, i, false);
      continue;
    }
    const std::uint64_t bit = s.tie_bit_offset + i;
    std::uint8_t& byte = s.tie_bits[bit / 8];
    const auto mask = static_cast<std::uint8_t>(1U << (bit % 8));
    const bool tie = detail::adam_compact_element(s, i, (byte & mask) != 0);
    byte = static_cast<std::uint8_t>(tie ? byte | mask : byte & ~mask);
  }
  return ok_status();
}

void accumulate_grad_cpu(float* acc, const void* grad, DType format, std::size_t n, bool overwrite, float scale) {
  const auto* g16 = static_cast<const std::uint16_t*>(grad);
  for (std::size_t i = 0; i < n; ++i) {
    const float g = format == DType::kFp32   ? static_cast<const float*>(grad)[i]
                    : format == DType::kBf16 ? bf16_to_fp32(g16[i])
                                                  : fp16_to_fp32(g16[i]);
    acc[i] = overwrite ? scale * g : std::fma(scale, g, acc[i]);  // cpu_adam's: -0 stays -0 on overwrite
  }
}

#if !defined(TIERZERO_WITH_CUDA)
Status accumulate_grad_cuda(float*, const void*, DType, std::size_t, bool, float, void*) {
  return unavailable("accumulate_grad_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
Status unscale_cuda(float*, std::size_t, float, int*, void*) {
  return unavailable("unscale_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
Status squared_norms_cuda(const TensorRef*, std::size_t, double*, void*) {
  return unavailable("squared_norms_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
Status adam_step_cuda(const AdamTensors&, std::size_t, const AdamHyper&, void*) {
  return unavailable("adam_step_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
Status adam_step_compact_cuda(const AdamCompactTensors&, std::size_t, const AdamHyper&, void*) {
  return unavailable("adam_step_compact_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
#endif

}  // namespace tz::kernels
