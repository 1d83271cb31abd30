// The planner's words: names, the summary line, out-of-memory messages that
// say what to change, and the report tierzero-estimate prints.
#include <limits>
#include <string>
#include <vector>

#include "planner_internal.h"
#include "tierzero/offload/planner.h"

namespace tz {
namespace {

std::size_t idx(Tier t) { return static_cast<std::size_t>(t); }

std::string_view budget_key(Tier t) {
  switch (t) {
    case Tier::kGpu: return "tierzero.tiers.gpu_bytes";
    case Tier::kCpu: return "tierzero.tiers.cpu_bytes";
    case Tier::kNvme: return "tierzero.tiers.nvme_bytes";
  }
  return "";
}

constexpr std::string_view kGpuWindowKeys =
    "lower zero_optimization.stage3_prefetch_bucket_size (one block is prefetched whatever it says)";
constexpr std::string_view kSubGroupKey = "lower zero_optimization.sub_group_size (NVMe optimizer staging)";
constexpr std::string_view kCpuStagingKeys =
    "lower zero_optimization.sub_group_size (NVMe optimizer staging) or stage3_prefetch_bucket_size (NVMe "
    "parameter staging)";

std::string_view per_what(Tier t) { return t == Tier::kGpu ? "per rank" : "per node"; }

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (const std::string& p : parts) {
    if (!out.empty()) out += sep;
    out += p;
  }
  return out;
}

constexpr Tier kTiers[] = {Tier::kGpu, Tier::kCpu, Tier::kNvme};
constexpr StateClass kClasses[] = {StateClass::kParam16, StateClass::kGrad, StateClass::kMaster,
                                   StateClass::kMoments};

// "cpu needs 336.00 GiB per node but tierzero.tiers.cpu_bytes is 111.76 GiB"
std::string over_text(const Plan& plan, Tier t) {
  const TierUsage& u = plan.usage_of(t);
  return fmt::format("{} needs {} {} but {} is {}", tier_name(t), format_bytes(u.need_bytes), per_what(t),
                     budget_key(t), format_bytes(u.budget_bytes));
}

std::vector<std::string> gpu_remedies(const PlanInput& in) {
  std::vector<std::string> out;
  if (in.offload_optimizer == OffloadDevice::kNone) {
    out.push_back("set zero_optimization.offload_optimizer.device to \"cpu\" or \"nvme\"");
  }
  if (in.offload_param == OffloadDevice::kNone && in.stage == 3) {
    out.push_back("set zero_optimization.offload_param.device to \"cpu\" or \"nvme\"");
  }
  if (in.stage == 3) out.push_back(std::string(kGpuWindowKeys));
  if (in.stage < 3) out.push_back("use zero_optimization.stage 3 so params can leave the GPU");
  return out;
}

std::vector<std::string> cpu_remedies(const PlanInput& in) {
  std::vector<std::string> out;
  if (in.offload_param == OffloadDevice::kCpu) out.push_back("set zero_optimization.offload_param.device to \"nvme\"");
  if (in.offload_optimizer == OffloadDevice::kCpu) {
    out.push_back("set zero_optimization.offload_optimizer.device to \"nvme\"");
  }
  if (in.offload_param == OffloadDevice::kNvme) {
    out.push_back("lower zero_optimization.stage3_prefetch_bucket_size (parameters staged from NVMe)");
  }
  if (in.offload_optimizer == OffloadDevice::kNvme) out.push_back("lower zero_optimization.sub_group_size");
  return out;
}

std::vector<std::string> nvme_remedies(const PlanInput& in) {
  std::vector<std::string> out = {"add tierzero.tiers.nvme_paths"};
  if (in.offload_param == OffloadDevice::kNvme) out.push_back("set zero_optimization.offload_param.device to \"cpu\"");
  if (in.offload_optimizer == OffloadDevice::kNvme) {
    out.push_back("set zero_optimization.offload_optimizer.device to \"cpu\"");
  }
  return out;
}

std::vector<std::string> remedies(const PlanInput& in, Tier t) {
  std::vector<std::string> out = {fmt::format("raise {}", budget_key(t))};
  std::vector<std::string> more = t == Tier::kGpu ? gpu_remedies(in) : t == Tier::kCpu ? cpu_remedies(in)
                                                                                       : nvme_remedies(in);
  out.insert(out.end(), more.begin(), more.end());
  if (in.param_bytes == 4) out.push_back("enable the config's \"bf16\" block (2-byte params instead of fp32)");
  return out;
}

void format_inputs(std::string& out, const Plan& plan, const PlanInput& in) {
  const PlanLayout& l = plan.layout;
  const int g = in.gradient_accumulation_steps;
  out += fmt::format("model      {} params ({}) in {} blocks, largest {}\n", format_count(double(l.model_numel)),
                     l.model_numel, l.blocks, format_count(double(l.largest_block_numel)));
  out += fmt::format("partition  ZeRO stage {} over {} rank{} ({} per node), {} micro-batch{} per step\n", in.stage,
                     in.ranks, in.ranks == 1 ? "" : "s", in.effective_ranks_per_node(), g, g == 1 ? "" : "es");
  out += in.param_bytes == 2 ? "precision  16-bit params (bf16 or fp16, 2 B)" : "precision  fp32 params (4 B: neither bf16 nor fp16 is enabled)";
  out += fmt::format("; master {} ({:g} B), moments {} ({:g} B)\n", master_format_name(in.states.master),
                     master_bytes_per_elem(in.states.master), moment_format_name(in.states.moments),
                     moments_bytes_per_elem(in.states.moments));
  out += fmt::format("per rank   param16 {} elem, grad {} elem, master/moments {} elem (shards padded to 2048)\n",
                     l.param_numel, l.grad_numel, l.optimizer_numel);
  if (l.persistent_blocks > 0) {
    out += fmt::format("persistent {} blocks under {} elem stay whole on every GPU ({} elem)\n", l.persistent_blocks,
                       in.persistence_threshold, l.persistent_numel);
  }
  if (plan.mode == PlacementMode::kDeepSpeed) {
    out += fmt::format("placement  deepspeed: offload_param \"{}\", offload_optimizer \"{}\"\n",
                       offload_device_name(in.offload_param), offload_device_name(in.offload_optimizer));
  } else {
    out += fmt::format("placement  auto: the least movement time of {} placements that fit ({} considered)\n",
                       plan.feasible_candidates, plan.candidates);
  }
}

// "4", "2.125", "10.15625": bytes per element, exact to 1/256 B and without trailing zeros.
std::string elem_bytes_text(double bytes) {
  std::string text = fmt::format("{:.5f}", bytes);
  while (text.back() == '0') text.pop_back();
  if (text.back() == '.') text.pop_back();
  return text;
}

void format_tables(std::string& out, const Plan& plan) {
  out += fmt::format("\n{:<12} {:<10} {:>10}  {:<5} {:>14}\n", "state class", "format", "bytes/elem", "tier",
                     "per-rank bytes");
  double per_elem = 0;
  std::uint64_t per_rank = 0;
  for (StateClass s : kClasses) {
    out += fmt::format("{:<12} {:<10} {:>10}  {:<5} {:>14}\n", state_class_name(s),
                       state_format_name(s, plan.param_bytes, plan.states), elem_bytes_text(plan.elem_bytes_of(s)),
                       tier_name(plan.tier_of(s)), format_bytes(plan.bytes_of(s)));
    per_elem += plan.elem_bytes_of(s);
    per_rank += plan.bytes_of(s);
  }
  out += fmt::format("{:<12} {:<10} {:>10}  {:<5} {:>14}\n", "total", "", elem_bytes_text(per_elem), "",
                     format_bytes(per_rank));
  out += fmt::format("\n{:<5} {:>14} {:>14} {:>14}\n", "tier", "needed", "budget", "headroom");
  for (Tier t : kTiers) {
    const TierUsage& u = plan.usage_of(t);
    const std::int64_t head = u.headroom_bytes();
    const std::string head_text = head >= 0 ? format_bytes(static_cast<std::uint64_t>(head))
                                            : "-" + format_bytes(u.need_bytes - u.budget_bytes);
    out += fmt::format("{:<5} {:>14} {:>14} {:>14}  {}{}\n", tier_name(t), format_bytes(u.need_bytes),
                       format_bytes(u.budget_bytes), head_text, per_what(t), u.fits() ? "" : "  OVER BUDGET");
  }
}

void format_breakdown(std::string& out, const Plan& plan) {
  for (Tier t : kTiers) {
    const TierUsage& u = plan.usage_of(t);
    if (t == Tier::kGpu) {
      out += fmt::format("\n{} need per rank: {}\n", tier_name(t), format_bytes(u.need_bytes));
    } else {
      out += fmt::format("\n{} need per node: {} rank{} x {} = {}\n", tier_name(t), u.ranks_sharing,
                         u.ranks_sharing == 1 ? "" : "s", format_bytes(u.per_rank_bytes), format_bytes(u.need_bytes));
    }
    if (u.breakdown.empty()) out += "  (nothing)\n";
    for (const NeedItem& item : u.breakdown) out += fmt::format("  {:>14}  {}\n", format_bytes(item.bytes), item.what);
  }
}

void format_traffic(std::string& out, const Plan& plan, const PlanInput& in) {
  const StepTraffic& t = plan.traffic;
  const LinkSpeeds& s = in.links;
  out += fmt::format("\nper-step traffic per rank ({} micro-batch{} per step):\n", in.gradient_accumulation_steps,
                     in.gradient_accumulation_steps == 1 ? "" : "es");
  const auto line = [&](std::string_view what, std::uint64_t bytes, double bps, std::string_view link) {
    out += fmt::format("  {:<22} {:>14} {:>8.3f} B/param  {:>9.2f} s at {:.2f} GB/s ({})\n", what,
                       format_bytes(bytes), bytes_per_param(bytes, plan.layout, in.ranks),
                       static_cast<double>(bytes) / bps, bps / 1e9, link);
  };
  line("nvme read", t.nvme_read_bytes, s.nvme_read_Bps, "NVMe read");
  line("nvme write", t.nvme_write_bytes, s.nvme_write_Bps, "NVMe write");
  line("host to device", t.h2d_bytes, s.pcie_Bps, "PCIe");
  line("device to host", t.d2h_bytes, s.pcie_Bps, "PCIe");
  line("cpu adam memory", t.cpu_optimizer_bytes, s.cpu_mem_Bps, "CPU memory");
  out += fmt::format("  per parameter per step: NVMe {:.3f} B (read {:.3f} + write {:.3f}), PCIe {:.3f} B "
                     "(all ranks' bytes over the model's parameters)\n",
                     bytes_per_param(t.nvme_read_bytes, plan.layout, in.ranks) +
                         bytes_per_param(t.nvme_write_bytes, plan.layout, in.ranks),
                     bytes_per_param(t.nvme_read_bytes, plan.layout, in.ranks),
                     bytes_per_param(t.nvme_write_bytes, plan.layout, in.ranks),
                     bytes_per_param(t.h2d_bytes, plan.layout, in.ranks) +
                         bytes_per_param(t.d2h_bytes, plan.layout, in.ranks));
  out += fmt::format("  estimated data movement: {:.2f} s per step (the sum, before any overlap with compute)\n",
                     t.estimated_seconds);
}

}  // namespace

