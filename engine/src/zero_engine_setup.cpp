// ZeroEngineImpl's creation: the device and communicator, the placement
// plan, the tiered stores, the optimizer's sub-groups, the initial values
// (Note [Initial values]) and the step report's I/O counters.
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <span>

#include "tierzero/kernels.h"
#include "tierzero/comm/host_collectives.h"
#include "zero_engine_impl.h"

namespace tz {
namespace {

}  // namespace

Status ZeroEngineImpl::make_device_and_comm() {
  if (options_.device != nullptr) {
    device_ = options_.device;
  } else {
    TZ_ASSIGN_OR_RETURN(own_device_, create_device({.backend = options_.config.backend}));
    device_ = own_device_.get();
  }
  TZ_ASSIGN_OR_RETURN(stream_, device_->create_stream());
  TZ_ASSIGN_OR_RETURN(release_stream_, device_->create_stream());
  TZ_ASSIGN_OR_RETURN(reader_done_, device_->create_event());
  TZ_ASSIGN_OR_RETURN(persistent_read_, device_->create_event());
  if (options_.comm != nullptr) {
    comm_ = options_.comm;
  } else {
    TZ_ASSIGN_OR_RETURN(own_comm_, create_communicator({.device = device_}));
    comm_ = own_comm_.get();
  }
  comm_->note_step(step_ + 1);
  if (comm_->backend() == CommBackend::kGloo && device_->kind() == BackendKind::kCuda && comm_->size() > 1) {
    return invalid_argument("the Gloo communicator works on host memory, but the device is {}: use NCCL",
                            device_->name());
  }
  return ok_status();
}

Status ZeroEngineImpl::make_plan() {
  const Config& c = options_.config;
  TierConfig tiers = c.tiers;
  if (device_->kind() == BackendKind::kHost && tiers.gpu.is_auto) {
    // The Host backend's "device" memory is host memory: give it a quarter.
    TZ_ASSIGN_OR_RETURN(HostMemoryReading mem, read_host_memory());
    tiers.gpu = ByteBudget::of(mem.available_bytes / 4);
  }
  // Dead runs' swap files go before "auto" reads the free space (Note [Swap file ownership] in nvme/src/swap_files.cpp).
  std::string swap_files_seen;
  for (const std::string& path : c.all_nvme_paths()) swap_files_seen += nvme::reclaim_stale_swap_files(path).describe();
  TZ_ASSIGN_OR_RETURN(budgets_, resolve_budgets(tiers, c.all_nvme_paths()));
  PlanInput input = PlanInput::from_config(c, layout_.block_numel(), comm_->size(), 0, budgets_);
  // The steps under backward are counted by make_stores and make_step_ahead,
  // from the shards as stored and the pool's pages (the planner's is the
  // same count from the layout, for tierzero-estimate).
  input.step_under_backward = StepUnderBackward::kOff;
  input.keep_fetched_params = false;  // make_kept_params counts it the same way
  input.grads_on_device_across_micro_batches = false;  // the engine counts its own (make_grad_window)
  Expected<Plan> plan = plan_placement(input);
  if (!plan.ok() && !options_.placement) {
    const Status refused = std::move(plan).status().with_context("placing the model states");
    return Status(refused.code(), refused.message() + swap_files_seen, refused.sys_errno());
  }
  if (plan.ok()) plan_ = std::move(*plan);
  if (options_.placement) plan_.tier = *options_.placement;
  // The optimizer runs on the CPU (cpu_adam); on the Host backend "device"
  // memory is host memory, so states placed there step in place. On CUDA,
  // states on the GPU step there (Note [GPU optimizer]): all of them or none.
  if (device_->kind() == BackendKind::kCuda) {
    int on_gpu = 0;
    for (StateClass s : {StateClass::kGrad, StateClass::kMaster, StateClass::kMoments}) on_gpu += plan_.tier_of(s) == Tier::kGpu;
    if (on_gpu > 0) {
      if (on_gpu < 3) {
        return unavailable("the GPU optimizer steps shards whose gradients, master weights and moments all live on the "
                           "GPU, but this placement has grad on {}, master on {}, moments on {}: offload the optimizer "
                           "(zero_optimization.offload_optimizer.device \"cpu\" or \"nvme\"), or give the GPU room "
                           "for all three",
                           tier_name(plan_.tier_of(StateClass::kGrad)), tier_name(plan_.tier_of(StateClass::kMaster)),
                           tier_name(plan_.tier_of(StateClass::kMoments)));
      }
      if (c.states.grads != GradFormat::kFp32) {
        return unavailable("data_types.grad_accum_dtype = \"{}\": the GPU optimizer accumulates gradients in fp32 "
                           "only; offload the optimizer (zero_optimization.offload_optimizer.device \"cpu\" or "
                           "\"nvme\") to accumulate in 16 bits, or remove the key",
                           grad_format_name(c.states.grads));
      }
      if (c.optimizer.type != "Adam" && c.optimizer.type != "AdamW") {
        return unavailable("optimizer.type = \"{}\": the GPU optimizer steps Adam and AdamW; offload the optimizer "
                           "(zero_optimization.offload_optimizer.device \"cpu\") to step {} with cpu_adam",
                           c.optimizer.type, c.optimizer.type);
      }
      gpu_optimizer_ = true;
    }
  }
  return ok_status();
}

// Note [Accumulating on the device across micro-batches] (gradient_path.cpp):
// the blocks backward reaches first, while this rank's share of the GPU
// tier's headroom holds their fp32 accumulators.
std::vector<bool> ZeroEngineImpl::grad_window_blocks() const {
  std::vector<bool> on(layout_.blocks.size(), false);
  const std::optional<bool> wanted = options_.grads_on_device_across_micro_batches;
  const bool allowed = wanted.has_value() ? *wanted : device_->kind() == BackendKind::kCuda;
  if (!allowed || gpu_optimizer_ || gas_ < 2 || acc_type() != DType::kFp32) return on;
  const TierUsage& gpu = plan_.usage_of(Tier::kGpu);
  std::int64_t room = gpu.headroom_bytes() / std::max(gpu.ranks_sharing, 1);
  for (std::size_t b = layout_.blocks.size(); b-- > 0;) {
    const auto bytes = static_cast<std::int64_t>(layout_.blocks[b].shard_numel * sizeof(float));
    if (bytes > room) break;
    room -= bytes;
    on[b] = true;
  }
  return on;
}

Status ZeroEngineImpl::make_grad_window() {
  const std::vector<bool> on = grad_window_blocks();
  TZ_TRY_CTX(grads_->allocate_window(on), "the gradient accumulators on the device");
  std::uint64_t bytes = 0;  // as the planner counts them (add_grad_window): 4 B per shard element
  for (std::size_t b = 0; b < on.size(); ++b) {
    if (!on[b]) continue;
    ++grad_window_blocks_;
    bytes += layout_.blocks[b].shard_numel * sizeof(float);
  }
  if (bytes == 0) return ok_status();
  TierUsage& usage = plan_.usage[static_cast<std::size_t>(Tier::kGpu)];
  usage.breakdown.push_back({fmt::format("fp32 gradient accumulators across micro-batches, {} of {} blocks (Note "
                                         "[Accumulating on the device across micro-batches])",
                                         grad_window_blocks_, layout_.blocks.size()),
                             bytes});
  usage.per_rank_bytes += bytes;
  usage.need_bytes += bytes * static_cast<std::uint64_t>(std::max(usage.ranks_sharing, 1));
  return ok_status();
}

// The NVMe tier: its I/O engine and the swap store over the configured paths,
// sized for nvme_bytes of shards, plus the second copies of Note [Stepping
// under backward] where the tier's headroom holds them.
Status ZeroEngineImpl::make_swap(std::uint64_t nvme_bytes) {
  const Config& c = options_.config;
  const std::vector<std::string> paths = c.all_nvme_paths();
  if (paths.empty()) return invalid_argument("a state class is placed on NVMe, but no NVMe path is configured "
                                             "(zero_optimization.offload_*.nvme_path or tierzero.tiers.nvme_paths)");
  nvme::EngineOptions eo = nvme::EngineOptions::from_config(c.aio);
  eo.fault_injector = options_.nvme_fault_injector;
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoEngine> io, nvme::IoEngine::create(eo));
  io_ = std::move(io);
  // Note [Stepping under backward]: a second copy of the NVMe master and
  // moments, where the NVMe tier's headroom holds it.
  if (c.step_under_backward != StepUnderBackward::kOff && !gpu_optimizer_) {
    std::uint64_t shadow = 0;
    for (StateClass cls : {StateClass::kMaster, StateClass::kMoments}) {
      if (plan_.tier_of(cls) == Tier::kNvme) {
        shadow += state_bytes(cls, layout_.shard_numel, dtype_bytes(param_type_), c.states);
      }
    }
    const TierUsage& usage = plan_.usage_of(Tier::kNvme);
    const std::int64_t room = usage.headroom_bytes() / std::max(usage.ranks_sharing, 1);
    if (shadow > 0 && static_cast<std::int64_t>(shadow) <= room) {
      ahead_shadow_bytes_ = shadow;
      nvme_bytes += shadow;
    } else if (shadow > 0) {
      ahead_off_ = fmt::format("stepping under backward writes the new NVMe master and moments ({} B) beside the "
                               "old ones, and this rank's share of the NVMe tier's headroom is {} B",
                               shadow, room);
    }
  }
  // Room for every shard plus per-extent padding (4 KiB each at most).
  const std::uint64_t capacity = nvme_bytes + 4096 * 8 * layout_.blocks.size() + (std::uint64_t{1} << 20);
  TZ_ASSIGN_OR_RETURN(swap_, nvme::SwapStore::create({.paths = paths, .capacity_bytes = capacity,
                                                      .allow_buffered = c.aio.allow_buffered_io}, io_));
  return ok_status();
}

