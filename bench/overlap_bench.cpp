// tierzero-overlap-bench: does the prefetch scheduler hide the tiers behind
// compute? The built-in MLP workload runs on the engine (CPU backend) with a
// simulated compute time per block and direction; each measured step records
// a timeline, and the bench compares the forward+backward time with its
// critical path: the larger of the compute time and the busiest transfer
// stage's busy time (the union of its spans: NVMe reads, host-to-device
// copies, collectives, gradient accumulation), all measured in the same step.
// It also reports how long compute waited on each stage.
//
// The whole step (forward, backward and the optimizer) is set against its
// own critical path: the largest of the compute time, the busiest transfer
// stage (the timeline's tracks, and the time any NVMe request was in flight,
// reads and writes together, as one drive shares its time) and the
// optimizer's own work (the union of its CPU spans). --ahead both (default)
// runs two engines, tierzero.step_under_backward off and on, alternating
// step by step, so both figures come from the same run and the same load
// (Note [Stepping under backward], engine/src/step_ahead.h). --next-fetches
// off issues the next forward's first fetches after the optimizer pass, as
// before Note [The next forward's fetches under the optimizer] (prefetch.h).
//
//   tierzero-overlap-bench --layers 12 --hidden 1024 --compute-ms 15 --placement nvme
//       --nvme-path /var/tmp/tz --steps 6 --json out.json --trace step.json
//
// Prints a table per step and a summary, writes JSON and one step's Chrome trace.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "bench_common.h"
#include "tierzero/engine.h"
#include "tierzero/testing/mlp.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  int layers = 12;
  int hidden = 1024;
  int batch = 2;
  double compute_ms = 15;
  std::string placement = "nvme";
  std::string nvme_path = "/var/tmp/tierzero-overlap";
  int steps = 6;
  std::int64_t prefetch_elems = 0;  // 0: 3 blocks
  std::string json_path;
  std::string trace_path;
  bool synthetic = false;  // no MLP arithmetic: compute is the simulated time alone
  std::string backend = "host";
  std::string ahead = "both";  // off | on | both (alternating)
  double max_norm = 1.0;       // gradient_clipping (the synthetic gradients' norm is ~0.0115 x sqrt(params))
  std::string next_fetches = "on";  // ZeroOptions::next_fetches_under_step
};

// The engine's protocol without the MLP's arithmetic: fetch, "compute",
// release; backward with a gradient buffer filled with a small constant.
tz::Status synthetic_micro_batch(tz::ZeroEngine& engine, const tz::mlp::ComputeHook& hook) {
  const std::size_t blocks = engine.layout().blocks.size();
  for (std::size_t b = 0; b < blocks; ++b) {
    TZ_ASSIGN_OR_RETURN(tz::GatheredBlock p, engine.fetch(b));
    hook(b, false);
  }
  for (std::size_t b = blocks; b-- > 0;) {
    TZ_ASSIGN_OR_RETURN(tz::GatheredBlock p, engine.fetch(b));
    hook(b, true);
    TZ_ASSIGN_OR_RETURN(tz::GradBlock g, engine.grad_buffer(b));
    const std::size_t bytes = engine.layout().blocks[b].used_numel * tz::dtype_bytes(g.type());
    if (engine.device().kind() == tz::BackendKind::kHost) {
      std::memset(g.data(), 0x3c, bytes);  // bf16 ~0.0115
    } else {
      TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::Stream> stream, engine.device().create_stream());
      TZ_TRY(engine.device().memset_async(g.data(), 0x3c, bytes, *stream));
      TZ_TRY(engine.device().synchronize_stream(*stream));
    }
    TZ_TRY(engine.reduce_grads(std::move(g)));
  }
  return tz::ok_status();
}

