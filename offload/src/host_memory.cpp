#include "tierzero/offload/host_memory.h"

#include <hwloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <string>
#include <mutex>

#include "device_internal.h"

namespace tz {
namespace {

// One hwloc topology for the process, loaded on first use; nullptr when hwloc
// fails (binding is then skipped, once, with a warning).
hwloc_topology_t topology() {
  static hwloc_topology_t topo = [] {
    hwloc_topology_t t = nullptr;
    if (hwloc_topology_init(&t) != 0) return hwloc_topology_t{nullptr};
    if (hwloc_topology_load(t) != 0) {
      hwloc_topology_destroy(t);
      return hwloc_topology_t{nullptr};
    }
    return t;
  }();
  return topo;
}

std::size_t page_size() {
  static const auto size = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

Status bind_to_node(void* ptr, std::size_t bytes, int node) {
  hwloc_topology_t topo = topology();
  if (topo == nullptr) {
    TZ_LOG_ONCE_WARN("offload", "hwloc topology unavailable; host memory is not bound to NUMA node {}", node);
    return ok_status();
  }
  hwloc_obj_t obj = hwloc_get_numanode_obj_by_os_index(topo, static_cast<unsigned>(node));
  if (obj == nullptr) return invalid_argument("NUMA node {} does not exist (tierzero.tiers.numa_node)", node);
  if (hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE) <= 1) return ok_status();  // nothing to choose
  if (hwloc_set_area_membind(topo, ptr, bytes, obj->nodeset, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET) != 0) {
    return errno_status(errno, fmt::format("binding {} to NUMA node {}", format_bytes(bytes), node));
  }
  return ok_status();
}

// Note [Host memory on huge pages]
// The CPU tier, the staging sets and the copy-out buffers are what NVMe reads
// land in and writes leave from. On 4 KiB pages every page is a DMA segment:
// the block layer splits each request at max_segments pages and cannot merge
// neighbours, and reads of 1 MiB pieces ran at 0.72x fio's where on 2 MiB
// pages they ran at 0.96x (bench/RESULTS.md, issue #25). CPU Adam streams the
// same memory and takes fewer TLB misses on huge pages. So an allocation of a
// huge page or more starts on a 2 MiB boundary (the mapping is cut out of one
// 2 MiB larger) and is madvise(MADV_HUGEPAGE)d before its first touch, where
// the kernel offers transparent huge pages in "always" or "madvise" mode;
// where it does not, the log says so once. The pages beyond the last whole
// huge page stay small; nothing is rounded up, so the budget counts what is
// mapped.
constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

bool huge_pages_offered() {
  static const bool offered = [] {
    const std::string& mode = capabilities().memory.transparent_hugepage;
    if (mode == "always" || mode == "madvise") return true;
    TZ_LOG_WARN("offload", "host memory stays on 4 KiB pages: transparent huge pages are {} here "
                "(/sys/kernel/mm/transparent_hugepage/enabled); NVMe reads into it are split into more requests",
                mode.empty() ? "not offered" : "\"" + mode + "\"");
    return false;
  }();
  return offered;
}

// [ptr, ptr + length) mapped, starting `offset` (< 2 MiB) past a 2 MiB
// boundary, on transparent huge pages when `advise`.
Expected<void*> map_huge_aligned(std::size_t length, std::size_t offset, bool advise) {
  const std::size_t mapped = length + kHugePageBytes;
  void* base = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return errno_status(errno, fmt::format("mmap({})", format_bytes(mapped)));
  const auto start = reinterpret_cast<std::uintptr_t>(base);
  // The first boundary + offset at or after start: within the 2 MiB of slack.
  std::uintptr_t aligned = align_up(start, kHugePageBytes) + offset;
  if (aligned >= start + kHugePageBytes) aligned -= kHugePageBytes;
  // Cut the slack on both sides away; munmap of a range inside a private
  // anonymous mapping that we own cannot fail but for a bad argument.
  if (aligned > start) (void)::munmap(base, aligned - start);
  if (const std::uintptr_t end = start + mapped, used_end = aligned + length; end > used_end) {
    (void)::munmap(reinterpret_cast<void*>(used_end), end - used_end);
  }
  void* ptr = reinterpret_cast<void*>(aligned);
  if (advise && ::madvise(ptr, length, MADV_HUGEPAGE) != 0) {
    TZ_LOG_ONCE_WARN("offload", "madvise(MADV_HUGEPAGE) on host memory: {}; it stays on 4 KiB pages",
                     std::strerror(errno));
  }
  return ptr;
}

class HostAllocator final : public RawAllocator {
 public:
  HostAllocator(Device& device, HostMemoryOptions options) : device_(device), options_(options) {}

  Expected<void*> allocate(std::size_t bytes) override { return allocate_coloured(bytes, Colour::kMaster); }

