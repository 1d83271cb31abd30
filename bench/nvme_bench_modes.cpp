#include "nvme_bench_modes.h"

#include <algorithm>
#include <functional>
#include <numeric>

namespace tzbench {
namespace {

// The sweep re-measures its best first-pass points before choosing: one
// noisy run should not pick the winner.
constexpr std::size_t kRefineTop = 3;
constexpr int kRefineRuns = 2;

std::vector<double> gbps_of(const std::vector<Sample>& samples) {
  std::vector<double> out;
  for (const Sample& s : samples) out.push_back(s.gbps);
  return out;
}

std::string gbps_text(double gbps) { return fmt::format("{:.3f}", gbps); }

}  // namespace

nlohmann::json config_json(const EngineConfig& c) {
  return {{"block_size", c.block_bytes}, {"queue_depth", c.queue_depth}, {"rings", c.rings},
          {"single_submit", c.single_submit}, {"sqpoll", c.sqpoll}, {"fixed_buffers", c.fixed_buffers},
          {"fixed_files", c.fixed_files}, {"direct", c.direct}, {"backend", tz::nvme::io_backend_name(c.backend)},
          {"inflight_requests", c.inflight}};
}

// ---------------------------------------------------------------- one run

tz::Expected<Sample> measure_ours(Context& ctx, const EngineConfig& config, Workload w, const RunLimits& limits) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<RawBench> bench, RawBench::create(config, *ctx.files, *ctx.pool));
  ctx.cache.drop();
  const std::string label = fmt::format("ours {} {}", workload_name(w), config.label());
  ctx.progress.update("{}", label);
  TZ_ASSIGN_OR_RETURN(RunResult r, bench->run(w, limits, ctx.progress, label));
  if (config.fixed_buffers && bench->backend() == tz::nvme::IoBackend::kUring && r.fixed_buffer_ios == 0) {
    TZ_LOG_ONCE_WARN("bench", "fixed buffers were asked for but no I/O used one ({})", bench->describe());
  }
  return Sample{.gbps = r.gbps(), .iops = r.iops(), .latency_us = r.mean_latency_us()};
}

tz::Expected<Sample> measure_fio(Context& ctx, const EngineConfig& config, Workload w, const RunLimits& limits) {
  FioSpec spec{.fio = ctx.setup.fio,
               .files = ctx.files->paths(),
               .file_bytes = ctx.files->file_bytes(),
               .workload = w,
               .config = config,
               .limits = limits,
               .hugepages = ctx.setup.hugepages};
  ctx.cache.drop();
  ctx.progress.update("fio {} {}", workload_name(w), config.label());
  TZ_ASSIGN_OR_RETURN(FioResult f, run_fio(spec));
  return Sample{.gbps = f.gbps,
                .iops = f.gbps * 1e9 / static_cast<double>(config.block_bytes),
                .latency_us = f.mean_latency_us,
                .command = f.command};
}

tz::Expected<nlohmann::json> fill_file(Context& ctx) {
  ctx.progress.show("filling {} x {} once (warm-up, not counted)", ctx.files->paths().size(),
                    tz::format_bytes(ctx.files->file_bytes()));
  TZ_ASSIGN_OR_RETURN(Sample s, measure_ours(ctx, ctx.setup.base, Workload::kWrite, RunLimits{}));
  return nlohmann::json{{"workload", "write"}, {"config", config_json(ctx.setup.base)}, {"gbps", s.gbps}};
}

// ---------------------------------------------------------------- plain runs