Status ZeroEngineImpl::make_stores() {
  const Config& c = options_.config;
  TZ_ASSIGN_OR_RETURN(device_pool_, make_device_pool(*device_, budgets_.gpu_bytes));
  // On CUDA the CPU tier is pinned whatever pin_memory says (DeepSpeed's
  // default is false): every host buffer the engine keeps is a copy source or
  // target, and pageable ones make each copy synchronous and several times
  // slower (docs/engine.md).
  const bool pinned = c.zero.offload_param.pin_memory || c.zero.offload_optimizer.pin_memory ||
                      device_->kind() == BackendKind::kCuda;
  TZ_ASSIGN_OR_RETURN(int numa, resolve_numa_node(*device_, c.tiers.numa_node));
  TZ_ASSIGN_OR_RETURN(host_pool_, make_host_pool(*device_, budgets_.cpu_bytes,
                                                 {.pinned = pinned, .numa_node = numa, .huge_pages = c.tiers.huge_pages}));

  const bool adagrad = c.optimizer.type == "Adagrad", lion = c.optimizer.type == "Lion";
  std::uint64_t nvme_bytes = 0;
  for (std::size_t s = 0; s < kNumStateClasses; ++s) {
    if (plan_.tier[s] != Tier::kNvme) continue;
    // The parameters are 16-bit, or fp32 when neither bf16 nor fp16 is on.
    nvme_bytes += state_bytes(static_cast<StateClass>(s), layout_.shard_numel, dtype_bytes(param_type_), c.states);
  }
  if (nvme_bytes > 0) TZ_TRY(make_swap(nvme_bytes));
  std::vector<ShardSpec> shards;
  for (const BlockLayout& b : layout_.blocks) shards.push_back({.name = b.name, .numel = b.shard_numel});
  auto store_args = [&](StateClass cls, std::size_t elem_bytes, Colour colour) {
    return TieredStoreArgs{.state = cls, .tier = plan_.tier_of(cls), .elem_bytes = elem_bytes, .colour = colour,
                           .device = device_, .device_pool = device_pool_.get(), .host_pool = host_pool_.get(),
                           .swap = swap_.get(), .traffic = &nvme_traffic_};
  };
  auto make = [&](StateClass cls, std::size_t elem_bytes, Colour colour) {
    return TieredStore::create(store_args(cls, elem_bytes, colour), shards);
  };
  // Note [Coloured arrays]: the five arrays one optimizer kernel streams each get their own colour.
  TZ_ASSIGN_OR_RETURN(param16_, make(StateClass::kParam16, dtype_bytes(param_type_), Colour::kParam16));
  TZ_ASSIGN_OR_RETURN(grad_, make(StateClass::kGrad, grad_bytes_per_elem(c.states.grads), Colour::kGrad));
  // The master's and the moments' arguments in their formats: a shard that is
  // not a whole number of bytes per element takes its stored size (Notes
  // [Stored remainder shards], [Stored int8 moment shards]). The second copies
  // of Note [Stepping under backward] are made from the same arguments.
  auto state_args = [&](StateClass cls, Colour colour) {
    const bool master = cls == StateClass::kMaster;
    const bool remainder = c.states.master == MasterFormat::kRemainder;
    TieredStoreArgs args = store_args(cls, master ? (remainder ? 0 : 4) : dtype_bytes(moment_type()), colour);
    if (master && remainder) {
      args.bytes_of = [](std::uint64_t n) { return stored_master_bytes(MasterFormat::kRemainder, n); };
    } else if (!master && c.states.moments == MomentFormat::kInt8) {
      args.bytes_of = [](std::uint64_t n) { return stored_moment_bytes(MomentFormat::kInt8, n); };
    }
    return args;
  };
  TZ_ASSIGN_OR_RETURN(master_, TieredStore::create(state_args(StateClass::kMaster, Colour::kMaster), shards));
  if (!adagrad) {
    TZ_ASSIGN_OR_RETURN(exp_avg_, TieredStore::create(state_args(StateClass::kMoments, Colour::kExpAvg), shards));
  }
  if (!lion) {
    TZ_ASSIGN_OR_RETURN(exp_avg_sq_,
                        TieredStore::create(state_args(StateClass::kMoments, Colour::kExpAvgSq), shards));
  }
  if (ahead_shadow_bytes_ > 0) {  // Note [Stepping under backward]: same arguments, other extents
    for (auto [store, shadow] : {std::pair{master_.get(), &master_shadow_}, std::pair{exp_avg_.get(), &exp_avg_shadow_},
                                 std::pair{exp_avg_sq_.get(), &exp_avg_sq_shadow_}}) {
      if (store == nullptr || store->tier() != Tier::kNvme) continue;
      TZ_ASSIGN_OR_RETURN(*shadow, TieredStore::create(state_args(store->state(), store->colour()), shards));
    }
  }
  return ok_status();
}

