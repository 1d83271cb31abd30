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
  if (decays.size() > param && decays[param] == weight_decay) return ok_status();
  // The steps under backward took the old value (and the optimizer thread
  // reads the segments): undone first, stepped after backward.
  TZ_TRY(cancel_step_ahead(detail::AheadRedo::kHyperparameters));
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

// Note [Stepping under backward] (step_ahead.h)
Status ZeroEngineImpl::make_step_ahead() {
  if (options_.config.step_under_backward == StepUnderBackward::kOff) {
    ahead_off_ = "tierzero.step_under_backward is false";
    return ok_status();
  }
  if (!optimizer_->can_step_ahead()) {
    ahead_off_ = "the optimizer runs on the GPU (every state there), which steps after backward";
    return ok_status();
  }
  if (!ahead_off_.empty()) return ok_status();  // make_stores found no NVMe room for the second copies
  ahead_policy_ = detail::AheadPolicy(options_.config.step_under_backward == StepUnderBackward::kAlways,
                                      options_.auto_ahead_by_pace);
  for (auto [store, shadow] : {std::pair{master_.get(), master_shadow_.get()}, std::pair{exp_avg_.get(), exp_avg_shadow_.get()},
                               std::pair{exp_avg_sq_.get(), exp_avg_sq_shadow_.get()}}) {
    if (shadow != nullptr) optimizer_->set_shadow(store, shadow);
  }
  // The CPU tier's headroom in the plan, this rank's share of it, pays for
  // the staging and a slot per block, the blocks backward reaches first.
  const TierUsage& cpu = plan_.usage_of(Tier::kCpu);
  const std::int64_t share = cpu.headroom_bytes() / std::max(cpu.ranks_sharing, 1);
  const std::uint64_t staging = optimizer_->ahead_staging_bytes();
  // "auto" leaves small blocks to run() (Note [When to speculate]).
  const std::uint64_t min_numel =
      options_.config.step_under_backward == StepUnderBackward::kAuto ? options_.auto_ahead_min_block_numel : 0;
  std::vector<bool> may(layout_.blocks.size(), false);
  std::uint64_t need = staging;
  std::size_t large = 0;
  for (std::size_t b = layout_.blocks.size(); b-- > 0;) {
    if (layout_.blocks[b].shard_numel < min_numel) continue;
    ++large;
    if (static_cast<std::int64_t>(need + optimizer_->ahead_bytes(b)) > share) break;
    need += optimizer_->ahead_bytes(b);
    may[b] = true;
    ++ahead_blocks_;
  }
  if (ahead_blocks_ == 0) {
    optimizer_->clear_shadows();
    master_shadow_.reset();
    exp_avg_shadow_.reset();
    exp_avg_sq_shadow_.reset();
    ahead_shadow_bytes_ = 0;
    if (large == 0) {
      ahead_off_ = fmt::format("tierzero.step_under_backward \"auto\" steps blocks of at least {} elements per rank "
                               "under backward and this model's are smaller (per-block overhead would cost more than "
                               "it hides); true steps every block",
                               min_numel);
      return ok_status();
    }
    const std::size_t first = layout_.blocks.size() - 1;
    ahead_off_ = fmt::format("stepping under backward needs {} B of CPU memory for its first block ({} B of it "
                             "staging), and this rank's share of the CPU tier's headroom is {} B (needs {} of {} B "
                             "budget)", staging + (layout_.blocks.empty() ? 0 : optimizer_->ahead_bytes(first)),
                             staging, share, cpu.need_bytes, cpu.budget_bytes);
    return ok_status();
  }
  if (ahead_blocks_ < large) {
    ahead_off_ = fmt::format("{} of {} blocks step under backward: the CPU tier's headroom ({} B for this rank) holds "
                             "no more slots", ahead_blocks_, layout_.blocks.size(), share);
  } else if (ahead_blocks_ < layout_.blocks.size()) {
    ahead_off_ = fmt::format("{} of {} blocks step under backward: \"auto\" leaves blocks of fewer than {} elements "
                             "per rank to after backward", ahead_blocks_, layout_.blocks.size(), min_numel);
  }
  count_step_ahead_in_plan(need);
  TZ_ASSIGN_OR_RETURN(ahead_stream_, device_->create_stream());
  optimizer_->set_ahead_stream(ahead_stream_.get());
  ahead_ = std::make_unique<detail::StepAhead>(
      detail::StepAheadDeps{.pass = optimizer_.get(), .grads = grads_.get(), .layout = &layout_, .timeline = &timeline_},
      std::move(may));
  grads_->set_observer(ahead_.get());
  return ok_status();
}

