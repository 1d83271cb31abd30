#include "tierzero/common/sysinfo.h"

#include <sys/resource.h>

#include <cstdint>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

namespace tz {

Expected<HostMemoryReading> read_host_memory() {
  std::ifstream in("/proc/meminfo");
  if (!in) return unavailable("cannot read /proc/meminfo");
  HostMemoryReading reading;
  std::string key;
  std::uint64_t value_kib = 0;
  std::string unit;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    if (!(fields >> key >> value_kib)) continue;
    if (key == "MemTotal:") reading.total_bytes = value_kib * 1024;
    if (key == "MemAvailable:") reading.available_bytes = value_kib * 1024;
  }
  if (reading.total_bytes == 0) return unavailable("/proc/meminfo has no MemTotal line");
  return reading;
}

std::uint64_t memlock_limit_bytes() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_MEMLOCK, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return std::numeric_limits<std::uint64_t>::max();
  }
  return limit.rlim_cur;
}

std::uint64_t locked_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) * 1024;  // "VmLck:  1234 kB"
  }
  return 0;
}

bool has_cap_ipc_lock() {
  constexpr int kCapIpcLock = 14;  // linux/capability.h
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("CapEff:", 0) == 0) {
      std::uint64_t mask = std::stoull(line.substr(7), nullptr, 16);
      return (mask >> kCapIpcLock) & 1U;
    }
  }
  return false;
}

}  // namespace tz