// Note [The step keeps backward's parameter shards] (kept_params.h): the
// blocks whose shards fit in this rank's share of the CPU tier's headroom,
// counted into the plan before the steps under backward take theirs (the
// planner's add_kept_params counts the same from the layout).
Status ZeroEngineImpl::make_kept_params() {
  const bool applies = options_.config.states.master == MasterFormat::kRemainder && !gpu_optimizer_ &&
                       param16_->tier() == Tier::kNvme;
  if (!applies) return ok_status();
  if (!options_.keep_fetched_params) {
    kept_off_ = "ZeroOptions::keep_fetched_params is false";
    return ok_status();
  }
  TierUsage& cpu = plan_.usage[static_cast<std::size_t>(Tier::kCpu)];
  const std::int64_t share = cpu.headroom_bytes() / std::max(cpu.ranks_sharing, 1);
  detail::KeptChoice choice = detail::choose_kept_blocks(layout_, *param16_, share);
  const auto keepable = static_cast<std::size_t>(
      std::count_if(layout_.blocks.begin(), layout_.blocks.end(), [](const BlockLayout& b) { return !b.persistent; }));
  if (choice.blocks < keepable) {
    kept_off_ = fmt::format("{} of {} blocks' 16-bit shards are kept from their fetch for the step: this rank's share "
                            "of the CPU tier's headroom ({} B) holds no more, the others are read from NVMe again",
                            choice.blocks, keepable, share);
  }
  if (choice.blocks == 0) return ok_status();
  cpu.breakdown.push_back({fmt::format("parameter shards kept for the step: {} blocks' 16-bit shards (Note [The step "
                                       "keeps backward's parameter shards])", choice.blocks),
                           choice.bytes});
  cpu.per_rank_bytes += choice.bytes;
  cpu.need_bytes += choice.bytes * static_cast<std::uint64_t>(std::max(cpu.ranks_sharing, 1));
  kept_params_ = std::make_unique<detail::KeptParams>(
      detail::KeptParamsDeps{.param16 = param16_.get(), .layout = &layout_}, std::move(choice.may));
  return ok_status();
}

