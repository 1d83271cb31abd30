// ZeroEngine: ZeRO-partitioned, tiered model states and the training step.
//
// The caller registers the model as blocks (tierzero/engine/model.h) and then
// drives each micro-batch block by block, as DESIGN.md's data flow describes:
//
//   TZ_ASSIGN_OR_RETURN(auto engine, tz::ZeroEngine::create(options, model, init));
//   for (micro-batch) {
//     for (b = 0 .. blocks-1) {                       // forward
//       TZ_ASSIGN_OR_RETURN(tz::GatheredBlock p, engine->fetch(b));
//       compute(p.param(0), p.param(1), ...);         // whole 16-bit params, device memory
//     }                                               // p's destructor releases the block
//     for (b = blocks-1 .. 0) {                       // backward
//       TZ_ASSIGN_OR_RETURN(tz::GatheredBlock p, engine->fetch(b));
//       TZ_ASSIGN_OR_RETURN(tz::GradBlock g, engine->grad_buffer(b));   // zeroed, device memory
//       backward(p, g.grad(0), ...);
//       TZ_TRY(engine->reduce_grads(std::move(g)));   // reduce-scatter, accumulate on the grad tier
//     }
//     TZ_ASSIGN_OR_RETURN(tz::StepReport r, engine->step());   // optimizer step at the accumulation boundary
//   }
//
// Parameters are bf16 or fp16 as the config's "bf16"/"fp16" block says, fp32
// when neither is enabled (as in DeepSpeed; the "param16" state class then
// holds fp32 copies of the master weights).
// Each rank holds 1/ranks of every state (ZeRO stage 3: 16-bit params,
// gradients, fp32 master weights, Adam moments), on the tier the placement
// planner chose for its class: device memory, pinned CPU memory, or NVMe
// (the swap store). Stages 1 and 2 keep whole 16-bit parameters on every
// rank's device and shard the rest (stage 1: gradients are all-reduced and
// each rank keeps its part; stage 2: reduce-scattered).
//
// The step: the global gradient norm (each rank's shard norms come with the
// gradient-arrival pass, then one all-reduce), the fp16 overflow check and
// dynamic loss scaling (an overflowing step is skipped and the scale halved
// after `hysteresis` overflows; it doubles after `loss_scale_window` good
// steps), clipping, then CPU Adam over sub-groups of blocks; NVMe-resident
// master weights and moments stream through pinned staging (the next
// sub-group is read while this one steps and the last one is written). The
// new 16-bit parameters go back to their tier.
//
// Threads: fetch/grad_buffer/reduce_grads/step are called from one thread (the
// training loop), in the same order on every rank.
// CUDA: a GatheredBlock's memory goes back to the pool when it is destroyed,
// and a GradBlock's when reduce_grads takes it; the caller's kernels that read
// or write them must be complete by then (synchronise the compute stream), or
// give the block back with release_after(), which lets the caller's kernels
// still be queued (Note [Stream-ordered release]). The CUDA path (the
// engine's tests with a CUDA device, every placement, the GPU optimizer) ran
// on an H100; release_after and set_master were written later and have run
// on the Host backend only.
// Errors: any failure (NVMe, a collective, a budget) fails the call that
// sees it with a Status naming what failed; the engine is then unusable
// (a failed step leaves checkpoints on disk untouched).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tierzero/comm/agreement.h"
#include "tierzero/comm/communicator.h"
#include "tierzero/engine/model.h"
#include "tierzero/nvme.h"
#include "tierzero/offload.h"

