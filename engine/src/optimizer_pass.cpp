#include "optimizer_pass.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <unistd.h>

#include <fmt/format.h>

#include "optimizer_passes.h"
#include "tierzero/common/state_math.h"
#include "tierzero/kernels.h"

namespace tz::detail {

std::uint64_t pool_bytes(std::uint64_t bytes) {
  static const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  return (std::max<std::uint64_t>(bytes, 1) + page - 1) / page * page;
}

namespace optimizer_pass_impl {

Status wait_all(std::vector<nvme::IoFuture>& futures) {
  Status first;
  for (nvme::IoFuture& f : futures) {
    Status s = f.wait();
    if (first.ok() && !s.ok()) first = std::move(s);
  }
  futures.clear();
  return first;
}

std::span<const cpu_adam::WeightDecaySegment> segments_of(const OptimizerPassDeps& deps, std::size_t block) {
  if (deps.weight_decay_segments == nullptr) return {};
  return (*deps.weight_decay_segments)[block];
}

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
// tier into the copy-out staging they leave by (Note [Remainder traffic]),
// or copied from what backward's fetch kept (Note [The step keeps
// backward's parameter shards]); a copy from the GPU tier is there once the
// stream settles.
Status CpuOptimizerPass::read_group(std::size_t group, StagingSet& set, std::vector<nvme::IoFuture>& reads) {
  for (const TieredStore* store : {deps_.master, deps_.exp_avg, deps_.exp_avg_sq, deps_.grad}) {
    if (store == nullptr || store->resident()) continue;
    for (std::size_t b : groups_[group]) {
      if (!skipped(b)) reads.push_back(store->read(b, state_ptr(store, b, set)));
    }
  }
  if (!remainder()) return ok_status();
  for (std::size_t b : groups_[group]) {
    if (skipped(b)) continue;
    const bool copied = deps_.kept != nullptr && deps_.kept->copy_to(b, param16_out(b, set));
    if (deps_.kept != nullptr) deps_.kept->release(b);  // this step's last use
    if (!copied) TZ_TRY(deps_.param16->read_into(b, param16_out(b, set), *deps_.stream, reads));
  }
  return deps_.param16->settle(*deps_.stream);
}

// The states' writes go to `writes`, the new parameters' to `param_writes`
// (what the next forward's fetches wait for).
Status CpuOptimizerPass::write_group(std::size_t group, StagingSet& set, std::vector<nvme::IoFuture>& writes,
                                     std::vector<nvme::IoFuture>& param_writes) {
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
    TZ_TRY(param16.write_back(b, out, *deps_.stream, param_writes));
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

void CpuOptimizerPass::tell_written(std::size_t group, bool skipped_ones, bool more_to_step) const {
  if (!deps_.params_written) return;
  for (std::size_t b : groups_[group]) {
    if (skipped(b) == skipped_ones) deps_.params_written(b, more_to_step);
  }
}

// Three staging sets in turn: group g + 1's reads are issued before g steps,
// and g's writes are waited for when its set comes round again. Groups whose
// new parameters have landed are told so (Note [The next forward's fetches
// under the optimizer]) in group order, as soon as the pass sees it.
Status CpuOptimizerPass::run(const cpu_adam::Hyper& h, std::int64_t step, double grad_scale,
                             const std::vector<bool>& skip) {
  if (staging_.empty()) TZ_TRY(make_staging());
  skip_ = skip;
  struct Unskip {
    std::vector<bool>& skip;
    ~Unskip() { skip.clear(); }
  } unskip{skip_};
  const std::size_t groups = groups_.size(), sets = staging_.size();
  std::vector<std::vector<nvme::IoFuture>> reads(sets), writes(sets), param_writes(sets);
  ParamsLanded landed(*this, param_writes);
  const auto reuse = [&](std::size_t set, bool more_to_step) -> Status {  // the set's writes done; told
    Status s = landed.wait(set, more_to_step);
    Status w = wait_all(writes[set]);
    return s.ok() ? w : s;
  };
  Status failed = read_group(0, staging_[0], reads[0]);
  for (std::size_t b = 0; b < skip_.size() && deps_.kept != nullptr; ++b) {
    if (skip_[b]) deps_.kept->release(b);  // stepped under backward: used already
  }
  for (std::size_t g = 0; g < groups && failed.ok(); ++g) tell_written(g, true, landed.steps_from(0));  // committed
  for (std::size_t g = 0; g < groups && failed.ok(); ++g) {
    failed = wait_all(reads[g % sets]);
    const bool whole_group_skipped =
        std::all_of(groups_[g].begin(), groups_[g].end(), [&](std::size_t b) { return skipped(b); });
    if (!failed.ok()) break;
    if (g + 1 < groups) {
      const std::size_t next = (g + 1) % sets;
      failed = reuse(next, landed.steps_from(g));  // the writes of g + 1 - sets used this set
      if (!failed.ok()) break;
      failed = read_group(g + 1, staging_[next], reads[next]);
      if (!failed.ok()) break;
    }
    if (whole_group_skipped) continue;
    if (failed = landed.poll(landed.steps_from(g)); !failed.ok()) break;
    const auto begin = std::chrono::steady_clock::now();
    failed = step_group(g, staging_[g % sets], h, step, grad_scale);
    deps_.timeline->record(Track::kOptimizer, fmt::format("sub-group {}", g), begin, std::chrono::steady_clock::now());
    if (failed.ok()) failed = write_group(g, staging_[g % sets], writes[g % sets], param_writes[g % sets]);
    if (failed.ok()) landed.writing(g % sets, g);
    if (failed.ok()) failed = landed.poll(landed.steps_from(g + 1));
  }
  if (!failed.ok()) landed.stop();  // a failed step tells nothing more
  // Whatever happened, nothing may still be in flight into or out of staging.
  for (auto& r : reads) {
    Status s = wait_all(r);
    if (failed.ok()) failed = std::move(s);
  }
  for (std::size_t i = 0; i < sets; ++i) {  // the last groups, in their order
    Status s = reuse((groups + i) % sets, false);
    if (failed.ok()) failed = std::move(s);
  }
  return failed;
}

CpuOptimizerPass::ParamsLanded::ParamsLanded(const CpuOptimizerPass& pass,
                                             std::vector<std::vector<nvme::IoFuture>>& param_writes)
    : pass_(pass), param_writes_(param_writes), group_of_set_(param_writes.size(), kNone) {
  for (std::size_t g = 0; g < pass.groups_.size(); ++g) {
    const std::vector<std::size_t>& blocks = pass.groups_[g];
    if (std::any_of(blocks.begin(), blocks.end(), [&](std::size_t b) { return !pass.skipped(b); })) last_to_step_ = g;
  }
}

bool CpuOptimizerPass::ParamsLanded::steps_from(std::size_t group) const {
  return last_to_step_ != kNone && last_to_step_ >= group;
}

// The set holding the oldest group not yet told, or kNone.
std::size_t CpuOptimizerPass::ParamsLanded::oldest() const {
  std::size_t best = kNone;
  for (std::size_t s = 0; s < group_of_set_.size(); ++s) {
    if (group_of_set_[s] != kNone && (best == kNone || group_of_set_[s] < group_of_set_[best])) best = s;
  }
  return best;
}

// Waits for set s's parameter writes and tells its group, unless a write
// failed (here or before: nothing more is told, and wait() returns it).
Status CpuOptimizerPass::ParamsLanded::land(std::size_t s, bool more_to_step) {
  Status landed = wait_all(param_writes_[s]);
  const std::size_t group = std::exchange(group_of_set_[s], kNone);
  if (!landed.ok() && error_.ok()) error_ = landed;
  if (group != kNone && error_.ok() && !stopped_) pass_.tell_written(group, false, more_to_step);
  return error_;
}

// Tells the oldest groups whose parameter writes have all landed, stopping
// at the first that has not (group order); the first failed parameter write.
Status CpuOptimizerPass::ParamsLanded::poll(bool more_to_step) {
  for (std::size_t s = oldest(); s != kNone && error_.ok(); s = oldest()) {
    const std::vector<nvme::IoFuture>& f = param_writes_[s];
    if (!std::all_of(f.begin(), f.end(), [](const nvme::IoFuture& w) { return w.ready(); })) break;
    (void)land(s, more_to_step);
  }
  return error_;
}

// The set's parameter writes, waited for (older groups' first, in order);
// the first failed parameter write of the pass, if any.
Status CpuOptimizerPass::ParamsLanded::wait(std::size_t set, bool more_to_step) {
  while (group_of_set_[set] != kNone) (void)land(oldest(), more_to_step);
  (void)land(set, more_to_step);  // writes of a group whose write_group failed part-way
  return error_;
}

}  // namespace optimizer_pass_impl


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
  if (on_gpu) return optimizer_pass_impl::make_gpu_pass(deps);
  return std::make_unique<optimizer_pass_impl::CpuOptimizerPass>(deps);
}

}  // namespace tz::detail