// The NVMe bytes and busy time the next step report counts start from here.
void ZeroEngineImpl::reset_io_counters() {
  nvme_traffic_.reset();
  (void)take_io_busy_seconds();
}

std::tuple<double, double, double> ZeroEngineImpl::take_io_busy_seconds() {
  if (!io_) return {0, 0, 0};
  const nvme::EngineStats io = io_->stats();
  const std::uint64_t read = io.read_busy_ns - std::exchange(read_busy_seen_ns_, io.read_busy_ns);
  const std::uint64_t write = io.write_busy_ns - std::exchange(write_busy_seen_ns_, io.write_busy_ns);
  const std::uint64_t either = io.io_busy_ns - std::exchange(io_busy_seen_ns_, io.io_busy_ns);
  return {static_cast<double>(read) / 1e9, static_cast<double>(write) / 1e9, static_cast<double>(either) / 1e9};
}

// Note [Ranks agree on their settings]
// Each rank steps its own shard with its own config: two ranks whose lr or
// clipping differ both train, each its part with its value, and exit 0; a
// different accumulation count or stage waits in a collective until the
// timeout, and different precisions meet with different message sizes. So,
// before any state is written, the ranks agree on every setting that must
// match, and a difference fails every rank naming the first such setting and
// both values (Note [Agreeing on settings]). Budgets, paths and I/O tuning
// may differ per rank and are not compared; the placement that follows from
// them is.
RankAgreement::Settings ZeroEngineImpl::settings_that_must_match() const {
  const Config& c = options_.config;
  const PrecisionConfig& p = c.precision;
  const OptimizerConfig& o = c.optimizer;
  const SchedulerConfig& s = c.scheduler;
  auto tier = [&](StateClass k) { return std::string(tier_name(plan_.tier_of(k))); };
  return {
      {"zero_optimization.stage", fmt::format("{}", stage_)},
      {"gradient_accumulation_steps", fmt::format("{}", gas_)},
      {"gradient_clipping", fmt::format("{}", c.gradient_clipping)},
      {"precision", std::string(dtype_name(param_type_))},
      {"fp16.loss_scale", fmt::format("{}", p.loss_scale)},
      {"fp16.initial_scale_power", fmt::format("{}", p.initial_scale_power)},
      {"fp16.loss_scale_window", fmt::format("{}", p.loss_scale_window)},
      {"fp16.hysteresis", fmt::format("{}", p.hysteresis)},
      {"fp16.min_loss_scale", fmt::format("{}", p.min_loss_scale)},
      {"optimizer.type", o.type},
      {"optimizer.params.lr", fmt::format("{}", o.lr)},
      {"optimizer.params.betas", fmt::format("[{}, {}]", o.beta1, o.beta2)},
      {"optimizer.params.eps", fmt::format("{}", o.eps)},
      {"optimizer.params.weight_decay", fmt::format("{}", o.weight_decay)},
      {"optimizer.params.amsgrad", o.amsgrad ? "true" : "false"},
      {"scheduler.type", std::string(scheduler_name(s.type))},
      {"scheduler.params", fmt::format("min_lr {} max_lr {}{} warmup {} {} total {} min_ratio {} cos_min_ratio {}",
                                       s.warmup_min_lr, s.warmup_max_lr, s.warmup_max_lr_auto ? " (auto)" : "",
                                       s.warmup_num_steps, s.warmup_type == WarmupType::kLog ? "log" : "linear",
                                       s.total_num_steps, s.warmup_min_ratio, s.cos_min_ratio)},
      {"zero_optimization.stage3_param_persistence_threshold",
       fmt::format("{}", c.zero.stage3_param_persistence_threshold)},
      {"zero_optimization.stage3_prefetch_bucket_size", fmt::format("{}", c.zero.stage3_prefetch_bucket_size)},
      {"placement", fmt::format("params {}, grads {}, master {}, moments {}", tier(StateClass::kParam16),
                                tier(StateClass::kGrad), tier(StateClass::kMaster), tier(StateClass::kMoments))},
  };
}

