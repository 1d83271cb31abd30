// Tier budgets: "auto" resolved from the capability probe, and the planner's
// input read from a Config.
#include <algorithm>
#include <limits>
#include <set>
#include <sys/stat.h>
#include <string>
#include <vector>

#include "tierzero/offload/planner.h"

namespace tz {
namespace {

// 90%, not 100%: the CUDA context, the allocator's fragmentation, the OS page
// cache and the rest of the process need the remainder.
std::uint64_t ninety_percent(std::uint64_t bytes) { return bytes / 10 * 9 + bytes % 10 * 9 / 10; }

Expected<std::uint64_t> auto_gpu_bytes(const Capabilities& caps, std::string* source) {
  if (caps.cuda.devices.empty()) {
    return unavailable(
        "tierzero.tiers.gpu_bytes is \"auto\" but no GPU was found ({}); set tierzero.tiers.gpu_bytes to the "
        "memory of the GPU to plan for, e.g. \"80GB\"",
        caps.cuda.status.empty() ? "no CUDA devices" : caps.cuda.status);
  }
  const GpuDevice& device = caps.cuda.devices.front();
  *source = fmt::format("auto: 90% of GPU 0 ({}) total memory {}", device.name,
                        format_bytes(device.total_memory_bytes));
  return ninety_percent(device.total_memory_bytes);
}

// Free space summed over the paths; two paths on one file system (same
// st_dev: a block device, or one tmpfs/overlay/btrfs subvolume) count once.
Expected<std::uint64_t> auto_nvme_bytes(const std::vector<std::string>& paths, std::string* source) {
  if (paths.empty()) {
    *source = "auto: no NVMe paths given (tierzero.tiers.nvme_paths), so no NVMe tier";
    return std::uint64_t{0};
  }
  std::uint64_t total = 0;
  std::set<dev_t> seen;
  std::vector<std::string> counted;
  for (const std::string& path : paths) {
    Expected<PathCapabilities> probed = probe_path(path);
    if (!probed.ok()) {
      return std::move(probed).status().with_context(
          fmt::format("resolving tierzero.tiers.nvme_bytes \"auto\" from NVMe path {}", path));
    }
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && !seen.insert(st.st_dev).second) continue;
    total += probed->free_bytes;
    counted.push_back(fmt::format("{} ({} free)", path, format_bytes(probed->free_bytes)));
  }
  *source = "auto: free space on ";
  for (std::size_t i = 0; i < counted.size(); ++i) *source += (i == 0 ? "" : ", ") + counted[i];
  return total;
}

int clamp_to_int(std::int64_t v) {
  return static_cast<int>(std::clamp<std::int64_t>(v, std::numeric_limits<int>::min(),
                                                   std::numeric_limits<int>::max()));
}

}  // namespace

Expected<ResolvedBudgets> resolve_budgets(const TierConfig& tiers, const Capabilities& caps,
                                          const std::vector<std::string>& nvme_paths) {
  ResolvedBudgets out;
  out.gpu_bytes = tiers.gpu.bytes;
  out.cpu_bytes = tiers.cpu.bytes;
  out.nvme_bytes = tiers.nvme.bytes;
  out.gpu_source = out.cpu_source = out.nvme_source = "config";
  if (tiers.gpu.is_auto) {
    TZ_ASSIGN_OR_RETURN(out.gpu_bytes, auto_gpu_bytes(caps, &out.gpu_source));
  }
  if (tiers.cpu.is_auto) {
    out.cpu_bytes = ninety_percent(caps.memory.available_bytes);
    out.cpu_source = fmt::format("auto: 90% of MemAvailable {}", format_bytes(caps.memory.available_bytes));
  }
  if (tiers.nvme.is_auto) {
    TZ_ASSIGN_OR_RETURN(out.nvme_bytes, auto_nvme_bytes(nvme_paths, &out.nvme_source));
  }
  return out;
}

Expected<ResolvedBudgets> resolve_budgets(const TierConfig& tiers, const std::vector<std::string>& nvme_paths) {
  const bool any_auto = tiers.gpu.is_auto || tiers.cpu.is_auto || tiers.nvme.is_auto;
  return any_auto ? resolve_budgets(tiers, capabilities(), nvme_paths) : resolve_budgets(tiers, Capabilities{}, nvme_paths);
}

PlanInput PlanInput::from_config(const Config& config, std::vector<std::uint64_t> block_numel, int ranks,
                                 int ranks_per_node, ResolvedBudgets budgets) {
  PlanInput in;
  in.block_numel = std::move(block_numel);
  in.ranks = ranks;
  in.ranks_per_node = ranks_per_node;
  in.stage = config.zero.stage;
  in.gradient_accumulation_steps = clamp_to_int(config.gradient_accumulation_steps);
  // Neither bf16 nor fp16: the engine trains fp32 parameters.
  in.param_bytes = config.precision.bf16 || config.precision.fp16 ? 2 : 4;
  in.states = config.states;
  in.gpu_bytes = budgets.gpu_bytes;
  in.cpu_bytes = budgets.cpu_bytes;
  in.nvme_bytes = budgets.nvme_bytes;
  in.mode = config.placement;
  in.offload_param = config.zero.offload_param.device;
  in.offload_optimizer = config.zero.offload_optimizer.device;
  in.persistence_threshold = config.zero.stage3_param_persistence_threshold;
  in.prefetch_bucket_size = config.zero.stage3_prefetch_bucket_size;
  in.sub_group_size = config.zero.sub_group_size;
  in.step_under_backward = config.step_under_backward;
  in.grads_on_device_across_micro_batches = config.backend != BackendChoice::kHost;
  return in;
}

}  // namespace tz
