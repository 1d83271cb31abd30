// The placement planner: layout, needs, traffic, and the search over
// placements. Reports, budgets and names live in planner_report.cpp.
//
// Note [Planner formulas]: docs/placement.md derives every number computed
// here; a change to one is a change to the other, and to planner_test.cpp's
// hand-computed expectations.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "planner_internal.h"
#include "tierzero/offload/planner.h"

namespace tz {

using planner_internal::deepspeed_error;
using planner_internal::evaluate_placement;
using planner_internal::no_fit_error;
using planner_internal::Placement;

namespace {

// Each shard is a whole number of 2048 elements: 4 KiB of bf16, the O_DIRECT
// unit, so a shard's file extent never shares a page with its neighbour.
constexpr std::uint64_t kShardAlignNumel = 2048;
// 2^50 elements (a quadrillion) keeps every byte count below 2^64 even at 16 B/elem.
constexpr std::uint64_t kMaxModelNumel = std::uint64_t{1} << 50;

std::uint64_t sat_mul(std::uint64_t a, std::uint64_t b) {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) {
    return std::numeric_limits<std::uint64_t>::max();
  }
  return a * b;
}

std::uint64_t sat_add(std::uint64_t a, std::uint64_t b) {
  return b > std::numeric_limits<std::uint64_t>::max() - a ? std::numeric_limits<std::uint64_t>::max() : a + b;
}

std::uint64_t as_u64(std::int64_t v) { return v < 0 ? 0 : static_cast<std::uint64_t>(v); }

struct SizeField {
  const char* key;
  std::int64_t value;
  std::int64_t min;
};

Status validate_sizes(const PlanInput& in) {
  const SizeField fields[] = {
      {"zero_optimization.stage3_param_persistence_threshold", in.persistence_threshold, 0},
      {"zero_optimization.stage3_prefetch_bucket_size", in.prefetch_bucket_size, 0},
      {"zero_optimization.sub_group_size", in.sub_group_size, 1},
  };
  for (const SizeField& f : fields) {
    if (f.value < f.min) return invalid_argument("{} is {}; it must be at least {}", f.key, f.value, f.min);
  }
  const std::pair<const char*, double> links[] = {{"nvme_read_Bps", in.links.nvme_read_Bps},
                                                  {"nvme_write_Bps", in.links.nvme_write_Bps},
                                                  {"pcie_Bps", in.links.pcie_Bps},
                                                  {"cpu_mem_Bps", in.links.cpu_mem_Bps}};
  for (const auto& [name, speed] : links) {
    if (!(speed > 0) || !std::isfinite(speed)) {
      return invalid_argument("link speed {} is {}; it must be a positive number of bytes/second", name, speed);
    }
  }
  return ok_status();
}

Status validate_blocks(const std::vector<std::uint64_t>& blocks) {
  if (blocks.empty()) return invalid_argument("the model has no blocks (block_numel is empty)");
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i] == 0) return invalid_argument("block {} has 0 elements; every block must hold at least one", i);
    if (blocks[i] > kMaxModelNumel || total + blocks[i] > kMaxModelNumel) {
      return invalid_argument("the model has more than 2^50 elements (block {} reaches it); too large to plan", i);
    }
    total += blocks[i];
  }
  return ok_status();
}

Status validate(const PlanInput& in) {
  if (in.ranks < 1) return invalid_argument("ranks is {}; it must be at least 1", in.ranks);
  if (in.ranks_per_node < 0 || in.ranks_per_node > in.ranks ||
      (in.ranks_per_node > 0 && in.ranks % in.ranks_per_node != 0)) {
    return invalid_argument("ranks_per_node is {}; it must divide ranks ({}), or be 0 for all ranks on one node",
                            in.ranks_per_node, in.ranks);
  }
  if (in.stage < 0 || in.stage > 3) {
    return invalid_argument("ZeRO stage is {}; it must be 0, 1, 2 or 3 (zero_optimization.stage)", in.stage);
  }
  if (in.gradient_accumulation_steps < 1) {
    return invalid_argument("gradient_accumulation_steps is {}; it must be at least 1",
                            in.gradient_accumulation_steps);
  }
  if (in.param_bytes != 2 && in.param_bytes != 4) {
    return invalid_argument("param_bytes is {}; it must be 2 (bf16 or fp16) or 4 (fp32)", in.param_bytes);
  }
  if (in.states.master == MasterFormat::kRemainder && in.param_bytes != 2) {
    return invalid_argument("tierzero.states.master \"remainder\" needs bf16 parameters, but param_bytes is {} (fp32 "
                            "training): there is no 16-bit parameter to build the master on",
                            in.param_bytes);
  }
  TZ_TRY(validate_blocks(in.block_numel));
  return validate_sizes(in);
}

