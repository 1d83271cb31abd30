// The step: global norm, overflow and loss scale, clipping, then the
// optimizer pass (optimizer_pass.h), and the step report.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>

#include "tierzero/comm/host_collectives.h"
#include "tierzero/kernels.h"
#include "zero_engine_impl.h"

namespace tz {

cpu_adam::Hyper ZeroEngineImpl::hyper() const {
  const OptimizerConfig& o = options_.config.optimizer;
  cpu_adam::Hyper h{.lr = o.lr, .beta1 = o.beta1, .beta2 = o.beta2, .eps = o.eps, .weight_decay = o.weight_decay};
  h.algorithm = o.type == "Adam"      ? cpu_adam::Algorithm::kAdam
                : o.type == "Adagrad" ? cpu_adam::Algorithm::kAdagrad
                : o.type == "Lion"    ? cpu_adam::Algorithm::kLion
                                      : cpu_adam::Algorithm::kAdamW;
  return h;
}

// Note [Weight decay per parameter]
// torch param groups that differ only in weight_decay (Hugging Face's and
// nanoGPT's decay / no-decay split) train with each parameter's own value:
// set_weight_decay() records it, and each block's shard gets a table of
// segments (cpu_adam::WeightDecaySegment, relative to the shard's first
// element) that the optimizer pass hands to cpu_adam, or steps as one GPU
// launch per run. A parameter's segment reaches from its offset to the next
// parameter's (the last one's to the end of the chunk), so the alignment
// padding between parameters rides with the one before it: padding is zero
// with a zero gradient, which stays zero under any weight decay, and
// neighbours with one value make one segment. Segments are cut to this
// rank's slice [rank x shard_numel, (rank + 1) x shard_numel) of the flat
// chunk. Parameters never set use Hyper::weight_decay (the config's).
// cpu_adam steps each segment exactly as a call of its own with that weight
// decay would, so the result is bit for bit the per-parameter optimizer's
// (tierzero.optim over the same groups). Weight decays are hyperparameters,
// like the learning rate of torch's groups: checkpoints do not carry them,
// and a resumed run steps with whatever the resuming code sets (the groups it
// passes to initialize()).
Status ZeroEngineImpl::set_weight_decay(std::size_t block, std::size_t param, double weight_decay) {
  if (block >= layout_.blocks.size()) {
    return invalid_argument("set_weight_decay: block {} is out of range (the model has {} blocks)", block,
                            layout_.blocks.size());
  }
  const BlockLayout& b = layout_.blocks[block];
  if (param >= b.params.size()) {
    return invalid_argument("set_weight_decay: {} has {} parameters, no parameter {}", b.name, b.params.size(), param);
  }
  if (!std::isfinite(weight_decay) || !(weight_decay >= 0) ||
      !std::isfinite(static_cast<float>(weight_decay))) {
    return invalid_argument("set_weight_decay: {}.{} weight_decay = {} must be finite and >= 0", b.name,
                            b.params[param].name, weight_decay);
  }
  std::vector<std::optional<double>>& decays = param_weight_decay_[block];
  decays.resize(b.params.size());
  decays[param] = weight_decay;
  make_weight_decay_segments(block);
  return ok_status();
}

double ZeroEngineImpl::weight_decay(std::size_t block, std::size_t param) const {
  if (block < param_weight_decay_.size() && param < param_weight_decay_[block].size() &&
      param_weight_decay_[block][param].has_value()) {
    return *param_weight_decay_[block][param];
  }
  return options_.config.optimizer.weight_decay;
}

void ZeroEngineImpl::make_weight_decay_segments(std::size_t block) {
  const BlockLayout& b = layout_.blocks[block];
  const std::vector<std::optional<double>>& decays = param_weight_decay_[block];
  const std::uint64_t first = static_cast<std::uint64_t>(rank()) * b.shard_numel, last = first + b.shard_numel;
  std::vector<cpu_adam::WeightDecaySegment>& out = weight_decay_segments_[block];
  out.clear();
  for (std::size_t i = 0; i < decays.size(); ++i) {
    if (!decays[i].has_value()) continue;
    const std::uint64_t begin = std::max(b.params[i].offset, first);
    const std::uint64_t end = std::min(i + 1 < b.params.size() ? b.params[i + 1].offset : b.whole_numel, last);
    if (begin >= end) continue;  // on another rank's shard
    const cpu_adam::WeightDecaySegment seg{.begin = begin - first, .end = end - first, .weight_decay = *decays[i]};
    if (!out.empty() && out.back().end == seg.begin && out.back().weight_decay == seg.weight_decay) {
      out.back().end = seg.end;
    } else {
      out.push_back(seg);
    }
  }
}

// Blocks that got no gradient in this accumulation window (not used by the
// model this time) step with a zero gradient, not the last window's.
Status ZeroEngineImpl::zero_stale_grads() {
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    if (blocks_.state(b) == detail::BlockState::kReduced) continue;
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
  TZ_TRY(blocks_.check_all_set("step"));
  // Every gradient of this micro-batch has reached its accumulator.
  TZ_TRY(grads_->wait());
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
  blocks_.end_window();
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
    comm_->note_step(step_ + 1);  // what the other ranks' timeouts name: Note [What the other ranks were doing]
    const auto start = std::chrono::steady_clock::now();
    TZ_TRY_CTX(optimizer_->run(hyper(), step_, report.clip_coef / scale_used), "optimizer step {}", step_);
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
  const std::uint64_t host_waits = device_->host_waits();
  report.host_waits = host_waits - std::exchange(host_waits_seen_, host_waits);
  report.blocks_reduced = grads_->take_reduced();
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

}  // namespace tz
