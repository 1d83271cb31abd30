// The loss chart and the PNG encoder (png.h).
#include "png.h"

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

namespace tz::tool {
namespace {

using Rgb = std::array<std::uint8_t, 3>;

// 5x7 glyphs, one row per byte, bit 4 = leftmost pixel.
const std::map<char, std::array<std::uint8_t, 7>>& font() {
  static const std::map<char, std::array<std::uint8_t, 7>> glyphs = {
      {'0', {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}}, {'1', {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E}},
      {'2', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}}, {'3', {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E}},
      {'4', {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}}, {'5', {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E}},
      {'6', {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}}, {'7', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}},
      {'8', {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}}, {'9', {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}},
      {'.', {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C}}, {'-', {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00}},
      {'+', {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00}}, {':', {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00}},
      {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}}, {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}},
      {',', {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08}}, {'/', {0x01, 0x01, 0x02, 0x04, 0x08, 0x10, 0x10}},
      {'=', {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00}}, {'x', {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11}},
      {'a', {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F}}, {'b', {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E}},
      {'c', {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E}}, {'d', {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F}},
      {'e', {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E}}, {'f', {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08}},
      {'g', {0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E}}, {'h', {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11}},
      {'i', {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E}}, {'j', {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C}},
      {'k', {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12}}, {'l', {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}},
      {'m', {0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11}}, {'n', {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11}},
      {'o', {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E}}, {'p', {0x00, 0x00, 0x1E, 0x11, 0x1E, 0x10, 0x10}},
      {'q', {0x00, 0x00, 0x0D, 0x13, 0x0F, 0x01, 0x01}}, {'r', {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10}},
      {'s', {0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E}}, {'t', {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06}},
      {'u', {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D}}, {'v', {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04}},
      {'w', {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A}}, {'y', {0x00, 0x00, 0x11, 0x11, 0x0F, 0x01, 0x0E}},
      {'z', {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F}},
  };
  return glyphs;
}

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), rgb_(static_cast<std::size_t>(w) * h * 3, 255) {}

  void set(int x, int y, const Rgb& c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    std::copy(c.begin(), c.end(), rgb_.begin() + (static_cast<std::size_t>(y) * w_ + x) * 3);
  }
  void rect(int x0, int y0, int x1, int y1, const Rgb& c) {
    for (int y = y0; y <= y1; ++y) {
      for (int x = x0; x <= x1; ++x) set(x, y, c);
    }
  }
  // Bresenham, `thick` pixels wide.
  void line(int x0, int y0, int x1, int y1, const Rgb& c, int thick = 1) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
    const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    for (;;) {
      rect(x0, y0, x0 + thick - 1, y0 + thick - 1, c);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * err;
      if (e2 >= dy) {
        err += dy;
        x0 += sx;
      }
      if (e2 <= dx) {
        err += dx;
        y0 += sy;
      }
    }
  }
  // Text with its top-left corner at (x, y); characters without a glyph are spaces.
  void text(int x, int y, const std::string& s, const Rgb& c) {
    for (char ch : s) {
      auto g = font().find(static_cast<char>(std::tolower(static_cast<unsigned char>(ch))));
      if (g != font().end()) {
        for (int row = 0; row < 7; ++row) {
          for (int col = 0; col < 5; ++col) {
            if ((g->second[row] >> (4 - col)) & 1) set(x + col, y + row, c);
          }
        }
      }
      x += 6;
    }
  }
  static int text_width(const std::string& s) { return static_cast<int>(s.size()) * 6; }
  const std::vector<std::uint8_t>& rgb() const { return rgb_; }

 private:
  int w_, h_;
  std::vector<std::uint8_t> rgb_;
};

// Round tick positions covering [lo, hi]: steps of 1, 2 or 5 x 10^k.
std::vector<double> ticks(double lo, double hi, int target) {
  const double raw = (hi - lo) / std::max(target, 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  std::vector<double> out;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push_back(std::fabs(t) < step * 1e-9 ? 0 : t);
  return out;
}

std::string tick_label(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

void append_chunk(std::string& out, const char* type, const std::string& data) {
  auto put32 = [&](std::uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<char>((v >> s) & 0xFF));
  };
  put32(static_cast<std::uint32_t>(data.size()));
  const std::string body = std::string(type, 4) + data;
  out += body;
  put32(static_cast<std::uint32_t>(crc32(0, reinterpret_cast<const Bytef*>(body.data()), static_cast<uInt>(body.size()))));
}

}  // namespace

