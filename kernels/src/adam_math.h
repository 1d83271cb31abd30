// Private to kernels/: one Adam element update, shared by the CPU twin
// (optim_cpu.cpp) and the CUDA kernel (optim_cuda.cu) so the two run the same
// fp32 operations in the same order. Plain C++ (no tierzero or CUDA headers):
// nvcc compiles it for the device too.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define TZ_HOST_DEVICE __host__ __device__
#else
#define TZ_HOST_DEVICE
#endif

namespace tz::kernels::detail {

// AdamHyper turned into per-element fp32 factors (the bias corrections are
// computed once, in double, by the caller).
struct AdamCoef {
  float step_size = 0;        // lr / (1 - beta1^step)
  float inv_sqrt_bc2 = 1;     // 1 / sqrt(1 - beta2^step)
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0, eps = 0;
  float decay = 1;            // AdamW: 1 - lr * weight_decay
  float weight_decay = 0;     // Adam: added to the gradient as weight_decay * p
  float grad_scale = 1;
  bool adamw = true;
};

TZ_HOST_DEVICE inline void adam_element(float& p, float g, float& m, float& v, const AdamCoef& c) {
  g *= c.grad_scale;
  if (c.adamw) {
    p *= c.decay;
  } else {
    g += c.weight_decay * p;
  }
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  p -= c.step_size * m / (sqrtf(v) * c.inv_sqrt_bc2 + c.eps);
}

}  // namespace tz::kernels::detail