std::string_view tier_name(Tier tier) {
  switch (tier) {
    case Tier::kGpu: return "gpu";
    case Tier::kCpu: return "cpu";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

std::string_view state_class_name(StateClass state) {
  switch (state) {
    case StateClass::kParam16: return "param16";
    case StateClass::kGrad: return "grad";
    case StateClass::kMaster: return "master";
    case StateClass::kMoments: return "moments";
  }
  return "?";
}

// Note [Stepping under backward] (engine/src/step_ahead.h): what the plan holds for it.
void format_step_ahead(std::string& out, const Plan& plan, const PlanInput& in) {
  if (in.step_under_backward == StepUnderBackward::kOff) return;
  out += fmt::format("\noptimizer under backward (tierzero.step_under_backward {}): ",
                     step_under_backward_name(in.step_under_backward));
  if (plan.tier_of(StateClass::kMaster) == Tier::kGpu) {
    out += "none: the optimizer runs on the GPU\n";
  } else if (plan.ahead_blocks == 0) {
    out += fmt::format("none: {}\n", plan.ahead_off);
  } else {
    out += fmt::format("{} of {} blocks{}{} (the breakdowns' \"steps under backward\" items)\n", plan.ahead_blocks,
                       plan.layout.blocks, plan.ahead_off.empty() ? "" : "; ", plan.ahead_off);
  }
}

// Note [Accumulating on the device across micro-batches] (engine/src/gradient_path.cpp).
void format_grad_window(std::string& out, const Plan& plan, const PlanInput& in) {
  if (!in.grads_on_device_across_micro_batches || in.gradient_accumulation_steps < 2 ||
      plan.tier_of(StateClass::kMaster) == Tier::kGpu) {
    return;
  }
  out += fmt::format("gradients across {} micro-batches: ", in.gradient_accumulation_steps);
  if (in.states.grads != GradFormat::kFp32) {
    out += "on the host (16-bit accumulators round after every micro-batch)\n";
  } else if (plan.grad_window_blocks == 0) {
    out += "on the host (the GPU headroom holds no block's fp32 accumulator)\n";
  } else {
    out += fmt::format("{} of {} blocks add up on the GPU and go down once (the GPU breakdown's \"gradient "
                       "accumulators\" item)\n", plan.grad_window_blocks, plan.layout.blocks);
  }
}

std::string format_plan(const Plan& plan, const PlanInput& input) {
  std::string out;
  format_inputs(out, plan, input);
  format_tables(out, plan);
  format_breakdown(out, plan);
  format_step_ahead(out, plan, input);
  format_grad_window(out, plan, input);
  format_traffic(out, plan, input);
  return out;
}

namespace planner_internal {

std::string placement_text(const Plan& plan) {
  return fmt::format("params {}, grads {}, master {}, moments {}", tier_name(plan.tier_of(StateClass::kParam16)),
                     tier_name(plan.tier_of(StateClass::kGrad)), tier_name(plan.tier_of(StateClass::kMaster)),
                     tier_name(plan.tier_of(StateClass::kMoments)));
}

std::string plan_summary(const Plan& plan) {
  std::vector<std::string> needs;
  for (Tier t : kTiers) {
    const TierUsage& u = plan.usage_of(t);
    needs.push_back(fmt::format("{} {} of {} {}", tier_name(t), format_bytes(u.need_bytes),
                                format_bytes(u.budget_bytes), per_what(t)));
  }
  return fmt::format("{}; {}; {:.2f} s of data movement per step", placement_text(plan), join(needs, ", "),
                     plan.traffic.estimated_seconds);
}

Status no_fit_error(const PlanInput& in, const PlanLayout& layout, const std::array<std::uint64_t, kNumTiers>& least,
                    std::size_t candidates) {
  const Tier deepest_param = in.stage == 3 ? Tier::kNvme : Tier::kGpu;
  const Plan deepest = evaluate_placement(in, layout, {deepest_param, Tier::kNvme, Tier::kNvme, Tier::kNvme});
  std::vector<std::string> over;
  std::vector<std::string> fixes;
  for (Tier t : kTiers) {
    if (deepest.usage_of(t).fits()) continue;
    over.push_back(over_text(deepest, t));
    fixes.push_back(fmt::format("raise {}", budget_key(t)));
    if (t == Tier::kGpu && in.stage < 3) fixes.push_back("use zero_optimization.stage 3 so params can leave the GPU");
    if (t == Tier::kGpu && in.stage == 3) fixes.push_back(std::string(kGpuWindowKeys));
    if (t == Tier::kCpu) fixes.push_back(std::string(deepest_param == Tier::kNvme ? kCpuStagingKeys : kSubGroupKey));
    if (t == Tier::kNvme) fixes.push_back("add tierzero.tiers.nvme_paths");
  }
  static constexpr std::string_view kWhere[] = {"", " where the gpu fits", " where the gpu and cpu fit"};
  std::vector<std::string> mins;
  for (Tier t : kTiers) {
    const std::uint64_t need = least[idx(t)];
    const std::string what = need == std::numeric_limits<std::uint64_t>::max()
                                 ? fmt::format("{}: no placement{}", tier_name(t), kWhere[idx(t)])
                                 : fmt::format("{} {} {}{}", tier_name(t), format_bytes(need), per_what(t),
                                               kWhere[idx(t)]);
    mins.push_back(fmt::format("{} (budget {}, {})", what, format_bytes(deepest.usage_of(t).budget_bytes),
                               budget_key(t)));
  }
  return out_of_memory(
      "no placement of {} parameters fits the budgets ({} placements tried). With every state offloaded as far "
      "as it goes ({}): {}. The least each tier needs: {}. To fit: {}",
      format_count(static_cast<double>(layout.model_numel)), candidates, placement_text(deepest), join(over, "; "),
      join(mins, "; "), join(fixes, ", or "));
}

Status deepspeed_error(const PlanInput& in, const Plan& plan, const Plan* alternative,
                       const Status& alternative_status) {
  std::vector<std::string> problems;
  for (Tier t : kTiers) {
    if (plan.usage_of(t).fits()) continue;
    problems.push_back(fmt::format("{}; to fix: {}", over_text(plan, t), join(remedies(in, t), ", or ")));
  }
  const std::string alt = alternative != nullptr
                              ? fmt::format("placement 'auto' would fit: {} (set tierzero.placement to \"auto\")",
                                            alternative->summary)
                              : fmt::format("placement 'auto' would not fit either: {}", alternative_status.message());
  return out_of_memory(
      "placement 'deepspeed' ({}; from zero_optimization.offload_param.device \"{}\" and "
      "zero_optimization.offload_optimizer.device \"{}\") does not fit: {}. {}",
      placement_text(plan), offload_device_name(in.offload_param), offload_device_name(in.offload_optimizer),
      join(problems, "; "), alt);
}

}  // namespace planner_internal
}  // namespace tz
