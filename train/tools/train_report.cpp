// tierzero-train's progress lines, summary and output files (train_report.h).
#include "train_report.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>

#include "png.h"

namespace tz::tool {
namespace {

// Steady-state steps: not the first (it records the prefetch trace) and not
// one right after an evaluation (whose master reads it reports). All of them
// when that leaves none.
std::vector<const StepRecord*> steady(const std::vector<StepRecord>& steps) {
  std::vector<const StepRecord*> out;
  for (std::size_t i = 1; i < steps.size(); ++i) {
    if (!steps[i].after_eval) out.push_back(&steps[i]);
  }
  if (out.empty()) {
    for (const StepRecord& r : steps) out.push_back(&r);
  }
  return out;
}

double mean_of(const std::vector<const StepRecord*>& steps, double (*get)(const StepRecord&)) {
  double sum = 0;
  for (const StepRecord* r : steps) sum += get(*r);
  return steps.empty() ? 0 : sum / static_cast<double>(steps.size());
}

// Mean loss of the first / last `n` steps (the single-step loss is noisy).
double mean_loss(const std::vector<StepRecord>& steps, bool first, std::size_t n) {
  n = std::min(n, steps.size());
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += steps[first ? i : steps.size() - 1 - i].loss;
  return n > 0 ? sum / static_cast<double>(n) : 0;
}

}  // namespace

std::string format_bytes_si(double bytes) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1000 && u < 4) {
    bytes /= 1000;
    ++u;
  }
  return fmt::format("{:.1f} {}", bytes, units[u]);
}

void print_progress(const StepRecord& r, std::int64_t last_step, double flops_per_token) {
  constexpr int kBar = 20;
  const double done = last_step > 0 ? static_cast<double>(r.step + 1) / static_cast<double>(last_step) : 1.0;
  const int filled = std::clamp(static_cast<int>(done * kBar), 0, kBar);
  const double tok_s = static_cast<double>(r.tokens) / r.seconds;
  std::printf("step %5lld/%lld [%s%s] loss %.4f | lr %.3g | %6.0f tok/s | %.4f TFLOPS | %.2f s (fwd+bwd %.2f, "
              "optim %.2f) | NVMe r %s w %s | waits nvme %.2f h2d %.2f gather %.2f s\n",
              static_cast<long long>(r.step + 1), static_cast<long long>(last_step), std::string(filled, '#').c_str(),
              std::string(kBar - filled, '.').c_str(), r.loss, r.report.lr, tok_s, tok_s * flops_per_token / 1e12, r.seconds,
              r.compute_seconds, r.report.optimizer_seconds,
              format_bytes_si(static_cast<double>(r.nvme_read_bytes)).c_str(),
              format_bytes_si(static_cast<double>(r.nvme_write_bytes)).c_str(), r.wait_nvme_seconds,
              r.wait_h2d_seconds, r.wait_gather_seconds);
  std::fflush(stdout);
}

void print_eval(const EvalRecord& e) {
  std::printf("eval after step %lld: validation loss %.4f\n", static_cast<long long>(e.step), e.val_loss);
  std::fflush(stdout);
}

// The NVMe rates the steady-state steps achieved: their bytes over the time
// a read (write) was in flight (Note [Busy time]); 0 where nothing moved.
struct NvmeRates {
  double read_gbps = 0, write_gbps = 0, read_busy_s = 0, write_busy_s = 0;
};

NvmeRates nvme_rates(const std::vector<const StepRecord*>& st) {
  NvmeRates r;
  double read = 0, written = 0;
  for (const StepRecord* s : st) {
    read += static_cast<double>(s->nvme_read_bytes);
    written += static_cast<double>(s->nvme_write_bytes);
    r.read_busy_s += s->nvme_read_busy_seconds;
    r.write_busy_s += s->nvme_write_busy_seconds;
  }
  if (r.read_busy_s > 0) r.read_gbps = read / r.read_busy_s / 1e9;
  if (r.write_busy_s > 0) r.write_gbps = written / r.write_busy_s / 1e9;
  if (!st.empty()) r.read_busy_s /= static_cast<double>(st.size()), r.write_busy_s /= static_cast<double>(st.size());
  return r;
}

// NVMe bytes a steady-state step writes on this rank, per parameter (all
// ranks' bytes over the model's) and per hour of training at the mean step
// time: what the drives' rated endurance is spent at.
struct NvmeWrites {
  double per_step = 0, per_param = 0, read_per_param = 0, per_hour = 0;
};

