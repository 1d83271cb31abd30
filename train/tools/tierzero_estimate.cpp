// tierzero-estimate: where would a model's states live, and what would it cost
// to move them each step? Like DeepSpeed's estimate_zero3_model_states_mem_needs,
// with NVMe as a third tier and the placement planner's choice.
//
//   tierzero-estimate --params 20e9 --ranks 1 --gpu 80GB --cpu 120GB --nvme 2TB
//   tierzero-estimate --largest --gpu 80GB --cpu 112GB --nvme 52GB --master remainder --moments int8
//   tierzero-estimate --params 8B --gpu 80GB --cpu 112GB --nvme 2TB --tbw 1200
//
// --largest searches the largest model of the family --layers (or
// --largest-block) describes that fits the budgets, and reports its plan.
// --hidden (with --layers, --heads, --seq) plans tierzero-train's GPT instead
// and adds the trainer's peak host memory on the CPU backend: the states and
// buffers the plan puts there, the activations of one micro-batch (--batch,
// default the config's), evaluation's buffers (--eval-batches, 0 for a run
// that never evaluates), the corpus and the runtime baseline (Note [Peak RSS
// estimate] in train/src/host_memory.cpp):
//   tierzero-estimate --config examples/train_cpu_nvme.json --layers 6 --hidden 384 --heads 6 --seq 128
// A drive rating (--tbw, or --dwpd with --drive-capacity) adds the days of
// training until the node's NVMe writes reach it.
//
// Exit status: 0 a plan fits; 1 no plan fits (the reason on stderr); 2 bad
// arguments (including a config that does not load, or an "auto" budget that
// cannot be resolved).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "tierzero/common.h"
#include "tierzero/offload.h"
#include "tierzero/train.h"

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
  std::string master, moments;  // tierzero.states formats; empty: the config's (fp32)
  std::string grad_accum_dtype;  // data_types.grad_accum_dtype; empty: the config's (fp32)
  bool largest = false;
  // Drive wear: a rating in TB written, or drive writes per day x capacity x years.
  double tbw = 0, dwpd = 0, warranty_years = 5, step_seconds = 0;
  std::string drive_capacity;
  std::string config_path;
  std::string gpu = "auto", cpu = "auto", nvme = "auto";
  std::vector<std::string> nvme_paths;
  std::string json_path;
  // tierzero-train's GPT (--hidden): its blocks replace --params, and the
  // host memory estimate is printed. batch 0: the config's micro batch.
  int hidden = 0, heads = 0, seq = 0, batch = 0, vocab = tz::train::kByteVocab;
  int eval_batches = 4;   // tierzero-train's --eval-batches; 0: a run that never evaluates
  std::string data_path;  // the corpus, held whole in memory; default tierzero-train's
  double nvme_read_gbps = 0, nvme_write_gbps = 0, pcie_gbps = 0, cpu_mem_gbps = 0;
  // Which of the above the user gave (the rest come from --config or defaults).
  bool has_stage = false, has_grad_accum = false, has_gpu = false, has_cpu = false, has_nvme = false;
};

CLI::Validator bytes(bool allow_auto) {
  return CLI::Validator(
      [allow_auto](std::string& text) -> std::string {
        if (allow_auto && text == "auto") return {};
        const tz::Expected<std::uint64_t> bytes = tz::parse_bytes(text);
        return bytes.ok() ? std::string() : bytes.status().message();
      },
      allow_auto ? "BYTES|auto" : "BYTES");
}

CLI::Validator bytes_or_auto() { return bytes(true); }

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

template <typename Format, std::size_t N>
std::vector<std::string> format_names(const Format (&formats)[N], std::string_view (*name)(Format)) {
  std::vector<std::string> out;
  for (Format f : formats) out.emplace_back(name(f));
  return out;
}