tz::Expected<nlohmann::json> run_plain(Context& ctx) {
  const Setup& su = ctx.setup;
  std::vector<std::vector<Sample>> samples(su.workloads.size());
  for (int r = 0; r < su.repeats; ++r) {  // rounds outermost, so drifts spread over every workload
    for (std::size_t i = 0; i < su.workloads.size(); ++i) {
      ctx.progress.show("round {}/{}: {} {}", r + 1, su.repeats, workload_name(su.workloads[i]), su.base.label());
      TZ_ASSIGN_OR_RETURN(Sample s, measure_ours(ctx, su.base, su.workloads[i], su.limits));
      samples[i].push_back(s);
    }
  }
  ctx.progress.done();
  std::printf("\nraw engine, %d run%s each (rounds alternate the workloads); GB/s = 10^9 B/s, median [min, max]\n",
              su.repeats, su.repeats == 1 ? "" : "s");
  std::printf("%-10s %-20s %8s %8s %8s %10s %10s\n", "workload", "config", "GB/s", "min", "max", "IOPS", "lat us");
  nlohmann::json rows = nlohmann::json::array();
  for (std::size_t i = 0; i < su.workloads.size(); ++i) {
    const std::vector<double> g = gbps_of(samples[i]);
    std::vector<double> iops, lat;
    for (const Sample& s : samples[i]) {
      iops.push_back(s.iops);
      lat.push_back(s.latency_us);
    }
    std::printf("%-10s %-20s %8.3f %8.3f %8.3f %10.0f %10.1f\n", std::string(workload_name(su.workloads[i])).c_str(),
                su.base.label().c_str(), median(g), *std::min_element(g.begin(), g.end()),
                *std::max_element(g.begin(), g.end()), median(iops), median(lat));
    rows.push_back({{"workload", workload_name(su.workloads[i])}, {"config", config_json(su.base)}, {"gbps", g},
                    {"gbps_median", median(g)}, {"iops_median", median(iops)}, {"mean_latency_us_median", median(lat)}});
  }
  return rows;
}

// ---------------------------------------------------------------- sweep

namespace {

using Measure = std::function<tz::Expected<Sample>(const EngineConfig&)>;

struct SweepOutcome {
  std::vector<Sample> first;                                 // per grid point
  std::vector<std::pair<std::size_t, std::vector<double>>> refined;  // grid index, GB/s of its runs
  std::size_t best = 0;                                      // grid index
  double best_median = 0;
};

// A side of a sweep: ours, or fio.
struct Side {
  std::string name;
  Measure measure;
};

// The top kRefineTop first-pass points of one side.
std::vector<std::size_t> top_points(const std::vector<Sample>& first) {
  std::vector<std::size_t> order(first.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return first[a].gbps > first[b].gbps; });
  order.resize(std::min(order.size(), kRefineTop));
  return order;
}

// Every grid point for every side, the sides alternating at each point (so a
// drift of the device, such as a host flushing what the write sweep left,
// meets both alike); then each side's best first-pass points are measured
// kRefineRuns more times, again alternating, and the best median wins.
tz::Expected<std::vector<SweepOutcome>> sweep(const std::vector<EngineConfig>& grid, const std::vector<Side>& sides,
                                              Progress& progress, const std::string& what) {
  std::vector<SweepOutcome> out(sides.size());
  for (std::size_t i = 0; i < grid.size(); ++i) {
    for (std::size_t s = 0; s < sides.size(); ++s) {
      progress.show("{} sweep {}/{}: {} {}", what, i + 1, grid.size(), sides[s].name, grid[i].label());
      TZ_ASSIGN_OR_RETURN(Sample sample, sides[s].measure(grid[i]));
      out[s].first.push_back(sample);
    }
  }
  for (SweepOutcome& o : out) {
    for (std::size_t i : top_points(o.first)) o.refined.emplace_back(i, std::vector<double>{o.first[i].gbps});
  }
  for (int k = 0; k < kRefineRuns; ++k) {
    for (std::size_t rank = 0; rank < out.front().refined.size(); ++rank) {
      for (std::size_t s = 0; s < sides.size(); ++s) {
        auto& [i, runs] = out[s].refined[rank];
        progress.show("{} sweep, re-measuring the best ({}/{}): {} {}", what, k + 2, kRefineRuns + 1, sides[s].name,
                      grid[i].label());
        TZ_ASSIGN_OR_RETURN(Sample sample, sides[s].measure(grid[i]));
        runs.push_back(sample.gbps);
      }
    }
  }
  for (SweepOutcome& o : out) {
    for (const auto& [i, runs] : o.refined) {
      if (median(runs) > o.best_median) {
        o.best_median = median(runs);
        o.best = i;
      }
    }
  }
  return out;
}

std::string row_label(const EngineConfig& c) {
  return tz::format_bytes(c.block_bytes) + (c.single_submit ? " ss" : "");
}
std::string column_label(const EngineConfig& c) { return fmt::format("qd{} x{}", c.queue_depth, c.rings); }

