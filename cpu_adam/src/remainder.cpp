// The conversions between the master formats (tierzero/cpu_adam.h): plain
// loops over remainder.h's split and join, one tie-bit byte (8 elements) at a
// time, built for the baseline ISA, on every core in runs of whole bytes
// (start-up and checkpoints convert billions of elements at once).
#include "remainder.h"

#include <algorithm>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include "validate.h"

namespace tz::cpu_adam {
namespace {

// body(begin, end) over [0, n) on every core, in runs that start on a multiple of 8.
template <typename Body>
void for_runs_of_8(std::size_t n, Body body) {
  constexpr std::size_t kRun = std::size_t{1} << 16;
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, (n + kRun - 1) / kRun), [&](const auto& r) {
    for (std::size_t run = r.begin(); run < r.end(); ++run) body(run * kRun, std::min(n, (run + 1) * kRun));
  });
}

}  // namespace

Status encode_remainder_masters(const float* master, std::size_t n, std::uint16_t* bf16, std::int16_t* remainder,
                                std::uint8_t* tie_bits) {
  TZ_TRY_CTX(detail::validate_master_arrays(master, bf16, remainder, tie_bits, n), "cpu_adam encode_remainder_masters");
  for_runs_of_8(n, [&](std::size_t first, std::size_t last) {
    for (std::size_t begin = first; begin < last; begin += 8) {
      const std::size_t count = std::min<std::size_t>(8, last - begin);
      auto ties = static_cast<std::uint8_t>(tie_bits[begin / 8] & (0xffU << count));  // the bits past n stay
      for (std::size_t k = 0; k < count; ++k) {
        const detail::SplitMaster split = detail::split_master(master[begin + k]);
        bf16[begin + k] = split.bf16;
        remainder[begin + k] = split.remainder;
        ties = static_cast<std::uint8_t>(ties | (split.tie ? 1U << k : 0U));
      }
      tie_bits[begin / 8] = ties;
    }
  });
  return ok_status();
}

Status decode_remainder_masters(const std::uint16_t* bf16, const std::int16_t* remainder,
                                const std::uint8_t* tie_bits, std::size_t n, float* master) {
  TZ_TRY_CTX(detail::validate_master_arrays(master, bf16, remainder, tie_bits, n), "cpu_adam decode_remainder_masters");
  for_runs_of_8(n, [&](std::size_t first, std::size_t last) {
    for (std::size_t begin = first; begin < last; begin += 8) {
      const std::size_t count = std::min<std::size_t>(8, last - begin);
      const std::uint8_t ties = tie_bits[begin / 8];
      for (std::size_t k = 0; k < count; ++k) {
        master[begin + k] = detail::join_master(bf16[begin + k], remainder[begin + k], ((ties >> k) & 1U) != 0);
      }
    }
  });
  return ok_status();
}

}  // namespace tz::cpu_adam