PlanLayout compute_layout(const PlanInput& in) {
  PlanLayout l;
  const auto ranks = static_cast<std::uint64_t>(in.ranks);
  const bool stage3 = in.stage == 3;
  l.blocks = in.block_numel.size();
  const std::uint64_t group_limit = std::max<std::uint64_t>(as_u64(in.sub_group_size), 1);
  std::uint64_t in_group = 0;
  for (std::uint64_t n : in.block_numel) {
    const std::uint64_t shard = align_up((n + ranks - 1) / ranks, kShardAlignNumel);
    const std::uint64_t whole = align_up(n, kShardAlignNumel);
    l.model_numel += n;
    l.largest_block_numel = std::max(l.largest_block_numel, n);
    if (stage3 && n < as_u64(in.persistence_threshold)) {
      ++l.persistent_blocks;
      l.persistent_numel += whole;
      l.persistent_shard_numel += shard;
    } else if (stage3) {
      l.param_numel += shard;
      l.gathered_block_numel = std::max(l.gathered_block_numel, shard * ranks);
    } else {
      l.param_numel += whole;
    }
    l.grad_numel += in.stage >= 2 ? shard : whole;
    const std::uint64_t stepped = in.stage >= 1 ? shard : whole;
    l.optimizer_numel += stepped;
    if (in_group > 0 && in_group + stepped > group_limit) in_group = 0;
    if (in_group == 0) ++l.sub_groups;
    in_group += stepped;
    l.largest_sub_group_numel = std::max(l.largest_sub_group_numel, in_group);
  }
  return l;
}

std::size_t idx(StateClass s) { return static_cast<std::size_t>(s); }
std::size_t idx(Tier t) { return static_cast<std::size_t>(t); }

// "16-bit params" or "fp32 params": what the training parameters are.
std::string_view params_name(std::uint64_t param_bytes) { return param_bytes == 2 ? "16-bit params" : "fp32 params"; }

std::string_view class_what(StateClass s, std::uint64_t param_bytes, StateFormats formats) {
  switch (s) {
    case StateClass::kParam16: return params_name(param_bytes);
    case StateClass::kGrad:
      switch (formats.grads) {
        case GradFormat::kFp32: return "fp32 grads";
        case GradFormat::kBf16: return "bf16 grads (data_types.grad_accum_dtype)";
        case GradFormat::kFp16: return "fp16 grads (data_types.grad_accum_dtype)";
      }
      return "grads";
    case StateClass::kMaster:
      return formats.master == MasterFormat::kFp32 ? "fp32 master weights"
                                                   : "master weights as int16 remainders + tie bits";
    case StateClass::kMoments:
      switch (formats.moments) {
        case MomentFormat::kFp32: break;
        case MomentFormat::kBf16: return "Adam moments exp_avg + exp_avg_sq in bf16";
        case MomentFormat::kInt8: return "Adam moments exp_avg + exp_avg_sq in int8 + fp32 block scales";
      }
      return "Adam moments exp_avg + exp_avg_sq";
  }
  return "?";
}

std::string class_label(StateClass s, std::uint64_t param_bytes, StateFormats formats, std::uint64_t numel) {
  return fmt::format("{} ({:g} B x {} elem)", class_what(s, param_bytes, formats),
                     state_elem_bytes(s, param_bytes, formats), format_count(static_cast<double>(numel)));
}

void add_item(TierUsage& usage, std::string what, std::uint64_t bytes) {
  if (bytes == 0) return;
  usage.breakdown.push_back({std::move(what), bytes});
  // Saturate rather than wrap: absurd buffer settings must read as "too big".
  usage.per_rank_bytes = sat_add(usage.per_rank_bytes, bytes);
}

// Note [Gather window]: the gathered blocks a rank holds at once, in
// elements: the block in use plus the prefetch window behind it, which is
// stage3_prefetch_bucket_size but at least one block (engine/src/prefetch.h,
// Note [Prefetch window]). stage3_max_live_parameters does not cap it: the
// engine does not honour that key (Note [Inert keys]), and planning with it
// under-counted blocks over half of it. Never more than the gathered blocks
// there are. 0 below stage 3 (no block is gathered).
std::uint64_t gather_window(const PlanInput& in, const PlanLayout& l) {
  if (in.stage != 3 || l.gathered_block_numel == 0) return 0;
  const std::uint64_t largest = l.gathered_block_numel;
  const std::uint64_t all = l.param_numel * static_cast<std::uint64_t>(std::max(in.ranks, 1));
  return std::min(largest + std::max(largest, as_u64(in.prefetch_bucket_size)), std::max(all, largest));
}