// The optimizer pass (CPU or GPU), with the 16-bit shards it may take from
// their fetch (Note [The step keeps backward's parameter shards]) and each
// block's weight-decay segments.
Status ZeroEngineImpl::make_optimizer() {
  const Config& c = options_.config;
  TZ_TRY(make_kept_params());
  TZ_ASSIGN_OR_RETURN(cpu_opt_, cpu_adam::CpuOptimizer::create({}));
  param_weight_decay_.resize(layout_.blocks.size());
  weight_decay_segments_.resize(layout_.blocks.size());
  optimizer_ = detail::OptimizerPass::make(
      {.device = device_, .stream = stream_.get(), .device_pool = device_pool_.get(), .host_pool = host_pool_.get(),
       .param16 = param16_.get(), .grad = grad_.get(), .master = master_.get(), .exp_avg = exp_avg_.get(),
       .exp_avg_sq = exp_avg_sq_.get(), .cpu_opt = cpu_opt_.get(), .layout = &layout_, .param_type = param_type_,
       .grad_dtype = acc_type(), .master_format = c.states.master, .moment_dtype = moment_type(),
       .sub_group_size = static_cast<std::uint64_t>(std::max<std::int64_t>(c.zero.sub_group_size, 1)),
       .rank = comm_->rank(), .timeline = &timeline_, .weight_decay_segments = &weight_decay_segments_,
       .kept = kept_params_.get(),
       .params_written = options_.next_fetches_under_step
                             ? std::function<void(std::size_t, bool)>([this](std::size_t b, bool more) {
                                 prefetcher_->block_stepped(b, more);
                               })
                             : nullptr},
      gpu_optimizer_);
  return ok_status();
}

