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
  c.l2 = !h.adamw && h.weight_decay != 0;
  return c;
}

// adam_step_compact_*'s arguments checked and turned into the element's.
inline Expected<CompactStep> compact_step_of(const AdamCompactTensors& t, std::size_t n, const AdamHyper& h,
                                             bool fused) {
  TZ_ASSIGN_OR_RETURN(AdamCoef coef, adam_coef(h));
  if (t.moment_format == MomentFormat::kInt8) {
    return invalid_argument("compact Adam: moments in int8 are stepped by cpu_adam only (the GPU optimizer steps "
                            "fp32 and bf16 moments)");
  }
  const bool remainder = t.master_format == MasterFormat::kRemainder;
  const bool missing = t.grad == nullptr || t.exp_avg == nullptr || t.exp_avg_sq == nullptr ||
                       (remainder ? t.param16 == nullptr || t.remainder == nullptr || t.tie_bits == nullptr
                                  : t.master == nullptr);
  if (n > 0 && missing) {
    return invalid_argument("compact Adam: master {} with moments {} needs grad, exp_avg, exp_avg_sq and {}; one is null",
                            master_format_name(t.master_format), moment_format_name(t.moment_format),
                            remainder ? "param16, remainder and tie_bits" : "master");
  }
  CompactStep s;
  s.coef = coef;
  s.fused = fused;
  s.remainder_master = remainder;
  s.bf16_moments = t.moment_format == MomentFormat::kBf16;
  s.master = remainder ? nullptr : t.master;
  s.param16 = t.param16;
  s.remainder = t.remainder;
  s.tie_bits = t.tie_bits;
  s.tie_bit_offset = t.tie_bit_offset;
  s.grad = t.grad;
  s.exp_avg = t.exp_avg;
  s.exp_avg_sq = t.exp_avg_sq;
  s.sr_key = t.sr_key;
  s.sr_base = t.sr_base;
  return s;
}

}  // namespace tz::kernels::detail
