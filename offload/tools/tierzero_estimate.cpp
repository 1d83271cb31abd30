// tierzero-estimate: where would a model's states live, and what would it cost
// to move them each step? Like DeepSpeed's estimate_zero3_model_states_mem_needs,
// with NVMe as a third tier and the placement planner's choice.
//
//   tierzero-estimate --params 20e9 --ranks 1 --gpu 80GB --cpu 120GB --nvme 2TB
//
// Exit status: 0 a plan fits; 1 no plan fits (the reason on stderr); 2 bad
// arguments (including a config that does not load, or an "auto" budget that
// cannot be resolved).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "tierzero/common.h"
#include "tierzero/offload.h"

namespace {

constexpr int kExitNoFit = 1;
constexpr int kExitBadArgs = 2;
constexpr double kMaxParams = 0x1p50;          // the planner's limit
constexpr std::uint64_t kMaxBlocks = 1'000'000;  // --largest-block 1 on 20e9 params is a typo

struct Options {
  std::string params;
  int ranks = 1;
  int ranks_per_node = 0;
  int layers = 32;
  std::string largest_block;
  int stage = 3;
  int grad_accum = 1;
  std::string offload_param, offload_optimizer, placement;
  std::string precision;  // bf16 | fp16 | fp32; empty: the config's, or bf16 without one
  std::string config_path;
  std::string gpu = "auto", cpu = "auto", nvme = "auto";
  std::vector<std::string> nvme_paths;
  std::string json_path;
  double nvme_read_gbps = 0, nvme_write_gbps = 0, pcie_gbps = 0, cpu_mem_gbps = 0;
  // Which of the above the user gave (the rest come from --config or defaults).
  bool has_stage = false, has_grad_accum = false, has_gpu = false, has_cpu = false, has_nvme = false;
};

CLI::Validator bytes_or_auto() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (text == "auto") return {};
        const tz::Expected<std::uint64_t> bytes = tz::parse_bytes(text);
        return bytes.ok() ? std::string() : bytes.status().message();
      },
      "BYTES|auto");
}

CLI::Validator count() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const tz::Expected<double> n = tz::parse_count(text);
        if (!n.ok()) return n.status().message();
        if (*n < 1 || *n > kMaxParams) return fmt::format("'{}' is out of range [1, 2^50]", text);
        return {};
      },
      "COUNT");
}

void add_options(CLI::App& app, Options& o) {
  app.add_option("--params", o.params, "parameters in the model, e.g. 20e9, 1.3B, 350M")->required()->check(count());
  app.add_option("--ranks", o.ranks, "data-parallel ranks (GPUs)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--ranks-per-node", o.ranks_per_node, "ranks sharing one node's CPU memory and NVMe (default: all)")
      ->check(CLI::Range(1, 1 << 20));
  auto* layers = app.add_option("--layers", o.layers, "the model is this many equal blocks (default 32)")
                     ->check(CLI::Range(1, static_cast<int>(kMaxBlocks)));
  app.add_option("--largest-block", o.largest_block, "blocks of this many params (and one remainder block)")
      ->check(count())
      ->excludes(layers);
  app.add_option("--stage", o.stage, "ZeRO stage 0..3 (default 3, or the config's)")->check(CLI::Range(0, 3));
  app.add_option("--grad-accum", o.grad_accum, "micro-batches per optimizer step (default 1, or the config's)")
      ->check(CLI::Range(1, 1 << 20));
  const auto devices = CLI::IsMember({"none", "cpu", "nvme"});
  app.add_option("--offload-param", o.offload_param, "DeepSpeed offload_param.device (implies DeepSpeed placement)")
      ->check(devices);
  app.add_option("--offload-optimizer", o.offload_optimizer,
                 "DeepSpeed offload_optimizer.device (implies DeepSpeed placement)")
      ->check(devices);
  app.add_option("--precision", o.precision,
                 "training precision: bf16 or fp16 (2 B params) or fp32 (4 B params); default the config's, "
                 "or bf16 without a config")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  app.add_option("--placement", o.placement, "auto (fastest plan that fits) or deepspeed (follow the offload devices)")
      ->check(CLI::IsMember({"auto", "deepspeed"}));
  app.add_option("--config", o.config_path, "tierzero/DeepSpeed JSON config (flags override it)")
      ->check(CLI::ExistingFile);
  app.add_option("--gpu", o.gpu, "GPU budget per GPU: bytes (80GB, 64GiB) or auto (90% of GPU 0; the default)")
      ->check(bytes_or_auto());
  app.add_option("--cpu", o.cpu, "pinned CPU budget per node, or auto (90% of MemAvailable; the default)")
      ->check(bytes_or_auto());
  app.add_option("--nvme", o.nvme, "NVMe budget per node, or auto (free space on the --nvme-path dirs; the default)")
      ->check(bytes_or_auto());
  app.add_option("--nvme-path", o.nvme_paths, "NVMe directory (repeatable), for --nvme auto");
  app.add_option("--json", o.json_path, "also write the plan as JSON to this file");
  const auto speed = CLI::PositiveNumber;
  app.add_option("--nvme-read-gbps", o.nvme_read_gbps, "NVMe read speed, GB/s (default 2)")->check(speed);
  app.add_option("--nvme-write-gbps", o.nvme_write_gbps, "NVMe write speed, GB/s (default 2)")->check(speed);
  app.add_option("--pcie-gbps", o.pcie_gbps, "host<->device speed, GB/s (default 25)")->check(speed);
  app.add_option("--cpu-mem-gbps", o.cpu_mem_gbps, "CPU Adam memory bandwidth, GB/s (default 40)")->check(speed);
}

