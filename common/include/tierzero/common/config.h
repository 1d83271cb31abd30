// tierzero's configuration: one JSON file, DeepSpeed-compatible.
//
// A DeepSpeed config works unchanged: its `zero_optimization` block (stage,
// offload_param, offload_optimizer, sub_group_size, stage3_* ...) and its `aio`
// block mean what they mean in DeepSpeed, and so do the training keys we use
// (train_micro_batch_size_per_gpu, gradient_accumulation_steps,
// gradient_clipping, fp16, bf16, optimizer, scheduler). tierzero's own settings live in a
// top-level `tierzero` block:
//
//   "tierzero": {
//     "backend": "auto",                     // "auto" | "cuda" | "host"
//     "placement": "auto",                   // "auto" | "deepspeed" (default: see below)
//     "tiers": {
//       "gpu_bytes": "auto",                 // bytes, "80GB"/"64GiB", or "auto" (90% of GPU 0's memory)
//       "cpu_bytes": "120GB",
//       "nvme_bytes": "2TB",
//       "nvme_paths": ["/nvme0/tz", "/nvme1/tz"],   // striped
//       "numa_node": "auto"                  // or a node number for pinned memory
//     },
//     "aio": { "sqpoll": false, "fixed_buffers": true, "allow_buffered_io": false },
//     "states": { "master": "fp32", "moments": "fp32" }   // or "remainder"; "bf16" | "int8"
//   }
//
// Rules (docs/configuration.md lists every key):
// - DeepSpeed keys that tierzero has no use for (logging, profilers,
//   overlap_comm, ...) are accepted and returned in Config::ignored_keys; the
//   loader logs them once as a single warning.
// - DeepSpeed keys for features tierzero lacks (MoE expert parallelism,
//   sequence parallelism, ZenFlow, "sum" gradient all-reduce, ...) load when
//   they leave the feature off and are otherwise refused as "a DeepSpeed
//   feature tierzero does not support"; a DeepSpeed key is never "unknown".
// - A key nobody knows is an InvalidArgument error naming its dotted path and
//   the nearest known key ("did you mean ...?").
// - "auto" (Note [Auto values] in config.cpp): in a block DeepSpeed reads
//   through pydantic (zero_optimization, its offload blocks) it means
//   DeepSpeed's default, which is tierzero's; where it would change what is
//   trained (batch, precision, clipping, the optimizer's hyperparameters,
//   step counts) and the file does not resolve it, it is listed in
//   Config::unresolved_auto and the engine refuses it.
// - optimizer.type "Adam" runs AdamW (decoupled weight decay) unless
//   optimizer.params.adam_w_mode is false, as in DeepSpeed; the loaded
//   Config holds the optimizer that runs.
// - A wrong type or an impossible value is an error naming the key, the value,
//   and what is allowed.
// - Integer keys accept JSON numbers written as 5e8 when they are whole.
// - Placement: with "placement" unset, a config that has an offload_param or
//   offload_optimizer block follows it (as DeepSpeed would); otherwise "auto".
//
// Parsing never touches the file system; check_paths() does, separately, so a
// DeepSpeed config can be validated on a machine without its NVMe mount.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tierzero/common/state_format.h"
#include "tierzero/common/status.h"

namespace tz {

enum class OffloadDevice { kNone, kCpu, kNvme };
std::string_view offload_device_name(OffloadDevice device);  // "none" | "cpu" | "nvme"

// A budget in bytes, or "auto" (resolved later from free memory / free space).
struct ByteBudget {
  bool is_auto = true;
  std::uint64_t bytes = 0;  // meaningful when !is_auto

  static ByteBudget automatic() { return {}; }
  static ByteBudget of(std::uint64_t b) { return {false, b}; }
};

// zero_optimization.offload_param
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;                       // required when device == kNvme
  bool pin_memory = false;
  // DeepSpeed's, checked but without effect in tierzero (Note [Inert keys]
  // in config.cpp): staging buffers for NVMe reads, elements per buffer,
  // elements cached in CPU memory.
  std::int64_t buffer_count = 5;
  std::int64_t buffer_size = 100'000'000;
  std::int64_t max_in_cpu = 1'000'000'000;
};

// zero_optimization.offload_optimizer
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  bool pin_memory = false;
  // DeepSpeed's, checked but without effect in tierzero (Note [Inert keys]
  // in config.cpp): the optimizer pass always pipelines its sub-groups, and
  // offloads every optimizer state or none. `ratio` < 1 still needs stage 3,
  // as in DeepSpeed.
  std::int64_t buffer_count = 4;
  bool pipeline_read = false;
  bool pipeline_write = false;
  double ratio = 1.0;
};

