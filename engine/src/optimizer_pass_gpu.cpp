// The GPU optimizer pass: Adam on the device-resident shards.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "optimizer_passes.h"
#include "tierzero/common/state_math.h"
#include "tierzero/kernels.h"

namespace tz::detail::optimizer_pass_impl {
namespace {

// Note [GPU optimizer] (gradient_path.cpp): Adam on the device-resident shards.
class GpuOptimizerPass final : public OptimizerPass {
 public:
  explicit GpuOptimizerPass(const OptimizerPassDeps& deps) : deps_(deps) {}
  Status run(const cpu_adam::Hyper& h, std::int64_t step, double grad_scale, const std::vector<bool>& skip) override;
  std::size_t sub_groups() const override { return 1; }

 private:
  kernels::AdamCompactTensors compact_tensors(std::size_t b, float* master, std::uint16_t* param16,
                                              std::int64_t step) const;
  Status upload_int8_tables();
  // Note [GPU optimizer copy-out]: the device buffer and the two pinned
  // buffers the new 16-bit parameters leave through when they live off the
  // GPU, and each pinned buffer's writes to their tier in flight.
  struct CopyOut {
    PoolBlock device;
    PoolBlock host[2];
    std::vector<nvme::IoFuture> writes[2];
  };
  Status step_block(std::size_t b, const kernels::AdamHyper& h, CopyOut& out);
  Status launch(std::size_t b, const kernels::AdamCompactTensors& t, const kernels::AdamHyper& h);
  Status make_copy_out(std::size_t bytes, bool host_buffers, CopyOut& out) const;