// Note [Stepping under backward]: what it adds to the plan, `need` B of this
// rank's CPU memory and the NVMe second copies (ZeroEngine.ThePoolsStayWithinThePlan
// measures it).
void ZeroEngineImpl::count_step_ahead_in_plan(std::uint64_t need) {
  TierUsage& usage = plan_.usage[static_cast<std::size_t>(Tier::kCpu)];
  usage.breakdown.push_back({fmt::format("steps under backward: {} blocks' old master + moments and new params, and "
                                         "three blocks' NVMe states as staging (Note [Stepping under backward])", ahead_blocks_),
                             need});
  usage.per_rank_bytes += need;
  usage.need_bytes += need * static_cast<std::uint64_t>(std::max(usage.ranks_sharing, 1));
  if (ahead_shadow_bytes_ > 0) {
    TierUsage& nvme = plan_.usage[static_cast<std::size_t>(Tier::kNvme)];
    nvme.breakdown.push_back({"steps under backward: a second copy of the master and moments (Note [Stepping under "
                              "backward])", ahead_shadow_bytes_});
    nvme.per_rank_bytes += ahead_shadow_bytes_;
    nvme.need_bytes += ahead_shadow_bytes_ * static_cast<std::uint64_t>(std::max(nvme.ranks_sharing, 1));
  }
}

void ZeroEngineImpl::open_step_ahead() {
  if (!ahead_ || ahead_decided_) return;
  ahead_decided_ = true;
  if (!ahead_policy_.speculate(ahead_why_not_)) return;  // Note [When to speculate]
  ahead_opened_ = true;
  cpu_adam::Hyper h = hyper();
  h.lr = learning_rate();  // what step() sets before it steps
  ahead_->open({.hyper = h, .step = step_ + 1, .grad_scale = 1.0 / scaler_.scale(),
                .max_norm = options_.config.gradient_clipping, .loss_scale = scaler_.scale()});
}

Status ZeroEngineImpl::cancel_step_ahead(detail::AheadRedo why) {
  // Note [The step keeps backward's parameter shards]: whoever reads or
  // writes states outside a step finds the kept shards' headroom free (the
  // step reads the shards from NVMe instead).
  if (kept_params_) kept_params_->drop_all();
  last_window_end_ = {};  // Note [When to speculate]: this window's time may hold a save or load
  if (!ahead_) return ok_status();
  TZ_TRY(grads_->wait());
  return ahead_->cancel(why);
}

// The window's end, in the report and the policy (Note [When to speculate],
// Note [What a redo costs]).
void ZeroEngineImpl::end_ahead_window(StepReport& report, const detail::AheadOutcome& ahead) {
  report.ahead_blocks = ahead.committed;
  report.ahead_redone = ahead.redone;
  report.ahead_seconds = ahead.busy_seconds;
  report.ahead_hidden_seconds = ahead.hidden_seconds;
  report.ahead_redone_seconds = ahead.redone_seconds;
  report.ahead_redone_read_bytes = ahead.redone_io.read_bytes;
  report.ahead_redone_write_bytes = ahead.redone_io.write_bytes;
  report.ahead_redo_reason = std::string(detail::ahead_redo_name(ahead.why));
  if (!ahead_) return;
  if (!ahead_opened_ && !ahead_why_not_.empty()) report.ahead_off = ahead_why_not_;
  ahead_policy_.record(report.stepped, report.overflow, report.grad_norm, options_.config.gradient_clipping,
                       ahead_opened_, ahead.why);
  const auto now = std::chrono::steady_clock::now();
  const bool timed = last_window_end_ != std::chrono::steady_clock::time_point{};
  ahead_policy_.record_pace(timed ? std::chrono::duration<double>(now - last_window_end_).count() : 0.0,
                            report.stepped, ahead_opened_, ahead.why);
  last_window_end_ = now;
  ahead_decided_ = ahead_opened_ = false;
  ahead_why_not_.clear();
}