NvmeWrites nvme_writes(const RunInfo& info, const std::vector<const StepRecord*>& st) {
  NvmeWrites w;
  const double step_s = mean_of(st, [](const StepRecord& r) { return r.seconds; });
  w.per_step = mean_of(st, [](const StepRecord& r) { return static_cast<double>(r.nvme_write_bytes); });
  const double read = mean_of(st, [](const StepRecord& r) { return static_cast<double>(r.nvme_read_bytes); });
  const double params = static_cast<double>(std::max<std::uint64_t>(info.params, 1));
  w.per_param = w.per_step * info.ranks / params;
  w.read_per_param = read * info.ranks / params;
  if (step_s > 0) w.per_hour = w.per_step * 3600 / step_s;
  return w;
}

// Note [What a redo costs] (engine/src/step_ahead.h): over the whole run,
// the work under backward that was undone and done again after it, and why.
void print_redone(const RunInfo& info, const std::vector<StepRecord>& steps) {
  std::map<std::string, int> reasons;
  double read = 0, written = 0, seconds = 0;
  for (const StepRecord& r : steps) {
    read += static_cast<double>(r.report.ahead_redone_read_bytes);
    written += static_cast<double>(r.report.ahead_redone_write_bytes);
    seconds += r.report.ahead_redone_seconds;
    if (!r.report.ahead_redo_reason.empty()) ++reasons[r.report.ahead_redo_reason];
  }
  if (reasons.empty()) return;
  const double per_param = static_cast<double>(info.ranks) /
                           static_cast<double>(std::max<std::uint64_t>(info.params, 1)) /
                           static_cast<double>(steps.size());
  std::string why;
  for (const auto& [reason, count] : reasons) why += fmt::format("{}{} {}", why.empty() ? "" : ", ", reason, count);
  std::printf("optimizer under backward, redone: %.2f B/param/step NVMe read + %.2f written, %.3f s per step of "
              "optimizer work; windows redone: %s\n", read * per_param, written * per_param,
              seconds / static_cast<double>(steps.size()), why.c_str());
}

// Note [The step keeps backward's parameter shards] (engine/src/kept_params.h):
// the 16-bit shards the step took from their fetch's copy (NVMe reads saved,
// already out of the NVMe read line) and those it read from NVMe again.
void print_kept_params(const RunInfo& info, const std::vector<const StepRecord*>& st) {
  const double kept = mean_of(st, [](const StepRecord& r) { return double(r.report.kept_param_blocks); });
  const double reread = mean_of(st, [](const StepRecord& r) { return double(r.report.reread_param_blocks); });
  if (kept + reread == 0) return;
  const double bytes = mean_of(st, [](const StepRecord& r) { return double(r.report.kept_param_bytes); });
  std::printf("16-bit shards the step kept from their fetch: %.1f blocks per step (%.2f B/param of NVMe reads "
              "saved), read again %.1f\n", kept,
              bytes * info.ranks / static_cast<double>(std::max<std::uint64_t>(info.params, 1)), reread);
}

// Note [Stepping under backward]
void print_ahead(const std::vector<StepRecord>& steps, const std::vector<const StepRecord*>& st) {
  const double ahead = mean_of(st, [](const StepRecord& r) { return r.report.ahead_seconds; });
  const double hidden = mean_of(st, [](const StepRecord& r) { return r.report.ahead_hidden_seconds; });
  const double kept = mean_of(st, [](const StepRecord& r) { return double(r.report.ahead_blocks); });
  const double redone = mean_of(st, [](const StepRecord& r) { return double(r.report.ahead_redone); });
  if (!steps.back().report.ahead_off.empty()) std::printf("optimizer under backward: %s\n", steps.back().report.ahead_off.c_str());
  std::printf("optimizer under backward: %.3f s per step, %.3f s of it hidden (before step()); blocks kept %.1f, "
              "redone %.1f per step\n", ahead, hidden, kept, redone);
}

