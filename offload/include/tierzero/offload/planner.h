// The placement planner: which tier (GPU HBM, pinned CPU memory, NVMe) holds
// each class of model state, decided before anything is allocated.
//
// Mixed-precision Adam keeps four state classes per parameter:
//
//   class     bytes/elem                         where the optimizer allows it
//   param16   2 (bf16/fp16); 4 in fp32 training  gpu | cpu | nvme (off-GPU needs stage 3)
//   grad      4 (fp32 accumulator)               with the optimizer, see below
//   master    4 (fp32); 2.125 (remainder)        gpu | cpu | nvme
//   moments   8 (fp32 exp_avg + exp_avg_sq);     with the optimizer, see below
//             4 (bf16); 2.03125 (int8)
//
// The master's and the moments' formats are PlanInput::states
// (tierzero/common/state_format.h, from the config's tierzero.states). A
// remainder master is rebuilt from the bf16 parameter, so the optimizer also
// reads the parameter shard from its tier each step: the plan counts that
// traffic (docs/placement.md).
//
// The optimizer runs where `master` lives: master on gpu puts grad and moments
// on gpu (GPU Adam); master on cpu or nvme puts grad and moments each on cpu or
// nvme (CPU Adam; NVMe-resident states stream through pinned CPU buffers).
//
// Partitioning follows ZeRO `stage` over `ranks`: stage 3 shards everything,
// stage 2 grads and optimizer states, stage 1 optimizer states (master,
// moments) only, stage 0 nothing. Every block (a flattened layer) is padded so
// each shard is a whole number of 2048 elements (4 KiB of bf16, for O_DIRECT):
//   shard_numel(n) = align_up(ceil(n / ranks), 2048),  whole_numel(n) = align_up(n, 2048).
// At stage 3, blocks with n < persistence_threshold stay whole on every GPU
// (16-bit params and 16-bit grads); their optimizer states follow the plan.
// docs/placement.md gives every formula and a worked example.
//
// Units: byte counts are bytes; numel counts are elements. GPU needs and
// budgets are per GPU (= per rank); CPU and NVMe needs and budgets are per node,
// shared by `ranks_per_node` ranks. Traffic is per rank per optimizer step
// (gradient_accumulation_steps micro-batches); link speeds are bytes/second.
//
// Errors: invalid input (ranks < 1, an empty block list, stage outside 0..3,
// ranks_per_node not dividing ranks, ...) is kInvalidArgument naming the value.
// A plan that cannot fit is kOutOfMemory whose message names the tier, its
// need, its budget, and the config keys that would change the answer.
//
// Example:
//
//   tz::PlanInput in;
//   in.block_numel.assign(32, 625'000'000);           // a 20B model, 32 layers
//   in.gpu_bytes = 80'000'000'000;                     // per GPU
//   in.cpu_bytes = 120'000'000'000;                    // per node
//   in.nvme_bytes = 2'000'000'000'000;                 // per node
//   TZ_ASSIGN_OR_RETURN(tz::Plan plan, tz::plan_placement(in));
//   if (plan.tier_of(tz::StateClass::kMaster) == tz::Tier::kNvme) { ... }
//   fmt::print("{}", tz::format_plan(plan, in));
//
// Thread safety: pure functions of their arguments, except resolve_budgets,
// which probes NVMe paths through probe_path() (itself thread-safe).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "tierzero/common.h"

