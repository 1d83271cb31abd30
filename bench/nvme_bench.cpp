// tierzero-nvme-bench: the NVMe tier's I/O engine and swap store on real files,
// against fio's io_uring engine and against the raw engine in the same run.
//
// A benchmark file of --size is striped over one scratch file per --path
// (stripe unit = block size) and filled once before anything is timed. Then,
// by mode:
//   (default)       each workload of --ops (write, read, randwrite, randread)
//                   at one configuration, --repeats rounds, plus the swap
//                   store round trip when --ops has "swap";
//   --sweep         every point of the grid (--sweep-blocks x --sweep-depths x
//                   --sweep-rings), the best re-measured, per workload;
//   --tune          the sweep over sequential write and read, and the best
//                   `aio` block as JSON ready to paste into the config;
//   --compare-fio   ours and fio alternating, --pairs times per workload, the
//                   median of the per-pair ratios (with --sweep: each side at
//                   the best point of its own sweep, both swept in one pass,
//                   alternating at each point); where fio cannot be run, a
//                   note and the plain runs instead;
//   --swap          only the swap store round trip against the raw engine.
// Every run keeps queue_depth * rings requests of block size in flight (see
// nvme_bench_raw.h). GB/s are 10^9 B/s. Buffered runs (--buffered) drop the
// page cache before each run where /proc/sys/vm/drop_caches is writable, and
// say so where it is not. Scratch files are removed at the end, on error, and
// on SIGINT/SIGTERM.
//
// Prints the device and file system under each path, a table per mode
// (stdout), a progress line (stderr), and JSON with --json.
//
//   tierzero-nvme-bench --path /mnt/nvme0/tz --size 4GiB --ops write,read --compare-fio --sweep --json seq.json
//   tierzero-nvme-bench --path /mnt/nvme0/tz --swap --swap-size 2GiB --json swap.json
//   tierzero-nvme-bench --path /mnt/nvme0/tz --path /mnt/nvme1/tz --tune
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <sys/utsname.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "nvme_bench_modes.h"
#include "nvme_bench_replay.h"

