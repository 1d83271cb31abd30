// Bad input is refused before any memory is touched: the error names the
// value and its range, and every buffer is byte-identical afterwards.
#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <string>

#include "reference.h"

namespace tzt {
namespace {

using tz::cpu_adam::CpuOptimizer;

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Spans switched to the remainder format, with a remainder and tie bits of
// their own for n = 1000 (packed end to end: 2000 + 125 bytes).
void use_remainder(Spans& s) {
  alignas(8) static std::uint8_t packed[2000 + 125];
  s.master_format = tz::cpu_adam::MasterFormat::kRemainder;
  s.param = nullptr;
  s.remainder = reinterpret_cast<std::int16_t*>(packed);
  s.tie_bits = packed + 2000;
}

struct BadStep {
  const char* what;
  std::function<void(Hyper&, StepArgs&, Spans&)> mutate;
  std::string expect;  // in the message
  Algorithm algorithm = Algorithm::kAdamW;
  bool amsgrad = false;
};

std::vector<BadStep> bad_steps() {
  return {
      {"null param", [](Hyper&, StepArgs&, Spans& s) { s.param = nullptr; }, "spans.param is null"},
      {"null grad", [](Hyper&, StepArgs&, Spans& s) { s.grad = nullptr; }, "spans.grad is null"},
      {"null exp_avg", [](Hyper&, StepArgs&, Spans& s) { s.exp_avg = nullptr; }, "spans.exp_avg is null"},
      {"null exp_avg_sq", [](Hyper&, StepArgs&, Spans& s) { s.exp_avg_sq = nullptr; }, "spans.exp_avg_sq is null",
       Algorithm::kAdagrad},
      {"amsgrad without max_exp_avg_sq", [](Hyper&, StepArgs&, Spans& s) { s.max_exp_avg_sq = nullptr; },
       "spans.max_exp_avg_sq is null but amsgrad is set", Algorithm::kAdam, true},
      {"moments alias", [](Hyper&, StepArgs&, Spans& s) { s.exp_avg_sq = s.exp_avg; },
       "spans.exp_avg and spans.exp_avg_sq overlap"},
      {"grad overlaps param", [](Hyper&, StepArgs&, Spans& s) { s.grad = s.param + 10; },
       "spans.param and spans.grad overlap"},
      {"param16 overlaps a moment", [](Hyper&, StepArgs&, Spans& s) { s.param16 = static_cast<char*>(s.exp_avg) + 2; },
       "spans.exp_avg and spans.param16 overlap"},
      {"misaligned param",
       [](Hyper&, StepArgs&, Spans& s) { s.param = reinterpret_cast<float*>(reinterpret_cast<char*>(s.param) + 1); },
       "is not aligned to its 4-byte elements"},
      {"fp16 moments", [](Hyper&, StepArgs&, Spans& s) { s.moment_dtype = DType::kFp16; },
       "spans.moment_dtype = fp16 is not allowed (fp32, bf16, or uint8: int8 block codes)"},
      {"fp32 copy-out", [](Hyper&, StepArgs&, Spans& s) { s.param16_dtype = DType::kFp32; },
       "spans.param16_dtype = fp32 is not allowed (bf16 or fp16)"},
      {"unknown grad dtype", [](Hyper&, StepArgs&, Spans& s) { s.grad_dtype = static_cast<DType>(9); },
       "spans.grad_dtype = 9 is not a dtype"},
      {"unknown algorithm", [](Hyper& h, StepArgs&, Spans&) { h.algorithm = static_cast<Algorithm>(7); },
       "algorithm = 7 is not one of"},
      {"NaN lr", [](Hyper& h, StepArgs&, Spans&) { h.lr = kNan; }, "lr = nan is not a number"},
      {"negative lr", [](Hyper& h, StepArgs&, Spans&) { h.lr = -1e-3; },
       "lr = -0.001 is out of range: must be finite and >= 0"},
      {"infinite lr", [](Hyper& h, StepArgs&, Spans&) { h.lr = kInf; }, "lr = inf is out of range"},
      {"lr beyond fp32", [](Hyper& h, StepArgs&, Spans&) { h.lr = 1e300; }, "out of fp32 range (lr = 1e+300"},
      {"grad_scale below fp32", [](Hyper&, StepArgs& a, Spans&) { a.grad_scale = 1e-50; },
       "out of fp32 range (lr = "},
      {"beta1 1.0", [](Hyper& h, StepArgs&, Spans&) { h.beta1 = 1.0; }, "beta1 = 1 is outside [0, 1)"},
      {"beta2 -0.1", [](Hyper& h, StepArgs&, Spans&) { h.beta2 = -0.1; }, "beta2 = -0.1 is outside [0, 1)"},
      {"Lion beta2 1.5", [](Hyper& h, StepArgs&, Spans&) { h.beta2 = 1.5; }, "beta2 = 1.5 is outside [0, 1)",
       Algorithm::kLion},
      {"NaN beta1", [](Hyper& h, StepArgs&, Spans&) { h.beta1 = kNan; }, "beta1 = nan is not a number"},
      {"zero eps", [](Hyper& h, StepArgs&, Spans&) { h.eps = 0; }, "eps = 0 is out of range: must be finite and > 0"},
      {"NaN eps, even where unused", [](Hyper& h, StepArgs&, Spans&) { h.eps = kNan; }, "eps = nan is not a number",
       Algorithm::kLion},
      {"negative weight_decay", [](Hyper& h, StepArgs&, Spans&) { h.weight_decay = -0.01; },
       "weight_decay = -0.01 is out of range: must be finite and >= 0"},
      {"negative lr_decay", [](Hyper& h, StepArgs&, Spans&) { h.lr_decay = -1; },
       "lr_decay = -1 is out of range: must be finite and >= 0", Algorithm::kAdagrad},
      {"step 0", [](Hyper&, StepArgs& a, Spans&) { a.step = 0; }, "step = 0 is out of range: must be >= 1"},
      {"step -5", [](Hyper&, StepArgs& a, Spans&) { a.step = -5; }, "step = -5 is out of range"},
      {"infinite grad_scale", [](Hyper&, StepArgs& a, Spans&) { a.grad_scale = kInf; },
       "grad_scale = inf is out of range: must be finite and > 0"},
      {"NaN grad_scale", [](Hyper&, StepArgs& a, Spans&) { a.grad_scale = kNan; }, "grad_scale = nan is out of range"},
      {"zero grad_scale", [](Hyper&, StepArgs& a, Spans&) { a.grad_scale = 0; }, "grad_scale = 0 is out of range"},
      {"amsgrad with Lion", [](Hyper&, StepArgs&, Spans&) {}, "amsgrad is only for adam and adamw, not lion",
       Algorithm::kLion, true},
      {"amsgrad with Adagrad", [](Hyper&, StepArgs&, Spans&) {}, "amsgrad is only for adam and adamw, not adagrad",
       Algorithm::kAdagrad, true},
      {"unknown master format", [](Hyper&, StepArgs&, Spans& s) { s.master_format = static_cast<tz::cpu_adam::MasterFormat>(3); },
       "spans.master_format = 3 is not one of fp32, remainder"},
      {"remainder with fp16 parameters",
       [](Hyper&, StepArgs&, Spans& s) {
         use_remainder(s);
         s.param16_dtype = DType::kFp16;
       },
       "spans.param16_dtype = fp16 is not allowed with master_format = remainder (bf16 only): fp16's narrower "
       "exponent cannot hold an fp32 master's range; use bf16 parameters or master_format = fp32"},
      {"remainder without parameters",
       [](Hyper&, StepArgs&, Spans& s) {
         use_remainder(s);
         s.param16 = nullptr;
       },
       "spans.param16 is null, but master_format = remainder keeps the master's bf16 part there (n = 1000)"},
      {"remainder with an fp32 master",
       [](Hyper&, StepArgs&, Spans& s) {
         float* param = s.param;
         use_remainder(s);
         s.param = param;
       },
       "is set, but master_format = remainder keeps no fp32 master (it is rebuilt from param16, remainder and "
       "tie_bits); pass null"},
      {"remainder without a remainder",
       [](Hyper&, StepArgs&, Spans& s) {
         use_remainder(s);
         s.remainder = nullptr;
       },
       "spans.remainder is null (n = 1000)"},
      {"remainder without tie bits",
       [](Hyper&, StepArgs&, Spans& s) {
         use_remainder(s);
         s.tie_bits = nullptr;
       },
       "spans.tie_bits is null, but master_format = remainder needs ceil(n / 8) = 125 bytes of them (n = 1000)"},
      {"tie bits from the remainder's last byte",
       [](Hyper&, StepArgs&, Spans& s) {
         use_remainder(s);
         s.tie_bits -= 1;
       },
       "spans.remainder and spans.tie_bits overlap"},
      {"tie bits in the parameters",
       [](Hyper&, StepArgs&, Spans& s) {
         use_remainder(s);
         s.tie_bits = static_cast<std::uint8_t*>(s.param16) + 1990;
       },
       "spans.param16 and spans.tie_bits overlap"},
      {"misaligned remainder",
       [](Hyper&, StepArgs&, Spans& s) {
         use_remainder(s);
         s.remainder = reinterpret_cast<std::int16_t*>(s.tie_bits + 1);
       },
       "spans.remainder = 0x"},
  };
}

std::vector<std::vector<std::uint8_t>> snapshot(const StepProblem& p) {
  return {p.param.snapshot(),      p.grad.snapshot(),           p.exp_avg.snapshot(),
          p.exp_avg_sq.snapshot(), p.max_exp_avg_sq.snapshot(), p.param16.snapshot()};
}

TEST(CpuAdamValidate, BadStepInputIsRefusedByNameAndNothingIsWritten) {
  const auto opt = make_optimizer(tz::cpu_adam::best_supported(), 2, 64);
  for (const BadStep& bad : bad_steps()) {
    StepSetup setup;
    setup.hyper = random_hyper(bad.algorithm, bad.amsgrad, 0.01);
    setup.copy = DType::kBf16;
    setup.n = 1000;
    StepProblem p(setup);
    p.fresh_grads();
    Hyper hyper = setup.hyper;
    StepArgs args{.step = 2};
    Spans spans = p.spans();
    bad.mutate(hyper, args, spans);
    const auto before = snapshot(p);
    const tz::Status status = opt->step(hyper, args, spans);
    ASSERT_FALSE(status.ok()) << bad.what;
    EXPECT_EQ(status.code(), tz::ErrorCode::kInvalidArgument) << bad.what;
    EXPECT_NE(status.message().find(bad.expect), std::string::npos) << bad.what << ": " << status.message();
    EXPECT_NE(status.message().find("cpu_adam"), std::string::npos) << bad.what << ": " << status.message();
    EXPECT_TRUE(snapshot(p) == before) << bad.what << ": a buffer was written";
  }
}

// lr = 0 is a step (a schedule's first warm-up or last decay step, as torch
// allows it): the moments move, the parameters do not.
TEST(CpuAdamValidate, AZeroLearningRateMovesTheMomentsButNotTheParameters) {
  const auto opt = make_optimizer(tz::cpu_adam::best_supported(), 2, 64);
  for (Algorithm algorithm : {Algorithm::kAdam, Algorithm::kAdamW, Algorithm::kAdagrad, Algorithm::kLion}) {
    StepSetup setup;
    setup.hyper = random_hyper(algorithm, false, 0.01);
    setup.hyper.lr = 0;
    setup.copy = DType::kBf16;
    setup.n = 1000;
    StepProblem p(setup);
    p.fresh_grads();
    Buffer& moment = algorithm == Algorithm::kAdagrad ? p.exp_avg_sq : p.exp_avg;  // Adagrad's sum of squares
    const auto param = p.param.snapshot(), moment_before = moment.snapshot();
    const tz::Status status = opt->step(setup.hyper, StepArgs{.step = 3}, p.spans());
    ASSERT_TRUE(status.ok()) << status.to_string();
    EXPECT_TRUE(p.param.snapshot() == param) << static_cast<int>(algorithm);
    EXPECT_FALSE(moment.snapshot() == moment_before) << static_cast<int>(algorithm) << ": the moment did not move";
  }
}

TEST(CpuAdamValidate, BadAccumulateInputIsRefusedByNameAndNothingIsWritten) {
  const auto opt = make_optimizer(tz::cpu_adam::best_supported(), 2, 64);
  constexpr std::size_t kN = 500;
  Buffer acc(DType::kFp32, kN, false), grad(DType::kBf16, kN, false);
  for (std::size_t i = 0; i < kN; ++i) {
    acc.set(i, uniform(-1, 1));
    grad.set(i, uniform(-1, 1));
  }
  struct Case {
    const char* what;
    float* acc;
    const void* grad;
    DType dtype;
    double scale;
    std::string expect;
  };
  const Case cases[] = {
      {"null acc", nullptr, grad.data(), DType::kBf16, 1.0, "acc is null (n = 500)"},
      {"null grad", acc.f32(), nullptr, DType::kBf16, 1.0, "grad is null (n = 500)"},
      {"NaN scale", acc.f32(), grad.data(), DType::kBf16, kNan, "scale = nan is out of range"},
      {"scale beyond fp32", acc.f32(), grad.data(), DType::kBf16, 1e39, "scale = 1e+39 is out of range"},
      {"grad overlaps acc", acc.f32(), acc.f32() + 100, DType::kFp32, 1.0, "acc and grad overlap"},
      {"unknown dtype", acc.f32(), grad.data(), static_cast<DType>(5), 1.0, "grad_dtype = 5 is not a dtype"},
  };
  for (const Case& c : cases) {
    const auto acc_before = acc.snapshot(), grad_before = grad.snapshot();
    const auto stats = opt->accumulate_grad(c.acc, c.grad, c.dtype, kN, false, c.scale);
    ASSERT_FALSE(stats.ok()) << c.what;
    EXPECT_EQ(stats.status().code(), tz::ErrorCode::kInvalidArgument) << c.what;
    EXPECT_NE(stats.status().message().find(c.expect), std::string::npos) << c.what << ": " << stats.status().message();
    EXPECT_TRUE(acc.snapshot() == acc_before && grad.snapshot() == grad_before) << c.what << ": a buffer was written";
  }
}

}  // namespace
}  // namespace tzt
