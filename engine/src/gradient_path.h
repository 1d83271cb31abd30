// GradientPath: a block's gradients from backward to the fp32 accumulator.
//
//   reduce-scatter (stages 2-3; all-reduce at 0-1)  on the comm thread, in call order (Note [Collective order])
//   device-to-host copy of this rank's shard        on the grad thread
//   accumulation (mean over ranks and micro-batches) with its squared norm, in
//   fp32 or, with data_types.grad_accum_dtype, in the 16-bit training dtype
//
// Note [16-bit gradient accumulators]
// DeepSpeed's data_types.grad_accum_dtype sets the dtype of ZeRO's gradient
// partition buffer; stage 3 adds each micro-batch's shard into it with a
// 16-bit add on the GPU (PyTorch: the fp32 sum rounded to nearest even).
// tierzero's accumulator is the grad TieredStore, on CPU memory or NVMe; with
// the key at the training dtype it holds 2 B an element instead of 4. The
// arithmetic is the fp32 path's, x = fma(scale, g, acc) in fp32 with
// scale = 1/(ranks * gas), then rounded to nearest even into the 16-bit
// store (cpu_adam's accumulate_grad): for a power-of-two scale g * scale is
// exact, so x is PyTorch's fp32 sum and the rounding DeepSpeed's. The first
// micro-batch stores g * scale rounded once; with gas = 1 and ranks a power
// of two that is exact (a bf16 g times 2^-k, away from the subnormals), so
// the bf16 accumulator holds bit for bit what the fp32 one holds and the run
// is the fp32 run. With gas > 1 each later micro-batch k rounds the fp32 sum
// (relative error <= 2^-24) to bf16 (<= 2^-8 of the value stored, acc_k;
// fp16: 2^-11), so per element
//   |acc - exact| <= (2^-8 + 2^-23) * sum over k = 2..gas of |acc_k|,
// about (gas - 1) * 2^-8 of the gradient's size (docs/configuration.md;
// tested in tests/cpu_adam/accumulate_test.cpp, measured in
// bench/RESULTS.md). Round-to-nearest rather than stochastic rounding: the
// values a DeepSpeed run holds, and no rounding at all with one micro-batch.
// The squared norm and non-finite flags are of the values stored, so
// clipping and overflow skips see the 16-bit gradient the optimizer reads.
// The GPU optimizer keeps its fp32 accumulator: the key is refused there
// (zero_engine_setup.cpp), and the planner never plans it with one.
//
// The accumulator is the grad TieredStore (CPU memory, NVMe, or with the GPU
// optimizer the GPU, where a kernel accumulates and nothing leaves the
// device: Note [GPU optimizer]). Backward goes on while gradients drain; at
// most kMaxPendingGrads blocks are in flight (planner.h), so a path slower
// than backward holds a bounded number of buffers. wait() is the step's
// barrier; sum_squares()/non_finite() then give each block's contribution to
// the global norm.
//
// Threads: reduce() and wait() on the training thread; the work runs on the
// comm and grad TaskThreads the engine owns (shared with the prefetcher's
// gathers, so every rank issues collectives in one order).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "trace.h"
#include "workers.h"
#include "tierzero/comm/communicator.h"
#include "tierzero/cpu_adam.h"
#include "tierzero/engine/zero.h"
#include "tierzero/offload.h"

namespace tz::detail {

// Told of each accumulation on the thread that runs it (Note [Stepping under
// backward], step_ahead.h): before it touches the block's accumulator, and
// after it has finished with it (ok: it succeeded).
class AccumulationObserver {
 public:
  virtual ~AccumulationObserver() = default;
  virtual void before_accumulate(std::size_t block) = 0;
  virtual void after_accumulate(std::size_t block, bool ok) = 0;
};

struct GradientPathDeps {
  Device* device = nullptr;
  Communicator* comm = nullptr;
  TaskThread* comm_thread = nullptr;
  TaskThread* grad_thread = nullptr;
  Stream* comm_stream = nullptr;      // the collectives (NCCL)
  Stream* d2h_stream = nullptr;       // the grad thread's copies and kernels
  MemoryPool* device_pool = nullptr;  // reduced shards
  MemoryPool* host_pool = nullptr;    // arriving shards; NVMe accumulator staging
  TieredStore* grad = nullptr;        // the accumulator, (shard_numel,) acc_type per block
  DType acc_type = DType::kFp32;      // fp32, or grad_type (Note [16-bit gradient accumulators])
  cpu_adam::CpuOptimizer* cpu_opt = nullptr;
  const ModelLayout* layout = nullptr;
  DType grad_type = DType::kBf16;
  int stage = 3;
  int gradient_accumulation_steps = 1;
  bool on_device = false;             // the GPU optimizer's path: accumulate on the GPU
  Timeline* timeline = nullptr;
  AccumulationObserver* observer = nullptr;  // may be nullptr; may be set later (set_observer)
};

class GradientPath {
 public:
  explicit GradientPath(const GradientPathDeps& deps);