namespace {

using tzbench::EngineConfig;
using tzbench::Setup;

struct Flags {
  std::vector<std::string> paths;
  std::string size = "4GiB";
  std::string block_size = "1M";
  int queue_depth = 32;
  int rings = 1;
  int inflight = 0;
  bool buffered = false;
  bool fixed_buffers = true;
  bool fixed_files = true;
  bool single_submit = false;
  bool sqpoll = false;
  bool hugepages = true;
  std::string backend = "auto";
  std::string ops = "write,read,randwrite,randread,swap";
  int repeats = 3;
  double runtime_s = 0;
  std::string io_bytes;
  bool sweep = false;
  std::string sweep_blocks = "128K,1M,4M,8M";
  std::string sweep_depths = "1,8,32";
  std::string sweep_rings = "1,2";
  bool sweep_single_submit = false;
  std::string sweep_bytes = "1GiB";
  std::string max_inflight = "512MiB";
  bool tune = false;
  bool swap_only = false;
  std::string swap_size = "2GiB";
  std::string extent_size = "64MiB";
  int swap_window = 0;
  bool swap_checksums = true;
  bool compare_fio = false;
  std::string replay_path;  // --replay: a fio version 2 I/O log
  int replay_loops = 0;     // 0: enough passes for 2 GiB a run
  int pairs = 5;
  std::string fio = "fio";
  std::string json_path;
};

// ---------------------------------------------------------------- setup

tz::Expected<tz::nvme::IoBackend> parse_backend(const std::string& name) {
  for (auto b : {tz::nvme::IoBackend::kAuto, tz::nvme::IoBackend::kUring, tz::nvme::IoBackend::kThreads}) {
    if (tz::nvme::io_backend_name(b) == name) return b;
  }
  return tz::invalid_argument("--backend '{}': use auto, io_uring or threads", name);
}

tz::Expected<EngineConfig> base_config(const Flags& f) {
  EngineConfig c{.queue_depth = f.queue_depth,
                 .rings = f.rings,
                 .single_submit = f.single_submit,
                 .sqpoll = f.sqpoll,
                 .fixed_buffers = f.fixed_buffers,
                 .fixed_files = f.fixed_files,
                 .direct = !f.buffered,
                 .inflight = f.inflight};
  TZ_ASSIGN_OR_RETURN(c.block_bytes, tzbench::parse_size("--block-size", f.block_size));
  TZ_ASSIGN_OR_RETURN(c.backend, parse_backend(f.backend));
  return c;
}

tz::Status parse_ops(const Flags& f, Setup& s) {
  for (const std::string& op : tzbench::split_list(f.ops)) {
    if (op == "swap") {
      s.swap = true;
      continue;
    }
    TZ_ASSIGN_OR_RETURN(tzbench::Workload w, tzbench::parse_workload(op));
    if (std::find(s.workloads.begin(), s.workloads.end(), w) == s.workloads.end()) s.workloads.push_back(w);
  }
  if (f.swap_only) {
    s.workloads.clear();
    s.swap = true;
  }
  if (f.tune) s.swap = false;
  if (s.workloads.empty() && !s.swap && !f.tune) return tz::invalid_argument("--ops '{}': nothing to run", f.ops);
  return tz::ok_status();
}

// The sweep's points; those with more than --max-inflight bytes in flight are left out.
tz::Status build_grid(const Flags& f, Setup& s) {
  TZ_ASSIGN_OR_RETURN(auto blocks, tzbench::parse_byte_list("--sweep-blocks", f.sweep_blocks));
  TZ_ASSIGN_OR_RETURN(auto depths, tzbench::parse_int_list("--sweep-depths", f.sweep_depths, 1, 4096));
  TZ_ASSIGN_OR_RETURN(auto rings, tzbench::parse_int_list("--sweep-rings", f.sweep_rings, 1, 64));
  TZ_ASSIGN_OR_RETURN(std::uint64_t max_inflight, tzbench::parse_size("--max-inflight", f.max_inflight));
  std::vector<bool> single_submit{false};
  if (f.sweep_single_submit) single_submit.push_back(true);
  for (bool ss : single_submit) {
    for (std::uint64_t b : blocks) {
      for (int r : rings) {
        for (int d : depths) {
          if (b % 4096 != 0 || b > s.file_bytes) {
            return tz::invalid_argument("--sweep-blocks: {} is not a multiple of 4096 no larger than the file ({} per path)",
                                        b, tz::format_bytes(s.file_bytes));
          }
          if (b * static_cast<std::uint64_t>(d) * static_cast<std::uint64_t>(r) > max_inflight) continue;
          EngineConfig c = s.base;
          c.block_bytes = b;
          c.queue_depth = d;
          c.rings = r;
          c.single_submit = ss;
          c.inflight = 0;
          s.grid.push_back(c);
        }
      }
    }
  }
  if (s.grid.empty()) return tz::invalid_argument("the sweep grid is empty (every point is over --max-inflight {})", f.max_inflight);
  return tz::ok_status();
}

tz::Expected<Setup> resolve(const Flags& f) {
  Setup s;
  s.dirs = f.paths;
  if (s.dirs.empty()) s.dirs.push_back("/var/tmp");
  TZ_ASSIGN_OR_RETURN(s.base, base_config(f));
  TZ_ASSIGN_OR_RETURN(std::uint64_t size, tzbench::parse_size("--size", f.size));
  s.file_bytes = size / s.dirs.size() / 4096 * 4096;
  if (s.file_bytes == 0) return tz::invalid_argument("--size {}: less than 4 KiB per path", f.size);
  if (s.base.block_bytes % 4096 != 0 || s.base.block_bytes == 0 || s.base.block_bytes > s.file_bytes) {
    return tz::invalid_argument("--block-size {}: must be a multiple of 4096 no larger than the file ({} per path)",
                                f.block_size, tz::format_bytes(s.file_bytes));
  }
  TZ_TRY(parse_ops(f, s));
  if (!f.replay_path.empty()) {  // the replay alone: no benchmark file, no swap run
    s.workloads.clear();
    s.swap = false;
  }
  s.repeats = f.repeats;
  s.pairs = f.pairs;
  s.fio = f.fio;
  s.limits.runtime_s = f.runtime_s;
  if (!f.io_bytes.empty()) {
    TZ_ASSIGN_OR_RETURN(s.limits.io_bytes, tzbench::parse_size("--io-bytes", f.io_bytes));
  }
  TZ_ASSIGN_OR_RETURN(s.sweep_limits.io_bytes, tzbench::parse_size("--sweep-bytes", f.sweep_bytes));
  if (f.sweep || f.tune) TZ_TRY(build_grid(f, s));
  TZ_ASSIGN_OR_RETURN(s.swap_spec.total_bytes, tzbench::parse_size("--swap-size", f.swap_size));
  TZ_ASSIGN_OR_RETURN(s.swap_spec.extent_bytes, tzbench::parse_size("--extent-size", f.extent_size));
  s.swap_spec.window = f.swap_window;
  s.hugepages = s.swap_spec.hugepages = f.hugepages;
  s.swap_spec.checksums = f.swap_checksums;
  s.swap_spec.rounds = f.pairs;
  return s;
}

// ---------------------------------------------------------------- checks

bool needs_file(const Flags& f, const Setup& s) { return f.tune || !s.workloads.empty(); }

// Disk: the benchmark file and, for the swap run, the store and its raw twin.
tz::Status check_space(const Flags& f, const Setup& s) {
  const std::uint64_t swap_bytes = s.swap_spec.extent_bytes > 0
                                       ? s.swap_spec.total_bytes / s.swap_spec.extent_bytes * s.swap_spec.extent_bytes
                                       : 0;
  for (const std::string& dir : s.dirs) {
    std::uint64_t need = 0;
    std::string what;
    if (needs_file(f, s)) {
      need += s.file_bytes;
      what = fmt::format("the benchmark file (--size {} over {} path(s))", f.size, s.dirs.size());
    }
    if (s.swap) {
      need += 2 * (swap_bytes / s.dirs.size() + 4096);
      what += fmt::format("{}the swap store and its raw twin (2 x --swap-size {} over {} path(s))",
                          what.empty() ? "" : " and ", f.swap_size, s.dirs.size());
    }
    TZ_TRY(tzbench::check_free_space(dir, need, what));
  }
  return tz::ok_status();
}

std::size_t pool_bytes(const Flags& f, const Setup& s) {
  if (!needs_file(f, s)) return 0;
  std::size_t bytes = tzbench::RawBench::pool_bytes(s.base, s.dirs.size());
  for (const EngineConfig& c : s.grid) bytes = std::max(bytes, tzbench::RawBench::pool_bytes(c, s.dirs.size()));
  return bytes;
}

// Memory: the request buffers, and the swap run's source and destination.
tz::Status check_memory(const Setup& s, std::size_t pool) {
  TZ_ASSIGN_OR_RETURN(tz::HostMemoryReading mem, tz::read_host_memory());
  const std::uint64_t swap = s.swap ? 2 * s.swap_spec.total_bytes : 0;
  constexpr std::uint64_t kHeadroom = std::uint64_t{512} << 20;
  if (pool + swap + kHeadroom > mem.available_bytes) {
    return tz::out_of_memory("the run needs {} of request buffers and {} for the swap run's source and read-back "
                             "copies (2 x --swap-size) plus {} headroom, but MemAvailable is {}; lower --swap-size, "
                             "--max-inflight or --queue-depth",
                             tz::format_bytes(pool), tz::format_bytes(swap), tz::format_bytes(kHeadroom),
                             tz::format_bytes(mem.available_bytes));
  }
  return tz::ok_status();
}

// ---------------------------------------------------------------- report

// Prints and returns what is under each path; refuses a path without real
// O_DIRECT unless the run is buffered.
tz::Expected<nlohmann::json> describe_paths(const Setup& s) {
  nlohmann::json out = nlohmann::json::array();
  for (const std::string& dir : s.dirs) {
    TZ_ASSIGN_OR_RETURN(tz::PathCapabilities p, tz::probe_path(dir));
    std::printf("path %s", tz::describe(p).c_str());
    if (s.base.direct && !p.o_direct) {
      return tz::invalid_argument("--path {}: O_DIRECT is not possible on this {} ({}); pass --buffered to measure "
                                  "buffered I/O there",
                                  dir, p.filesystem, p.note.empty() ? "refused by open" : p.note);
    }
    out.push_back({{"path", dir}, {"filesystem", p.filesystem}, {"device", p.device}, {"free_bytes", p.free_bytes},
                   {"total_bytes", p.total_bytes}, {"o_direct", p.o_direct}, {"dio_mem_align", p.dio_mem_align},
                   {"dio_offset_align", p.dio_offset_align}, {"note", p.note}});
  }
  return out;
}

nlohmann::json machine_json() {
  struct utsname u {};
  ::uname(&u);
  tz::Expected<tz::HostMemoryReading> mem = tz::read_host_memory();
  return {{"cpu_model", tzbench::cpu_model()}, {"nproc", ::sysconf(_SC_NPROCESSORS_ONLN)}, {"kernel", u.release},
          {"mem_total_bytes", mem.ok() ? mem->total_bytes : 0}};
}

nlohmann::json flags_json(const Flags& f, const Setup& s) {
  return {{"paths", s.dirs}, {"size", f.size}, {"file_bytes_per_path", s.file_bytes},
          {"base", tzbench::config_json(s.base)}, {"ops", f.ops}, {"repeats", f.repeats}, {"pairs", f.pairs},
          {"runtime_s", f.runtime_s}, {"io_bytes", s.limits.io_bytes}, {"sweep", f.sweep}, {"tune", f.tune},
          {"compare_fio", f.compare_fio}, {"sweep_bytes", s.sweep_limits.io_bytes}, {"grid_points", s.grid.size()},
          {"swap_size", s.swap_spec.total_bytes}, {"extent_size", s.swap_spec.extent_bytes},
          {"max_inflight", f.max_inflight}, {"buffered", f.buffered},
          {"hugepages", f.hugepages ? "buffers madvise(MADV_HUGEPAGE); fio with GLIBC_TUNABLES=glibc.malloc.hugetlb=1"
                                    : "off"}};
}

void collect_targets(const nlohmann::json& out, nlohmann::json& targets) {
  if (out.contains("compare")) {
    for (const nlohmann::json& p : out["compare"]["pairs"]) {
      if (p.contains("target")) {
        targets.push_back({{"what", std::string("sequential ") + p["workload"].get<std::string>() +
                                        " O_DIRECT, each at its best: ours/fio >= 1.0 (median of pairs)"},
                           {"value", p["ours_over_fio_median"]}, {"met", p["target"]["met"]}});
      }
    }
  }
  if (out.contains("swap") && !out["swap"]["target"].is_null()) targets.push_back(out["swap"]["target"]);
}

// ---------------------------------------------------------------- run

// "" when --compare-fio can run fio; else why not (the comparison is then
// skipped with a note, as the other benchmarks do for a missing peer).
std::string fio_unavailable_reason(const Flags& f) {
  if (!f.compare_fio) return "";
  tz::Expected<std::string> version = tzbench::fio_version(f.fio);
  return version.ok() ? "" : version.status().message();
}

tz::Status run_modes(const Flags& f, tzbench::Context& ctx, nlohmann::json& out) {
  const std::string no_fio = fio_unavailable_reason(f);
  if (!no_fio.empty()) {
    std::printf("fio: cannot run it (%s); --compare-fio skipped\n", no_fio.c_str());
    out["fio_unavailable_reason"] = no_fio;
  }
  if (ctx.files != nullptr) {
    TZ_ASSIGN_OR_RETURN(out["fill"], tzbench::fill_file(ctx));
  }
  if (f.tune) {
    TZ_ASSIGN_OR_RETURN(out["tune"], tzbench::run_tune(ctx));
  } else if (f.compare_fio && no_fio.empty() && !ctx.setup.workloads.empty()) {
    TZ_ASSIGN_OR_RETURN(out["compare"], tzbench::run_compare(ctx, f.sweep));
  } else if (f.sweep && !ctx.setup.workloads.empty()) {
    TZ_ASSIGN_OR_RETURN(out["sweep"], tzbench::run_sweep(ctx));
  } else if (!ctx.setup.workloads.empty()) {
    TZ_ASSIGN_OR_RETURN(out["plain"], tzbench::run_plain(ctx));
  }
  std::fflush(stdout);  // the tables so far, before the swap run's progress lines
  if (ctx.setup.swap) {
    TZ_ASSIGN_OR_RETURN(out["swap"], tzbench::run_swap(ctx));
  }
  if (!f.replay_path.empty()) {
    TZ_ASSIGN_OR_RETURN(out["replay"], tzbench::run_replay(ctx, f.replay_path, f.replay_loops,
                                                           f.compare_fio && no_fio.empty()));
  }
  return tz::ok_status();
}

tz::Status write_json(const std::string& path, const nlohmann::json& out) {
  TZ_TRY(tz::write_file_durably(path, out.dump(2) + "\n"));
  std::printf("\nwrote %s\n", path.c_str());
  return tz::ok_status();
}

tz::Status run(const Flags& f) {
  TZ_ASSIGN_OR_RETURN(Setup setup, resolve(f));
  std::printf("%s\n", tzbench::build_summary().c_str());
  TZ_ASSIGN_OR_RETURN(nlohmann::json paths, describe_paths(setup));
  TZ_TRY(check_space(f, setup));
  const std::size_t pool_size = pool_bytes(f, setup);
  TZ_TRY(check_memory(setup, pool_size));

  tzbench::Context ctx{.setup = setup, .cache = tzbench::PageCache(f.buffered)};
  TZ_ASSIGN_OR_RETURN(auto engine, tz::nvme::IoEngine::create(setup.base.engine_options()));
  std::printf("engine: %s; %d request%s in flight; %s\nbuffers: %s\n", engine->describe().c_str(),
              setup.base.inflight_requests(setup.dirs.size()),
              setup.base.inflight_requests(setup.dirs.size()) == 1 ? "" : "s",
              f.buffered ? ctx.cache.note().c_str() : "O_DIRECT",
              f.hugepages ? "transparent huge pages (madvise), fio's malloc told to do the same "
                            "(GLIBC_TUNABLES=glibc.malloc.hugetlb=1)"
                          : "small pages (--no-hugepages), fio's as malloc gives them");
  engine.reset();
  std::fflush(stdout);

  tzbench::ScratchFiles files;
  tzbench::HostBuffer pool;
  if (needs_file(f, setup)) {
    ctx.progress.show("creating {} x {} and {} of request buffers", setup.dirs.size(),
                      tz::format_bytes(setup.file_bytes), tz::format_bytes(pool_size));
    TZ_ASSIGN_OR_RETURN(files, tzbench::ScratchFiles::create(setup.dirs, setup.file_bytes, "file"));
    TZ_ASSIGN_OR_RETURN(pool, tzbench::HostBuffer::map(pool_size, f.hugepages));
    pool.fill_random(1);
    ctx.files = &files;
    ctx.pool = &pool;
  }
  nlohmann::json out = {{"benchmark", "tierzero-nvme-bench"}, {"build", tzbench::build_summary()},
                        {"machine", machine_json()}, {"paths", paths}, {"config", flags_json(f, setup)},
                        {"page_cache", f.buffered ? ctx.cache.note() : "O_DIRECT"}};
  TZ_TRY(run_modes(f, ctx, out));
  ctx.progress.done();
  nlohmann::json targets = nlohmann::json::array();
  collect_targets(out, targets);
  out["targets"] = targets;
  if (!f.json_path.empty()) TZ_TRY(write_json(f.json_path, out));
  return tz::ok_status();
}

void add_flags(CLI::App& app, Flags& f) {
  app.add_option("--path", f.paths, "directory for a scratch file; repeat to stripe over several (default /var/tmp)");
  app.add_option("--size", f.size, "benchmark file size, total over the paths (4GiB; bare K/M/G are binary)")
      ->capture_default_str();
  app.add_option("--block-size", f.block_size, "block size: largest I/O piece, stripe unit")->capture_default_str();
  app.add_option("--queue-depth", f.queue_depth, "pieces in flight per ring")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--rings", f.rings, "rings, each with a thread (DeepSpeed's intra_op_parallelism); fio numjobs")
      ->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--inflight", f.inflight, "requests kept in flight (0: queue_depth * rings / paths)")
      ->check(CLI::Range(0, 1 << 16))->capture_default_str();
  app.add_flag("--buffered", f.buffered, "buffered I/O instead of O_DIRECT");
  app.add_flag("!--no-fixed-buffers", f.fixed_buffers, "do not register the buffers with io_uring");
  app.add_flag("!--no-fixed-files", f.fixed_files, "do not register the files with io_uring");
  app.add_flag("--single-submit", f.single_submit, "one io_uring_enter per piece (aio.single_submit)");
  app.add_flag("--sqpoll", f.sqpoll, "IORING_SETUP_SQPOLL");
  app.add_flag("!--no-hugepages", f.hugepages,
               "do not madvise(MADV_HUGEPAGE) the buffers (nor run fio with glibc.malloc.hugetlb=1)");
  app.add_option("--backend", f.backend, "auto, io_uring or threads")->capture_default_str();
  app.add_option("--ops", f.ops, "workloads: write, read, randwrite, randread, swap")->capture_default_str();
  app.add_option("--repeats", f.repeats, "runs per workload (plain mode)")->check(CLI::Range(1, 1000))->capture_default_str();
  auto* runtime = app.add_option("--runtime", f.runtime_s, "seconds per run instead of once through the file")
                      ->check(CLI::Range(0.0, 86400.0));
  app.add_option("--io-bytes", f.io_bytes, "bytes per run instead of once through the file")->excludes(runtime);
  app.add_flag("--sweep", f.sweep, "sweep block size x queue depth x rings (with --compare-fio: each side's best)");
  app.add_option("--sweep-blocks", f.sweep_blocks, "sweep block sizes")->capture_default_str();
  app.add_option("--sweep-depths", f.sweep_depths, "sweep queue depths")->capture_default_str();
  app.add_option("--sweep-rings", f.sweep_rings, "sweep rings (fio numjobs)")->capture_default_str();
  app.add_flag("--sweep-single-submit", f.sweep_single_submit, "also sweep single_submit = true");
  app.add_option("--sweep-bytes", f.sweep_bytes, "bytes per sweep point (0: the whole file)")->capture_default_str();
  app.add_option("--max-inflight", f.max_inflight, "sweep points with more bytes in flight are skipped")
      ->capture_default_str();
  app.add_flag("--tune", f.tune, "sweep sequential write and read; print the best aio block as JSON");
  app.add_flag("--swap", f.swap_only, "only the swap store round trip (and its raw twin)");
  app.add_option("--swap-size", f.swap_size, "bytes of tensors for the swap run")->capture_default_str();
  app.add_option("--extent-size", f.extent_size, "bytes per tensor (swap extent)")->capture_default_str();
  app.add_option("--swap-window", f.swap_window, "extents in flight (0: enough for the queue depth)")
      ->check(CLI::Range(0, 4096))->capture_default_str();
  app.add_flag("!--swap-no-checksums", f.swap_checksums, "swap store without checksums (to measure their cost)");
  app.add_flag("--compare-fio", f.compare_fio, "alternate with fio's io_uring engine on the same file");
  app.add_option("--replay", f.replay_path, "replay a fio version 2 I/O log (tierzero-train --io-log writes a training "
                 "step's) through the engine, and with --compare-fio through fio's read_iolog, alternating, on scratch "
                 "files under --path; nothing else runs")->check(CLI::ExistingFile);
  app.add_option("--replay-loops", f.replay_loops, "passes over the log per run (0: enough for 2 GiB)")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--pairs", f.pairs, "ours/fio pairs, and swap rounds")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("--fio", f.fio, "fio executable")->capture_default_str();
  app.add_option("--json", f.json_path, "write the results as JSON to this file")
      ->check(CLI::Validator(tzbench::writable_file, "FILE"));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tierzero-nvme-bench: the NVMe tier's I/O engine and swap store against fio and the raw engine"};
  Flags flags;
  add_flags(app, flags);
  CLI11_PARSE(app, argc, argv);
  tzbench::install_signal_cleanup();
  tz::Status status = run(flags);
  if (!status.ok()) {
    std::fprintf(stderr, "\ntierzero-nvme-bench: %s\n", status.message().c_str());
    return status.code() == tz::ErrorCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
