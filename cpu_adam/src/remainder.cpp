// The conversions between the master formats (tierzero/cpu_adam.h): plain
// loops over remainder.h's split and join, one tie-bit byte (8 elements) at a
// time, built for the baseline ISA.
#include "remainder.h"

#include <algorithm>

#include "validate.h"

namespace tz::cpu_adam {

Status encode_remainder_masters(const float* master, std::size_t n, std::uint16_t* bf16, std::int16_t* remainder,
                                std::uint8_t* tie_bits) {
  TZ_TRY_CTX(detail::validate_master_arrays(master, bf16, remainder, tie_bits, n), "cpu_adam encode_remainder_masters");
  for (std::size_t begin = 0; begin < n; begin += 8) {
    const std::size_t count = std::min<std::size_t>(8, n - begin);
    auto ties = static_cast<std::uint8_t>(tie_bits[begin / 8] & (0xffU << count));  // the bits past n stay
    for (std::size_t k = 0; k < count; ++k) {
      const detail::SplitMaster split = detail::split_master(master[begin + k]);
      bf16[begin + k] = split.bf16;
      remainder[begin + k] = split.remainder;
      ties = static_cast<std::uint8_t>(ties | (split.tie ? 1U << k : 0U));
    }
    tie_bits[begin / 8] = ties;
  }
  return ok_status();
}

Status decode_remainder_masters(const std::uint16_t* bf16, const std::int16_t* remainder,
                                const std::uint8_t* tie_bits, std::size_t n, float* master) {
  TZ_TRY_CTX(detail::validate_master_arrays(master, bf16, remainder, tie_bits, n), "cpu_adam decode_remainder_masters");
  for (std::size_t begin = 0; begin < n; begin += 8) {
    const std::size_t count = std::min<std::size_t>(8, n - begin);
    const std::uint8_t ties = tie_bits[begin / 8];
    for (std::size_t k = 0; k < count; ++k) {
      master[begin + k] = detail::join_master(bf16[begin + k], remainder[begin + k], ((ties >> k) & 1U) != 0);
    }
  }
  return ok_status();
}

}  // namespace tz::cpu_adam