std::uint64_t count_of(const std::string& text) {
  return static_cast<std::uint64_t>(std::llround(tz::parse_count(text).value()));
}

tz::Expected<std::vector<std::uint64_t>> make_blocks(const Options& o) {
  const std::uint64_t params = count_of(o.params);
  std::vector<std::uint64_t> blocks;
  if (!o.largest_block.empty()) {
    const std::uint64_t largest = std::min(count_of(o.largest_block), params);
    if (params / largest > kMaxBlocks) {
      return tz::invalid_argument("--largest-block {} splits {} params into more than {} blocks", o.largest_block,
                                  o.params, kMaxBlocks);
    }
    blocks.assign(params / largest, largest);
    if (params % largest != 0) blocks.push_back(params % largest);
    return blocks;
  }
  const auto layers = static_cast<std::uint64_t>(o.layers);
  if (layers > params) return tz::invalid_argument("--layers {} is more than --params {}", o.layers, o.params);
  blocks.assign(layers, params / layers);
  for (std::uint64_t i = 0; i < params % layers; ++i) ++blocks[i];
  return blocks;
}

tz::OffloadDevice device_of(const std::string& name) {
  if (name == "cpu") return tz::OffloadDevice::kCpu;
  if (name == "nvme") return tz::OffloadDevice::kNvme;
  return tz::OffloadDevice::kNone;
}

tz::ByteBudget budget_of(const std::string& text) {
  if (text == "auto") return tz::ByteBudget::automatic();
  return tz::ByteBudget::of(tz::parse_bytes(text).value());
}

// The config (or defaults: stage 3, bf16, every budget auto) with the flags applied.
tz::Expected<tz::Config> effective_config(const Options& o) {
  tz::Config config;
  config.zero.stage = 3;
  config.precision.bf16 = true;  // an estimate without a config is for mixed precision
  if (!o.config_path.empty()) {
    TZ_ASSIGN_OR_RETURN(config, tz::load_config(o.config_path));
  }
  if (!o.precision.empty()) TZ_TRY(tz::set_training_precision(config, o.precision));
  if (o.has_stage) config.zero.stage = o.stage;
  if (o.has_grad_accum) tz::override_gradient_accumulation_steps(config, o.grad_accum);
  if (o.has_gpu || o.config_path.empty()) config.tiers.gpu = budget_of(o.gpu);
  if (o.has_cpu || o.config_path.empty()) config.tiers.cpu = budget_of(o.cpu);
  if (o.has_nvme || o.config_path.empty()) config.tiers.nvme = budget_of(o.nvme);
  config.tiers.nvme_paths.insert(config.tiers.nvme_paths.end(), o.nvme_paths.begin(), o.nvme_paths.end());
  if (!o.offload_param.empty() || !o.offload_optimizer.empty()) config.placement = tz::PlacementMode::kDeepSpeed;
  if (!o.offload_param.empty()) config.zero.offload_param.device = device_of(o.offload_param);
  if (!o.offload_optimizer.empty()) config.zero.offload_optimizer.device = device_of(o.offload_optimizer);
  if (o.placement == "auto") config.placement = tz::PlacementMode::kAuto;
  if (o.placement == "deepspeed") config.placement = tz::PlacementMode::kDeepSpeed;
  return config;
}

