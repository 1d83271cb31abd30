// tierzero-nvme-bench's modes: plain runs, the sweep, --tune, the paired fio
// comparison and the swap store round trip. Each prints its table on stdout
// and returns its JSON section.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "nvme_bench_fio.h"
#include "nvme_bench_raw.h"
#include "nvme_bench_swap.h"

namespace tzbench {

// What the flags resolve to.
struct Setup {
  std::vector<std::string> dirs;          // --path, one scratch file each
  std::uint64_t file_bytes = 0;           // per path
  EngineConfig base;                      // the single configuration (no sweep)
  std::vector<Workload> workloads;        // raw runs, in order
  bool swap = false;
  int repeats = 3;                        // plain runs per workload
  int pairs = 5;                          // ours/fio pairs, swap rounds
  RunLimits limits;                       // per run
  std::vector<EngineConfig> grid;         // the sweep's points
  RunLimits sweep_limits;                 // per sweep point
  SwapSpec swap_spec;
  std::string fio = "fio";
  bool hugepages = true;                  // request buffers madvised; fio told to do the same
};

// What every mode uses.
struct Context {
  Setup setup;
  const ScratchFiles* files = nullptr;
  HostBuffer* pool = nullptr;
  PageCache cache{false};
  Progress progress;
};

// A measurement of one configuration: GB/s, and for --tune the parts (write, read).
struct Sample {
  double gbps = 0;
  double iops = 0;
  double latency_us = 0;
  std::vector<double> parts;
  std::string command;  // fio: the command line it ran
};

// One run of ours (a fresh engine for `config`) or of fio.
tz::Expected<Sample> measure_ours(Context& ctx, const EngineConfig& config, Workload w, const RunLimits& limits);
tz::Expected<Sample> measure_fio(Context& ctx, const EngineConfig& config, Workload w, const RunLimits& limits);

// Writes the whole file once (the first write into fallocated blocks is slower,
// and reads of never-written blocks never reach the device).
tz::Expected<nlohmann::json> fill_file(Context& ctx);

tz::Expected<nlohmann::json> run_plain(Context& ctx);
tz::Expected<nlohmann::json> run_sweep(Context& ctx);
tz::Expected<nlohmann::json> run_tune(Context& ctx);
tz::Expected<nlohmann::json> run_compare(Context& ctx, bool sweep);
tz::Expected<nlohmann::json> run_swap(Context& ctx);

nlohmann::json config_json(const EngineConfig& c);

}  // namespace tzbench
