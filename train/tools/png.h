// A small line chart written as a PNG (zlib for the compression), for
// tierzero-train's loss curve: axes with tick labels, one polyline per
// series, a legend. Text uses a built-in 5x7 pixel font (digits, lower-case
// letters and a few signs).
//
//   tz::tool::Chart chart{.title = "loss", .x_label = "step", .y_label = "loss"};
//   chart.series.push_back({"train", {0x1f, 0x77, 0xb4}, steps, losses});
//   TZ_TRY(tz::tool::write_line_chart(chart, "loss.png"));
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "tierzero/common.h"

namespace tz::tool {

struct Series {
  std::string name;
  std::array<std::uint8_t, 3> rgb{0, 0, 0};
  std::vector<double> x, y;   // same length; drawn in order, points (x[i], y[i]) joined
  bool markers = false;       // also draw a small square at each point
};

struct Chart {
  std::string title, x_label, y_label;
  std::vector<Series> series;
  int width = 800, height = 500;
};

// Draws the chart and writes it as an 8-bit RGB PNG; errors name the path.
tz::Status write_line_chart(const Chart& chart, const std::string& path);

// Writes rgb (height rows of width x 3 bytes) as a PNG.
tz::Status write_png(const std::string& path, int width, int height, const std::vector<std::uint8_t>& rgb);

}  // namespace tz::tool
