// The remainder-master conversions' timing (adam_bench_conversions.h).
#include "adam_bench_conversions.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <random>

#include "bench_common.h"
#include "tierzero/common.h"
#include "tierzero/cpu_adam.h"

namespace tzbench::adam {
namespace {

namespace ca = tz::cpu_adam;

// 32M masters: 384 MiB of arrays beside the kernels' own, and long enough
// that a repetition takes tens of milliseconds.
constexpr std::size_t kConversionCap = std::size_t{1} << 25;

}  // namespace

tz::Status measure_conversions(std::size_t size, int repeats, std::vector<ConversionRow>& out) {
  ConversionRow row{.n = std::min(size, kConversionCap)};
  const std::size_t n = row.n;
  std::vector<float> master(n), back(n);
  std::vector<std::uint16_t> bf16(n);
  std::vector<std::int16_t> remainder(n);
  std::vector<std::uint8_t> ties((n + 7) / 8);
  std::mt19937_64 gen(n);
  std::uniform_real_distribution<float> uniform(-2.0F, 2.0F);
  for (float& x : master) x = uniform(gen);
  const tz::Status timed = time_pairs(repeats, row.times, [&](int, double& encode, double& decode) -> tz::Status {
    std::memset(back.data(), 0, n * sizeof(float));
    const auto t0 = Clock::now();
    TZ_TRY(ca::encode_remainder_masters(master.data(), n, bf16.data(), remainder.data(), ties.data()));
    encode = seconds_since(t0);
    const auto t1 = Clock::now();
    TZ_TRY(ca::decode_remainder_masters(bf16.data(), remainder.data(), ties.data(), n, back.data()));
    decode = seconds_since(t1);
    if (std::memcmp(master.data(), back.data(), n * sizeof(float)) != 0) {
      return tz::internal_error("remainder conversions of {} masters: the decode did not rebuild them bit for bit", n);
    }
    return tz::ok_status();
  });
  TZ_TRY(timed);
  out.push_back(std::move(row));
  return tz::ok_status();
}

nlohmann::json print_conversions(const std::vector<ConversionRow>& rows) {
  nlohmann::json out = nlohmann::json::array();
  if (rows.empty()) return out;
  // Bytes each must move: encode reads 4 and writes 2 + 2 + 1/8; decode the reverse.
  constexpr double kBytes = 4 + 2 + 2 + 0.125;
  std::printf("\nremainder-master conversions, every core (%u threads; encode: fp32 -> bf16 + remainder + tie bit, at creation; "
              "decode: back, for fp32 exports and checkpoints), %.3f B/element each\n", std::thread::hardware_concurrency(), kBytes);
  std::printf("%9s %14s %11s %14s %11s\n", "elements", "encode ns/el", "GB/s", "decode ns/el", "GB/s");
  for (const ConversionRow& r : rows) {
    const double n = static_cast<double>(r.n);
    std::printf("%9s %14.3f %11.2f %14.3f %11.2f\n", tz::format_count(n).c_str(), r.times.a_median / n * 1e9,
                kBytes * n / r.times.a_median / 1e9, r.times.b_median / n * 1e9, kBytes * n / r.times.b_median / 1e9);
    out.push_back({{"elements", r.n}, {"encode_seconds", r.times.a_s}, {"decode_seconds", r.times.b_s},
                   {"encode_median_s", r.times.a_median}, {"decode_median_s", r.times.b_median},
                   {"encode_ns_per_element", r.times.a_median / n * 1e9},
                   {"decode_ns_per_element", r.times.b_median / n * 1e9}, {"bytes_per_element", kBytes}});
  }
  return out;
}

}  // namespace tzbench::adam
