// tierzero.estimate(): the placement planner (tierzero/offload/planner.h),
// the same computation as `tierzero-estimate`, returning the plan as a dict
// and the report that tool prints. Budgets and settings follow the tool's
// rules: explicit arguments override the config; without a config, stage 3
// and "auto" budgets.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <vector>

#include "errors.h"
#include "tierzero/common.h"
#include "tierzero/offload.h"

namespace tzpy {
namespace {

struct EstimateArgs {
  std::vector<std::uint64_t> block_numel;
  int ranks = 1;
  int ranks_per_node = 0;
  std::optional<std::string> config_path, config_json;
  std::optional<int> stage, grad_accum;
  std::optional<std::string> gpu, cpu, nvme;
  std::vector<std::string> nvme_paths;
  std::optional<std::string> offload_param, offload_optimizer, placement;
  std::optional<std::string> precision;
  std::optional<std::string> master, moments;  // tierzero.states formats
  tz::LinkSpeeds links;
};

tz::OffloadDevice device_of(const std::string& name) {
  if (name == "cpu") return tz::OffloadDevice::kCpu;
  if (name == "nvme") return tz::OffloadDevice::kNvme;
  if (name == "none") return tz::OffloadDevice::kNone;
  raise_status(tz::invalid_argument("offload device '{}': expected none, cpu or nvme", name));
}

tz::ByteBudget budget_of(const std::string& text, const char* arg) {
  if (text == "auto") return tz::ByteBudget::automatic();
  tz::Expected<std::uint64_t> bytes = tz::parse_bytes(text);
  if (!bytes.ok()) raise_status(tz::invalid_argument("{}: {}", arg, bytes.status().message()));
  return tz::ByteBudget::of(*bytes);
}

tz::Config effective_config(const EstimateArgs& a) {
  tz::Config config;
  config.zero.stage = 3;
  config.precision.bf16 = true;  // an estimate without a config is for mixed precision
  const bool has_config = a.config_path || a.config_json;
  if (a.config_path) config = value_or_raise(tz::load_config(*a.config_path));
  if (a.config_json) config = value_or_raise(tz::parse_config(*a.config_json, "<config dict>"));
  if (a.precision) check(tz::set_training_precision(config, *a.precision));
  if (a.master) check(tz::set_master_format(config, *a.master));
  if (a.moments) check(tz::set_moment_format(config, *a.moments));
  check(tz::check_state_formats(config));  // again: precision= or master= may have changed the pair
  if (a.stage) config.zero.stage = *a.stage;
  if (a.grad_accum) tz::override_gradient_accumulation_steps(config, *a.grad_accum);
  if (a.gpu || !has_config) config.tiers.gpu = budget_of(a.gpu.value_or("auto"), "gpu");
  if (a.cpu || !has_config) config.tiers.cpu = budget_of(a.cpu.value_or("auto"), "cpu");
  if (a.nvme || !has_config) config.tiers.nvme = budget_of(a.nvme.value_or("auto"), "nvme");
  config.tiers.nvme_paths.insert(config.tiers.nvme_paths.end(), a.nvme_paths.begin(), a.nvme_paths.end());
  if (a.offload_param || a.offload_optimizer) config.placement = tz::PlacementMode::kDeepSpeed;
  if (a.offload_param) config.zero.offload_param.device = device_of(*a.offload_param);
  if (a.offload_optimizer) config.zero.offload_optimizer.device = device_of(*a.offload_optimizer);
  if (a.placement == "auto") config.placement = tz::PlacementMode::kAuto;
  if (a.placement == "deepspeed") config.placement = tz::PlacementMode::kDeepSpeed;
  if (a.placement && *a.placement != "auto" && *a.placement != "deepspeed") {
    raise_status(tz::invalid_argument("placement '{}': expected auto or deepspeed", *a.placement));
  }
  check(tz::resolve_batch(config, a.ranks));  // Note [Batch keys]
  return config;
}

nb::dict tier_dict(const tz::TierUsage& u) {
  nb::dict d;
  d["need_bytes"] = u.need_bytes;
  d["per_rank_bytes"] = u.per_rank_bytes;
  d["ranks_sharing"] = u.ranks_sharing;
  d["budget_bytes"] = u.budget_bytes;
  d["headroom_bytes"] = u.headroom_bytes();
  d["fits"] = u.fits();
  nb::list items;
  for (const tz::NeedItem& item : u.breakdown) {
    nb::dict i;
    i["what"] = item.what;
    i["bytes"] = item.bytes;
    items.append(i);
  }
  d["breakdown"] = items;
  return d;
}

nb::dict plan_dict(const tz::Plan& plan, const tz::PlanInput& in, const tz::ResolvedBudgets& b) {
  nb::dict d;
  nb::dict states, tiers, budgets, traffic, layout;
  for (std::size_t s = 0; s < tz::kNumStateClasses; ++s) {
    const auto state = static_cast<tz::StateClass>(s);
    nb::dict sd;
    sd["tier"] = std::string(tz::tier_name(plan.tier_of(state)));
    sd["format"] = std::string(tz::state_format_name(state, plan.param_bytes, plan.states));
    sd["bytes_per_elem"] = plan.elem_bytes_of(state);
    sd["bytes_per_rank"] = plan.bytes_of(state);
    states[std::string(tz::state_class_name(state)).c_str()] = sd;
  }
  for (tz::Tier t : {tz::Tier::kGpu, tz::Tier::kCpu, tz::Tier::kNvme}) {
    tiers[std::string(tz::tier_name(t)).c_str()] = tier_dict(plan.usage_of(t));
  }
  budgets["gpu"] = nb::make_tuple(b.gpu_bytes, b.gpu_source);
  budgets["cpu"] = nb::make_tuple(b.cpu_bytes, b.cpu_source);
  budgets["nvme"] = nb::make_tuple(b.nvme_bytes, b.nvme_source);
  const tz::StepTraffic& t = plan.traffic;
  traffic["nvme_read_bytes"] = t.nvme_read_bytes;
  traffic["nvme_write_bytes"] = t.nvme_write_bytes;
  traffic["h2d_bytes"] = t.h2d_bytes;
  traffic["d2h_bytes"] = t.d2h_bytes;
  traffic["cpu_optimizer_bytes"] = t.cpu_optimizer_bytes;
  traffic["estimated_seconds"] = t.estimated_seconds;
  traffic["nvme_bytes_per_param"] = tz::bytes_per_param(t.nvme_read_bytes, plan.layout, in.ranks) +
                                    tz::bytes_per_param(t.nvme_write_bytes, plan.layout, in.ranks);
  traffic["pcie_bytes_per_param"] = tz::bytes_per_param(t.h2d_bytes, plan.layout, in.ranks) +
                                    tz::bytes_per_param(t.d2h_bytes, plan.layout, in.ranks);
  const tz::PlanLayout& l = plan.layout;
  layout["model_numel"] = l.model_numel;
  layout["blocks"] = l.blocks;
  layout["largest_block_numel"] = l.largest_block_numel;
  layout["param_numel"] = l.param_numel;
  layout["grad_numel"] = l.grad_numel;
  layout["optimizer_numel"] = l.optimizer_numel;
  layout["persistent_blocks"] = l.persistent_blocks;
  layout["gathered_block_numel"] = l.gathered_block_numel;
  d["states"] = states;
  d["tiers"] = tiers;
  d["budgets"] = budgets;
  d["traffic"] = traffic;
  d["layout"] = layout;
  d["ranks"] = in.ranks;
  d["stage"] = in.stage;
  d["param_bytes"] = in.param_bytes;  // 2: bf16 or fp16 training; 4: fp32
  d["placement"] = plan.mode == tz::PlacementMode::kAuto ? "auto" : "deepspeed";
  d["candidates"] = plan.candidates;
  d["feasible_candidates"] = plan.feasible_candidates;
  d["fits"] = plan.fits();
  d["summary"] = plan.summary;
  return d;
}

nb::tuple estimate(const EstimateArgs& a) {
  const tz::Config config = effective_config(a);
  tz::ResolvedBudgets budgets;
  tz::Expected<tz::Plan> plan = tz::invalid_argument("not planned");
  tz::PlanInput in;
  {
    // Resolving "auto" probes memory, GPUs and the NVMe paths (a file write each).
    nb::gil_scoped_release release;
    tz::Expected<tz::ResolvedBudgets> b = tz::resolve_budgets(config.tiers, config.all_nvme_paths());
    if (!b.ok()) {
      plan = tz::Status(b.status().code(), b.status().message() + " (pass gpu=, cpu=, nvme= budgets or nvme_paths=)");
    } else {
      budgets = *b;
      in = tz::PlanInput::from_config(config, a.block_numel, a.ranks, a.ranks_per_node, budgets);
      in.links = a.links;
      plan = tz::plan_placement(in);
    }
  }
  const tz::Plan& p = value_or_raise(std::move(plan));
  return nb::make_tuple(plan_dict(p, in, budgets), tz::format_plan(p, in));
}

}  // namespace

void bind_planner(nb::module_& m) {
  m.def(
      "plan_placement",
      [](std::vector<std::uint64_t> block_numel, int ranks, int ranks_per_node, std::optional<std::string> config_path,
         std::optional<std::string> config_json, std::optional<int> stage, std::optional<int> grad_accum,
         std::optional<std::string> gpu, std::optional<std::string> cpu, std::optional<std::string> nvme,
         std::vector<std::string> nvme_paths, std::optional<std::string> offload_param,
         std::optional<std::string> offload_optimizer, std::optional<std::string> placement,
         std::optional<std::string> precision, std::optional<std::string> master,
         std::optional<std::string> moments, double nvme_read_gbps, double nvme_write_gbps, double pcie_gbps,
         double cpu_mem_gbps) {
        EstimateArgs a{std::move(block_numel), ranks, ranks_per_node, std::move(config_path), std::move(config_json),
                       stage, grad_accum, std::move(gpu), std::move(cpu), std::move(nvme), std::move(nvme_paths),
                       std::move(offload_param), std::move(offload_optimizer), std::move(placement),
                       std::move(precision), std::move(master), std::move(moments), {}};
        if (nvme_read_gbps > 0) a.links.nvme_read_Bps = nvme_read_gbps * 1e9;
        if (nvme_write_gbps > 0) a.links.nvme_write_Bps = nvme_write_gbps * 1e9;
        if (pcie_gbps > 0) a.links.pcie_Bps = pcie_gbps * 1e9;
        if (cpu_mem_gbps > 0) a.links.cpu_mem_Bps = cpu_mem_gbps * 1e9;
        return estimate(a);
      },
      nb::arg("block_numel"), nb::arg("ranks") = 1, nb::arg("ranks_per_node") = 0,
      nb::arg("config_path") = nb::none(), nb::arg("config_json") = nb::none(), nb::arg("stage") = nb::none(),
      nb::arg("grad_accum") = nb::none(), nb::arg("gpu") = nb::none(), nb::arg("cpu") = nb::none(),
      nb::arg("nvme") = nb::none(), nb::arg("nvme_paths") = std::vector<std::string>{},
      nb::arg("offload_param") = nb::none(), nb::arg("offload_optimizer") = nb::none(),
      nb::arg("placement") = nb::none(), nb::arg("precision") = nb::none(), nb::arg("master") = nb::none(),
      nb::arg("moments") = nb::none(), nb::arg("nvme_read_gbps") = 0.0,
      nb::arg("nvme_write_gbps") = 0.0, nb::arg("pcie_gbps") = 0.0, nb::arg("cpu_mem_gbps") = 0.0,
      "Plans where each state class lives for blocks of `block_numel` elements; returns (plan dict, report text). "
      "MemoryError (naming the tier, need, budget and keys) when nothing fits; ValueError for bad input.");
  m.def(
      "check_config",
      [](const std::optional<std::string>& config_path, const std::optional<std::string>& config_json) {
        const tz::Config c = config_path ? value_or_raise(tz::load_config(*config_path))
                                         : value_or_raise(tz::parse_config(config_json.value_or("{}"), "<config dict>"));
        nb::dict d;
        d["source"] = c.source;
        d["ignored_keys"] = c.ignored_keys;
        d["unresolved_auto"] = c.unresolved_auto;
        d["zero_stage"] = c.zero.stage;
        d["optimizer"] = c.optimizer.type;
        d["precision"] = c.precision.bf16 ? "bf16" : c.precision.fp16 ? "fp16" : "fp32";
        return d;
      },
      nb::arg("config_path") = nb::none(), nb::arg("config_json") = nb::none(),
      "Loads a config as the engine would (without touching its NVMe paths): a dict of source, ignored_keys, "
      "unresolved_auto (\"auto\" values the engine would refuse), zero_stage, optimizer (the one that runs) and "
      "precision; ValueError naming the key otherwise.");
}

}  // namespace tzpy

namespace tzpy {
void bind_units(nb::module_& m) {
  m.def("parse_count", [](const std::string& s) { return value_or_raise(tz::parse_count(s)); }, nb::arg("text"),
        "'1.3B', '350M', '20e9' -> a number (ValueError naming the text otherwise).");
  m.def("parse_bytes", [](const std::string& s) { return value_or_raise(tz::parse_bytes(s)); }, nb::arg("text"),
        "'80GB' (SI), '64GiB' (IEC), '4096' -> bytes.");
}
}  // namespace tzpy
