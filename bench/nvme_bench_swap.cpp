#include "nvme_bench_swap.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>

namespace tzbench {
namespace {

constexpr std::size_t kStampStride = 4096;

// Keeps up to `size` operations in flight; acquire() blocks while full.
class Window {
 public:
  explicit Window(int size) : size_(size) {}

  // Waits for a free place; false once an operation has failed.
  bool acquire() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return in_flight_ < size_ || !error_.ok(); });
    if (!error_.ok()) return false;
    ++in_flight_;
    return true;
  }
  void release(const tz::Status& status, Clock::time_point issued) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - issued).count();
    std::lock_guard<std::mutex> lock(mu_);
    latency_ns_ += static_cast<std::uint64_t>(ns);
    if (!status.ok() && error_.ok()) error_ = status;
    --in_flight_;
    cv_.notify_all();
  }
  // Waits for every operation; the first error.
  tz::Status drain(double* latency_sum_s) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return in_flight_ == 0; });
    *latency_sum_s = static_cast<double>(latency_ns_) * 1e-9;
    return error_;
  }

 private:
  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int in_flight_ = 0;             // guarded by mu_
  std::uint64_t latency_ns_ = 0;  // guarded by mu_
  tz::Status error_;              // guarded by mu_
};

// submit(k, done) starts extent k's operation; done must be called once.
using SubmitExtent = std::function<void(std::uint64_t extent, tz::nvme::IoCallback done)>;

struct Pass {
  std::uint64_t extents = 0;
  std::size_t extent_bytes = 0;
  std::size_t ios_per_extent = 0;
  int window = 1;
};

tz::Expected<RunResult> run_pass(const Pass& pass, const SubmitExtent& submit) {
  Window window(pass.window);
  const Clock::time_point start = Clock::now();
  for (std::uint64_t k = 0; k < pass.extents; ++k) {
    if (!window.acquire()) break;
    const Clock::time_point issued = Clock::now();
    submit(k, [&window, issued](const tz::Status& s, const tz::nvme::IoResult&) { window.release(s, issued); });
  }
  RunResult r;
  TZ_TRY(window.drain(&r.latency_sum_s));
  r.seconds = seconds_since(start);
  r.requests = pass.extents;
  r.bytes = pass.extents * pass.extent_bytes;
  r.ios = pass.extents * pass.ios_per_extent;
  return r;
}

// The raw twin's segments for extent k: stripe units of `unit` round-robin over
// the files, each file holding its share of the extent contiguously at
// k * share (the swap store's layout, without its rotating first file).
std::vector<tz::nvme::Segment> raw_segments(const std::vector<tz::nvme::FileId>& files, std::uint64_t k,
                                            std::size_t extent_bytes, std::size_t unit) {
  const std::size_t share = extent_bytes / files.size();
  std::vector<tz::nvme::Segment> out;
  for (std::size_t u = 0; u * unit < extent_bytes; ++u) {
    const tz::nvme::Segment seg{files[u % files.size()], k * share + (u / files.size()) * unit, unit};
    if (!out.empty() && out.back().file == seg.file && out.back().offset + out.back().length == seg.offset) {
      out.back().length += unit;  // one path: the extent is one run of the file, as in the swap store
    } else {
      out.push_back(seg);
    }
  }
  return out;
}

tz::Status verify(const char* expect, const char* got, std::uint64_t extents, std::size_t extent_bytes,
                  const char* side) {
  for (std::uint64_t k = 0; k < extents; ++k) {
    const char* e = expect + k * extent_bytes;
    const char* g = got + k * extent_bytes;
    if (std::memcmp(e, g, extent_bytes) == 0) continue;
    std::size_t at = 0;
    while (e[at] == g[at]) ++at;
    return tz::data_corruption("{} read of extent {}: byte {} differs from what was written (wrote {:#04x}, read "
                               "{:#04x})",
                               side, k, at, static_cast<unsigned char>(e[at]), static_cast<unsigned char>(g[at]));
  }
  return tz::ok_status();
}

void stamp_round(HostBuffer& source, std::uint64_t round) {
  for (std::size_t at = 0; at + sizeof(round) <= source.size_bytes(); at += kStampStride) {
    std::memcpy(source.data() + at, &round, sizeof(round));
  }
}

