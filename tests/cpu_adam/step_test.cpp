// One optimizer step against the float64 reference (reference.h states the
// tolerance) for every algorithm, dtype combination, runnable SIMD variant,
// thread count 1-4, length and alignment.
#include <gtest/gtest.h>

#include <cstdio>

#include "reference.h"

namespace tzt {
namespace {

using tz::cpu_adam::simd_name;

constexpr DType kGradDtypes[] = {DType::kFp32, DType::kBf16, DType::kFp16};
constexpr DType kMomentDtypes[] = {DType::kFp32, DType::kBf16};
const std::optional<DType> kCopies[] = {std::nullopt, DType::kBf16, DType::kFp16};
constexpr std::size_t kLengths[] = {0, 1, 15, 17, 4093};

StepSetup random_setup(const AlgorithmConfig& c, DType grad, DType moment, std::optional<DType> copy, std::size_t n,
                       bool unaligned) {
  StepSetup s;
  s.hyper = random_hyper(c.algorithm, c.amsgrad, c.weight_decay);
  s.grad_dtype = grad;
  s.moment_dtype = moment;
  s.copy = copy;
  s.n = n;
  s.unaligned = unaligned;
  s.first_step = static_cast<std::int64_t>(uniform(1, 1000));
  s.grad_scale = uniform(0.25, 2.0);
  return s;
}

void report(const char* what, Simd simd, std::size_t cases, const CheckResult& r) {
  std::printf("[ cpu_adam ] %-28s %-7s %5zu cases: largest param error %.3g (relative %.3g where |param| >= 0.01), largest error/bound %.3f (%s)\n",
              what, std::string(simd_name(simd)).c_str(), cases, r.max_param_err, r.max_rel_err, r.max_ratio, r.worst_state.c_str());
}

TEST(CpuAdamStep, EveryAlgorithmDtypeVariantThreadCountAndLengthMatchesFloat64Reference) {
  for (Simd simd : runnable_variants()) {
    // Small tiles so that 4093 elements are spread over 16 tiles and every thread.
    std::unique_ptr<tz::cpu_adam::CpuOptimizer> opts[] = {make_optimizer(simd, 1), make_optimizer(simd, 2, 256),
                                                          make_optimizer(simd, 3, 256), make_optimizer(simd, 4, 256)};
    CheckResult worst;
    std::size_t cases = 0, failed = 0;
    for (const AlgorithmConfig& c : kEveryElementLoop) {
      for (DType grad : kGradDtypes) {
        for (DType moment : kMomentDtypes) {
          for (const auto& copy : kCopies) {
            for (std::size_t n : kLengths) {
              const StepSetup setup = random_setup(c, grad, moment, copy, n, cases % 2 == 1);
              const CheckResult r = run_steps(*opts[cases % 4], setup, 1);
              ++cases;
              if (r.failures != 0 && ++failed <= 10) {
                ADD_FAILURE() << simd_name(simd) << ", " << (cases - 1) % 4 + 1 << " threads, " << describe(setup)
                              << ": " << r.failures << " values off, first: " << r.first_failure;
              }
              worst.merge(r);
            }
          }
        }
      }
    }
    report("every combination", simd, cases, worst);
  }
}

TEST(CpuAdamStep, MillionElementSpansMatchFloat64Reference) {
  constexpr std::size_t kN = 1'000'003;
  const std::vector<Simd> variants = runnable_variants();
  for (Simd simd : variants) {  // the benchmark's case on every variant, two threads, unaligned
    const StepSetup setup =
        random_setup({Algorithm::kAdamW, false, 0.1}, DType::kFp32, DType::kFp32, DType::kBf16, kN, true);
    const CheckResult r = run_steps(*make_optimizer(simd, 2), setup, 1);
    EXPECT_EQ(r.failures, 0U) << simd_name(simd) << ", " << describe(setup) << ": " << r.first_failure;
    report("adamw 1'000'003", simd, 1, r);
  }
  const Simd best = variants.back();
  const StepSetup others[] = {
      random_setup({Algorithm::kAdam, true, 0.01}, DType::kBf16, DType::kBf16, DType::kFp16, kN, false),
      random_setup({Algorithm::kLion, false, 0.1}, DType::kFp16, DType::kFp32, DType::kBf16, kN, true),
      random_setup({Algorithm::kAdagrad, false, 0.01}, DType::kFp32, DType::kBf16, std::nullopt, kN, true),
  };
  int threads = 4;
  for (const StepSetup& setup : others) {
    const CheckResult r = run_steps(*make_optimizer(best, threads), setup, 1);
    EXPECT_EQ(r.failures, 0U) << simd_name(best) << ", " << threads << " threads, " << describe(setup) << ": "
                              << r.first_failure;
    report(algorithm_name(setup.hyper.algorithm).data(), best, 1, r);
    --threads;
  }
}

}  // namespace
}  // namespace tzt