// Busy seconds per track: the union of its spans (overlapping spans count once).
std::map<std::string, double> busy_seconds(const std::string& trace_path) {
  std::ifstream in(trace_path);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  std::map<int, std::string> names;
  std::map<int, std::vector<std::pair<double, double>>> spans;
  for (const auto& e : j.value("traceEvents", nlohmann::json::array())) {
    if (e.value("ph", "") == "M") names[e.value("tid", 0)] = e["args"].value("name", "");
    if (e.value("ph", "") == "X") {
      const double ts = e.value("ts", 0.0);
      spans[e.value("tid", 0)].emplace_back(ts, ts + e.value("dur", 0.0));
    }
  }
  std::map<std::string, double> out;
  for (auto& [tid, list] : spans) {
    std::sort(list.begin(), list.end());
    double total = 0, start = -1, end = -1;
    for (const auto& [a, b] : list) {
      if (a > end) {
        total += end - start;
        start = a;
        end = b;
      } else {
        end = std::max(end, b);
      }
    }
    total += end - start;
    out[names[tid]] = total * 1e-6;
  }
  return out;
}

std::array<tz::Tier, tz::kNumStateClasses> parse_placement(const std::string& p) {
  using tz::Tier;
  if (p == "gpu") return {Tier::kGpu, Tier::kGpu, Tier::kGpu, Tier::kGpu};
  if (p == "cpu") return {Tier::kCpu, Tier::kCpu, Tier::kCpu, Tier::kCpu};
  return {Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme};
}

tz::Expected<tz::Config> make_config(const Flags& f, const std::string& nvme_path) {
  const std::int64_t block = static_cast<std::int64_t>(f.hidden) * (f.hidden + 1);
  const std::int64_t prefetch = f.prefetch_elems > 0 ? f.prefetch_elems : 3 * block + 1;
  return tz::parse_config(fmt::format(R"({{
    "gradient_accumulation_steps": 1, "gradient_clipping": {}, "bf16": {{"enabled": true}},
    "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-4, "weight_decay": 0.01}}}},
    "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
                           "offload_optimizer": {{"device": "cpu", "pin_memory": true}},
                           "stage3_prefetch_bucket_size": {}, "sub_group_size": {}}},
    "tierzero": {{"backend": "{}", "tiers": {{"gpu_bytes": "4GiB", "cpu_bytes": "8GiB", "nvme_bytes": "64GiB",
                  "nvme_paths": ["{}"]}}}}
  }})",
                                      f.max_norm, prefetch, 4 * block, f.backend, nvme_path),
                          "overlap bench config");
}

struct StepRow {
  int step = 0;
  double forward_backward_s = 0, optimizer_s = 0;
  double compute_s = 0;
  std::map<std::string, double> busy;
  double critical_s = 0;
  std::string critical_stage;
  double wait_s = 0, wait_nvme_s = 0, wait_h2d_s = 0, wait_gather_s = 0;
  std::uint64_t prefetched = 0, fetches = 0;
  // The whole step and its critical path (Note [Stepping under backward]).
  double whole_s = 0, whole_critical_s = 0, nvme_busy_s = 0, optimizer_busy_s = 0;
  std::string whole_critical_stage;
  double ahead_s = 0, ahead_hidden_s = 0;
  std::uint64_t ahead_blocks = 0, ahead_redone = 0;
};

// One step's wall time and the engine's report; the timeline is recorded
// from step 1 on (step 0 records the trace, on demand).
struct TimedStep {
  double total_s = 0;
  tz::StepReport report;
};

tz::Expected<TimedStep> time_step(tz::ZeroEngine& engine, const Flags& f, const tz::mlp::MlpConfig& mlp,
                                  const tz::mlp::ComputeHook& hook, int step) {
  engine.clear_timeline();
  engine.record_timeline(step > 0);
  const auto start = Clock::now();
  if (f.synthetic) {
    TZ_TRY(synthetic_micro_batch(engine, hook));
  } else {
    TZ_TRY(tz::mlp::train_micro_batch(engine, mlp, tz::mlp::make_batch(mlp, 0, 0, step), hook).status());
  }
  TZ_ASSIGN_OR_RETURN(tz::StepReport r, engine.step());
  const double total = std::chrono::duration<double>(Clock::now() - start).count();
  engine.record_timeline(false);
  return TimedStep{.total_s = total, .report = r};
}

