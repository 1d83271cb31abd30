// The config's learning-rate schedules (tz::scheduled_lr) at points worked out
// by hand from DeepSpeed's definitions (tierzero/common/config.h).
#include <gtest/gtest.h>

#include <cmath>

#include "tierzero/common/config.h"

namespace tz {
namespace {

SchedulerConfig schedule(SchedulerType type, std::int64_t warmup, WarmupType warmup_type = WarmupType::kLog) {
  SchedulerConfig s;
  s.type = type;
  s.warmup_num_steps = warmup;
  s.warmup_type = warmup_type;
  return s;
}

TEST(LrSchedule, NoSchedulerIsTheOptimizersRate) {
  EXPECT_EQ(scheduled_lr(SchedulerConfig{}, 3e-4, 0), 3e-4);
  EXPECT_EQ(scheduled_lr(SchedulerConfig{}, 3e-4, 12345), 3e-4);
}

TEST(LrSchedule, WarmupLrRisesLogarithmicallyOrLinearlyThenHolds) {
  SchedulerConfig s = schedule(SchedulerType::kWarmupLR, 10);
  s.warmup_min_lr = 0.1;
  s.warmup_max_lr = 1.1;
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 5.0, 0), 0.1);                       // log(1) = 0: the minimum
  EXPECT_NEAR(scheduled_lr(s, 5.0, 4), 0.1 + 0.698970004336, 1e-12);    // log(5) / log(10)
  EXPECT_NEAR(scheduled_lr(s, 5.0, 9), 1.1, 1e-15);                     // log(10) / log(10)
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 5.0, 10), 1.1);
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 5.0, 1000000), 1.1);                 // the optimizer's 5.0 plays no part
  s.warmup_type = WarmupType::kLinear;
  s.warmup_num_steps = 4;
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 5.0, 1), 0.35);                      // 0.1 + 1 * 1/4
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 5.0, 3), 0.85);
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 5.0, 4), 1.1);
  s.warmup_max_lr_auto = true;                                          // "auto": the optimizer's lr
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 5.0, 4), 5.0);
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 5.0, 2), 0.1 + 4.9 * 0.5);
}

TEST(LrSchedule, AWarmupBelowTwoStepsCountsAsTwo) {
  SchedulerConfig s = schedule(SchedulerType::kWarmupLR, 0);
  s.warmup_max_lr = 1.0;
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 1.0, 0), 0.0);
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 1.0, 1), 1.0);  // log(2) / log(2)
  s.warmup_type = WarmupType::kLinear;
  s.warmup_num_steps = 1;
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 1.0, 1), 0.5);  // 1 / 2
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 1.0, 2), 1.0);
}

TEST(LrSchedule, WarmupDecayLrFallsLinearlyToTheMinimumAtTheLastStep) {
  SchedulerConfig s = schedule(SchedulerType::kWarmupDecayLR, 4, WarmupType::kLinear);
  s.warmup_min_lr = 0.0;
  s.warmup_max_lr = 1.0;
  s.total_num_steps = 12;
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 9.0, 2), 0.5);
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 9.0, 4), 1.0);   // (12 - 4) / 8
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 9.0, 8), 0.5);   // (12 - 8) / 8
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 9.0, 11), 0.125);
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 9.0, 12), 0.0);
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 9.0, 40), 0.0);  // never negative
}

TEST(LrSchedule, WarmupCosineLrScalesTheOptimizersRateAndStaysAtTheFloorAfterTheEnd) {
  SchedulerConfig s = schedule(SchedulerType::kWarmupCosineLR, 4, WarmupType::kLinear);
  s.warmup_min_ratio = 0.5;
  s.cos_min_ratio = 0.1;
  s.total_num_steps = 8;
  const double lr = 2.0;
  EXPECT_DOUBLE_EQ(scheduled_lr(s, lr, 0), 1.0);                 // 2 * 0.5
  EXPECT_DOUBLE_EQ(scheduled_lr(s, lr, 2), 1.5);                 // 2 * (0.5 + 0.5 * 2/4)
  // t = 4: progress (4 - 4 + 1) / (8 - 4) = 1/4; (1 + cos(pi/4)) / 2 = 0.853553390593
  EXPECT_NEAR(scheduled_lr(s, lr, 4), 2 * (0.1 + 0.9 * 0.853553390593), 1e-12);
  EXPECT_NEAR(scheduled_lr(s, lr, 5), 2 * 0.55, 1e-15);          // progress 1/2
  EXPECT_NEAR(scheduled_lr(s, lr, 7), 0.2, 1e-15);               // progress 1: the floor
  EXPECT_NEAR(scheduled_lr(s, lr, 100), 0.2, 1e-15);             // and there it stays
}

}  // namespace
}  // namespace tz
