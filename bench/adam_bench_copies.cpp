// The old-state copies' timing (adam_bench_copies.h).
#include "adam_bench_copies.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "bench_common.h"

namespace tzbench::adam {
namespace {

// 32M elements: 384 MiB of states and as much again for their copies.
constexpr std::size_t kCopyCap = std::size_t{1} << 25;
constexpr double kBytesPerElement = 12;  // fp32 master, exp_avg, exp_avg_sq

}  // namespace

tz::Status measure_copies(std::size_t size, tz::cpu_adam::CpuOptimizer& opt, int repeats, std::vector<CopyRow>& out) {
  CopyRow row{.n = std::min(size, kCopyCap), .threads = opt.threads()};
  const std::size_t n = row.n;
  std::vector<std::vector<float>> states(3, std::vector<float>(n)), kept(3, std::vector<float>(n));
  for (std::size_t s = 0; s < 3; ++s) {
    for (std::size_t i = 0; i < n; ++i) states[s][i] = static_cast<float>((i * 2654435761u + s) % 1000003) * 1e-6F;
  }
  std::vector<tz::cpu_adam::CpuOptimizer::CopyJob> jobs;
  for (std::size_t s = 0; s < 3; ++s) jobs.push_back({kept[s].data(), states[s].data(), n * sizeof(float)});
  const tz::Status timed = time_pairs(repeats, row.times, [&](int, double& ours, double& plain) -> tz::Status {  // the warm-up touches `kept` first
    for (auto& k : kept) std::fill(k.begin(), k.end(), 0.0F);
    const auto t0 = Clock::now();
    TZ_TRY(opt.copy(jobs));
    ours = seconds_since(t0);
    for (std::size_t s = 0; s < 3; ++s) {
      if (std::memcmp(kept[s].data(), states[s].data(), n * sizeof(float)) != 0) {
        return tz::internal_error("CpuOptimizer::copy of {} elements on {} threads: state {} differs", n,
                                  row.threads, s);
      }
    }
    const auto t1 = Clock::now();
    for (const auto& j : jobs) std::memcpy(j.dst, j.src, j.bytes);
    plain = seconds_since(t1);
    return tz::ok_status();
  });
  TZ_TRY(timed);
  out.push_back(std::move(row));
  return tz::ok_status();
}

nlohmann::json print_copies(const std::vector<CopyRow>& rows) {
  nlohmann::json out = nlohmann::json::array();
  if (rows.empty()) return out;
  std::printf("\nold-state copies of a step under backward (fp32 master + moments, %.0f B/element copied; "
              "CpuOptimizer::copy vs one thread's memcpy, alternating)\n", kBytesPerElement);
  std::printf("%9s %8s %12s %11s %15s %11s %9s\n", "elements", "threads", "copy ns/el", "GB/s", "memcpy ns/el",
              "GB/s", "speed-up");
  for (const CopyRow& r : rows) {
    const double n = static_cast<double>(r.n);
    std::printf("%9s %8d %12.3f %11.2f %15.3f %11.2f %9.2f\n", tz::format_count(n).c_str(), r.threads,
                r.times.a_median / n * 1e9, kBytesPerElement * n / r.times.a_median / 1e9, r.times.b_median / n * 1e9,
                kBytesPerElement * n / r.times.b_median / 1e9, r.times.b_median / r.times.a_median);
    out.push_back({{"elements", r.n}, {"threads", r.threads}, {"copy_seconds", r.times.a_s},
                   {"memcpy_seconds", r.times.b_s}, {"copy_median_s", r.times.a_median},
                   {"memcpy_median_s", r.times.b_median}, {"bytes_per_element", kBytesPerElement},
                   {"copy_gb_per_s", kBytesPerElement * n / r.times.a_median / 1e9},
                   {"memcpy_gb_per_s", kBytesPerElement * n / r.times.b_median / 1e9}});
  }
  return out;
}

}  // namespace tzbench::adam
