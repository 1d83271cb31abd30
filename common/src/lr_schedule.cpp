// The learning-rate schedules of the config's `scheduler` block (formulas in
// tierzero/common/config.h, where SchedulerConfig is).
#include <algorithm>
#include <cmath>
#include <numbers>

#include "tierzero/common/config.h"

namespace tz {

std::string_view scheduler_name(SchedulerType type) {
  switch (type) {
    case SchedulerType::kNone: return "none";
    case SchedulerType::kWarmupLR: return "WarmupLR";
    case SchedulerType::kWarmupDecayLR: return "WarmupDecayLR";
    case SchedulerType::kWarmupCosineLR: return "WarmupCosineLR";
  }
  return "?";
}

std::int64_t warmup_length(const SchedulerConfig& s) { return std::max<std::int64_t>(2, s.warmup_num_steps); }

double scheduled_lr(const SchedulerConfig& s, double optimizer_lr, std::int64_t steps_taken) {
  if (s.type == SchedulerType::kNone) return optimizer_lr;
  const double t = static_cast<double>(std::max<std::int64_t>(0, steps_taken));
  const double warmup = static_cast<double>(warmup_length(s));
  const bool warming = t < warmup;
  const double gamma = s.warmup_type == WarmupType::kLog ? std::log(t + 1) / std::log(warmup) : t / warmup;
  const double total = static_cast<double>(s.total_num_steps);

  if (s.type == SchedulerType::kWarmupCosineLR) {
    if (warming) return optimizer_lr * (s.warmup_min_ratio + (1 - s.warmup_min_ratio) * gamma);
    // Past total_num_steps the ratio stays at cos_min_ratio (the cosine would rise again).
    const double progress = std::min(1.0, (t - warmup + 1) / (total - warmup));
    const double cosine = (1 + std::cos(std::numbers::pi * progress)) / 2;
    return optimizer_lr * std::max(0.0, s.cos_min_ratio + (1 - s.cos_min_ratio) * cosine);
  }
  const double max_lr = s.warmup_max_lr_auto ? optimizer_lr : s.warmup_max_lr;
  double factor = 1;
  if (warming) {
    factor = gamma;
  } else if (s.type == SchedulerType::kWarmupDecayLR) {
    factor = std::max(0.0, (total - t) / std::max(1.0, total - warmup));
  }
  return s.warmup_min_lr + (max_lr - s.warmup_min_lr) * factor;
}

}  // namespace tz
