// The raw engine runs of tierzero-nvme-bench: one IoEngine configuration
// reading or writing the scratch files, sequentially or at random, with a fixed
// number of requests kept in flight.
//
// Layout: the benchmark file is striped over its scratch files (one per
// --path) with a stripe unit of the block size. Row r is the block at offset
// r * block_size of every file; one request moves one row, one segment per
// file, so the engine makes one piece per file. A run walks the rows in order
// (sequential) or in a random permutation (random: every block once, as fio's
// random map does), once through the file, or for a byte count, or for a time.
//
// Keeping the device busy: `inflight` requests (default queue_depth * rings /
// paths, so the engine has queue_depth pieces per ring) are submitted at the
// start; each completion callback (on a ring's thread) checks the result and
// submits the slot's next request. Latency is submit to callback, per request.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "nvme_bench_common.h"

namespace tzbench {

enum class Workload : std::uint8_t { kWrite, kRead, kRandWrite, kRandRead };

// fio's rw names: "write", "read", "randwrite", "randread".
std::string_view workload_name(Workload w);
tz::Expected<Workload> parse_workload(std::string_view name);
inline tz::nvme::IoOp workload_op(Workload w) {
  return w == Workload::kRead || w == Workload::kRandRead ? tz::nvme::IoOp::kRead : tz::nvme::IoOp::kWrite;
}
inline bool workload_random(Workload w) { return w == Workload::kRandRead || w == Workload::kRandWrite; }

// One engine configuration (the aio block, plus what the bench may vary).
struct EngineConfig {
  std::size_t block_bytes = std::size_t{1} << 20;
  int queue_depth = 32;
  int rings = 1;
  bool single_submit = false;
  bool sqpoll = false;
  bool fixed_buffers = true;
  bool fixed_files = true;
  bool direct = true;
  tz::nvme::IoBackend backend = tz::nvme::IoBackend::kAuto;
  int inflight = 0;  // requests kept in flight; 0: ceil(queue_depth * rings / paths)

  tz::nvme::EngineOptions engine_options() const;
  int inflight_requests(std::size_t paths) const;
  // "1 MiB qd32 x2".
  std::string label() const;
};

// How much one run moves: once through the file (both 0), `io_bytes`, or for
// `runtime_s` seconds (wrapping around the file).
struct RunLimits {
  std::uint64_t io_bytes = 0;
  double runtime_s = 0;
};

struct RunResult {
  double seconds = 0;
  std::uint64_t bytes = 0;
  std::uint64_t requests = 0;
  std::uint64_t ios = 0;               // pieces of block size (one per file per request)
  double latency_sum_s = 0;            // over requests, submit to completion
  std::uint64_t fixed_buffer_ios = 0;  // of ios, through registered buffers

  double gbps() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
  double iops() const { return seconds > 0 ? static_cast<double>(ios) / seconds : 0; }
  double mean_latency_us() const { return requests > 0 ? latency_sum_s / static_cast<double>(requests) * 1e6 : 0; }
};

// One engine with the scratch files open and its slice of the buffer pool
// registered. Runs one workload at a time from the calling thread.
class RawBench {
 public:
  // `pool` must hold at least pool_bytes(config, files) bytes (random data for
  // writes) and outlive the bench.
  static tz::Expected<std::unique_ptr<RawBench>> create(const EngineConfig& config, const ScratchFiles& files,
                                                        HostBuffer& pool);
  static std::size_t pool_bytes(const EngineConfig& config, std::size_t paths);
  ~RawBench();
  RawBench(const RawBench&) = delete;
  RawBench& operator=(const RawBench&) = delete;

  tz::Expected<RunResult> run(Workload workload, const RunLimits& limits, Progress& progress,
                              const std::string& label);
  // The engine as it runs ("io_uring, 2 rings x depth 32, 1.00 MiB blocks, fixed buffers, fixed files").
  std::string describe() const { return engine_->describe(); }
  tz::nvme::IoBackend backend() const { return engine_->backend(); }

 private:
  RawBench() = default;
  tz::Status sync_files() const;

  EngineConfig config_;
  const ScratchFiles* files_ = nullptr;
  HostBuffer* pool_ = nullptr;
  std::unique_ptr<tz::nvme::IoEngine> engine_;
  std::vector<tz::nvme::FileId> ids_;
  std::vector<void*> registered_;
  std::uint64_t rows_ = 0;
  std::vector<std::uint64_t> permutation_;  // random rows, made on first use
};

}  // namespace tzbench
