#include "nvme_bench_replay.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <condition_variable>
#include <mutex>
#include <map>
#include <optional>

namespace tzbench {
namespace {

using tz::nvme::IoLogEntry;

// The log cut into pieces of at most `block` bytes, in order, each naming the
// index of its file (in order of first appearance).
struct Pattern {
  std::vector<std::string> logged_files;   // as the log names them
  std::vector<IoLogEntry> pieces;          // path = the logged file
  std::vector<std::size_t> file_index;     // per piece
  std::uint64_t file_bytes = 0;            // the furthest byte of any file, rounded up to 1 MiB
  std::uint64_t read_bytes = 0, write_bytes = 0;  // one pass
};

tz::Expected<Pattern> cut(const std::vector<IoLogEntry>& log, std::size_t block) {
  Pattern p;
  std::map<std::string, std::size_t> index;
  for (const IoLogEntry& e : log) {
    if (e.offset % 4096 != 0 || e.length % 512 != 0) {
      return tz::invalid_argument("the I/O log's {} of {} bytes at offset {} of {} is not aligned for O_DIRECT "
                                  "(4 KiB offsets, 512 B lengths)", tz::nvme::io_op_name(e.op), e.length, e.offset,
                                  e.path);
    }
    auto [it, fresh] = index.emplace(e.path, p.logged_files.size());
    if (fresh) p.logged_files.push_back(e.path);
    p.file_bytes = std::max(p.file_bytes, e.offset + e.length);
    for (std::uint64_t at = 0; at < e.length; at += block) {
      p.pieces.push_back({e.op, e.path, e.offset + at, std::min<std::uint64_t>(block, e.length - at)});
      p.file_index.push_back(it->second);
    }
    (e.op == tz::nvme::IoOp::kRead ? p.read_bytes : p.write_bytes) += e.length;
  }
  p.file_bytes = tz::align_up(p.file_bytes, std::uint64_t{1} << 20);
  return p;
}

// One replay through a fresh engine: `loops` passes, queue_depth x rings pieces in flight.
tz::Expected<double> replay_ours(const EngineConfig& c, const ScratchFiles& files, const Pattern& p, int loops,
                                 HostBuffer& pool) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::nvme::IoEngine> engine, tz::nvme::IoEngine::create(c.engine_options()));
  std::vector<tz::nvme::FileId> ids;
  for (const std::string& path : files.paths()) {
    TZ_ASSIGN_OR_RETURN(tz::nvme::FileId id, engine->open(path, {.direct = c.direct}));
    ids.push_back(id);
  }
  const std::size_t slots = static_cast<std::size_t>(c.queue_depth) * static_cast<std::size_t>(c.rings);
  std::vector<void*> registered;
  if (c.fixed_buffers) {
    TZ_ASSIGN_OR_RETURN(registered, register_chunks(*engine, pool.data(), slots * c.block_bytes, c.block_bytes));
  }
  // A slot (a block of the pool) is reused as soon as any piece completes,
  // as fio refills its queue, in the log's order of submission.
  std::mutex mu;
  std::condition_variable freed;
  std::vector<std::size_t> free_slots;
  for (std::size_t s = 0; s < slots; ++s) free_slots.push_back(slots - 1 - s);
  tz::Status failed;
  const auto start = Clock::now();
  for (int loop = 0; loop < loops; ++loop) {
    for (std::size_t i = 0; i < p.pieces.size(); ++i) {
      std::size_t slot = 0;
      {
        std::unique_lock<std::mutex> lock(mu);
        freed.wait(lock, [&] { return !free_slots.empty(); });
        if (!failed.ok()) break;
        slot = free_slots.back();
        free_slots.pop_back();
      }
      const IoLogEntry& e = p.pieces[i];
      tz::nvme::IoRequest request{.op = e.op, .buffer = pool.data() + slot * c.block_bytes,
                                  .segments = {{ids[p.file_index[i]], e.offset, e.length}}};
      engine->submit(std::move(request), [&, slot](const tz::Status& s, tz::nvme::IoResult) {
        std::lock_guard<std::mutex> lock(mu);
        if (!s.ok() && failed.ok()) failed = s;
        free_slots.push_back(slot);
        freed.notify_one();
      });
    }
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    freed.wait(lock, [&] { return free_slots.size() == slots; });
  }
  const double seconds = seconds_since(start);
  unregister_chunks(*engine, registered);
  TZ_TRY_CTX(failed, "replaying the I/O log");
  return seconds;
}

// The cut log with the scratch files' paths, `loops` times over, for fio's
// read_iolog (fio's --loops replays a log once).
tz::Status write_fio_log(const std::string& path, const Pattern& p, const ScratchFiles& files, int loops) {
  std::vector<IoLogEntry> out;
  out.reserve(p.pieces.size() * static_cast<std::size_t>(loops));
  for (int loop = 0; loop < loops; ++loop) {
    for (std::size_t i = 0; i < p.pieces.size(); ++i) {
      out.push_back({p.pieces[i].op, files.paths()[p.file_index[i]], p.pieces[i].offset, p.pieces[i].length});
    }
  }
  return tz::nvme::write_fio_iolog(path, out);
}

