#include "nvme_bench_raw.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <random>

namespace tzbench {

namespace {
constexpr std::array<std::pair<Workload, std::string_view>, 4> kWorkloadNames = {
    {{Workload::kWrite, "write"}, {Workload::kRead, "read"}, {Workload::kRandWrite, "randwrite"},
     {Workload::kRandRead, "randread"}}};
constexpr auto kProgressEvery = std::chrono::milliseconds(500);
}  // namespace

std::string_view workload_name(Workload w) {
  for (const auto& [workload, name] : kWorkloadNames) {
    if (workload == w) return name;
  }
  return "?";
}

tz::Expected<Workload> parse_workload(std::string_view name) {
  for (const auto& [workload, known] : kWorkloadNames) {
    if (known == name) return workload;
  }
  return tz::invalid_argument("unknown workload '{}' (known: write, read, randwrite, randread, swap)", name);
}

tz::nvme::EngineOptions EngineConfig::engine_options() const {
  return {.block_size_bytes = block_bytes,
          .queue_depth = queue_depth,
          .rings = rings,
          .single_submit = single_submit,
          .sqpoll = sqpoll,
          .fixed_buffers = fixed_buffers,
          .fixed_files = fixed_files,
          .backend = backend};
}

int EngineConfig::inflight_requests(std::size_t paths) const {
  if (inflight > 0) return inflight;
  const std::size_t pieces = static_cast<std::size_t>(queue_depth) * static_cast<std::size_t>(rings);
  return static_cast<int>(std::max<std::size_t>(1, (pieces + paths - 1) / paths));
}

std::string EngineConfig::label() const {
  return fmt::format("{} qd{} x{}", tz::format_bytes(block_bytes), queue_depth, rings);
}

// ---------------------------------------------------------------- driver

namespace {

// One run: `slots` requests in flight, each completion submitting the slot's
// next request until the run's work is handed out or a request fails.
class Driver {
 public:
  struct Plan {
    tz::nvme::IoOp op = tz::nvme::IoOp::kRead;
    std::vector<tz::nvme::FileId> files;
    std::uint64_t file_bytes = 0;
    std::size_t block_bytes = 0;
    std::uint64_t rows = 0;
    const std::vector<std::uint64_t>* order = nullptr;  // random: row permutation; null: sequential
    std::uint64_t total_requests = 0;                   // 0: until the deadline
    Clock::time_point deadline{};
    char* buffers = nullptr;                            // slots * files * block_bytes
    int slots = 1;
  };

  Driver(tz::nvme::IoEngine& engine, Plan plan) : engine_(engine), plan_(std::move(plan)) {}

  // Submits the first requests and waits for the last; `tick` is called every
  // kProgressEvery with the bytes so far.
  template <typename Tick>
  tz::Expected<RunResult> run(Tick&& tick);

 private:
  void issue(int slot);
  void on_done(int slot, Clock::time_point issued, const tz::Status& status, const tz::nvme::IoResult& result);
  void retire();

  tz::nvme::IoEngine& engine_;
  const Plan plan_;
  std::atomic<std::uint64_t> next_{0};
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> bytes_{0}, requests_{0}, ios_{0}, latency_ns_{0};

  std::mutex mu_;
  std::condition_variable idle_;
  int active_ = 0;            // guarded by mu_
  tz::Status error_;          // guarded by mu_: the first failure
  Clock::time_point end_{};   // guarded by mu_: when the last slot retired
};

template <typename Tick>
tz::Expected<RunResult> Driver::run(Tick&& tick) {
  active_ = plan_.slots;
  const Clock::time_point start = Clock::now();
  for (int s = 0; s < plan_.slots; ++s) issue(s);
  std::unique_lock<std::mutex> lock(mu_);
  while (!idle_.wait_for(lock, kProgressEvery, [&] { return active_ == 0; })) {
    lock.unlock();
    tick(bytes_.load(std::memory_order_relaxed), seconds_since(start));
    lock.lock();
  }
  if (!error_.ok()) return error_;
  RunResult r;
  r.seconds = std::chrono::duration<double>(end_ - start).count();
  r.bytes = bytes_.load();
  r.requests = requests_.load();
  r.ios = ios_.load();
  r.latency_sum_s = static_cast<double>(latency_ns_.load()) * 1e-9;
  return r;
}

void Driver::issue(int slot) {
  const std::uint64_t seq = next_.fetch_add(1, std::memory_order_relaxed);
  const bool out_of_work = plan_.total_requests > 0 ? seq >= plan_.total_requests : Clock::now() >= plan_.deadline;
  if (stop_.load(std::memory_order_relaxed) || out_of_work) {
    retire();
    return;
  }
  const std::uint64_t index = seq % plan_.rows;
  const std::uint64_t row = plan_.order != nullptr ? (*plan_.order)[index] : index;
  const std::uint64_t offset = row * plan_.block_bytes;
  const std::size_t length = static_cast<std::size_t>(std::min<std::uint64_t>(plan_.block_bytes, plan_.file_bytes - offset));
  tz::nvme::IoRequest request{.op = plan_.op,
                              .buffer = plan_.buffers + static_cast<std::size_t>(slot) * plan_.files.size() *
                                                            plan_.block_bytes};
  request.segments.reserve(plan_.files.size());
  for (tz::nvme::FileId f : plan_.files) request.segments.push_back({f, offset, length});
  const Clock::time_point issued = Clock::now();
  engine_.submit(std::move(request), [this, slot, issued](const tz::Status& status, const tz::nvme::IoResult& result) {
    on_done(slot, issued, status, result);
  });
}

void Driver::on_done(int slot, Clock::time_point issued, const tz::Status& status, const tz::nvme::IoResult& result) {
  if (!status.ok()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.ok()) error_ = status;
    }
    stop_.store(true);
    retire();
    return;
  }
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - issued).count();
  latency_ns_.fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
  bytes_.fetch_add(result.bytes, std::memory_order_relaxed);
  requests_.fetch_add(1, std::memory_order_relaxed);
  ios_.fetch_add(plan_.files.size(), std::memory_order_relaxed);
  issue(slot);
}