void add_wear_options(CLI::App& app, Options& o) {
  const auto positive = CLI::PositiveNumber;
  auto* tbw = app.add_option("--tbw", o.tbw, "the NVMe drive's rated endurance, TB written (several drives striped: "
                                             "their sum); prints the days of training until it is reached")
                  ->check(positive);
  auto* capacity = app.add_option("--drive-capacity", o.drive_capacity, "the drive's capacity, for --dwpd (2TB, ...)")
                       ->check(bytes(false));
  app.add_option("--dwpd", o.dwpd, "the drive's rating in drive writes per day over its warranty (needs "
                                   "--drive-capacity)")
      ->check(positive)
      ->excludes(tbw)
      ->needs(capacity);
  app.add_option("--warranty-years", o.warranty_years, "the warranty a --dwpd rating covers (default 5)")
      ->check(positive);
  app.add_option("--step-seconds", o.step_seconds,
                 "a measured step time for the drive wear (default: the plan's estimated data movement)")
      ->check(positive);
}

// `layers` is the GPT's too; `other_models` (--params, --largest, --largest-block) exclude it.
void add_gpt_options(CLI::App& app, Options& o, CLI::Option* layers, std::initializer_list<CLI::Option*> other_models) {
  const auto positive = CLI::Range(1, 1 << 20);
  auto* hidden = app.add_option("--hidden", o.hidden, "plan tierzero-train's GPT of this width (with --layers, --heads, "
                                                      "--seq) and predict the trainer's peak host memory")
                     ->check(positive);
  for (CLI::Option* other : other_models) hidden->excludes(other);
  hidden->needs(layers);
  hidden->needs(app.add_option("--heads", o.heads, "the GPT's attention heads")->check(positive)->needs(hidden));
  hidden->needs(app.add_option("--seq", o.seq, "the GPT's context length")->check(positive)->needs(hidden));
  app.add_option("--batch", o.batch, "the GPT's sequences per micro-batch (default: the config's "
                                     "train_micro_batch_size_per_gpu)")
      ->check(positive)
      ->needs(hidden);
  app.add_option("--vocab", o.vocab, "the GPT's vocabulary (default 256, bytes)")->check(positive)->needs(hidden);
  app.add_option("--eval-batches", o.eval_batches, "the GPT run's validation batches per evaluation (default 4, "
                                                   "tierzero-train's; 0 for a run with --eval-every 0)")
      ->check(CLI::Range(0, 1 << 20))
      ->needs(hidden);
  app.add_option("--data", o.data_path, "the training text, held whole in memory (default tierzero-train's corpus)")
      ->check(CLI::ExistingFile)
      ->needs(hidden);
}

void add_options(CLI::App& app, Options& o) {
  auto* params = app.add_option("--params", o.params, "parameters in the model, e.g. 20e9, 1.3B, 350M")->check(count());
  auto* largest = app.add_flag("--largest", o.largest,
                               "search the largest model of this family (--layers or --largest-block) that fits the "
                               "budgets")
                      ->excludes(params);
  app.add_option("--ranks", o.ranks, "data-parallel ranks (GPUs)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--ranks-per-node", o.ranks_per_node, "ranks sharing one node's CPU memory and NVMe (default: all)")
      ->check(CLI::Range(1, 1 << 20));
  auto* layers = app.add_option("--layers", o.layers, "the model is this many equal blocks (default 32)")
                     ->check(CLI::Range(1, static_cast<int>(kMaxBlocks)));
  auto* largest_block = app.add_option("--largest-block", o.largest_block, "blocks of this many params (and one "
                                                                           "remainder block)")
                            ->check(count())
                            ->excludes(layers);
  add_gpt_options(app, o, layers, {params, largest, largest_block});
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
  app.add_option("--master", o.master, "the master weights' format: fp32, or remainder (bf16 params; default the "
                                       "config's tierzero.states.master, or fp32)")
      ->check(CLI::IsMember(format_names(tz::kMasterFormats, tz::master_format_name)));
  app.add_option("--moments", o.moments, "the Adam moments' format: fp32, bf16 or int8 (default the config's "
                                         "tierzero.states.moments, or fp32)")
      ->check(CLI::IsMember(format_names(tz::kMomentFormats, tz::moment_format_name)));
  app.add_option("--grad-accum-dtype", o.grad_accum_dtype,
                 "the gradient accumulator's dtype, as DeepSpeed's data_types.grad_accum_dtype: fp32, or the 16-bit "
                 "training dtype (bf16, fp16); default the config's, or fp32")
      ->check(CLI::IsMember(format_names(tz::kGradFormats, tz::grad_format_name)));
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
  app.add_option("--nvme-path", o.nvme_paths, "NVMe directory (repeatable), replacing the config's NVMe paths; "
                                             "--nvme auto is their free space");
  app.add_option("--json", o.json_path, "also write the plan as JSON to this file");
  const auto speed = CLI::PositiveNumber;
  app.add_option("--nvme-read-gbps", o.nvme_read_gbps, "NVMe read speed, GB/s (default 2)")->check(speed);
  app.add_option("--nvme-write-gbps", o.nvme_write_gbps, "NVMe write speed, GB/s (default 2)")->check(speed);
  app.add_option("--pcie-gbps", o.pcie_gbps, "host<->device speed, GB/s (default 25)")->check(speed);
  app.add_option("--cpu-mem-gbps", o.cpu_mem_gbps, "CPU Adam memory bandwidth, GB/s (default 40)")->check(speed);
  add_wear_options(app, o);
}

