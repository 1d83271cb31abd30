#include "tierzero/common/units.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <string>

namespace tz {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Splits "1.5 GiB" into 1.5 and "gib" (lower case). False if no number leads.
bool split_number(std::string_view text, double* number, std::string* unit) {
  text = trim(text);
  const char* begin = text.data();
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(begin, end, *number);
  if (ec != std::errc() || ptr == begin) return false;
  std::string_view rest = trim(std::string_view(ptr, static_cast<size_t>(end - ptr)));
  unit->assign(rest);
  std::transform(unit->begin(), unit->end(), unit->begin(), [](unsigned char c) { return std::tolower(c); });
  return std::isfinite(*number);
}

}  // namespace

Expected<std::uint64_t> parse_bytes(std::string_view text) {
  double number = 0;
  std::string unit;
  if (!split_number(text, &number, &unit)) {
    return invalid_argument("'{}' is not a byte size (want a number of bytes, or e.g. '80GB', '64GiB', '2TB')",
                            text);
  }
  static constexpr std::pair<std::string_view, double> kUnits[] = {
      {"", 1.0},        {"b", 1.0},           {"k", 1e3},         {"kb", 1e3},
      {"m", 1e6},       {"mb", 1e6},          {"g", 1e9},         {"gb", 1e9},
      {"t", 1e12},      {"tb", 1e12},         {"kib", 0x1p10},    {"mib", 0x1p20},
      {"gib", 0x1p30},  {"tib", 0x1p40}};
  for (const auto& [name, scale] : kUnits) {
    if (unit == name) {
      double bytes = number * scale;
      if (bytes < 0 || bytes >= 0x1p63) {
        return invalid_argument("byte size '{}' is out of range [0, 2^63)", text);
      }
      return static_cast<std::uint64_t>(bytes);
    }
  }
  return invalid_argument("'{}': unknown unit '{}' (use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB)", text, unit);
}

Expected<double> parse_count(std::string_view text) {
  double number = 0;
  std::string unit;
  if (!split_number(text, &number, &unit)) {
    return invalid_argument("'{}' is not a count (want e.g. '20e9', '1.3B', '350M')", text);
  }
  double scale = 0;
  if (unit.empty()) scale = 1;
  else if (unit == "k") scale = 1e3;
  else if (unit == "m") scale = 1e6;
  else if (unit == "b" || unit == "g") scale = 1e9;
  else if (unit == "t") scale = 1e12;
  if (scale == 0) return invalid_argument("'{}': unknown suffix '{}' (use K, M, B or T)", text, unit);
  if (number < 0) return invalid_argument("count '{}' is negative", text);
  return number * scale;
}

std::string format_bytes(std::uint64_t bytes) {
  if (bytes < kKiB) return fmt::format("{} B", bytes);
  static constexpr std::string_view kNames[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes) / 1024.0;
  size_t i = 0;
  while (value >= 1024.0 && i + 1 < std::size(kNames)) {
    value /= 1024.0;
    ++i;
  }
  return fmt::format("{:.2f} {}", value, kNames[i]);
}

std::string format_count(double count) {
  if (count >= 1e12) return fmt::format("{:.1f}T", count / 1e12);
  if (count >= 1e9) return fmt::format("{:.1f}B", count / 1e9);
  if (count >= 1e6) return fmt::format("{:.1f}M", count / 1e6);
  if (count >= 1e3) return fmt::format("{:.1f}K", count / 1e3);
  return fmt::format("{:.0f}", count);
}

}  // namespace tz
