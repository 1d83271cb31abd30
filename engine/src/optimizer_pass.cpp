// The step: global norm, overflow and loss scale, clipping, then CPU Adam
// over sub-groups with NVMe-resident states streamed through pinned staging.
//
// Note [Optimizer pipeline]
// Three staging sets rotate: while sub-group g steps in set g % 3, the reads
// of g + 1 fill set (g + 1) % 3 and the writes of g - 1 drain set (g - 1) % 3.
// Before reading into a set, the writes that last used it (g - 2) must be
// done. Each state class on NVMe is read once and written once per step
// (gradients only read: they are rewritten by the next micro-batch), so the
// bytes moved per step are the planner's count, no more.
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "tierzero/comm/host_collectives.h"
#include "tierzero/kernels.h"
#include "zero_engine_impl.h"

namespace tz {
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

}  // namespace

cpu_adam::Hyper ZeroEngineImpl::hyper() const {
  const OptimizerConfig& o = options_.config.optimizer;
  cpu_adam::Hyper h{.lr = o.lr, .beta1 = o.beta1, .beta2 = o.beta2, .eps = o.eps, .weight_decay = o.weight_decay};
  h.algorithm = o.type == "Adam"      ? cpu_adam::Algorithm::kAdam
                : o.type == "Adagrad" ? cpu_adam::Algorithm::kAdagrad
                : o.type == "Lion"    ? cpu_adam::Algorithm::kLion
                                      : cpu_adam::Algorithm::kAdamW;
  return h;
}

// Blocks that got no gradient in this accumulation window (not used by the
// model this time) step with a zero gradient, not the last window's.
Status ZeroEngineImpl::zero_stale_grads() {
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    if (grad_fresh_[b]) continue;
    const std::vector<float> zeros(layout_.blocks[b].shard_numel, 0.0F);
    TZ_TRY(put(*grad_, b, zeros.data()));  // whatever the tier: device memory, CPU memory or NVMe
    grads_->set_zero(b);
  }
  return ok_status();
}

// One all-reduce of {sum of squares, non-finite count} over the ranks.
Expected<bool> ZeroEngineImpl::global_norm(double& norm) {
  double local[2] = {0, 0};
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    local[0] += grads_->sum_squares(b);
    local[1] += grads_->non_finite(b) ? 1 : 0;
  }
  TZ_TRY_CTX(comm_thread_->run([&] {
               return detail::all_reduce_host(*comm_, *device_, *device_pool_, local, 2, DType::kFp64,
                                              ReduceOp::kSum);
             }),
             "all-reducing the gradient norm");
  const bool overflow = local[1] > 0 || !std::isfinite(local[0]);
  norm = overflow ? std::numeric_limits<double>::infinity() : std::sqrt(local[0]) / scaler_.scale();
  return overflow;
}

Expected<StepReport> ZeroEngineImpl::step() {
  StepReport report;
  TZ_TRY(release_failure());  // Note [Stream-ordered release]
  TZ_TRY(check_all_values_set("step"));
  // Every gradient of this micro-batch has reached its accumulator.
  TZ_TRY(comm_thread_->wait_idle());
  TZ_TRY(grad_thread_->wait_idle());
  if (++micro_ < gas_) {
    TZ_TRY(prefetcher_->end_micro_batch());
    report.step = step_;
    report.loss_scale = scaler_.scale();
    return report;
  }
  micro_ = 0;
  // Blocks fetched ahead that this micro-batch did not use (it fetched
  // nothing, or was rewound) would be read while the optimizer writes their
  // parameters, in device memory it may need: drop them; end_micro_batch
  // issues the next window from the new parameters.
  prefetcher_->drop_in_flight();
  TZ_TRY(zero_stale_grads());
  std::fill(grad_fresh_.begin(), grad_fresh_.end(), false);
  TZ_ASSIGN_OR_RETURN(report.overflow, global_norm(report.grad_norm));
  const double scale_used = scaler_.scale();
  const bool run = scaler_.update(report.overflow);
  report.loss_scale = scaler_.scale();
  if (report.overflow && !options_.config.precision.fp16) {
    TZ_LOG_ONCE_WARN("engine", "non-finite gradients without fp16 loss scaling: the step is skipped");
  }
  if (run) {
    const double max_norm = options_.config.gradient_clipping;
    report.clip_coef = max_norm > 0 ? std::min(1.0, max_norm / (report.grad_norm + 1e-6)) : 1.0;
    options_.config.optimizer.lr = learning_rate();  // the schedule at the steps taken so far
    report.lr = options_.config.optimizer.lr;
    ++step_;
    const auto start = std::chrono::steady_clock::now();
    TZ_TRY_CTX(optimizer_pass(report.clip_coef / scale_used), "optimizer step {}", step_);
    TZ_TRY_CTX(gather_persistent(), "re-gathering the persistent blocks after step {}", step_);
    report.optimizer_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report.stepped = true;
  }
  TZ_TRY(prefetcher_->end_micro_batch());
  report.step = step_;
  const detail::StageWaits waits = prefetcher_->take_waits();
  report.nvme_read_bytes = nvme_traffic_.read_bytes.exchange(0);
  report.nvme_write_bytes = nvme_traffic_.write_bytes.exchange(0);
  report.h2d_bytes = waits.h2d_bytes;
  report.gather_bytes = waits.gather_bytes;
  report.wait_nvme_seconds = waits.nvme;
  report.wait_h2d_seconds = waits.h2d;
  report.wait_gather_seconds = waits.gather;
  report.fetches = waits.fetches;
  report.prefetched = waits.prefetched;
  const PoolStats gpu = device_pool_->stats(), cpu = host_pool_->stats();
  report.peak_gpu_bytes = gpu.peak_in_use_bytes;
  report.gpu_budget_bytes = gpu.budget_bytes;
  report.peak_cpu_bytes = cpu.peak_in_use_bytes;
  const std::uint64_t allocations = gpu.backend_allocations + cpu.backend_allocations;
  report.new_allocations = allocations - std::exchange(pool_allocations_seen_, allocations);
  report.cpu_budget_bytes = cpu.budget_bytes;
  device_pool_->reset_peak();
  host_pool_->reset_peak();
  std::tie(report.nvme_read_busy_seconds, report.nvme_write_busy_seconds) = take_io_busy_seconds();
  if (swap_) {
    const nvme::SwapStats nvme = swap_->stats();
    report.peak_nvme_bytes = nvme.peak_used_bytes;
    report.nvme_capacity_bytes = nvme.capacity_bytes;
  }
  return report;
}

