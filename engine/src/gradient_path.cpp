#include "gradient_path.h"

#include <chrono>
#include <cmath>
#include <map>

#include "tierzero/kernels.h"

namespace tz::detail {

GradientPath::GradientPath(const GradientPathDeps& deps)
    : deps_(deps), sum_squares_(deps.layout->blocks.size(), 0), non_finite_(deps.layout->blocks.size(), false) {}

std::size_t GradientPath::shard_bytes(std::size_t block) const {
  return deps_.layout->blocks[block].shard_numel * dtype_bytes(deps_.grad_type);
}

Status GradientPath::error() const {
  TZ_TRY(deps_.comm_thread->error());
  return deps_.grad_thread->error();
}

Status GradientPath::wait() {
  TZ_TRY(deps_.comm_thread->wait_idle());
  return deps_.grad_thread->wait_idle();
}

// Queued in call order on the comm thread (Note [Collective order]); the
// device-to-host copy and the fp32 accumulation follow on the grad thread,
// so backward goes on while gradients drain.
Status GradientPath::reduce(std::size_t block, PoolBlock whole, bool first, bool last) {
  TZ_TRY(error());
  ++reduced_;
  // Backpressure: at most kMaxPendingGrads blocks' gradients in flight.
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return pending_ < kMaxPendingGrads; });
    ++pending_;
  }
  // Released when the last task holding it is done (or dropped on an error).
  std::shared_ptr<void> pending(nullptr, [this](void*) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      --pending_;
    }
    cv_.notify_all();
  });
  auto held = std::make_shared<PoolBlock>(std::move(whole));
  // Note [Single-rank reduce]
  // With one rank the reduced gradient is the buffer as the caller filled it
  // (a reduce-scatter over one rank is a copy, an all-reduce nothing), and
  // there is no order of collectives to keep with peers. So the buffer goes
  // straight to the grad thread, saving a thread hand-off and, at stages 2
  // and 3, a device copy of the whole block per reduce_grads.
  if (deps_.comm->size() == 1) {
    accumulate_later(block, first, last, held, held->data(), std::move(pending));
    return deps_.grad_thread->error();
  }
  deps_.comm_thread->post([this, block, first, last, held, pending]() -> Status {
    return reduce_on_comm_thread(block, first, last, held, pending);
  });
  return ok_status();
}

Status GradientPath::reduce_on_comm_thread(std::size_t block, bool first, bool last, std::shared_ptr<PoolBlock> whole,
                                           std::shared_ptr<void> pending) {
  if (Status prior = deps_.comm_thread->error(); !prior.ok()) return prior;  // see Prefetcher::post_gather
  const BlockLayout& b = deps_.layout->blocks[block];
  const DType type = (deps_.grad_type);
  const auto start = std::chrono::steady_clock::now();
  // Stages 2 and 3 reduce-scatter; stages 0 and 1 all-reduce the whole
  // buffer and keep their part, as DeepSpeed does.
  auto d_shard = std::make_shared<PoolBlock>();
  const void* shard = nullptr;
  if (deps_.stage >= 2) {
    TZ_ASSIGN_OR_RETURN(*d_shard, deps_.device_pool->allocate(shard_bytes(block)));
    TZ_TRY_CTX(deps_.comm->reduce_scatter(whole->data(), d_shard->data(), b.shard_numel, type, ReduceOp::kSum,
                                          deps_.comm_stream),
               "reduce-scattering the gradients of {}", b.name);
    shard = d_shard->data();
  } else {
    TZ_TRY_CTX(deps_.comm->all_reduce(whole->data(), b.whole_numel, type, ReduceOp::kSum, deps_.comm_stream),
               "all-reducing the gradients of {}", b.name);
    shard = static_cast<const char*>(whole->data()) + static_cast<std::uint64_t>(deps_.comm->rank()) * shard_bytes(block);
  }
  TZ_TRY(deps_.device->synchronize_stream(*deps_.comm_stream));  // NCCL only enqueues
  deps_.timeline->record(Track::kComm, "reduce-scatter " + b.name, start, std::chrono::steady_clock::now());
  // The reduced shard lives in d_shard (stages 2-3) or in the whole buffer.
  std::shared_ptr<void> keep = std::make_shared<std::pair<std::shared_ptr<PoolBlock>, std::shared_ptr<PoolBlock>>>(
      std::move(whole), std::move(d_shard));
  accumulate_later(block, first, last, std::move(keep), shard, std::move(pending));
  return ok_status();
}

