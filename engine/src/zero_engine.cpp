// ZeroEngine: creation (plan, stores, initial states), fetching parameters,
// and the gradient path. The optimizer pass is in optimizer_pass.cpp.
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include "tierzero/kernels.h"
#include "tierzero/comm/host_collectives.h"
#include "zero_engine_impl.h"

namespace tz {

std::vector<std::uint8_t> to_param_type(const float* src, std::size_t n, DType type) {
  std::vector<std::uint8_t> out(n * dtype_bytes(type));
  switch (type) {
    case DType::kFp32: std::memcpy(out.data(), src, n * 4); break;
    case DType::kBf16: kernels::cast_fp32_to_bf16_cpu(src, reinterpret_cast<std::uint16_t*>(out.data()), n); break;
    case DType::kFp16: kernels::cast_fp32_to_fp16_cpu(src, reinterpret_cast<std::uint16_t*>(out.data()), n); break;
  }
  return out;
}

// ---------------------------------------------------------------- handles

GatheredBlock::~GatheredBlock() { reset(); }

GatheredBlock::GatheredBlock(GatheredBlock&& other) noexcept { *this = std::move(other); }

GatheredBlock& GatheredBlock::operator=(GatheredBlock&& other) noexcept {
  if (this != &other) {
    reset();
    owner_ = std::exchange(other.owner_, nullptr);
    block_ = other.block_;
    data_ = std::exchange(other.data_, nullptr);
    type_ = other.type_;
    layout_ = other.layout_;
    persistent_ = other.persistent_;
  }
  return *this;
}

void GatheredBlock::reset() {
  if (owner_ != nullptr && data_ != nullptr && !persistent_) owner_->release(block_, data_);
  owner_ = nullptr;
  data_ = nullptr;
}

Status GatheredBlock::release_after(Stream& stream) { return give_back_after(&stream, nullptr); }

Status GatheredBlock::release_after_native(void* native_stream) { return give_back_after(nullptr, native_stream); }

Status GatheredBlock::give_back_after(Stream* stream, void* native) {
  Releaser* owner = std::exchange(owner_, nullptr);
  void* data = std::exchange(data_, nullptr);
  return owner != nullptr && data != nullptr ? owner->release_after(block_, data, stream, native) : ok_status();
}

void* GatheredBlock::param(std::size_t i) const {
  return static_cast<char*>(data_) + layout_->params.at(i).offset * dtype_bytes(type_);
}

void* GradBlock::grad(std::size_t i) const {
  return static_cast<char*>(buffer_.data()) + layout_->params.at(i).offset * dtype_bytes(type_);
}

// ---------------------------------------------------------------- creation

ZeroEngineImpl::~ZeroEngineImpl() {
  prefetcher_.reset();
  if (comm_thread_) (void)comm_thread_->wait_idle();
  if (grad_thread_) (void)grad_thread_->wait_idle();
  live_.clear();
  persistent_.clear();
  // Stores free their extents and pool blocks before the swap store and pools go.
  param16_.reset();
  grad_.reset();
  master_.reset();
  exp_avg_.reset();
  exp_avg_sq_.reset();
  staging_.clear();
}

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
  TZ_ASSIGN_OR_RETURN(budgets_, resolve_budgets(tiers, c.all_nvme_paths()));
  PlanInput input = PlanInput::from_config(c, layout_.block_numel(), comm_->size(), 0, budgets_);
  Expected<Plan> plan = plan_placement(input);
  if (!plan.ok() && !options_.placement) return std::move(plan).status().with_context("placing the model states");
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
    nvme_bytes += state_elem_bytes(static_cast<StateClass>(s), dtype_bytes(param_type_)) * layout_.shard_numel;
  }
  if (nvme_bytes > 0) {
    const std::vector<std::string> paths = c.all_nvme_paths();
    if (paths.empty()) return invalid_argument("a state class is placed on NVMe, but no NVMe path is configured "
                                               "(zero_optimization.offload_*.nvme_path or tierzero.tiers.nvme_paths)");
    nvme::EngineOptions eo = nvme::EngineOptions::from_config(c.aio);
    eo.fault_injector = options_.nvme_fault_injector;
    TZ_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoEngine> io, nvme::IoEngine::create(eo));
    io_ = std::move(io);
    // Room for every shard plus per-extent padding (4 KiB each at most).
    const std::uint64_t capacity = nvme_bytes + 4096 * 5 * layout_.blocks.size() + (std::uint64_t{1} << 20);
    TZ_ASSIGN_OR_RETURN(swap_, nvme::SwapStore::create({.paths = paths, .capacity_bytes = capacity,
                                                        .allow_buffered = c.aio.allow_buffered_io}, io_));
  }
  std::vector<ShardSpec> shards;
  for (const BlockLayout& b : layout_.blocks) shards.push_back({.name = b.name, .numel = b.shard_numel});
  auto make = [&](StateClass cls, std::size_t elem_bytes, Colour colour) -> Expected<std::unique_ptr<TieredStore>> {
    return TieredStore::create({.state = cls, .tier = plan_.tier_of(cls), .elem_bytes = elem_bytes, .colour = colour,
                                .device = device_, .device_pool = device_pool_.get(), .host_pool = host_pool_.get(),
                                .swap = swap_.get(), .traffic = &nvme_traffic_},
                               shards);
  };
  // Note [Coloured arrays]: the five arrays one optimizer kernel streams each get their own colour.
  TZ_ASSIGN_OR_RETURN(param16_, make(StateClass::kParam16, dtype_bytes(param_type_), Colour::kParam16));
  TZ_ASSIGN_OR_RETURN(grad_, make(StateClass::kGrad, 4, Colour::kGrad));
  TZ_ASSIGN_OR_RETURN(master_, make(StateClass::kMaster, 4, Colour::kMaster));
  if (!adagrad) {
    TZ_ASSIGN_OR_RETURN(exp_avg_, make(StateClass::kMoments, 4, Colour::kExpAvg));
  }
  if (!lion) {
    TZ_ASSIGN_OR_RETURN(exp_avg_sq_, make(StateClass::kMoments, 4, Colour::kExpAvgSq));
  }
  return ok_status();
}