struct ZeroConfig {
  int stage = 0;                                            // 0..3
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
  bool has_offload_param = false;                           // the block was present
  bool has_offload_optimizer = false;
  std::int64_t sub_group_size = 1'000'000'000;              // elements per optimizer sub-group
  std::int64_t stage3_prefetch_bucket_size = 50'000'000;    // elements prefetched ahead
  std::int64_t stage3_max_live_parameters = 1'000'000'000;  // elements resident whole on GPU
  std::int64_t stage3_param_persistence_threshold = 100'000;  // blocks below stay whole on GPU
};

// The `aio` block, plus tierzero.aio.
struct AioConfig {
  std::int64_t block_size = 1'048'576;   // bytes per I/O request; multiple of 4096
  int queue_depth = 8;                   // requests in flight per ring, 1..4096 (nvme::kMaxQueueDepth)
  int intra_op_parallelism = 1;          // rings/threads per request, 1..64 (nvme::kMaxRings)
  bool single_submit = false;
  // overlap_events: not stored; its rings always overlap (Note [Overlap events] in config.cpp).
  // ours (tierzero.aio; auto_tune: true is refused, false changes nothing)
  bool sqpoll = false;                   // IORING_SETUP_SQPOLL
  bool fixed_buffers = true;             // register staging buffers with the ring
  bool allow_buffered_io = false;        // fall back to buffered I/O where O_DIRECT is refused
};

struct OptimizerConfig {
  std::string type = "AdamW";            // Adam | AdamW | Adagrad | Lion (case-insensitive on input)
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool present = false;                  // the block was present
};

// The `scheduler` block: DeepSpeed's learning-rate schedules, stepped once
// per optimizer step (a step skipped for fp16 overflow does not count).
// With `t` the optimizer steps already taken and W = max(2, warmup_num_steps):
//   warm-up gamma(t) = log(t + 1) / log(W)  ("log", the default)
//                    = t / W                ("linear")
//   WarmupLR        lr = min_lr + (max_lr - min_lr) * (t < W ? gamma(t) : 1)
//   WarmupDecayLR   the same, then (t >= W) the factor is
//                   max(0, (total - t) / max(1, total - W))
//   WarmupCosineLR  lr = optimizer lr * ratio, with ratio
//                   min_ratio + (1 - min_ratio) * gamma(t) while t < W, then
//                   max(0, cos_min + (1 - cos_min) * (1 + cos(pi * (t - W + 1) / (total - W))) / 2)
// WarmupLR and WarmupDecayLR set the learning rate themselves (warmup_max_lr,
// as in DeepSpeed: the optimizer block's lr is not used); WarmupCosineLR
// scales the optimizer's.
enum class SchedulerType { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR };
enum class WarmupType { kLog, kLinear };
std::string_view scheduler_name(SchedulerType type);  // "none" | "WarmupLR" | ...

struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;
  double warmup_min_lr = 0.0;            // WarmupLR, WarmupDecayLR
  double warmup_max_lr = 0.001;          //   "auto": the optimizer block's lr
  bool warmup_max_lr_auto = false;
  std::int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::kLog;
  std::int64_t total_num_steps = 0;      // WarmupDecayLR, WarmupCosineLR (required there)
  double warmup_min_ratio = 0.0;         // WarmupCosineLR
  double cos_min_ratio = 0.0001;
  std::vector<std::string> params_given; // the params keys the file set (checked against the type)
};

// W above: the warm-up length the schedule runs, max(2, warmup_num_steps).
std::int64_t warmup_length(const SchedulerConfig& scheduler);

// The learning rate of the optimizer step taken after `steps_taken` steps,
// for a schedule whose optimizer block says `optimizer_lr`. kNone: optimizer_lr.
double scheduled_lr(const SchedulerConfig& scheduler, double optimizer_lr, std::int64_t steps_taken);

struct PrecisionConfig {
  bool fp16 = false;
  bool bf16 = false;
  double loss_scale = 0.0;               // 0 = dynamic
  int initial_scale_power = 16;          // dynamic scale starts at 2^power
  int loss_scale_window = 1000;
  int hysteresis = 2;
  double min_loss_scale = 1.0;
};

enum class BackendChoice { kAuto, kCuda, kHost };
enum class PlacementMode { kAuto, kDeepSpeed };

struct TierConfig {
  ByteBudget gpu;
  ByteBudget cpu;
  ByteBudget nvme;
  std::vector<std::string> nvme_paths;   // tierzero.tiers.nvme_paths, in order
  std::optional<int> numa_node;          // nullopt = auto (nearest the GPU)
  bool huge_pages = true;                // CPU-tier memory advised onto transparent huge pages (Note [Host memory on huge pages])
};