// The fp32 accumulation of the reduced shard at `shard`, on the grad thread;
// `keep` holds the memory it lies in until then.
void GradientPath::accumulate_later(std::size_t block, bool first, bool last, std::shared_ptr<void> keep,
                                    const void* shard, std::shared_ptr<void> pending) {
  std::function<Status()> task = [this, block, first, last, keep, shard, pending]() -> Status {
    if (deps_.observer != nullptr) deps_.observer->before_accumulate(block);
    const auto begin = std::chrono::steady_clock::now();
    Status s = deps_.on_device     ? accumulate_on_device(block, shard, first)
               : in_window(block) ? accumulate_in_window(block, shard, first, last)
                                  : accumulate(block, shard, first);
    deps_.timeline->record(Track::kGrad, deps_.layout->blocks[block].name, begin, std::chrono::steady_clock::now());
    if (deps_.observer != nullptr) deps_.observer->after_accumulate(block, s.ok());
    return s;
  };
  if (cheap(block)) {
    deps_.grad_thread->run_inline_or_post(std::move(task));  // reduce() reports its failure at once
  } else {
    deps_.grad_thread->post(std::move(task));
  }
}

// Note [Cheap accumulations run inline]
// With one rank on the Host backend and the fp32 gradient accumulator in
// memory, accumulating a small block's gradients is a few microseconds of
// arithmetic on the CPU, less than waking the grad thread for it (with the
// Note [Single-rank reduce] hand-off gone too, a tiny block's reduce_grads
// from Python went from ~15 to ~7 us; bench/RESULTS.md). Such an
// accumulation runs on the calling thread when the grad thread is idle
// (TaskThread::run_inline_or_post keeps the order); a large block, an NVMe
// accumulator or a GPU's copies still go to the grad thread, where they
// overlap with backward.
bool GradientPath::cheap(std::size_t block) const {
  constexpr std::uint64_t kInlineBytes = 64 * 1024;
  return deps_.comm->size() == 1 && deps_.device->kind() == BackendKind::kHost && !deps_.on_device &&
         deps_.grad->resident() && deps_.grad->shard_bytes(block) <= kInlineBytes;
}

// `bytes` of device memory at `src` in a host staging block, counted as gradient bytes down.
Expected<PoolBlock> GradientPath::copy_down(const void* src, std::size_t bytes) {
  TZ_ASSIGN_OR_RETURN(PoolBlock host, deps_.host_pool->allocate(bytes, Colour::kArrivingGrad));
  TZ_TRY(deps_.device->copy_async(host.data(), src, bytes, *deps_.d2h_stream));
  TZ_TRY(deps_.device->synchronize_stream(*deps_.d2h_stream));
  d2h_bytes_ += bytes;
  return host;
}

// acc = (first ? 0 : acc) + scale * g on the grad tier (read and written back
// when it is NVMe), with the squared norm of the values stored.
Status GradientPath::add_to_grad_tier(std::size_t block, const void* g, DType g_type, bool first, double scale) {
  const BlockLayout& b = deps_.layout->blocks[block];
  TieredStore& grad = *deps_.grad;
  PoolBlock acc_staging;
  void* acc = grad.memory(block);
  if (!grad.resident()) {
    TZ_ASSIGN_OR_RETURN(acc_staging, deps_.host_pool->allocate(grad.shard_bytes(block), Colour::kGrad));
    acc = acc_staging.data();
    if (!first) TZ_TRY(grad.read(block, acc).wait());
  }
  Expected<cpu_adam::GradStats> stats =
      deps_.cpu_opt->accumulate_grad(acc, deps_.acc_type, g, g_type, b.shard_numel, first, scale);
  TZ_TRY_CTX(stats, "accumulating the gradients of {}", b.name);
  if (!grad.resident()) TZ_TRY(grad.write(block, acc).wait());
  sum_squares_[block] = stats->sum_squares;
  non_finite_[block] = stats->non_finite;
  return ok_status();
}

