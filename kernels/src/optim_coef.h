// Private to kernels/: AdamHyper checked and turned into detail::AdamCoef,
// for the CPU twin and the CUDA wrapper alike.
#pragma once

#include <cmath>

#include "adam_math.h"
#include "tierzero/kernels.h"

namespace tz::kernels::detail {

inline Expected<AdamCoef> adam_coef(const AdamHyper& h) {
  if (h.step < 1) return invalid_argument("Adam step {} must be >= 1 (the step being taken, 1-based)", h.step);
  if (!(h.beta1 >= 0 && h.beta1 < 1)) return invalid_argument("Adam beta1 = {} is not in [0, 1)", h.beta1);
  if (!(h.beta2 >= 0 && h.beta2 < 1)) return invalid_argument("Adam beta2 = {} is not in [0, 1)", h.beta2);
  if (!(h.lr >= 0) || !(h.eps > 0) || !(h.weight_decay >= 0)) {
    return invalid_argument("Adam lr = {}, eps = {}, weight_decay = {}: need lr >= 0, eps > 0, weight_decay >= 0", h.lr,
                            h.eps, h.weight_decay);
  }
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(h.step));
  AdamCoef c;
  c.step_size = static_cast<float>(h.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1 / std::sqrt(bc2));
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.decay = static_cast<float>(1 - h.lr * h.weight_decay);
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.grad_scale = static_cast<float>(h.grad_scale);
  c.adamw = h.adamw;
  return c;
}

}  // namespace tz::kernels::detail
