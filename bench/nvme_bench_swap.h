// The swap store end to end, against the raw engine on the same bytes.
//
// One engine serves both sides. The swap side writes `total_bytes` of tensors
// (extents of `extent_bytes`) through a SwapStore with checksums and reads
// them back; the raw side writes the same source buffer, extent by extent, to
// a plain scratch file striped the same way and reads it back, no checksums.
// Both keep `window` extents in flight, both read into the same destination,
// which is cleared before each read and compared byte for byte with the
// source after it (outside the timing). Each round stamps the round number
// into every 4 KiB of the source, so a read that returns the previous round's
// data fails the comparison.
//
// Rounds alternate the sides: raw write, raw read, swap write, swap read; the
// first round is a warm-up (it turns the files' fallocated extents into
// written ones) and is not counted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "nvme_bench_raw.h"

namespace tzbench {

struct SwapSpec {
  std::uint64_t total_bytes = std::uint64_t{2} << 30;
  std::size_t extent_bytes = std::size_t{64} << 20;
  int window = 0;  // extents in flight; 0: enough for queue_depth * rings pieces, plus one
  int rounds = 5;  // counted rounds, after the warm-up
  bool hugepages = true;  // source and destination madvised (Note [Huge pages])
  bool checksums = true;  // false only to measure what the checksums cost
};

struct SwapRound {
  RunResult raw_write, raw_read, swap_write, swap_read;
};

struct SwapReport {
  std::vector<SwapRound> rounds;
  std::string engine;          // IoEngine::describe()
  std::uint64_t extents = 0;
  std::size_t extent_bytes = 0;
  int window = 0;
  std::uint64_t verified_bytes = 0;  // compared byte for byte, every read of every round
  bool checksums = true;
  tz::nvme::SwapStats stats;
};

int swap_window(const EngineConfig& config, const SwapSpec& spec);

tz::Expected<SwapReport> run_swap_bench(const EngineConfig& config, const std::vector<std::string>& dirs,
                                        const SwapSpec& spec, const PageCache& cache, Progress& progress);

}  // namespace tzbench
