#include "trace.h"

#include <unistd.h>


#include <nlohmann/json.hpp>

namespace tz::detail {

std::string_view track_name(Track track) {
  switch (track) {
    case Track::kCompute: return "compute";
    case Track::kNvme: return "nvme read";
    case Track::kH2D: return "host to device";
    case Track::kComm: return "collectives";
    case Track::kGrad: return "gradients (D2H + accumulate)";
    case Track::kOptimizer: return "optimizer";
  }
  return "?";
}

void Timeline::enable(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  if (on && !enabled_ && spans_.empty()) origin_ = Clock::now();
  enabled_ = on;
}

void Timeline::record(Track track, std::string name, Clock::time_point start, Clock::time_point end) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!enabled_) return;
  spans_.push_back({track, std::move(name), start, end});
}

void Timeline::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  spans_.clear();
  origin_ = Clock::now();
}

std::size_t Timeline::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spans_.size();
}

Status Timeline::write_json(const std::string& path) const {
  TZ_TRY(check_path(path, "write_timeline"));
  nlohmann::json events = nlohmann::json::array();
  const int pid = static_cast<int>(::getpid());
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int t = 0; t < kTracks; ++t) {
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", t},
                        {"args", {{"name", track_name(static_cast<Track>(t))}}}});
    }
    for (const Span& s : spans_) {
      const double ts = std::chrono::duration<double, std::micro>(s.start - origin_).count();
      const double dur = std::chrono::duration<double, std::micro>(s.end - s.start).count();
      events.push_back({{"name", s.name}, {"ph", "X"}, {"pid", pid}, {"tid", static_cast<int>(s.track)},
                        {"ts", ts}, {"dur", dur}});
    }
  }
  // A reader never sees half a file.
  return write_file_durably(path, nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump())
      .with_context("writing the trace");
}

}  // namespace tz::detail
