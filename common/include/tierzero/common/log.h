// Logging: levelled, tagged by subsystem, always to stderr (never stdout: the
// library's stdout belongs to the program that links it).
//
// Levels come from the TIERZERO_LOG environment variable, read once:
//   TIERZERO_LOG=debug               every subsystem at debug
//   TIERZERO_LOG=warn,nvme=trace     warn by default, the nvme subsystem at trace
// Levels: trace, debug, info, warn, error, off. Default: info.
//
// Example:
//   TZ_LOG_INFO("offload", "pinned pool: {} budget on NUMA node {}", format_bytes(b), node);
//   TZ_LOG_ONCE_WARN("nvme", "io_uring refused ({}); using the pread/pwrite pool", why);
//
// Thread safety: every function may be called from any thread.
#pragma once

#include <fmt/format.h>

#include <atomic>
#include <string>
#include <string_view>

namespace tz::log {

enum class Level : int { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

// Parses "debug", "WARN", ... Returns false for an unknown name.
bool parse_level(std::string_view name, Level* out);
std::string_view level_name(Level level);

// Is a message at `level` from `subsystem` written?
bool enabled(std::string_view subsystem, Level level);
// Writes one line: "<time> [tierzero:<subsystem>] [<level>] <message>".
void write(std::string_view subsystem, Level level, std::string_view message);

// Replaces the TIERZERO_LOG setting (same syntax). Returns false, changing
// nothing, when the spec does not parse.
bool configure(std::string_view spec);

template <typename... Args>
void logf(std::string_view subsystem, Level level, fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(subsystem, level)) write(subsystem, level, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace tz::log

#define TZ_LOG_AT_(level, subsystem, ...) ::tz::log::logf(subsystem, level, __VA_ARGS__)
#define TZ_LOG_TRACE(subsystem, ...) TZ_LOG_AT_(::tz::log::Level::kTrace, subsystem, __VA_ARGS__)
#define TZ_LOG_DEBUG(subsystem, ...) TZ_LOG_AT_(::tz::log::Level::kDebug, subsystem, __VA_ARGS__)
#define TZ_LOG_INFO(subsystem, ...) TZ_LOG_AT_(::tz::log::Level::kInfo, subsystem, __VA_ARGS__)
#define TZ_LOG_WARN(subsystem, ...) TZ_LOG_AT_(::tz::log::Level::kWarn, subsystem, __VA_ARGS__)
#define TZ_LOG_ERROR(subsystem, ...) TZ_LOG_AT_(::tz::log::Level::kError, subsystem, __VA_ARGS__)

// Logs once per call site per process: for "falling back to X" messages that
// must be said, but only once.
#define TZ_LOG_ONCE_(level, subsystem, ...)                                   \
  do {                                                                        \
    static std::atomic<bool> tz_logged_once_{false};                          \
    if (!tz_logged_once_.exchange(true)) TZ_LOG_AT_(level, subsystem, __VA_ARGS__); \
  } while (0)
#define TZ_LOG_ONCE_INFO(subsystem, ...) TZ_LOG_ONCE_(::tz::log::Level::kInfo, subsystem, __VA_ARGS__)
#define TZ_LOG_ONCE_WARN(subsystem, ...) TZ_LOG_ONCE_(::tz::log::Level::kWarn, subsystem, __VA_ARGS__)