void add_gpu_extras(const PlanInput& in, Plan& plan) {
  const PlanLayout& l = plan.layout;
  const std::uint64_t b = in.param_bytes;  // a parameter, and its gradient in backward
  TierUsage& gpu = plan.usage[idx(Tier::kGpu)];
  add_item(gpu,
           fmt::format("{} persistent blocks, whole: params + grads ({} B x {} elem)", l.persistent_blocks, 2 * b,
                       format_count(static_cast<double>(l.persistent_numel))),
           2 * b * l.persistent_numel);
  const std::uint64_t live = gather_window(in, l);
  if (live == 0) return;
  const std::uint64_t largest = l.gathered_block_numel;
  add_item(gpu,
           fmt::format("gathered {}, current + prefetch ({} B x {} elem)", params_name(b), b,
                       format_count(static_cast<double>(live))),
           b * live);
  // The whole gradient of the block in backward, and up to kMaxPendingGrads
  // more waiting for their reduce-scatter (the gradient path's backpressure
  // bound), each with its reduced shard.
  // ZeroEngine.ThePoolsStayWithinThePlan measures it.
  const std::uint64_t ranks = static_cast<std::uint64_t>(std::max(in.ranks, 1));
  const std::uint64_t shard = largest / ranks;
  const std::uint64_t pending = kMaxPendingGrads;
  add_item(gpu,
           fmt::format("gradients: the block in backward + {} pending, whole ({} B x {} x {} elem)", pending, b,
                       pending + 1, format_count(static_cast<double>(largest))),
           (pending + 1) * b * largest);
  add_item(gpu,
           fmt::format("their reduced shards ({} x {} B x {} elem)", pending, b,
                       format_count(static_cast<double>(shard))),
           pending * b * shard);
}

void add_cpu_extras(const PlanInput& in, Plan& plan) {
  const PlanLayout& l = plan.layout;
  TierUsage& cpu = plan.usage[idx(Tier::kCpu)];
  const std::uint64_t b = in.param_bytes;
  const std::uint64_t ranks = static_cast<std::uint64_t>(std::max(in.ranks, 1));
  if (plan.tier_of(StateClass::kParam16) == Tier::kNvme) {
    // Each block in the gather window is read into CPU staging (its shard)
    // on its way to the device.
    const std::uint64_t staged = (gather_window(in, l) + ranks - 1) / ranks;
    add_item(cpu,
             fmt::format("param NVMe staging, the gather window's shards ({} B x {} elem)", b,
                         format_count(static_cast<double>(staged))),
             b * staged);
  }
  if (plan.tier_of(StateClass::kMaster) == Tier::kGpu) return;  // the GPU optimizer stages nothing here
  // The CPU optimizer's host buffers (engine/src/optimizer_pass.cpp,
  // zero_engine.cpp): three sub-groups in flight (reading the next, updating
  // this, writing the last; one per group when there are fewer), each with
  // the states that live on NVMe and, unless the parameters live in CPU
  // memory, their new 16-bit copy on its way out; and each arriving gradient
  // shard, copied down in the parameters' type (and accumulated in staging of
  // the accumulator's dtype when the accumulators live on NVMe).
  const std::uint64_t group = l.largest_sub_group_numel;
  const std::uint64_t sets = std::min<std::uint64_t>(kStagingSets, l.sub_groups);
  double nvme_elem_bytes = 0;
  std::uint64_t nvme_group_bytes = 0;
  std::string names;
  for (StateClass s : {StateClass::kGrad, StateClass::kMaster, StateClass::kMoments}) {
    if (plan.tier_of(s) != Tier::kNvme) continue;
    nvme_elem_bytes += state_elem_bytes(s, in.param_bytes, in.states);
    nvme_group_bytes += state_bytes(s, group, in.param_bytes, in.states);
    names += names.empty() ? "" : " + ";
    names += state_class_name(s);
  }
  if (nvme_group_bytes > 0) {
    add_item(cpu,
             fmt::format("optimizer sub-group staging ({} x {} elem x {:g} B: {})", sets,
                         format_count(static_cast<double>(group)), nvme_elem_bytes, names),
             sets * nvme_group_bytes);
  }
  // A remainder master reads the 16-bit shard in through the same buffer its
  // new value leaves by (Note [Remainder traffic]): no more staging.
  if (plan.tier_of(StateClass::kParam16) != Tier::kCpu && b != 4) {
    const bool in_and_out = in.states.master == MasterFormat::kRemainder;
    add_item(cpu,
             fmt::format("optimizer 16-bit {} staging ({} x {} elem x {} B)", in_and_out ? "copy-in/out" : "copy-out",
                         sets, format_count(static_cast<double>(group)), b),
             sets * group * b);
  }
  const std::uint64_t shard = align_up((l.largest_block_numel + ranks - 1) / ranks, kShardAlignNumel);
  // Accumulations into accumulators on NVMe run one at a time on the
  // engine's grad thread; cheap ones into CPU memory also run inline on the
  // thread that reduced the gradient (Note [Cheap accumulations run inline]),
  // so up to three at once: the training thread's, the comm thread's and the
  // grad thread's (ZeroEngine.ThePoolsStayWithinThePlan measures it).
  const bool on_nvme = plan.tier_of(StateClass::kGrad) == Tier::kNvme;
  const std::uint64_t arrival = on_nvme ? b + grad_bytes_per_elem(in.states.grads) : b;
  const std::uint64_t at_once = on_nvme ? 1 : 3;
  add_item(cpu,
           fmt::format("gradient shards arriving ({} x {} B x {} elem{})", at_once, arrival,
                       format_count(static_cast<double>(shard)),
                       on_nvme ? ": copied down, its accumulation staged" : ", copied down"),
           at_once * arrival * shard);
}

