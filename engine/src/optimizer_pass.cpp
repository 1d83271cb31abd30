#include "optimizer_pass.h"

#include <chrono>
#include <cstring>
#include <map>
#include <span>

#include <fmt/format.h>

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
  Status run(const cpu_adam::Hyper& h, std::int64_t step, double grad_scale) override;
  std::size_t sub_groups() const override { return groups_.size(); }

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
  Status step_group(std::size_t group, StagingSet& set, const cpu_adam::Hyper& h, std::int64_t step,
                    double grad_scale);
  void* param16_out(std::size_t block, StagingSet& set) const;

  OptimizerPassDeps deps_;
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
    for (std::size_t b : groups_[group]) reads.push_back(store->read(b, state_ptr(store, b, set)));
  }
  if (!remainder()) return ok_status();
  for (std::size_t b : groups_[group]) TZ_TRY(deps_.param16->read_into(b, param16_out(b, set), *deps_.stream, reads));
  return deps_.param16->settle(*deps_.stream);
}

Status CpuOptimizerPass::write_group(std::size_t group, StagingSet& set, std::vector<nvme::IoFuture>& writes) {
  for (const TieredStore* store : {deps_.master, deps_.exp_avg, deps_.exp_avg_sq}) {
    if (store == nullptr || store->resident()) continue;
    for (std::size_t b : groups_[group]) writes.push_back(store->write(b, state_ptr(store, b, set)));
  }
  // The new parameters to their tier: the 16-bit copy-out (already in place
  // when they live in CPU memory), or with fp32 parameters the master weights.
  const TieredStore& param16 = *deps_.param16;
  const bool fp32 = deps_.param_type == DType::kFp32;
  for (std::size_t b : groups_[group]) {
    const void* out = fp32 ? state_ptr(deps_.master, b, set) : param16_out(b, set);
    TZ_TRY(param16.write_back(b, out, *deps_.stream, writes));
  }
  return param16.settle(*deps_.stream);
}

Status CpuOptimizerPass::step_group(std::size_t group, StagingSet& set, const cpu_adam::Hyper& h, std::int64_t step,
                                    double grad_scale) {
  for (std::size_t b : groups_[group]) {
    // With fp32 parameters there is no copy-out: they are written from the
    // master weights. A remainder master is the 16-bit parameter (read, then
    // rewritten) and the remainders and tie bits of Note [Stored remainder shards].
    const std::uint64_t n = deps_.layout->blocks[b].shard_numel;
    void* param16 = deps_.param_type == DType::kFp32 ? nullptr : param16_out(b, set);
    auto* master = static_cast<std::uint8_t*>(state_ptr(deps_.master, b, set));
    const cpu_adam::Spans spans{.n = n,
                                .param = remainder() ? nullptr : reinterpret_cast<float*>(master),
                                .grad = state_ptr(deps_.grad, b, set),
                                .grad_dtype = DType::kFp32,
                                .exp_avg = state_ptr(deps_.exp_avg, b, set),
                                .exp_avg_sq = state_ptr(deps_.exp_avg_sq, b, set),
                                .moment_dtype = deps_.moment_dtype,
                                .param16 = param16,
                                .param16_dtype = param16 != nullptr ? deps_.param_type : DType::kBf16,
                                .master_format = deps_.master_format,
                                .remainder = remainder() ? reinterpret_cast<std::int16_t*>(master) : nullptr,
                                .tie_bits = remainder() ? master + remainder_tie_bits_offset(n) : nullptr,
                                .weight_decay_segments = segments_of(deps_, b)};
    TZ_TRY_CTX(deps_.cpu_opt->step(h, {.step = step, .grad_scale = grad_scale}, spans), "stepping {}",
               deps_.layout->blocks[b].name);
  }
  return ok_status();
}