namespace tz {

// The 16-bit formats (and fp32, for gradients).

// Fills one parameter's initial fp32 values (which rank's the engine keeps:
// ZeroOptions::initial_values).
using ParamInit = std::function<void(std::size_t block, std::size_t param, float* out, std::uint64_t numel)>;

// Note [Initial values]
// Ranks seeded apart (a rank-dependent seed, for dropout or data order) draw
// different initial weights. Each rank keeping its own shard would train a
// patchwork of them, and a block kept whole on every rank (persistent) would
// start from its owner's shards; DeepSpeed broadcasts rank 0's model at
// start, and so does the engine by default: each block's values, as rank 0's
// init gives them, go to every rank before any is written (one broadcast of
// the model, fp32, at creation). kSameOnEveryRank is the caller's promise
// that every rank's init gives the same values (a fixed seed, a file): the
// broadcast is skipped, and each rank keeps its own. kSetLater writes no
// weights at all: init is not called (it may be empty), the optimizer's
// moments start at zero as always, and every block must get its values from
// set_master() or load_checkpoint() before it is fetched, gathered, stepped
// or saved (refused until then, naming the block). A model made block by
// block elsewhere (tierzero.torch on the meta device) writes each block
// once instead of twice.
enum class InitialValues : std::uint8_t { kRankZero, kSameOnEveryRank, kSetLater };

struct ZeroOptions {
  Config config;                        // zero_optimization, optimizer, fp16/bf16, clipping, aio, tiers
  Communicator* comm = nullptr;         // null: a single rank
  Device* device = nullptr;             // null: created from config.backend (owned by the engine)
  // Gradient type on the device and in the reduce-scatter: fp32, or the
  // parameter type (half the traffic; DeepSpeed's default).
  std::optional<DType> grad_type;    // default: the parameter type
  // Overrides the planner (tests, and users who know better): tier per class.
  std::optional<std::array<Tier, kNumStateClasses>> placement;
  // Whose initial values the engine keeps (Note [Initial values]).
  InitialValues initial_values = InitialValues::kRankZero;
  // tierzero.step_under_backward "auto" steps only blocks whose shard holds
  // at least this many elements under backward; smaller ones step after it
  // (Note [When to speculate]: measured, with compute on the CPU, blocks
  // under 2^20 elements cost more than they hid). true steps every block
  // whatever this says.
  std::uint64_t auto_ahead_min_block_numel = kAutoAheadMinBlockNumel;
  static constexpr std::uint64_t kAutoAheadMinBlockNumel = tz::kAutoAheadMinBlockNumel;  // offload/planner.h
  // "auto" also times its windows and steps after backward for a while where
  // speculating measured slower (Note [When to speculate], the measured
  // pace). false: the calm and back-off rules alone (tests that count windows).
  bool auto_ahead_by_pace = true;
  // Note [Accumulating on the device across micro-batches] (gradient_path.cpp):
  // with the CPU optimizer, fp32 accumulators and gradient_accumulation_steps
  // > 1, blocks keep a device accumulator across the window where the GPU
  // tier's headroom allows. Unset: on CUDA only; true: on the Host backend
  // too (tests); false: never.
  std::optional<bool> grads_on_device_across_micro_batches;
  // With a remainder master and the 16-bit parameters on NVMe, the CPU
  // optimizer's step takes each block's parameter shard from the copy its
  // last fetch read, where the CPU tier's headroom holds it (Note [The step
  // keeps backward's parameter shards] in engine/src/kept_params.h). false:
  // it reads every shard from NVMe again (tests compare the two).
  bool keep_fetched_params = true;
  // With the CPU optimizer, the next forward's first fetches are issued as
  // the step's optimizer pass writes their blocks' new parameters, under its
  // last sub-groups (Note [The next forward's fetches under the optimizer] in
  // engine/src/prefetch.h). false: after the pass, as before (tests and
  // tierzero-overlap-bench compare the two).
  bool next_fetches_under_step = true;
  // Tests only: injects NVMe faults (see tz::nvme::EngineOptions).
  nvme::FaultInjector nvme_fault_injector;
};

// Note [Stream-ordered release]
// A caller that computes on a stream of its own (a framework's compute
// stream) queues kernels reading a gathered block and moves on; the kernels
// may run long after the block is let go. Were the buffer back in the pool at
// once, a prefetch could gather the next block into it under those kernels.
// release_after() gives the block back with the point its reader stream has
// reached: the engine's release stream waits for that point, and the buffer
// is reused only once the release stream passes it (MemoryPool::
// release_after). A persistent block's buffer is not returned, but step() and
// load_checkpoint() rewrite it: they wait for every such point first. Without
// release_after, destroying the block says its readers are done. If the wait
// cannot be queued (a CUDA error; a stream destroyed before the release, or
// one of another device) the buffer is never reused, and every later call of
// the engine fails with that error: where the readers end is unknown, so is
// when a persistent block may be rewritten. The stream must outlive the
// block.

// A whole block's 16-bit parameters on the device, gathered from every rank's
// shard. Move-only; releases the buffer when destroyed.
class GatheredBlock {
 public:
  GatheredBlock() = default;
  ~GatheredBlock();
  GatheredBlock(GatheredBlock&& other) noexcept;
  GatheredBlock& operator=(GatheredBlock&& other) noexcept;