Status GradientPath::accumulate(std::size_t block, const void* d_shard, bool first) {
  TZ_ASSIGN_OR_RETURN(PoolBlock host, copy_down(d_shard, shard_bytes(block)));
  // The mean over ranks and micro-batches, accumulated on the grad tier in
  // fp32 or 16 bits (Note [16-bit gradient accumulators]).
  return add_to_grad_tier(block, host.data(), deps_.grad_type, first, mean_scale());
}

// Note [GPU optimizer]
// With every state class on the GPU (CUDA), nothing leaves the device: the
// reduced shard is added into the fp32 gradient accumulator by a kernel on
// the grad thread's stream, and the host waits for it (the shard's buffer
// goes back to its pool after). No norm per micro-batch: at the window's
// end, window_norms() takes every block's squared norm in one launch of the
// deterministic multi-tensor kernel, one copy and one wait (each tensor's
// sum is the same whether it is reduced alone or with others, so this is the
// per-block norm the path used to take after each accumulation, bit for
// bit). step() runs the Adam kernel over each block's shard with the 16-bit
// copy-out, in every state format (Note [Compact states on the GPU optimizer]
// in optimizer_pass_gpu.cpp). The arithmetic is the CPU
// optimizer's (one fma per accumulated element, Adam as cpu_adam's fused
// kernels compute it), so the engine matches the same in-memory reference on
// either path.
Status GradientPath::accumulate_on_device(std::size_t block, const void* d_shard, bool first) {
  const BlockLayout& b = deps_.layout->blocks[block];
  const double scale = mean_scale();
  auto* acc = static_cast<float*>(deps_.grad->memory(block));
  void* stream = deps_.d2h_stream->native_handle();
  TZ_TRY_CTX(kernels::accumulate_grad_cuda(acc, d_shard, deps_.grad_type, b.shard_numel, first, static_cast<float>(scale), stream),
             "accumulating the gradients of {} on the GPU", b.name);
  return deps_.device->synchronize_stream(*deps_.d2h_stream);
}

// Note [Accumulating on the device across micro-batches]
// With the optimizer on the CPU and G > 1 micro-batches per step, each
// micro-batch's reduced shard used to go down (2 B/param in a 16-bit
// training dtype) and be added into the accumulator on the host: 2G B/param
// of PCIe and G host passes a step. Where the GPU tier's headroom allows, a
// block instead keeps an fp32 accumulator on the device (4 B per shard
// element, blocks backward reaches first taking the room first): each
// micro-batch's shard is added there by the GPU optimizer's accumulation
// kernel, and after the window's last micro-batch the sum goes down once
// (4 B/param) and is stored on the grad tier with its squared norm, as the
// host would have stored it. So PCIe carries 4 B/param a step instead of
// 2G (G = 2: the same bytes in one copy instead of two, and one host pass
// instead of two), and the host's accumulation passes become one store.
// Exact: the kernel's arithmetic is cpu_adam's fused one, x = g * s on a
// window's first micro-batch and fma(s, g, acc) after (Note [16-bit gradient
// accumulators] has the host's), so the sum is the host's bit for bit where
// cpu_adam fuses multiply-adds (AVX2, AVX-512: every x86-64 host a GPU is
// in); the store is a copy (cpu_adam's accumulate with scale 1, which also
// takes the norm of the values stored). fp32 accumulators only: a 16-bit
// accumulator rounds after every micro-batch, which this would skip.
// A block that the window's last micro-batch did not reach is brought down
// by window_norms(), at the step. On the Host backend the "device" is host
// memory and the kernel its CPU twin; tests force it there
// (ZeroOptions::grads_on_device_across_micro_batches) to check the plumbing
// and the twin's arithmetic against cpu_adam's.
Status GradientPath::allocate_window(const std::vector<bool>& on) {
  window_acc_.resize(deps_.layout->blocks.size());
  window_dirty_.assign(deps_.layout->blocks.size(), false);
  for (std::size_t b = 0; b < on.size() && b < window_acc_.size(); ++b) {
    if (!on[b]) continue;
    TZ_ASSIGN_OR_RETURN(window_acc_[b], deps_.device_pool->allocate(deps_.layout->blocks[b].shard_numel * sizeof(float)));
  }
  return ok_status();
}