// The NVMe bytes and busy time the next step report counts start from here.
void ZeroEngineImpl::reset_io_counters() {
  nvme_traffic_.reset();
  (void)take_io_busy_seconds();
}

std::pair<double, double> ZeroEngineImpl::take_io_busy_seconds() {
  if (!io_) return {0, 0};
  const nvme::EngineStats io = io_->stats();
  const std::uint64_t read = io.read_busy_ns - std::exchange(read_busy_seen_ns_, io.read_busy_ns);
  const std::uint64_t write = io.write_busy_ns - std::exchange(write_busy_seen_ns_, io.write_busy_ns);
  return {static_cast<double>(read) / 1e9, static_cast<double>(write) / 1e9};
}

void ZeroEngineImpl::make_sub_groups() {
  const auto limit = static_cast<std::uint64_t>(std::max<std::int64_t>(options_.config.zero.sub_group_size, 1));
  std::uint64_t in_group = 0;
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    const std::uint64_t n = layout_.blocks[b].shard_numel;
    if (sub_groups_.empty() || in_group + n > limit) {
      sub_groups_.emplace_back();
      in_group = 0;
    }
    sub_groups_.back().push_back(b);
    offset_in_group_.push_back(in_group);
    in_group += n;
    sub_group_max_numel_ = std::max(sub_group_max_numel_, in_group);
  }
}

