// OptimizerPass: one optimizer step over every block's shard, wherever its
// states live. Two variants behind one interface:
//
//   CPU: sub-groups of blocks rotate through kStagingSets pinned staging sets
//        (Note [Optimizer pipeline]): the NVMe-resident states of the next
//        sub-group are read while this one steps in cpu_adam and the last
//        one's new states and 16-bit parameters are written back.
//   GPU: with every state class on the GPU, the Adam kernel steps each shard
//        in place with its 16-bit copy-out (Note [GPU optimizer]).
//
// The engine decides whether the step runs at all (the norm, an fp16
// overflow, clipping: optimizer_step.cpp) and hands the pass the
// hyperparameters and the gradient scale. Each state class on NVMe is read
// once and written once per step (gradients only read), so the bytes moved
// are the planner's count.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "kept_params.h"
#include "trace.h"
#include "tierzero/cpu_adam.h"
#include "tierzero/engine/model.h"
#include "tierzero/offload.h"

namespace tz::detail {

// Bytes as the host pool reserves a block of `bytes`: whole pages (what the
// plan counts for staging sets, steps under backward and kept shards).
std::uint64_t pool_bytes(std::uint64_t bytes);

struct OptimizerPassDeps {
  Device* device = nullptr;
  Stream* stream = nullptr;              // copies of the new parameters to the GPU; the GPU variant's kernels
  MemoryPool* device_pool = nullptr;
  MemoryPool* host_pool = nullptr;       // staging
  TieredStore* param16 = nullptr;
  TieredStore* grad = nullptr;           // the fp32 accumulated gradient
  TieredStore* master = nullptr;
  TieredStore* exp_avg = nullptr;        // nullptr for Adagrad
  TieredStore* exp_avg_sq = nullptr;     // nullptr for Lion
  cpu_adam::CpuOptimizer* cpu_opt = nullptr;
  const ModelLayout* layout = nullptr;
  DType param_type = DType::kBf16;
  DType grad_dtype = DType::kFp32;                   // the accumulator's (Note [16-bit gradient accumulators])
  MasterFormat master_format = MasterFormat::kFp32;  // fp32 | remainder (Note [Compact states on the GPU optimizer])
  DType moment_dtype = DType::kFp32;                 // fp32 | bf16 | uint8 (int8 codes + scales; tierzero.states.moments)
  std::uint64_t sub_group_size = 1;      // zero_optimization.sub_group_size: elements stepped together (CPU)
  int rank = 0;                          // this rank's shard of each block starts at rank * shard_numel
  Timeline* timeline = nullptr;
  // Per block, the weight-decay segments of this rank's shard (Note [Weight
  // decay per parameter] in optimizer_step.cpp); a block's empty table, or
  // none: Hyper::weight_decay for all of it.
  const std::vector<std::vector<cpu_adam::WeightDecaySegment>>* weight_decay_segments = nullptr;
  // Note [The step keeps backward's parameter shards] (kept_params.h): the
  // CPU variant's remainder master takes the 16-bit shards from there where
  // it can (set with the parameters on NVMe only).
  KeptParams* kept = nullptr;
  // Note [The next forward's fetches under the optimizer] (prefetch.h): the
  // CPU variant calls it for each block once its new parameters have landed
  // in their tier, in sub-group order (blocks it skips, stepped under
  // backward and committed, first), and
  // says whether it has sub-groups left to step; unset: nobody is told.
  std::function<void(std::size_t block, bool more_to_step)> params_written;
};

// What a block stepped under backward keeps until the step commits or
// undoes it (Note [Stepping under backward], step_ahead.h): its master and
// moments as they were before the step, and its new parameters (16-bit, or
// fp32 with fp32 parameters), which reach their tier only at the commit.
inline constexpr std::size_t kNoBlock = static_cast<std::size_t>(-1);

// NVMe bytes a block's steps under backward issued (Note [What a redo costs], step_ahead.h).
struct AheadIo {
  std::uint64_t read_bytes = 0, write_bytes = 0;
};

struct AheadSlot {
  std::map<const TieredStore*, PoolBlock> old;
  PoolBlock param16;
  bool changed = false;  // the states on their tier may differ from `old` (an undo must restore them)
};

class OptimizerPass {
 public:
  // The GPU variant where on_gpu (every state class on the GPU, CUDA), else the CPU one.
  static std::unique_ptr<OptimizerPass> make(const OptimizerPassDeps& deps, bool on_gpu);
  virtual ~OptimizerPass() = default;