// The step's critical path: compute's busy time, or a transfer stage's where
// that is longer (the optimizer runs after forward+backward, so it is left out).
StepRow step_row(int step, const TimedStep& t, std::map<std::string, double> busy) {
  const tz::StepReport& r = t.report;
  StepRow row{.step = step, .forward_backward_s = t.total_s - r.optimizer_seconds, .optimizer_s = r.optimizer_seconds};
  row.busy = std::move(busy);
  row.compute_s = row.busy["compute"];
  row.critical_s = row.compute_s;
  row.critical_stage = "compute";
  for (const auto& [name, secs] : row.busy) {
    if (name == "compute" || name == "optimizer") continue;
    if (secs > row.critical_s) {
      row.critical_s = secs;
      row.critical_stage = name;
    }
  }
  // The whole step's: the optimizer's own work and every NVMe request count too.
  row.whole_s = t.total_s;
  row.nvme_busy_s = r.nvme_busy_seconds;
  row.optimizer_busy_s = row.busy["optimizer"];
  row.whole_critical_s = row.critical_s;
  row.whole_critical_stage = row.critical_stage;
  for (const auto& [name, secs] : std::map<std::string, double>{{"nvme (any I/O)", row.nvme_busy_s},
                                                                {"optimizer", row.optimizer_busy_s}}) {
    if (secs > row.whole_critical_s) {
      row.whole_critical_s = secs;
      row.whole_critical_stage = name;
    }
  }
  row.ahead_s = r.ahead_seconds;
  row.ahead_hidden_s = r.ahead_hidden_seconds;
  row.ahead_blocks = r.ahead_blocks;
  row.ahead_redone = r.ahead_redone;
  row.wait_nvme_s = r.wait_nvme_seconds;
  row.wait_h2d_s = r.wait_h2d_seconds;
  row.wait_gather_s = r.wait_gather_seconds;
  row.wait_s = r.wait_nvme_seconds + r.wait_h2d_seconds + r.wait_gather_seconds;
  row.prefetched = r.prefetched;
  row.fetches = r.fetches;
  return row;
}

void print_step_header() {
  std::printf("%-5s %4s %10s %10s %10s %10s %9s %-16s %8s %8s %8s %8s %6s | %8s %8s %8s %-14s %7s %7s %5s\n",
              "ahead", "step", "fwd+bwd s", "compute s", "critical s", "ratio", "optim s", "busiest stage", "wait %",
              "nvme", "h2d", "gather", "pref", "whole s", "crit s", "ratio", "whole critical", "under", "hidden",
              "kept");
}

void print_step_row(const std::string& ahead, const StepRow& row) {
  std::printf("%-5s %4d %10.3f %10.3f %10.3f %10.3f %9.3f %-16s %7.1f%% %8.3f %8.3f %8.3f %3llu/%llu | %8.3f %8.3f "
              "%8.3f %-14s %7.3f %7.3f %5llu\n",
              ahead.c_str(), row.step, row.forward_backward_s, row.compute_s, row.critical_s,
              row.forward_backward_s / row.critical_s, row.optimizer_s, row.critical_stage.substr(0, 16).c_str(),
              100 * row.wait_s / row.forward_backward_s, row.wait_nvme_s, row.wait_h2d_s, row.wait_gather_s,
              static_cast<unsigned long long>(row.prefetched), static_cast<unsigned long long>(row.fetches),
              row.whole_s, row.whole_critical_s, row.whole_s / row.whole_critical_s,
              row.whole_critical_stage.substr(0, 14).c_str(), row.ahead_s, row.ahead_hidden_s,
              static_cast<unsigned long long>(row.ahead_blocks));
}

