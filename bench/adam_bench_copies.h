// tierzero-adam-bench's old-state copies: a step under backward keeps a
// block's fp32 master and moments (12 B an element) before stepping them in
// place, through CpuOptimizer::copy on the optimizer's threads (Note [Stepping
// under backward], engine/src/step_ahead.h). Timed beside one thread's plain
// memcpy of the same bytes, alternating, per thread count.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <vector>

#include "bench_common.h"
#include "tierzero/common.h"
#include "tierzero/cpu_adam.h"

namespace tzbench::adam {

struct CopyRow {
  std::size_t n = 0;  // elements whose three fp32 states are copied (the size, capped: kCopyCap)
  int threads = 0;
  PairedTimes times;  // a: CpuOptimizer::copy, b: one thread's memcpy
};

// Times `repeats` copies (after one warm-up) of min(size, cap) elements' master
// and moments with `opt` and with one memcpy, and checks the bytes arrived.
tz::Status measure_copies(std::size_t size, tz::cpu_adam::CpuOptimizer& opt, int repeats, std::vector<CopyRow>& out);

// The copies table; returns its JSON.
nlohmann::json print_copies(const std::vector<CopyRow>& rows);

}  // namespace tzbench::adam