// Resolves "auto" (probing only then), and names each budget's source in the
// words the user typed.
tz::Expected<tz::ResolvedBudgets> budgets_for(const Options& o, const tz::Config& config) {
  tz::Expected<tz::ResolvedBudgets> b = tz::resolve_budgets(config.tiers, config.all_nvme_paths());
  if (!b.ok()) {
    return tz::Status(b.status().code(),
                      b.status().message() + " (on the command line: --gpu, --cpu, --nvme BYTES, --nvme-path DIR)");
  }
  const auto source = [&o](bool given, const char* flag, const std::string& value, std::string& out) {
    if (given || (o.config_path.empty() && value != "auto")) {
      out = fmt::format("{} {}", flag, value);
    } else if (out == "config") {
      out = fmt::format("{}", o.config_path);
    }
  };
  source(o.has_gpu, "--gpu", o.gpu, b->gpu_source);
  source(o.has_cpu, "--cpu", o.cpu, b->cpu_source);
  source(o.has_nvme, "--nvme", o.nvme, b->nvme_source);
  return b;
}

void apply_links(const Options& o, tz::LinkSpeeds& links) {
  if (o.nvme_read_gbps > 0) links.nvme_read_Bps = o.nvme_read_gbps * 1e9;
  if (o.nvme_write_gbps > 0) links.nvme_write_Bps = o.nvme_write_gbps * 1e9;
  if (o.pcie_gbps > 0) links.pcie_Bps = o.pcie_gbps * 1e9;
  if (o.cpu_mem_gbps > 0) links.cpu_mem_Bps = o.cpu_mem_gbps * 1e9;
}

nlohmann::json tiers_json(const tz::Plan& plan) {
  nlohmann::json tiers = nlohmann::json::array();
  for (tz::Tier t : {tz::Tier::kGpu, tz::Tier::kCpu, tz::Tier::kNvme}) {
    const tz::TierUsage& u = plan.usage_of(t);
    nlohmann::json items = nlohmann::json::array();
    for (const tz::NeedItem& item : u.breakdown) items.push_back({{"what", item.what}, {"bytes", item.bytes}});
    tiers.push_back({{"tier", tz::tier_name(t)}, {"need_bytes", u.need_bytes}, {"per_rank_bytes", u.per_rank_bytes},
                     {"ranks_sharing", u.ranks_sharing}, {"budget_bytes", u.budget_bytes},
                     {"headroom_bytes", u.headroom_bytes()}, {"fits", u.fits()}, {"breakdown", items}});
  }
  return tiers;
}

