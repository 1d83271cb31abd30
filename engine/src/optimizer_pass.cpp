#include "optimizer_pass.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <span>
#include <utility>

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tierzero/common/state_math.h"
#include "tierzero/kernels.h"

namespace tz::detail {
namespace {

Status wait_all(std::vector<nvme::IoFuture>& futures) {
  Status first;
  for (nvme::IoFuture& f : futures) {
    Status s = f.wait();
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  futures.clear();
  return first;
}

// A block's weight-decay segments (Note [Weight decay per parameter] in optimizer_step.cpp).
std::span<const cpu_adam::WeightDecaySegment> segments_of(const OptimizerPassDeps& deps, std::size_t block) {
  if (deps.weight_decay_segments == nullptr) return {};
  return (*deps.weight_decay_segments)[block];
}

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
  Status write_group(std::size_t group, StagingSet& set, std::vector<nvme::IoFuture>& writes);
  // Block b's spans over its staged states (the master in its format, the
  // moments, the fp32 gradient, the 16-bit copy-out): the one place a state
  // format's arrays meet cpu_adam, for run() and the steps under backward alike.
  cpu_adam::Spans spans_of(std::size_t b, void* master, void* grad, void* exp_avg, void* exp_avg_sq,
                           void* param16) const;
  Status step_group(std::size_t group, StagingSet& set, const cpu_adam::Hyper& h, std::int64_t step,
                    double grad_scale);
  void* param16_out(std::size_t block, StagingSet& set) const;
  bool skipped(std::size_t block) const { return block < skip_.size() && skip_[block]; }
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

CpuOptimizerPass::CpuOptimizerPass(const OptimizerPassDeps& deps) : deps_(deps) {
  const std::uint64_t limit = std::max<std::uint64_t>(deps.sub_group_size, 1);
  std::uint64_t in_group = 0;
  for (std::size_t b = 0; b < deps.layout->blocks.size(); ++b) {
    const std::uint64_t n = deps.layout->blocks[b].shard_numel;
    if (groups_.empty() || in_group + n > limit) {
      groups_.emplace_back();
      in_group = 0;
    }
    groups_.back().push_back(b);
    group_of_.push_back(groups_.size() - 1);
    in_group += n;
    max_group_numel_ = std::max(max_group_numel_, in_group);
  }
}

// Sized once for the largest sub-group: steady-state steps allocate nothing.
// Three sets keep the pipeline full (reading the next group, stepping this
// one, writing the last); a model of fewer groups needs one set per group.
Status CpuOptimizerPass::make_staging() {
  staging_.resize(std::min<std::size_t>(kStagingSets, groups_.size()));
  for (StagingSet& set : staging_) {
    for (const TieredStore* store : {deps_.master, deps_.exp_avg, deps_.exp_avg_sq, deps_.grad}) {
      if (store == nullptr || store->resident()) continue;
      std::uint64_t largest = 0;  // bytes of the largest sub-group in this store's format
      for (const std::vector<std::size_t>& group : groups_) {
        largest = std::max(largest, offset_in_group(*store, group.back()) + store->shard_bytes(group.back()));
      }
      TZ_ASSIGN_OR_RETURN(set.area[store], deps_.host_pool->allocate(largest, store->colour()));
    }
    if (deps_.param16->host_memory(0) == nullptr && deps_.param_type != DType::kFp32) {
      TZ_ASSIGN_OR_RETURN(set.param16, deps_.host_pool->allocate(max_group_numel_ * dtype_bytes(deps_.param_type),
                                                                 Colour::kParam16));
    }
  }
  return ok_status();
}

// Bytes before `block` in its sub-group's staging area for `store`: its
// group's earlier shards, in the store's format (whole 4 KiB each, so every
// shard starts aligned for O_DIRECT).
std::uint64_t CpuOptimizerPass::offset_in_group(const TieredStore& store, std::size_t block) const {
  std::uint64_t offset = 0;
  for (std::size_t b : groups_[group_of_[block]]) {
    if (b == block) break;
    offset += store.shard_bytes(b);
  }
  return offset;
}

// Where a state of `block` is while its sub-group steps: its own memory, or
// its place in the staging set (blocks of a group lie one after another).
void* CpuOptimizerPass::state_ptr(const TieredStore* store, std::size_t block, StagingSet& set) const {
  if (store == nullptr) return nullptr;
  if (store->resident()) return store->memory(block);
  return static_cast<char*>(set.area.at(store).data()) + offset_in_group(*store, block);
}

// The new 16-bit parameters of `block`: in place when they live in CPU
// memory, else in the staging set on their way out.
void* CpuOptimizerPass::param16_out(std::size_t block, StagingSet& set) const {
  if (void* in_place = deps_.param16->host_memory(block)) return in_place;
  return static_cast<char*>(set.param16.data()) + offset_in_group(*deps_.param16, block);
}

// Starts the reads of a sub-group's states into its staging set. A
// remainder master also needs its 16-bit parameter shards, read from their
// tier into the copy-out staging they leave by (Note [Remainder traffic]);
// a copy from the GPU tier is there once the stream settles.
Status CpuOptimizerPass::read_group(std::size_t group, StagingSet& set, std::vector<nvme::IoFuture>& reads) {
  for (const TieredStore* store : {deps_.master, deps_.exp_avg, deps_.exp_avg_sq, deps_.grad}) {
    if (store == nullptr || store->resident()) continue;
    for (std::size_t b : groups_[group]) {
      if (!skipped(b)) reads.push_back(store->read(b, state_ptr(store, b, set)));
    }
  }
  if (!remainder()) return ok_status();
  for (std::size_t b : groups_[group]) {
    if (!skipped(b)) TZ_TRY(deps_.param16->read_into(b, param16_out(b, set), *deps_.stream, reads));
  }
  return deps_.param16->settle(*deps_.stream);
}

Status CpuOptimizerPass::write_group(std::size_t group, StagingSet& set, std::vector<nvme::IoFuture>& writes) {
  for (const TieredStore* store : {deps_.master, deps_.exp_avg, deps_.exp_avg_sq}) {
    if (store == nullptr || store->resident()) continue;
    for (std::size_t b : groups_[group]) {
      if (!skipped(b)) writes.push_back(store->write(b, state_ptr(store, b, set)));
    }
  }
  // The new parameters to their tier: the 16-bit copy-out (already in place
  // when they live in CPU memory), or with fp32 parameters the master weights.
  const TieredStore& param16 = *deps_.param16;
  const bool fp32 = deps_.param_type == DType::kFp32;
  for (std::size_t b : groups_[group]) {
    if (skipped(b)) continue;
    const void* out = fp32 ? state_ptr(deps_.master, b, set) : param16_out(b, set);
    TZ_TRY(param16.write_back(b, out, *deps_.stream, writes));
  }
  return param16.settle(*deps_.stream);
}

cpu_adam::Spans CpuOptimizerPass::spans_of(std::size_t b, void* master_ptr, void* grad, void* exp_avg,
                                           void* exp_avg_sq, void* param16) const {
  const std::uint64_t n = deps_.layout->blocks[b].shard_numel;
  auto* master = static_cast<std::uint8_t*>(master_ptr);
  // Int8 moments: codes, then block scales (Note [Stored int8 moment shards]).
  const auto scales = [&](void* shard) {
    return deps_.moment_dtype == DType::kUint8 && shard != nullptr
               ? reinterpret_cast<float*>(static_cast<std::uint8_t*>(shard) + int8_moment_scales_offset(n))
               : nullptr;
  };
  return cpu_adam::Spans{.n = n,
                         .param = remainder() ? nullptr : reinterpret_cast<float*>(master),
                         .grad = grad,
                         .grad_dtype = deps_.grad_dtype,
                         .exp_avg = exp_avg,
                         .exp_avg_sq = exp_avg_sq,
                         .moment_dtype = deps_.moment_dtype,
                         .param16 = param16,
                         .param16_dtype = param16 != nullptr ? deps_.param_type : DType::kBf16,
                         .master_format = deps_.master_format,
                         .remainder = remainder() ? reinterpret_cast<std::int16_t*>(master) : nullptr,
                         .tie_bits = remainder() ? master + remainder_tie_bits_offset(n) : nullptr,
                         .exp_avg_scale = scales(exp_avg),
                         .exp_avg_sq_scale = scales(exp_avg_sq),
                         .weight_decay_segments = segments_of(deps_, b),
                         // Note [Stochastic rounding of bf16 second moments]: keyed by the block and the
                         // element's place in it, so the bits depend on neither the ranks nor the tiers.
                         .rounding_key = b,
                         .rounding_index = static_cast<std::uint64_t>(deps_.rank) * n};
}

Status CpuOptimizerPass::step_group(std::size_t group, StagingSet& set, const cpu_adam::Hyper& h, std::int64_t step,
                                    double grad_scale) {
  for (std::size_t b : groups_[group]) {
    if (skipped(b)) continue;
    // With fp32 parameters there is no copy-out: they are written from the
    // master weights. A remainder master is the 16-bit parameter (read, then
    // rewritten) and the remainders and tie bits of Note [Stored remainder shards].
    void* param16 = deps_.param_type == DType::kFp32 ? nullptr : param16_out(b, set);
    const cpu_adam::Spans spans = spans_of(b, state_ptr(deps_.master, b, set), state_ptr(deps_.grad, b, set),
                                           state_ptr(deps_.exp_avg, b, set), state_ptr(deps_.exp_avg_sq, b, set),
                                           param16);
    TZ_TRY_CTX(deps_.cpu_opt->step(h, {.step = step, .grad_scale = grad_scale}, spans), "stepping {}",
               deps_.layout->blocks[b].name);
  }
  return ok_status();
}

Status CpuOptimizerPass::run(const cpu_adam::Hyper& h, std::int64_t step, double grad_scale,
                             const std::vector<bool>& skip) {
  if (staging_.empty()) TZ_TRY(make_staging());
  skip_ = skip;
  struct Unskip {
    std::vector<bool>& skip;
    ~Unskip() { skip.clear(); }
  } unskip{skip_};
  const std::size_t groups = groups_.size(), sets = staging_.size();
  std::vector<std::vector<nvme::IoFuture>> reads(sets), writes(sets);
  Status failed = read_group(0, staging_[0], reads[0]);
  for (std::size_t g = 0; g < groups && failed.ok(); ++g) {
    failed = wait_all(reads[g % sets]);
    const bool whole_group_skipped =
        std::all_of(groups_[g].begin(), groups_[g].end(), [&](std::size_t b) { return skipped(b); });
    if (!failed.ok()) break;
    if (g + 1 < groups) {
      const std::size_t next = (g + 1) % sets;
      failed = wait_all(writes[next]);  // the writes of g + 1 - sets used this set
      if (!failed.ok()) break;
      failed = read_group(g + 1, staging_[next], reads[next]);
      if (!failed.ok()) break;
    }
    if (whole_group_skipped) continue;
    const auto begin = std::chrono::steady_clock::now();
    failed = step_group(g, staging_[g % sets], h, step, grad_scale);
    deps_.timeline->record(Track::kOptimizer, fmt::format("sub-group {}", g), begin, std::chrono::steady_clock::now());
    if (failed.ok()) failed = write_group(g, staging_[g % sets], writes[g % sets]);
  }
  // Whatever happened, nothing may still be in flight into or out of staging.
  for (auto& r : reads) {
    Status s = wait_all(r);
    if (failed.ok()) failed = std::move(s);
  }
  for (auto& w : writes) {
    Status s = wait_all(w);
    if (failed.ok()) failed = std::move(s);
  }
  return failed;
}

// ------------------------------------------------ steps under backward
// Note [Stepping under backward] (step_ahead.h). A block's step here is
// run()'s, element for element: the same cpu_adam call on the same n
// elements with the same hyperparameters, step and gradient scale, so the
// new states are the same bits (cpu_adam's arithmetic is per element; its
// tiles split a call, never an element). What differs is where they go: the
// old master and moments are copied into the slot first, and the new
// parameters are kept in the slot, out of the reach of fetches, until the
// commit.

// As the host pool reserves them: whole pages.
std::uint64_t pool_bytes(std::uint64_t bytes) {
  static const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  return (std::max<std::uint64_t>(bytes, 1) + page - 1) / page * page;
}

// States with a shadow (NVMe) keep their old values on their own extent: no copy.
std::uint64_t CpuOptimizerPass::ahead_bytes(std::size_t block) const {
  std::uint64_t bytes = pool_bytes(deps_.param16->shard_bytes(block));
  for (const TieredStore* store : stepped_states()) {
    if (store != nullptr && shadow_of(store) == nullptr) bytes += pool_bytes(store->shard_bytes(block));
  }
  return bytes;
}

std::uint64_t CpuOptimizerPass::ahead_staging_bytes() const {
  std::uint64_t bytes = 0;
  for (const TieredStore* store : {deps_.master, deps_.exp_avg, deps_.exp_avg_sq, deps_.grad}) {
    if (store == nullptr || store->resident()) continue;
    std::uint64_t largest = 0;
    for (std::size_t b = 0; b < deps_.layout->blocks.size(); ++b) largest = std::max<std::uint64_t>(largest, store->shard_bytes(b));
    bytes += pool_bytes(largest);
  }
  return kAheadSets * bytes;
}

// Note [Pipelined steps under backward]
// With states on NVMe a block's step under backward is a read, a step and a
// write. kAheadSets staging sets rotate as run()'s do: while block b steps,
// the master and moments of the block backward reaches next (b - 1, the
// hint) are read into another set (they do not change during backward: only
// the gradient must wait for its accumulation), and b's writes drain from its
// set while later blocks step; a set's writes are waited for before it is
// read into again. A write that fails is found then, or by ahead_flush(),
// which names the block (take_failed_ahead) so it is undone and redone.
// Every undo and commit flushes first, so no write of a step under backward
// can land after the undo's.
Status CpuOptimizerPass::drain_set(AheadSet& set) {
  Status reads = wait_all(set.reads);
  Status writes = wait_all(set.writes);
  if (!writes.ok() && set.block != kNoBlock) failed_ahead_.push_back(set.block);
  set.block = kNoBlock;
  set.stepped = false;
  return writes.ok() ? reads : writes;
}

Status CpuOptimizerPass::make_ahead_sets() {
  if (!ahead_sets_.empty()) return ok_status();
  ahead_io_.assign(deps_.layout->blocks.size(), {});
  ahead_sets_.resize(kAheadSets);
  for (AheadSet& set : ahead_sets_) {
    for (TieredStore* store : {deps_.master, deps_.exp_avg, deps_.exp_avg_sq, deps_.grad}) {
      if (store == nullptr || store->resident()) continue;
      std::uint64_t largest = 0;
      for (std::size_t b = 0; b < deps_.layout->blocks.size(); ++b) largest = std::max<std::uint64_t>(largest, store->shard_bytes(b));
      TZ_ASSIGN_OR_RETURN(set.area[store], deps_.host_pool->allocate(largest, store->colour()));
    }
  }
  return ok_status();
}

// A set for `block`: the one its reads went to, or else one whose block has
// stepped (its writes waited for), or else any but `keep`'s; the master and
// moments reads are issued. nullptr: none free (a hint is then dropped).
Expected<CpuOptimizerPass::AheadSet*> CpuOptimizerPass::claim_set(std::size_t block, std::size_t keep, bool must) {
  for (AheadSet& set : ahead_sets_) {
    if (set.block == block) return &set;
  }
  AheadSet* pick = nullptr;
  for (AheadSet& set : ahead_sets_) {
    if (set.block == kNoBlock || set.stepped) {
      pick = &set;
      break;
    }
  }
  if (pick == nullptr && must) {
    for (AheadSet& set : ahead_sets_) {
      if (set.block != keep) {
        pick = &set;
        break;
      }
    }
  }
  if (pick == nullptr) return static_cast<AheadSet*>(nullptr);
  Status drained = drain_set(*pick);  // a failed write is in failed_ahead_; the set is free either way
  (void)drained;
  pick->block = block;
  for (TieredStore* store : stepped_states()) {
    if (store == nullptr || store->resident()) continue;
    pick->reads.push_back(store->read(block, pick->area.at(store).data()));
    ahead_io_[block].read_bytes += store->shard_bytes(block);
  }
  return pick;
}

void* CpuOptimizerPass::ahead_ptr(TieredStore* store, std::size_t block, AheadSet& set) {
  if (store == nullptr) return nullptr;
  if (store->resident()) return store->memory(block);
  return set.area.at(store).data();
}

Status CpuOptimizerPass::step_ahead(std::size_t block, std::size_t next, const cpu_adam::Hyper& h, std::int64_t step,
                                    double grad_scale, AheadSlot& slot) {
  const TieredStore& param16_store = *deps_.param16;
  TZ_TRY(make_ahead_sets());
  for (TieredStore* store : stepped_states()) {
    if (store == nullptr || shadow_of(store) != nullptr || slot.old.count(store) != 0) continue;
    TZ_ASSIGN_OR_RETURN(slot.old[store], deps_.host_pool->allocate(store->shard_bytes(block), store->colour()));
  }
  if (!slot.param16.valid()) {
    TZ_ASSIGN_OR_RETURN(slot.param16, deps_.host_pool->allocate(param16_store.shard_bytes(block), Colour::kParam16));
  }
  TZ_ASSIGN_OR_RETURN(AheadSet* set, claim_set(block, kNoBlock, /*must=*/true));
  if (set == nullptr) return internal_error("no staging set for {} under backward", deps_.layout->blocks[block].name);
  if (next != kNoBlock) TZ_TRY(claim_set(next, block, /*must=*/false).status());  // Note [Pipelined steps under backward]
  Stream& stream = *ahead_stream_;
  if (deps_.grad != nullptr && !deps_.grad->resident()) {
    set->reads.push_back(deps_.grad->read(block, ahead_ptr(deps_.grad, block, *set)));
    ahead_io_[block].read_bytes += deps_.grad->shard_bytes(block);
  }
  if (remainder() && !param16_store.resident()) ahead_io_[block].read_bytes += param16_store.shard_bytes(block);
  Status read = remainder() ? param16_store.read_into(block, slot.param16.data(), stream, set->reads) : ok_status();
  if (read.ok() && remainder()) read = param16_store.settle(stream);
  Status waited = wait_all(set->reads);
  if (!read.ok() || !waited.ok()) set->block = kNoBlock;  // what it holds is in doubt
  TZ_TRY(read);
  TZ_TRY(waited);
  for (TieredStore* store : stepped_states()) {
    if (store == nullptr || shadow_of(store) != nullptr) continue;
    std::memcpy(slot.old.at(store).data(), ahead_ptr(store, block, *set), store->shard_bytes(block));
  }
  slot.changed = true;  // from here on the tier may hold new states
  set->stepped = true;  // the set is this block's until its writes drain
  const bool fp32 = deps_.param_type == DType::kFp32;
  void* master = ahead_ptr(deps_.master, block, *set);
  const cpu_adam::Spans spans =
      spans_of(block, master, ahead_ptr(deps_.grad, block, *set), ahead_ptr(deps_.exp_avg, block, *set),
               ahead_ptr(deps_.exp_avg_sq, block, *set), fp32 ? nullptr : slot.param16.data());
  const auto begin = std::chrono::steady_clock::now();
  TZ_TRY_CTX(deps_.cpu_opt->step(h, {.step = step, .grad_scale = grad_scale}, spans), "stepping {} under backward",
             deps_.layout->blocks[block].name);
  deps_.timeline->record(Track::kOptimizer, "ahead " + deps_.layout->blocks[block].name, begin,
                         std::chrono::steady_clock::now());
  if (fp32) std::memcpy(slot.param16.data(), master, param16_store.shard_bytes(block));  // run() writes the master
  for (TieredStore* store : stepped_states()) {
    if (store == nullptr || store->resident()) continue;
    TieredStore* to = shadow_of(store) != nullptr ? shadow_of(store) : store;  // the old values stay on store's extent
    set->writes.push_back(to->write(block, ahead_ptr(store, block, *set)));
    ahead_io_[block].write_bytes += store->shard_bytes(block);
  }
  return ok_status();  // the writes drain behind later blocks
}

Status CpuOptimizerPass::ahead_flush() {
  Status first;
  for (AheadSet& set : ahead_sets_) {
    Status s = drain_set(set);
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  return first;
}

std::vector<std::size_t> CpuOptimizerPass::take_failed_ahead() { return std::exchange(failed_ahead_, {}); }

AheadIo CpuOptimizerPass::take_ahead_io(std::size_t block) {
  return block < ahead_io_.size() ? std::exchange(ahead_io_[block], {}) : AheadIo{};
}

// Note [Committing steps under backward]
// A kept window's blocks commit together: every block's new 16-bit shard is
// issued to its tier (NVMe writes, copies queued on the stream) before one
// settle and the waits, then each block's second copy (the shadow extents)
// becomes its master and moments. A write and a wait per block cost one
// drive round trip per block, which on small blocks was most of what the
// speculation cost (bench/RESULTS.md, "Batched commits"). A block whose
// parameter write failed still takes its new master and moments: what it
// reads afterwards is the step's states, or an error where the parameters
// are (the swap store refuses an extent whose last write failed), never the
// old parameters beside a new master nor the old master beside a step that
// counted. The error names every such block; the others are committed. An
// undo likewise issues every block's restoring writes before waiting.
Status CpuOptimizerPass::commit_ahead(std::span<const std::size_t> blocks, std::vector<AheadSlot>& slots) {
  const TieredStore& param16 = *deps_.param16;
  std::vector<std::vector<nvme::IoFuture>> writes(blocks.size());
  std::vector<Status> failed(blocks.size());
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    failed[i] = param16.write_back(blocks[i], slots[blocks[i]].param16.data(), *deps_.stream, writes[i]);
  }
  const Status settled = param16.settle(*deps_.stream);  // every copy to the GPU tier at once
  std::vector<std::string> names;
  Status first;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const std::size_t b = blocks[i];
    Status s = wait_all(writes[i]);
    if (s.ok()) s = std::move(failed[i]);
    if (s.ok()) s = settled;
    if (!s.ok()) {
      names.push_back(deps_.layout->blocks[b].name);
      if (first.ok()) first = std::move(s);
    }
    for (TieredStore* store : stepped_states()) {
      if (store != nullptr && shadow_of(store) != nullptr) TZ_TRY(store->swap_shard(b, *shadow_of(store)));
    }
    slots[b].changed = false;
  }
  TZ_TRY_CTX(first, "writing the new parameters of {} of {} blocks stepped under backward ({})", names.size(),
             blocks.size(), fmt::join(names, ", "));
  return ok_status();
}

Status CpuOptimizerPass::undo_ahead(std::span<const std::size_t> blocks, std::vector<AheadSlot>& slots) {
  std::vector<std::vector<nvme::IoFuture>> writes(blocks.size());
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const std::size_t b = blocks[i];
    if (!slots[b].changed) continue;
    for (TieredStore* store : stepped_states()) {
      if (store == nullptr || shadow_of(store) != nullptr) continue;  // its own extent still holds the old values
      if (store->resident()) {
        std::memcpy(store->memory(b), slots[b].old.at(store).data(), store->shard_bytes(b));
      } else {
        writes[i].push_back(store->write(b, slots[b].old.at(store).data()));
      }
    }
  }
  std::vector<std::string> names;
  Status first;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    Status s = wait_all(writes[i]);
    if (s.ok()) {
      slots[blocks[i]].changed = false;  // still changed where it failed: a later undo tries again
      continue;
    }
    names.push_back(deps_.layout->blocks[blocks[i]].name);
    if (first.ok()) first = std::move(s);
  }
  TZ_TRY_CTX(first, "restoring the states of {} stepped under backward", fmt::join(names, ", "));
  return ok_status();
}

