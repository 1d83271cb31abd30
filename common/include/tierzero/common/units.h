// Byte sizes as users write them, and back.
//
//   parse_bytes("80GB")   -> 80'000'000'000      (SI: kB, MB, GB, TB = 10^3k)
//   parse_bytes("80GiB")  -> 85'899'345'920      (IEC: KiB, MiB, GiB, TiB = 2^10k)
//   parse_bytes("1.5e9")  -> 1'500'000'000       (plain numbers are bytes)
//   format_bytes(85'899'345'920) -> "80.00 GiB"
//
// Sizes are case-insensitive in the unit ("gb" == "GB"); "B" alone is bytes.
// A fractional result is rounded down to whole bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "tierzero/common/status.h"

namespace tz {

inline constexpr std::uint64_t kKiB = 1024;
inline constexpr std::uint64_t kMiB = 1024 * kKiB;
inline constexpr std::uint64_t kGiB = 1024 * kMiB;
inline constexpr std::uint64_t kTiB = 1024 * kGiB;

// Errors name the text and the accepted forms.
Expected<std::uint64_t> parse_bytes(std::string_view text);
// Parses a count such as "20e9", "1.5B" (billion), "7M", "350000".
Expected<double> parse_count(std::string_view text);

// "512 B", "4.00 KiB", "1.50 GiB", ... (binary units, two decimals).
std::string format_bytes(std::uint64_t bytes);
// "20.0B", "350.0M", "1.2K", "12" for parameter counts.
std::string format_count(double count);

constexpr std::uint64_t align_up(std::uint64_t value, std::uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace tz