// Where a state of `block` is while its sub-group steps: its own memory, or
// its place in the staging set (blocks of a group lie one after another).
void* ZeroEngineImpl::state_ptr(const TieredStore* store, std::size_t block, StagingSet& set) {
  if (store == nullptr) return nullptr;
  if (store->resident()) return store->memory(block);
  return static_cast<char*>(set.area.at(store).data()) + offset_in_group_[block] * store->elem_bytes();
}

std::vector<nvme::IoFuture> ZeroEngineImpl::read_sub_group(std::size_t group, StagingSet& set) {
  std::vector<nvme::IoFuture> reads;
  for (const TieredStore* store : {master_.get(), exp_avg_.get(), exp_avg_sq_.get(), grad_.get()}) {
    if (store == nullptr || store->resident()) continue;
    for (std::size_t b : sub_groups_[group]) {
      reads.push_back(store->read(b, state_ptr(store, b, set)));
    }
  }
  return reads;
}

Status ZeroEngineImpl::write_sub_group(std::size_t group, StagingSet& set, std::vector<nvme::IoFuture>& writes) {
  for (const TieredStore* store : {master_.get(), exp_avg_.get(), exp_avg_sq_.get()}) {
    if (store == nullptr || store->resident()) continue;
    for (std::size_t b : sub_groups_[group]) {
      writes.push_back(store->write(b, state_ptr(store, b, set)));
    }
  }
  // The new parameters to their tier: the 16-bit copy-out (in place when
  // they live in CPU memory), or with fp32 parameters the master weights.
  const bool fp32 = param_type_ == DType::kFp32;
  for (std::size_t b : sub_groups_[group]) {
    const std::size_t bytes = param16_->shard_bytes(b);
    void* out = fp32 ? state_ptr(master_.get(), b, set)
                     : static_cast<char*>(set.param16.data()) + offset_in_group_[b] * dtype_bytes(param_type_);
    if (fp32 && param16_->tier() == Tier::kCpu) std::memcpy(param16_->memory(b), out, bytes);
    if (param16_->tier() == Tier::kNvme) {
      writes.push_back(param16_->write(b, out));
    } else if (param16_->tier() == Tier::kGpu) {
      TZ_TRY(device_->copy_async(param16_->memory(b), out, bytes, *stream_));
    }
  }
  if (param16_->tier() == Tier::kGpu) TZ_TRY(sync());
  return ok_status();
}

Status ZeroEngineImpl::step_sub_group(std::size_t group, StagingSet& set, double grad_scale) {
  const cpu_adam::Hyper h = hyper();
  for (std::size_t b : sub_groups_[group]) {
    const std::uint64_t n = layout_.blocks[b].shard_numel;
    void* param16 = param_type_ == DType::kFp32 ? nullptr  // written from the master weights
                    : param16_->tier() == Tier::kCpu
                        ? param16_->memory(b)
                        : static_cast<char*>(set.param16.data()) + offset_in_group_[b] * dtype_bytes(param_type_);
    const cpu_adam::Spans spans{.n = n,
                                .param = static_cast<float*>(state_ptr(master_.get(), b, set)),
                                .grad = state_ptr(grad_.get(), b, set),
                                .grad_dtype = DType::kFp32,
                                .exp_avg = state_ptr(exp_avg_.get(), b, set),
                                .exp_avg_sq = state_ptr(exp_avg_sq_.get(), b, set),
                                .param16 = param16,
                                .param16_dtype = param16 != nullptr ? (param_type_) : DType::kBf16};
    TZ_TRY_CTX(cpu_opt_->step(h, {.step = step_, .grad_scale = grad_scale}, spans), "stepping {}",
               layout_.blocks[b].name);
  }
  return ok_status();
}