  std::size_t block() const { return block_; }
  void* data() const { return data_; }        // (whole_numel,) param type, device memory
  void* param(std::size_t i) const;           // parameter i's elements (its layout offset)
  DType type() const { return type_; }
  bool valid() const { return data_ != nullptr; }

  // Gives the block back now, while kernels reading it may still be queued on
  // `stream` (one of the engine's device's streams): the buffer is reused only
  // after the work queued on it so far (Note [Stream-ordered release]).
  Status release_after(Stream& stream);
  // The same for a stream the engine's device did not create, as
  // Device::stream_wait_native takes it: a cudaStream_t on CUDA (nullptr: the
  // legacy default stream). On the Host backend a plain release.
  Status release_after_native(void* native_stream);

 private:
  friend class ZeroEngineImpl;
  struct Releaser {
    virtual ~Releaser() = default;
    virtual void release(std::size_t block, void* data) = 0;
    // Waits for `stream` when it is given, else for the native stream.
    virtual Status release_after(std::size_t block, void* data, Stream* stream, void* native) = 0;
  };
  GatheredBlock(Releaser* owner, std::size_t block, void* data, DType type, const BlockLayout* layout,
                bool persistent)
      : owner_(owner), block_(block), data_(data), type_(type), layout_(layout), persistent_(persistent) {}
  void reset();
  Status give_back_after(Stream* stream, void* native);  // the release_after* calls
  Releaser* owner_ = nullptr;
  std::size_t block_ = 0;
  void* data_ = nullptr;
  DType type_ = DType::kBf16;
  const BlockLayout* layout_ = nullptr;
  bool persistent_ = false;  // its buffer stays the engine's: destroying it tells the engine nothing
};

// What a fetch is for. Training fetches follow one order every micro-batch,
// which the engine records and prefetches by (Note [Prefetch window] in
// engine/src/prefetch.h). An evaluation's fetches (a forward with no
// backward, between steps) are fetched on demand and leave that order
// alone: as training fetches they would break it, and pause prefetching at
// every validation pass while the order is recorded again.
enum class FetchFor : std::uint8_t { kTraining, kEvaluation };

// Where a micro-batch's training fetches had got to (ZeroEngine::fetch_mark),
// for rewind_fetches: which micro-batch since the engine was made (or a
// checkpoint loaded), and how many fetches into it.
struct FetchMark {
  std::uint64_t micro_batch = 0;
  std::size_t fetches = 0;
};

// A whole block's gradient buffer on the device (zeroed), for the caller's
// backward to fill; handed back through reduce_grads().
// What grad_buffer leaves in the buffer it hands out.
enum class GradFill : std::uint8_t {
  kZeroed,          // every element zero: the caller may leave parameters (and the gaps) untouched
  kUninitialised,   // the caller writes every element of data(): each parameter's gradient and
                    // zeros elsewhere (the gaps between parameters and the padding are in the
                    // reduced shard and its norm). Saves a pass over the buffer and, on CUDA, a
                    // host wait per block.
};

class GradBlock {
 public:
  GradBlock() = default;
  GradBlock(GradBlock&&) noexcept = default;
  GradBlock& operator=(GradBlock&&) noexcept = default;

  std::size_t block() const { return block_; }
  void* data() const { return buffer_.data(); }  // (whole_numel,) grad type, device memory
  void* grad(std::size_t i) const;
  DType type() const { return type_; }
  bool valid() const { return buffer_.valid(); }

