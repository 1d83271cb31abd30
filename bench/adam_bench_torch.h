// tierzero-adam-bench's torch side: torch.optim.AdamW (fused=True, the
// default, and the whole mixed-precision step as a torch user writes it),
// timed by a Python script in a child process on the same sizes and thread
// counts as the kernels.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "adam_bench.h"

namespace tzbench::adam {

struct TorchMedians {  // of one (size, threads); 0 where not measured
  double fused = 0, dflt = 0, whole = 0;
};
using TorchMedianMap = std::map<std::pair<std::size_t, int>, TorchMedians>;  // (n, threads)

// What torch's runs gave, every size's together.
struct TorchRuns {
  nlohmann::json info = nullptr;                  // {"version": ...} once the script printed it
  nlohmann::json runs = nlohmann::json::array();  // the script's lines, each with its size; or why a size has none
  TorchMedianMap medians;
};

// "" when `python -c "import torch"` works, else why not.
std::string torch_unavailable_reason(const std::string& python);

// Times torch on `n` parameters at each of `threads`, `repeats` times after a
// warm-up, adding to `out`. A size that does not fit MemAvailable, or whose
// script fails, is recorded in out.runs with the reason; only failing to read
// the host's memory is an error.
tz::Status time_torch(const std::string& python, std::size_t n, const std::vector<int>& threads, int repeats,
                      Progress& progress, TorchRuns& out);

}  // namespace tzbench::adam