void fill_usage(const PlanInput& in, Plan& plan) {
  const PlanLayout& l = plan.layout;
  const std::uint64_t numel[] = {l.param_numel, l.grad_numel, l.optimizer_numel, l.optimizer_numel};
  for (std::size_t c = 0; c < kNumStateClasses; ++c) {
    const auto s = static_cast<StateClass>(c);
    add_item(plan.usage[idx(plan.tier[c])], class_label(s, in.param_bytes, in.states, numel[c]),
             plan.class_bytes[c]);
  }
  add_gpu_extras(in, plan);
  add_cpu_extras(in, plan);
  const std::uint64_t budgets[] = {in.gpu_bytes, in.cpu_bytes, in.nvme_bytes};
  for (std::size_t t = 0; t < kNumTiers; ++t) {
    TierUsage& u = plan.usage[t];
    u.ranks_sharing = t == idx(Tier::kGpu) ? 1 : in.effective_ranks_per_node();
    u.need_bytes = sat_mul(u.per_rank_bytes, static_cast<std::uint64_t>(u.ranks_sharing));
    u.budget_bytes = budgets[t];
  }
}

// counter += the product of `factors`, saturating at 2^64 - 1 (a step of a
// huge model with many micro-batches can pass 2^64 bytes).
void add_bytes(std::uint64_t& counter, std::initializer_list<std::uint64_t> factors) {
  std::uint64_t product = 1;
  for (std::uint64_t f : factors) product = sat_mul(product, f);
  counter = sat_add(counter, product);
}

// Note [Remainder traffic]: a remainder master is rebuilt from the 16-bit
// parameter, so the optimizer reads each parameter shard from where it lives
// before it steps: from NVMe (param16 on NVMe), down over PCIe (param16 on
// the GPU, and the persistent blocks' shards, for CPU Adam), up over PCIe
// (param16 off the GPU, for GPU Adam), or in place (param16 where the
// optimizer runs). The buffer it arrives in is the one the new parameter
// leaves by, so the staging is the copy-out staging the plan already holds.
// With the parameters on NVMe and CPU Adam the step copies it instead from
// the staging the last fetch read it into, for the blocks the CPU headroom
// holds (add_kept_params, after the placement: Note [The step keeps
// backward's parameter shards] in engine/src/kept_params.h).
void add_remainder_reads(const PlanInput& in, const Plan& plan, StepTraffic& t) {
  if (in.states.master != MasterFormat::kRemainder) return;
  const std::uint64_t p = plan.layout.param_numel;
  const std::uint64_t b = in.param_bytes;
  const Tier where = plan.tier_of(StateClass::kParam16);
  if (where == Tier::kNvme) add_bytes(t.nvme_read_bytes, {b, p - plan.kept_param_numel});  // kept: add_kept_params
  if (plan.tier_of(StateClass::kMaster) == Tier::kGpu) {
    if (where != Tier::kGpu) add_bytes(t.h2d_bytes, {b, p});
    return;
  }
  if (where == Tier::kGpu) add_bytes(t.d2h_bytes, {b, p});
  add_bytes(t.d2h_bytes, {b, plan.layout.persistent_shard_numel});
  add_bytes(t.cpu_optimizer_bytes, {b, plan.layout.optimizer_numel});
}

// CPU Adam's memory traffic per step: it reads the gradient accumulator (4 B,
// or 2 with data_types.grad_accum_dtype 16-bit), reads and writes master and
// moments (in their formats) and writes the training parameter (2 B for a
// 16-bit one, 4 B in fp32 training): 28 B + b per element in the fp32
// formats. The remainder's parameter read is add_remainder_reads'.
std::uint64_t cpu_adam_bytes(const PlanInput& in, std::uint64_t numel) {
  std::uint64_t bytes = 0;
  add_bytes(bytes, {grad_bytes_per_elem(in.states.grads) + in.param_bytes, numel});
  add_bytes(bytes, {2, master_bytes(in.states.master, numel)});
  add_bytes(bytes, {2, moments_bytes(in.states.moments, numel)});
  return bytes;
}

void add_param_traffic(const PlanInput& in, const Plan& plan, StepTraffic& t) {
  const std::uint64_t g = static_cast<std::uint64_t>(in.gradient_accumulation_steps);
  const std::uint64_t p = plan.layout.param_numel;
  const std::uint64_t b = in.param_bytes;
  const Tier where = plan.tier_of(StateClass::kParam16);
  const bool gpu_optimizer = plan.tier_of(StateClass::kMaster) == Tier::kGpu;
  // Off-GPU shards come up once for forward and once for backward per micro-batch.
  if (where != Tier::kGpu) add_bytes(t.h2d_bytes, {b, p, 2, g});
  if (where == Tier::kNvme) {
    add_bytes(t.nvme_read_bytes, {b, p, 2, g});  // no CPU cache: every fetch reads its shard
    add_bytes(t.nvme_write_bytes, {b, p});  // the new parameter shard after the step
  }
  if (gpu_optimizer) {
    if (where != Tier::kGpu) add_bytes(t.d2h_bytes, {b, p});  // GPU Adam's new params go down to their tier
  } else {
    if (where == Tier::kGpu) add_bytes(t.h2d_bytes, {b, p});  // CPU Adam's new params come up
    add_bytes(t.h2d_bytes, {b, plan.layout.persistent_shard_numel});
    t.cpu_optimizer_bytes = sat_add(t.cpu_optimizer_bytes, cpu_adam_bytes(in, plan.layout.optimizer_numel));
  }
  add_remainder_reads(in, plan, t);
}

