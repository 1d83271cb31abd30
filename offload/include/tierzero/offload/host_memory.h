// Host memory for the CPU tier: page-aligned, placed on a NUMA node through
// hwloc, and pinned (page-locked) so device copies from it are asynchronous.
// Allocations of 2 MiB or more start on a 2 MiB boundary (those of 32 MiB or
// more their colour's step past it: Note [Coloured arrays] in pool.h) and are
// advised onto transparent huge pages where the kernel offers them (Note [Host
// memory on huge pages] in host_memory.cpp; the log says once where it does not).
//
// Pinning goes through the Device: cudaHostRegister on the CUDA backend, mlock
// on the Host backend. On the Host backend the memlock limit applies: a pool
// whose budget exceeds RLIMIT_MEMLOCK (and a process without CAP_IPC_LOCK)
// is refused at creation with the limit, the budget and what to change, rather
// than failing halfway through a step.
//
//   tz::HostMemoryOptions host{.pinned = config.zero.offload_optimizer.pin_memory,
//                              .numa_node = device->numa_node()};
//   TZ_ASSIGN_OR_RETURN(auto pinned, tz::make_host_pool(*device, 64 * tz::kGiB, host));
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "tierzero/offload/device.h"
#include "tierzero/offload/pool.h"

namespace tz {

struct HostMemoryOptions {
  bool pinned = true;   // page-lock through the device
  int numa_node = -1;   // bind to this NUMA node (OS index); -1 = first touch
  bool huge_pages = true;  // 2 MiB-aligned and madvise(MADV_HUGEPAGE) from 2 MiB up (false: 4 KiB pages)
};

// Raw page-aligned host allocations as described above. `device` must outlive it.
std::unique_ptr<RawAllocator> make_host_allocator(Device& device, HostMemoryOptions options);

// The CPU tier's pool (budget key tierzero.tiers.cpu_bytes).
Expected<std::unique_ptr<MemoryPool>> make_host_pool(Device& device, std::uint64_t budget_bytes,
                                                     HostMemoryOptions options);
// The device tier's pool (budget key tierzero.tiers.gpu_bytes), fed by
// device.allocate(). On the Host backend it holds host memory.
Expected<std::unique_ptr<MemoryPool>> make_device_pool(Device& device, std::uint64_t budget_bytes);

// The NUMA node `options` resolves to: an explicit node, else the device's
// nearest node, else -1. Errors name an out-of-range node.
Expected<int> resolve_numa_node(const Device& device, std::optional<int> configured);

}  // namespace tz