Status ZeroEngineImpl::init(const std::vector<BlockSpec>& model, const ParamInit& init) {
  const Config& c = options_.config;
  stage_ = c.zero.stage;
  // Neither fp16 nor bf16: fp32 training, as in DeepSpeed.
  param_type_ = c.precision.fp16 ? DType::kFp16 : c.precision.bf16 ? DType::kBf16 : DType::kFp32;
  grad_type_ = options_.grad_type.value_or(param_type_);
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
  TZ_ASSIGN_OR_RETURN(cpu_opt_, cpu_adam::CpuOptimizer::create({}));
  make_sub_groups();
  const std::size_t blocks = layout_.blocks.size();
  grad_fresh_.assign(blocks, false);
  TZ_ASSIGN_OR_RETURN(d2h_stream_, device_->create_stream());
  TZ_ASSIGN_OR_RETURN(comm_stream_, device_->create_stream());
  comm_thread_ = std::make_unique<detail::TaskThread>("comm");
  grad_thread_ = std::make_unique<detail::TaskThread>("grad");
  grads_ = std::make_unique<detail::GradientPath>(detail::GradientPathDeps{
      .device = device_, .comm = comm_, .comm_thread = comm_thread_.get(), .grad_thread = grad_thread_.get(),
      .comm_stream = comm_stream_.get(), .d2h_stream = d2h_stream_.get(), .device_pool = device_pool_.get(),
      .host_pool = host_pool_.get(), .grad = grad_.get(), .cpu_opt = cpu_opt_.get(), .layout = &layout_,
      .grad_type = grad_type_, .stage = stage_, .gradient_accumulation_steps = gas_, .on_device = gpu_optimizer_,
      .timeline = &timeline_});
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
  const std::uint64_t window =
      static_cast<std::uint64_t>(std::max<std::int64_t>(c.zero.stage3_prefetch_bucket_size, 0)) *
      dtype_bytes(param_type_);
  prefetcher_ = std::make_unique<detail::Prefetcher>(
      detail::PrefetchDeps{.device = device_, .comm = comm_, .comm_thread = comm_thread_.get(),
                           .comm_stream = comm_stream_.get(),
                           .device_pool = device_pool_.get(), .host_pool = host_pool_.get(),
                           .param16 = param16_.get(), .layout = &layout_, .param_type = param_type_,
                           .timeline = &timeline_},
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
  unset_.assign(layout_.blocks.size(), from == InitialValues::kSetLater);
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    const BlockLayout& block = layout_.blocks[b];
    std::vector<float> whole;
    if (from != InitialValues::kSetLater) {
      whole.assign(block.whole_numel, 0.0F);
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
    Status written = [&]() -> Status {
      const std::vector<float> zeros(block.shard_numel, 0.0F);
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
  }
  return gather_persistent();
}

// ---------------------------------------------------------------- movement

Status ZeroEngineImpl::sync() { return device_->synchronize_stream(*stream_); }

Status ZeroEngineImpl::check_values_set(std::size_t block, std::string_view what) const {
  if (!unset_[block]) return ok_status();
  return failed_precondition("{}: block '{}' has no values yet (the engine was made with initial_values = kSetLater, "
                             "and {} of its {} blocks are still unset): set_master() it, or load a checkpoint",
                             what, layout_.blocks[block].name, std::count(unset_.begin(), unset_.end(), true),
                             layout_.blocks.size());
}

Status ZeroEngineImpl::check_all_values_set(std::string_view what) const {
  const auto first = std::find(unset_.begin(), unset_.end(), true);
  return first == unset_.end() ? ok_status() : check_values_set(static_cast<std::size_t>(first - unset_.begin()), what);
}

Status ZeroEngineImpl::put_weights(std::size_t block, const float* shard) {
  TZ_TRY(put(*master_, block, shard));
  return put(*param16_, block, to_param_type(shard, layout_.blocks[block].shard_numel, param_type_).data());
}

Status ZeroEngineImpl::gather_persistent(bool unset_too) {
  // Note [Stream-ordered release]: a failed wait leaves the readers' end unknown.
  TZ_TRY(release_failure());
  TZ_TRY(device_->synchronize_event(*persistent_read_));
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    if (persistent_[b].valid() && (unset_too || !unset_[b])) {  // else gathered when set_master sets it
      TZ_TRY_CTX(prefetcher_->gather_into(b, persistent_[b].data()), "gathering {}", layout_.blocks[b].name);
    }
  }
  return ok_status();
}

Expected<GatheredBlock> ZeroEngineImpl::fetch(std::size_t block, FetchFor purpose) {
  if (block >= layout_.blocks.size()) {
    return invalid_argument("fetch: block {} does not exist (the model has {})", block, layout_.blocks.size());
  }
  TZ_TRY(release_failure());
  TZ_TRY(check_values_set(block, "fetch"));
  const BlockLayout& b = layout_.blocks[block];
  if (persistent_[block].valid()) {
    return GatheredBlock(this, block, persistent_[block].data(), param_type_, &b, /*persistent=*/true);
  }
  Expected<PoolBlock> whole = prefetcher_->acquire(block, purpose == FetchFor::kTraining);
  TZ_TRY_CTX(whole, "fetching {}", b.name);
  void* data = whole->data();
  live_.emplace(data, std::move(*whole));
  live_since_[data] = std::chrono::steady_clock::now();
  return GatheredBlock(this, block, data, param_type_, &b, /*persistent=*/false);
}

Status ZeroEngineImpl::rewind_fetches(const FetchMark& mark) {
  TZ_TRY(release_failure());
  return prefetcher_->rewind(mark);
}

void ZeroEngineImpl::end_compute(std::size_t block, void* data) {
  auto since = live_since_.find(data);
  if (since != live_since_.end()) {
    timeline_.record(detail::Track::kCompute, layout_.blocks[block].name, since->second,
                     std::chrono::steady_clock::now());
    live_since_.erase(since);
  }
}

void ZeroEngineImpl::release(std::size_t block, void* data) {
  end_compute(block, data);
  live_.erase(data);  // a persistent block's buffer is not in live_, and stays
}

// Note [Stream-ordered release]
Status ZeroEngineImpl::release_after(std::size_t block, void* data, Stream* stream, void* native) {
  const bool persistent = persistent_[block].valid() && persistent_[block].data() == data;
  if (stream == nullptr && device_->kind() == BackendKind::kHost) {
    if (!persistent) release(block, data);  // on the Host backend no foreign stream has work queued
    return ok_status();
  }
  end_compute(block, data);
  PoolBlock buffer;  // stays invalid for a persistent block
  if (auto live = live_.find(data); live != live_.end()) {
    buffer = std::move(live->second);
    live_.erase(live);
  }
  Status s = stream != nullptr ? device_->record_event(*reader_done_, *stream) : ok_status();
  if (s.ok()) {
    s = stream != nullptr ? device_->stream_wait_event(*release_stream_, *reader_done_)
                          : device_->stream_wait_native(*release_stream_, native);
  }
  if (s.ok()) {
    // The pool drains release_stream_ itself when it cannot record its event, and then reuses the buffer.
    s = buffer.valid() ? device_pool_->release_after(std::move(buffer), *release_stream_)
                       : device_->record_event(*persistent_read_, *release_stream_);
  }
  if (s.ok()) return s;
  if (buffer.valid()) quarantined_.push_back(std::move(buffer));  // when its readers end is unknown
  s = std::move(s).with_context(fmt::format("releasing {} after its readers' stream", layout_.blocks[block].name));
  if (release_error_.ok()) release_error_ = s;
  return s;
}

Expected<GradBlock> ZeroEngineImpl::grad_buffer(std::size_t block) {
  if (block >= layout_.blocks.size()) {
    return invalid_argument("grad_buffer: block {} does not exist (the model has {})", block, layout_.blocks.size());
  }
  TZ_TRY(release_failure());
  const BlockLayout& b = layout_.blocks[block];
  GradBlock g;
  g.block_ = block;
  g.type_ = grad_type_;
  g.layout_ = &b;
  TZ_ASSIGN_OR_RETURN(g.buffer_, device_pool_->allocate(b.whole_numel * dtype_bytes(grad_type_)));
  if (device_->kind() == BackendKind::kHost) {
    // Host "device" memory is host memory, and a block from the pool has no
    // stream work pending: a round trip through the stream thread would only
    // add latency to every backward call.
    std::memset(g.buffer_.data(), 0, g.buffer_.size_bytes());
  } else {
    TZ_TRY(device_->memset_async(g.buffer_.data(), 0, g.buffer_.size_bytes(), *stream_));
    TZ_TRY(sync());
  }
  return g;
}

Status ZeroEngineImpl::reduce_grads(GradBlock grads) {
  if (!grads.valid()) return invalid_argument("reduce_grads: an empty gradient buffer");
  TZ_TRY(release_failure());
  TZ_TRY(grads_->error());
  const std::size_t block = grads.block();
  const bool first = !grad_fresh_[block];
  grad_fresh_[block] = true;
  return grads_->reduce(block, std::move(grads.buffer_), first);  // gradient_path.h
}

Expected<std::vector<float>> ZeroEngineImpl::gather_master(std::size_t block) {
  if (block >= layout_.blocks.size()) return invalid_argument("gather_master: block {} does not exist", block);
  TZ_TRY(check_values_set(block, "gather_master"));
  const BlockLayout& b = layout_.blocks[block];
  std::vector<float> whole(b.whole_numel);
  float* mine = whole.data() + static_cast<std::uint64_t>(comm_->rank()) * b.shard_numel;
  TZ_TRY(get(*master_, block, mine));
  if (comm_->size() > 1) {
    TZ_TRY(comm_thread_->wait_idle());
    if (device_->kind() != BackendKind::kHost) {
      TZ_ASSIGN_OR_RETURN(PoolBlock d, device_pool_->allocate(whole.size() * 4));
      void* d_mine = static_cast<char*>(d.data()) + static_cast<std::uint64_t>(comm_->rank()) * b.shard_numel * 4;
      TZ_TRY(device_->copy_async(d_mine, mine, b.shard_numel * 4, *stream_));
      TZ_TRY(comm_thread_->run(
          [&] { return comm_->all_gather(d_mine, d.data(), b.shard_numel, DType::kFp32, stream_.get()); }));
      TZ_TRY(device_->copy_async(whole.data(), d.data(), whole.size() * 4, *stream_));
      TZ_TRY(sync());
    } else {
      TZ_TRY(comm_thread_->run([&] { return comm_->all_gather(mine, whole.data(), b.shard_numel, DType::kFp32); }));
    }
  }
  return whole;
}

Status ZeroEngineImpl::set_master(std::size_t block, float* whole, std::size_t count, int root,
                                  const Status& refusal) {
  // Every rank must name the same block and root; then every check (this
  // rank's own failures too) goes through one agreement, so a call refused
  // on one rank fails on all of them instead of leaving the others waiting
  // in the broadcast.
  const bool exists = block < layout_.blocks.size();
  TZ_TRY(ranks_->agree_on(fmt::format("block {}{} from rank {}", block, exists ? " (" + layout_.blocks[block].name + ")" : "",
                                   root),
                       "set_master", "blocks or roots", "pass the same block and root"));
  const Status checked = [&]() -> Status {
    if (!refusal.ok()) return refusal;
    TZ_TRY(release_failure());
    TZ_TRY(comm_thread_->wait_idle());
    TZ_TRY(grad_thread_->wait_idle());
    if (!exists) return invalid_argument("set_master: block {} does not exist", block);
    const BlockLayout& b = layout_.blocks[block];
    if (count != b.whole_numel) {
      return invalid_argument("set_master: {} values for block '{}', which has {} (whole_numel, as gather_master "
                              "gives)", count, b.name, b.whole_numel);
    }
    if (root < 0 || root >= comm_->size()) {
      return invalid_argument("set_master: root rank {} is not one of the {} rank(s)", root, comm_->size());
    }
    if (!live_.empty()) {
      return failed_precondition("set_master({}): {} gathered block(s) still out (a forward or backward under "
                                 "way?); release them first",
                                 b.name, live_.size());
    }
    return ok_status();
  }();
  TZ_TRY(agree(checked, "set_master"));
  const BlockLayout& b = layout_.blocks[block];
  TZ_TRY(comm_thread_->run([&] {
    return detail::broadcast_host(*comm_, *device_, *device_pool_, whole, count * sizeof(float), root);
  }));
  // Prefetched blocks hold the old parameters, and their reads would race
  // the writes: dropped now, issued again after.
  prefetcher_->drop_in_flight();
  // Each step is agreed before the next collective, so a rank that failed
  // one does not meet the others' collectives with its own.
  const float* shard = whole + static_cast<std::uint64_t>(comm_->rank()) * b.shard_numel;
  const Status written = [&]() -> Status {
    TZ_TRY(put_weights(block, shard));
    // Note [Stream-ordered release]: a persistent block's readers are done before it is rewritten.
    return persistent_[block].valid() ? device_->synchronize_event(*persistent_read_) : ok_status();
  }();
  TZ_TRY(agree(written, fmt::format("set_master({})", b.name)));
  if (persistent_[block].valid()) {
    TZ_TRY(agree(prefetcher_->gather_into(block, persistent_[block].data()), fmt::format("set_master({})", b.name)));
  }
  unset_[block] = false;
  return prefetcher_->reissue();
}

std::string ZeroEngineImpl::describe() const {
  // Shards are padded (Note [Chunk layout]), so on a model of small blocks the count per rank can exceed
  // the model's: say why rather than print a count that looks wrong.
  const std::uint64_t padding = layout_.shard_numel * comm_->size() - layout_.param_numel;
  const std::string padded =
      padding * 10 > layout_.param_numel
          ? fmt::format(" with padding: a block's shard is whole runs of {} elements", kShardAlignElems)
          : std::string();
  std::string out = fmt::format("ZeRO stage {} over {} rank(s) ({}), {} blocks, {} parameters ({} per rank{}), {} params, "
                                "{} gradients; device {}",
                                stage_, comm_->size(), comm_->describe(), layout_.blocks.size(),
                                format_count(static_cast<double>(layout_.param_numel)),
                                format_count(static_cast<double>(layout_.shard_numel)), padded,
                                dtype_name(param_type_), dtype_name(grad_type_), device_->name());
  for (std::size_t s = 0; s < kNumStateClasses; ++s) {
    out += fmt::format("; {} on {}", state_class_name(static_cast<StateClass>(s)), tier_name(plan_.tier[s]));
  }
  if (io_) out += fmt::format("; NVMe: {}", io_->describe());
  return out;
}

// ---------------------------------------------------------------- factory

Expected<std::unique_ptr<ZeroEngine>> ZeroEngine::create(const ZeroOptions& options, const std::vector<BlockSpec>& model,
                                                         const ParamInit& init) {
  if (!init && options.initial_values != InitialValues::kSetLater) {
    return invalid_argument("ZeroEngine::create: no parameter initialiser given (only initial_values = kSetLater "
                            "takes none)");
  }
  const std::string& type = options.config.optimizer.type;
  if (type != "Adam" && type != "AdamW" && type != "Adagrad" && type != "Lion") {
    return invalid_argument("optimizer.type = \"{}\": the engine steps Adam, AdamW, Adagrad or Lion", type);
  }
  if (options.config.optimizer.amsgrad) {
    return invalid_argument("optimizer.params.amsgrad = true is not supported by the engine yet");
  }
  const SchedulerConfig& sched = options.config.scheduler;
  if (!sched.unresolved_auto.empty()) {
    return invalid_argument("{}: scheduler.params.{} = \"auto\": give the number of optimizer steps (the Hugging "
                            "Face Trainer fills these in; tierzero has nothing to fill them from)",
                            options.config.source, fmt::join(sched.unresolved_auto, ", scheduler.params."));
  }
  if (sched.warmup_max_lr_auto && sched.type != SchedulerType::kWarmupCosineLR &&
      options.config.optimizer.lr < sched.warmup_min_lr) {
    return invalid_argument("{}: scheduler.params.warmup_max_lr = \"auto\" is the optimizer's lr, {}, which is below "
                            "warmup_min_lr = {}", options.config.source, options.config.optimizer.lr,
                            sched.warmup_min_lr);
  }
  auto engine = std::make_unique<ZeroEngineImpl>(options);
  TZ_TRY(engine->init(model, init));
  return std::unique_ptr<ZeroEngine>(std::move(engine));
}

}  // namespace tz
