// CpuOptimizer: validation, the choice of element loop, and the tiles that
// oneTBB spreads over the arena's threads.
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <mutex>
#include <vector>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/info.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include "dispatch.h"
#include "pinning.h"
#include "validate.h"

namespace tz::cpu_adam {
namespace {

using detail::KernelTable;
using detail::TileStat;

constexpr std::size_t kMinTileElems = 16 * 1024;
constexpr std::size_t kMaxTileElems = 64 * 1024;
constexpr std::size_t kTileQuantum = 64;  // elements: a cache line of fp32, two of bf16 grads
// Tiles start at multiples of 8 elements, so each tie-bit byte of a remainder
// master belongs to one tile (Note [Remainder masters]); create() keeps
// Options::tile_elems a multiple of 16 for the same reason.
static_assert(kTileQuantum % 8 == 0);

std::size_t l2_cache_bytes() {
  const long l2 = ::sysconf(_SC_LEVEL2_CACHE_SIZE);
  return l2 > 0 ? static_cast<std::size_t>(l2) : std::size_t{1} << 20;
}


class CpuOptimizerImpl final : public CpuOptimizer {
 public:
  CpuOptimizerImpl(const KernelTable& table, int threads, std::size_t tile_elems,
                   std::unique_ptr<detail::Pinning> pinning)
      : table_(table), threads_(threads), tile_elems_(tile_elems), l2_bytes_(l2_cache_bytes()),
        pinning_(std::move(pinning)), arena_(threads) {
    if (threads_ > 1 && pinning_->pins()) observer_ = std::make_unique<detail::PinningObserver>(arena_, *pinning_);
  }

  Status step(const Hyper& hyper, const StepArgs& args, const Spans& spans) override;
  Expected<GradStats> accumulate_grad(float* acc, const void* grad, DType grad_dtype, std::size_t n, bool overwrite,
                                      double scale) override;
  Simd simd() const override { return table_.simd; }
  int threads() const override { return threads_; }

 private:
  // Tile size for a pass touching `bytes_per_elem` bytes of distinct arrays
  // per element: half of L2 for a tile's lines, leaving room for its neighbours
  // and the prefetchers; a multiple of 64 elements.
  std::size_t tile_for(std::size_t bytes_per_elem) const {
    if (tile_elems_ != 0) return tile_elems_;
    const std::size_t t = l2_bytes_ / 2 / bytes_per_elem / kTileQuantum * kTileQuantum;
    return std::clamp(t, kMinTileElems, kMaxTileElems);
  }

  // Runs body(begin, end) over [0, n) in tiles. Caller holds mu_.
  template <class Body>
  Status run_tiles(std::size_t n, std::size_t tile, const Body& body);

  const KernelTable& table_;
  const int threads_;
  const std::size_t tile_elems_;  // 0: tile_for() decides
  const std::size_t l2_bytes_;
  std::unique_ptr<detail::Pinning> pinning_;
  tbb::task_arena arena_;
  std::unique_ptr<detail::PinningObserver> observer_;  // destroyed before arena_ and pinning_
  std::mutex mu_;                                      // one call at a time
  std::vector<TileStat> tile_stats_;                   // guarded by mu_; reused across calls
};

template <class Body>
Status CpuOptimizerImpl::run_tiles(std::size_t n, std::size_t tile, const Body& body) {
  const std::size_t tiles = (n + tile - 1) / tile;
  if (tiles == 1 || threads_ == 1) {
    for (std::size_t t = 0; t < tiles; ++t) body(t * tile, std::min(n, (t + 1) * tile));
    return ok_status();
  }
  try {
    arena_.execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<std::size_t>(0, tiles, 1),
          [&](const tbb::blocked_range<std::size_t>& r) {
            for (std::size_t t = r.begin(); t != r.end(); ++t) body(t * tile, std::min(n, (t + 1) * tile));
          },
          tbb::simple_partitioner());
    });
  } catch (const std::exception& e) {
    return internal_error("cpu_adam: running {} tiles on {} threads failed: {}", tiles, threads_, e.what());
  }
  return ok_status();
}