// GB/s of the first pass as a matrix (block size down, (depth, rings) across),
// then the re-measured points and the winner.
void print_matrix(const std::string& title, const std::vector<EngineConfig>& grid, const SweepOutcome& o) {
  std::vector<std::string> rows, cols;
  for (const EngineConfig& c : grid) {
    if (std::find(rows.begin(), rows.end(), row_label(c)) == rows.end()) rows.push_back(row_label(c));
    if (std::find(cols.begin(), cols.end(), column_label(c)) == cols.end()) cols.push_back(column_label(c));
  }
  std::printf("\n%s\n%-12s", title.c_str(), "block");
  for (const std::string& c : cols) std::printf(" %10s", c.c_str());
  std::printf("\n");
  for (const std::string& r : rows) {
    std::printf("%-12s", r.c_str());
    for (const std::string& c : cols) {
      std::string cell = "-";
      for (std::size_t i = 0; i < grid.size(); ++i) {
        if (row_label(grid[i]) == r && column_label(grid[i]) == c) cell = gbps_text(o.first[i].gbps) + (i == o.best ? "*" : "");
      }
      std::printf(" %10s", cell.c_str());
    }
    std::printf("\n");
  }
  std::string refined;
  for (const auto& [i, runs] : o.refined) {
    refined += fmt::format("{}{} median {:.3f}", refined.empty() ? "" : "; ", grid[i].label(), median(runs));
  }
  std::printf("re-measured (%d runs each): %s\n* best: %s, %.3f GB/s\n", kRefineRuns + 1, refined.c_str(),
              grid[o.best].label().c_str(), o.best_median);
  std::fflush(stdout);
}

nlohmann::json sweep_json(const std::vector<EngineConfig>& grid, const SweepOutcome& o) {
  nlohmann::json points = nlohmann::json::array();
  for (std::size_t i = 0; i < grid.size(); ++i) {
    nlohmann::json p = {{"config", config_json(grid[i])}, {"gbps", o.first[i].gbps}, {"iops", o.first[i].iops},
                        {"mean_latency_us", o.first[i].latency_us}};
    if (!o.first[i].parts.empty()) p["parts_gbps"] = o.first[i].parts;
    points.push_back(p);
  }
  nlohmann::json refined = nlohmann::json::array();
  for (const auto& [i, runs] : o.refined) refined.push_back({{"config", config_json(grid[i])}, {"gbps", runs}});
  return {{"points", points}, {"refined", refined}, {"best", config_json(grid[o.best])}, {"best_gbps_median", o.best_median}};
}

std::string limits_text(const RunLimits& l) {
  if (l.runtime_s > 0) return fmt::format("{:.1f} s per run", l.runtime_s);
  if (l.io_bytes > 0) return fmt::format("{} per run", tz::format_bytes(l.io_bytes));
  return "once through the file per run";
}

}  // namespace

tz::Expected<nlohmann::json> run_sweep(Context& ctx) {
  nlohmann::json out = nlohmann::json::array();
  for (Workload w : ctx.setup.workloads) {
    Measure ours = [&](const EngineConfig& c) { return measure_ours(ctx, c, w, ctx.setup.sweep_limits); };
    TZ_ASSIGN_OR_RETURN(std::vector<SweepOutcome> swept,
                        sweep(ctx.setup.grid, {{"ours", ours}}, ctx.progress, std::string(workload_name(w))));
    const SweepOutcome& o = swept.front();
    ctx.progress.done();
    print_matrix(fmt::format("sweep, {}: GB/s, first pass ({})", workload_name(w), limits_text(ctx.setup.sweep_limits)),
                 ctx.setup.grid, o);
    nlohmann::json j = sweep_json(ctx.setup.grid, o);
    j["workload"] = workload_name(w);
    out.push_back(j);
  }
  return out;
}

// ---------------------------------------------------------------- tune

