// Names, CPU support and the run-time choice of kernels.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "reference.h"
#include "tierzero/common.h"

namespace tzt {
namespace {

using tz::cpu_adam::best_supported;
using tz::cpu_adam::compiled_variants;
using tz::cpu_adam::CpuOptimizer;
using tz::cpu_adam::cpu_supports;
using tz::cpu_adam::parse_simd;
using tz::cpu_adam::simd_name;

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(CpuAdamSimd, NamesRoundTripAndUnknownNamesListTheKnownOnes) {
  for (Simd s : {Simd::kScalar, Simd::kSse4_2, Simd::kAvx2, Simd::kAvx512}) {
    const auto parsed = parse_simd(simd_name(s));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, s);
  }
  const auto bad = parse_simd("avx1024");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("avx1024"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("sse4.2"), std::string::npos) << bad.status().message();
}

TEST(CpuAdamSimd, EveryX86VariantIsCompiledNarrowestFirst) {
  const std::vector<Simd> want = {Simd::kScalar, Simd::kSse4_2, Simd::kAvx2, Simd::kAvx512};
  EXPECT_EQ(compiled_variants(), want);
}

// cpu_supports agrees with the capability probe (cpuid read by common).
TEST(CpuAdamSimd, SupportMatchesTheCapabilityProbe) {
  const tz::CpuCapabilities& cpu = tz::capabilities().cpu;
  EXPECT_TRUE(cpu_supports(Simd::kScalar));
  EXPECT_EQ(cpu_supports(Simd::kSse4_2), cpu.sse4_2);
  EXPECT_EQ(cpu_supports(Simd::kAvx2), cpu.avx2 && cpu.fma && cpu.f16c);
  if (cpu_supports(Simd::kAvx512)) {
    EXPECT_TRUE(cpu.avx512f && cpu.avx512bw && cpu.avx512vl);
  }
  EXPECT_EQ(best_supported(), runnable_variants().back());
  std::printf("[ cpu_adam ] this CPU runs:");
  for (Simd s : runnable_variants()) std::printf(" %s", std::string(simd_name(s)).c_str());
  std::printf("; best %s\n", std::string(simd_name(best_supported())).c_str());
}

TEST(CpuAdamSimd, EverySupportedVariantCanBeForced) {
  for (Simd s : runnable_variants()) {
    auto opt = CpuOptimizer::create({.threads = 1, .simd = s});
    ASSERT_TRUE(opt.ok()) << opt.status().to_string();
    EXPECT_EQ((*opt)->simd(), s);
  }
  auto opt = CpuOptimizer::create({.threads = 1});
  ASSERT_TRUE(opt.ok());
  EXPECT_EQ((*opt)->simd(), best_supported());
}

// On a CPU without AVX-512 (the CI machines), forcing it is an error that
// names it and what the CPU runs; with AVX-512 it must run.
TEST(CpuAdamSimd, ForcingAvx512WorksOnlyWhereTheCpuHasIt) {
  auto opt = CpuOptimizer::create({.threads = 1, .simd = Simd::kAvx512});
  if (cpu_supports(Simd::kAvx512)) {
    ASSERT_TRUE(opt.ok()) << opt.status().to_string();
    EXPECT_EQ((*opt)->simd(), Simd::kAvx512);
    return;
  }
  ASSERT_FALSE(opt.ok());
  const std::string msg = opt.status().message();
  EXPECT_EQ(opt.status().code(), tz::ErrorCode::kInvalidArgument);
  EXPECT_NE(msg.find("avx512 is not supported by this CPU"), std::string::npos) << msg;
  for (Simd s : runnable_variants()) EXPECT_NE(msg.find(simd_name(s)), std::string::npos) << msg;
  std::printf("[ cpu_adam ] forcing avx512 here: %s\n", msg.c_str());
}

TEST(CpuAdamSimd, EnvironmentForcesAVariantUnlessOptionsDo) {
  {
    ScopedEnv env("TIERZERO_SIMD", "scalar");
    auto opt = CpuOptimizer::create({.threads = 1});
    ASSERT_TRUE(opt.ok()) << opt.status().to_string();
    EXPECT_EQ((*opt)->simd(), Simd::kScalar);
    auto forced = CpuOptimizer::create({.threads = 1, .simd = best_supported()});
    ASSERT_TRUE(forced.ok());
    EXPECT_EQ((*forced)->simd(), best_supported());
  }
  {
    ScopedEnv env("TIERZERO_SIMD", "avx9");
    auto opt = CpuOptimizer::create({.threads = 1});
    ASSERT_FALSE(opt.ok());
    EXPECT_NE(opt.status().message().find("TIERZERO_SIMD=avx9"), std::string::npos) << opt.status().message();
  }
  if (!cpu_supports(Simd::kAvx512)) {
    ScopedEnv env("TIERZERO_SIMD", "avx512");
    auto opt = CpuOptimizer::create({.threads = 1});
    ASSERT_FALSE(opt.ok());
    EXPECT_NE(opt.status().message().find("TIERZERO_SIMD=avx512"), std::string::npos) << opt.status().message();
    EXPECT_NE(opt.status().message().find("not supported by this CPU"), std::string::npos) << opt.status().message();
  }
}

}  // namespace
}  // namespace tzt