// Removes a file when the run ends, however it ends (and on SIGINT/SIGTERM).
struct RemovedAtExit {
  std::string path;
  explicit RemovedAtExit(std::string p) : path(std::move(p)) { add_cleanup_path(path); }
  ~RemovedAtExit() {
    if (path.empty()) return;
    std::remove(path.c_str());
    remove_cleanup_path(path);
  }
  RemovedAtExit(const RemovedAtExit&) = delete;
  RemovedAtExit& operator=(const RemovedAtExit&) = delete;
};

std::vector<std::string> fio_replay_args(const std::string& fio, const EngineConfig& c, const std::string& log,
                                         bool hugepages, const std::string& output) {
  std::vector<std::string> a = {fio,
                                "--name=tierzero-replay",
                                "--ioengine=io_uring",
                                fmt::format("--direct={}", c.direct ? 1 : 0),
                                "--read_iolog=" + log,
                                "--replay_no_stall=1",
                                fmt::format("--bs={}", c.block_bytes),
                                fmt::format("--iodepth={}", c.queue_depth * c.rings),
                                "--hipri=0",
                                "--output-format=json",
                                "--output=" + output};
  if (hugepages) a.push_back("--iomem_align=2m");
  if (c.fixed_buffers) a.push_back("--fixedbufs=1");
  // fio's registerfiles needs nr_files == open_files, which a read_iolog job
  // cannot state: fio opens the log's files unregistered.
  if (c.sqpoll) a.push_back("--sqthread_poll=1");
  return a;
}

// The directory of each of the log's files (round-robin over --path), each
// directory checked for room for the files it gets.
tz::Expected<std::vector<std::string>> scratch_dirs(const Setup& s, const Pattern& p) {
  std::vector<std::string> dirs;
  for (std::size_t i = 0; i < p.logged_files.size(); ++i) dirs.push_back(s.dirs[i % s.dirs.size()]);
  for (const std::string& dir : s.dirs) {
    const auto here = static_cast<std::uint64_t>(std::count(dirs.begin(), dirs.end(), dir));
    TZ_TRY(check_free_space(dir, here * p.file_bytes, "the replay's scratch files"));
  }
  return dirs;
}

// Every byte written once, so the replay's reads reach the device.
tz::Status fill_scratch_files(const EngineConfig& c, const ScratchFiles& files, std::uint64_t file_bytes,
                              HostBuffer& pool) {
  Pattern fill;
  for (std::size_t f = 0; f < files.paths().size(); ++f) {
    for (std::uint64_t at = 0; at < file_bytes; at += c.block_bytes) {
      fill.pieces.push_back({tz::nvme::IoOp::kWrite, "", at, std::min<std::uint64_t>(c.block_bytes, file_bytes - at)});
      fill.file_index.push_back(f);
    }
  }
  TZ_TRY_CTX(replay_ours(c, files, fill, 1, pool).status(), "writing the replay's scratch files");
  return tz::ok_status();
}

// What one replay run is: the pattern, its files and buffers, the passes a run makes.
struct Replay {
  const EngineConfig& config;
  const Pattern& pattern;
  const ScratchFiles& files;
  HostBuffer& pool;
  int loops = 0;
  double run_bytes = 0;              // the log's bytes x loops
  std::string fio_log_path;          // "": no fio comparison
};

// The ours/fio pairs: each pair one run of ours, then (with --compare-fio) one of fio's.
struct Pairs {
  nlohmann::json rows = nlohmann::json::array();
  std::vector<double> ours_gbps, fio_gbps, ratios;
};

// fio's time for the run; its rate as the log's bytes over that time (its
// io_bytes is kept beside: fio's count of a replay can differ).
tz::Status fio_side(const Setup& s, const Replay& r, Pairs& out, nlohmann::json& row) {
  TZ_ASSIGN_OR_RETURN(FioResult f, run_fio_with([&](const std::string& output) {
    return fio_replay_args(s.fio, r.config, r.fio_log_path, s.hugepages, output);
  }, s.hugepages));
  const double fio_s = f.aggregate_gbps > 0 ? static_cast<double>(f.io_bytes) / (f.aggregate_gbps * 1e9) : 0;
  const double g = fio_s > 0 ? r.run_bytes / fio_s / 1e9 : 0;
  out.fio_gbps.push_back(g);
  out.ratios.push_back(g > 0 ? out.ours_gbps.back() / g : 0);
  row.update({{"fio_seconds", fio_s}, {"fio_gbps", g}, {"fio_reported_io_bytes", f.io_bytes},
              {"fio_reported_gbps", f.aggregate_gbps}, {"ours_over_fio", out.ratios.back()},
              {"fio_command", f.command}});
  return tz::ok_status();
}

