// The CPU optimizer pass's steps under backward (Note [Stepping under backward],
// step_ahead.h).
#include <algorithm>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "optimizer_passes.h"
#include "tierzero/common/state_math.h"
#include "tierzero/kernels.h"

namespace tz::detail::optimizer_pass_impl {

// ------------------------------------------------ steps under backward
// Note [Stepping under backward] (step_ahead.h). A block's step here is
// run()'s, element for element: the same cpu_adam call on the same n
// elements with the same hyperparameters, step and gradient scale, so the
// new states are the same bits (cpu_adam's arithmetic is per element; its
// tiles split a call, never an element). What differs is where they go: the
// old master and moments are copied into the slot first, and the new
// parameters are kept in the slot, out of the reach of fetches, until the
// commit.

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
  // Note [The step keeps backward's parameter shards]: copied, not taken, so a redo finds it too.
  const bool read_param = remainder() && (deps_.kept == nullptr || !deps_.kept->copy_to(block, slot.param16.data()));
  if (read_param && !param16_store.resident()) ahead_io_[block].read_bytes += param16_store.shard_bytes(block);
  Status read = read_param ? param16_store.read_into(block, slot.param16.data(), stream, set->reads) : ok_status();
  if (read.ok() && read_param) read = param16_store.settle(stream);
  Status waited = wait_all(set->reads);
  if (!read.ok() || !waited.ok()) set->block = kNoBlock;  // what it holds is in doubt
  TZ_TRY(read);
  TZ_TRY(waited);
  std::vector<cpu_adam::CpuOptimizer::CopyJob> keep;
  for (TieredStore* store : stepped_states()) {
    if (store == nullptr || shadow_of(store) != nullptr) continue;
    keep.push_back({slot.old.at(store).data(), ahead_ptr(store, block, *set), store->shard_bytes(block)});
  }
  TZ_TRY_CTX(deps_.cpu_opt->copy(keep), "keeping the old states of {}", deps_.layout->blocks[block].name);
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
// becomes its master and moments. A write and a wait per block cost a
// drive round trip per block after backward, which step() waits out: with
// 32 blocks of 66K-263K elements the batch halved the time step() spent
// after backward (bench/RESULTS.md, "Batched commits and the floor"). A
// block whose parameter write failed still takes its new master and
// moments: what it reads afterwards is the step's states, or an error where
// the parameters are (the swap store refuses an extent whose last write
// failed), never the old parameters beside a new master nor the old master
// beside a step that counted. The error names every such block; the others
// are committed. An undo likewise issues every block's restoring writes
// before waiting.
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
  std::vector<cpu_adam::CpuOptimizer::CopyJob> restore;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const std::size_t b = blocks[i];
    if (!slots[b].changed) continue;
    for (TieredStore* store : stepped_states()) {
      if (store == nullptr || shadow_of(store) != nullptr) continue;  // its own extent still holds the old values
      if (store->resident()) {
        restore.push_back({store->memory(b), slots[b].old.at(store).data(), store->shard_bytes(b)});
      } else {
        writes[i].push_back(store->write(b, slots[b].old.at(store).data()));
      }
    }
  }
  const Status restored = deps_.cpu_opt->copy(restore);
  std::vector<std::string> names;
  Status first;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    Status s = wait_all(writes[i]);
    if (s.ok() && restored.ok()) {
      slots[blocks[i]].changed = false;  // still changed where it failed: a later undo tries again
      continue;
    }
    if (s.ok()) continue;
    names.push_back(deps_.layout->blocks[blocks[i]].name);
    if (first.ok()) first = std::move(s);
  }
  TZ_TRY_CTX(restored, "restoring the states in CPU memory of {} blocks stepped under backward{}", blocks.size(),
             first.ok() ? std::string() : fmt::format(" (and on NVMe of {}: {})", fmt::join(names, ", "), first.message()));
  TZ_TRY_CTX(first, "restoring the states of {} stepped under backward", fmt::join(names, ", "));
  return ok_status();
}

}  // namespace tz::detail::optimizer_pass_impl
