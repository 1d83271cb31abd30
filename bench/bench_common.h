// What every tierzero benchmark shares: timing, the median, comma lists, the
// progress line on stderr, and the build and CPU summary printed above each
// table. Header-only; each benchmark target defines TZB_VERSION and
// TZB_BUILD_TYPE (bench/CMakeLists.txt).
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#ifndef TZB_VERSION
#define TZB_VERSION "unknown"
#endif
#ifndef TZB_BUILD_TYPE
#define TZB_BUILD_TYPE "unknown"
#endif

namespace tzbench {

using Clock = std::chrono::steady_clock;

// --json's check, before the benchmark runs (a CLI11 validator): the file can
// be written, so a long run does not end in "cannot write". An existing file
// is left as it is; one created to find out is removed.
inline std::string writable_file(std::string& path) {
  const bool existed = ::access(path.c_str(), F_OK) == 0;
  if (std::ofstream probe(path, std::ios::app); !probe) return "cannot write " + path;
  if (!existed) std::remove(path.c_str());
  return {};
}

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Median of the values (0 for none).
inline double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t k = values.size();
  return k % 2 == 1 ? values[k / 2] : 0.5 * (values[k / 2 - 1] + values[k / 2]);
}

// Two timed parts a round, side by side: round(r, a, b) runs once as a
// warm-up (r = -1) and then `repeats` times, putting its two parts' seconds
// in a and b and checking what it must; the first result that is not ok()
// is returned. `out` gets each part's seconds and medians.
struct PairedTimes {
  std::vector<double> a_s, b_s;
  double a_median = 0, b_median = 0;
};
template <typename Round>
auto time_pairs(int repeats, PairedTimes& out, Round round) {
  using Result = decltype(round(0, std::declval<double&>(), std::declval<double&>()));
  for (int r = -1; r < repeats; ++r) {
    double a = 0, b = 0;
    Result result = round(r, a, b);
    if (!result.ok()) return result;
    if (r < 0) continue;
    out.a_s.push_back(a);
    out.b_s.push_back(b);
  }
  out.a_median = median(out.a_s);
  out.b_median = median(out.b_s);
  return Result{};
}

// "128K, 1M,8M" -> {"128K", "1M", "8M"}: items split at commas, blanks
// trimmed, empty items kept (for the caller to refuse by name).
inline std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto b = item.find_first_not_of(" \t");
    const auto e = item.find_last_not_of(" \t");
    out.push_back(b == std::string::npos ? std::string() : item.substr(b, e - b + 1));
  }
  return out;
}

// One line on stderr, rewritten in place on a terminal; one line per call otherwise.
class Progress {
 public:
  Progress() : tty_(::isatty(2) != 0) {}
  template <typename... Args>
  void show(fmt::format_string<Args...> format, Args&&... args) {
    const std::string line = fmt::format(format, std::forward<Args>(args)...);
    if (tty_) {
      std::fprintf(stderr, "\r\033[K%s", line.c_str());
      dirty_ = true;
    } else {
      std::fprintf(stderr, "%s\n", line.c_str());
    }
    std::fflush(stderr);
  }
  // A line that only a terminal shows (updates within a run).
  template <typename... Args>
  void update(fmt::format_string<Args...> format, Args&&... args) {
    if (tty_) show(format, std::forward<Args>(args)...);
  }
  // Clears the line (on a terminal) before the tables are printed.
  void done() {
    if (dirty_) std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
    dirty_ = false;
  }
  bool tty() const { return tty_; }

 private:
  bool tty_;
  bool dirty_ = false;
};

// "tierzero 0.1.0 (RelWithDebInfo), bench built by GCC 12.2.0".
inline std::string build_summary() {
#if defined(__clang__)
  const std::string compiler = fmt::format("clang {}", __clang_version__);
#elif defined(__GNUC__)
  const std::string compiler = fmt::format("GCC {}", __VERSION__);
#else
  const std::string compiler = "unknown compiler";
#endif
  return fmt::format("tierzero {} ({}), bench built by {}", TZB_VERSION, TZB_BUILD_TYPE, compiler);
}

// /proc/cpuinfo's first "model name" ("unknown" where there is none).
inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  }
  return "unknown";
}

}  // namespace tzbench