StepTraffic step_traffic(const PlanInput& in, const Plan& plan) {
  StepTraffic t;
  add_param_traffic(in, plan, t);
  const std::uint64_t g = static_cast<std::uint64_t>(in.gradient_accumulation_steps);
  const std::uint64_t grad = plan.layout.grad_numel;
  const std::uint64_t opt = plan.layout.optimizer_numel;
  // The gradient leaves the GPU in the parameters' type; the host accumulates
  // it in fp32, or 16 bits (data_types.grad_accum_dtype). The blocks that
  // accumulate on the device (Note [Accumulating on the device across
  // micro-batches]) send their fp32 sum down once and store it once.
  const std::uint64_t window = std::min(plan.grad_window_numel, grad);
  if (plan.tier_of(StateClass::kGrad) != Tier::kGpu) {
    add_bytes(t.d2h_bytes, {in.param_bytes, grad - window, g});
    add_bytes(t.d2h_bytes, {4, window});
  }
  if (plan.tier_of(StateClass::kGrad) == Tier::kNvme) {
    // Each micro-batch writes its accumulated grads; every one but the
    // first reads them back to accumulate, and the step reads them once.
    const std::uint64_t acc = grad_bytes_per_elem(in.states.grads);
    add_bytes(t.nvme_write_bytes, {acc, grad - window, g});
    add_bytes(t.nvme_read_bytes, {acc, grad - window, g});
    add_bytes(t.nvme_write_bytes, {acc, window});
    add_bytes(t.nvme_read_bytes, {acc, window});
  }
  for (StateClass s : {StateClass::kMaster, StateClass::kMoments}) {
    if (plan.tier_of(s) != Tier::kNvme) continue;
    const std::uint64_t bytes = state_bytes(s, opt, in.param_bytes, in.states);
    add_bytes(t.nvme_read_bytes, {bytes});
    add_bytes(t.nvme_write_bytes, {bytes});
  }
  const LinkSpeeds& s = in.links;
  t.estimated_seconds = static_cast<double>(t.nvme_read_bytes) / s.nvme_read_Bps +
                        static_cast<double>(t.nvme_write_bytes) / s.nvme_write_Bps +
                        (static_cast<double>(t.h2d_bytes) + static_cast<double>(t.d2h_bytes)) / s.pcie_Bps +
                        static_cast<double>(t.cpu_optimizer_bytes) / s.cpu_mem_Bps;
  return t;
}

std::vector<Placement> candidate_placements(const PlanInput& in) {
  std::vector<Tier> param_tiers = {Tier::kGpu};
  if (in.stage == 3) param_tiers = {Tier::kGpu, Tier::kCpu, Tier::kNvme};
  std::vector<Placement> out;
  for (Tier param : param_tiers) {
    // The GPU optimizer steps every master and moment format (Note [Compact
    // states on the GPU optimizer] in engine/src/optimizer_pass_gpu.cpp), and
    // accumulates gradients in fp32 only (data_types.grad_accum_dtype).
    if (in.states.grads == GradFormat::kFp32) {
      out.push_back({param, Tier::kGpu, Tier::kGpu, Tier::kGpu});
    }
    for (Tier master : {Tier::kCpu, Tier::kNvme}) {
      for (Tier grad : {Tier::kCpu, Tier::kNvme}) {
        for (Tier moments : {Tier::kCpu, Tier::kNvme}) out.push_back({param, grad, master, moments});
      }
    }
  }
  return out;
}

// Note [Tie-break]: equal movement time (within rounding) goes to fewer bytes
// on the slower tiers (NVMe, then CPU), then to the hotter state on the faster
// tier: grads are touched every micro-batch, params every pass, master and
// moments once a step.
bool preferred(const Plan& a, const Plan& b) {
  const double ta = a.traffic.estimated_seconds;
  const double tb = b.traffic.estimated_seconds;
  if (std::abs(ta - tb) > 1e-9 * std::max(ta, tb)) return ta < tb;
  for (Tier t : {Tier::kNvme, Tier::kCpu}) {
    if (a.usage_of(t).need_bytes != b.usage_of(t).need_bytes) {
      return a.usage_of(t).need_bytes < b.usage_of(t).need_bytes;
    }
  }
  for (StateClass s : {StateClass::kGrad, StateClass::kParam16, StateClass::kMaster, StateClass::kMoments}) {
    if (a.tier_of(s) != b.tier_of(s)) return a.tier_of(s) < b.tier_of(s);
  }
  return false;
}

