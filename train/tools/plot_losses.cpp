// tierzero-plot-losses: several tierzero-train runs' loss curves in one PNG,
// to compare runs that differ in one setting (the state formats of issue #21,
// say). Each run's training loss is drawn as its mean over the last 10 steps,
// and its validation losses as markers, in the run's own colour.
//
//   tierzero-plot-losses formats.png "fp32=out-fp32/loss.csv" "remainder + bf16=out-bf16/loss.csv"
//
// Reads loss.csv as tierzero-train writes it (step,loss,val_loss,...; an
// empty val_loss where no evaluation ran). Exit 0, or 1 naming the file and
// line that could not be read.
#include <array>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "png.h"

namespace {

using tz::tool::Series;

struct Curves {
  Series train, val;
};

tz::Expected<Curves> read_run(const std::string& label, const std::string& path, std::array<std::uint8_t, 3> rgb) {
  std::ifstream in(path);
  if (!in) return tz::not_found("{}: cannot be opened", path);
  Curves c{.train = {label + " train (mean of 10)", rgb, {}, {}}, .val = {label + " validation", rgb, {}, {}, true}};
  std::string line;
  std::getline(in, line);
  if (line.rfind("step,loss,val_loss", 0) != 0) return tz::invalid_argument("{}: not a tierzero-train loss.csv", path);
  std::vector<double> last;
  for (int n = 2; std::getline(in, line); ++n) {
    std::stringstream fields(line);
    std::string step, loss, val;
    std::getline(fields, step, ',');
    std::getline(fields, loss, ',');
    std::getline(fields, val, ',');
    try {
      const double x = std::stod(step);
      last.push_back(std::stod(loss));
      if (last.size() > 10) last.erase(last.begin());
      double mean = 0;
      for (double l : last) mean += l / static_cast<double>(last.size());
      c.train.x.push_back(x);
      c.train.y.push_back(mean);
      if (!val.empty()) {
        c.val.x.push_back(x);
        c.val.y.push_back(std::stod(val));
      }
    } catch (const std::exception&) {
      return tz::invalid_argument("{} line {}: '{}' is not step,loss,val_loss,...", path, n, line);
    }
  }
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s OUT.png LABEL=loss.csv [LABEL=loss.csv ...]\n", argv[0]);
    return 1;
  }
  constexpr std::array<std::array<std::uint8_t, 3>, 6> kColours = {
      {{0x1f, 0x77, 0xb4}, {0xd6, 0x27, 0x28}, {0x2c, 0xa0, 0x2c}, {0x94, 0x67, 0xbd}, {0xff, 0x7f, 0x0e}, {0x8c, 0x56, 0x4b}}};
  tz::tool::Chart chart{.title = "tierzero-train runs", .x_label = "step", .y_label = "loss (nats)"};
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::size_t eq = arg.find('=');
    if (eq == std::string::npos || eq == 0) {
      std::fprintf(stderr, "argument %d ('%s') is not LABEL=loss.csv\n", i, arg.c_str());
      return 1;
    }
    auto run = read_run(arg.substr(0, eq), arg.substr(eq + 1), kColours[(i - 2) % kColours.size()]);
    if (!run.ok()) {
      std::fprintf(stderr, "%s\n", run.status().message().c_str());
      return 1;
    }
    chart.series.push_back(std::move(run->train));
    if (!run->val.x.empty()) chart.series.push_back(std::move(run->val));
  }
  const tz::Status written = tz::tool::write_line_chart(chart, argv[1]);
  if (!written.ok()) {
    std::fprintf(stderr, "%s\n", written.message().c_str());
    return 1;
  }
  return 0;
}
