// Private to kernels/: AdamHyper checked and turned into detail::AdamCoef,
// for the CPU twin and the CUDA wrapper alike.
#pragma once

#include <cmath>

#include <vector>

#include "adam_math.h"
#include "int8_math.h"
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

// The weight-decay runs' coefficients, checked: each is adam_coef's with its
// weight decay (the same double arithmetic, so the same floats).
inline Status decay_runs_of(const AdamCompactTensors& t, std::size_t n, const AdamHyper& h,
                            std::vector<DecayRun>& runs) {
  runs.clear();
  std::uint64_t covered = 0;
  for (std::size_t k = 0; k < t.weight_decay_run_count; ++k) {
    const WeightDecayRun& r = t.weight_decay_runs[k];
    if (r.begin < covered || r.end < r.begin || r.end > n) {
      return invalid_argument("compact Adam: weight_decay_runs[{}] = [{}, {}) is not sorted, disjoint and inside "
                              "[0, {})", k, r.begin, r.end, n);
    }
    AdamHyper run = h;
    run.weight_decay = r.weight_decay;
    TZ_ASSIGN_OR_RETURN(AdamCoef c, adam_coef(run));
    if (r.end > r.begin) runs.push_back({r.begin, r.end, c.decay, c.weight_decay, c.l2});
    covered = r.end;
  }
  return ok_status();
}

// Note [Int8 moments on the GPU]: what an int8 call needs besides the arrays.
inline Status check_int8_call(const AdamCompactTensors& t, std::size_t n) {
  static_assert(kInt8BlockNumel == kInt8MomentBlockNumel);
  if (n == 0) return ok_status();
  if (t.exp_avg_scale == nullptr || t.exp_avg_sq_scale == nullptr || t.exp_avg_code.decode == nullptr ||
      t.exp_avg_code.mid == nullptr || t.exp_avg_sq_code.decode == nullptr || t.exp_avg_sq_code.mid == nullptr) {
    return invalid_argument("compact Adam: int8 moments need exp_avg_scale, exp_avg_sq_scale and both codes' "
                            "tables (tz::cpu_adam::int8_code_tables); one is null");
  }
  if (t.master_format == MasterFormat::kRemainder && t.tie_bit_offset % 8 != 0) {
    return invalid_argument("compact Adam: int8 moments step whole blocks, and tie_bit_offset = {} does not start "
                            "a tie-bit byte", t.tie_bit_offset);
  }
  return ok_status();
}

// adam_step_compact_*'s arguments checked and turned into the element's;
// `runs` holds the weight-decay runs s.runs points to.
inline Expected<CompactStep> compact_step_of(const AdamCompactTensors& t, std::size_t n, const AdamHyper& h,
                                             bool fused, std::vector<DecayRun>& runs) {
  TZ_ASSIGN_OR_RETURN(AdamCoef coef, adam_coef(h));
  TZ_TRY(decay_runs_of(t, n, h, runs));
  const bool remainder = t.master_format == MasterFormat::kRemainder;
  const bool int8 = t.moment_format == MomentFormat::kInt8;
  const bool missing = t.grad == nullptr || t.exp_avg == nullptr || t.exp_avg_sq == nullptr ||
                       (remainder ? t.param16 == nullptr || t.remainder == nullptr || t.tie_bits == nullptr
                                  : t.master == nullptr);
  if (n > 0 && missing) {
    return invalid_argument("compact Adam: master {} with moments {} needs grad, exp_avg, exp_avg_sq and {}; one is null",
                            master_format_name(t.master_format), moment_format_name(t.moment_format),
                            remainder ? "param16, remainder and tie_bits" : "master");
  }
  if (int8) TZ_TRY(check_int8_call(t, n));
  CompactStep s;
  s.coef = coef;
  s.fused = fused;
  s.remainder_master = remainder;
  s.bf16_moments = t.moment_format == MomentFormat::kBf16;
  s.int8_moments = int8;
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
  s.exp_avg_scale = t.exp_avg_scale;
  s.exp_avg_sq_scale = t.exp_avg_sq_scale;
  s.exp_avg_code = {t.exp_avg_code.decode, t.exp_avg_code.mid, true};
  s.exp_avg_sq_code = {t.exp_avg_sq_code.decode, t.exp_avg_sq_code.mid, false};
  s.runs = runs.data();
  s.run_count = static_cast<std::uint32_t>(runs.size());
  return s;
}

}  // namespace tz::kernels::detail