 private:
  friend class ZeroEngineImpl;
  std::size_t block_ = 0;
  PoolBlock buffer_;
  DType type_ = DType::kFp32;
  const BlockLayout* layout_ = nullptr;
};

struct StepReport {
  bool stepped = false;            // an optimizer step ran (accumulation boundary, no overflow)
  bool overflow = false;           // fp16: inf/NaN gradients, step skipped
  std::int64_t step = 0;           // optimizer steps taken so far
  double grad_norm = 0;            // global, unscaled, before clipping
  double clip_coef = 1;
  double lr = 0;                   // the learning rate the optimizer step used (0: no step ran)
  double loss_scale = 1;           // the scale for the next micro-batch
  double optimizer_seconds = 0;
  std::uint64_t nvme_read_bytes = 0;   // this step, this rank
  std::uint64_t nvme_write_bytes = 0;
  // Seconds since the last report with at least one NVMe read (write) in
  // flight (Note [Busy time]): the bytes over them are the rates the drives
  // gave while the engine asked.
  double nvme_read_busy_seconds = 0, nvme_write_busy_seconds = 0;
  double nvme_busy_seconds = 0;  // with a read or a write in flight: the drives' busy time
  std::uint64_t h2d_bytes = 0;         // 16-bit shards copied up from the host for gathering (0: params on the GPU)
  std::uint64_t d2h_bytes = 0;         // gradients copied down to the host accumulator (Note [Accumulating on the
                                       // device across micro-batches]); 0 with the GPU optimizer
  std::uint64_t grad_window_blocks = 0;  // blocks accumulating on the device across micro-batches
  std::uint64_t gather_bytes = 0;      // received by all-gathers
  // Seconds fetch() waited on each stage since the last report (the stage
  // still running when the wait ended owns that part of the wait).
  double wait_nvme_seconds = 0, wait_h2d_seconds = 0, wait_gather_seconds = 0;
  std::uint64_t fetches = 0, prefetched = 0;   // fetches since the last report, and how many were prefetched
  // Peak bytes in use per tier since the last report (device pool, CPU pool,
  // swap store), and each tier's budget.
  std::uint64_t peak_gpu_bytes = 0, peak_cpu_bytes = 0, peak_nvme_bytes = 0;
  std::uint64_t gpu_budget_bytes = 0, cpu_budget_bytes = 0, nvme_capacity_bytes = 0;
  // Raw allocations the device and CPU pools made since the last report: 0 in
  // steady state (buffers come back to the pools and are reused).
  std::uint64_t new_allocations = 0;
  // Since the last report that stepped: the times a thread of the engine (or
  // of the Python bindings' gradient copies) blocked waiting for the device
  // (Device::host_waits), and the reduce_grads calls those steps made. Their
  // ratio is the host synchronisations per reduced block the gradient path costs.
  std::uint64_t host_waits = 0, blocks_reduced = 0;
  // Note [Stepping under backward] (engine/src/step_ahead.h): the blocks
  // whose optimizer step ran under backward and was kept, those stepped
  // under backward then put back and stepped after it (clipping, an
  // overflow, a changed learning rate), the seconds of optimizer work under
  // backward and how many of them ended before step() was called (hidden).
  // ahead_off: why the step runs after backward (empty when every block may
  // step under backward).
  std::uint64_t ahead_blocks = 0, ahead_redone = 0;
  double ahead_seconds = 0, ahead_hidden_seconds = 0;
  std::string ahead_off;
  // Note [What a redo costs] (engine/src/step_ahead.h): of the work under
  // backward, what was undone (and is done again after backward): the NVMe
  // bytes it read and wrote, its optimizer seconds, and why: "clip",
  // "overflow", "hyperparameters" (the learning rate or a weight decay
  // changed after backward began), "step number", "cancel" (a checkpoint,
  // set_master, gather_master mid-window), "fault" (some blocks: an NVMe write
  // failed, a gradient arrived twice); empty when nothing was undone.
  std::uint64_t ahead_redone_read_bytes = 0, ahead_redone_write_bytes = 0;
  double ahead_redone_seconds = 0;
  std::string ahead_redo_reason;
  // Note [The step keeps backward's parameter shards] (engine/src/kept_params.h):
  // with a remainder master and the 16-bit parameters on NVMe, the 16-bit
  // shards this step took from the copy their last fetch read (and their
  // bytes: NVMe reads saved, already out of nvme_read_bytes), and those it
  // read from NVMe (no copy kept: the CPU headroom, or the shard changed since
  // the fetch). A block stepped under backward and redone counts twice.
  std::uint64_t kept_param_blocks = 0, kept_param_bytes = 0, reread_param_blocks = 0;
  // Note [The next forward's fetches under the optimizer] (engine/src/prefetch.h):
  // the next forward's fetches this step issued while its optimizer pass
  // was still running.
  std::uint64_t next_fetches_under_step = 0;
};

// save_checkpoint's choices beyond the directory (DeepSpeed's save_checkpoint
// takes the same: a tag, whether to point `latest` at it, a client state).
struct CheckpointSave {
  // The checkpoint's directory under `dir`. Empty: "step-<N>", a name no
  // existing checkpoint has. A tag naming an existing checkpoint replaces it
  // in one atomic exchange: at every instant one complete checkpoint is there.
  std::string tag;
  // Point dir/latest at it.
  bool save_latest = true;
  // Bytes of the caller's (a data loader's position, an epoch count) that rank
  // 0 stores with the checkpoint, checksummed; load_checkpoint gives them back
  // to every rank.
  std::optional<std::string> client_state;
  // A refusal of the caller's (its client state would not pack, say), agreed
  // on with the other ranks before anything is written: one rank's refusal
  // fails the save on every rank instead of leaving them waiting.
  Status refusal;
  // Keep the newest `keep_last` complete checkpoints under `dir` (by step),
  // this one included; 0 keeps all. Older ones are removed once this one is
  // published (their manifest first, so none is ever left half-removed yet
  // loadable); the one `latest` names is never removed. Only directories with
  // a tierzero manifest count; anything else under `dir` is left alone.
  int keep_last = 0;
};

// load_checkpoint's choices beyond the directory.
struct CheckpointLoad {
  // The checkpoint under `dir` to load; empty: dir/latest (or dir itself).
  std::string tag;
  // Called on every rank with the client state once every file is verified
  // and before any state is replaced; an error refuses the load on every rank
  // and replaces nothing. It runs inside the engine's call: it must not call
  // the engine.
  std::function<Status(const std::optional<std::string>&)> check_client_state;
  // A refusal of the caller's (the client state, read beforehand with
  // read_checkpoint_client_state, does not suit it), agreed on with the other
  // ranks before anything is replaced.
  Status refusal;
  // The weights alone (the masters, and their 16-bit copies): this engine's
  // optimizer moments, step count, learning rate and loss scale stay as they
  // are, and the checkpoint's optimizer may be another. Fine-tuning from a
  // checkpoint with a fresh optimizer.
  bool weights_only = false;
};

// What load_checkpoint loaded.
struct LoadedCheckpoint {
  std::string path;  // the checkpoint's directory
  std::int64_t step = 0;
  std::optional<std::string> client_state;  // as saved; none when it was saved without
};

// The client state of the checkpoint load_checkpoint(dir, {.tag}) would load,
// verified against its checksum; none when it was saved without. Reads files
// only: a caller can check it before the (collective) load, and pass a
// refusal to it.
Expected<std::optional<std::string>> read_checkpoint_client_state(const std::string& dir, const std::string& tag);

class ZeroEngine {
 public:
  // A collective: every rank passes the same model (block names, parameter
  // names and shapes), or every rank fails, kInvalidArgument naming this
  // rank's block and parameter counts. Every rank starts from rank 0's
  // values unless options.initial_values says otherwise.
  static Expected<std::unique_ptr<ZeroEngine>> create(const ZeroOptions& options, const std::vector<BlockSpec>& model,
                                                      const ParamInit& init);
  virtual ~ZeroEngine() = default;