Status CpuOptimizerPass::run(const cpu_adam::Hyper& h, std::int64_t step, double grad_scale) {
  if (staging_.empty()) TZ_TRY(make_staging());
  const std::size_t groups = groups_.size(), sets = staging_.size();
  std::vector<std::vector<nvme::IoFuture>> reads(sets), writes(sets);
  Status failed = read_group(0, staging_[0], reads[0]);
  for (std::size_t g = 0; g < groups && failed.ok(); ++g) {
    failed = wait_all(reads[g % sets]);
    if (!failed.ok()) break;
    if (g + 1 < groups) {
      const std::size_t next = (g + 1) % sets;
      failed = wait_all(writes[next]);  // the writes of g + 1 - sets used this set
      if (!failed.ok()) break;
      failed = read_group(g + 1, staging_[next], reads[next]);
      if (!failed.ok()) break;
    }
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

// Note [GPU optimizer] (gradient_path.cpp): Adam on the device-resident shards.
class GpuOptimizerPass final : public OptimizerPass {
 public:
  explicit GpuOptimizerPass(const OptimizerPassDeps& deps) : deps_(deps) {}
  Status run(const cpu_adam::Hyper& h, std::int64_t step, double grad_scale) override;
  std::size_t sub_groups() const override { return 1; }

 private:
  OptimizerPassDeps deps_;
};

Status GpuOptimizerPass::run(const cpu_adam::Hyper& c, std::int64_t step, double grad_scale) {
  const kernels::AdamHyper h{.lr = c.lr, .beta1 = c.beta1, .beta2 = c.beta2, .eps = c.eps,
                             .weight_decay = c.weight_decay, .adamw = c.algorithm == cpu_adam::Algorithm::kAdamW,
                             .step = step, .grad_scale = grad_scale};
  Stream& stream = *deps_.stream;
  const auto begin = std::chrono::steady_clock::now();
  // 16-bit parameters off the GPU: the copy-out goes to a device buffer, then
  // down to their tier (2 B/param over PCIe, and to NVMe when they live there).
  TieredStore& param16_store = *deps_.param16;
  const bool params_on_gpu = param16_store.device_memory(0) != nullptr;
  PoolBlock d_out, h_out;
  for (std::size_t b = 0; b < deps_.layout->blocks.size(); ++b) {
    const std::uint64_t n = deps_.layout->blocks[b].shard_numel;
    auto* master = static_cast<float*>(deps_.master->device_memory(b));
    if (!params_on_gpu && d_out.size_bytes() < param16_store.shard_bytes(b)) {
      TZ_ASSIGN_OR_RETURN(d_out, deps_.device_pool->allocate(param16_store.shard_bytes(b)));
      TZ_ASSIGN_OR_RETURN(h_out, deps_.host_pool->allocate(param16_store.shard_bytes(b)));
    }
    auto* param16 = static_cast<std::uint16_t*>(params_on_gpu ? param16_store.device_memory(b) : d_out.data());
    const kernels::AdamTensors t{.param = master,
                                 .grad = static_cast<const float*>(deps_.grad->device_memory(b)),
                                 .exp_avg = static_cast<float*>(deps_.exp_avg->device_memory(b)),
                                 .exp_avg_sq = static_cast<float*>(deps_.exp_avg_sq->device_memory(b)),
                                 .param16 = deps_.param_type == DType::kBf16 ? param16 : nullptr};
    // One launch per run of one weight decay: the kernel is elementwise, so this is the whole-shard launch
    // with each element's own weight decay.
    std::uint64_t at = 0;
    const auto launch = [&](std::uint64_t end, double weight_decay) -> Status {
      if (end <= at) return ok_status();
      kernels::AdamHyper run = h;
      run.weight_decay = weight_decay;
      const kernels::AdamTensors part{.param = t.param + at, .grad = t.grad + at, .exp_avg = t.exp_avg + at,
                                      .exp_avg_sq = t.exp_avg_sq + at,
                                      .param16 = t.param16 != nullptr ? t.param16 + at : nullptr};
      TZ_TRY_CTX(kernels::adam_step_cuda(part, end - at, run, stream.native_handle()), "stepping {} on the GPU",
                 deps_.layout->blocks[b].name);
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

std::unique_ptr<OptimizerPass> OptimizerPass::make(const OptimizerPassDeps& deps, bool on_gpu) {
  if (on_gpu) return std::make_unique<GpuOptimizerPass>(deps);
  return std::make_unique<CpuOptimizerPass>(deps);
}

}  // namespace tz::detail