// One engine of the run: "off" or "on" (tierzero.step_under_backward).
struct Arm {
  std::string ahead;
  std::unique_ptr<tz::ZeroEngine> engine;
  std::string nvme_path;
  std::vector<StepRow> rows;
};

// Every step of every arm, the arms alternating step by step; a row printed
// for each measured one (step 0 records the trace and is not measured); the
// last step's trace goes to --trace (one per arm: .off/.on before .json
// when there are two).
tz::Status measure_steps(std::vector<Arm>& arms, const Flags& f, const tz::mlp::MlpConfig& mlp) {
  const auto compute = std::chrono::microseconds(static_cast<std::int64_t>(f.compute_ms * 1000));
  const tz::mlp::ComputeHook hook = [&](std::size_t, bool) { std::this_thread::sleep_for(compute); };
  print_step_header();
  for (int step = 0; step < f.steps; ++step) {
    for (Arm& arm : arms) {
      const std::string tmp_trace = arm.nvme_path + "/overlap-step.json";
      TZ_ASSIGN_OR_RETURN(const TimedStep t, time_step(*arm.engine, f, mlp, hook, step));
      if (step == 0) continue;
      TZ_TRY(arm.engine->write_timeline(tmp_trace));
      const StepRow row = step_row(step, t, busy_seconds(tmp_trace));
      std::filesystem::remove(tmp_trace);
      print_step_row(arm.ahead, row);
      if (!f.trace_path.empty() && step == f.steps - 1) {
        std::string path = f.trace_path;
        if (arms.size() > 1) {
          const auto dot = path.rfind(".json");
          path = (dot == std::string::npos ? path : path.substr(0, dot)) + "." + arm.ahead + ".json";
        }
        TZ_TRY(arm.engine->write_timeline(path));
      }
      arm.rows.push_back(row);
    }
  }
  return tz::ok_status();
}