  OptimizerPassDeps deps_;
  // Note [Int8 moments on the GPU optimizer]: cpu_adam's code tables in device
  // memory, exp_avg's decode and mid then exp_avg_sq's (4 x 256 fp32).
  PoolBlock int8_tables_;
};

// Note [Compact states on the GPU optimizer]
// With tierzero.states.master = "remainder" or moments = "bf16" or "int8" the
// GPU tier's stores hold the compact shards (Note [Stored remainder shards]:
// remainders, then tie bits, beside the bf16 parameter shard; Note [Stored
// int8 moment shards]: codes, then block scales), and the pass steps every
// format with the compact kernel (Note [Compact Adam arithmetic] in
// kernels/src/adam_math.h), which gives cpu_adam's bits for the same
// gradient scale: the rounding key and index are spans_of's, the block and
// rank * shard_numel, so a bf16 second moment rounds as it would in CPU
// memory; int8 moments decode, step and encode per 256-element block with
// cpu_adam's tables (Note [Int8 moments on the GPU optimizer]). fp32 states
// take the same kernel, so a remainder run on the GPU is an fp32-master run
// on the GPU bit for bit, as on the CPU. (The two optimizers' runs still
// differ where the gradient norm does: the device sums it in another order,
// Note [Deterministic norms], and clipping scales by it.) A remainder master
// reads and rewrites the bf16 parameter shard; when the parameters do not
// live on the GPU it goes up before the step and down after it, as the
// copy-out does.
//
// Note [Int8 moments on the GPU optimizer]
// An int8 block's scale is of all its 256 elements after the step, so a
// block must step in one call, and a weight-decay segment (a bias, a norm)
// may begin or end inside one. So the pass launches once per shard and hands
// the kernel the segments as weight-decay runs (every element finds its own
// weight decay; kernels.h AdamCompactTensors::weight_decay_runs), for every
// format: one launch per block instead of one per segment. A shard starts a
// quantization block (its codes and scales are its own, Note [Stored int8
// moment shards]) and its tie bits start a byte, as the int8 kernel needs.
// The code tables (cpu_adam::int8_code_tables, 4 KiB) go up once, on the
// first step, through a pinned block; cpu_adam builds the same ones, so both
// optimizers write the same codes (Note [Int8 moments on the GPU] in
// kernels/src/int8_math.h) and a checkpoint moves between them as it is.
Status GpuOptimizerPass::upload_int8_tables() {
  if (deps_.moment_dtype != DType::kUint8 || int8_tables_.data() != nullptr) return ok_status();
  constexpr std::size_t kTable = 256 * sizeof(float);
  TZ_ASSIGN_OR_RETURN(PoolBlock host, deps_.host_pool->allocate(4 * kTable));
  auto* out = static_cast<char*>(host.data());
  for (cpu_adam::Int8Moment which : {cpu_adam::Int8Moment::kExpAvg, cpu_adam::Int8Moment::kExpAvgSq}) {
    const cpu_adam::Int8CodeTables t = cpu_adam::int8_code_tables(which);
    std::memcpy(out, t.decode, kTable);
    std::memcpy(out + kTable, t.mid, kTable);
    out += 2 * kTable;
  }
  TZ_ASSIGN_OR_RETURN(int8_tables_, deps_.device_pool->allocate(4 * kTable));
  TZ_TRY(deps_.device->copy_async(int8_tables_.data(), host.data(), 4 * kTable, *deps_.stream));
  return deps_.device->synchronize_stream(*deps_.stream);  // before `host` goes back to its pool
}

kernels::AdamCompactTensors GpuOptimizerPass::compact_tensors(std::size_t b, float* master, std::uint16_t* param16,
                                                               std::int64_t step) const {
  const std::uint64_t n = deps_.layout->blocks[b].shard_numel;
  const bool remainder = deps_.master_format == MasterFormat::kRemainder;
  const bool int8 = deps_.moment_dtype == DType::kUint8;
  auto* stored = static_cast<std::uint8_t*>(deps_.master->device_memory(b));
  const std::uint64_t index = static_cast<std::uint64_t>(deps_.rank) * n;  // as spans_of
  const auto scales = [&](void* codes) {  // Note [Stored int8 moment shards]
    return int8 ? reinterpret_cast<float*>(static_cast<std::uint8_t*>(codes) + int8_moment_scales_offset(n)) : nullptr;
  };
  const auto* tables = static_cast<const float*>(int8_tables_.data());  // null without int8 moments
  return {.master_format = deps_.master_format,
          .master = master,
          .param16 = remainder || deps_.param_type == DType::kBf16 ? param16 : nullptr,
          .remainder = remainder ? reinterpret_cast<std::int16_t*>(stored) : nullptr,
          .tie_bits = remainder ? stored + remainder_tie_bits_offset(n) : nullptr,
          .grad = static_cast<const float*>(deps_.grad->device_memory(b)),
          .moment_format = int8                                   ? MomentFormat::kInt8
                           : deps_.moment_dtype == DType::kBf16 ? MomentFormat::kBf16
                                                                : MomentFormat::kFp32,
          .exp_avg = deps_.exp_avg->device_memory(b),
          .exp_avg_sq = deps_.exp_avg_sq->device_memory(b),
          .sr_key = state_math::sr_step_key(b, step, index),
          .sr_base = static_cast<std::uint32_t>(index),
          .exp_avg_scale = scales(deps_.exp_avg->device_memory(b)),
          .exp_avg_sq_scale = scales(deps_.exp_avg_sq->device_memory(b)),
          .exp_avg_code = {tables, tables == nullptr ? nullptr : tables + 256},
          .exp_avg_sq_code = {tables == nullptr ? nullptr : tables + 512, tables == nullptr ? nullptr : tables + 768}};
}

// Note [GPU optimizer copy-out]
// With the 16-bit parameters off the GPU (pinned CPU memory or NVMe) the new
// ones are written into a device buffer, copied down once into a pinned pool
// block (page-aligned, as O_DIRECT wants) and written to their tier from
// there: write_back, not put(), which staged them a second time in a pool
// block of its own (one more host copy of 2 B/param). Two pinned buffers
// alternate, so block b's NVMe write drains while block b + 1 steps; a buffer
// is reused only once its last write is done, and run() returns only when
// every write is. A remainder master's bf16 half is read from its tier into
// the same buffer (read_into: no staging of its own either) and goes up
// before the step. Bytes moved per step are unchanged: 2 B/param down over
// PCIe and to the parameters' tier (and 2 B/param read and up with remainders).
// In pinned CPU memory the shard itself is the pinned buffer: the copies go
// straight to and from it (read_into and write_back copy nothing then). Going
// through a pool block cost two single-thread host copies of 2 B/param a
// step, 4.0 of the 8.1B compact run's 6.7 s a step on the H200.
Status GpuOptimizerPass::make_copy_out(std::size_t bytes, bool host_buffers, CopyOut& out) const {
  if (out.device.size_bytes() >= bytes && (!host_buffers || out.host[0].size_bytes() >= bytes)) return ok_status();
  for (std::vector<nvme::IoFuture>& writes : out.writes) TZ_TRY(wait_all(writes));  // before a buffer goes
  TZ_ASSIGN_OR_RETURN(out.device, deps_.device_pool->allocate(bytes));
  for (PoolBlock& host : out.host) {
    if (!host_buffers) break;
    TZ_ASSIGN_OR_RETURN(host, deps_.host_pool->allocate(bytes));
  }
  return ok_status();
}

// One launch per shard, its weight-decay segments as runs (Note [Int8
// moments on the GPU optimizer]).
Status GpuOptimizerPass::launch(std::size_t b, const kernels::AdamCompactTensors& t, const kernels::AdamHyper& h) {
  std::vector<kernels::WeightDecayRun> runs;
  for (const cpu_adam::WeightDecaySegment& seg : segments_of(deps_, b)) {
    runs.push_back({seg.begin, seg.end, seg.weight_decay});
  }
  kernels::AdamCompactTensors call = t;
  call.weight_decay_runs = runs.data();
  call.weight_decay_run_count = runs.size();
  TZ_TRY_CTX(kernels::adam_step_compact_cuda(call, deps_.layout->blocks[b].shard_numel, h,
                                             deps_.stream->native_handle()),
             "stepping {} on the GPU", deps_.layout->blocks[b].name);
  return ok_status();
}

Status GpuOptimizerPass::step_block(std::size_t b, const kernels::AdamHyper& h, CopyOut& out) {
  Stream& stream = *deps_.stream;
  TieredStore& param16_store = *deps_.param16;
  const std::uint64_t n = deps_.layout->blocks[b].shard_numel;
  const std::size_t bytes = param16_store.shard_bytes(b);
  const bool params_on_gpu = param16_store.device_memory(0) != nullptr;
  const bool remainder = deps_.master_format == MasterFormat::kRemainder;
  auto* master = remainder ? nullptr : static_cast<float*>(deps_.master->device_memory(b));
  auto* param16 = static_cast<std::uint16_t*>(params_on_gpu ? param16_store.device_memory(b) : nullptr);
  const std::size_t k = b % 2;
  void* const in_place = param16_store.host_memory(b);  // pinned CPU memory: no buffer between
  void* host = nullptr;
  if (!params_on_gpu) {
    TZ_TRY(make_copy_out(bytes, in_place == nullptr, out));
    TZ_TRY_CTX(wait_all(out.writes[k]), "writing the new parameters of the block before {}", deps_.layout->blocks[b].name);
    param16 = static_cast<std::uint16_t*>(out.device.data());
    host = in_place != nullptr ? in_place : out.host[k].data();
    if (remainder) {  // a remainder master's bf16 half is the parameter: up to the device first
      std::vector<nvme::IoFuture> reads;
      TZ_TRY_CTX(param16_store.read_into(b, host, stream, reads), "reading the parameters of {}",
                 deps_.layout->blocks[b].name);
      TZ_TRY_CTX(wait_all(reads), "reading the parameters of {}", deps_.layout->blocks[b].name);
      TZ_TRY(deps_.device->copy_async(param16, host, bytes, stream));
    }
  }
  TZ_TRY(launch(b, compact_tensors(b, master, param16, h.step), h));
  if (deps_.param_type == DType::kFp16) {
    TZ_TRY(kernels::cast_fp32_to_fp16_cuda(master, param16, n, stream.native_handle()));
  }
  if (deps_.param_type == DType::kFp32) TZ_TRY(deps_.device->copy_async(param16, master, n * 4, stream));
  if (params_on_gpu) return ok_status();
  TZ_TRY(deps_.device->copy_async(host, param16, bytes, stream));
  TZ_TRY(deps_.device->synchronize_stream(stream));  // down before the next block's step rewrites the device buffer
  TZ_TRY_CTX(param16_store.write_back(b, host, stream, out.writes[k]), "writing the new parameters of {}",
             deps_.layout->blocks[b].name);
  return ok_status();
}

Status GpuOptimizerPass::run(const cpu_adam::Hyper& c, std::int64_t step, double grad_scale,
                             const std::vector<bool>& skip) {
  if (std::find(skip.begin(), skip.end(), true) != skip.end()) {
    return internal_error("the GPU optimizer pass steps every block (nothing steps under backward on it)");
  }
  const kernels::AdamHyper h{.lr = c.lr, .beta1 = c.beta1, .beta2 = c.beta2, .eps = c.eps,
                             .weight_decay = c.weight_decay, .adamw = c.algorithm == cpu_adam::Algorithm::kAdamW,
                             .step = step, .grad_scale = grad_scale};
  const auto begin = std::chrono::steady_clock::now();
  TZ_TRY_CTX(upload_int8_tables(), "uploading the int8 moment code tables");
  CopyOut out;
  Status stepped;
  for (std::size_t b = 0; b < deps_.layout->blocks.size() && stepped.ok(); ++b) stepped = step_block(b, h, out);
  // Every write lands (or fails) before the pass returns, also after a failure: the buffers go with `out`.
  Status written = wait_all(out.writes[0]);
  Status written_odd = wait_all(out.writes[1]);
  TZ_TRY(stepped);
  TZ_TRY_CTX(written, "writing the new parameters");
  TZ_TRY_CTX(written_odd, "writing the new parameters");
  TZ_TRY(deps_.device->synchronize_stream(*deps_.stream));
  deps_.timeline->record(Track::kOptimizer, "GPU Adam", begin, std::chrono::steady_clock::now());
  return ok_status();
}

}  // namespace

std::unique_ptr<OptimizerPass> make_gpu_pass(const OptimizerPassDeps& deps) {
  return std::make_unique<GpuOptimizerPass>(deps);
}

}  // namespace tz::detail::optimizer_pass_impl
