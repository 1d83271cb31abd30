// Names of the enums, CPU feature checks and the run-time choice of kernels.
#include <atomic>
#include <cstdlib>
#include <string>

#include "dispatch.h"

namespace tz::cpu_adam {
namespace {

constexpr Simd kAllSimd[] = {Simd::kScalar, Simd::kSse4_2, Simd::kAvx2, Simd::kAvx512};

std::string join_names(const std::vector<Simd>& variants) {
  std::string out;
  for (Simd s : variants) {
    if (!out.empty()) out += ", ";
    out += simd_name(s);
  }
  return out;
}

std::vector<Simd> supported_variants() {
  std::vector<Simd> out;
  for (Simd s : compiled_variants()) {
    if (cpu_supports(s)) out.push_back(s);
  }
  return out;
}

bool is_compiled(Simd simd) {
  for (Simd s : compiled_variants()) {
    if (s == simd) return true;
  }
  return false;
}

Status check_runnable(Simd simd, std::string_view source) {
  if (!is_compiled(simd)) {
    return invalid_argument("{}: SIMD variant {} is not compiled into this build (compiled: {})", source,
                            simd_name(simd), join_names(compiled_variants()));
  }
  if (!cpu_supports(simd)) {
    return invalid_argument("{}: SIMD variant {} is not supported by this CPU (it supports: {})", source,
                            simd_name(simd), join_names(supported_variants()));
  }
  return ok_status();
}

// Once per variant, so a process that forces several (the tests) says each.
void log_choice(Simd simd, std::string_view source) {
  static std::atomic<unsigned> logged{0};
  const unsigned bit = 1U << static_cast<unsigned>(simd);
  if ((logged.fetch_or(bit) & bit) == 0) {
    TZ_LOG_INFO("cpu_adam", "kernels: {} ({}; this CPU supports {})", simd_name(simd), source,
                join_names(supported_variants()));
  }
}

}  // namespace

std::string_view simd_name(Simd simd) {
  switch (simd) {
    case Simd::kScalar: return "scalar";
    case Simd::kSse4_2: return "sse4.2";
    case Simd::kAvx2: return "avx2";
    case Simd::kAvx512: return "avx512";
  }
  return "unknown";
}

Expected<Simd> parse_simd(std::string_view name) {
  for (Simd s : kAllSimd) {
    if (name == simd_name(s)) return s;
  }
  return invalid_argument("unknown SIMD variant \"{}\" (expected one of: scalar, sse4.2, avx2, avx512)", name);
}

std::vector<Simd> compiled_variants() {
#if defined(TZ_CPU_ADAM_X86)
  return {Simd::kScalar, Simd::kSse4_2, Simd::kAvx2, Simd::kAvx512};
#else
  return {Simd::kScalar};
#endif
}

bool cpu_supports(Simd simd) {
#if defined(TZ_CPU_ADAM_X86)
  __builtin_cpu_init();  // may run before the constructors that normally do this
  switch (simd) {
    case Simd::kScalar: return true;
    case Simd::kSse4_2: return __builtin_cpu_supports("sse4.2");
    case Simd::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Simd::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }
  return false;
#else
  return simd == Simd::kScalar;
#endif
}

Simd best_supported() {
  Simd best = Simd::kScalar;
  for (Simd s : compiled_variants()) {
    if (cpu_supports(s)) best = s;  // narrowest first
  }
  return best;
}

std::string_view algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kAdam: return "adam";
    case Algorithm::kAdamW: return "adamw";
    case Algorithm::kAdagrad: return "adagrad";
    case Algorithm::kLion: return "lion";
  }
  return "unknown";
}

namespace detail {

Expected<Simd> choose_simd(const std::optional<Simd>& forced) {
  if (forced) {
    TZ_TRY(check_runnable(*forced, "Options::simd"));
    log_choice(*forced, "forced by Options::simd");
    return *forced;
  }
  if (const char* env = std::getenv("TIERZERO_SIMD"); env != nullptr && *env != '\0') {
    Expected<Simd> parsed = parse_simd(env);
    if (!parsed.ok()) return invalid_argument("TIERZERO_SIMD={}: {}", env, parsed.status().message());
    const Simd simd = *parsed;
    TZ_TRY(check_runnable(simd, fmt::format("TIERZERO_SIMD={}", env)));
    log_choice(simd, "forced by TIERZERO_SIMD");
    return simd;
  }
  const Simd best = best_supported();
  log_choice(best, "the widest this CPU runs");
  return best;
}

const KernelTable& kernel_table(Simd simd) {
  switch (simd) {
#if defined(TZ_CPU_ADAM_X86)
    case Simd::kSse4_2: return kernels_sse4_2();
    case Simd::kAvx2: return kernels_avx2();
    case Simd::kAvx512: return kernels_avx512();
#endif
    default: return kernels_scalar();
  }
}

}  // namespace detail
}  // namespace tz::cpu_adam