  virtual Expected<GatheredBlock> fetch(std::size_t block, FetchFor purpose) = 0;
  Expected<GatheredBlock> fetch(std::size_t block) { return fetch(block, FetchFor::kTraining); }
  virtual Expected<GradBlock> grad_buffer(std::size_t block, GradFill fill) = 0;
  Expected<GradBlock> grad_buffer(std::size_t block) { return grad_buffer(block, GradFill::kZeroed); }
  // Refused (FailedPrecondition) for a block with no values yet (Note [Initial values]).
  virtual Status reduce_grads(GradBlock grads) = 0;
  // Ends a micro-batch; at the accumulation boundary runs the optimizer.
  virtual Expected<StepReport> step() = 0;
  // Abandoning a forward that raised half-way: take fetch_mark() before it,
  // and rewind_fetches(mark) after it raised, once its gathered blocks are
  // released (or will be: rewinding does not need them back). The training
  // fetches since the mark are forgotten, so the recorded order and the
  // prefetch window go on from the mark; without it the next forward breaks
  // the order, and prefetching pauses for two micro-batches while it is
  // recorded again (Note [A trace that stops holding] in engine/src/prefetch.h).
  // Gradients already reduced stay. A mark from another micro-batch, or past
  // a rewind already made, is refused (kInvalidArgument). Every rank rewinds
  // at the same point or none does, as it fetches: the window's all-gathers
  // are collectives, and one rank rewinding alone would post them at other
  // points than the rest.
  virtual FetchMark fetch_mark() const = 0;
  virtual Status rewind_fetches(const FetchMark& mark) = 0;