void print_summary(const RunInfo& info, const std::vector<StepRecord>& steps, const std::vector<EvalRecord>& evals) {
  if (steps.empty()) return;
  const std::vector<const StepRecord*> st = steady(steps);
  const double step_s = mean_of(st, [](const StepRecord& r) { return r.seconds; });
  const double tokens = mean_of(st, [](const StepRecord& r) { return static_cast<double>(r.tokens); });
  const double tok_s = tokens / step_s;
  std::printf("\nsummary: %zu steps in %.1f s; steady state %.2f s/step, %.0f tokens/s, %.4f TFLOPS "
              "(estimate: %.3g FLOPs/token = 6 x %s params + attention)\n",
              steps.size(), info.wall_seconds, step_s, tok_s, tok_s * info.flops_per_token / 1e12,
              info.flops_per_token, format_count(static_cast<double>(info.params)).c_str());
  const std::size_t n = std::max<std::size_t>(1, std::min<std::size_t>(10, steps.size() / 4));
  std::printf("loss: %.4f (mean of the first %zu steps) -> %.4f (mean of the last %zu)", mean_loss(steps, true, n), n,
              mean_loss(steps, false, n), n);
  if (!evals.empty()) {
    std::printf("; validation %.4f (after step %lld) -> %.4f (after step %lld)", evals.front().val_loss,
                static_cast<long long>(evals.front().step), evals.back().val_loss,
                static_cast<long long>(evals.back().step));
  }
  std::printf("\nmodel states: %s (16 B/param) = %.1f x the device budget of %s\n",
              format_bytes_si(static_cast<double>(info.state_bytes)).c_str(),
              static_cast<double>(info.state_bytes) / static_cast<double>(std::max<std::uint64_t>(info.gpu_budget_bytes, 1)),
              format_bytes_si(static_cast<double>(info.gpu_budget_bytes)).c_str());
  auto per_step = [&](double (*get)(const StepRecord&)) { return format_bytes_si(mean_of(st, get)); };
  std::printf("bytes per step, this rank (mean over %zu steady-state steps: not the first, which records the prefetch "
              "trace, nor those right after an evaluation):\n", st.size());
  const NvmeWrites writes = nvme_writes(info, st);
  std::printf("  %-28s %12s  (%.2f B/param)\n", "NVMe read",
              per_step([](const StepRecord& r) { return double(r.nvme_read_bytes); }).c_str(), writes.read_per_param);
  std::printf("  %-28s %12s  (%.2f B/param; %s per hour of training at %.2f s a step: drive wear)\n", "NVMe write",
              format_bytes_si(writes.per_step).c_str(), writes.per_param, format_bytes_si(writes.per_hour).c_str(),
              step_s);
  if (const NvmeRates rates = nvme_rates(st); rates.read_busy_s > 0 || rates.write_busy_s > 0) {
    std::printf("  %-28s read %.2f GB/s (%.3f s a step with a read in flight), write %.2f GB/s (%.3f s with a "
                "write in flight)\n", "NVMe rates achieved", rates.read_gbps, rates.read_busy_s, rates.write_gbps,
                rates.write_busy_s);
  }
  // PCIe both ways, per parameter as the NVMe lines: the parameters up, the gradients down.
  const double h2d = mean_of(st, [](const StepRecord& r) { return double(r.h2d_bytes); });
  std::printf("  %-28s %12s  (%.2f B/param)\n", "host-to-device",
              per_step([](const StepRecord& r) { return double(r.h2d_bytes); }).c_str(),
              h2d * info.ranks / static_cast<double>(std::max<std::uint64_t>(info.params, 1)));
  const double d2h = mean_of(st, [](const StepRecord& r) { return double(r.report.d2h_bytes); });
  std::printf("  %-28s %12s  (%.2f B/param; %llu block(s) accumulate on the device across micro-batches)\n",
              "device-to-host (gradients)", per_step([](const StepRecord& r) { return double(r.report.d2h_bytes); }).c_str(),
              d2h * info.ranks / static_cast<double>(std::max<std::uint64_t>(info.params, 1)),
              static_cast<unsigned long long>(st.empty() ? 0 : st.back()->report.grad_window_blocks));
  std::printf("  %-28s %12s\n", "all-gather (received)", per_step([](const StepRecord& r) { return double(r.gather_bytes); }).c_str());
  const double waits = mean_of(st, [](const StepRecord& r) { return double(r.report.host_waits); });
  const double reduced = mean_of(st, [](const StepRecord& r) { return double(r.report.blocks_reduced); });
  std::printf("host waits on the device per step: %.1f (%.2f per reduced block)\n", waits,
              reduced > 0 ? waits / reduced : 0.0);
  const double w_nvme = mean_of(st, [](const StepRecord& r) { return r.wait_nvme_seconds; });
  const double w_h2d = mean_of(st, [](const StepRecord& r) { return r.wait_h2d_seconds; });
  const double w_gather = mean_of(st, [](const StepRecord& r) { return r.wait_gather_seconds; });
  const double optim = mean_of(st, [](const StepRecord& r) { return r.report.optimizer_seconds; });
  std::printf("stage waits per step: compute waited %.3f s on NVMe, %.3f s on host-to-device, %.3f s on all-gather "
              "(%.1f%% of the step)\n", w_nvme, w_h2d, w_gather, 100 * (w_nvme + w_h2d + w_gather) / step_s);
  // Note [The next forward's fetches under the optimizer]
  const double under = mean_of(st, [](const StepRecord& r) { return double(r.report.next_fetches_under_step); });
  std::printf("optimizer: %.3f s per step after backward (%.1f%% of the step); the next forward's fetches issued "
              "under it: %.1f blocks per step\n", optim, 100 * optim / step_s, under);
  print_ahead(steps, st);
  print_redone(info, steps);
  print_kept_params(info, st);
  std::uint64_t pg = 0, pc = 0, pn = 0;
  for (const StepRecord& r : steps) {
    pg = std::max(pg, r.report.peak_gpu_bytes), pc = std::max(pc, r.report.peak_cpu_bytes);
    pn = std::max(pn, r.report.peak_nvme_bytes);
  }
  const StepReport& last = steps.back().report;
  std::printf("peak memory per tier (budget): device %s (%s), CPU %s (%s), NVMe %s (%s)\n",
              format_bytes_si(double(pg)).c_str(), format_bytes_si(double(last.gpu_budget_bytes)).c_str(),
              format_bytes_si(double(pc)).c_str(), format_bytes_si(double(last.cpu_budget_bytes)).c_str(),
              format_bytes_si(double(pn)).c_str(), format_bytes_si(double(last.nvme_capacity_bytes)).c_str());
}