Status ZeroEngineImpl::init(const std::vector<BlockSpec>& model, const ParamInit& init) {
  const Config& c = options_.config;
  stage_ = c.zero.stage;
  // Neither fp16 nor bf16: fp32 training, as in DeepSpeed.
  param_type_ = c.precision.fp16 ? DType::kFp16 : c.precision.bf16 ? DType::kBf16 : DType::kFp32;
  grad_type_ = options_.grad_type.value_or(param_type_);
  if (grad_type_ != DType::kFp32 && grad_type_ != DType::kBf16 && grad_type_ != DType::kFp16) {
    return invalid_argument("ZeroOptions::grad_type = {}: gradients are fp32, bf16 or fp16", dtype_name(grad_type_));
  }
  TZ_TRY(make_device_and_comm());
  TZ_TRY(resolve_batch(options_.config, comm_->size()));  // Note [Batch keys] (common/src/config.cpp)
  gas_ = static_cast<int>(c.gradient_accumulation_steps);
  // Stage 3 keeps small blocks whole; stages 0-2 keep every block whole.
  const std::uint64_t persist_below =
      stage_ >= 3 ? static_cast<std::uint64_t>(std::max<std::int64_t>(c.zero.stage3_param_persistence_threshold, 0))
                  : UINT64_MAX;
  TZ_ASSIGN_OR_RETURN(layout_, ModelLayout::make(model, comm_->size(), persist_below));
  TZ_TRY(make_plan());
  TZ_TRY(make_stores());
  TZ_TRY(make_optimizer());
  TZ_ASSIGN_OR_RETURN(d2h_stream_, device_->create_stream());
  TZ_ASSIGN_OR_RETURN(comm_stream_, device_->create_stream());
  comm_thread_ = std::make_unique<detail::TaskThread>("comm");
  grad_thread_ = std::make_unique<detail::TaskThread>("grad");
  grads_ = std::make_unique<detail::GradientPath>(detail::GradientPathDeps{
      .device = device_, .comm = comm_, .comm_thread = comm_thread_.get(), .grad_thread = grad_thread_.get(),
      .comm_stream = comm_stream_.get(), .d2h_stream = d2h_stream_.get(), .device_pool = device_pool_.get(),
      .host_pool = host_pool_.get(), .grad = grad_.get(), .acc_type = acc_type(), .cpu_opt = cpu_opt_.get(),
      .layout = &layout_, .grad_type = grad_type_, .stage = stage_, .gradient_accumulation_steps = gas_, .on_device = gpu_optimizer_,
      .timeline = &timeline_});
  TZ_TRY(make_grad_window());
  TZ_TRY(make_step_ahead());  // Note [Stepping under backward]
  ranks_ = std::make_unique<RankAgreement>(*comm_, *device_, *device_pool_, [this](const std::function<Status()>& f) {
    return comm_thread_->run(f);
  });
  // Every rank must train the same model: one with other blocks would meet the
  // others' collectives with other sizes, and wait or read garbage. Checked
  // before any state is written.
  std::string described;
  for (const BlockLayout& b : layout_.blocks) {
    described += fmt::format("{}[", b.name);
    for (const ParamLayout& p : b.params) described += fmt::format("{}({}),", p.name, fmt::join(p.shape, "x"));
    described += "]";
  }
  TZ_TRY(ranks_->agree_on(fmt::format("{} blocks, {} parameters, layout digest {:016x}", layout_.blocks.size(),
                                   layout_.param_numel, nvme::checksum(described.data(), described.size())),
                       "creating the engine", "models", "build the same model (block names, parameters, shapes)"));
  // Note [Initial values]: with kRankZero every rank takes part in the broadcasts.
  static constexpr std::string_view kInitialNames[] = {"kRankZero", "kSameOnEveryRank", "kSetLater"};
  TZ_TRY(ranks_->agree_on(fmt::format("initial_values = {}", kInitialNames[static_cast<int>(options_.initial_values)]),
                       "creating the engine", "initial values", "pass the same ZeroOptions::initial_values"));
  TZ_TRY(ranks_->agree_on_settings(settings_that_must_match(), "creating the engine",
                                   "every rank must load the same config (Note [Ranks agree on their settings])"));
  const std::uint64_t window =
      static_cast<std::uint64_t>(std::max<std::int64_t>(c.zero.stage3_prefetch_bucket_size, 0)) *
      dtype_bytes(param_type_);
  prefetcher_ = std::make_unique<detail::Prefetcher>(
      detail::PrefetchDeps{.device = device_, .comm = comm_, .comm_thread = comm_thread_.get(),
                           .comm_stream = comm_stream_.get(),
                           .device_pool = device_pool_.get(), .host_pool = host_pool_.get(),
                           .param16 = param16_.get(), .layout = &layout_, .param_type = param_type_,
                           .timeline = &timeline_, .kept = kept_params_.get()},
      window);
  TZ_TRY(init_states(init));
  TZ_TRY(grads_->prewarm());
  reset_io_counters();  // step reports count steps, not set-up
  TZ_LOG_INFO("engine", "{}", describe());
  return ok_status();
}