  Expected<void*> allocate_coloured(std::size_t bytes, Colour colour) override {
    const std::size_t length = align_up(bytes, page_size());
    void* ptr = nullptr;
    if (length >= kHugePageBytes) {
      // Note [Coloured arrays]: placed by colour whether or not huge pages back it, on a whole page.
      const std::size_t step = static_cast<std::size_t>(colour) * kColourStepBytes % kHugePageBytes;
      const std::size_t offset = length >= kColourMinBytes ? step / page_size() * page_size() : 0;
      TZ_ASSIGN_OR_RETURN(ptr, map_huge_aligned(length, offset, options_.huge_pages && huge_pages_offered()));
    } else {
      ptr = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (ptr == MAP_FAILED) return errno_status(errno, fmt::format("mmap({})", format_bytes(length)));
    }
    MappedRegion region(ptr, length);  // unmapped on any error below
    // Bind before the first touch (pinning touches every page).
    if (options_.numa_node >= 0) TZ_TRY(bind_to_node(ptr, length, options_.numa_node));
    if (options_.pinned) TZ_TRY_CTX(device_.pin(ptr, length), "pinning host memory");
    (void)region.release();
    return ptr;
  }

  void deallocate(void* ptr, std::size_t bytes) override {
    const std::size_t length = align_up(bytes, page_size());
    if (options_.pinned) {
      Status s = device_.unpin(ptr, length);
      if (!s.ok()) TZ_LOG_ERROR("offload", "unpinning host memory: {}", s.to_string());
    }
    MappedRegion region(ptr, length);
  }

 private:
  Device& device_;
  HostMemoryOptions options_;
};

}  // namespace

std::unique_ptr<RawAllocator> make_host_allocator(Device& device, HostMemoryOptions options) {
  return std::make_unique<HostAllocator>(device, options);
}

Expected<std::unique_ptr<MemoryPool>> make_host_pool(Device& device, std::uint64_t budget_bytes,
                                                     HostMemoryOptions options) {
  // mlock is bound by RLIMIT_MEMLOCK (cudaHostRegister is not): say so now,
  // not mid-step. What is locked already (other pools) counts against it too.
  if (options.pinned && device.kind() == BackendKind::kHost && !has_cap_ipc_lock()) {
    const std::uint64_t limit = memlock_limit_bytes();
    const std::uint64_t locked = locked_bytes();
    if (locked > limit || budget_bytes > limit - locked) {
      return out_of_memory(
          "cpu tier: pinned budget {} (tierzero.tiers.cpu_bytes) plus {} already locked exceeds the memlock "
          "limit; {}",
          format_bytes(budget_bytes), format_bytes(locked), memlock_advice(budget_bytes + locked));
    }
  }
  PoolOptions pool_options;
  pool_options.tier = options.pinned ? "pinned cpu" : "cpu";
  pool_options.budget_key = "tierzero.tiers.cpu_bytes";
  pool_options.hint = "move more state to NVMe (offload_*.device: nvme)";
  pool_options.budget_bytes = budget_bytes;
  pool_options.granularity_bytes = page_size();
  pool_options.coloured = true;
  return std::make_unique<MemoryPool>(std::move(pool_options), make_host_allocator(device, options), &device);
}

namespace {
class DeviceAllocator final : public RawAllocator {
 public:
  explicit DeviceAllocator(Device& device) : device_(device) {}
  Expected<void*> allocate(std::size_t bytes) override { return device_.allocate(bytes, nullptr); }
  void deallocate(void* ptr, std::size_t bytes) override {
    Status s = device_.deallocate(ptr, bytes, nullptr);
    if (!s.ok()) TZ_LOG_ERROR("offload", "freeing device memory: {}", s.to_string());
  }

 private:
  Device& device_;
};
}  // namespace

Expected<std::unique_ptr<MemoryPool>> make_device_pool(Device& device, std::uint64_t budget_bytes) {
  PoolOptions pool_options;
  pool_options.tier = device.kind() == BackendKind::kCuda ? "gpu" : "device (host backend)";
  pool_options.budget_key = "tierzero.tiers.gpu_bytes";
  pool_options.hint = "lower stage3_prefetch_bucket_size, or offload more";
  pool_options.budget_bytes = budget_bytes;
  return std::make_unique<MemoryPool>(std::move(pool_options), std::make_unique<DeviceAllocator>(device), &device);
}

Expected<int> resolve_numa_node(const Device& device, std::optional<int> configured) {
  if (!configured) return device.numa_node();
  const auto& nodes = capabilities().numa_nodes;
  for (const NumaNode& node : nodes) {
    if (node.os_index == *configured) return *configured;
  }
  std::string known;
  for (const NumaNode& node : nodes) known += fmt::format("{}{}", known.empty() ? "" : ", ", node.os_index);
  return invalid_argument("tierzero.tiers.numa_node is {}, but this machine's NUMA nodes are [{}]", *configured,
                          known);
}

}  // namespace tz