// Note [GPU optimizer] (gradient_path.cpp): Adam on the device-resident shards.
class GpuOptimizerPass final : public OptimizerPass {
 public:
  explicit GpuOptimizerPass(const OptimizerPassDeps& deps) : deps_(deps) {}
  Status run(const cpu_adam::Hyper& h, std::int64_t step, double grad_scale, const std::vector<bool>& skip) override;
  std::size_t sub_groups() const override { return 1; }

 private:
  kernels::AdamCompactTensors compact_tensors(std::size_t b, float* master, std::uint16_t* param16,
                                              std::int64_t step) const;
  static kernels::AdamCompactTensors part_from(const kernels::AdamCompactTensors& t, std::uint64_t at);

  OptimizerPassDeps deps_;
};

// Note [Compact states on the GPU optimizer]
// With tierzero.states.master = "remainder" or moments = "bf16" the GPU
// tier's stores hold the compact shards (Note [Stored remainder shards]:
// remainders, then tie bits, beside the bf16 parameter shard), and the pass
// steps every format with the compact kernel (Note [Compact Adam arithmetic]
// in kernels/src/adam_math.h), which gives cpu_adam's bits for the same
// gradient scale: the rounding key and index are spans_of's, the block and
// rank * shard_numel, so a bf16 second moment rounds as it would in CPU
// memory. fp32 states take the same kernel, so a remainder run on the GPU is
// an fp32-master run on the GPU bit for bit, as on the CPU. (The two
// optimizers' runs still differ where the gradient norm does: the device
// sums it in another order, Note [Deterministic norms], and clipping scales
// by it.) A remainder master reads and rewrites the bf16 parameter shard;
// when the parameters do not live on the GPU it goes up before the step and
// down after it, as the copy-out does. int8 moments step on the CPU only
// (creation refuses them here).
kernels::AdamCompactTensors GpuOptimizerPass::compact_tensors(std::size_t b, float* master, std::uint16_t* param16,
                                                               std::int64_t step) const {
  const std::uint64_t n = deps_.layout->blocks[b].shard_numel;
  const bool remainder = deps_.master_format == MasterFormat::kRemainder;
  auto* stored = static_cast<std::uint8_t*>(deps_.master->device_memory(b));
  const std::uint64_t index = static_cast<std::uint64_t>(deps_.rank) * n;  // as spans_of
  return {.master_format = deps_.master_format,
          .master = master,
          .param16 = remainder || deps_.param_type == DType::kBf16 ? param16 : nullptr,
          .remainder = remainder ? reinterpret_cast<std::int16_t*>(stored) : nullptr,
          .tie_bits = remainder ? stored + remainder_tie_bits_offset(n) : nullptr,
          .grad = static_cast<const float*>(deps_.grad->device_memory(b)),
          .moment_format = deps_.moment_dtype == DType::kBf16 ? MomentFormat::kBf16 : MomentFormat::kFp32,
          .exp_avg = deps_.exp_avg->device_memory(b),
          .exp_avg_sq = deps_.exp_avg_sq->device_memory(b),
          .sr_key = state_math::sr_step_key(b, step, index),
          .sr_base = static_cast<std::uint32_t>(index)};
}