std::uint64_t count_of(const std::string& text) {
  return static_cast<std::uint64_t>(std::llround(tz::parse_count(text).value()));
}

// The model family: `params` in --layers equal blocks, or in blocks of --largest-block.
tz::Expected<std::vector<std::uint64_t>> make_blocks(const Options& o, std::uint64_t params) {
  std::vector<std::uint64_t> blocks;
  if (!o.largest_block.empty()) {
    const std::uint64_t largest = std::min(count_of(o.largest_block), params);
    if (params / largest > kMaxBlocks) {
      return tz::invalid_argument("--largest-block {} splits {} params into more than {} blocks", o.largest_block,
                                  params, kMaxBlocks);
    }
    blocks.assign(params / largest, largest);
    if (params % largest != 0) blocks.push_back(params % largest);
    return blocks;
  }
  const auto layers = static_cast<std::uint64_t>(o.layers);
  if (layers > params) return tz::invalid_argument("--layers {} is more than --params {}", o.layers, params);
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
  if (!o.master.empty()) TZ_TRY(tz::set_master_format(config, o.master));
  if (!o.moments.empty()) TZ_TRY(tz::set_moment_format(config, o.moments));
  if (!o.grad_accum_dtype.empty()) TZ_TRY(tz::set_grad_format(config, o.grad_accum_dtype));
  // Again after the flags: --precision fp16 under a remainder config, or --master remainder without bf16.
  if (const tz::Status s = tz::check_state_formats(config); !s.ok()) {
    return tz::invalid_argument("{} (on the command line: --master, --precision, --grad-accum-dtype)", s.message());
  }
  if (o.has_stage) config.zero.stage = o.stage;
  if (o.has_grad_accum) tz::override_gradient_accumulation_steps(config, o.grad_accum);
  if (o.has_gpu || o.config_path.empty()) config.tiers.gpu = budget_of(o.gpu);
  if (o.has_cpu || o.config_path.empty()) config.tiers.cpu = budget_of(o.cpu);
  if (o.has_nvme || o.config_path.empty()) config.tiers.nvme = budget_of(o.nvme);
  if (!o.nvme_paths.empty()) {  // replacing the config's, as tierzero-train's --nvme-path does
    config.tiers.nvme_paths = o.nvme_paths;
    config.zero.offload_param.nvme_path = config.zero.offload_optimizer.nvme_path = o.nvme_paths.front();
  }
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
                      {"format", tz::state_format_name(s, plan.param_bytes, plan.states)},
                      {"bytes_per_elem", plan.elem_bytes_of(s)}, {"bytes_per_rank", plan.bytes_of(s)}});
  }
  const tz::StepTraffic& t = plan.traffic;
  const auto per_param = [&](std::uint64_t bytes) { return tz::bytes_per_param(bytes, l, in.ranks); };
  return {
      {"inputs",
       {{"params", l.model_numel}, {"blocks", l.blocks}, {"largest_block", l.largest_block_numel},
        {"ranks", in.ranks}, {"ranks_per_node", in.effective_ranks_per_node()}, {"stage", in.stage},
        {"gradient_accumulation_steps", in.gradient_accumulation_steps}, {"param_bytes", in.param_bytes},
        {"master", tz::master_format_name(in.states.master)}, {"moments", tz::moment_format_name(in.states.moments)},
        {"grad_accum_dtype", tz::grad_format_name(in.states.grads)},
        {"step_under_backward", tz::step_under_backward_name(in.step_under_backward)},
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
                   {"cpu_optimizer_bytes", t.cpu_optimizer_bytes}, {"estimated_seconds", t.estimated_seconds},
                   {"nvme_bytes_per_param", per_param(t.nvme_read_bytes) + per_param(t.nvme_write_bytes)},
                   {"pcie_bytes_per_param", per_param(t.h2d_bytes) + per_param(t.d2h_bytes)}}},
      {"step_under_backward", {{"blocks", plan.ahead_blocks}, {"off", plan.ahead_off}}},
      {"kept_param_blocks", {{"kept", plan.kept_param_blocks}, {"of", plan.keepable_param_blocks}}},
      {"grads_on_device_across_micro_batches", {{"blocks", plan.grad_window_blocks}, {"numel", plan.grad_window_numel}}},
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

// "240.00 GB": drives are rated in SI units.
std::string si_bytes(double bytes) {
  static constexpr const char* kUnits[] = {"B", "kB", "MB", "GB", "TB", "PB"};
  std::size_t u = 0;
  while (bytes >= 1000 && u + 1 < std::size(kUnits)) bytes /= 1000, ++u;
  return fmt::format("{:.2f} {}", bytes, kUnits[u]);
}

std::string model_family(const Options& o) {
  return o.largest_block.empty() ? fmt::format("{} equal blocks (--layers)", o.layers)
                                 : fmt::format("blocks of {} params (--largest-block)", o.largest_block);
}

// --largest: the largest model of the family that fits, searched with the planner.
tz::Expected<tz::LargestModel> search_largest(const Options& o, const tz::PlanInput& base) {
  const tz::BlocksOf blocks_of = [&o](std::uint64_t params) { return make_blocks(o, params); };
  std::uint64_t max_params = static_cast<std::uint64_t>(kMaxParams);
  std::uint64_t min_params = static_cast<std::uint64_t>(o.layers);
  if (!o.largest_block.empty()) {
    min_params = 1;
    max_params = std::min(max_params, count_of(o.largest_block) * kMaxBlocks);
  }
  return tz::find_largest_model(base, blocks_of, min_params, max_params);
}

void print_largest(const Options& o, const tz::LargestModel& m) {
  fmt::print("largest    {} params ({}) fit, in {}", tz::format_count(static_cast<double>(m.params)), m.params,
             model_family(o));
  if (m.next_params != 0) {
    fmt::print("; {} ({}) finds no placement (searched to {:.2g}%)\n", tz::format_count(static_cast<double>(m.next_params)),
               m.next_params, 100.0 * static_cast<double>(m.next_params - m.params) / static_cast<double>(m.params));
  } else {
    fmt::print("; the search's upper end\n");
  }
}

std::optional<tz::Expected<tz::DriveEndurance>> endurance_of(const Options& o) {
  if (o.tbw > 0) return tz::endurance_from_tbw(o.tbw);
  if (o.dwpd > 0) return tz::endurance_from_dwpd(o.dwpd, tz::parse_bytes(o.drive_capacity).value(), o.warranty_years);
  return std::nullopt;
}

// Note [Step rate for drive wear]: the estimator has no compute model, so its
// step time is the plan's data movement, every transfer one after another
// (estimated_seconds): longer than a step that overlaps them, so the wear it
// gives is the least. The drives' own pace bounds it from the other side: a
// step takes at least its NVMe reads and writes, one after another on a drive.
// A measured step time (--step-seconds) replaces both.
void print_wear(const Options& o, const tz::Plan& plan, const tz::PlanInput& in,
                const std::optional<tz::DriveEndurance>& endurance) {
  const tz::DriveEndurance rating = endurance.value_or(tz::DriveEndurance{});
  const double step = o.step_seconds > 0 ? o.step_seconds : plan.traffic.estimated_seconds;
  const tz::DriveWear wear = tz::drive_wear(plan, in, step, rating);
  fmt::print("\ndrive writes (the NVMe tier of a node, {} rank{} writing):\n", in.effective_ranks_per_node(),
             in.effective_ranks_per_node() == 1 ? "" : "s");
  if (wear.written_per_step_bytes == 0) {
    fmt::print("  nothing is written to NVMe in a step: no wear from training\n");
    return;
  }
  fmt::print("  written per step       {} ({:.3f} B/param)\n", si_bytes(static_cast<double>(wear.written_per_step_bytes)),
             tz::bytes_per_param(plan.traffic.nvme_write_bytes, plan.layout, in.ranks));
  fmt::print("  step time              {:.2f} s: {}\n", step,
             o.step_seconds > 0 ? "--step-seconds (measured)"
                                : "the plan's estimated data movement, every transfer one after another (no compute "
                                  "model; --step-seconds S to give a measured one)");
  fmt::print("  written per hour       {}\n", si_bytes(wear.written_per_hour_bytes));
  if (!endurance) {
    fmt::print("  (give the drive's rating, --tbw N or --dwpd N --drive-capacity SIZE, for the days until it is "
               "reached)\n");
    return;
  }
  fmt::print("  rated endurance        {}\n", rating.source);
  fmt::print("  days of training until the rating is reached: {:.1f} (around the clock at that step time)\n",
             wear.days_to_rating);
  if (o.step_seconds > 0) return;
  const double bound = tz::nvme_bound_seconds(plan, in);
  const tz::DriveWear fastest = tz::drive_wear(plan, in, bound, rating);
  fmt::print("  at the drives' own pace (a step no shorter than its NVMe reads and writes, {:.2f} s at {:.2f} + "
             "{:.2f} GB/s): {:.1f} days\n",
             bound, in.links.nvme_read_Bps / 1e9, in.links.nvme_write_Bps / 1e9, fastest.days_to_rating);
}

nlohmann::json wear_json(const Options& o, const tz::Plan& plan, const tz::PlanInput& in,
                         const std::optional<tz::DriveEndurance>& endurance) {
  const double step = o.step_seconds > 0 ? o.step_seconds : plan.traffic.estimated_seconds;
  const tz::DriveWear w = tz::drive_wear(plan, in, step, endurance.value_or(tz::DriveEndurance{}));
  nlohmann::json j = {{"written_per_step_bytes", w.written_per_step_bytes}, {"step_seconds", step},
                      {"step_seconds_source", o.step_seconds > 0 ? "--step-seconds" : "estimated_seconds"},
                      {"written_per_hour_bytes", w.written_per_hour_bytes}};
  if (endurance && std::isfinite(w.days_to_rating)) {
    j["rated_bytes"] = endurance->rated_bytes;
    j["rating"] = endurance->source;
    j["days_to_rating"] = w.days_to_rating;
  }
  return j;
}

// --hidden: tierzero-train's GPT, its micro batch the config's unless --batch.
tz::Expected<tz::train::GptConfig> gpt_of(const Options& o, const tz::Config& config) {
  const int batch = o.batch > 0 ? o.batch : static_cast<int>(config.train_micro_batch_size_per_gpu);
  tz::train::GptConfig cfg{.layers = o.layers, .hidden = o.hidden, .heads = o.heads, .seq = o.seq, .batch = batch,
                           .vocab = o.vocab};
  TZ_TRY_CTX(cfg.validate(), "--layers/--hidden/--heads/--seq/--batch/--vocab");
  return cfg;
}

std::vector<std::uint64_t> gpt_blocks(const tz::train::GptConfig& cfg) {
  std::vector<std::uint64_t> blocks;
  for (const tz::BlockSpec& b : tz::train::model(cfg)) {
    std::uint64_t numel = 0;
    for (const tz::ParamSpec& p : b.params) numel += p.numel();
    blocks.push_back(numel);
  }
  return blocks;
}

// The corpus tierzero-train would read: --data, or its default (the source
// tree's data/, or share/tierzero/data beside an installed bin/).
tz::Expected<std::string> corpus_path(const Options& o) {
  if (!o.data_path.empty()) return o.data_path;
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return tz::train::default_corpus_path(ec ? std::string() : self.parent_path().string());
}

struct GptMemory {
  tz::train::GptConfig cfg;
  std::string corpus;
  int eval_batches = 0;
  tz::train::HostMemoryEstimate host;
};

tz::Expected<GptMemory> gpt_memory(const Options& o, const tz::train::GptConfig& cfg, const tz::Plan& plan) {
  TZ_ASSIGN_OR_RETURN(std::string corpus, corpus_path(o));
  std::error_code ec;
  const std::uintmax_t corpus_bytes = std::filesystem::file_size(corpus, ec);
  if (ec) return tz::io_error("--data {}: {}", corpus, ec.message());
  return GptMemory{cfg, corpus, o.eval_batches,
                   tz::train::estimate_host_memory(cfg, plan, tz::BackendKind::kHost, corpus_bytes, o.eval_batches)};
}

void print_host_memory(const GptMemory& m) {
  const tz::train::HostMemoryEstimate& h = m.host;
  const auto mib = [](std::uint64_t bytes) { return fmt::format("{:9.1f} MiB", static_cast<double>(bytes) / (1 << 20)); };
  fmt::print("\nhost memory of one rank of tierzero-train on the CPU backend (Note [Peak RSS estimate]):\n");
  fmt::print("  model states         {}  in the device and CPU tiers (the device is host memory there)\n",
             mib(h.state_bytes));
  fmt::print("  staging and buffers  {}  NVMe staging, the gather window, gradients in flight\n", mib(h.buffer_bytes));
  fmt::print("  activations          {}  {} x {} tokens through {} layers x {} (GptConfig::activation_bytes)\n",
             mib(h.activation_bytes), m.cfg.batch, m.cfg.seq, m.cfg.layers, m.cfg.hidden);
  fmt::print("  evaluation           {}  {} batches (--eval-batches; GptConfig::evaluation_bytes)\n",
             mib(h.evaluation_bytes), m.eval_batches);
  fmt::print("  corpus               {}  {}\n", mib(h.corpus_bytes), m.corpus);
  fmt::print("  runtime baseline     {}  the program, its libraries and threads (measured)\n", mib(h.runtime_bytes));
  fmt::print("  predicted peak RSS   {}\n", mib(h.total_bytes()));
}

nlohmann::json host_memory_json(const GptMemory& m) {
  const tz::train::HostMemoryEstimate& h = m.host;
  return {{"backend", "host"}, {"gpt", {{"layers", m.cfg.layers}, {"hidden", m.cfg.hidden}, {"heads", m.cfg.heads},
                                        {"seq", m.cfg.seq}, {"batch", m.cfg.batch}, {"vocab", m.cfg.vocab}}},
          {"state_bytes", h.state_bytes}, {"buffer_bytes", h.buffer_bytes}, {"activation_bytes", h.activation_bytes},
          {"eval_batches", m.eval_batches}, {"evaluation_bytes", h.evaluation_bytes},
          {"corpus_bytes", h.corpus_bytes}, {"corpus", m.corpus}, {"runtime_bytes", h.runtime_bytes},
          {"predicted_peak_rss_bytes", h.total_bytes()}};
}

int run(const Options& o) {
  tz::Expected<tz::Config> config = effective_config(o);
  if (!config.ok()) return fail(config.status(), kExitBadArgs);
  if (const tz::Status s = tz::resolve_batch(*config, o.ranks); !s.ok()) return fail(s, kExitBadArgs);
  std::optional<tz::DriveEndurance> endurance;
  if (auto e = endurance_of(o)) {
    if (!e->ok()) return fail(e->status(), kExitBadArgs);
    endurance = **e;
  }
  tz::Expected<tz::ResolvedBudgets> budgets = budgets_for(o, *config);
  if (!budgets.ok()) return fail(budgets.status(), kExitBadArgs);
  tz::PlanInput in = tz::PlanInput::from_config(*config, {}, o.ranks, o.ranks_per_node, *budgets);
  apply_links(o, in.links);
  std::optional<tz::LargestModel> largest;
  std::optional<tz::train::GptConfig> gpt;
  tz::Expected<tz::Plan> plan = tz::invalid_argument("not planned");
  if (o.largest) {
    tz::Expected<tz::LargestModel> found = search_largest(o, in);
    if (found.ok()) {
      plan = found->plan;
      in = found->input;
      largest = *std::move(found);
    } else {
      plan = found.status();
    }
  } else if (o.hidden > 0) {
    tz::Expected<tz::train::GptConfig> cfg = gpt_of(o, *config);
    if (!cfg.ok()) return fail(cfg.status(), kExitBadArgs);
    gpt = *cfg;
    in.block_numel = gpt_blocks(*gpt);
    plan = tz::plan_placement(in);
  } else {
    tz::Expected<std::vector<std::uint64_t>> blocks = make_blocks(o, count_of(o.params));
    if (!blocks.ok()) return fail(blocks.status(), kExitBadArgs);
    in.block_numel = *std::move(blocks);
    plan = tz::plan_placement(in);
  }
  if (plan.ok() || plan.status().code() == tz::ErrorCode::kOutOfMemory) print_budgets(*budgets);
  if (!plan.ok()) {
    return fail(plan.status(), plan.status().code() == tz::ErrorCode::kOutOfMemory ? kExitNoFit : kExitBadArgs);
  }
  if (largest) print_largest(o, *largest);
  fmt::print("{}", tz::format_plan(*plan, in));
  print_wear(o, *plan, in, endurance);
  std::optional<GptMemory> memory;
  if (gpt) {
    tz::Expected<GptMemory> m = gpt_memory(o, *gpt, *plan);
    if (!m.ok()) return fail(m.status(), kExitBadArgs);
    memory = *std::move(m);
    print_host_memory(*memory);
  }
  if (!o.json_path.empty()) {
    nlohmann::json j = plan_json(*plan, in, *budgets);
    j["drive_wear"] = wear_json(o, *plan, in, endurance);
    if (memory) j["host_memory"] = host_memory_json(*memory);
    if (largest) j["largest"] = {{"params", largest->params}, {"next_params", largest->next_params},
                                 {"family", model_family(o)}};
    tz::Status written = tz::write_file_durably(o.json_path, j.dump(2) + "\n");
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
  if (options.params.empty() && !options.largest && options.hidden == 0) {
    fmt::print(stderr, "--params is required (or --largest, to search the largest model that fits, or --hidden with "
                       "--layers, --heads and --seq for tierzero-train's GPT)\n");
    return kExitBadArgs;
  }
  if (options.ranks_per_node > 0 && options.ranks % options.ranks_per_node != 0) {
    fmt::print(stderr, "--ranks-per-node: {} does not divide --ranks {}\n", options.ranks_per_node, options.ranks);
    return kExitBadArgs;
  }
  return run(options);
}