tz::Expected<nlohmann::json> run_tune(Context& ctx) {
  const RunLimits& limits = ctx.setup.sweep_limits;
  // An offload step writes what it swaps out and reads it back: the score is
  // the round trip's rate, the harmonic mean of write and read.
  Measure both = [&](const EngineConfig& c) -> tz::Expected<Sample> {
    TZ_ASSIGN_OR_RETURN(Sample wr, measure_ours(ctx, c, Workload::kWrite, limits));
    TZ_ASSIGN_OR_RETURN(Sample rd, measure_ours(ctx, c, Workload::kRead, limits));
    const double hm = wr.gbps > 0 && rd.gbps > 0 ? 2 / (1 / wr.gbps + 1 / rd.gbps) : 0;
    return Sample{.gbps = hm, .parts = {wr.gbps, rd.gbps}};
  };
  TZ_ASSIGN_OR_RETURN(std::vector<SweepOutcome> swept, sweep(ctx.setup.grid, {{"ours", both}}, ctx.progress, "tune"));
  const SweepOutcome& o = swept.front();
  ctx.progress.done();
  const EngineConfig& best = ctx.setup.grid[o.best];
  print_matrix(fmt::format("tune: harmonic mean of sequential write and read GB/s, first pass ({})", limits_text(limits)),
               ctx.setup.grid, o);
  std::size_t best_write = 0, best_read = 0;
  for (std::size_t i = 0; i < o.first.size(); ++i) {
    if (o.first[i].parts[0] > o.first[best_write].parts[0]) best_write = i;
    if (o.first[i].parts[1] > o.first[best_read].parts[1]) best_read = i;
  }
  std::printf("\nbest write alone: %.3f GB/s at %s; best read alone: %.3f GB/s at %s\n", o.first[best_write].parts[0],
              ctx.setup.grid[best_write].label().c_str(), o.first[best_read].parts[1],
              ctx.setup.grid[best_read].label().c_str());
  const nlohmann::json aio = {{"block_size", best.block_bytes}, {"queue_depth", best.queue_depth},
                              {"intra_op_parallelism", best.rings}, {"single_submit", best.single_submit},
                              {"overlap_events", true}};
  std::printf("best for both (%.3f GB/s round trip, median of %d runs); paste into the config:\n%s\n", o.best_median,
              kRefineRuns + 1, nlohmann::json{{"aio", aio}}.dump(2).c_str());
  nlohmann::json j = sweep_json(ctx.setup.grid, o);
  j["aio"] = aio;
  j["score"] = "harmonic mean of sequential write and read GB/s";
  return j;
}

// ---------------------------------------------------------------- fio

