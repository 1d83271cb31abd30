#include "tierzero/common/log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <mutex>
#include <shared_mutex>

namespace tz::log {
namespace {

struct Settings {
  Level default_level = Level::kInfo;
  std::map<std::string, Level, std::less<>> per_subsystem;
};

bool parse_spec(std::string_view spec, Settings* out) {
  Settings settings;
  while (!spec.empty()) {
    auto comma = spec.find(',');
    std::string_view item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view() : spec.substr(comma + 1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.remove_prefix(1);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.remove_suffix(1);
    if (item.empty()) continue;
    Level level;
    if (auto eq = item.find('='); eq != std::string_view::npos) {
      if (!parse_level(item.substr(eq + 1), &level) || eq == 0) return false;
      settings.per_subsystem[std::string(item.substr(0, eq))] = level;
    } else {
      if (!parse_level(item, &level)) return false;
      settings.default_level = level;
    }
  }
  *out = std::move(settings);
  return true;
}

// One stderr sink shared by every subsystem's lines; spdlog's _mt sink locks.
class Logger {
 public:
  Logger() : sink_(std::make_shared<spdlog::sinks::stderr_sink_mt>()) {
    sink_->set_pattern("%Y-%m-%d %H:%M:%S.%e %v");
    if (const char* env = std::getenv("TIERZERO_LOG"); env != nullptr) {
      if (!parse_spec(env, &settings_)) {
        sink_->log(make_msg("log", Level::kWarn,
                            fmt::format("TIERZERO_LOG='{}' does not parse (want e.g. 'debug' or "
                                        "'warn,nvme=trace'); using 'info'", env)));
      }
    }
  }

  Level level_for(std::string_view subsystem) const {
    std::shared_lock lock(mu_);
    auto it = settings_.per_subsystem.find(subsystem);
    return it != settings_.per_subsystem.end() ? it->second : settings_.default_level;
  }

  void write(std::string_view subsystem, Level level, std::string_view message) {
    sink_->log(make_msg(subsystem, level, message));
  }

  bool configure(std::string_view spec) {
    Settings settings;
    if (!parse_spec(spec, &settings)) return false;
    std::unique_lock lock(mu_);
    settings_ = std::move(settings);
    return true;
  }

 private:
  static spdlog::details::log_msg make_msg(std::string_view subsystem, Level level, std::string_view message) {
    // The formatted line lives in a thread-local buffer for the duration of log().
    thread_local std::string line;
    line = fmt::format("[tierzero:{}] [{}] {}", subsystem, level_name(level), message);
    return spdlog::details::log_msg(spdlog::string_view_t(), to_spdlog(level),
                                    spdlog::string_view_t(line.data(), line.size()));
  }
  static spdlog::level::level_enum to_spdlog(Level level) {
    return static_cast<spdlog::level::level_enum>(static_cast<int>(level));
  }

  std::shared_ptr<spdlog::sinks::stderr_sink_mt> sink_;
  mutable std::shared_mutex mu_;
  Settings settings_;
};

Logger& logger() {
  static Logger* instance = new Logger();  // never destroyed: usable from static destructors
  return *instance;
}

}  // namespace

bool parse_level(std::string_view name, Level* out) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  static constexpr std::pair<std::string_view, Level> kNames[] = {
      {"trace", Level::kTrace}, {"debug", Level::kDebug}, {"info", Level::kInfo},
      {"warn", Level::kWarn},   {"warning", Level::kWarn}, {"error", Level::kError},
      {"off", Level::kOff}};
  for (const auto& [text, level] : kNames) {
    if (lower == text) {
      *out = level;
      return true;
    }
  }
  return false;
}

std::string_view level_name(Level level) {
  switch (level) {
    case Level::kTrace: return "trace";
    case Level::kDebug: return "debug";
    case Level::kInfo: return "info";
    case Level::kWarn: return "warn";
    case Level::kError: return "error";
    case Level::kOff: return "off";
  }
  return "?";
}

bool enabled(std::string_view subsystem, Level level) {
  return level != Level::kOff && level >= logger().level_for(subsystem);
}

void write(std::string_view subsystem, Level level, std::string_view message) {
  logger().write(subsystem, level, message);
}

bool configure(std::string_view spec) { return logger().configure(spec); }

}  // namespace tz::log
