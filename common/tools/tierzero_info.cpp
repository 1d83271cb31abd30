// tierzero-info: what this machine and process offer tierzero.
//
//   tierzero-info                          io_uring, CPU SIMD, NUMA, memory, CUDA
//   tierzero-info --path /nvme0/tz         ... and whether /nvme0/tz can hold the NVMe tier
//   tierzero-info --config ds_config.json  ... and every NVMe path the config names
//   tierzero-info --json caps.json         ... and the same as JSON ("-": JSON alone on stdout)
//
// Exit status: 0; 1 when a path cannot be used (missing, not a directory, not
// writable), the config does not load, or the JSON cannot be written.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tierzero/common/config.h"
#include "tierzero/common/durable_file.h"
#include "tierzero/common/probe.h"

namespace tz {
// JSON field names are the struct member names.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(UringCapabilities, available, unavailable_reason, features,
                                   has_op_read, has_op_write, has_op_read_fixed, has_op_write_fixed,
                                   has_op_fsync, has_op_fallocate, missing_ops)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(CpuCapabilities, model, logical_cpus, sse4_2, avx2, fma, f16c,
                                   avx512f, avx512bw, avx512vl, avx512_bf16, avx512_fp16, best_simd)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(NumaNode, os_index, cpus, memory_bytes)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(MemoryCapabilities, total_bytes, available_bytes,
                                   memlock_limit_bytes, cap_ipc_lock, transparent_hugepage)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(GpuDevice, index, name, cc_major, cc_minor, total_memory_bytes,
                                   pci_bus_id, numa_node)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(CudaCapabilities, compiled, device_count, status, driver_version,
                                   runtime_version, devices)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Capabilities, kernel_release, uring, cpu, numa_nodes, numa_error,
                                   memory, cuda)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(PathCapabilities, path, filesystem, device, total_bytes,
                                   free_bytes, o_direct_accepted, o_direct, dio_mem_align,
                                   dio_offset_align, note)
}  // namespace tz

namespace {

struct Options {
  std::vector<std::string> paths;
  std::string config_file;
  std::string json_file;
  bool refresh = false;
};

// One probed directory: where it came from (--path, or the config) and the answer.
struct PathReport {
  std::string path;
  std::string source;
  tz::Expected<tz::PathCapabilities> result;
};

struct Report {
  tz::Capabilities caps;
  std::vector<PathReport> paths;
  std::string config_error;  // --config did not load
  std::string config_verdict;  // --config loaded: what it says, and what the engine would still refuse
  std::vector<std::string> ignored_keys, unresolved_auto;
  bool failed = false;
};

void probe_paths(Report& report, const Options& options) {
  for (const std::string& path : options.paths) {
    report.paths.push_back({path, "--path", tz::probe_path(path)});
  }
  if (options.config_file.empty()) return;
  tz::Expected<tz::Config> config = tz::load_config(options.config_file);
  if (!config.ok()) {
    report.config_error = config.status().message();
    report.failed = true;
    return;
  }
  report.ignored_keys = config->ignored_keys;
  report.unresolved_auto = config->unresolved_auto;
  // Note [Auto values] (common/src/config.cpp): such a config loads, and the engine refuses to train with it.
  report.config_verdict =
      config->unresolved_auto.empty()
          ? fmt::format("config: {} is valid (ZeRO stage {}, optimizer {}{})\n", options.config_file,
                        config->zero.stage, config->optimizer.type,
                        config->ignored_keys.empty()
                            ? ""
                            : fmt::format("; {} DeepSpeed key(s) ignored: {}", config->ignored_keys.size(),
                                          fmt::join(config->ignored_keys, ", ")))
          : fmt::format("config: {} loads, but the engine refuses \"auto\" with nothing to resolve it: {}; give "
                        "these values\n",
                        options.config_file, fmt::join(config->unresolved_auto, ", "));
  if (!config->unresolved_auto.empty()) report.failed = true;
  for (const std::string& path : config->all_nvme_paths()) {
    report.paths.push_back({path, options.config_file, tz::probe_path(path)});
  }
}

std::string text_report(const Report& report) {
  std::string out = tz::describe(report.caps);
  if (!report.config_error.empty()) out += fmt::format("config: {}\n", report.config_error);
  out += report.config_verdict;
  for (const PathReport& p : report.paths) {
    out += p.result.ok() ? tz::describe(*p.result)
                         : fmt::format("{}: unusable: {}\n", p.path, p.result.status().message());
  }
  return out;
}

nlohmann::json json_report(const Report& report, const Options& options) {
  nlohmann::json out;
  out["capabilities"] = report.caps;
  nlohmann::json paths = nlohmann::json::array();
  for (const PathReport& p : report.paths) {
    nlohmann::json entry;
    if (p.result.ok()) {
      entry = *p.result;
    } else {
      entry["path"] = p.path;
      entry["error"] = p.result.status().message();
      entry["error_code"] = std::string(tz::error_code_name(p.result.status().code()));
    }
    entry["source"] = p.source;
    paths.push_back(std::move(entry));
  }
  out["paths"] = std::move(paths);
  if (!options.config_file.empty()) {
    out["config"] = {{"file", options.config_file},
                     {"loaded", report.config_error.empty()},
                     {"valid", report.config_error.empty() && report.unresolved_auto.empty()},
                     {"ignored_keys", report.ignored_keys},
                     {"unresolved_auto", report.unresolved_auto}};
    if (!report.config_error.empty()) out["config"]["error"] = report.config_error;
  }
  return out;
}

bool write_json(const nlohmann::json& json, const std::string& file) {
  std::string text = json.dump(2) + "\n";
  if (file == "-") {
    std::fputs(text.c_str(), stdout);
    return true;
  }
  if (const tz::Status written = tz::write_file_durably(file, text); !written.ok()) {
    fmt::print(stderr, "tierzero-info: cannot write the JSON report: {}\n", written.message());
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tierzero-info: what this machine offers tierzero (io_uring, CPU SIMD, NUMA, memory, "
               "CUDA, NVMe paths)"};
  Options options;
  app.add_option("--path", options.paths, "also probe DIR as an NVMe tier directory (repeatable)")
      ->type_name("DIR");
  app.add_option("--config", options.config_file,
                 "also check this config (says whether it is valid) and probe every NVMe path it names")
      ->type_name("FILE");
  app.add_option("--json", options.json_file, "also write everything as JSON to FILE ('-': stdout, text omitted)")
      ->type_name("FILE|-");
  app.add_flag("--refresh", options.refresh, "probe afresh rather than use the process-wide cache");
  CLI11_PARSE(app, argc, argv);

  Report report;
  report.caps = options.refresh ? tz::probe_capabilities() : tz::capabilities();
  probe_paths(report, options);

  bool json_to_stdout = options.json_file == "-";
  if (!json_to_stdout) fmt::print("{}", text_report(report));
  for (const PathReport& p : report.paths) {
    if (p.result.ok()) continue;
    report.failed = true;
    fmt::print(stderr, "tierzero-info: {} ({}): {}\n", p.path, p.source, p.result.status().message());
  }
  if (!report.config_error.empty()) {
    fmt::print(stderr, "tierzero-info: --config {}: {}\n", options.config_file, report.config_error);
  }
  if (!options.json_file.empty() && !write_json(json_report(report, options), options.json_file)) {
    report.failed = true;
  }
  return report.failed ? 1 : 0;
}