namespace {

struct PairRow {
  Workload workload = Workload::kRead;
  EngineConfig ours_config, fio_config;
  std::vector<Sample> ours, fio;
  std::vector<double> ratios;  // ours / fio, per pair
};

// The target: sequential read and write with O_DIRECT at least match fio.
bool has_target(const PairRow& r) { return !workload_random(r.workload) && r.ours_config.direct; }

void print_pairs(const std::vector<PairRow>& rows, int pairs) {
  std::printf("\ntierzero vs fio io_uring, %d alternating pairs (ours, fio, ours, fio, ...); GB/s medians; "
              "ours/fio = median of the per-pair ratios\n", pairs);
  std::printf("%-10s %-20s %-20s %9s %9s %9s %9s %9s  %s\n", "workload", "ours config", "fio config", "ours GB/s",
              "fio GB/s", "ours/fio", "ours lat", "fio lat", "target");
  for (const PairRow& r : rows) {
    const double ratio = median(r.ratios);
    std::vector<double> ol, fl;
    for (const Sample& s : r.ours) ol.push_back(s.latency_us);
    for (const Sample& s : r.fio) fl.push_back(s.latency_us);
    const std::string target = has_target(r) ? fmt::format(">= 1.00: {}", ratio >= 1.0 ? "met" : "MISSED") : "-";
    std::printf("%-10s %-20s %-20s %9.3f %9.3f %9.3f %9.0f %9.0f  %s\n", std::string(workload_name(r.workload)).c_str(),
                r.ours_config.label().c_str(), r.fio_config.label().c_str(), median(gbps_of(r.ours)),
                median(gbps_of(r.fio)), ratio, median(ol), median(fl), target.c_str());
  }
  std::printf("lat = mean latency per request, us (ours: submit to callback; fio: lat_ns mean)\n");
}

nlohmann::json pair_json(const PairRow& r) {
  const double ratio = median(r.ratios);
  nlohmann::json j = {{"workload", workload_name(r.workload)}, {"ours_config", config_json(r.ours_config)},
                      {"fio_config", config_json(r.fio_config)}, {"ours_gbps", gbps_of(r.ours)},
                      {"fio_gbps", gbps_of(r.fio)}, {"ratios", r.ratios}, {"ours_gbps_median", median(gbps_of(r.ours))},
                      {"fio_gbps_median", median(gbps_of(r.fio))}, {"ours_over_fio_median", ratio},
                      {"fio_command", r.fio.empty() ? "" : r.fio.back().command}};
  if (has_target(r)) j["target"] = {{"what", "ours/fio >= 1.0"}, {"met", ratio >= 1.0}};
  return j;
}

// Each side's best configuration for `w` (their own sweeps), or the base for both.
tz::Status choose_configs(Context& ctx, bool do_sweep, PairRow& row, nlohmann::json& sweeps) {
  row.ours_config = row.fio_config = ctx.setup.base;
  if (!do_sweep) return tz::ok_status();
  const Workload w = row.workload;
  const RunLimits& limits = ctx.setup.sweep_limits;
  Measure ours = [&](const EngineConfig& c) { return measure_ours(ctx, c, w, limits); };
  Measure fio = [&](const EngineConfig& c) { return measure_fio(ctx, c, w, limits); };
  const std::string name(workload_name(w));
  TZ_ASSIGN_OR_RETURN(std::vector<SweepOutcome> swept,
                      sweep(ctx.setup.grid, {{"ours", ours}, {"fio", fio}}, ctx.progress, name));
  const SweepOutcome& o = swept[0];
  const SweepOutcome& f = swept[1];
  ctx.progress.done();
  print_matrix(fmt::format("ours, {}: GB/s, first pass ({}; fio ran after ours at each point)", name,
                           limits_text(limits)),
               ctx.setup.grid, o);
  print_matrix(fmt::format("fio, {}: GB/s, first pass ({})", name, limits_text(limits)), ctx.setup.grid, f);
  row.ours_config = ctx.setup.grid[o.best];
  row.fio_config = ctx.setup.grid[f.best];
  sweeps.push_back({{"workload", name}, {"ours", sweep_json(ctx.setup.grid, o)}, {"fio", sweep_json(ctx.setup.grid, f)}});
  return tz::ok_status();
}

}  // namespace

tz::Expected<nlohmann::json> run_compare(Context& ctx, bool do_sweep) {
  TZ_ASSIGN_OR_RETURN(std::string version, fio_version(ctx.setup.fio));
  std::printf("peer: %s, ioengine=io_uring\n", version.c_str());
  std::fflush(stdout);
  std::vector<PairRow> rows;
  nlohmann::json sweeps = nlohmann::json::array();
  for (Workload w : ctx.setup.workloads) {
    PairRow row{.workload = w};
    TZ_TRY(choose_configs(ctx, do_sweep, row, sweeps));
    for (int p = 0; p < ctx.setup.pairs; ++p) {
      const std::string name(workload_name(w));
      ctx.progress.show("{} pair {}/{}: ours at {}", name, p + 1, ctx.setup.pairs, row.ours_config.label());
      TZ_ASSIGN_OR_RETURN(Sample ours, measure_ours(ctx, row.ours_config, w, ctx.setup.limits));
      ctx.progress.show("{} pair {}/{}: fio at {}", name, p + 1, ctx.setup.pairs, row.fio_config.label());
      TZ_ASSIGN_OR_RETURN(Sample fio, measure_fio(ctx, row.fio_config, w, ctx.setup.limits));
      row.ours.push_back(ours);
      row.fio.push_back(fio);
      row.ratios.push_back(fio.gbps > 0 ? ours.gbps / fio.gbps : 0);
    }
    rows.push_back(std::move(row));
  }
  ctx.progress.done();
  print_pairs(rows, ctx.setup.pairs);
  nlohmann::json pairs = nlohmann::json::array();
  for (const PairRow& r : rows) pairs.push_back(pair_json(r));
  return nlohmann::json{{"fio_version", version}, {"sweeps", sweeps}, {"pairs", pairs}};
}

// ---------------------------------------------------------------- swap