// Note [Weight-decay segments]
// Spans::weight_decay_segments give runs of elements their own weight decay
// (torch parameter groups). The spans' [0, n) is cut into runs: each segment,
// and the gaps between them with Hyper::weight_decay. A run gets the element
// loop and constants a whole step() with its weight decay would get (Adam's
// kind changes with it: kAdamL2, or kAdamW's loop for 0), so its elements get
// the same arithmetic, bit for bit. Tiles are cut over [0, n) as without
// segments (tile starts at multiples of kTileQuantum, so a tie-bit byte of a
// remainder master never has two threads), and each tile calls the kernel once
// per run piece it covers, in order, on its own thread. A run may start at
// any element: the kernels take any begin (a remainder run's part of a
// tie-bit byte goes through the partial path, Note [Tails and unaligned spans]).
Status CpuOptimizerImpl::step(const Hyper& hyper, const StepArgs& args, const Spans& spans) {
  TZ_TRY_CTX(detail::validate_hyper(hyper, args), "cpu_adam {} step", algorithm_name(hyper.algorithm));
  Expected<detail::StepConsts> made = detail::make_consts(hyper, args);
  TZ_TRY_CTX(made, "cpu_adam {} step {}", algorithm_name(hyper.algorithm), args.step);
  TZ_TRY_CTX(detail::validate_segments(spans), "cpu_adam {} step {}", algorithm_name(hyper.algorithm), args.step);
  // Each run's loop and constants, before anything is written.
  struct Run {
    std::size_t begin, end;
    detail::StepFn fn;
    detail::StepConsts consts;
  };
  const bool remainder = spans.master_format == MasterFormat::kRemainder;
  const detail::ParamLayout layout = spans.n == 0 ? detail::ParamLayout::kFp32 : detail::param_layout_of(spans);
  const auto fn_for = [&](const Hyper& h) {
    return table_.step[static_cast<std::size_t>(detail::kind_of(h))][static_cast<std::size_t>(spans.grad_dtype)]
                      [static_cast<std::size_t>(spans.moment_dtype)][static_cast<std::size_t>(layout)];
  };
  std::vector<Run> runs;
  runs.reserve(2 * spans.weight_decay_segments.size() + 1);
  std::size_t covered = 0;
  for (std::size_t k = 0; k < spans.weight_decay_segments.size(); ++k) {
    const WeightDecaySegment& seg = spans.weight_decay_segments[k];
    if (covered < seg.begin) runs.push_back({covered, seg.begin, fn_for(hyper), *made});
    Hyper h = hyper;
    h.weight_decay = seg.weight_decay;
    Expected<detail::StepConsts> c = detail::make_consts(h, args);
    TZ_TRY_CTX(c, "cpu_adam {} step {}: weight_decay_segments[{}] = [{}, {}) with weight_decay = {}",
               algorithm_name(hyper.algorithm), args.step, k, seg.begin, seg.end, seg.weight_decay);
    runs.push_back({seg.begin, seg.end, fn_for(h), *c});
    covered = seg.end;
  }
  if (spans.n == 0) return ok_status();
  if (covered < spans.n) runs.push_back({covered, spans.n, fn_for(hyper), *made});
  TZ_TRY_CTX(detail::validate_spans(hyper, spans), "cpu_adam {} step {}", algorithm_name(hyper.algorithm), args.step);

  const bool adagrad = hyper.algorithm == Algorithm::kAdagrad, lion = hyper.algorithm == Algorithm::kLion;
  const detail::StepPtrs ptrs{remainder ? nullptr : spans.param,
                              spans.grad,
                              adagrad ? nullptr : spans.exp_avg,
                              lion ? nullptr : spans.exp_avg_sq,
                              hyper.amsgrad ? spans.max_exp_avg_sq : nullptr,
                              spans.param16,
                              remainder ? spans.remainder : nullptr,
                              remainder ? spans.tie_bits : nullptr};
  const std::size_t moment = dtype_bytes(spans.moment_dtype);
  // The master's arrays: fp32, or bf16 + remainder + tie bits (1/8 B, counted as 1).
  const std::size_t master = remainder ? 2 + 2 + 1 : 4 + (spans.param16 != nullptr ? 2 : 0);
  const std::size_t bytes = master + dtype_bytes(spans.grad_dtype) + (adagrad ? 0 : moment) + (lion ? 0 : moment) +
                            (hyper.amsgrad ? 4 : 0);
  std::lock_guard<std::mutex> lock(mu_);
  if (runs.size() == 1) {
    const Run& r = runs.front();
    return run_tiles(spans.n, tile_for(bytes),
                     [&](std::size_t begin, std::size_t end) { r.fn(r.consts, ptrs, begin, end); });
  }
  return run_tiles(spans.n, tile_for(bytes), [&](std::size_t begin, std::size_t end) {
    // The first run that ends after begin; runs cover [0, n) in order.
    auto it = std::upper_bound(runs.begin(), runs.end(), begin,
                               [](std::size_t b, const Run& r) { return b < r.end; });
    for (; it != runs.end() && it->begin < end; ++it) {
      it->fn(it->consts, ptrs, std::max(begin, it->begin), std::min(end, it->end));
    }
  });
}