// Everything one swap benchmark holds, destroyed in reverse order.
struct SwapSetup {
  std::shared_ptr<tz::nvme::IoEngine> engine;
  ScratchFiles raw_files;
  std::vector<tz::nvme::FileId> raw_ids;
  std::unique_ptr<tz::nvme::SwapStore> store;
  std::vector<tz::nvme::ExtentId> extents;
  std::vector<std::vector<tz::nvme::Segment>> segments;  // raw twin, per extent
  HostBuffer source, dest;                               // (extents * extent_bytes,) each
  std::vector<void*> registered;

  ~SwapSetup() {
    if (!engine) return;
    unregister_chunks(*engine, registered);
    if (store) {
      for (const std::string& p : store->file_paths()) remove_cleanup_path(p);
    }
    store.reset();
    for (tz::nvme::FileId id : raw_ids) engine->close(id).ignore_error();  // nothing in flight by now
  }
};

tz::Status open_setup(SwapSetup& s, const EngineConfig& config, const std::vector<std::string>& dirs,
                      const SwapSpec& spec, std::uint64_t extents) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<tz::nvme::IoEngine> engine, tz::nvme::IoEngine::create(config.engine_options()));
  s.engine = std::move(engine);
  const std::uint64_t bytes = extents * spec.extent_bytes;
  TZ_ASSIGN_OR_RETURN(s.raw_files, ScratchFiles::create(dirs, bytes / dirs.size(), "swapraw"));
  for (const std::string& path : s.raw_files.paths()) {
    // As the swap store does: O_DIRECT where the path really has it.
    TZ_ASSIGN_OR_RETURN(tz::nvme::FileId id, s.engine->open(path, {.direct = true, .allow_buffered = true}));
    s.raw_ids.push_back(id);
  }
  tz::nvme::SwapOptions options{
      .paths = dirs, .capacity_bytes = bytes, .checksums = spec.checksums, .allow_buffered = true};
  TZ_ASSIGN_OR_RETURN(s.store, tz::nvme::SwapStore::create(options, s.engine));
  for (const std::string& p : s.store->file_paths()) add_cleanup_path(p);
  for (std::uint64_t k = 0; k < extents; ++k) {
    TZ_ASSIGN_OR_RETURN(tz::nvme::ExtentId id, s.store->allocate(spec.extent_bytes));
    s.extents.push_back(id);
    s.segments.push_back(raw_segments(s.raw_ids, k, spec.extent_bytes, config.block_bytes));
  }
  TZ_ASSIGN_OR_RETURN(s.source, HostBuffer::map(bytes, spec.hugepages));
  TZ_ASSIGN_OR_RETURN(s.dest, HostBuffer::map(bytes, spec.hugepages));
  s.source.fill_random(0x5eed);
  if (config.fixed_buffers) {
    TZ_ASSIGN_OR_RETURN(s.registered, register_chunks(*s.engine, s.source.data(), bytes, spec.extent_bytes));
    TZ_ASSIGN_OR_RETURN(auto more, register_chunks(*s.engine, s.dest.data(), bytes, spec.extent_bytes));
    s.registered.insert(s.registered.end(), more.begin(), more.end());
  }
  return tz::ok_status();
}

enum class Side : std::uint8_t { kRaw, kSwap };

tz::Expected<RunResult> timed(SwapSetup& s, Side side, tz::nvme::IoOp op, const Pass& pass, const PageCache& cache) {
  const std::size_t e = pass.extent_bytes;
  const bool write = op == tz::nvme::IoOp::kWrite;
  char* buffer = write ? s.source.data() : s.dest.data();
  if (!write) std::memset(s.dest.data(), 0, s.dest.size_bytes());
  cache.drop();
  SubmitExtent submit;
  if (side == Side::kRaw) {
    submit = [&](std::uint64_t k, tz::nvme::IoCallback done) {
      s.engine->submit({.op = op, .buffer = buffer + k * e, .segments = s.segments[k]}, std::move(done));
    };
  } else if (write) {
    submit = [&](std::uint64_t k, tz::nvme::IoCallback done) { s.store->write(s.extents[k], buffer + k * e, std::move(done)); };
  } else {
    submit = [&](std::uint64_t k, tz::nvme::IoCallback done) { s.store->read(s.extents[k], buffer + k * e, std::move(done)); };
  }
  const char* name = side == Side::kRaw ? "raw" : "swap";
  TZ_ASSIGN_OR_RETURN(RunResult r, run_pass(pass, submit));
  if (!write) TZ_TRY(verify(s.source.data(), s.dest.data(), pass.extents, e, name));
  return r;
}