namespace {

struct SwapLine {
  const char* name;
  std::vector<double> raw, swap;  // GB/s per round
};

std::vector<SwapLine> swap_lines(const SwapReport& r) {
  SwapLine w{"write", {}, {}}, rd{"read", {}, {}}, rt{"round trip", {}, {}};
  for (const SwapRound& x : r.rounds) {
    w.raw.push_back(x.raw_write.gbps());
    w.swap.push_back(x.swap_write.gbps());
    rd.raw.push_back(x.raw_read.gbps());
    rd.swap.push_back(x.swap_read.gbps());
    const auto bytes = static_cast<double>(x.raw_write.bytes + x.raw_read.bytes);
    rt.raw.push_back(bytes / (x.raw_write.seconds + x.raw_read.seconds) / 1e9);
    rt.swap.push_back(bytes / (x.swap_write.seconds + x.swap_read.seconds) / 1e9);
  }
  return {w, rd, rt};
}

std::vector<double> pairwise(const SwapLine& l) {
  std::vector<double> out;
  for (std::size_t i = 0; i < l.raw.size(); ++i) out.push_back(l.raw[i] > 0 ? l.swap[i] / l.raw[i] : 0);
  return out;
}

}  // namespace

tz::Expected<nlohmann::json> run_swap(Context& ctx) {
  TZ_ASSIGN_OR_RETURN(SwapReport r, run_swap_bench(ctx.setup.base, ctx.setup.dirs, ctx.setup.swap_spec, ctx.cache,
                                                   ctx.progress));
  ctx.progress.done();
  const std::uint64_t bytes = r.extents * r.extent_bytes;
  const std::string sums = r.checksums ? fmt::format("XXH3 ({} build) per {} piece", tz::nvme::checksum_variant(),
                                                    tz::format_bytes(ctx.setup.base.block_bytes))
                                        : "NO checksums (--swap-no-checksums)";
  std::printf("\nswap store vs raw engine on the same bytes: %s in %llu extents of %s, %d in flight, %s; %zu "
              "round%s after 1 warm-up (raw write, raw read, swap write, swap read); %s verified byte for byte\n"
              "engine: %s\n",
              tz::format_bytes(bytes).c_str(), static_cast<unsigned long long>(r.extents),
              tz::format_bytes(r.extent_bytes).c_str(), r.window, sums.c_str(),
              r.rounds.size(), r.rounds.size() == 1 ? "" : "s", tz::format_bytes(r.verified_bytes).c_str(), r.engine.c_str());
  std::printf("%-11s %9s %9s %9s %9s  %s\n", "", "raw GB/s", "swap GB/s", "swap/raw", "pairwise", "target");
  nlohmann::json lines = nlohmann::json::array();
  nlohmann::json target;
  for (const SwapLine& l : swap_lines(r)) {
    const double ratio = median(l.swap) / median(l.raw);
    const bool round_trip = std::string(l.name) == "round trip";
    if (round_trip && r.checksums) {
      target = {{"what", "swap round trip with checksums >= 0.9x raw"}, {"value", ratio}, {"met", ratio >= 0.9}};
    }
    std::printf("%-11s %9.3f %9.3f %9.3f %9.3f  %s\n", l.name, median(l.raw), median(l.swap), ratio,
                median(pairwise(l)), round_trip && r.checksums ? fmt::format(">= 0.90: {}", ratio >= 0.9 ? "met" : "MISSED").c_str() : "");
    lines.push_back({{"op", l.name}, {"raw_gbps", l.raw}, {"swap_gbps", l.swap}, {"raw_gbps_median", median(l.raw)},
                     {"swap_gbps_median", median(l.swap)}, {"swap_over_raw", ratio},
                     {"swap_over_raw_pairwise_median", median(pairwise(l))}});
  }
  return nlohmann::json{{"engine", r.engine}, {"bytes", bytes}, {"extents", r.extents},
                        {"extent_bytes", r.extent_bytes}, {"window", r.window},
                        {"checksums", r.checksums ? "xxh3-64 per piece" : "none"},
                        {"checksum_build", std::string(tz::nvme::checksum_variant())},
                        {"verified_bytes", r.verified_bytes}, {"rows", lines}, {"target", target},
                        {"store_stats", {{"bytes_written", r.stats.bytes_written}, {"bytes_read", r.stats.bytes_read},
                                         {"corrupt_reads", r.stats.corrupt_reads},
                                         {"failed_writes", r.stats.failed_writes}}}};
}

}  // namespace tzbench
