// Timeline: spans of work (NVMe reads, copies, collectives, compute, the
// optimizer) recorded from any thread and written as a Chrome trace (JSON
// "traceEvents", opens in Perfetto or chrome://tracing). Each track is a row
// (a "thread" in the viewer's terms). Recording is off until enabled; spans
// cost a mutex and a vector push.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "tierzero/common.h"

namespace tz::detail {

enum class Track : std::uint8_t { kCompute, kNvme, kH2D, kComm, kGrad, kOptimizer };
inline constexpr int kTracks = 6;
std::string_view track_name(Track track);

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  void enable(bool on);
  bool enabled() const { return enabled_; }
  void record(Track track, std::string name, Clock::time_point start, Clock::time_point end);
  // Writes every span recorded so far (microseconds from the first enable).
  Status write_json(const std::string& path) const;
  void clear();
  std::size_t size() const;

 private:
  struct Span {
    Track track;
    std::string name;
    Clock::time_point start, end;
  };
  mutable std::mutex mu_;
  bool enabled_ = false;
  Clock::time_point origin_ = Clock::now();
  std::vector<Span> spans_;
};

}  // namespace tz::detail
