// The capability probe: what this machine and process can do, asked once.
//
// capabilities() probes on first call (thread-safe) and caches the answer for
// the life of the process: io_uring and the opcodes tierzero uses, CPU SIMD
// level, NUMA nodes (hwloc), memory and the memlock limit, CUDA devices. A
// missing capability is a normal answer (no GPU: device_count 0 with the
// reason), never an error. probe_path() checks one directory for the NVMe tier:
// file system, block device, free space, and whether O_DIRECT really bypasses
// the page cache and with what alignment (tmpfs accepts the flag but does not).
//
// `tierzero-info` prints all of it (`--json` for a machine-readable copy).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tierzero/common/status.h"

namespace tz {

struct UringCapabilities {
  bool available = false;
  std::string unavailable_reason;       // why not, when !available (errno text)
  std::uint32_t features = 0;           // io_uring_params.features
  bool has_op_read = false;             // IORING_OP_READ
  bool has_op_write = false;
  bool has_op_read_fixed = false;
  bool has_op_write_fixed = false;
  bool has_op_fsync = false;
  bool has_op_fallocate = false;
  std::vector<std::string> missing_ops; // opcodes tierzero would use but the kernel lacks
};

struct CpuCapabilities {
  std::string model;
  int logical_cpus = 0;
  bool sse4_2 = false, avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false;
  bool avx512_bf16 = false, avx512_fp16 = false;
  std::string best_simd;                // the widest xsimd architecture this CPU runs, e.g. "avx512bw"
};

struct NumaNode {
  int os_index = 0;
  std::vector<int> cpus;                // OS indices of its processing units
  std::uint64_t memory_bytes = 0;       // local memory
};

struct MemoryCapabilities {
  std::uint64_t total_bytes = 0;        // MemTotal
  std::uint64_t available_bytes = 0;    // MemAvailable at probe time
  std::uint64_t memlock_limit_bytes = 0;  // RLIMIT_MEMLOCK soft limit; UINT64_MAX = unlimited
  bool cap_ipc_lock = false;            // CAP_IPC_LOCK in the effective set: the limit does not apply
  // /sys/kernel/mm/transparent_hugepage/enabled, the bracketed choice:
  // "always", "madvise" or "never"; "" where the kernel offers none.
  std::string transparent_hugepage;
};

struct GpuDevice {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;       // compute capability
  std::uint64_t total_memory_bytes = 0;
  std::string pci_bus_id;               // "0000:17:00.0"
  int numa_node = -1;                   // nearest NUMA node, -1 unknown
};

struct CudaCapabilities {
  bool compiled = false;                // built with TIERZERO_CUDA
  int device_count = 0;
  std::string status;                   // "ok", or why there are no devices
  int driver_version = 0;               // e.g. 13000; 0 without a driver
  int runtime_version = 0;
  std::vector<GpuDevice> devices;
};

struct Capabilities {
  std::string kernel_release;           // uname -r
  UringCapabilities uring;
  CpuCapabilities cpu;
  std::vector<NumaNode> numa_nodes;     // at least one (the machine) when hwloc works
  std::string numa_error;               // hwloc failure, if any
  MemoryCapabilities memory;
  CudaCapabilities cuda;
};

// Probed once per process, then cached. Thread-safe.
const Capabilities& capabilities();
// A fresh probe, uncached (tests, tierzero-info --refresh).
Capabilities probe_capabilities();

struct PathCapabilities {
  std::string path;
  std::string filesystem;               // "ext4", "xfs", "tmpfs", ... ("unknown(0x...)")
  std::string device;                   // block device ("nvme0n1", "vda"), "" when none
  std::uint64_t total_bytes = 0;
  std::uint64_t free_bytes = 0;         // available to this user
  bool o_direct_accepted = false;       // open(O_DIRECT) succeeded
  bool o_direct = false;                // real direct I/O: accepted and bypasses the page cache
  std::uint32_t dio_mem_align = 0;      // required buffer alignment, bytes (0 without o_direct)
  std::uint32_t dio_offset_align = 0;   // required offset/length alignment, bytes
  std::string note;                     // e.g. "tmpfs: O_DIRECT is accepted but data stays in memory"
};

// Probes a directory that must exist and be writable (it creates and removes
// one small temporary file). Cached per path for the process; errors (missing,
// not a directory, not writable) name the path.
Expected<PathCapabilities> probe_path(const std::string& directory);

// Human-readable multi-line summaries (what tierzero-info prints).
std::string describe(const Capabilities& caps);
std::string describe(const PathCapabilities& path);

namespace detail {
// What probe_path() falls back to on kernels without STATX_DIOALIGN (< 6.1):
// the smallest offset/length alignment and buffer alignment, each one of 512,
// 1024, 2048 or 4096 bytes, at which pwrite and pread on `fd` (an O_DIRECT
// file it may overwrite) succeed. Exposed for tests.
Status measure_dio_alignment(int fd, std::uint32_t* mem_align, std::uint32_t* offset_align);
}  // namespace detail

}  // namespace tz