Expected<Plan> plan_auto(const PlanInput& in, const PlanLayout& layout) {
  const std::vector<Placement> all = candidate_placements(in);
  std::optional<Plan> best;
  std::size_t feasible = 0;
  // least[t]: tier t's smallest need among the placements whose faster tiers
  // fit, so a no-fit message can say how far each budget is from enough.
  std::array<std::uint64_t, kNumTiers> least;
  least.fill(std::numeric_limits<std::uint64_t>::max());
  for (const Placement& p : all) {
    Plan plan = evaluate_placement(in, layout, p);
    for (std::size_t t = 0; t < kNumTiers && (t == 0 || plan.usage[t - 1].fits()); ++t) {
      least[t] = std::min(least[t], plan.usage[t].need_bytes);
    }
    if (!plan.fits()) continue;
    ++feasible;
    if (!best || preferred(plan, *best)) best = std::move(plan);
  }
  if (!best) return no_fit_error(in, layout, least, all.size());
  best->mode = PlacementMode::kAuto;  // also when asked for as DeepSpeed mode's alternative
  best->candidates = all.size();
  best->feasible_candidates = feasible;
  return *std::move(best);
}

Tier device_tier(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kCpu: return Tier::kCpu;
    case OffloadDevice::kNvme: return Tier::kNvme;
    case OffloadDevice::kNone: break;
  }
  return Tier::kGpu;
}

Expected<Plan> plan_deepspeed(const PlanInput& in, const PlanLayout& layout) {
  if (in.offload_param != OffloadDevice::kNone && in.stage != 3) {
    return invalid_argument("zero_optimization.offload_param.device \"{}\" needs ZeRO stage 3, but stage is {}",
                            offload_device_name(in.offload_param), in.stage);
  }
  const Tier param = device_tier(in.offload_param);
  Placement p = {param, Tier::kGpu, Tier::kGpu, Tier::kGpu};
  if (in.offload_optimizer == OffloadDevice::kCpu) p = {param, Tier::kCpu, Tier::kCpu, Tier::kCpu};
  if (in.offload_optimizer == OffloadDevice::kNvme) p = {param, Tier::kCpu, Tier::kNvme, Tier::kNvme};
  Plan plan = evaluate_placement(in, layout, p);
  // DeepSpeed keeps the fp32 grad partition in CPU memory; where that does not
  // fit we let it follow the optimizer states to NVMe.
  if (in.offload_optimizer == OffloadDevice::kNvme && !plan.usage_of(Tier::kCpu).fits()) {
    p[idx(StateClass::kGrad)] = Tier::kNvme;
    plan = evaluate_placement(in, layout, p);
  }
  plan.candidates = 1;
  plan.feasible_candidates = plan.fits() ? 1 : 0;
  if (!plan.fits()) {
    Expected<Plan> alternative = plan_auto(in, layout);
    return deepspeed_error(in, plan, alternative.ok() ? &*alternative : nullptr, alternative.status());
  }
  return plan;
}

}  // namespace

double state_elem_bytes(StateClass state, std::uint64_t param_bytes, StateFormats formats) {
  switch (state) {
    case StateClass::kParam16: return static_cast<double>(param_bytes);
    // 4 B, or 2 with data_types.grad_accum_dtype 16-bit (off the GPU only:
    // the GPU optimizer keeps fp32, and a 16-bit accumulator never plans it).
    case StateClass::kGrad: return static_cast<double>(grad_bytes_per_elem(formats.grads));
    case StateClass::kMaster: return master_bytes_per_elem(formats.master);
    case StateClass::kMoments: return moments_bytes_per_elem(formats.moments);
  }
  return 0;
}

std::uint64_t state_bytes(StateClass state, std::uint64_t numel, std::uint64_t param_bytes, StateFormats formats) {
  switch (state) {
    case StateClass::kParam16: return sat_mul(param_bytes, numel);
    case StateClass::kGrad: return sat_mul(grad_bytes_per_elem(formats.grads), numel);
    case StateClass::kMaster: return master_bytes(formats.master, numel);
    case StateClass::kMoments: return moments_bytes(formats.moments, numel);
  }
  return 0;
}

std::string_view state_format_name(StateClass state, std::uint64_t param_bytes, StateFormats formats) {
  switch (state) {
    case StateClass::kParam16: return param_bytes == 2 ? "bf16/fp16" : "fp32";
    case StateClass::kGrad: return grad_format_name(formats.grads);
    case StateClass::kMaster: return master_format_name(formats.master);
    case StateClass::kMoments: return moment_format_name(formats.moments);
  }
  return "?";
}

double bytes_per_param(std::uint64_t bytes, const PlanLayout& layout, int ranks) {
  if (layout.model_numel == 0) return 0;
  return static_cast<double>(bytes) * static_cast<double>(std::max(ranks, 1)) / static_cast<double>(layout.model_numel);
}

std::int64_t TierUsage::headroom_bytes() const {
  constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  if (budget_bytes >= need_bytes) return static_cast<std::int64_t>(std::min(budget_bytes - need_bytes, kMax));
  return -static_cast<std::int64_t>(std::min(need_bytes - budget_bytes, kMax));
}

bool Plan::fits() const {
  return std::all_of(usage.begin(), usage.end(), [](const TierUsage& u) { return u.fits(); });
}

