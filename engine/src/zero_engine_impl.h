// ZeroEngineImpl: the engine's state and the components it composes (the
// tiered stores, the prefetcher, the gradient path, the optimizer pass, rank
// agreement), shared by zero_engine.cpp (fetch, gradients), zero_engine_setup.cpp
// (creation), optimizer_step.cpp (the step) and checkpoint.cpp.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <atomic>
#include <cmath>

#include "block_table.h"
#include "checkpoint_files.h"
#include "gradient_path.h"
#include "kept_params.h"
#include "optimizer_pass.h"
#include "loss_scaler.h"
#include "prefetch.h"
#include "step_ahead.h"
#include "trace.h"
#include "workers.h"
#include "tierzero/common/handles.h"
#include "tierzero/cpu_adam.h"
#include "tierzero/engine/zero.h"
#include "tierzero/nvme.h"

namespace tz {

class ZeroEngineImpl final : public ZeroEngine, private GatheredBlock::Releaser {
 public:
  explicit ZeroEngineImpl(const ZeroOptions& options)
      : options_(options), scaler_(options.config.precision), base_lr_(options.config.optimizer.lr) {}
  ~ZeroEngineImpl() override;

  Status init(const std::vector<BlockSpec>& model, const ParamInit& init);

  using ZeroEngine::fetch;
  using ZeroEngine::grad_buffer;
  Expected<GatheredBlock> fetch(std::size_t block, FetchFor purpose) override;
  Expected<GradBlock> grad_buffer(std::size_t block, GradFill fill) override;
  Status reduce_grads(GradBlock grads) override;
  Expected<StepReport> step() override;
  FetchMark fetch_mark() const override { return prefetcher_->mark(); }
  Status rewind_fetches(const FetchMark& mark) override;
  const Config& config() const override { return options_.config; }
  double loss_scale() const override { return scaler_.scale(); }
  std::int64_t optimizer_steps() const override { return step_; }
  Status set_learning_rate(double lr) override {
    // 0 is a rate (a torch warm-up starts there, an annealing ends there).
    if (!(lr >= 0) || !std::isfinite(lr)) return invalid_argument("learning rate = {} must be finite and >= 0", lr);
    const SchedulerConfig& sched = options_.config.scheduler;
    if (sched.type != SchedulerType::kNone) {
      return invalid_argument("set_learning_rate({}): the config's scheduler ({}) sets the learning rate at every "
                              "step; remove the scheduler block to set it yourself", lr, scheduler_name(sched.type));
    }
    base_lr_ = lr;
    lr_set_by_caller_ = true;
    return ok_status();
  }
  double learning_rate() const override { return scheduled_lr(options_.config.scheduler, base_lr_, step_); }
  Status set_weight_decay(std::size_t block, std::size_t param, double weight_decay) override;
  double weight_decay(std::size_t block, std::size_t param) const override;
  const ModelLayout& layout() const override { return layout_; }
  const Plan& plan() const override { return plan_; }
  DType param_type() const override { return param_type_; }
  DType grad_type() const override { return grad_type_; }
  Device& device() override { return *device_; }
  int rank() const override { return comm_->rank(); }
  int world_size() const override { return comm_->size(); }
  Expected<std::vector<float>> gather_master(std::size_t block) override;
  using ZeroEngine::set_master;
  Status set_master(std::size_t block, float* whole, std::size_t count, int root, const Status& refusal) override;
  bool has_values(std::size_t block) const override { return blocks_.has_values(block); }
  RankAgreement& ranks() override { return *ranks_; }
  std::string describe() const override;
  std::vector<std::string> swap_files() const override {
    return swap_ ? swap_->file_paths() : std::vector<std::string>{};
  }
  using ZeroEngine::load_checkpoint;
  using ZeroEngine::save_checkpoint;
  Expected<std::string> save_checkpoint(const std::string& dir, const CheckpointSave& options) override;
  Expected<LoadedCheckpoint> load_checkpoint(const std::string& dir, const CheckpointLoad& options) override;
  using ZeroEngine::export_safetensors;
  Status export_safetensors(const std::string& path, const std::vector<std::vector<std::string>>& names) override;
  void record_timeline(bool on) override { timeline_.enable(on); }
  Status write_timeline(const std::string& path) override { return timeline_.write_json(path); }
  void clear_timeline() override { timeline_.clear(); }
  void record_io_log(bool on) override {
    if (io_) io_->record_log(on);
  }
  Status write_io_log(const std::string& path) override {
    if (!io_) return failed_precondition("write_io_log {}: no state lives on NVMe, so there is no NVMe I/O to log", path);
    std::vector<nvme::IoLogEntry> log = io_->take_log();
    if (log.empty()) return failed_precondition("write_io_log {}: no NVMe request was recorded (record_io_log(true) "
                                                "first)", path);
    return nvme::write_fio_iolog(path, log);
  }