void Driver::retire() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--active_ == 0) {
    end_ = Clock::now();
    idle_.notify_all();
  }
}

}  // namespace

// ---------------------------------------------------------------- RawBench

std::size_t RawBench::pool_bytes(const EngineConfig& config, std::size_t paths) {
  return static_cast<std::size_t>(config.inflight_requests(paths)) * paths * config.block_bytes;
}

tz::Expected<std::unique_ptr<RawBench>> RawBench::create(const EngineConfig& config, const ScratchFiles& files,
                                                         HostBuffer& pool) {
  const std::size_t paths = files.paths().size();
  if (pool.size_bytes() < pool_bytes(config, paths)) {
    return tz::internal_error("buffer pool of {} is smaller than the {} that {} needs", tz::format_bytes(pool.size_bytes()),
                              tz::format_bytes(pool_bytes(config, paths)), config.label());
  }
  std::unique_ptr<RawBench> bench(new RawBench());
  bench->config_ = config;
  bench->files_ = &files;
  bench->pool_ = &pool;
  TZ_ASSIGN_OR_RETURN(bench->engine_, tz::nvme::IoEngine::create(config.engine_options()));
  for (const std::string& path : files.paths()) {
    tz::nvme::FileOptions options{.direct = config.direct};
    TZ_ASSIGN_OR_RETURN(tz::nvme::FileId id, bench->engine_->open(path, options));
    bench->ids_.push_back(id);
  }
  if (config.fixed_buffers) {
    TZ_ASSIGN_OR_RETURN(bench->registered_, register_chunks(*bench->engine_, pool.data(), pool_bytes(config, paths),
                                                            paths * config.block_bytes));
  }
  bench->rows_ = (files.file_bytes() + config.block_bytes - 1) / config.block_bytes;
  return bench;
}

RawBench::~RawBench() {
  if (!engine_) return;
  unregister_chunks(*engine_, registered_);
  for (tz::nvme::FileId id : ids_) {
    tz::Status s = engine_->close(id);
    if (!s.ok()) TZ_LOG_WARN("bench", "closing a benchmark file: {}", s.message());
  }
}

tz::Status RawBench::sync_files() const {
  for (const std::string& path : files_->paths()) {
    TZ_ASSIGN_OR_RETURN(tz::UniqueFd fd, tz::open_file(path, O_RDONLY));
    TZ_SYSCALL_CHECK(::fdatasync(fd.get()));
  }
  return tz::ok_status();
}

tz::Expected<RunResult> RawBench::run(Workload workload, const RunLimits& limits, Progress& progress,
                                      const std::string& label) {
  if (workload_random(workload) && permutation_.empty()) {
    permutation_.resize(rows_);
    std::iota(permutation_.begin(), permutation_.end(), std::uint64_t{0});
    std::shuffle(permutation_.begin(), permutation_.end(), std::mt19937_64(rows_));
  }
  const std::size_t paths = ids_.size();
  const std::uint64_t row_bytes = config_.block_bytes * paths;
  Driver::Plan plan{.op = workload_op(workload),
                    .files = ids_,
                    .file_bytes = files_->file_bytes(),
                    .block_bytes = config_.block_bytes,
                    .rows = rows_,
                    .order = workload_random(workload) ? &permutation_ : nullptr,
                    .total_requests = limits.runtime_s > 0 ? 0
                                      : limits.io_bytes > 0 ? (limits.io_bytes + row_bytes - 1) / row_bytes
                                                            : rows_,
                    .deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                   std::chrono::duration<double>(limits.runtime_s)),
                    .buffers = pool_->data(),
                    .slots = config_.inflight_requests(paths)};
  const std::uint64_t expect = plan.total_requests * row_bytes;
  const tz::nvme::EngineStats before = engine_->stats();
  Driver driver(*engine_, std::move(plan));
  const Clock::time_point start = Clock::now();
  TZ_ASSIGN_OR_RETURN(RunResult result, driver.run([&](std::uint64_t bytes, double seconds) {
    progress.update("{}: {} of {}, {:.2f} GB/s", label, tz::format_bytes(bytes),
                    expect > 0 ? tz::format_bytes(expect) : fmt::format("{:.0f} s", limits.runtime_s),
                    static_cast<double>(bytes) / seconds / 1e9);
  }));
  if (!config_.direct && workload_op(workload) == tz::nvme::IoOp::kWrite) {
    // Buffered writes count only once the data is on the device.
    TZ_TRY_CTX(sync_files(), "{}: fdatasync after the run", label);
    result.seconds = seconds_since(start);
  }
  result.fixed_buffer_ios = engine_->stats().fixed_buffer_pieces - before.fixed_buffer_pieces;
  return result;
}

}  // namespace tzbench
