// Live readings of the process's memory situation (not cached, unlike the
// probe): what the pools check before they allocate or pin.
#pragma once

#include <cstdint>

#include "tierzero/common/status.h"

namespace tz {

struct HostMemoryReading {
  std::uint64_t total_bytes = 0;      // MemTotal
  std::uint64_t available_bytes = 0;  // MemAvailable
};

// /proc/meminfo now.
Expected<HostMemoryReading> read_host_memory();
// RLIMIT_MEMLOCK soft limit in bytes; UINT64_MAX when unlimited.
std::uint64_t memlock_limit_bytes();
// Bytes this process has locked now (VmLck in /proc/self/status).
std::uint64_t locked_bytes();
// CAP_IPC_LOCK in this process's effective set (then RLIMIT_MEMLOCK does not apply).
bool has_cap_ipc_lock();

}  // namespace tz