 private:
  // --- creation (zero_engine_setup.cpp)
  Status make_device_and_comm();
  Status make_plan();
  RankAgreement::Settings settings_that_must_match() const;
  Status make_stores();
  Status make_swap(std::uint64_t nvme_bytes);  // make_stores' NVMe part
  // Note [Accumulating on the device across micro-batches]: which blocks do, and the plan counts them.
  std::vector<bool> grad_window_blocks() const;
  Status make_grad_window();
  Status make_kept_params();  // Note [The step keeps backward's parameter shards] (kept_params.h)
  Status make_optimizer();    // the pass, after make_kept_params
  Status init_states(const ParamInit& init);

  // --- data movement
  Status sync();
  // Host bytes into a store's shard of `block` / the shard into host bytes,
  // whatever its tier (on stream_). `host` is ordinary host memory.
  Status put(TieredStore& store, std::size_t block, const void* host) { return store.put(block, host, *stream_); }
  Status get(const TieredStore& store, std::size_t block, void* host) { return store.get(block, host, *stream_); }
  // This rank's shard of `block`'s fp32 master weights, and the 16-bit
  // parameters as the optimizer's copy-out writes them: the masters rounded.
  // A block's fp32 master shard into the stores (with its 16-bit copy), and
  // out of them, whatever the master's format (Note [Remainder masters in the engine]).
  Status put_weights(std::size_t block, const float* shard);
  Status get_master(std::size_t block, float* shard);
  // A moment's shard (0: exp_avg, 1: exp_avg_sq) as fp32, whatever its
  // format, into and out of its store (Note [Moments in bf16]).
  Status put_moment(int which, std::size_t block, const float* shard);
  Status get_moment(int which, std::size_t block, float* shard);
  // The dtype the moments are stored and stepped in: fp32, bf16, or uint8
  // for int8 codes (with their block scales, Note [Stored int8 moment shards]).
  DType moment_type() const {
    switch (options_.config.states.moments) {
      case MomentFormat::kBf16: return DType::kBf16;
      case MomentFormat::kInt8: return DType::kUint8;
      default: return DType::kFp32;
    }
  }
  // The gradient accumulator's dtype (data_types.grad_accum_dtype; Note
  // [16-bit gradient accumulators], gradient_path.h).
  DType acc_type() const {
    switch (options_.config.states.grads) {
      case GradFormat::kBf16: return DType::kBf16;
      case GradFormat::kFp16: return DType::kFp16;
      default: return DType::kFp32;
    }
  }
  // Gathers every persistent block's 16-bit parameters; with unset_too, also
  // those of blocks still marked unset (a load that has just written them).
  Status gather_persistent(bool unset_too = false);
  void release(std::size_t block, void* data) override;
  Status release_after(std::size_t block, void* data, Stream* stream, void* native) override;
  void end_compute(std::size_t block, void* data);  // the timeline's compute span, fetch to release
  // A copy of the first failed release_after (sticky: every later call fails with it).
  Status release_failure() const { return release_error_; }

  // --- checkpoints (checkpoint.cpp)
  // Every rank passes its own result; all return an error if any rank failed.
  Status agree(const Status& mine, std::string_view what) { return ranks_->agree(mine, what); }
  // Rank 0 makes `partial` ready for a save to `final_dir` (Note [Replacing a checkpoint]).
  Status prepare_save(const std::string& dir, const std::string& final_dir, const std::string& partial);
  Status write_rank_files(const std::string& dir);
  // Checks this rank's manifest against the model, opens its .bin file and
  // verifies every state the load needs (Note [Streamed checkpoints]).
  // weights_only: the masters alone are needed (and the optimizer may differ).
  Status read_rank_files(const std::string& dir, bool weights_only, detail::RankFile& file);
  // Puts every state `file` holds into its store, each read and verified again.
  Status put_rank_file(const detail::RankFile& file);
  void restore_progress(std::int64_t step, const detail::LossScaler::State& scaler,
                        const std::optional<double>& saved_lr);

  // --- the step (optimizer_step.cpp)
  Status zero_stale_grads();
  Expected<bool> global_norm(double& norm);  // returns overflow
  // Note [Stepping under backward] (step_ahead.h): set up (or why not), the
  // window opened on the last micro-batch, and undone before anything else
  // reads or writes the states.
  Status make_step_ahead();
  void count_step_ahead_in_plan(std::uint64_t need);
  void open_step_ahead();
  Status cancel_step_ahead(detail::AheadRedo why = detail::AheadRedo::kCancel);
  void end_ahead_window(StepReport& report, const detail::AheadOutcome& ahead);
  void fill_counters(StepReport& report);  // step()'s traffic, waits, pools and I/O since the last report
  cpu_adam::Hyper hyper() const;

  ZeroOptions options_;
  Communicator* comm_ = nullptr;
  std::unique_ptr<Communicator> own_comm_;
  std::unique_ptr<RankAgreement> ranks_;      // over comm_, serialised on comm_thread_
  Device* device_ = nullptr;
  std::unique_ptr<Device> own_device_;
  std::unique_ptr<Stream> stream_;

  ModelLayout layout_;
  Plan plan_;
  ResolvedBudgets budgets_;
  int stage_ = 3;
  int gas_ = 1;
  DType param_type_ = DType::kBf16;
  DType grad_type_ = DType::kBf16;
  bool gpu_optimizer_ = false;   // CUDA, and every state class on the GPU: Adam runs there

