// The tables and the JSON (adam_bench_report.h).
#include "adam_bench_report.h"

#include <nlohmann/json.hpp>
#include <oneapi/tbb/info.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace tzbench::adam {
namespace {

const Row* find_row(const std::vector<Row>& rows, std::size_t n, int threads, const std::string& simd,
                    const std::string& kernel) {
  for (const Row& r : rows) {
    if (r.n == n && r.threads == threads && r.simd == simd && r.kernel.name == kernel) return &r;
  }
  return nullptr;
}

void print_table(const std::vector<Row>& rows) {
  std::printf("%-13s %7s %7s %-7s %9s %8s %11s %9s %9s\n", "kernel", "size", "threads", "simd", "ns/param", "GB/s",
              "limit GB/s", "fraction", "pairwise");
  for (const Row& r : rows) {
    std::printf("%-13s %7s %7d %-7s %9.3f %8.2f %11.2f %9.3f %9.3f\n", r.kernel.name.c_str(),
                tz::format_count(static_cast<double>(r.n)).c_str(), r.threads, r.simd.c_str(), r.ns_per_param(),
                r.gbps(), r.limit_gbps(), r.fraction(), r.pair_ratio_median);
  }
  std::printf("fraction = limit median / kernel median; pairwise = median over rounds of limit / kernel "
              "(robust to drift)\n");
}

struct CopyCost {
  std::string algorithm;
  std::size_t n;
  int threads;
  std::string simd;
  double plain_s, copy_s, cost, limit_cost;
  double pairwise;  // median over rounds of (copy - plain) / plain, the two measured in the same round
};

std::vector<CopyCost> copy_costs(const std::vector<Row>& rows) {
  std::vector<CopyCost> out;
  for (const Row& plain : rows) {
    if (plain.kernel.kind != Kind::kStep || plain.kernel.copy_out) continue;
    const Row* copy = find_row(rows, plain.n, plain.threads, plain.simd, plain.kernel.name + "+bf16");
    if (copy == nullptr) continue;
    std::vector<double> per_round;
    for (std::size_t i = 0; i < std::min(plain.kernel_s.size(), copy->kernel_s.size()); ++i) {
      per_round.push_back((copy->kernel_s[i] - plain.kernel_s[i]) / plain.kernel_s[i]);
    }
    out.push_back({plain.kernel.name, plain.n, plain.threads, plain.simd, plain.kernel_median, copy->kernel_median,
                   (copy->kernel_median - plain.kernel_median) / plain.kernel_median,
                   (copy->limit_median - plain.limit_median) / plain.limit_median, median(per_round)});
  }
  return out;
}

nlohmann::json row_json(const Row& r) {
  return {{"kernel", r.kernel.name},
          {"kind", r.kernel.kind == Kind::kStep ? "step" : "grad_arrival"},
          {"algorithm", r.kernel.kind == Kind::kStep ? nlohmann::json(ca::algorithm_name(r.kernel.algorithm))
                                                     : nlohmann::json(nullptr)},
          {"copy_out", r.kernel.copy_out ? "bf16" : "none"},
          {"master", tz::master_format_name(r.kernel.master)},
          {"grad_dtype", tz::dtype_name(r.kernel.grad_dtype)},
          {"size", r.n},
          {"threads", r.threads},
          {"simd", r.simd},
          {"bytes_per_param", tzbench::pattern_bytes_per_param(r.kernel.pattern)},
          {"limit_tile_elems", r.tile},
          {"kernel_seconds", r.kernel_s},
          {"limit_seconds", r.limit_s},
          {"kernel_median_s", r.kernel_median},
          {"limit_median_s", r.limit_median},
          {"ns_per_param", r.ns_per_param()},
          {"gbps", r.gbps()},
          {"limit_gbps", r.limit_gbps()},
          {"fraction_of_limit", r.fraction()},
          {"fraction_of_limit_pairwise_median", r.pair_ratio_median}};
}

void print_copy_costs(const std::vector<CopyCost>& costs) {
  if (costs.empty()) return;
  std::printf("\nbf16 copy-out cost, (t_copy - t_plain) / t_plain of the medians; pairwise: median over rounds; "
              "limit: the same for the limit loops (Adam 30 vs 28 B: +7.1%%; Adagrad, Lion 22 vs 20 B: +10%%)\n");
  std::printf("%-9s %7s %7s %-7s %14s %14s %8s %9s %8s\n", "algorithm", "size", "threads", "simd", "plain ns/param",
              "copy ns/param", "cost", "pairwise", "limit");
  for (const CopyCost& c : costs) {
    std::printf("%-9s %7s %7d %-7s %14.3f %14.3f %7.1f%% %8.1f%% %7.1f%%\n", c.algorithm.c_str(),
                tz::format_count(static_cast<double>(c.n)).c_str(), c.threads, c.simd.c_str(),
                c.plain_s / static_cast<double>(c.n) * 1e9, c.copy_s / static_cast<double>(c.n) * 1e9,
                100 * c.cost, 100 * c.pairwise, 100 * c.limit_cost);
  }
}

// The remainder master against the fp32 master with its bf16 copy (both end
// with the new bf16 parameters): time ratio of the medians and per round, and
// each one's fraction of its own limit; returns the comparison's JSON.
nlohmann::json print_remainder_master(const std::vector<Row>& rows) {
  nlohmann::json out = nlohmann::json::array();
  bool header = false;
  for (const Row& rem : rows) {
    if (rem.kernel.master != ca::MasterFormat::kRemainder) continue;
    const std::string fp32_name = rem.kernel.name.substr(0, rem.kernel.name.find('+')) + "+bf16";
    const Row* fp32 = find_row(rows, rem.n, rem.threads, rem.simd, fp32_name);
    if (fp32 == nullptr) continue;
    if (!header) {
      std::printf("\nremainder master (2.125 B/param beside the bf16 parameter, 28.25 B moved) vs fp32 master + bf16 "
                  "copy (4 B, 30 B moved); time = rem / fp32 of the medians, pairwise: median over rounds\n");
      std::printf("%-11s %7s %7s %-7s %13s %13s %7s %9s %13s %14s\n", "kernel", "size", "threads", "simd",
                  "rem ns/param", "fp32 ns/param", "time", "pairwise", "rem fraction", "fp32 fraction");
      header = true;
    }
    std::vector<double> per_round;
    for (std::size_t i = 0; i < std::min(rem.kernel_s.size(), fp32->kernel_s.size()); ++i) {
      per_round.push_back(rem.kernel_s[i] / fp32->kernel_s[i]);
    }
    const double time = rem.kernel_median / fp32->kernel_median, pairwise = median(per_round);
    std::printf("%-11s %7s %7d %-7s %13.3f %13.3f %7.3f %9.3f %13.3f %14.3f\n", rem.kernel.name.c_str(),
                tz::format_count(static_cast<double>(rem.n)).c_str(), rem.threads, rem.simd.c_str(),
                rem.ns_per_param(), fp32->ns_per_param(), time, pairwise, rem.fraction(), fp32->fraction());
    out.push_back({{"kernel", rem.kernel.name}, {"fp32_kernel", fp32_name}, {"size", rem.n},
                   {"threads", rem.threads}, {"simd", rem.simd}, {"remainder_median_s", rem.kernel_median},
                   {"fp32_median_s", fp32->kernel_median}, {"time_ratio", time}, {"time_ratio_pairwise_median", pairwise},
                   {"remainder_fraction_of_limit", rem.fraction()}, {"fp32_fraction_of_limit", fp32->fraction()}});
  }
  return out;
}

// torch.optim.AdamW against our adamw rows; returns the comparison's JSON.
nlohmann::json print_torch_compare(const std::vector<Row>& rows, const TorchRuns& torch) {
  nlohmann::json torch_compare = nlohmann::json::array();
  std::printf("\ntorch.optim.AdamW (torch %s) vs tierzero adamw, fp32, same size and threads; ours/torch = time "
              "ratio (< 1: tierzero faster)\n",
              torch.info.value("version", std::string("?")).c_str());
  std::printf("%7s %7s %-7s %12s %12s %12s %11s %13s\n", "size", "threads", "simd", "ours ns/p", "fused ns/p",
              "default ns/p", "ours/fused", "ours/default");
  for (const Row& r : rows) {
    if (r.kernel.name != "adamw") continue;
    auto it = torch.medians.find({r.n, r.threads});
    const double fused = it == torch.medians.end() ? 0 : it->second.fused;
    const double dflt = it == torch.medians.end() ? 0 : it->second.dflt;
    auto ns = [&](double s) { return s > 0 ? fmt::format("{:.3f}", s / static_cast<double>(r.n) * 1e9) : "-"; };
    auto ratio = [&](double s) { return s > 0 ? fmt::format("{:.3f}", r.kernel_median / s) : "-"; };
    std::printf("%7s %7d %-7s %12.3f %12s %12s %11s %13s\n", tz::format_count(static_cast<double>(r.n)).c_str(),
                r.threads, r.simd.c_str(), r.ns_per_param(), ns(fused).c_str(), ns(dflt).c_str(),
                ratio(fused).c_str(), ratio(dflt).c_str());
    torch_compare.push_back({{"size", r.n}, {"threads", r.threads}, {"simd", r.simd},
                             {"ours_median_s", r.kernel_median},
                             {"torch_fused_median_s", fused > 0 ? nlohmann::json(fused) : nlohmann::json(nullptr)},
                             {"torch_default_median_s", dflt > 0 ? nlohmann::json(dflt) : nlohmann::json(nullptr)},
                             {"ours_over_fused", fused > 0 ? nlohmann::json(r.kernel_median / fused) : nlohmann::json(nullptr)},
                             {"ours_over_default", dflt > 0 ? nlohmann::json(r.kernel_median / dflt) : nlohmann::json(nullptr)}});
  }
  return torch_compare;
}

// The whole-step table; returns its JSON. With torch, the speedup is
// torch's time over ours (> 1: tierzero faster).
nlohmann::json print_whole_step(const std::vector<WholeRow>& rows,
                                const TorchMedianMap& torch) {
  nlohmann::json out = nlohmann::json::array();
  if (rows.empty()) return out;
  std::printf("\nwhole optimizer step, bf16 mixed precision (gradient arrival + unscale, norm, clip to %.0f, AdamW, "
              "bf16 copy; ours: 2 passes, 36 B/param); torch: GradScaler.unscale_, clip_grad_norm_, fused AdamW, "
              "copy_\n",
              kMaxGradNorm);
  std::printf("%7s %7s %-7s %12s %9s %13s %9s\n", "size", "threads", "simd", "ours ns/p", "GB/s", "torch ns/p",
              "speedup");
  for (const WholeRow& r : rows) {
    auto it = torch.find({r.n, r.threads});
    const double t = it == torch.end() ? 0 : it->second.whole;
    const double n = static_cast<double>(r.n);
    std::printf("%7s %7d %-7s %12.3f %9.2f %13s %9s\n", tz::format_count(n).c_str(), r.threads, r.simd.c_str(),
                r.median_s / n * 1e9, 36 * n / r.median_s / 1e9,
                t > 0 ? fmt::format("{:.3f}", t / n * 1e9).c_str() : "-",
                t > 0 ? fmt::format("{:.2f}x", t / r.median_s).c_str() : "-");
    out.push_back({{"size", r.n}, {"threads", r.threads}, {"simd", r.simd}, {"seconds", r.seconds},
                   {"median_s", r.median_s}, {"last_clip_coefficient", r.clip},
                   {"torch_median_s", t > 0 ? nlohmann::json(t) : nlohmann::json(nullptr)},
                   {"speedup_over_torch", t > 0 ? nlohmann::json(t / r.median_s) : nlohmann::json(nullptr)}});
  }
  return out;
}

nlohmann::json print_layouts(const std::vector<LayoutRow>& rows) {
  nlohmann::json out = nlohmann::json::array();
  if (rows.empty()) return out;
  std::printf("\nlayouts (Note [Layout rows]): the same kernels on arrays placed differently, rounds alternating; "
              "vs separate = the separate layout's time / this one's (>= 0.90: within 10%%)\n");
  std::printf("%-18s %-11s %7s %7s %-7s %9s %8s %11s %9s %12s\n", "layout", "kernel", "size", "threads", "simd",
              "ns/param", "GB/s", "limit GB/s", "fraction", "vs separate");
  for (const LayoutRow& r : rows) {
    const double n = static_cast<double>(r.n), bytes = tzbench::pattern_bytes_per_param(r.kernel.pattern) * n;
    std::printf("%-18s %-11s %7s %7d %-7s %9.3f %8.2f %11.2f %9.3f %12.3f\n", r.layout.c_str(), r.kernel.name.c_str(),
                tz::format_count(n).c_str(), r.threads, r.simd.c_str(), r.kernel_median / n * 1e9,
                bytes / r.kernel_median / 1e9, bytes / r.limit_median / 1e9, r.limit_median / r.kernel_median,
                r.vs_separate);
    out.push_back({{"layout", r.layout}, {"kernel", r.kernel.name}, {"size", r.n}, {"threads", r.threads},
                   {"simd", r.simd}, {"kernel_seconds", r.kernel_s}, {"limit_seconds", r.limit_s},
                   {"kernel_median_s", r.kernel_median}, {"limit_median_s", r.limit_median},
                   {"fraction_of_limit", r.limit_median / r.kernel_median}, {"vs_separate", r.vs_separate},
                   {"within_10_percent", r.vs_separate >= 0.9}});
  }
  return out;
}

// Issue #4's targets, at 2 threads where measured (else the most threads
// measured); returns their JSON.
nlohmann::json print_targets(const std::vector<Row>& rows, const std::vector<CopyCost>& costs,
                             const nlohmann::json& whole_json, const std::vector<int>& threads) {
  const int target_threads = std::find(threads.begin(), threads.end(), 2) != threads.end()
                                 ? 2
                                 : *std::max_element(threads.begin(), threads.end());
  nlohmann::json targets = nlohmann::json::array();
  std::printf("\ntargets (issue #4) at %d thread%s:\n", target_threads, target_threads == 1 ? "" : "s");
  for (const Row& r : rows) {
    if (r.threads != target_threads) continue;
    if (r.kernel.name == "adamw" || r.kernel.kind == Kind::kGradArrival) {
      const bool met = r.fraction() >= 0.9;
      std::printf("  %-10s size %-6s %-7s fraction of limit %.3f (pairwise %.3f), target >= 0.90: %s\n",
                  r.kernel.name.c_str(), tz::format_count(static_cast<double>(r.n)).c_str(), r.simd.c_str(),
                  r.fraction(), r.pair_ratio_median, met ? "met" : "MISSED");
      targets.push_back({{"target", r.kernel.name + " fraction_of_limit >= 0.9"}, {"size", r.n}, {"threads", r.threads},
                         {"simd", r.simd}, {"value", r.fraction()}, {"met", met}});
    }
  }
  for (const CopyCost& c : costs) {
    if (c.threads != target_threads || c.algorithm != "adamw") continue;
    const bool met = c.cost <= 0.08;
    std::printf("  %-10s size %-6s %-7s bf16 copy-out cost %+.1f%% (pairwise %+.1f%%), target <= 8%%: %s\n",
                "adamw+bf16", tz::format_count(static_cast<double>(c.n)).c_str(), c.simd.c_str(), 100 * c.cost,
                100 * c.pairwise, met ? "met" : "MISSED");
    targets.push_back({{"target", "adamw bf16 copy-out cost <= 0.08"}, {"size", c.n}, {"threads", c.threads},
                       {"simd", c.simd}, {"value", c.cost}, {"met", met}});
  }
  for (const nlohmann::json& w : whole_json) {
    if (w["threads"] != target_threads || w["speedup_over_torch"].is_null()) continue;
    const double speedup = w["speedup_over_torch"].get<double>();
    const bool met = speedup >= 1.3;
    std::printf("  %-10s size %-6s %-7s %.2fx torch's whole step, aim >= 1.3x: %s\n", "whole-step",
                tz::format_count(static_cast<double>(w["size"].get<std::size_t>())).c_str(),
                w["simd"].get<std::string>().c_str(), speedup, met ? "met" : "MISSED");
    targets.push_back({{"target", "whole step speedup over torch >= 1.3"}, {"size", w["size"]},
                       {"threads", w["threads"]}, {"simd", w["simd"]}, {"value", speedup}, {"met", met}});
  }
  return targets;
}

// The JSON of what the tables printed, filled as they print.
struct Sections {
  std::vector<CopyCost> costs;
  nlohmann::json remainder_master;
  nlohmann::json torch = nullptr;
  nlohmann::json whole_step, layouts, conversions, copies, targets;
};

tz::Status write_json(const Flags& flags, const Machine& machine, const Results& results, const Sections& s) {
  nlohmann::json cost_json = nlohmann::json::array();
  for (const CopyCost& c : s.costs) {
    cost_json.push_back({{"algorithm", c.algorithm}, {"size", c.n}, {"threads", c.threads}, {"simd", c.simd},
                         {"plain_median_s", c.plain_s}, {"copy_median_s", c.copy_s}, {"cost", c.cost},
                         {"cost_pairwise_median", c.pairwise}, {"limit_cost", c.limit_cost}});
  }
  nlohmann::json result_json = nlohmann::json::array();
  for (const Row& r : results.rows) result_json.push_back(row_json(r));
  nlohmann::json variants = nlohmann::json::array();
  for (ca::Simd v : ca::compiled_variants()) {
    variants.push_back({{"simd", ca::simd_name(v)}, {"cpu_supports", ca::cpu_supports(v)}});
  }
  nlohmann::json out = {
      {"benchmark", "tierzero-adam-bench"},
      {"build", build_summary()},
      {"machine",
       {{"cpu_model", machine.cpu_model},
        {"nproc", ::sysconf(_SC_NPROCESSORS_ONLN)},
        {"affinity_cpus", machine.affinity_cpus},
        {"mem_total_bytes", machine.mem.total_bytes},
        {"mem_available_bytes", machine.mem.available_bytes},
        {"transparent_hugepage", machine.thp},
        {"simd_best_supported", ca::simd_name(ca::best_supported())},
        {"simd_compiled", variants},
        {"limit_loop_isa", tzbench::stream_isa()}}},
      {"config",
       {{"sizes", results.sizes},
        {"threads_requested", flags.threads},
        {"threads", results.threads},
        {"simd_requested", flags.simd},
        {"kernels", flags.kernels},
        {"repeats", flags.repeats},
        {"warmup", 1},
        {"tile_elems_flag", flags.tile_elems},
        {"limit_copy_stores", flags.plain_copy_limit ? "plain" : "non-temporal"},
        {"tbb_numa_nodes", tbb::info::numa_nodes().size()},
        {"hugepages_madvise", flags.hugepages},
        {"grad_scale", kGradScale},
        {"statistic",
         "1 warm-up round, then `repeats` rounds; each round runs limit, kernel for every kernel in turn; "
         "fraction_of_limit = limit median / kernel median; *_pairwise_median: median over rounds of the "
         "per-round ratio"}}},
      {"results", result_json},
      {"copy_out_cost", cost_json},
      {"remainder_master", s.remainder_master},
      {"whole_step", s.whole_step},
      {"layouts", s.layouts},
      {"remainder_conversions", s.conversions},
      {"old_state_copies", s.copies},
      {"torch", s.torch},
      {"torch_unavailable_reason", results.torch_reason.empty() ? nlohmann::json(nullptr) : nlohmann::json(results.torch_reason)},
      {"targets", s.targets}};
  TZ_TRY(tz::write_file_durably(flags.json_path, out.dump(2) + "\n"));
  std::printf("\nwrote %s\n", flags.json_path.c_str());
  return tz::ok_status();
}

}  // namespace

tz::Status report(const Flags& flags, const Machine& machine, const Results& results) {
  Sections s;
  print_table(results.rows);
  s.costs = copy_costs(results.rows);
  print_copy_costs(s.costs);
  s.remainder_master = print_remainder_master(results.rows);
  if (!results.torch_reason.empty()) {
    std::printf("\nPyTorch: not importable, torch.optim.AdamW not timed (%s)\n", results.torch_reason.c_str());
  } else {
    const nlohmann::json compare = print_torch_compare(results.rows, results.torch);
    s.torch = results.torch.info;
    s.torch["runs"] = results.torch.runs;
    s.torch["compare"] = compare;
  }
  s.whole_step = print_whole_step(results.whole_rows, results.torch.medians);
  s.layouts = print_layouts(results.layout_rows);
  s.conversions = print_conversions(results.conversion_rows);
  s.copies = print_copies(results.copy_rows);
  s.targets = print_targets(results.rows, s.costs, s.whole_step, results.threads);
  if (!flags.json_path.empty()) TZ_TRY(write_json(flags, machine, results, s));
  return tz::ok_status();
}

}  // namespace tzbench::adam