// Medians over the measured steps of forward+backward / critical path, of
// the fraction of forward+backward that compute waited, and of the whole
// step over its critical path.
struct Summary {
  double ratio = 0, wait = 0, whole = 0, whole_s = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

Summary summarize(const std::vector<StepRow>& rows) {
  std::vector<double> ratios, waits, wholes, whole_s;
  for (const StepRow& r : rows) {
    ratios.push_back(r.forward_backward_s / r.critical_s);
    waits.push_back(r.wait_s / r.forward_backward_s);
    wholes.push_back(r.whole_s / r.whole_critical_s);
    whole_s.push_back(r.whole_s);
  }
  return {.ratio = median(ratios), .wait = median(waits), .whole = median(wholes), .whole_s = median(whole_s)};
}

void print_summary(const Flags& f, const Arm& arm, const Summary& sum) {
  const std::vector<StepRow>& rows = arm.rows;
  std::printf("\n[step_under_backward %s] median over %zu steps: forward+backward / critical path = %.3f (target <= "
              "1.15: %s); compute waited %.1f%% of it (target < 10%%: %s)\n",
              arm.ahead.c_str(), rows.size(), sum.ratio, sum.ratio <= 1.15 ? "met" : "MISSED", 100 * sum.wait,
              sum.wait < 0.10 ? "met" : "MISSED");
  std::printf("[step_under_backward %s] whole step %.3f s; whole step / its critical path = %.3f (target <= 1.10: "
              "%s)\n",
              arm.ahead.c_str(), sum.whole_s, sum.whole, sum.whole <= 1.10 ? "met" : "MISSED");
  std::printf("busy seconds per stage in the last step:");
  for (const auto& [name, secs] : rows.back().busy) std::printf("  %s %.3f", name.c_str(), secs);
  std::printf("  nvme (any I/O) %.3f\n", rows.back().nvme_busy_s);
  if (!f.trace_path.empty()) std::printf("Chrome trace of step %d written\n", rows.back().step);
}

nlohmann::json arm_json(const Arm& arm, const Summary& sum) {
  nlohmann::json steps = nlohmann::json::array();
  for (const StepRow& r : arm.rows) {
    steps.push_back({{"step", r.step}, {"forward_backward_s", r.forward_backward_s}, {"optimizer_s", r.optimizer_s},
                     {"compute_s", r.compute_s}, {"busy_s", r.busy}, {"critical_s", r.critical_s},
                     {"critical_stage", r.critical_stage}, {"wait_s", r.wait_s}, {"wait_nvme_s", r.wait_nvme_s},
                     {"wait_h2d_s", r.wait_h2d_s}, {"wait_gather_s", r.wait_gather_s},
                     {"prefetched", r.prefetched}, {"fetches", r.fetches}, {"whole_s", r.whole_s},
                     {"whole_critical_s", r.whole_critical_s}, {"whole_critical_stage", r.whole_critical_stage},
                     {"nvme_busy_s", r.nvme_busy_s}, {"optimizer_busy_s", r.optimizer_busy_s},
                     {"ahead_s", r.ahead_s}, {"ahead_hidden_s", r.ahead_hidden_s},
                     {"ahead_blocks", r.ahead_blocks}, {"ahead_redone", r.ahead_redone}});
  }
  return {{"step_under_backward", arm.ahead}, {"engine", arm.engine->describe()}, {"steps", steps},
          {"median_ratio_to_critical_path", sum.ratio}, {"median_wait_fraction", sum.wait},
          {"whole_step_over_critical_path", sum.whole}, {"median_whole_step_s", sum.whole_s}};
}

tz::Status write_json(const Flags& f, const std::vector<Arm>& arms, const std::vector<Summary>& sums) {
  nlohmann::json out = {{"benchmark", "tierzero-overlap-bench"}, {"layers", f.layers}, {"hidden", f.hidden},
                        {"compute_ms", f.compute_ms}, {"placement", f.placement}, {"synthetic", f.synthetic},
                        {"backend", f.backend}, {"ahead", f.ahead}, {"max_norm", f.max_norm},
                        {"next_fetches_under_step", f.next_fetches}};
  nlohmann::json runs = nlohmann::json::object();
  for (std::size_t i = 0; i < arms.size(); ++i) runs[arms[i].ahead] = arm_json(arms[i], sums[i]);
  // The headline figures are the switch-on arm's (the last one).
  const nlohmann::json& last = runs[arms.back().ahead];
  for (const char* key : {"engine", "steps", "median_ratio_to_critical_path", "median_wait_fraction",
                          "whole_step_over_critical_path", "median_whole_step_s"}) {
    out[key] = last[key];
  }
  out["runs"] = runs;
  TZ_TRY(tz::write_file_durably(f.json_path, out.dump(2) + "\n"));
  std::printf("wrote %s\n", f.json_path.c_str());
  return tz::ok_status();
}

tz::Status run(const Flags& f) {
  const tz::mlp::MlpConfig mlp{.layers = f.layers, .hidden = f.hidden, .batch = f.batch};
  std::vector<std::string> which;
  if (f.ahead == "off" || f.ahead == "both") which.emplace_back("off");
  if (f.ahead == "on" || f.ahead == "both") which.emplace_back("on");
  if (f.ahead == "auto") which.emplace_back("auto");
  std::vector<Arm> arms;
  for (const std::string& ahead : which) {
    Arm arm{.ahead = ahead, .nvme_path = which.size() > 1 ? f.nvme_path + "/" + ahead : f.nvme_path};
    std::filesystem::create_directories(arm.nvme_path);
    TZ_ASSIGN_OR_RETURN(tz::Config config, make_config(f, arm.nvme_path));
    config.step_under_backward = ahead == "on"     ? tz::StepUnderBackward::kAlways
                                 : ahead == "auto" ? tz::StepUnderBackward::kAuto
                                                   : tz::StepUnderBackward::kOff;
    TZ_ASSIGN_OR_RETURN(arm.engine, tz::ZeroEngine::create({.config = config, .placement = parse_placement(f.placement),
                                                           .next_fetches_under_step = f.next_fetches == "on"},
                                                          tz::mlp::model(mlp), tz::mlp::init(mlp)));
    std::printf("[step_under_backward %s] %s\n", ahead.c_str(), arm.engine->describe().c_str());
    arms.push_back(std::move(arm));
  }
  std::printf("model: %d layers x (%d x %d + %d) = %s parameters; simulated compute %.1f ms per block and direction\n\n",
              f.layers, f.hidden, f.hidden, f.hidden,
              tz::format_count(static_cast<double>(arms.front().engine->layout().param_numel)).c_str(), f.compute_ms);
  TZ_TRY(measure_steps(arms, f, mlp));
  if (arms.front().rows.empty()) return tz::invalid_argument("--steps must be at least 2 (step 0 records the trace)");
  std::vector<Summary> sums;
  for (const Arm& arm : arms) {
    sums.push_back(summarize(arm.rows));
    print_summary(f, arm, sums.back());
  }
  if (!f.json_path.empty()) TZ_TRY(write_json(f, arms, sums));
  return tz::ok_status();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tierzero-overlap-bench: step time against its critical path with prefetching"};
  Flags f;
  app.add_option("--layers", f.layers, "blocks (layers)")->capture_default_str()->check(CLI::Range(1, 10000));
  app.add_option("--hidden", f.hidden, "hidden size")->capture_default_str()->check(CLI::Range(8, 65536));
  app.add_option("--batch", f.batch, "rows per micro-batch")->capture_default_str()->check(CLI::Range(1, 4096));
  app.add_option("--compute-ms", f.compute_ms, "simulated compute per block and direction, ms")->capture_default_str();
  app.add_option("--placement", f.placement, "nvme (params + optimizer on NVMe), cpu, gpu")
      ->capture_default_str()
      ->check(CLI::IsMember({"nvme", "cpu", "gpu"}));
  app.add_option("--nvme-path", f.nvme_path, "directory for the swap files")->capture_default_str();
  app.add_option("--steps", f.steps, "steps (the first records the trace and is not measured)")->capture_default_str();
  app.add_option("--prefetch-elems", f.prefetch_elems, "stage3_prefetch_bucket_size; 0: three blocks");
  app.add_option("--backend", f.backend, "host (CPU memory plays the device) or cuda")
      ->capture_default_str()
      ->check(CLI::IsMember({"host", "cuda"}));
  app.add_flag("--synthetic", f.synthetic, "skip the MLP arithmetic: compute is the simulated time alone");
  app.add_option("--json", f.json_path, "write results as JSON")->check(CLI::Validator(tzbench::writable_file, "FILE"));
  app.add_option("--trace", f.trace_path, "write the last step's Chrome trace here");
  app.add_option("--max-norm", f.max_norm, "gradient_clipping; a step that clips is redone after backward")
      ->capture_default_str();
  app.add_option("--ahead", f.ahead, "tierzero.step_under_backward: off, on (true), auto, or both (two engines, off and on, alternating)")
      ->capture_default_str()
      ->check(CLI::IsMember({"off", "on", "auto", "both"}));
  app.add_option("--next-fetches", f.next_fetches,
                 "the next forward's fetches issued under the optimizer pass (on) or after it (off)")
      ->capture_default_str()
      ->check(CLI::IsMember({"on", "off"}));
  CLI11_PARSE(app, argc, argv);
  const tz::Status s = run(f);
  if (!s.ok()) {
    std::fprintf(stderr, "tierzero-overlap-bench: %s\n", s.message().c_str());
    return s.code() == tz::ErrorCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
