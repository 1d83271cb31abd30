// The optimizer pass's two variants, for the files that implement them:
// optimizer_pass.cpp (the CPU pipeline after backward), optimizer_pass_ahead.cpp
// (the CPU steps under backward) and optimizer_pass_gpu.cpp. Everything else
// sees only OptimizerPass (optimizer_pass.h).
#pragma once

#include <map>
#include <memory>
#include <span>
#include <vector>

#include "optimizer_pass.h"

namespace tz::detail::optimizer_pass_impl {

Status wait_all(std::vector<nvme::IoFuture>& futures);

// A block's weight-decay segments (Note [Weight decay per parameter] in optimizer_step.cpp).
std::span<const cpu_adam::WeightDecaySegment> segments_of(const OptimizerPassDeps& deps, std::size_t block);

std::unique_ptr<OptimizerPass> make_gpu_pass(const OptimizerPassDeps& deps);

// Note [Optimizer pipeline]
// Three staging sets rotate: while sub-group g steps in set g % 3, the reads
// of g + 1 fill set (g + 1) % 3 and the writes of g - 1 drain set (g - 1) % 3.
// Before reading into a set, the writes that last used it (g - 2) must be
// done. Each state class on NVMe is read once and written once per step
// (gradients only read: they are rewritten by the next micro-batch), so the
// bytes moved per step are the planner's count, no more.
class CpuOptimizerPass final : public OptimizerPass {
 public:
  explicit CpuOptimizerPass(const OptimizerPassDeps& deps);
  Status run(const cpu_adam::Hyper& h, std::int64_t step, double grad_scale, const std::vector<bool>& skip) override;
  std::size_t sub_groups() const override { return groups_.size(); }
  bool can_step_ahead() const override { return true; }
  Status step_ahead(std::size_t block, std::size_t next, const cpu_adam::Hyper& h, std::int64_t step,
                    double grad_scale, AheadSlot& slot) override;
  Status ahead_flush() override;
  AheadIo take_ahead_io(std::size_t block) override;
  std::vector<std::size_t> take_failed_ahead() override;
  Status commit_ahead(std::span<const std::size_t> blocks, std::vector<AheadSlot>& slots) override;
  Status undo_ahead(std::span<const std::size_t> blocks, std::vector<AheadSlot>& slots) override;
  std::uint64_t ahead_bytes(std::size_t block) const override;
  std::uint64_t ahead_staging_bytes() const override;

 private:
  // A pinned staging set for one sub-group: for each state that lives on
  // NVMe (and the 16-bit copy-out when the parameters do not live in CPU
  // memory), room for the largest sub-group.
  struct StagingSet {
    std::map<const TieredStore*, PoolBlock> area;
    PoolBlock param16;
  };

  bool remainder() const { return deps_.master_format == MasterFormat::kRemainder; }
  Status make_staging();
  std::uint64_t offset_in_group(const TieredStore& store, std::size_t block) const;
  void* state_ptr(const TieredStore* store, std::size_t block, StagingSet& set) const;
  Status read_group(std::size_t group, StagingSet& set, std::vector<nvme::IoFuture>& reads);
  Status write_group(std::size_t group, StagingSet& set, std::vector<nvme::IoFuture>& writes,
                     std::vector<nvme::IoFuture>& param_writes);
  // Block b's spans over its staged states (the master in its format, the
  // moments, the fp32 gradient, the 16-bit copy-out): the one place a state
  // format's arrays meet cpu_adam, for run() and the steps under backward alike.
  cpu_adam::Spans spans_of(std::size_t b, void* master, void* grad, void* exp_avg, void* exp_avg_sq,
                           void* param16) const;
  Status step_group(std::size_t group, StagingSet& set, const cpu_adam::Hyper& h, std::int64_t step,
                    double grad_scale);
  void* param16_out(std::size_t block, StagingSet& set) const;
  bool skipped(std::size_t block) const { return block < skip_.size() && skip_[block]; }
  // Note [The next forward's fetches under the optimizer]: deps_.params_written
  // for `group`'s blocks that were stepped (`skipped`: those that were not).
  void tell_written(std::size_t group, bool skipped, bool more_to_step) const;
  // run()'s record of the sub-groups whose new parameters are on their way
  // to their tier, one per staging set, told in group order once landed.
  class ParamsLanded {
   public:
    ParamsLanded(const CpuOptimizerPass& pass, std::vector<std::vector<nvme::IoFuture>>& param_writes);
    bool steps_from(std::size_t group) const;  // a group at or after `group` has a block to step
    void writing(std::size_t set, std::size_t group) { group_of_set_[set] = group; }
    Status poll(bool more_to_step);
    void stop() { stopped_ = true; }  // waits go on, tells stop
    Status wait(std::size_t set, bool more_to_step);

   private:
    static constexpr std::size_t kNone = static_cast<std::size_t>(-1);
    std::size_t oldest() const;
    Status land(std::size_t set, bool more_to_step);
    const CpuOptimizerPass& pass_;
    std::vector<std::vector<nvme::IoFuture>>& param_writes_;
    std::vector<std::size_t> group_of_set_;  // the group whose parameter writes the set holds, or kNone
    std::size_t last_to_step_ = kNone;
    Status error_;  // the first failed parameter write
    bool stopped_ = false;
  };
  // The states the step reads and writes (master, moments), and the
  // gradient, which it only reads.
  std::vector<TieredStore*> stepped_states() const { return {deps_.master, deps_.exp_avg, deps_.exp_avg_sq}; }
  // Note [Pipelined steps under backward]: a staging set of one block's
  // NVMe states, the reads into it and the writes out of it in flight.
  struct AheadSet {
    std::map<const TieredStore*, PoolBlock> area;
    std::vector<nvme::IoFuture> reads, writes;
    std::size_t block = kNoBlock;
    bool stepped = false;
  };
  static constexpr std::size_t kAheadSets = kAheadStagingBlocks;  // the planner counts as many
  Status make_ahead_sets();
  Status drain_set(AheadSet& set);
  Expected<AheadSet*> claim_set(std::size_t block, std::size_t keep, bool must);
  // Where `store`'s shard of `block` is while a step under backward takes it.
  void* ahead_ptr(TieredStore* store, std::size_t block, AheadSet& set);

  OptimizerPassDeps deps_;
  std::vector<bool> skip_;                      // run()'s blocks left out, while it runs
  std::vector<AheadSet> ahead_sets_;             // made at the first step under backward
  std::vector<std::size_t> failed_ahead_;       // blocks whose writes under backward failed
  std::vector<AheadIo> ahead_io_;               // per block, since its last take_ahead_io
  std::vector<std::vector<std::size_t>> groups_;
  std::vector<std::size_t> group_of_;           // per block
  std::uint64_t max_group_numel_ = 0;
  std::vector<StagingSet> staging_;             // min(kStagingSets, sub-groups), made at the first step
};

}  // namespace tz::detail::optimizer_pass_impl