Expected<GradStats> CpuOptimizerImpl::accumulate_grad(float* acc, const void* grad, DType grad_dtype, std::size_t n,
                                                      bool overwrite, double scale) {
  TZ_TRY_CTX(detail::validate_accumulate(acc, grad, grad_dtype, n, scale), "cpu_adam accumulate_grad");
  if (n == 0) return GradStats{};
  const detail::AccFn fn = table_.accumulate[static_cast<std::size_t>(grad_dtype)][overwrite ? 1 : 0];
  const detail::AccPtrs ptrs{acc, grad, static_cast<float>(scale)};
  std::lock_guard<std::mutex> lock(mu_);
  const std::size_t tile = tile_for(4 + dtype_bytes(grad_dtype));
  tile_stats_.assign((n + tile - 1) / tile, TileStat{});
  TZ_TRY(run_tiles(n, tile, [&](std::size_t begin, std::size_t end) { tile_stats_[begin / tile] = fn(ptrs, begin, end); }));
  // In tile order, so the result does not depend on which thread ran what.
  GradStats stats;
  for (const TileStat& t : tile_stats_) {
    stats.sum_squares += t.sum_squares;
    stats.non_finite = stats.non_finite || t.non_finite;
  }
  return stats;
}

}  // namespace

Expected<std::unique_ptr<CpuOptimizer>> CpuOptimizer::create(const Options& options) {
  if (options.threads < 0) return invalid_argument("Options::threads = {} must be >= 0 (0: automatic)", options.threads);
  if (options.tile_elems % 16 != 0) {  // 64 bytes of fp32; also whole tie-bit bytes (Note [Remainder masters])
    return invalid_argument("Options::tile_elems = {} must be a multiple of 16 (0: automatic)", options.tile_elems);
  }
  if (options.numa_node < -1) {
    return invalid_argument("Options::numa_node = {} must be >= -1 (-1: the node of the first CPU)", options.numa_node);
  }
  TZ_ASSIGN_OR_RETURN(const Simd simd, detail::choose_simd(options.simd));
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<detail::Pinning> pinning, detail::Pinning::create(options.numa_node));
  // More threads than TBB runs at once (one per CPU it may use) would only
  // queue: a memory-bound pass gains nothing from oversubscription.
  const int cap = std::max(1, tbb::info::default_concurrency());
  int threads = options.threads > 0 ? options.threads : pinning->cpu_count();
  if (threads > cap) {
    TZ_LOG_DEBUG("cpu_adam", "Options::threads = {} exceeds the {} CPUs this process runs on; using {}", threads, cap,
                 cap);
    threads = cap;
  }
  TZ_LOG_DEBUG("cpu_adam", "optimizer: {} kernels, {} threads, workers {}", simd_name(simd), threads,
               pinning->description());
  return std::unique_ptr<CpuOptimizer>(std::make_unique<CpuOptimizerImpl>(detail::kernel_table(simd), threads,
                                                                          options.tile_elems, std::move(pinning)));
}

}  // namespace tz::cpu_adam