// Note [GPU optimizer] (gradient_path.cpp): Adam on the device-resident shards.
Status ZeroEngineImpl::gpu_optimizer_pass(double grad_scale) {
  const cpu_adam::Hyper c = hyper();
  const kernels::AdamHyper h{.lr = c.lr, .beta1 = c.beta1, .beta2 = c.beta2, .eps = c.eps,
                             .weight_decay = c.weight_decay, .adamw = c.algorithm == cpu_adam::Algorithm::kAdamW,
                             .step = step_, .grad_scale = grad_scale};
  void* stream = stream_->native_handle();
  const auto begin = std::chrono::steady_clock::now();
  // 16-bit parameters off the GPU: the copy-out goes to a device buffer, then
  // down to their tier (2 B/param over PCIe, and to NVMe when they live there).
  const bool params_on_gpu = param16_->tier() == Tier::kGpu;
  PoolBlock d_out, h_out;
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    const std::uint64_t n = layout_.blocks[b].shard_numel;
    auto* master = static_cast<float*>(master_->memory(b));
    if (!params_on_gpu && d_out.size_bytes() < param16_->shard_bytes(b)) {
      TZ_ASSIGN_OR_RETURN(d_out, device_pool_->allocate(param16_->shard_bytes(b)));
      TZ_ASSIGN_OR_RETURN(h_out, host_pool_->allocate(param16_->shard_bytes(b)));
    }
    auto* param16 = static_cast<std::uint16_t*>(params_on_gpu ? param16_->memory(b) : d_out.data());
    const kernels::AdamTensors t{.param = master,
                                 .grad = static_cast<const float*>(grad_->memory(b)),
                                 .exp_avg = static_cast<float*>(exp_avg_->memory(b)),
                                 .exp_avg_sq = static_cast<float*>(exp_avg_sq_->memory(b)),
                                 .param16 = param_type_ == DType::kBf16 ? param16 : nullptr};
    TZ_TRY_CTX(kernels::adam_step_cuda(t, n, h, stream), "stepping {} on the GPU", layout_.blocks[b].name);
    if (param_type_ == DType::kFp16) TZ_TRY(kernels::cast_fp32_to_fp16_cuda(master, param16, n, stream));
    if (param_type_ == DType::kFp32) TZ_TRY(device_->copy_async(param16, master, n * 4, *stream_));
    if (!params_on_gpu) {
      TZ_TRY(device_->copy_async(h_out.data(), param16, param16_->shard_bytes(b), *stream_));
      TZ_TRY(sync());
      TZ_TRY_CTX(put(*param16_, b, h_out.data()), "writing the new parameters of {}", layout_.blocks[b].name);
    }
  }
  TZ_TRY(sync());
  timeline_.record(detail::Track::kOptimizer, "GPU Adam", begin, std::chrono::steady_clock::now());
  return ok_status();
}

Status ZeroEngineImpl::optimizer_pass(double grad_scale) {
  if (gpu_optimizer_) return gpu_optimizer_pass(grad_scale);
  if (staging_.empty()) {
    // Sized once for the largest sub-group: steady-state steps allocate
    // nothing. Three sets keep the pipeline full (reading the next group,
    // stepping this one, writing the last); a model of fewer groups needs one
    // set per group.
    staging_.resize(std::min<std::size_t>(kStagingSets, sub_groups_.size()));
    for (StagingSet& set : staging_) {
      for (const TieredStore* store : {master_.get(), exp_avg_.get(), exp_avg_sq_.get(), grad_.get()}) {
        if (store == nullptr || store->resident()) continue;
        TZ_ASSIGN_OR_RETURN(set.area[store], host_pool_->allocate(sub_group_max_numel_ * 4, store->colour()));
      }
      if (param16_->tier() != Tier::kCpu && param_type_ != DType::kFp32) {
        TZ_ASSIGN_OR_RETURN(set.param16, host_pool_->allocate(sub_group_max_numel_ * dtype_bytes(param_type_),
                                                              Colour::kParam16));
      }
    }
  }
  const std::size_t groups = sub_groups_.size(), sets = staging_.size();
  std::vector<std::vector<nvme::IoFuture>> reads(sets), writes(sets);
  reads[0] = read_sub_group(0, staging_[0]);
  Status failed;
  for (std::size_t g = 0; g < groups && failed.ok(); ++g) {
    failed = wait_all(reads[g % sets]);
    if (!failed.ok()) break;
    if (g + 1 < groups) {
      const std::size_t next = (g + 1) % sets;
      failed = wait_all(writes[next]);  // the writes of g + 1 - sets used this set
      if (!failed.ok()) break;
      reads[next] = read_sub_group(g + 1, staging_[next]);
    }
    const auto begin = std::chrono::steady_clock::now();
    failed = step_sub_group(g, staging_[g % sets], grad_scale);
    timeline_.record(detail::Track::kOptimizer, fmt::format("sub-group {}", g), begin, std::chrono::steady_clock::now());
    if (failed.ok()) failed = write_sub_group(g, staging_[g % sets], writes[g % sets]);
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

}  // namespace tz