// Note [Initial values] (tierzero/engine/zero.h).
Status ZeroEngineImpl::init_states(const ParamInit& init) {
  const int rank = comm_->rank();
  const InitialValues from = options_.initial_values;
  persistent_.resize(layout_.blocks.size());
  blocks_ = detail::BlockTable(layout_, from == InitialValues::kSetLater ? detail::BlockState::kUnset
                                                                          : detail::BlockState::kIdle);
  // One buffer for every block's values, one of zeros for its moments: allocating
  // (and faulting in) them per block cost seconds a billion parameters, on one thread.
  std::uint64_t most_whole = 0, most_shard = 0;
  for (const BlockLayout& block : layout_.blocks) most_whole = std::max(most_whole, block.whole_numel);
  for (const BlockLayout& block : layout_.blocks) most_shard = std::max(most_shard, block.shard_numel);
  std::vector<float> values(from == InitialValues::kSetLater ? 0 : most_whole);
  const std::vector<float> zeros(exp_avg_ || exp_avg_sq_ ? most_shard : 0, 0.0F);
  using Clock = std::chrono::steady_clock;
  Clock::duration making{}, writing{};
  const Clock::time_point began = Clock::now();
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    const BlockLayout& block = layout_.blocks[b];
    const std::span<float> whole =
        from == InitialValues::kSetLater ? std::span<float>() : std::span<float>(values.data(), block.whole_numel);
    const Clock::time_point block_began = Clock::now();
    if (!whole.empty()) {
      std::fill(whole.begin(), whole.end(), 0.0F);  // the gaps between parameters
      for (std::size_t p = 0; p < block.params.size(); ++p) {
        init(b, p, whole.data() + block.params[p].offset, block.params[p].numel);
      }
      if (from == InitialValues::kRankZero && comm_->size() > 1) {
        TZ_TRY_CTX(comm_thread_->run([&] {
          return detail::broadcast_host(*comm_, *device_, *device_pool_, whole.data(), whole.size() * sizeof(float), 0);
        }), "initialising {} (rank 0's values to every rank)", block.name);
      }
    }
    // This rank's writes, agreed on before the next block's broadcast (or the
    // persistent gathers): a rank whose write failed must not leave the
    // others waiting in a collective it never joins.
    const Clock::time_point made = Clock::now();
    making += made - block_began;
    Status written = [&]() -> Status {
      if (!whole.empty()) TZ_TRY(put_weights(b, whole.data() + static_cast<std::uint64_t>(rank) * block.shard_numel));
      if (exp_avg_) TZ_TRY(put(*exp_avg_, b, zeros.data()));
      if (exp_avg_sq_) TZ_TRY(put(*exp_avg_sq_, b, zeros.data()));
      if (block.persistent) {
        TZ_ASSIGN_OR_RETURN(persistent_[b], device_pool_->allocate(block.whole_numel * dtype_bytes(param_type_)));
      }
      return ok_status();
    }();
    const std::string what = fmt::format("initialising {}", block.name);
    if (!written.ok()) written.with_context(what);
    TZ_TRY(agree(written, what));
    writing += Clock::now() - made;
  }
  const Clock::time_point gathering = Clock::now();
  TZ_TRY(gather_persistent());
  auto secs = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  TZ_LOG_INFO("engine", "initial states of {} parameters in {:.1f} s: values made{} {:.1f} s, written to their tiers "
              "{:.1f} s, persistent blocks gathered {:.1f} s", layout_.param_numel, secs(Clock::now() - began),
              from == InitialValues::kRankZero && comm_->size() > 1 ? " and broadcast" : "", secs(making),
              secs(writing), secs(Clock::now() - gathering));
  return ok_status();
}

}  // namespace tz