Plan planner_internal::evaluate_placement(const PlanInput& in, const PlanLayout& layout,
                                          const Placement& placement) {
  Plan plan;
  plan.tier = placement;
  plan.layout = layout;
  plan.param_bytes = in.param_bytes;
  plan.states = in.states;
  plan.mode = in.mode;
  const std::uint64_t numel[] = {layout.param_numel, layout.grad_numel, layout.optimizer_numel,
                                 layout.optimizer_numel};
  for (std::size_t c = 0; c < kNumStateClasses; ++c) {
    plan.class_bytes[c] = state_bytes(static_cast<StateClass>(c), numel[c], in.param_bytes, in.states);
  }
  fill_usage(in, plan);
  plan.traffic = step_traffic(in, plan);
  plan.summary = planner_internal::plan_summary(plan);
  return plan;
}

namespace {

// What the passes after the placement share (add_kept_params,
// add_step_ahead, add_grad_window: each counts what the engine adds to its
// own plan): a block's shard on one rank, as compute_layout pads it; this
// rank's share of a tier's headroom; and a need added to a tier.
std::uint64_t rank_shard_numel(const PlanInput& in, std::uint64_t numel) {
  const std::uint64_t ranks = static_cast<std::uint64_t>(std::max(in.ranks, 1));
  return align_up((numel + ranks - 1) / ranks, kShardAlignNumel);
}

std::int64_t rank_headroom(const Plan& plan, Tier t) {
  const TierUsage& u = plan.usage_of(t);
  return u.headroom_bytes() / std::max(u.ranks_sharing, 1);
}

void add_need(Plan& plan, Tier t, std::string what, std::uint64_t bytes) {
  TierUsage& u = plan.usage[idx(t)];
  add_item(u, std::move(what), bytes);
  u.need_bytes = sat_mul(u.per_rank_bytes, static_cast<std::uint64_t>(std::max(u.ranks_sharing, 1)));
}

// Note [Accumulating on the device across micro-batches] (engine/src/
// gradient_path.cpp), counted as the engine counts it (grad_window_blocks in
// zero_engine_setup.cpp): with the CPU optimizer, fp32 accumulators and G >= 2,
// an fp32 accumulator per block from the last (backward reaches it first)
// while this rank's share of the GPU headroom holds it; after the placement
// is chosen, as the engine decides, and the traffic follows.
void add_grad_window(const PlanInput& in, Plan& plan) {
  if (!in.grads_on_device_across_micro_batches || in.gradient_accumulation_steps < 2 ||
      plan.tier_of(StateClass::kMaster) == Tier::kGpu || in.states.grads != GradFormat::kFp32) {
    return;
  }
  std::int64_t room = rank_headroom(plan, Tier::kGpu);
  for (std::size_t b = in.block_numel.size(); b-- > 0;) {
    const std::uint64_t shard = rank_shard_numel(in, in.block_numel[b]);
    if (static_cast<std::int64_t>(shard * 4) > room) break;
    room -= static_cast<std::int64_t>(shard * 4);
    plan.grad_window_numel += shard;
    ++plan.grad_window_blocks;
  }
  if (plan.grad_window_blocks == 0) return;
  add_need(plan, Tier::kGpu,
           fmt::format("fp32 gradient accumulators across micro-batches, {} of {} blocks (Note [Accumulating on the "
                       "device across micro-batches])", plan.grad_window_blocks, in.block_numel.size()),
           plan.grad_window_numel * 4);
  plan.traffic = step_traffic(in, plan);
  plan.summary = planner_internal::plan_summary(plan);
}

// Note [Stepping under backward] (engine/src/step_ahead.h), "Cost, per
// rank", counted as the engine counts it (make_stores, make_step_ahead) but
// from the layout: a second NVMe copy of the NVMe master and moments where
// the NVMe headroom holds it; in CPU memory three blocks' NVMe states as
// staging and, per block from the last (backward reaches it first) while the
// CPU headroom holds them, its new 16-bit shard and its old CPU-resident
// master and moments. After the placement is chosen: what does not fit turns
// the speculation off (or shortens it), never the placement.
void add_step_ahead(const PlanInput& in, Plan& plan) {
  if (in.step_under_backward == StepUnderBackward::kOff || plan.tier_of(StateClass::kMaster) == Tier::kGpu) return;
  const auto shard_of = [&](std::uint64_t numel) { return rank_shard_numel(in, numel); };
  const auto add = [&](Tier t, std::string what, std::uint64_t bytes) { add_need(plan, t, std::move(what), bytes); };
  const auto share = [&](Tier t) { return rank_headroom(plan, t); };
  std::uint64_t shadow = 0;
  for (StateClass s : {StateClass::kMaster, StateClass::kMoments}) {
    if (plan.tier_of(s) == Tier::kNvme) shadow += plan.bytes_of(s);
  }
  if (shadow > 0 && static_cast<std::int64_t>(shadow) > share(Tier::kNvme)) {
    plan.ahead_off = fmt::format("stepping under backward writes the new NVMe master and moments ({}) beside the "
                                 "old ones, and this rank's share of the NVMe headroom is {}",
                                 format_bytes(shadow), format_bytes(as_u64(share(Tier::kNvme))));
    return;
  }
  const std::uint64_t largest = shard_of(plan.layout.largest_block_numel);
  std::uint64_t staging = 0;
  for (StateClass s : {StateClass::kGrad, StateClass::kMaster, StateClass::kMoments}) {
    if (plan.tier_of(s) == Tier::kNvme) staging += std::uint64_t{kAheadStagingBlocks} * state_bytes(s, largest, in.param_bytes, in.states);
  }
  std::uint64_t need = staging;
  // "auto" leaves small blocks to after backward, as the engine does (make_step_ahead).
  const std::uint64_t min_numel = in.step_under_backward == StepUnderBackward::kAuto ? kAutoAheadMinBlockNumel : 0;
  std::size_t large = 0;
  for (std::size_t b = in.block_numel.size(); b-- > 0;) {
    const std::uint64_t shard = shard_of(in.block_numel[b]);
    if (shard < min_numel) continue;
    ++large;
    std::uint64_t slot = shard * in.param_bytes;
    for (StateClass s : {StateClass::kMaster, StateClass::kMoments}) {
      if (plan.tier_of(s) != Tier::kNvme) slot += state_bytes(s, shard, in.param_bytes, in.states);
    }
    if (static_cast<std::int64_t>(need + slot) > share(Tier::kCpu)) break;
    need += slot;
    ++plan.ahead_blocks;
  }
  if (large == 0) {
    plan.ahead_off = fmt::format("\"auto\" steps blocks of at least {} elements per rank under backward and this "
                                 "model's are smaller", min_numel);
    return;
  }
  if (plan.ahead_blocks == 0) {
    plan.ahead_off = fmt::format("stepping under backward needs more CPU memory than this rank's share of the CPU "
                                 "headroom ({}) for its first block", format_bytes(as_u64(share(Tier::kCpu))));
    return;
  }
  if (plan.ahead_blocks < large) {
    plan.ahead_off = fmt::format("{} of {} blocks step under backward: the CPU headroom holds no more", plan.ahead_blocks,
                                 in.block_numel.size());
  } else if (plan.ahead_blocks < in.block_numel.size()) {
    plan.ahead_off = fmt::format("{} of {} blocks step under backward: \"auto\" leaves blocks of fewer than {} "
                                 "elements per rank to after backward", plan.ahead_blocks, in.block_numel.size(), min_numel);
  }
  add(Tier::kCpu,
      fmt::format("steps under backward: {} blocks' old master + moments and new params, and three blocks' NVMe states "
                  "as staging", plan.ahead_blocks),
      need);
  if (shadow > 0) add(Tier::kNvme, "steps under backward: a second copy of the master and moments", shadow);
}

// Note [The step keeps backward's parameter shards] (engine/src/kept_params.h),
// counted as the engine counts it (make_kept_params) but from the layout:
// with a remainder master stepped by the CPU optimizer and the 16-bit
// parameters on NVMe, each non-persistent block's 16-bit shard, from the
// last block while this rank's share of the CPU headroom holds them; the
// step's NVMe reads of those shards (Note [Remainder traffic]) leave the
// traffic. Before the steps under backward take their share, as in the engine.
void add_kept_params(const PlanInput& in, Plan& plan) {
  if (!in.keep_fetched_params || in.states.master != MasterFormat::kRemainder ||
      plan.tier_of(StateClass::kParam16) != Tier::kNvme || plan.tier_of(StateClass::kMaster) == Tier::kGpu) {
    return;
  }
  const std::int64_t share = rank_headroom(plan, Tier::kCpu);
  bool full = false;
  for (std::size_t b = in.block_numel.size(); b-- > 0;) {
    const std::uint64_t n = in.block_numel[b];
    if (in.stage < 3 || n < as_u64(in.persistence_threshold)) continue;  // persistent: gathered whole, not kept
    ++plan.keepable_param_blocks;
    const std::uint64_t shard = rank_shard_numel(in, n);
    if (full || static_cast<std::int64_t>((plan.kept_param_numel + shard) * in.param_bytes) > share) {
      full = true;
      continue;
    }
    plan.kept_param_numel += shard;
    ++plan.kept_param_blocks;
  }
  if (plan.kept_param_blocks == 0) return;
  add_need(plan, Tier::kCpu, fmt::format("parameter shards kept for the step: {} blocks' 16-bit shards", plan.kept_param_blocks),
           plan.kept_param_numel * in.param_bytes);
  plan.traffic = step_traffic(in, plan);  // the remainder's reads of these shards leave NVMe (add_remainder_reads)
  plan.summary = planner_internal::plan_summary(plan);
}

}  // namespace

Expected<Plan> plan_placement(const PlanInput& input) {
  TZ_TRY(validate(input));
  const PlanLayout layout = compute_layout(input);
  Expected<Plan> plan = input.mode == PlacementMode::kDeepSpeed ? plan_deepspeed(input, layout) : plan_auto(input, layout);
  if (plan.ok()) add_kept_params(input, *plan);
  if (plan.ok()) add_step_ahead(input, *plan);
  if (plan.ok()) add_grad_window(input, *plan);
  return plan;
}

}  // namespace tz