tz::Expected<SwapRound> run_round(SwapSetup& s, const Pass& pass, const PageCache& cache, Progress& progress,
                                  const std::string& where) {
  SwapRound round;
  progress.show("{}: raw write", where);
  TZ_ASSIGN_OR_RETURN(round.raw_write, timed(s, Side::kRaw, tz::nvme::IoOp::kWrite, pass, cache));
  progress.show("{}: raw read", where);
  TZ_ASSIGN_OR_RETURN(round.raw_read, timed(s, Side::kRaw, tz::nvme::IoOp::kRead, pass, cache));
  progress.show("{}: swap write", where);
  TZ_ASSIGN_OR_RETURN(round.swap_write, timed(s, Side::kSwap, tz::nvme::IoOp::kWrite, pass, cache));
  progress.show("{}: swap read", where);
  TZ_ASSIGN_OR_RETURN(round.swap_read, timed(s, Side::kSwap, tz::nvme::IoOp::kRead, pass, cache));
  return round;
}

}  // namespace

int swap_window(const EngineConfig& config, const SwapSpec& spec) {
  if (spec.window > 0) return spec.window;
  const std::size_t pieces_bytes =
      static_cast<std::size_t>(config.queue_depth) * static_cast<std::size_t>(config.rings) * config.block_bytes;
  return static_cast<int>(std::max<std::size_t>(2, (pieces_bytes + spec.extent_bytes - 1) / spec.extent_bytes + 1));
}

tz::Expected<SwapReport> run_swap_bench(const EngineConfig& config, const std::vector<std::string>& dirs,
                                        const SwapSpec& spec, const PageCache& cache, Progress& progress) {
  const std::size_t stripe_set = config.block_bytes * dirs.size();
  if (spec.extent_bytes == 0 || spec.extent_bytes % stripe_set != 0) {
    return tz::invalid_argument("--extent-size {}: must be a multiple of the block size times the paths ({})",
                                tz::format_bytes(spec.extent_bytes), tz::format_bytes(stripe_set));
  }
  const std::uint64_t extents = spec.total_bytes / spec.extent_bytes;
  if (extents == 0) {
    return tz::invalid_argument("--swap-size {} is smaller than one extent ({})", tz::format_bytes(spec.total_bytes),
                                tz::format_bytes(spec.extent_bytes));
  }
  SwapSetup s;
  progress.show("swap: creating the store and filling {} of tensors", tz::format_bytes(extents * spec.extent_bytes));
  TZ_TRY(open_setup(s, config, dirs, spec, extents));
  const Pass pass{.extents = extents,
                  .extent_bytes = spec.extent_bytes,
                  .ios_per_extent = spec.extent_bytes / config.block_bytes,
                  .window = swap_window(config, spec)};
  SwapReport report{.engine = s.engine->describe(), .extents = extents, .extent_bytes = spec.extent_bytes,
                    .window = pass.window, .checksums = spec.checksums};
  for (int r = 0; r <= spec.rounds; ++r) {  // round 0: the warm-up
    stamp_round(s.source, static_cast<std::uint64_t>(r) + 1);
    const std::string where = r == 0 ? "swap warm-up" : fmt::format("swap round {}/{}", r, spec.rounds);
    TZ_ASSIGN_OR_RETURN(SwapRound round, run_round(s, pass, cache, progress, where));
    report.verified_bytes += 2 * extents * spec.extent_bytes;
    if (r > 0) report.rounds.push_back(round);
  }
  report.stats = s.store->stats();
  return report;
}

}  // namespace tzbench
