// ZeroEngine: its handles, fetching parameters, gradients into the gradient
// path, set_master/gather_master, the factory. Creation is in
// zero_engine_setup.cpp, the step in optimizer_step.cpp, checkpoints in
// checkpoint.cpp.
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include "tierzero/kernels.h"
#include "tierzero/comm/host_collectives.h"
#include "zero_engine_impl.h"

namespace tz {

std::vector<std::uint8_t> to_param_type(const float* src, std::size_t n, DType type) {
  std::vector<std::uint8_t> out(n * dtype_bytes(type));
  // On every core: start-up and checkpoint loads convert billions of elements.
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n, std::size_t{1} << 16), [&](const auto& r) {
    const std::size_t k = r.size();
    auto* to = reinterpret_cast<std::uint16_t*>(out.data()) + r.begin();
    switch (type) {
      case DType::kFp32: std::memcpy(out.data() + r.begin() * 4, src + r.begin(), k * 4); break;
      case DType::kBf16: kernels::cast_fp32_to_bf16_cpu(src + r.begin(), to, k); break;
      case DType::kFp16: kernels::cast_fp32_to_fp16_cpu(src + r.begin(), to, k); break;
      default: break;  // creation refuses other parameter types
    }
  });
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

// ---------------------------------------------------------------- lifetime

ZeroEngineImpl::~ZeroEngineImpl() {
  prefetcher_.reset();
  if (comm_thread_) (void)comm_thread_->wait_idle();
  if (grad_thread_) (void)grad_thread_->wait_idle();
  // Steps under backward use the stores and the pass: done before they go.
  if (grads_) grads_->set_observer(nullptr);
  ahead_.reset();
  live_.clear();
  persistent_.clear();
  // Stores free their extents and pool blocks before the swap store and pools go.
  param16_.reset();
  grad_.reset();
  master_.reset();
  exp_avg_.reset();
  exp_avg_sq_.reset();
  master_shadow_.reset();
  exp_avg_shadow_.reset();
  exp_avg_sq_shadow_.reset();
  optimizer_.reset();  // its staging goes back to the pools before they go
}

// ---------------------------------------------------------------- movement

Status ZeroEngineImpl::sync() { return device_->synchronize_stream(*stream_); }

// Note [Remainder masters in the engine]
// With tierzero.states.master = "remainder" the master store holds, per
// shard, int16 remainders and tie bits (Note [Stored remainder shards]), and
// the fp32 master is rebuilt from them and the bf16 parameter shard the
// param16 store already holds (Note [Master remainder]). So a master is put
// by splitting it (the bf16 half is the parameter), read back by joining the
// two stores, and stepped by the CPU optimizer pass reading the parameter
// shard in beside the remainders (Note [Remainder traffic] counts it). The
// split is exact both ways: an fp32 master saved by one run loads into a
// remainder run and back bit for bit, so checkpoints and exports always hold
// the rebuilt fp32 master, whatever the run's format.
Status ZeroEngineImpl::put_weights(std::size_t block, const float* shard) {
  const std::uint64_t n = layout_.blocks[block].shard_numel;
  if (options_.config.states.master == MasterFormat::kRemainder) {
    std::vector<std::uint16_t> bf16(n);
    std::vector<std::uint8_t> stored(master_->shard_bytes(block), 0);  // the padding stays zero
    TZ_TRY(cpu_adam::encode_remainder_masters(shard, n, bf16.data(), reinterpret_cast<std::int16_t*>(stored.data()),
                                              stored.data() + remainder_tie_bits_offset(n)));
    TZ_TRY(put(*master_, block, stored.data()));
    return put(*param16_, block, bf16.data());
  }
  TZ_TRY(put(*master_, block, shard));
  return put(*param16_, block, to_param_type(shard, n, param_type_).data());
}

// Note [Moments in bf16]
// With tierzero.states.moments = "bf16" both moments are stored, moved and
// stepped in bf16 (cpu_adam rounds each new moment to nearest even as it
// stores it). Checkpoints hold them widened to fp32, exactly: a bf16 run
// resumes bit for bit, and an fp32 checkpoint loads into a bf16 run rounded
// to nearest even, as the step itself rounds.
//
// Note [Int8 moments in the engine]
// With "int8" each moment's shard holds its codes and block scales (Note
// [Stored int8 moment shards]), stepped block by block by cpu_adam (Note
// [Int8 moments] in cpu_adam/src/int8_codes.h) or on the GPU with the same
// codes (Note [Int8 moments on the GPU optimizer]). Checkpoints hold them decoded
// to fp32 ("dtype": "fp32" as every format): an int8 run resumes bit for bit
// (decoded values encode to the same codes and scales), and an fp32 or bf16
// checkpoint loads into an int8 run encoded as the step would encode it.
Status ZeroEngineImpl::put_moment(int which, std::size_t block, const float* shard) {
  TieredStore& store = which == 0 ? *exp_avg_ : *exp_avg_sq_;
  if (moment_type() == DType::kFp32) return put(store, block, shard);
  if (moment_type() == DType::kUint8) {
    const std::uint64_t n = layout_.blocks[block].shard_numel;
    std::vector<std::uint8_t> stored(store.shard_bytes(block), 0);  // the padding stays zero
    TZ_TRY(cpu_adam::encode_int8_moment(which == 0 ? cpu_adam::Int8Moment::kExpAvg : cpu_adam::Int8Moment::kExpAvgSq,
                                        shard, n, stored.data(),
                                        reinterpret_cast<float*>(stored.data() + int8_moment_scales_offset(n))));
    return put(store, block, stored.data());
  }
  return put(store, block, to_param_type(shard, layout_.blocks[block].shard_numel, DType::kBf16).data());
}