tz::Expected<Pairs> measure_pairs(Context& ctx, const Replay& r) {
  const Setup& s = ctx.setup;
  Pairs out;
  for (int pair = 0; pair < s.pairs; ++pair) {
    ctx.progress.show("replay: pair {}/{}", pair + 1, s.pairs);
    TZ_ASSIGN_OR_RETURN(double ours_s, replay_ours(r.config, r.files, r.pattern, r.loops, r.pool));
    nlohmann::json row = {{"ours_seconds", ours_s}, {"ours_gbps", r.run_bytes / ours_s / 1e9}};
    out.ours_gbps.push_back(r.run_bytes / ours_s / 1e9);
    if (!r.fio_log_path.empty()) TZ_TRY(fio_side(s, r, out, row));
    out.rows.push_back(row);
  }
  ctx.progress.done();
  return out;
}

void print_replay_table(const Pairs& pairs, bool compare_fio) {
  std::printf("%-8s %10s %10s %10s\n", "replay", "ours GB/s", "fio GB/s", "ours/fio");
  std::printf("%-8s %10.3f %10s %10s\n", "median", median(pairs.ours_gbps),
              compare_fio ? fmt::format("{:.3f}", median(pairs.fio_gbps)).c_str() : "-",
              compare_fio ? fmt::format("{:.3f}", median(pairs.ratios)).c_str() : "-");
  std::printf("GB/s = the log's bytes x passes over each run's time; ours/fio = median of the per-pair ratios\n");
}

}  // namespace

tz::Expected<nlohmann::json> run_replay(Context& ctx, const std::string& log_path, int loops, bool compare_fio) {
  const Setup& s = ctx.setup;
  const EngineConfig& c = s.base;
  TZ_ASSIGN_OR_RETURN(std::vector<IoLogEntry> log, tz::nvme::read_fio_iolog(log_path));
  TZ_ASSIGN_OR_RETURN(Pattern p, cut(log, c.block_bytes));
  TZ_ASSIGN_OR_RETURN(std::vector<std::string> dirs, scratch_dirs(s, p));
  ctx.progress.show("replay: {} file(s) of {}", dirs.size(), tz::format_bytes(p.file_bytes));
  TZ_ASSIGN_OR_RETURN(ScratchFiles files, ScratchFiles::create(dirs, p.file_bytes, "replay"));
  const std::size_t slots = static_cast<std::size_t>(c.queue_depth) * static_cast<std::size_t>(c.rings);
  TZ_ASSIGN_OR_RETURN(HostBuffer pool, HostBuffer::map(std::max(slots, std::size_t{8}) * c.block_bytes, s.hugepages));
  pool.fill_random(7);
  TZ_TRY(fill_scratch_files(c, files, p.file_bytes, pool));
  const double pass_bytes = static_cast<double>(p.read_bytes + p.write_bytes);
  if (loops <= 0) loops = static_cast<int>(std::max(1.0, std::ceil(static_cast<double>(std::uint64_t{2} << 30) / pass_bytes)));
  const Replay replay{.config = c, .pattern = p, .files = files, .pool = pool, .loops = loops,
                      .run_bytes = pass_bytes * loops,
                      .fio_log_path = compare_fio ? files.paths().front() + ".iolog" : ""};
  std::optional<RemovedAtExit> fio_log;
  if (compare_fio) {
    fio_log.emplace(replay.fio_log_path);
    TZ_TRY(write_fio_log(replay.fio_log_path, p, files, loops));
  }
  std::printf("\nreplay of %s: %zu requests (%s read, %s written a pass) in %zu file(s), cut into %zu pieces of at "
              "most %s; %d pass(es) a run; ours %s with %zu pieces in flight%s\n",
              log_path.c_str(), log.size(), tz::format_bytes(p.read_bytes).c_str(),
              tz::format_bytes(p.write_bytes).c_str(), p.logged_files.size(), p.pieces.size(),
              tz::format_bytes(c.block_bytes).c_str(), loops, c.label().c_str(), slots,
              compare_fio ? "; fio read_iolog, iodepth the same, alternating" : "");
  TZ_ASSIGN_OR_RETURN(Pairs pairs, measure_pairs(ctx, replay));
  print_replay_table(pairs, compare_fio);
  return nlohmann::json{{"log", log_path},
                        {"requests", log.size()},
                        {"pieces", p.pieces.size()},
                        {"read_bytes_per_pass", p.read_bytes},
                        {"write_bytes_per_pass", p.write_bytes},
                        {"passes_per_run", loops},
                        {"config", config_json(c)},
                        {"pieces_in_flight", slots},
                        {"pairs", pairs.rows},
                        {"ours_gbps_median", median(pairs.ours_gbps)},
                        {"fio_gbps_median", compare_fio ? nlohmann::json(median(pairs.fio_gbps)) : nlohmann::json(nullptr)},
                        {"ours_over_fio_median", compare_fio ? nlohmann::json(median(pairs.ratios)) : nlohmann::json(nullptr)}};
}

}  // namespace tzbench
