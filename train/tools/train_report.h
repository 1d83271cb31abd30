// What tierzero-train reports: a progress line per logged step, a summary at
// the end (bytes per hop, stage waits, optimizer time, peak memory per tier),
// and the files (JSON, loss CSV, loss PNG).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tierzero/engine.h"

namespace tz::tool {

struct StepRecord {
  std::int64_t step = 0;          // 0-based optimizer step
  bool after_eval = false;        // an evaluation ran just before: its master reads are in this step's bytes
  double loss = 0;                // mean over the step's micro-batches
  double seconds = 0;             // wall time of the whole step
  double compute_seconds = 0;     // forward + backward (everything but the optimizer)
  std::uint64_t tokens = 0;       // trained this step, all ranks
  StepReport report;              // the last micro-batch's engine report (the stepping one)
  std::uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0, h2d_bytes = 0, gather_bytes = 0;  // whole step
  double wait_nvme_seconds = 0, wait_h2d_seconds = 0, wait_gather_seconds = 0;              // whole step
  double nvme_read_busy_seconds = 0, nvme_write_busy_seconds = 0;  // whole step: a read (write) in flight
};

struct EvalRecord {
  std::int64_t step = 0;          // evaluated after this many optimizer steps
  double val_loss = 0;
};

struct RunInfo {
  std::string command;            // the command line
  std::string config_path;
  std::string engine;             // ZeroEngine::describe()
  std::string model;              // "6 layers x 384 hidden, 6 heads, seq 128"
  std::uint64_t params = 0;
  double flops_per_token = 0;
  std::uint64_t state_bytes = 0;  // 16 B / param
  std::uint64_t activation_bytes = 0;  // GptConfig::activation_bytes: the CPU trainer's per micro-batch
  std::uint64_t gpu_budget_bytes = 0;
  std::string corpus;
  int batch = 0, seq = 0, ranks = 1, gas = 1;
  std::int64_t first_step = 0, steps = 0;
  double wall_seconds = 0;
  std::string trace_path, checkpoint_dir;
  // Set when a signal stopped the run early (Note [Stopping on a signal]):
  // "SIGTERM", "SIGINT", or "a signal to another rank"; after this many
  // optimizer steps (counted from the start of training, as step numbers are).
  std::string stopped_by;
  std::int64_t stopped_after_step = 0;
};

std::string format_bytes_si(double bytes);  // "12.3 MB"

// One line: step, a bar, loss, tokens/s, TFLOPS, the step's time split, NVMe bytes, waits.
void print_progress(const StepRecord& r, std::int64_t last_step, double flops_per_token);
void print_eval(const EvalRecord& e);
// The end-of-run summary (steady state: steps after the first, which records the trace).
void print_summary(const RunInfo& info, const std::vector<StepRecord>& steps, const std::vector<EvalRecord>& evals);

Status write_json(const std::string& path, const RunInfo& info, const std::vector<StepRecord>& steps,
                  const std::vector<EvalRecord>& evals);
Status write_csv(const std::string& path, const std::vector<StepRecord>& steps, const std::vector<EvalRecord>& evals);
Status write_plot(const std::string& path, const RunInfo& info, const std::vector<StepRecord>& steps,
                  const std::vector<EvalRecord>& evals);

}  // namespace tz::tool