Status write_json(const std::string& path, const RunInfo& info, const std::vector<StepRecord>& steps,
                  const std::vector<EvalRecord>& evals) {
  nlohmann::json js = nlohmann::json::array();
  for (const StepRecord& r : steps) {
    js.push_back({{"step", r.step + 1}, {"loss", r.loss}, {"after_eval", r.after_eval}, {"seconds", r.seconds}, {"compute_seconds", r.compute_seconds},
                  {"optimizer_seconds", r.report.optimizer_seconds}, {"tokens", r.tokens},
                  {"tokens_per_second", static_cast<double>(r.tokens) / r.seconds},
                  {"tflops", static_cast<double>(r.tokens) / r.seconds * info.flops_per_token / 1e12},
                  {"grad_norm", r.report.grad_norm}, {"lr", r.report.lr}, {"nvme_read_bytes", r.nvme_read_bytes},
                  {"nvme_write_bytes", r.nvme_write_bytes}, {"h2d_bytes", r.h2d_bytes}, {"d2h_bytes", r.report.d2h_bytes}, {"gather_bytes", r.gather_bytes},
                  {"wait_nvme_seconds", r.wait_nvme_seconds}, {"wait_h2d_seconds", r.wait_h2d_seconds},
                  {"wait_gather_seconds", r.wait_gather_seconds},
                  {"nvme_read_busy_seconds", r.nvme_read_busy_seconds},
                  {"nvme_write_busy_seconds", r.nvme_write_busy_seconds}, {"peak_gpu_bytes", r.report.peak_gpu_bytes},
                  {"peak_cpu_bytes", r.report.peak_cpu_bytes}, {"peak_nvme_bytes", r.report.peak_nvme_bytes},
                  {"host_waits", r.report.host_waits}, {"blocks_reduced", r.report.blocks_reduced},
                  {"ahead_blocks", r.report.ahead_blocks}, {"ahead_redone", r.report.ahead_redone},
                  {"ahead_seconds", r.report.ahead_seconds}, {"ahead_hidden_seconds", r.report.ahead_hidden_seconds},
                  {"ahead_redone_read_bytes", r.report.ahead_redone_read_bytes},
                  {"ahead_redone_write_bytes", r.report.ahead_redone_write_bytes},
                  {"ahead_redone_seconds", r.report.ahead_redone_seconds},
                  {"ahead_redo_reason", r.report.ahead_redo_reason},
                  {"kept_param_blocks", r.report.kept_param_blocks}, {"kept_param_bytes", r.report.kept_param_bytes},
                  {"reread_param_blocks", r.report.reread_param_blocks},
                  {"next_fetches_under_step", r.report.next_fetches_under_step}});
  }
  const NvmeRates rates = nvme_rates(steady(steps));
  const NvmeWrites writes = nvme_writes(info, steady(steps));
  nlohmann::json je = nlohmann::json::array();
  for (const EvalRecord& e : evals) je.push_back({{"step", e.step}, {"val_loss", e.val_loss}});
  const nlohmann::json out = {
      {"program", "tierzero-train"}, {"command", info.command}, {"config", info.config_path}, {"engine", info.engine},
      {"model", info.model}, {"params", info.params}, {"flops_per_token", info.flops_per_token},
      {"model_state_bytes", info.state_bytes}, {"gpu_budget_bytes", info.gpu_budget_bytes}, {"corpus", info.corpus},
      {"batch", info.batch}, {"seq", info.seq}, {"ranks", info.ranks}, {"gradient_accumulation_steps", info.gas},
      {"first_step", info.first_step}, {"steps", info.steps}, {"wall_seconds", info.wall_seconds},
      {"trace", info.trace_path}, {"checkpoint", info.checkpoint_dir},
      {"stopped", info.stopped_by.empty() ? nlohmann::json()
                                          : nlohmann::json{{"by", info.stopped_by},
                                                           {"after_step", info.stopped_after_step}}},
      {"step_records", js}, {"evals", je},
      {"nvme_rates", {{"read_gbps", rates.read_gbps}, {"write_gbps", rates.write_gbps},
                      {"read_busy_seconds_per_step", rates.read_busy_s},
                      {"write_busy_seconds_per_step", rates.write_busy_s},
                      {"over", "the steady-state steps: their bytes over the time a read (write) was in flight"}}},
      {"nvme_writes", {{"bytes_per_step", writes.per_step}, {"bytes_per_param_per_step", writes.per_param},
                       {"bytes_per_hour", writes.per_hour},
                       {"over", "the steady-state steps, this rank; per hour at their mean step time"}}}};
  return write_file_durably(path, out.dump(1) + "\n");
}

