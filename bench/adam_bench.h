// tierzero-adam-bench's shared pieces: its flags, the kernels it times, and
// the rows its measurements make, for the measuring (adam_bench.cpp), the
// torch comparison (adam_bench_torch.cpp) and the report (adam_bench_report.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "adam_stream.h"
#include "bench_common.h"
#include "tierzero/cpu_adam.h"
#include "tierzero/offload.h"

namespace tzbench::adam {

namespace ca = tz::cpu_adam;

// Gradients are stored as a mixed-precision run leaves them, scaled up by the
// loss scale; every kernel multiplies them by its inverse (the unscale).
constexpr double kGradScale = 1.0 / 4096;
// Headroom left in MemAvailable beyond the arrays.
constexpr std::uint64_t kHeadroomBytes = std::uint64_t{512} << 20;
// The whole step's gradient clip (time_whole_step in adam_bench.cpp), max norm 1 as torch computes it.
constexpr double kMaxGradNorm = 1.0;

struct Flags {
  std::string sizes = "200M";
  std::string threads = "1,all";
  std::string simd = "best";
  std::string kernels = "all";
  int repeats = 5;
  std::string json_path;
  std::size_t tile_elems = 0;
  bool hugepages = true;
  bool torch = true;
  std::string python = "python3";
  bool plain_copy_limit = false;
  bool whole_step = true;
  std::string layouts = "separate";  // more than "separate": the layout comparison (Note [Layout rows] in adam_bench.cpp)
};

enum class Kind : std::uint8_t { kStep, kGradArrival };

struct KernelSpec {
  std::string name;
  Kind kind;
  ca::Algorithm algorithm;  // kStep
  bool copy_out;            // kStep: bf16 copy of the new parameter
  tz::DType grad_dtype;
  Pattern pattern;
  ca::MasterFormat master = ca::MasterFormat::kFp32;  // kStep; kRemainder: the bf16 parameters are the output
  bool int8 = false;                                  // kStep: int8 moments (codes + block scales)
};

// One kernel of one configuration on one size: its times and its limit loop's.
struct Row {
  KernelSpec kernel;
  std::size_t n = 0;
  int threads = 0;
  std::string simd;
  std::size_t tile = 0;  // limit-loop tile, elements
  std::vector<double> kernel_s, limit_s;
  double kernel_median = 0, limit_median = 0;
  double pair_ratio_median = 0;  // median over repetitions of limit/kernel, for the record

  double bytes() const { return pattern_bytes_per_param(kernel.pattern) * static_cast<double>(n); }
  double ns_per_param() const { return kernel_median / static_cast<double>(n) * 1e9; }
  double gbps() const { return bytes() / kernel_median / 1e9; }
  double limit_gbps() const { return bytes() / limit_median / 1e9; }
  double fraction() const { return limit_median / kernel_median; }
};

// One kernel on one layout's arrays (Note [Layout rows]).
struct LayoutRow {
  std::string layout;
  KernelSpec kernel;
  std::size_t n = 0;
  int threads = 0;
  std::string simd;
  std::vector<double> kernel_s, limit_s;
  double kernel_median = 0, limit_median = 0;
  double vs_separate = 0;  // the separate layout's kernel median / this one's (>= 0.9: within 10%)
};

// The whole optimizer step of one configuration on one size.
struct WholeRow {
  std::size_t n = 0;
  int threads = 0;
  std::string simd;
  std::vector<double> seconds;
  double median_s = 0;
  double clip = 0;  // the last clip coefficient, for the record
};

// The machine as the run found it, printed above the tables and recorded in the JSON.
struct Machine {
  std::string cpu_model;
  std::string thp;  // /sys/kernel/mm/transparent_hugepage/enabled
  int affinity_cpus = 0;
  tz::HostMemoryReading mem;
};

}  // namespace tzbench::adam