  // The config as the engine runs it: its batch keys resolved for the ranks
  // (Note [Batch keys] in common/src/config.cpp).
  virtual const Config& config() const = 0;
  // The loss scale to multiply the loss by (1 without fp16).
  virtual double loss_scale() const = 0;
  // Optimizer steps taken (restored by load_checkpoint).
  virtual std::int64_t optimizer_steps() const = 0;
  // The learning rate for the next steps (a warm-up or decay of your own);
  // must be finite and >= 0 (InvalidArgument naming it otherwise). With a
  // `scheduler` block in the config the schedule sets it, and this is refused.
  // Once set, checkpoints carry it (load_checkpoint restores it).
  virtual Status set_learning_rate(double lr) = 0;
  // The learning rate the next optimizer step will use (the config's
  // scheduler at optimizer_steps(), or the optimizer's lr).
  virtual double learning_rate() const = 0;
  // One parameter's weight decay (finite, >= 0), in place of the config's
  // optimizer.params.weight_decay: torch param groups that differ in it
  // (Note [Weight decay per parameter] in engine/src/optimizer_step.cpp).
  // `param` indexes the block's parameters in the layout. A hyperparameter,
  // not a state: checkpoints do not carry it, and every rank must set the
  // same values. InvalidArgument naming the block, parameter and value.
  virtual Status set_weight_decay(std::size_t block, std::size_t param, double weight_decay) = 0;
  // The weight decay the parameter steps with (the config's unless set).
  virtual double weight_decay(std::size_t block, std::size_t param) const = 0;
  virtual const ModelLayout& layout() const = 0;
  virtual const Plan& plan() const = 0;
  virtual DType param_type() const = 0;
  virtual DType grad_type() const = 0;
  virtual Device& device() = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // The whole block's fp32 master weights (every rank gets them; a
  // collective: call on every rank), whole_numel floats (the padding past
  // used_numel included). For reading weights between steps, and export.
  virtual Expected<std::vector<float>> gather_master(std::size_t block) = 0;
  // Replaces the block's fp32 master weights, and the 16-bit parameters
  // computed from them, with `root`'s `whole` (whole_numel floats, as
  // gather_master gives them). A collective: every rank calls it with the
  // same block and root, and root's values are broadcast into the others'
  // `whole`. The optimizer's moments, step count and accumulated gradients
  // stay. Refused while gathered blocks are out; not for use between a
  // forward and its backward (the backward would gather other weights than
  // the forward computed with). Editing weights in place, as DeepSpeed's
  // GatheredParameters(modifier_rank=) and safe_set_full_fp32_param do.
  // `refusal`: this rank's reason not to go on (every rank then fails, this
  // one with the reason), as CheckpointSave::refusal.
  virtual Status set_master(std::size_t block, float* whole, std::size_t count, int root, const Status& refusal) = 0;
  // Whether the block has values: always, unless the engine was made with
  // InitialValues::kSetLater and neither set_master() nor load_checkpoint()
  // has set it yet (Note [Initial values]). False for a block that does not
  // exist.
  virtual bool has_values(std::size_t block) const = 0;
  Status set_master(std::size_t block, float* whole, std::size_t count, int root) {
    return set_master(block, whole, count, root, Status());
  }
  // The engine's ranks, for checks every rank must pass alike and small
  // broadcasts (tierzero/comm/agreement.h); its collectives queue behind the
  // engine's own, in one order on every rank.
  virtual RankAgreement& ranks() = 0;
  // Human-readable: where each state class lives, the budgets and use.
  virtual std::string describe() const = 0;
  // The NVMe swap files the engine made, one per NVMe path (none when no
  // state lives on NVMe). Scratch: removed when the engine is destroyed.
  virtual std::vector<std::string> swap_files() const = 0;