nlohmann::json plan_json(const tz::Plan& plan, const tz::PlanInput& in, const tz::ResolvedBudgets& b) {
  const tz::PlanLayout& l = plan.layout;
  nlohmann::json states = nlohmann::json::array();
  for (auto s : {tz::StateClass::kParam16, tz::StateClass::kGrad, tz::StateClass::kMaster, tz::StateClass::kMoments}) {
    states.push_back({{"class", tz::state_class_name(s)}, {"tier", tz::tier_name(plan.tier_of(s))},
                      {"bytes_per_elem", plan.elem_bytes_of(s)}, {"bytes_per_rank", plan.bytes_of(s)}});
  }
  const tz::StepTraffic& t = plan.traffic;
  return {
      {"inputs",
       {{"params", l.model_numel}, {"blocks", l.blocks}, {"largest_block", l.largest_block_numel},
        {"ranks", in.ranks}, {"ranks_per_node", in.effective_ranks_per_node()}, {"stage", in.stage},
        {"gradient_accumulation_steps", in.gradient_accumulation_steps}, {"param_bytes", in.param_bytes},
        {"placement", plan.mode == tz::PlacementMode::kAuto ? "auto" : "deepspeed"},
        {"links_Bps", {{"nvme_read", in.links.nvme_read_Bps}, {"nvme_write", in.links.nvme_write_Bps},
                       {"pcie", in.links.pcie_Bps}, {"cpu_mem", in.links.cpu_mem_Bps}}}}},
      {"budgets", {{"gpu", {{"bytes", b.gpu_bytes}, {"source", b.gpu_source}}},
                   {"cpu", {{"bytes", b.cpu_bytes}, {"source", b.cpu_source}}},
                   {"nvme", {{"bytes", b.nvme_bytes}, {"source", b.nvme_source}}}}},
      {"layout", {{"param_numel", l.param_numel}, {"grad_numel", l.grad_numel},
                  {"optimizer_numel", l.optimizer_numel}, {"persistent_blocks", l.persistent_blocks},
                  {"persistent_numel", l.persistent_numel}, {"gathered_block_numel", l.gathered_block_numel}}},
      {"states", states},
      {"tiers", tiers_json(plan)},
      {"traffic", {{"nvme_read_bytes", t.nvme_read_bytes}, {"nvme_write_bytes", t.nvme_write_bytes},
                   {"h2d_bytes", t.h2d_bytes}, {"d2h_bytes", t.d2h_bytes},
                   {"cpu_optimizer_bytes", t.cpu_optimizer_bytes}, {"estimated_seconds", t.estimated_seconds}}},
      {"candidates", plan.candidates},
      {"feasible_candidates", plan.feasible_candidates},
      {"summary", plan.summary}};
}

void print_budgets(const tz::ResolvedBudgets& b) {
  fmt::print("budgets    gpu {} per GPU ({})\n", tz::format_bytes(b.gpu_bytes), b.gpu_source);
  fmt::print("           cpu {} per node ({})\n", tz::format_bytes(b.cpu_bytes), b.cpu_source);
  fmt::print("           nvme {} per node ({})\n", tz::format_bytes(b.nvme_bytes), b.nvme_source);
}

int fail(const tz::Status& status, int code) {
  fmt::print(stderr, "tierzero-estimate: {}\n", status.message());
  return code;
}

int run(const Options& o) {
  tz::Expected<std::vector<std::uint64_t>> blocks = make_blocks(o);
  if (!blocks.ok()) return fail(blocks.status(), kExitBadArgs);
  tz::Expected<tz::Config> config = effective_config(o);
  if (!config.ok()) return fail(config.status(), kExitBadArgs);
  if (const tz::Status s = tz::resolve_batch(*config, o.ranks); !s.ok()) return fail(s, kExitBadArgs);
  tz::Expected<tz::ResolvedBudgets> budgets = budgets_for(o, *config);
  if (!budgets.ok()) return fail(budgets.status(), kExitBadArgs);
  tz::PlanInput in = tz::PlanInput::from_config(*config, *std::move(blocks), o.ranks, o.ranks_per_node, *budgets);
  apply_links(o, in.links);
  const tz::Expected<tz::Plan> plan = tz::plan_placement(in);
  if (plan.ok() || plan.status().code() == tz::ErrorCode::kOutOfMemory) print_budgets(*budgets);
  if (!plan.ok()) {
    return fail(plan.status(), plan.status().code() == tz::ErrorCode::kOutOfMemory ? kExitNoFit : kExitBadArgs);
  }
  fmt::print("{}", tz::format_plan(*plan, in));
  if (!o.json_path.empty()) {
    tz::Status written = tz::write_file_durably(o.json_path, plan_json(*plan, in, *budgets).dump(2) + "\n");
    if (!written.ok()) return fail(written.with_context("--json"), kExitBadArgs);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tierzero-estimate: where a model's states fit across GPU, CPU and NVMe, and the per-step traffic"};
  Options options;
  add_options(app, options);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitBadArgs;
  }
  options.has_stage = app.count("--stage") > 0;
  options.has_grad_accum = app.count("--grad-accum") > 0;
  options.has_gpu = app.count("--gpu") > 0;
  options.has_cpu = app.count("--cpu") > 0;
  options.has_nvme = app.count("--nvme") > 0;
  if (options.ranks_per_node > 0 && options.ranks % options.ranks_per_node != 0) {
    fmt::print(stderr, "--ranks-per-node: {} does not divide --ranks {}\n", options.ranks_per_node, options.ranks);
    return kExitBadArgs;
  }
  return run(options);
}