tz::Status write_png(const std::string& path, int width, int height, const std::vector<std::uint8_t>& rgb) {
  std::string raw;  // each row: filter byte 0, then the pixels
  for (int y = 0; y < height; ++y) {
    raw.push_back('\0');
    raw.append(reinterpret_cast<const char*>(rgb.data()) + static_cast<std::size_t>(y) * width * 3,
               static_cast<std::size_t>(width) * 3);
  }
  uLongf packed_size = compressBound(static_cast<uLong>(raw.size()));
  std::string packed(packed_size, '\0');
  if (compress2(reinterpret_cast<Bytef*>(packed.data()), &packed_size, reinterpret_cast<const Bytef*>(raw.data()),
                static_cast<uLong>(raw.size()), 9) != Z_OK) {
    return tz::internal_error("PNG {}: zlib could not compress {} bytes", path, raw.size());
  }
  packed.resize(packed_size);
  std::string header;
  for (std::uint32_t v : {static_cast<std::uint32_t>(width), static_cast<std::uint32_t>(height)}) {
    for (int s = 24; s >= 0; s -= 8) header.push_back(static_cast<char>((v >> s) & 0xFF));
  }
  header += std::string("\x08\x02\x00\x00\x00", 5);  // 8-bit RGB, deflate, no filter method, no interlace
  std::string png("\x89PNG\r\n\x1a\n", 8);
  append_chunk(png, "IHDR", header);
  append_chunk(png, "IDAT", packed);
  append_chunk(png, "IEND", "");
  return tz::write_file_durably(path, png);
}

tz::Status write_line_chart(const Chart& chart, const std::string& path) {
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const Series& s : chart.series) {
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      x0 = std::min(x0, s.x[i]), x1 = std::max(x1, s.x[i]), y0 = std::min(y0, s.y[i]), y1 = std::max(y1, s.y[i]);
    }
  }
  if (!(x0 <= x1)) return tz::invalid_argument("chart {}: no finite points to draw", path);
  if (x1 - x0 < 1e-12) x1 = x0 + 1;
  if (y1 - y0 < 1e-12) y1 = y0 + 1;
  const double pad = (y1 - y0) * 0.05;
  y0 -= pad;
  y1 += pad;
  Canvas c(chart.width, chart.height);
  const int left = 70, right = chart.width - 20, top = 40, bottom = chart.height - 50;
  auto px = [&](double x) { return left + static_cast<int>(std::lround((x - x0) / (x1 - x0) * (right - left))); };
  auto py = [&](double y) { return bottom - static_cast<int>(std::lround((y - y0) / (y1 - y0) * (bottom - top))); };
  const Rgb grid{225, 225, 225}, ink{40, 40, 40};
  for (double t : ticks(y0, y1, 6)) {
    c.line(left, py(t), right, py(t), grid);
    const std::string l = tick_label(t);
    c.text(left - 8 - Canvas::text_width(l), py(t) - 3, l, ink);
  }
  for (double t : ticks(x0, x1, 8)) {
    c.line(px(t), top, px(t), bottom, grid);
    const std::string l = tick_label(t);
    c.text(px(t) - Canvas::text_width(l) / 2, bottom + 8, l, ink);
  }
  c.line(left, bottom, right, bottom, ink);
  c.line(left, top, left, bottom, ink);
  c.text((chart.width - Canvas::text_width(chart.title)) / 2, 14, chart.title, ink);
  c.text((left + right - Canvas::text_width(chart.x_label)) / 2, chart.height - 22, chart.x_label, ink);
  c.text(8, top - 18, chart.y_label, ink);
  std::size_t longest = 0;
  for (const Series& s : chart.series) longest = std::max(longest, s.name.size());
  const int legend_x = right - 30 - Canvas::text_width(std::string(longest, 'x'));
  int legend_y = top + 8;
  for (const Series& s : chart.series) {
    for (std::size_t i = 0; i + 1 < s.x.size(); ++i) {
      if (std::isfinite(s.y[i]) && std::isfinite(s.y[i + 1])) {
        c.line(px(s.x[i]), py(s.y[i]), px(s.x[i + 1]), py(s.y[i + 1]), s.rgb, 2);
      }
    }
    for (std::size_t i = 0; s.markers && i < s.x.size(); ++i) {
      if (std::isfinite(s.y[i])) c.rect(px(s.x[i]) - 2, py(s.y[i]) - 2, px(s.x[i]) + 2, py(s.y[i]) + 2, s.rgb);
    }
    c.rect(legend_x, legend_y, legend_x + 18, legend_y + 3, s.rgb);
    c.text(legend_x + 25, legend_y - 2, s.name, ink);
    legend_y += 14;
  }
  return write_png(path, chart.width, chart.height, c.rgb());
}

}  // namespace tz::tool