Status write_csv(const std::string& path, const std::vector<StepRecord>& steps, const std::vector<EvalRecord>& evals) {
  std::string text = "step,loss,val_loss,seconds,tokens_per_second\n";
  std::size_t e = 0;
  for (const StepRecord& r : steps) {
    std::string val;
    while (e < evals.size() && evals[e].step <= r.step + 1) {
      if (evals[e].step == r.step + 1) val = fmt::format("{:.10g}", evals[e].val_loss);
      ++e;
    }
    text += fmt::format("{},{:.10g},{},{:.4f},{:.1f}\n", r.step + 1, r.loss, val, r.seconds,
                        static_cast<double>(r.tokens) / r.seconds);
  }
  return write_file_durably(path, text);
}

Status write_plot(const std::string& path, const RunInfo& info, const std::vector<StepRecord>& steps,
                  const std::vector<EvalRecord>& evals) {
  Chart chart{.title = fmt::format("tierzero-train: {}", info.model), .x_label = "step", .y_label = "loss (nats)"};
  Series train{"train", {0x9e, 0xc5, 0xe8}, {}, {}}, smooth{"train (mean of last 10)", {0x1f, 0x77, 0xb4}, {}, {}};
  double window = 0;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    train.x.push_back(static_cast<double>(steps[i].step + 1));
    train.y.push_back(steps[i].loss);
    window += steps[i].loss - (i >= 10 ? steps[i - 10].loss : 0);
    smooth.x.push_back(static_cast<double>(steps[i].step + 1));
    smooth.y.push_back(window / static_cast<double>(std::min<std::size_t>(i + 1, 10)));
  }
  chart.series = {train, smooth};
  if (!evals.empty()) {
    Series val{"validation", {0xd6, 0x27, 0x28}, {}, {}, true};
    for (const EvalRecord& e : evals) {
      val.x.push_back(static_cast<double>(e.step));
      val.y.push_back(e.val_loss);
    }
    chart.series.push_back(val);
  }
  return write_line_chart(chart, path);
}

}  // namespace tz::tool