// Elements [at, ...) of a call: the tie bits and the rounding index count
// from the shard's element 0.
kernels::AdamCompactTensors GpuOptimizerPass::part_from(const kernels::AdamCompactTensors& t, std::uint64_t at) {
  const std::size_t moment_bytes = t.moment_format == MomentFormat::kBf16 ? 2 : 4;
  kernels::AdamCompactTensors p = t;
  if (p.master != nullptr) p.master += at;
  if (p.param16 != nullptr) p.param16 += at;
  if (p.remainder != nullptr) p.remainder += at;
  p.tie_bit_offset = at;
  p.grad += at;
  p.exp_avg = static_cast<char*>(p.exp_avg) + at * moment_bytes;
  p.exp_avg_sq = static_cast<char*>(p.exp_avg_sq) + at * moment_bytes;
  p.sr_base += static_cast<std::uint32_t>(at);
  return p;
}

Status GpuOptimizerPass::run(const cpu_adam::Hyper& c, std::int64_t step, double grad_scale,
                             const std::vector<bool>& skip) {
  if (std::find(skip.begin(), skip.end(), true) != skip.end()) {
    return internal_error("the GPU optimizer pass steps every block (nothing steps under backward on it)");
  }
  const kernels::AdamHyper h{.lr = c.lr, .beta1 = c.beta1, .beta2 = c.beta2, .eps = c.eps,
                             .weight_decay = c.weight_decay, .adamw = c.algorithm == cpu_adam::Algorithm::kAdamW,
                             .step = step, .grad_scale = grad_scale};
  Stream& stream = *deps_.stream;
  const auto begin = std::chrono::steady_clock::now();
  // 16-bit parameters off the GPU: the copy-out goes to a device buffer, then
  // down to their tier (2 B/param over PCIe, and to NVMe when they live there).
  TieredStore& param16_store = *deps_.param16;
  const bool params_on_gpu = param16_store.device_memory(0) != nullptr;
  const bool remainder = deps_.master_format == MasterFormat::kRemainder;
  PoolBlock d_out, h_out;
  for (std::size_t b = 0; b < deps_.layout->blocks.size(); ++b) {
    const std::uint64_t n = deps_.layout->blocks[b].shard_numel;
    auto* master = remainder ? nullptr : static_cast<float*>(deps_.master->device_memory(b));
    if (!params_on_gpu && d_out.size_bytes() < param16_store.shard_bytes(b)) {
      TZ_ASSIGN_OR_RETURN(d_out, deps_.device_pool->allocate(param16_store.shard_bytes(b)));
      TZ_ASSIGN_OR_RETURN(h_out, deps_.host_pool->allocate(param16_store.shard_bytes(b)));
    }
    auto* param16 = static_cast<std::uint16_t*>(params_on_gpu ? param16_store.device_memory(b) : d_out.data());
    if (remainder && !params_on_gpu) {
      // A remainder master's bf16 half is the parameter: up to the device first.
      TZ_TRY_CTX(param16_store.get(b, h_out.data(), stream), "reading the parameters of {}", deps_.layout->blocks[b].name);
      TZ_TRY(deps_.device->copy_async(param16, h_out.data(), param16_store.shard_bytes(b), stream));
    }
    const kernels::AdamCompactTensors t = compact_tensors(b, master, param16, step);
    // One launch per run of one weight decay: the kernel is elementwise, so this is the whole-shard launch
    // with each element's own weight decay.
    std::uint64_t at = 0;
    const auto launch = [&](std::uint64_t end, double weight_decay) -> Status {
      if (end <= at) return ok_status();
      kernels::AdamHyper run = h;
      run.weight_decay = weight_decay;
      TZ_TRY_CTX(kernels::adam_step_compact_cuda(part_from(t, at), end - at, run, stream.native_handle()),
                 "stepping {} on the GPU", deps_.layout->blocks[b].name);
      at = end;
      return ok_status();
    };
    for (const cpu_adam::WeightDecaySegment& seg : segments_of(deps_, b)) {
      TZ_TRY(launch(seg.begin, h.weight_decay));
      TZ_TRY(launch(seg.end, seg.weight_decay));
    }
    TZ_TRY(launch(n, h.weight_decay));
    if (deps_.param_type == DType::kFp16) {
      TZ_TRY(kernels::cast_fp32_to_fp16_cuda(master, param16, n, stream.native_handle()));
    }
    if (deps_.param_type == DType::kFp32) TZ_TRY(deps_.device->copy_async(param16, master, n * 4, stream));
    if (!params_on_gpu) {
      TZ_TRY(deps_.device->copy_async(h_out.data(), param16, param16_store.shard_bytes(b), stream));
      TZ_TRY(deps_.device->synchronize_stream(stream));
      TZ_TRY_CTX(param16_store.put(b, h_out.data(), stream), "writing the new parameters of {}",
                 deps_.layout->blocks[b].name);
    }
  }
  TZ_TRY(deps_.device->synchronize_stream(stream));
  deps_.timeline->record(Track::kOptimizer, "GPU Adam", begin, std::chrono::steady_clock::now());
  return ok_status();
}

}  // namespace

Status OptimizerPass::step_ahead(std::size_t, std::size_t, const cpu_adam::Hyper&, std::int64_t, double, AheadSlot&) {
  return internal_error("this optimizer pass does not step under backward");
}
Status OptimizerPass::commit_ahead(std::span<const std::size_t>, std::vector<AheadSlot>&) {
  return internal_error("this optimizer pass does not step under backward");
}
Status OptimizerPass::undo_ahead(std::span<const std::size_t>, std::vector<AheadSlot>&) {
  return internal_error("this optimizer pass does not step under backward");
}

std::unique_ptr<OptimizerPass> OptimizerPass::make(const OptimizerPassDeps& deps, bool on_gpu) {
  if (on_gpu) return std::make_unique<GpuOptimizerPass>(deps);
  return std::make_unique<CpuOptimizerPass>(deps);
}

}  // namespace tz::detail