namespace tz {

enum class Tier : std::uint8_t { kGpu, kCpu, kNvme };
// The engine's pipeline depths, which the planner budgets memory for. One
// owner, read by both: the engine's gradient path (engine/src/gradient_path.h)
// and optimizer pass (engine/src/optimizer_pass.cpp), and this planner.
// Gradient blocks past backward and not yet accumulated, at most:
inline constexpr int kMaxPendingGrads = 3;
// Optimizer sub-groups staged at once: reading the next, stepping one, writing the last.
inline constexpr int kStagingSets = 3;
// Blocks' NVMe states staged at once by the steps under backward (Note
// [Pipelined steps under backward]): the next block's read, this one's step, the last one's write.
inline constexpr int kAheadStagingBlocks = 3;
// tierzero.step_under_backward "auto" steps under backward only blocks whose
// shard holds at least this many elements per rank (Note [When to
// speculate], engine/src/step_ahead.h, has the measurements); the engine's
// default (ZeroOptions::auto_ahead_min_block_numel) and the planner's count.
inline constexpr std::uint64_t kAutoAheadMinBlockNumel = std::uint64_t{1} << 20;

inline constexpr std::size_t kNumTiers = 3;
enum class StateClass : std::uint8_t { kParam16, kGrad, kMaster, kMoments };
inline constexpr std::size_t kNumStateClasses = 4;

std::string_view tier_name(Tier tier);                  // "gpu" | "cpu" | "nvme"
std::string_view state_class_name(StateClass state);    // "param16" | "grad" | "master" | "moments"
// Bytes per element of a state class: param16 is `param_bytes` (2 for bf16 or
// fp16, 4 when training in fp32), grad 4, master and moments as their format
// says (4 and 8 in fp32; 2.125, and 4 or 2.03125, compact).
double state_elem_bytes(StateClass state, std::uint64_t param_bytes, StateFormats formats = {});
// Bytes of `numel` elements of a state class, exactly (whole tie-bit bytes
// and scale blocks: master_bytes / moments_bytes).
std::uint64_t state_bytes(StateClass state, std::uint64_t numel, std::uint64_t param_bytes, StateFormats formats = {});
// The class's format in words: "bf16/fp16" or "fp32" for param16, "fp32" for
// grad, the format's name for master and moments.
std::string_view state_format_name(StateClass state, std::uint64_t param_bytes, StateFormats formats = {});

// Sustained link speeds, bytes/second, for the movement-time estimate.
struct LinkSpeeds {
  double nvme_read_Bps = 2e9;
  double nvme_write_Bps = 2e9;
  double pcie_Bps = 25e9;      // host <-> device, each direction
  double cpu_mem_Bps = 40e9;   // CPU Adam's streaming memory bandwidth
};

// Budgets after "auto" is resolved, with where each number came from.
struct ResolvedBudgets {
  std::uint64_t gpu_bytes = 0;   // per GPU
  std::uint64_t cpu_bytes = 0;   // per node
  std::uint64_t nvme_bytes = 0;  // per node
  std::string gpu_source;        // "config", "auto: 90% of GPU 0 (NVIDIA H100) total memory", ...
  std::string cpu_source;        // "config", "auto: 90% of MemAvailable"
  std::string nvme_source;       // "config", "auto: free space on /nvme0/tz", "auto: no NVMe paths ..."
};

// Resolves "auto" budgets: GPU = 90% of device 0's total memory (no GPU is
// kUnavailable naming tierzero.tiers.gpu_bytes); CPU = 90% of MemAvailable;
// NVMe = the sum of free bytes over `nvme_paths` (probe_path each; an empty
// list gives 0 with a note in nvme_source; a path that cannot be probed is the
// probe's error with the key as context). Explicit budgets pass through.
Expected<ResolvedBudgets> resolve_budgets(const TierConfig& tiers, const Capabilities& caps,
                                          const std::vector<std::string>& nvme_paths);
// The same with this machine's capabilities(), probed only when a budget is
// "auto" (explicit budgets need no probe: none runs, no NVMe path is touched).
Expected<ResolvedBudgets> resolve_budgets(const TierConfig& tiers, const std::vector<std::string>& nvme_paths);

struct PlanInput {
  std::vector<std::uint64_t> block_numel;  // elements per block, in model order; none may be 0
  int ranks = 1;                           // data-parallel world size
  int ranks_per_node = 0;                  // 0 = ranks (one node); must divide ranks
  int stage = 3;                           // ZeRO stage 0..3
  int gradient_accumulation_steps = 1;     // micro-batches per optimizer step
  // Bytes of a training parameter, and of its gradient in backward: 2 (bf16 or
  // fp16), or 4 when neither bf16 nor fp16 is enabled (fp32 training).
  std::uint64_t param_bytes = 2;
  // The master's and the moments' formats; a remainder master needs param_bytes 2.
  StateFormats states;
  std::uint64_t gpu_bytes = 0;             // budget per GPU
  std::uint64_t cpu_bytes = 0;             // budget per node
  std::uint64_t nvme_bytes = 0;            // budget per node
  PlacementMode mode = PlacementMode::kAuto;
  OffloadDevice offload_param = OffloadDevice::kNone;      // kDeepSpeed mode only
  OffloadDevice offload_optimizer = OffloadDevice::kNone;  // kDeepSpeed mode only
  std::int64_t persistence_threshold = 100'000;   // elements (stage3_param_persistence_threshold)
  std::int64_t prefetch_bucket_size = 50'000'000; // elements (stage3_prefetch_bucket_size)
  std::int64_t sub_group_size = 1'000'000'000;    // elements per optimizer sub-group
  // tierzero.step_under_backward: where not kOff, the plan counts what the
  // steps under backward hold (Plan::ahead_blocks). The engine plans with
  // kOff and adds its own count from its shards (engine/src/optimizer_step.cpp).
  StepUnderBackward step_under_backward = StepUnderBackward::kOff;
  // Note [The step keeps backward's parameter shards] (engine/src/kept_params.h):
  // the plan counts the 16-bit shards the CPU optimizer keeps from their
  // fetch for a remainder master (Plan::kept_param_blocks). from_config sets
  // it; the engine plans without and adds its own count from its shards.
  bool keep_fetched_params = false;
  // Note [Accumulating on the device across micro-batches] (engine/src/
  // gradient_path.cpp): where true, the plan counts the fp32 accumulators the
  // GPU headroom holds (Plan::grad_window_blocks) and the bytes they save. On
  // for a CUDA backend ("auto" or "cuda"); the engine plans with false and
  // adds its own count from its shards (zero_engine_setup.cpp).
  bool grads_on_device_across_micro_batches = false;
  LinkSpeeds links;