  // One step of every block: `step` is the optimizer step being taken (from
  // 1), grad_scale multiplies the accumulated gradient (clipping over the
  // loss scale). Returns when every new state and parameter is in its tier.
  Status run(const cpu_adam::Hyper& h, std::int64_t step, double grad_scale) { return run(h, step, grad_scale, {}); }
  // The same, leaving out the blocks where skip[b] (empty: none): those a
  // step under backward already took.
  virtual Status run(const cpu_adam::Hyper& h, std::int64_t step, double grad_scale, const std::vector<bool>& skip) = 0;
  // How many sub-groups the CPU variant steps in (1 for the GPU one).
  virtual std::size_t sub_groups() const = 0;

  // Note [Stepping under backward] (step_ahead.h); the CPU variant only.
  // step_ahead: `block`'s step as run() takes it, its old master and moments
  // kept in `slot` and its new parameters held there; commit_ahead: those
  // parameters of every block in `blocks` to their tier, together (Note
  // [Committing steps under backward]); undo_ahead: their old states back on
  // their tier, likewise (both after ahead_flush(); `slots` is indexed by
  // block). From one thread; never while run() runs.
  virtual bool can_step_ahead() const { return false; }
  void set_ahead_stream(Stream* stream) { ahead_stream_ = stream; }
  // A second copy of an NVMe state store (same shards, its own extents):
  // steps under backward write the new states there, and the commit trades
  // the two blocks' extents (Note [Stepping under backward]).
  void set_shadow(const TieredStore* store, TieredStore* shadow) { shadows_[store] = shadow; }
  void clear_shadows() { shadows_.clear(); }
  // `next`: the block likely to step next (kNoBlock: none), whose states
  // may be read meanwhile (Note [Pipelined steps under backward]). The new
  // states' writes drain behind later blocks: ahead_flush() waits for every
  // one, and take_failed_ahead() names the blocks whose writes failed.
  virtual Status step_ahead(std::size_t block, std::size_t next, const cpu_adam::Hyper& h, std::int64_t step,
                            double grad_scale, AheadSlot& slot);
  virtual Status ahead_flush() { return ok_status(); }
  // The NVMe bytes read and written for `block` under backward since the last
  // take (a hinted read of a block that never stepped counts too), zeroed.
  virtual AheadIo take_ahead_io(std::size_t /*block*/) { return {}; }
  virtual std::vector<std::size_t> take_failed_ahead() { return {}; }
  virtual Status commit_ahead(std::span<const std::size_t> blocks, std::vector<AheadSlot>& slots);
  virtual Status undo_ahead(std::span<const std::size_t> blocks, std::vector<AheadSlot>& slots);
  // CPU memory a step under backward holds for `block` until the commit, and
  // the staging it shares between blocks (the largest block's NVMe states).
  virtual std::uint64_t ahead_bytes(std::size_t /*block*/) const { return 0; }
  virtual std::uint64_t ahead_staging_bytes() const { return 0; }

 protected:
  TieredStore* shadow_of(const TieredStore* store) const {
    auto it = shadows_.find(store);
    return it == shadows_.end() ? nullptr : it->second;
  }
  Stream* ahead_stream_ = nullptr;
  std::map<const TieredStore*, TieredStore*> shadows_;
};

}  // namespace tz::detail