Status ZeroEngineImpl::get_moment(int which, std::size_t block, float* shard) {
  const TieredStore& store = which == 0 ? *exp_avg_ : *exp_avg_sq_;
  if (moment_type() == DType::kFp32) return get(store, block, shard);
  const std::uint64_t n = layout_.blocks[block].shard_numel;
  if (moment_type() == DType::kUint8) {
    std::vector<std::uint8_t> stored(store.shard_bytes(block));
    TZ_TRY(get(store, block, stored.data()));
    return cpu_adam::decode_int8_moment(which == 0 ? cpu_adam::Int8Moment::kExpAvg : cpu_adam::Int8Moment::kExpAvgSq,
                                        stored.data(),
                                        reinterpret_cast<const float*>(stored.data() + int8_moment_scales_offset(n)), n,
                                        shard);
  }
  std::vector<std::uint16_t> bf16(n);
  TZ_TRY(get(store, block, bf16.data()));
  for (std::uint64_t i = 0; i < n; ++i) shard[i] = kernels::bf16_to_fp32(bf16[i]);  // exact
  return ok_status();
}

Status ZeroEngineImpl::get_master(std::size_t block, float* shard) {
  if (options_.config.states.master != MasterFormat::kRemainder) return get(*master_, block, shard);
  const std::uint64_t n = layout_.blocks[block].shard_numel;
  std::vector<std::uint16_t> bf16(n);
  std::vector<std::uint8_t> stored(master_->shard_bytes(block));
  TZ_TRY(get(*master_, block, stored.data()));
  TZ_TRY(get(*param16_, block, bf16.data()));
  return cpu_adam::decode_remainder_masters(bf16.data(), reinterpret_cast<const std::int16_t*>(stored.data()),
                                            stored.data() + remainder_tie_bits_offset(n), n, shard);
}

Status ZeroEngineImpl::gather_persistent(bool unset_too) {
  // Note [Stream-ordered release]: a failed wait leaves the readers' end unknown.
  TZ_TRY(release_failure());
  TZ_TRY(device_->synchronize_event(*persistent_read_));
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    if (persistent_[b].valid() && (unset_too || blocks_.has_values(b))) {  // else gathered when set_master sets it
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
  TZ_TRY(blocks_.check_set(block, "fetch"));
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

Expected<GradBlock> ZeroEngineImpl::grad_buffer(std::size_t block, GradFill fill) {
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
  if (fill == GradFill::kUninitialised) return g;
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
  TZ_ASSIGN_OR_RETURN(const bool first, blocks_.reduce(block, "reduce_grads"));  // Note [Block states]
  if (micro_ + 1 == gas_) open_step_ahead();  // the window's last micro-batch
  return grads_->reduce(block, std::move(grads.buffer_), first, micro_ + 1 == gas_);  // gradient_path.h
}

Expected<std::vector<float>> ZeroEngineImpl::gather_master(std::size_t block) {
  if (block >= layout_.blocks.size()) return invalid_argument("gather_master: block {} does not exist", block);
  TZ_TRY(blocks_.check_set(block, "gather_master"));
  TZ_TRY(cancel_step_ahead());  // the master as it was before this window's step
  const BlockLayout& b = layout_.blocks[block];
  std::vector<float> whole(b.whole_numel);
  float* mine = whole.data() + static_cast<std::uint64_t>(comm_->rank()) * b.shard_numel;
  TZ_TRY(get_master(block, mine));
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
    TZ_TRY(cancel_step_ahead());
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
  blocks_.set_values(block);
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
  const StateFormats& formats = options_.config.states;
  for (std::size_t s = 0; s < kNumStateClasses; ++s) {
    const auto cls = static_cast<StateClass>(s);
    // The master's and moments' formats (tierzero.states), where they are not fp32.
    std::string format;
    if (cls == StateClass::kMaster && formats.master != MasterFormat::kFp32) {
      format = fmt::format(" ({})", master_format_name(formats.master));
    } else if (cls == StateClass::kMoments && formats.moments != MomentFormat::kFp32) {
      format = fmt::format(" ({})", moment_format_name(formats.moments));
    } else if (cls == StateClass::kGrad && formats.grads != GradFormat::kFp32) {
      format = fmt::format(" ({})", grad_format_name(formats.grads));
    }
    out += fmt::format("; {}{} on {}", state_class_name(cls), format, tier_name(plan_.tier[s]));
  }
  // Note [Stepping under backward]
  if (ahead_ && ahead_off_.empty()) out += "; the optimizer steps under backward";
  if (!ahead_off_.empty()) out += fmt::format("; the optimizer under backward: {}", ahead_off_);
  // Note [The step keeps backward's parameter shards]
  if (kept_params_ && kept_off_.empty()) out += "; the step keeps the 16-bit shards from their fetch";
  if (!kept_off_.empty()) out += fmt::format("; {}", kept_off_);
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
  if (!options.config.unresolved_auto.empty()) {  // Note [Auto values] in common/src/config.cpp
    return invalid_argument("{}: {} = \"auto\": nothing resolves it here; give the value in the config (the "
                            "Hugging Face Trainer fills these in from its TrainingArguments before DeepSpeed reads "
                            "the config; tierzero.torch.initialize takes the config as it is, "
                            "and a default would train another run than the one meant)",
                            options.config.source, fmt::join(options.config.unresolved_auto, " = \"auto\", "));
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