  // Takes `whole` (the block's gradient, whole_numel in grad_type, device
  // memory) through the path; first: the first micro-batch of the window for
  // this block (the accumulator starts from it rather than adding to it).
  // Returns once queued; a failure shows in a later call or in wait().
  // last: the window's last micro-batch (the block's device accumulator, if
  // it has one, goes down to the grad tier after this one).
  Status reduce(std::size_t block, PoolBlock whole, bool first, bool last = true);
  // Every reduce() so far done; the first failure, if any.
  Status wait();
  // The comm or grad thread's failure so far.
  Status error() const;

  // At the window's end, after wait() and once every block's accumulator
  // holds its window's gradient (stale ones zeroed): takes the norms the GPU
  // optimizer's path leaves for then (Note [GPU optimizer]), and brings down
  // the device accumulators the window's last micro-batch did not reach
  // (Note [Accumulating on the device across micro-batches]).
  Status window_norms();
  // The device accumulators' partial sums are forgotten (a checkpoint load
  // starts a new window).
  void discard_window() { std::fill(window_dirty_.begin(), window_dirty_.end(), false); }
  // Note [Accumulating on the device across micro-batches]: makes a device
  // accumulator for each block where on[b], whose micro-batches then add up
  // there until the window's last one. At creation, before any reduce(); the
  // CPU optimizer's path with fp32 accumulators only.
  Status allocate_window(const std::vector<bool>& on);
  // Gradient bytes copied from the device to the host since the last take.
  std::uint64_t take_d2h_bytes() { return d2h_bytes_.exchange(0); }
  // Of the accumulated shard of `block` (loss-scaled), after wait() (GPU
  // optimizer: after window_norms()).
  double sum_squares(std::size_t block) const { return sum_squares_[block]; }
  bool non_finite(std::size_t block) const { return non_finite_[block]; }
  // A block no reduce() reached this window: its accumulator holds zeros.
  void set_zero(std::size_t block) {
    sum_squares_[block] = 0;
    non_finite_[block] = false;
  }

  // Before any reduce().
  void set_observer(AccumulationObserver* observer) { deps_.observer = observer; }

  // reduce() calls since the last take (the step report's blocks reduced).
  std::uint64_t take_reduced() { return reduced_.exchange(0); }

  // Caches the device pool blocks the path can hold at once, so later steps
  // never meet a new high-water mark (and allocate) at a random step.
  Status prewarm();

 private:
  void accumulate_later(std::size_t block, bool first, bool last, std::shared_ptr<void> keep, const void* shard,
                        std::shared_ptr<void> pending);
  Status reduce_on_comm_thread(std::size_t block, bool first, bool last, std::shared_ptr<PoolBlock> whole,
                               std::shared_ptr<void> pending);
  bool cheap(std::size_t block) const;
  Status accumulate(std::size_t block, const void* d_shard, bool first);
  Status accumulate_on_device(std::size_t block, const void* d_shard, bool first);
  Status accumulate_in_window(std::size_t block, const void* d_shard, bool first, bool last);
  Status bring_down(std::size_t block);
  Expected<PoolBlock> copy_down(const void* src, std::size_t bytes);
  Status add_to_grad_tier(std::size_t block, const void* g, DType g_type, bool first, double scale);
  bool in_window(std::size_t block) const { return block < window_acc_.size() && window_acc_[block].valid(); }
  std::size_t shard_bytes(std::size_t block) const;
  // The factor each micro-batch's reduced sum is added with: the mean over ranks and micro-batches.
  double mean_scale() const {
    return 1.0 / (static_cast<double>(deps_.comm->size()) * deps_.gradient_accumulation_steps);
  }

  GradientPathDeps deps_;
  std::vector<double> sum_squares_;
  std::vector<bool> non_finite_;
  std::mutex mu_;
  std::condition_variable cv_;
  int pending_ = 0;  // guarded by mu_
  std::atomic<std::uint64_t> reduced_{0};
  std::atomic<std::uint64_t> d2h_bytes_{0};
  std::vector<PoolBlock> window_acc_;  // per block: its device accumulator, or empty
  std::vector<bool> window_dirty_;     // holds sums not yet brought down (grad thread; read after wait())
};

}  // namespace tz::detail