// DeepSpeed's three batch keys as the file gave them (none: absent or "auto").
struct BatchKeys {
  std::optional<std::int64_t> train_batch_size;
  std::optional<std::int64_t> train_micro_batch_size_per_gpu;
  std::optional<std::int64_t> gradient_accumulation_steps;
};

// tierzero.step_under_backward's values: false, true, "auto".
enum class StepUnderBackward : std::uint8_t { kOff, kAlways, kAuto };
std::string_view step_under_backward_name(StepUnderBackward mode);  // "false", "true", "auto"

struct Config {
  std::string source;                    // file name, or "<string>"
  // The batch: what the file gave, until resolve_batch() derives the rest
  // for a number of ranks (the engine does, once it knows them).
  std::int64_t train_micro_batch_size_per_gpu = 1;
  std::int64_t gradient_accumulation_steps = 1;
  BatchKeys batch_given;
  double gradient_clipping = 0.0;        // 0 = off
  PrecisionConfig precision;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero;
  AioConfig aio;
  TierConfig tiers;
  BackendChoice backend = BackendChoice::kAuto;
  PlacementMode placement = PlacementMode::kAuto;
  // tierzero.states: the optimizer states' formats (tierzero/common/state_format.h).
  // Non-default formats need what check_state_formats() says.
  StateFormats states;
  // tierzero.step_under_backward: the CPU optimizer steps each block under
  // backward as its gradient completes, kept only when it is exactly the step
  // after backward (Note [Stepping under backward], engine/src/step_ahead.h):
  // "auto" where it is likely to be kept (Note [When to speculate]), true in
  // every window, false never.
  StepUnderBackward step_under_backward = StepUnderBackward::kAuto;
  // Dotted paths of keys accepted but unused, in file order.
  std::vector<std::string> ignored_keys;
  // Note [Auto values]: dotted paths of the keys given as "auto" that nothing
  // in the file resolves (a Hugging Face Trainer template, which the Trainer
  // fills in before DeepSpeed reads it). The config loads (the estimator and
  // tierzero-info read such files); the engine refuses to train with them,
  // naming them.
  std::vector<std::string> unresolved_auto;
  // DeepSpeed's dataloader_drop_last: the data loader initialize(training_data=)
  // builds drops a last, incomplete batch. The engine does not read it.
  bool dataloader_drop_last = false;

  // Every NVMe directory in use (tiers.nvme_paths, then the nvme_path of each
  // offload block whose device is "nvme"), without duplicates, in that order.
  // An nvme_path beside device "cpu" is unused, as in DeepSpeed, and not listed.
  std::vector<std::string> all_nvme_paths() const;
};

// Parses JSON text. `source` names it in errors. Logs ignored keys once.
Expected<Config> parse_config(std::string_view json_text, std::string_view source = "<string>");
// Reads and parses a file; errors name the path.
Expected<Config> load_config(const std::string& path);
// Every NVMe path exists, is a directory and is writable; the error names the
// key and the path.
Status check_paths(const Config& config);
// Note [Batch keys]: sets train_micro_batch_size_per_gpu and
// gradient_accumulation_steps from the batch keys given and the number of
// data-parallel ranks, as DeepSpeed does (train_batch_size = micro batch x
// accumulation steps x ranks); the error names the keys and values when they
// disagree. Afterwards all three are recorded as given, so resolving again
// for the same ranks changes nothing, and for other ranks is refused.
Status resolve_batch(Config& config, int ranks);
// An override of the accumulation steps (a tool's flag): it replaces the
// config's, and a train_batch_size given with them no longer binds.
void override_gradient_accumulation_steps(Config& config, std::int64_t steps);
// A tool's precision flag: "bf16" or "fp16" enables that block (and disables
// the other), "fp32" disables both. Anything else is kInvalidArgument naming it.
Status set_training_precision(Config& config, std::string_view precision);
// The states' formats against the training precision: a 16-bit
// data_types.grad_accum_dtype must be the training dtype; master "remainder"
// needs bf16 parameters (fp16's exponent cannot hold the master; fp32
// training has no 16-bit parameter to build on). kInvalidArgument naming the
// key, the value, why, and what to use instead. parse_config() runs it; a
// tool that overrides the precision or the formats runs it again.
Status check_state_formats(const Config& config);
// A tool's --master / --moments flag: the format of that name (the config's
// spellings), or kInvalidArgument naming it and the allowed ones. Run
// check_state_formats() once every override is applied.
Status set_master_format(Config& config, std::string_view name);
Status set_moment_format(Config& config, std::string_view name);
// A tool's --grad-accum-dtype flag: "fp32", "bf16" or "fp16" as
// data_types.grad_accum_dtype; check_state_formats() checks it against the
// precision.
Status set_grad_format(Config& config, std::string_view name);

}  // namespace tz