  // Stage, accumulation, precision, state formats, mode, offload devices, thresholds and
  // sizes from `config`; budgets from `budgets`. offload_param's
  // buffer_count, buffer_size and max_in_cpu are not read: the engine stages
  // parameters read from NVMe through its CPU pool, one shard per block in
  // the gather window, and keeps no cache of them (docs/placement.md).
  static PlanInput from_config(const Config& config, std::vector<std::uint64_t> block_numel, int ranks,
                               int ranks_per_node, ResolvedBudgets budgets);
  int effective_ranks_per_node() const { return ranks_per_node == 0 ? ranks : ranks_per_node; }
};

// How the blocks partition, per rank, in elements (padding included).
struct PlanLayout {
  std::uint64_t model_numel = 0;          // sum of block_numel, unpadded
  std::size_t blocks = 0;
  std::uint64_t largest_block_numel = 0;  // unpadded
  std::uint64_t param_numel = 0;          // 16-bit param shard (stage 3: non-persistent blocks)
  std::uint64_t grad_numel = 0;           // gradient accumulator the optimizer reads
  std::uint64_t optimizer_numel = 0;      // master and moments
  std::size_t persistent_blocks = 0;      // stage 3 blocks kept whole on GPU
  std::uint64_t persistent_numel = 0;     // their whole (padded) numel
  std::uint64_t persistent_shard_numel = 0;  // their shard of the optimizer states
  std::uint64_t gathered_block_numel = 0;    // largest all-gathered block, ranks x shard (stage 3)
  // The largest optimizer sub-group: blocks in model order, each group as
  // many as fit in sub_group_size but at least one (a block larger than
  // sub_group_size is a group of its own), as the engine groups them.
  std::uint64_t largest_sub_group_numel = 0;
  std::size_t sub_groups = 0;  // how many; the optimizer stages min(3, sub_groups) at once
};

struct NeedItem {
  std::string what;          // "grad (fp32)", "optimizer sub-group staging (3 x ...)", ...
  std::uint64_t bytes = 0;   // per rank
};

struct TierUsage {
  std::uint64_t per_rank_bytes = 0;   // sum of breakdown
  int ranks_sharing = 1;              // 1 for gpu, ranks_per_node for cpu and nvme
  std::uint64_t need_bytes = 0;       // per_rank_bytes x ranks_sharing
  std::uint64_t budget_bytes = 0;
  std::vector<NeedItem> breakdown;

  bool fits() const { return need_bytes <= budget_bytes; }
  std::int64_t headroom_bytes() const;  // budget - need; negative when over
};

// Per rank, per optimizer step.
struct StepTraffic {
  std::uint64_t nvme_read_bytes = 0;
  std::uint64_t nvme_write_bytes = 0;
  std::uint64_t h2d_bytes = 0;
  std::uint64_t d2h_bytes = 0;
  // Memory traffic of CPU Adam over its shard: reads the fp32 grad, reads and
  // writes master and moments in their formats, writes the training parameter
  // (and reads it, for a remainder master): (28 B + param_bytes) per element in fp32.
  std::uint64_t cpu_optimizer_bytes = 0;
  double estimated_seconds = 0;           // the four above over their link speeds, summed (no overlap)
};

// A step's bytes per parameter of the model: `bytes` moved by each rank over
// the parameters one rank's share stands for (model / ranks), e.g. NVMe
// bytes per parameter per step. 0 for an empty layout.
double bytes_per_param(std::uint64_t bytes, const PlanLayout& layout, int ranks);

struct Plan {
  std::array<Tier, kNumStateClasses> tier{};               // indexed by StateClass
  std::array<std::uint64_t, kNumStateClasses> class_bytes{};  // per rank, indexed by StateClass
  std::array<TierUsage, kNumTiers> usage{};                // indexed by Tier
  StepTraffic traffic;
  PlanLayout layout;
  std::uint64_t param_bytes = 2;        // PlanInput::param_bytes
  StateFormats states;                  // PlanInput::states
  PlacementMode mode = PlacementMode::kAuto;
  std::size_t candidates = 0;           // placements considered (1 in kDeepSpeed mode)
  std::size_t feasible_candidates = 0;  // of those, how many fit
  std::string summary;                  // one line: tiers, needs vs budgets, seconds
  // Note [Stepping under backward] (engine/src/step_ahead.h), "Cost, per
  // rank": the blocks that may step under backward (their CPU memory and the
  // second NVMe copy are in `usage`'s breakdowns), and, where not every
  // block may, why (empty when PlanInput::step_under_backward is kOff).
  std::size_t ahead_blocks = 0;
  std::string ahead_off;
  // Note [The step keeps backward's parameter shards]: the blocks whose 16-bit
  // shard the step takes from its fetch's copy instead of NVMe (their CPU
  // memory is in usage's breakdown, the NVMe reads saved are out of traffic),
  // and of how many it could (0 and 0 where it does not apply).
  std::size_t kept_param_blocks = 0, keepable_param_blocks = 0;
  std::uint64_t kept_param_numel = 0;  // the kept blocks' shards, elements per rank
  // Note [Accumulating on the device across micro-batches]: the blocks (the
  // last ones) whose micro-batches add up on the GPU, and their shards' elements.
  std::size_t grad_window_blocks = 0;
  std::uint64_t grad_window_numel = 0;