// The step report's traffic, waits, pools and I/O since the last stepping
// report, each counter taken (reset) as it is read.
void ZeroEngineImpl::fill_counters(StepReport& report) {
  const detail::StageWaits waits = prefetcher_->take_waits();
  report.nvme_read_bytes = nvme_traffic_.read_bytes.exchange(0);
  report.nvme_write_bytes = nvme_traffic_.write_bytes.exchange(0);
  if (kept_params_) {  // Note [The step keeps backward's parameter shards]
    const detail::KeptCounts kept = kept_params_->take_counts();
    report.kept_param_blocks = kept.blocks;
    report.kept_param_bytes = kept.bytes;
    report.reread_param_blocks = kept.reread;
  }
  report.h2d_bytes = waits.h2d_bytes;
  report.d2h_bytes = grads_->take_d2h_bytes();
  report.grad_window_blocks = grad_window_blocks_;
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
  std::tie(report.nvme_read_busy_seconds, report.nvme_write_busy_seconds, report.nvme_busy_seconds) =
      take_io_busy_seconds();
  if (swap_) {
    const nvme::SwapStats nvme = swap_->stats();
    report.peak_nvme_bytes = nvme.peak_used_bytes;
    report.nvme_capacity_bytes = nvme.capacity_bytes;
  }
}

Expected<StepReport> ZeroEngineImpl::step() {
  StepReport report;
  const auto began = std::chrono::steady_clock::now();
  // A step that fails before it settles the window undoes what ran ahead.
  struct CancelAhead {
    detail::StepAhead* ahead;
    ~CancelAhead() {
      if (ahead != nullptr) (void)ahead->cancel();
    }
  } cancel_on_failure{ahead_.get()};
  report.ahead_off = ahead_off_;
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
  // parameters, in device memory it may need: the micro-batch ends now, and
  // the next window is issued from the new parameters as the optimizer
  // writes them (Note [The next forward's fetches under the optimizer]).
  TZ_TRY(prefetcher_->begin_step_pass());
  struct LiftGate {  // a step that fails issues nothing more
    detail::Prefetcher* prefetcher;
    ~LiftGate() { prefetcher->lift_gate(); }
  } lift_gate{prefetcher_.get()};
  TZ_TRY(zero_stale_grads());
  TZ_TRY(grads_->window_norms());
  blocks_.end_window();
  TZ_ASSIGN_OR_RETURN(report.overflow, global_norm(report.grad_norm));
  const double scale_used = scaler_.scale();
  const bool run = scaler_.update(report.overflow);
  report.loss_scale = scaler_.scale();
  if (report.overflow && !options_.config.precision.fp16) {
    TZ_LOG_ONCE_WARN("engine", "non-finite gradients without fp16 loss scaling: the step is skipped");
  }
  std::vector<bool> done;  // blocks whose step ran under backward and is kept
  detail::AheadOutcome ahead;
  if (run) {
    const double max_norm = options_.config.gradient_clipping;
    report.clip_coef = max_norm > 0 ? std::min(1.0, max_norm / (report.grad_norm + 1e-6)) : 1.0;
    options_.config.optimizer.lr = learning_rate();  // the schedule at the steps taken so far
    report.lr = options_.config.optimizer.lr;
    ++step_;
    comm_->note_step(step_ + 1);  // what the other ranks' timeouts name: Note [What the other ranks were doing]
    const auto start = std::chrono::steady_clock::now();
    const double grad_scale = report.clip_coef / scale_used;
    if (ahead_) {
      cancel_on_failure.ahead = nullptr;
      const detail::AheadRedo verdict = detail::verdict(ahead_->args(), report.clip_coef, hyper(), step_, grad_scale);
      TZ_TRY_CTX(ahead_->finish(verdict, done, began, ahead), "optimizer step {}", step_);
    }
    const Status ran = optimizer_->run(hyper(), step_, grad_scale, done);
    if (kept_params_) kept_params_->drop_all();  // every shard it stepped is rewritten: stale, and the memory goes back
    TZ_TRY_CTX(ran, "optimizer step {}", step_);
    TZ_TRY_CTX(gather_persistent(), "re-gathering the persistent blocks after step {}", step_);
    report.optimizer_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report.stepped = true;
  } else if (ahead_) {
    cancel_on_failure.ahead = nullptr;
    TZ_TRY_CTX(ahead_->finish(detail::AheadRedo::kOverflow, done, began, ahead),
               "undoing the steps under backward of a skipped step");
  }
  cancel_on_failure.ahead = nullptr;
  end_ahead_window(report, ahead);
  report.next_fetches_under_step = prefetcher_->take_issued_under_step();
  TZ_TRY(prefetcher_->end_step_pass());
  report.step = step_;
  fill_counters(report);
  return report;
}

}  // namespace tz