Status GradientPath::accumulate_in_window(std::size_t block, const void* d_shard, bool first, bool last) {
  const BlockLayout& b = deps_.layout->blocks[block];
  const auto scale = static_cast<float>(mean_scale());
  auto* acc = window_acc_[block].as<float>();
  if (deps_.device->kind() == BackendKind::kHost) {
    kernels::accumulate_grad_cpu(acc, d_shard, deps_.grad_type, b.shard_numel, first, scale);
  } else {
    TZ_TRY_CTX(kernels::accumulate_grad_cuda(acc, d_shard, deps_.grad_type, b.shard_numel, first, scale,
                                             deps_.d2h_stream->native_handle()),
               "accumulating the gradients of {} on the device", b.name);
    TZ_TRY(deps_.device->synchronize_stream(*deps_.d2h_stream));  // before the shard's buffer goes back
  }
  window_dirty_[block] = true;
  return last ? bring_down(block) : ok_status();
}

// The window's sum of `block` from its device accumulator to the grad tier
// (fp32: a copy, scale 1), with its norm.
Status GradientPath::bring_down(std::size_t block) {
  TZ_ASSIGN_OR_RETURN(PoolBlock host, copy_down(window_acc_[block].data(),
                                                deps_.layout->blocks[block].shard_numel * sizeof(float)));
  TZ_TRY(add_to_grad_tier(block, host.data(), DType::kFp32, /*first=*/true, 1.0));
  window_dirty_[block] = false;
  return ok_status();
}

Status GradientPath::window_norms() {
  for (std::size_t b = 0; b < window_dirty_.size(); ++b) {
    if (window_dirty_[b]) TZ_TRY(bring_down(b));
  }
  if (!deps_.on_device) return ok_status();  // accumulate() took each block's norm as it went
  const std::size_t count = deps_.layout->blocks.size();
  std::vector<kernels::TensorRef> shards(count);
  for (std::size_t b = 0; b < count; ++b) {
    shards[b] = {static_cast<const float*>(deps_.grad->memory(b)), deps_.layout->blocks[b].shard_numel};
  }
  TZ_ASSIGN_OR_RETURN(PoolBlock d_norms, deps_.device_pool->allocate(count * sizeof(double)));
  TZ_TRY_CTX(kernels::squared_norms_cuda(shards.data(), count, d_norms.as<double>(), deps_.d2h_stream->native_handle()),
             "the gradient norms of {} blocks", count);
  std::vector<double> norms(count);
  TZ_TRY(deps_.device->copy_async(norms.data(), d_norms.data(), count * sizeof(double), *deps_.d2h_stream));
  TZ_TRY(deps_.device->synchronize_stream(*deps_.d2h_stream));
  for (std::size_t b = 0; b < count; ++b) {
    sum_squares_[b] = norms[b];
    non_finite_[b] = !std::isfinite(norms[b]);
  }
  return ok_status();
}

// The path frees its buffers on worker threads, so how many are live at once
// varies with timing up to the backpressure bound. Caching that many of each
// size now keeps later steps from ever meeting a new high-water mark.
Status GradientPath::prewarm() {
  std::map<std::uint64_t, std::uint64_t> seen;  // whole_numel -> shard_numel
  for (const BlockLayout& b : deps_.layout->blocks) seen.emplace(b.whole_numel, b.shard_numel);
  const std::size_t gbytes = dtype_bytes(deps_.grad_type);
  std::vector<PoolBlock> held;
  for (const auto& [whole, shard] : seen) {
    for (int i = 0; i < kMaxPendingGrads + 1; ++i) {
      TZ_ASSIGN_OR_RETURN(PoolBlock g, deps_.device_pool->allocate(whole * gbytes));
      held.push_back(std::move(g));
    }
    for (int i = 0; deps_.stage >= 2 && i < kMaxPendingGrads; ++i) {
      TZ_ASSIGN_OR_RETURN(PoolBlock d, deps_.device_pool->allocate(shard * gbytes));
      held.push_back(std::move(d));
    }
  }
  return ok_status();  // `held` returns every block to its pool's cache
}

}  // namespace tz::detail