  std::unique_ptr<MemoryPool> device_pool_;
  std::unique_ptr<MemoryPool> host_pool_;
  std::shared_ptr<nvme::IoEngine> io_;
  std::unique_ptr<nvme::SwapStore> swap_;
  std::unique_ptr<TieredStore> param16_, grad_, master_, exp_avg_, exp_avg_sq_;
  // Note [Stepping under backward]: second copies of the NVMe master and moments (else nullptr).
  std::unique_ptr<TieredStore> master_shadow_, exp_avg_shadow_, exp_avg_sq_shadow_;
  std::uint64_t ahead_shadow_bytes_ = 0;
  std::vector<PoolBlock> persistent_;          // whole 16-bit params of persistent blocks (others invalid)
  detail::BlockTable blocks_;                  // each block's state (Note [Block states])
  std::map<void*, PoolBlock> live_;            // gathered buffers handed out
  std::map<void*, std::chrono::steady_clock::time_point> live_since_;
  // Note [Stream-ordered release]: the stream that waits for readers, the
  // event it waits on (recorded on the reader's stream), the point the
  // persistent blocks' readers had reached when last released, the buffers
  // whose readers' wait failed, and that failure.
  std::unique_ptr<Stream> release_stream_;
  std::unique_ptr<Event> reader_done_, persistent_read_;
  std::vector<PoolBlock> quarantined_;
  Status release_error_;
  std::unique_ptr<cpu_adam::CpuOptimizer> cpu_opt_;
  detail::LossScaler scaler_;
  // The optimizer's learning rate before any schedule: the config's, or what
  // set_learning_rate() set. options_.config.optimizer.lr is the one the
  // current step uses (the schedule's value at this step).
  double base_lr_;
  // set_learning_rate() was called (here, or before the loaded checkpoint was
  // saved): only then does a checkpoint carry the rate, so a config's new lr
  // applies when resuming a run that never set one.
  bool lr_set_by_caller_ = false;

  // Note [Weight decay per parameter]: each parameter's weight decay where
  // set_weight_decay() gave one (per block, per parameter; empty: none set in
  // the block), and each block's segment table for this rank's shard.
  std::vector<std::vector<std::optional<double>>> param_weight_decay_;
  std::vector<std::vector<cpu_adam::WeightDecaySegment>> weight_decay_segments_;
  void make_weight_decay_segments(std::size_t block);
  // Note [The step keeps backward's parameter shards]: nullptr where nothing
  // is kept, and kept_off_ says why where it applies.
  std::unique_ptr<detail::KeptParams> kept_params_;
  std::string kept_off_;
  std::unique_ptr<detail::OptimizerPass> optimizer_;  // CPU or GPU (optimizer_pass.h)
  int micro_ = 0;
  std::int64_t step_ = 0;
  NvmeTraffic nvme_traffic_;                   // every store's NVMe bytes since the last step report
  std::uint64_t pool_allocations_seen_ = 0;    // pools' backend allocations at the last report
  std::uint64_t host_waits_seen_ = 0;          // the device's host waits at the last stepping report
  std::uint64_t read_busy_seen_ns_ = 0, write_busy_seen_ns_ = 0, io_busy_seen_ns_ = 0;  // io_'s busy clocks at the last report
  void reset_io_counters();  // after set-up and a checkpoint load: the next report counts from here
  // Seconds with an NVMe read, a write, and either, in flight since the last call (Note [Busy time]).
  std::tuple<double, double, double> take_io_busy_seconds();
  std::unique_ptr<Stream> d2h_stream_;         // the grad thread's copies
  std::unique_ptr<Stream> comm_stream_;        // the comm thread's collectives (NCCL)
  detail::Timeline timeline_;
  // Before the threads: destroyed after them, so no queued task outlives it.
  std::unique_ptr<detail::GradientPath> grads_;
  // Note [Stepping under backward]: nullptr when the step runs after
  // backward, and ahead_off_ says why; ahead_blocks_ blocks may step ahead.
  std::unique_ptr<detail::StepAhead> ahead_;
  std::unique_ptr<Stream> ahead_stream_;
  std::string ahead_off_;
  std::size_t ahead_blocks_ = 0;
  std::size_t grad_window_blocks_ = 0;  // Note [Accumulating on the device across micro-batches]
  // Note [When to speculate]: whether each window speculates; this window's
  // decision (made at its first reduce_grads), and why not.
  detail::AheadPolicy ahead_policy_{false};
  bool ahead_decided_ = false, ahead_opened_ = false;
  std::chrono::steady_clock::time_point last_window_end_{};  // Note [When to speculate]: the measured pace
  std::string ahead_why_not_;
  // Declared last: destroyed first, so no task outlives what it uses.
  std::unique_ptr<detail::TaskThread> grad_thread_;
  std::unique_ptr<detail::TaskThread> comm_thread_;
  std::unique_ptr<detail::Prefetcher> prefetcher_;
};

// fp32 values in the parameter type (rounded to nearest even for 16-bit).
std::vector<std::uint8_t> to_param_type(const float* src, std::size_t n, DType type);

}  // namespace tz
