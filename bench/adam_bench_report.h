// tierzero-adam-bench's report: the tables (stdout) and the JSON (--json) of
// a run's measurements, with issue #4's targets.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "adam_bench.h"
#include "adam_bench_conversions.h"
#include "adam_bench_copies.h"
#include "adam_bench_torch.h"

namespace tzbench::adam {

// Everything a run measured.
struct Results {
  std::vector<std::size_t> sizes;
  std::vector<int> threads;  // as the optimizers resolved --threads, each once, in order
  std::vector<Row> rows;
  std::vector<WholeRow> whole_rows;     // empty with --no-whole-step
  std::vector<LayoutRow> layout_rows;   // empty unless --layouts names more than separate
  std::vector<ConversionRow> conversion_rows;  // one per size
  std::vector<CopyRow> copy_rows;              // one per size and thread count
  TorchRuns torch;
  std::string torch_reason;  // why torch was not timed; "" when it was
};

// Prints every table and the targets, then writes --json if given.
tz::Status report(const Flags& flags, const Machine& machine, const Results& results);

}  // namespace tzbench::adam
