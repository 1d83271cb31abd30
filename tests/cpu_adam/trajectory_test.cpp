// Twenty consecutive steps follow the float64 reference's trajectory: the
// reference keeps its own state and the error bound grows with it
// (reference.h), so drift that compounds over steps is caught.
#include <gtest/gtest.h>

#include <cstdio>

#include "reference.h"

namespace tzt {
namespace {

using tz::cpu_adam::simd_name;

TEST(CpuAdamTrajectory, TwentyStepsFollowTheReference) {
  struct Config {
    Algorithm algorithm;
    bool amsgrad;
    double weight_decay;
  };
  constexpr Config kConfigs[] = {{Algorithm::kAdam, false, 0.0},   {Algorithm::kAdam, true, 0.01},
                                 {Algorithm::kAdamW, false, 0.1},  {Algorithm::kAdamW, true, 0.1},
                                 {Algorithm::kAdagrad, false, 0.01}, {Algorithm::kLion, false, 0.1}};
  constexpr int kSteps = 20;
  for (Simd simd : runnable_variants()) {
    const auto opt = make_optimizer(simd, 2, 512);
    for (DType moment : {DType::kFp32, DType::kBf16}) {
      CheckResult worst;
      std::size_t runs = 0;
      for (const Config& c : kConfigs) {
        for (DType grad : {DType::kFp32, DType::kBf16}) {
          StepSetup s;
          s.hyper = random_hyper(c.algorithm, c.amsgrad, c.weight_decay);
          s.grad_dtype = grad;
          s.moment_dtype = moment;
          s.copy = DType::kBf16;
          s.n = 4093;
          s.unaligned = runs % 2 == 0;
          s.first_step = 1;
          s.grad_scale = uniform(0.5, 1.0);
          const CheckResult r = run_steps(*opt, s, kSteps);
          EXPECT_EQ(r.failures, 0U) << simd_name(simd) << ", " << describe(s) << ": " << r.first_failure;
          worst.merge(r);
          ++runs;
        }
      }
      std::printf("[ cpu_adam ] 20 steps, %s moments, %-7s %zu runs: largest param error %.3g (relative %.3g where |param| >= 0.01), "
                  "largest error/bound %.3f (%s)\n",
                  std::string(tz::dtype_name(moment)).c_str(), std::string(simd_name(simd)).c_str(), runs,
                  worst.max_param_err, worst.max_rel_err, worst.max_ratio, worst.worst_state.c_str());
    }
  }
}

}  // namespace
}  // namespace tzt