  // Checkpoints (collectives: every rank calls them at the same point).
  // save_checkpoint writes every rank's master weights, Adam moments, step
  // and loss-scale state under dir/<tag or step-N>/ (per-rank shard files
  // with XXH3 checksums and a manifest; rank 0's client state), each file
  // written under a temporary name and fsynced; only when every rank is done
  // is the directory renamed (or, replacing a tag, exchanged) into place and
  // dir/latest pointed at it. A crash at any point leaves the previous
  // checkpoint, and `latest`, intact (Note [Checkpoint atomicity]). Call
  // between steps. Returns the checkpoint's directory.
  virtual Expected<std::string> save_checkpoint(const std::string& dir, const CheckpointSave& options) = 0;
  Status save_checkpoint(const std::string& dir) { return save_checkpoint(dir, CheckpointSave{}).status(); }
  // Loads dir/<tag>, or with no tag dir/latest (or dir itself when it is a
  // checkpoint directory), into this engine's tiers, whatever tiers it was
  // saved from; the world size and the model's layout must match. Every
  // checksum (the client state's too) is verified before any state is
  // replaced. Resuming continues bit for bit as the saved run would have.
  virtual Expected<LoadedCheckpoint> load_checkpoint(const std::string& dir, const CheckpointLoad& options) = 0;
  Status load_checkpoint(const std::string& dir) { return load_checkpoint(dir, CheckpointLoad{}).status(); }
  // The full fp32 weights as one safetensors file, like DeepSpeed's
  // zero_to_fp32. Tensors are named "<block>.<param>", or names[b][p] when
  // `names` is given (one list per block, one name per parameter: the names
  // a framework loads them by). A collective; rank 0 writes the file
  // (path.tmp, fsynced, then renamed: never a partial file at `path`).
  virtual Status export_safetensors(const std::string& path,
                                    const std::vector<std::vector<std::string>>& names) = 0;
  Status export_safetensors(const std::string& path) { return export_safetensors(path, {}); }

  // Records a timeline of NVMe reads, copies, collectives, compute (from each
  // fetch to its release), gradient accumulation and the optimizer, and
  // writes it as a Chrome trace (opens in Perfetto).
  virtual void record_timeline(bool on) = 0;
  virtual Status write_timeline(const std::string& path) = 0;
  virtual void clear_timeline() = 0;

  // Records the NVMe requests the engine makes (every state on NVMe, each
  // segment in submission order) and writes them as a fio version 2 I/O log
  // that tierzero-nvme-bench --replay and fio's read_iolog replay (Note [I/O
  // logs]). Turning it on clears what was recorded. Without NVMe there is
  // nothing to record: write_io_log refuses, naming why.
  virtual void record_io_log(bool on) = 0;
  virtual Status write_io_log(const std::string& path) = 0;
};

}  // namespace tz