  Tier tier_of(StateClass state) const { return tier[static_cast<std::size_t>(state)]; }
  std::uint64_t bytes_of(StateClass state) const { return class_bytes[static_cast<std::size_t>(state)]; }
  double elem_bytes_of(StateClass state) const { return state_elem_bytes(state, param_bytes, states); }
  const TierUsage& usage_of(Tier t) const { return usage[static_cast<std::size_t>(t)]; }
  bool fits() const;
};

// kDeepSpeed: follows offload_param / offload_optimizer (see docs/placement.md)
// and fails with kOutOfMemory when that does not fit, saying what would.
// kAuto: the feasible placement with the least estimated movement time.
Expected<Plan> plan_placement(const PlanInput& input);

// The human-readable report tierzero-estimate prints: inputs, the state-class
// table, the tier table with headroom, each tier's breakdown, the traffic.
std::string format_plan(const Plan& plan, const PlanInput& input);

// ---- what a plan means: the largest model, the drives' life ----------------

// The largest model of a family that fits `base`'s budgets: `blocks_of(n)`
// gives the blocks of an n-parameter model (e.g. 32 equal blocks). Searches
// n in [min_params, max_params] by doubling, then bisection, to within
// `relative_tolerance` of n, assuming that a model that fits means every
// smaller one of the family fits too. kOutOfMemory (the planner's message for
// min_params) when not even min_params fits; blocks_of's errors pass through.
struct LargestModel {
  std::uint64_t params = 0;       // the largest found to fit
  Plan plan;                      // its plan
  PlanInput input;                // base with its blocks
  std::uint64_t next_params = 0;  // the smallest found not to fit (0: max_params fits)
  Status next_status;             // why next_params does not fit
};
using BlocksOf = std::function<Expected<std::vector<std::uint64_t>>(std::uint64_t params)>;
Expected<LargestModel> find_largest_model(const PlanInput& base, const BlocksOf& blocks_of, std::uint64_t min_params,
                                          std::uint64_t max_params, double relative_tolerance = 1e-4);

// A drive's rated endurance, in bytes written (TB = 1e12 B, as drives are rated).
struct DriveEndurance {
  double rated_bytes = 0;
  std::string source;  // "1200 TBW", "1 DWPD x 2.00 TB x 365 days x 5 years = 3650 TBW"
};
// kInvalidArgument naming the value unless positive and finite.
Expected<DriveEndurance> endurance_from_tbw(double tbw);
Expected<DriveEndurance> endurance_from_dwpd(double dwpd, std::uint64_t capacity_bytes, double warranty_years);

// What a plan's NVMe writes do to the node's drives: every rank on a node
// writes to the node's NVMe tier (per-rank writes x ranks_per_node), and a
// drive's rating is reached after rated_bytes of them.
struct DriveWear {
  std::uint64_t written_per_step_bytes = 0;  // per node
  double step_seconds = 0;                   // as given
  double written_per_hour_bytes = 0;         // per node, at that step time
  double days_to_rating = 0;                 // of training, around the clock; infinity when nothing is written
};
DriveWear drive_wear(const Plan& plan, const PlanInput& input, double step_seconds, const DriveEndurance& endurance);
// The least time a step can take on the drives: its NVMe reads and writes at
// the link speeds, one after the other (a drive shares its time between them).
double nvme_bound_seconds(const Plan& plan, const PlanInput& input);

}  // namespace tz
