// Dynamic loss scaling for fp16, with DeepSpeed's knobs: the scale starts at
// 2^initial_scale_power; an overflowing step is skipped, and after
// `hysteresis` overflows (counted since the last scale change) the scale is
// halved, never below min_loss_scale; after loss_scale_window steps without
// overflow it doubles. A static scale (loss_scale > 0) never changes, but an
// overflowing step is still skipped. Without fp16 the scale is 1.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "tierzero/common.h"

namespace tz::detail {

class LossScaler {
 public:
  explicit LossScaler(const PrecisionConfig& p) : p_(p) {
    dynamic_ = p.fp16 && p.loss_scale == 0;
    // ldexp, not 1 << power: the config allows powers up to 63, and 1 << 63
    // in an int64 is negative.
    scale_ = !p.fp16 ? 1.0 : dynamic_ ? std::ldexp(1.0, p.initial_scale_power) : p.loss_scale;
    hysteresis_left_ = p.hysteresis;
  }

  double scale() const { return scale_; }

  // After a step's overflow check; returns whether the step may run.
  bool update(bool overflow) {
    if (!dynamic_) return !overflow;
    if (overflow) {
      good_steps_ = 0;
      if (hysteresis_left_ <= 1) {
        scale_ = std::max(scale_ / 2, p_.min_loss_scale);
        hysteresis_left_ = p_.hysteresis;
      } else {
        --hysteresis_left_;
      }
      return false;
    }
    if (++good_steps_ >= p_.loss_scale_window) {
      scale_ *= 2;
      good_steps_ = 0;
      hysteresis_left_ = p_.hysteresis;
    }
    return true;
  }

  struct State {
    double scale;
    int hysteresis_left;
    std::int64_t good_steps;
  };
  State state() const { return {scale_, hysteresis_left_, good_steps_}; }
  // A saved dynamic state continues; a static scale, or none (bf16, fp32), is
  // this run's config's, whatever the saving run used.
  void restore(const State& s) {
    if (!dynamic_) return;
    scale_ = s.scale;
    hysteresis_left_ = s.hysteresis_left;
    good_steps_ = s.good_steps;
  }

 private:
  PrecisionConfig p_;
  bool dynamic_ = false;
  double scale_ = 1;
  int hysteresis_left_ = 2;
  std::int64_t good_steps_ = 0;
};

}  // namespace tz::detail
