// CpuOptimizer: validation, the choice of element loop, and the tiles that
// oneTBB spreads over the arena's threads.
#include <unistd.h>

#include <algorithm>
#include <cstring>
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


// One run of elements with its loop and constants (Note [Weight-decay segments]).
struct Run {
  std::size_t begin, end;
  detail::StepFn fn;
  detail::StepConsts consts;
};

// The pointers of `p` moved on by `at` elements (null stays null). With a
// remainder master `at` is a multiple of 8: tie-bit bytes stay whole.
detail::StepPtrs offset_ptrs(const detail::StepPtrs& p, std::size_t at, std::size_t grad_bytes) {
  detail::StepPtrs q = p;
  if (q.param) q.param += at;
  if (q.grad) q.grad = static_cast<const unsigned char*>(q.grad) + at * grad_bytes;
  if (q.max_exp_avg_sq) q.max_exp_avg_sq += at;
  if (q.param16) q.param16 = static_cast<std::uint16_t*>(q.param16) + at;
  if (q.remainder) q.remainder += at;
  if (q.tie_bits) q.tie_bits += at / 8;
  return q;
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
  Expected<GradStats> accumulate_grad(void* acc, DType acc_dtype, const void* grad, DType grad_dtype, std::size_t n,
                                      bool overwrite, double scale) override;
  Status copy(std::span<const CopyJob> jobs) override;
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

  // Note [Int8 moments]: the step over block-decoded moments. Caller holds mu_.
  Status step_int8(const Spans& spans, const detail::StepPtrs& ptrs, const std::vector<Run>& runs, bool uses_m,
                   bool uses_v, std::size_t bytes_per_elem);

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

// Chunks of 1 MiB: large enough that a chunk's memcpy runs at full speed,
// small enough that a 2.4 GB block's copy spreads over every thread.
Status CpuOptimizerImpl::copy(std::span<const CopyJob> jobs) {
  constexpr std::size_t kChunk = std::size_t{1} << 20;
  std::vector<std::size_t> first_chunk(jobs.size() + 1, 0);  // job j's chunks are [first_chunk[j], first_chunk[j + 1])
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    if (jobs[j].bytes != 0 && (jobs[j].dst == nullptr || jobs[j].src == nullptr)) {
      return invalid_argument("cpu_adam copy: job {} of {} bytes has a null pointer", j, jobs[j].bytes);
    }
    first_chunk[j + 1] = first_chunk[j] + (jobs[j].bytes + kChunk - 1) / kChunk;
  }
  const auto body = [&](std::size_t begin, std::size_t end) {
    for (std::size_t c = begin; c < end; ++c) {
      const std::size_t j = static_cast<std::size_t>(
          std::upper_bound(first_chunk.begin(), first_chunk.end(), c) - first_chunk.begin() - 1);
      const std::size_t at = (c - first_chunk[j]) * kChunk;
      std::memcpy(static_cast<char*>(jobs[j].dst) + at, static_cast<const char*>(jobs[j].src) + at,
                  std::min(kChunk, jobs[j].bytes - at));
    }
  };
  std::lock_guard<std::mutex> lock(mu_);
  return run_tiles(first_chunk.back(), 1, body);
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
  const bool remainder = spans.master_format == MasterFormat::kRemainder;
  const detail::ParamLayout layout = spans.n == 0 ? detail::ParamLayout::kFp32 : detail::param_layout_of(spans);
  // Int8 moments step through the fp32-moment loops on decoded blocks.
  const bool int8 = spans.moment_dtype == DType::kUint8;
  const std::size_t moment_index = int8 ? 0 : static_cast<std::size_t>(spans.moment_dtype);
  // Null for a dtype the table has no loop for: validate_spans (below, before
  // any run is used) refuses those by name.
  const std::size_t grad_index = static_cast<std::size_t>(spans.grad_dtype);
  const auto fn_for = [&](const Hyper& h) -> detail::StepFn {
    if (grad_index >= detail::kGradDtypes || moment_index >= detail::kMomentDtypes) return nullptr;
    return table_.step[static_cast<std::size_t>(detail::kind_of(h))][grad_index][moment_index]
                      [static_cast<std::size_t>(layout)];
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
  // Note [Stochastic rounding of bf16 second moments]: the key folds in the
  // tensor, the step and the index's high half; the low half is the base.
  const std::uint32_t sr_key = state_math::sr_step_key(spans.rounding_key, args.step, spans.rounding_index);
  for (Run& r : runs) {
    r.consts.sr_key = sr_key;
    r.consts.sr_base = static_cast<std::uint32_t>(spans.rounding_index);
  }

  const bool adagrad = hyper.algorithm == Algorithm::kAdagrad, lion = hyper.algorithm == Algorithm::kLion;
  const detail::StepPtrs ptrs{remainder ? nullptr : spans.param,
                              spans.grad,
                              adagrad ? nullptr : spans.exp_avg,
                              lion ? nullptr : spans.exp_avg_sq,
                              hyper.amsgrad ? spans.max_exp_avg_sq : nullptr,
                              spans.param16,
                              remainder ? spans.remainder : nullptr,
                              remainder ? spans.tie_bits : nullptr};
  const std::size_t moment = dtype_bytes(spans.moment_dtype);  // int8: 1 (+ 4/256 of scale, not counted)
  // The master's arrays: fp32, or bf16 + remainder + tie bits (1/8 B, counted as 1).
  const std::size_t master = remainder ? 2 + 2 + 1 : 4 + (spans.param16 != nullptr ? 2 : 0);
  const std::size_t bytes = master + dtype_bytes(spans.grad_dtype) + (adagrad ? 0 : moment) + (lion ? 0 : moment) +
                            (hyper.amsgrad ? 4 : 0);
  std::lock_guard<std::mutex> lock(mu_);
  if (int8) return step_int8(spans, ptrs, runs, !adagrad, !lion, bytes);
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

// Note [Int8 block steps]
// Tiles are whole blocks of kInt8Block elements (a tile size rounded up to a
// multiple of 256), so each block's codes and scale belong to one thread. Per
// block the moments are decoded into two fp32 buffers on the stack (2 KiB, in
// L1), the fp32-moment loop of each run the block covers steps them in place
// with the master and gradient where they are, and the buffers are encoded
// back: memory is read and written once, as in the fp32-moment step, and the
// arithmetic of each element is that step's (weight-decay runs inside a block
// included: the block is never split, the runs are).
Status CpuOptimizerImpl::step_int8(const Spans& spans, const detail::StepPtrs& ptrs, const std::vector<Run>& runs,
                                   bool uses_m, bool uses_v, std::size_t bytes_per_elem) {
  constexpr std::size_t kB = detail::kInt8Block;
  const std::size_t tile = (tile_for(bytes_per_elem) + kB - 1) / kB * kB;
  const std::size_t grad_bytes = dtype_bytes(spans.grad_dtype);
  const detail::Int8Code& cm = detail::int8_code_exp_avg();
  const detail::Int8Code& cv = detail::int8_code_exp_avg_sq();
  auto* m_codes = static_cast<std::uint8_t*>(spans.exp_avg);
  auto* v_codes = static_cast<std::uint8_t*>(spans.exp_avg_sq);
  return run_tiles(spans.n, tile, [&](std::size_t begin, std::size_t end) {
    alignas(64) float m[kB];
    alignas(64) float v[kB];
    auto it = std::upper_bound(runs.begin(), runs.end(), begin, [](std::size_t b, const Run& r) { return b < r.end; });
    for (std::size_t b = begin; b < end; b += kB) {
      const std::size_t count = std::min(kB, end - b), block = b / kB;
      if (uses_m) table_.int8_decode(cm, m_codes + b, spans.exp_avg_scale[block], m, count);
      if (uses_v) table_.int8_decode(cv, v_codes + b, spans.exp_avg_sq_scale[block], v, count);
      detail::StepPtrs p = offset_ptrs(ptrs, b, grad_bytes);
      p.exp_avg = uses_m ? m : nullptr;
      p.exp_avg_sq = uses_v ? v : nullptr;
      while (it != runs.end() && it->end <= b) ++it;
      for (auto r = it; r != runs.end() && r->begin < b + count; ++r) {
        r->fn(r->consts, p, std::max(b, r->begin) - b, std::min(b + count, r->end) - b);
      }
      if (uses_m) spans.exp_avg_scale[block] = table_.int8_encode(cm, m, m_codes + b, count);
      if (uses_v) spans.exp_avg_sq_scale[block] = table_.int8_encode(cv, v, v_codes + b, count);
    }
  });
}

Expected<GradStats> CpuOptimizerImpl::accumulate_grad(void* acc, DType acc_dtype, const void* grad, DType grad_dtype,
                                                      std::size_t n, bool overwrite, double scale) {
  TZ_TRY_CTX(detail::validate_accumulate(acc, acc_dtype, grad, grad_dtype, n, scale), "cpu_adam accumulate_grad");
  if (n == 0) return GradStats{};
  const detail::AccFn fn =
      table_.accumulate[static_cast<std::size_t>(acc_dtype)][static_cast<std::size_t>(grad_dtype)][overwrite ? 1 : 0];
  const detail::AccPtrs ptrs{acc, grad, static_cast<float>(scale)};
  std::lock_guard<std::mutex> lock(mu_);
  const std::size_t tile = tile_for(dtype_bytes(acc_dtype) + dtype_bytes(grad_dtype));
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

const detail::Int8Code& int8_code(Int8Moment which) {
  return which == Int8Moment::kExpAvg ? detail::int8_code_exp_avg() : detail::int8_code_exp_avg_sq();
}

}  // namespace

Status encode_int8_moment(Int8Moment which, const float* x, std::size_t n, std::uint8_t* codes, float* scales) {
  TZ_TRY_CTX(detail::validate_int8_arrays(x, codes, scales, n), "cpu_adam encode_int8_moment");
  const detail::KernelTable& table = detail::kernel_table(best_supported());
  constexpr std::size_t kB = detail::kInt8Block;
  // Every core, in runs of whole blocks (start-up and checkpoints encode billions at once).
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, (n + kB - 1) / kB, 256), [&](const auto& r) {
    for (std::size_t i = r.begin(); i < r.end(); ++i) {
      scales[i] = table.int8_encode(int8_code(which), x + i * kB, codes + i * kB, std::min(kB, n - i * kB));
    }
  });
  return ok_status();
}

Int8CodeTables int8_code_tables(Int8Moment which) {
  const detail::Int8Code& c = int8_code(which);
  return {c.decode, c.mid};
}

Status decode_int8_moment(Int8Moment which, const std::uint8_t* codes, const float* scales, std::size_t n, float* x) {
  TZ_TRY_CTX(detail::validate_int8_arrays(x, codes, scales, n), "cpu_adam decode_int8_moment");
  const detail::KernelTable& table = detail::kernel_table(best_supported());
  constexpr std::size_t kB = detail::kInt8Block;
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, (n + kB - 1) / kB, 256), [&](const auto& r) {
    for (std::size_t i = r.begin(); i < r.end(); ++i) {
      table.int8_decode(int8_code(which), codes + i * kB, scales[i], x + i * kB, std::min(kB, n - i * kB));
    }
  });
  return ok_status();
}

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
