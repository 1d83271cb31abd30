// The machine-wide half of the capability probe: kernel, io_uring, CPU, NUMA,
// memory, CUDA. probe_paths.cpp holds the per-directory half.
//
// Every probe_* function here returns an answer, never an error: a missing
// capability (no io_uring under seccomp, no GPU, hwloc failing) is recorded
// with its reason in the struct, because callers decide what they can do
// without it.
#if defined(TIERZERO_WITH_CUDA)
#include <cuda_runtime.h>  // before checks.h, so TZ_CUDA_CHECK exists
#endif

#include "tierzero/common/probe.h"

#include <fmt/ranges.h>
#include <hwloc.h>
#include <liburing.h>
#include <sys/resource.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string_view>
#include <thread>
#include <xsimd/xsimd.hpp>

#include "tierzero/common/checks.h"
#include "tierzero/common/handles.h"
#include "tierzero/common/log.h"
#include "tierzero/common/sysinfo.h"
#include "tierzero/common/units.h"

namespace tz {
namespace {

std::optional<std::string> read_text_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// The value after "key:" on the first line that starts with `key` in a
// /proc file of "key: value" lines (cpuinfo, meminfo, status).
std::optional<std::string> proc_field(const std::string& text, std::string_view key) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    std::string_view view(line);
    if (!view.starts_with(key)) continue;
    auto colon = view.find(':');
    if (colon == std::string_view::npos || trim(view.substr(0, colon)) != key) continue;
    return std::string(trim(view.substr(colon + 1)));
  }
  return std::nullopt;
}

std::string probe_kernel_release() {
  struct utsname name {};
  if (::uname(&name) != 0) return "unknown";
  return name.release;
}

// --- io_uring ---------------------------------------------------------------

struct ProbeDeleter {
  void operator()(io_uring_probe* probe) const { io_uring_free_probe(probe); }
};

void record_opcodes(const io_uring_probe* probe, UringCapabilities& uring) {
  struct Op {
    int opcode;
    const char* name;
    bool UringCapabilities::*field;
  };
  static constexpr Op kOps[] = {
      {IORING_OP_READ, "READ", &UringCapabilities::has_op_read},
      {IORING_OP_WRITE, "WRITE", &UringCapabilities::has_op_write},
      {IORING_OP_READ_FIXED, "READ_FIXED", &UringCapabilities::has_op_read_fixed},
      {IORING_OP_WRITE_FIXED, "WRITE_FIXED", &UringCapabilities::has_op_write_fixed},
      {IORING_OP_FSYNC, "FSYNC", &UringCapabilities::has_op_fsync},
      {IORING_OP_FALLOCATE, "FALLOCATE", &UringCapabilities::has_op_fallocate},
  };
  for (const Op& op : kOps) {
    // No probe at all means a kernel before 5.6, which also lacks READ/WRITE.
    bool present = probe != nullptr && io_uring_opcode_supported(probe, op.opcode);
    uring.*op.field = present;
    if (!present) uring.missing_ops.emplace_back(op.name);
  }
}

UringCapabilities probe_uring() {
  UringCapabilities uring;
  io_uring ring{};
  io_uring_params params{};
  int rc = io_uring_queue_init_params(8, &ring, &params);
  if (rc < 0) {
    // EPERM under a seccomp filter or io_uring_disabled=2, ENOSYS before 5.1.
    uring.unavailable_reason = errno_status(-rc, "io_uring_queue_init").message();
    record_opcodes(nullptr, uring);
    return uring;
  }
  Cleanup exit_ring([&ring] { io_uring_queue_exit(&ring); });
  uring.available = true;
  uring.features = params.features;
  std::unique_ptr<io_uring_probe, ProbeDeleter> probe(io_uring_get_probe_ring(&ring));
  record_opcodes(probe.get(), uring);
  return uring;
}

// --- CPU --------------------------------------------------------------------

// The name xsimd gives the architecture with version `best` ("fma3+avx2",
// "avx512bw", ...): what an xsimd::dispatch over every architecture picks.
std::string xsimd_arch_name(unsigned best) {
  std::string name = "scalar";
  xsimd::all_architectures::for_each([&](auto arch) {
    if (decltype(arch)::version() == best) name = decltype(arch)::name();
  });
  return name;
}

// Flags-only fallback in the same order xsimd ranks them, for the rare case
// where CPUID advertises AVX-512 but the OS does not save its state (then
// __builtin_cpu_supports says no and so must we).
std::string best_simd_from_flags(const CpuCapabilities& cpu) {
  if (cpu.avx512bw) return "avx512bw";
  if (cpu.avx512f) return "avx512f";
  if (cpu.avx2 && cpu.fma) return "fma3+avx2";
  if (cpu.avx2) return "avx2";
  if (cpu.sse4_2) return "sse4.2";
  return "scalar";
}

void probe_cpu_flags(CpuCapabilities& cpu) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  cpu.sse4_2 = __builtin_cpu_supports("sse4.2");
  cpu.avx2 = __builtin_cpu_supports("avx2");
  cpu.fma = __builtin_cpu_supports("fma");
  cpu.f16c = __builtin_cpu_supports("f16c");
  cpu.avx512f = __builtin_cpu_supports("avx512f");
  cpu.avx512bw = __builtin_cpu_supports("avx512bw");
  cpu.avx512vl = __builtin_cpu_supports("avx512vl");
  cpu.avx512_bf16 = __builtin_cpu_supports("avx512bf16");
  cpu.avx512_fp16 = __builtin_cpu_supports("avx512fp16");
#else
  (void)cpu;
#endif
}

CpuCapabilities probe_cpu() {
  CpuCapabilities cpu;
  auto cpuinfo = read_text_file("/proc/cpuinfo");
  if (cpuinfo) cpu.model = proc_field(*cpuinfo, "model name").value_or("");
  if (cpu.model.empty()) cpu.model = "unknown CPU";
  long online = ::sysconf(_SC_NPROCESSORS_ONLN);
  cpu.logical_cpus = online > 0 ? static_cast<int>(online)
                                : static_cast<int>(std::thread::hardware_concurrency());
  probe_cpu_flags(cpu);

  cpu.best_simd = xsimd_arch_name(xsimd::available_architectures().best);
  bool xsimd_says_avx512 = cpu.best_simd.starts_with("avx512");
  bool xsimd_says_avx2 = cpu.best_simd.find("avx2") != std::string::npos;
  if ((xsimd_says_avx512 && !cpu.avx512f) || (xsimd_says_avx2 && !cpu.avx2)) {
    TZ_LOG_DEBUG("common", "xsimd picks {} but the OS does not enable it; reporting {}",
                 cpu.best_simd, best_simd_from_flags(cpu));
    cpu.best_simd = best_simd_from_flags(cpu);
  }
  return cpu;
}

// --- NUMA -------------------------------------------------------------------

struct TopologyDeleter {
  void operator()(hwloc_topology* topology) const { hwloc_topology_destroy(topology); }
};
using Topology = std::unique_ptr<hwloc_topology, TopologyDeleter>;

void probe_numa(Capabilities& caps) {
  hwloc_topology_t raw = nullptr;
  if (hwloc_topology_init(&raw) != 0) {
    caps.numa_error = errno_status(errno, "hwloc_topology_init").message();
    return;
  }
  Topology topology(raw);
  if (hwloc_topology_load(topology.get()) != 0) {
    caps.numa_error = errno_status(errno, "hwloc_topology_load").message();
    return;
  }
  int count = hwloc_get_nbobjs_by_type(topology.get(), HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < count; ++i) {
    hwloc_obj_t obj = hwloc_get_obj_by_type(topology.get(), HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
    if (obj == nullptr) continue;
    NumaNode node;
    node.os_index = static_cast<int>(obj->os_index);
    node.memory_bytes = obj->attr != nullptr ? obj->attr->numanode.local_memory : 0;
    if (obj->cpuset != nullptr) {
      unsigned pu = 0;
      hwloc_bitmap_foreach_begin(pu, obj->cpuset) {
        node.cpus.push_back(static_cast<int>(pu));
      }
      hwloc_bitmap_foreach_end();
    }
    caps.numa_nodes.push_back(std::move(node));
  }
  if (caps.numa_nodes.empty()) caps.numa_error = "hwloc found no NUMA node";
}

// --- memory -----------------------------------------------------------------

MemoryCapabilities probe_memory() {
  MemoryCapabilities memory;
  if (Expected<HostMemoryReading> reading = read_host_memory(); reading.ok()) {
    memory.total_bytes = reading->total_bytes;
    memory.available_bytes = reading->available_bytes;
  }
  memory.memlock_limit_bytes = memlock_limit_bytes();
  memory.cap_ipc_lock = has_cap_ipc_lock();
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (thp && std::getline(thp, line)) {  // "always [madvise] never"
    const std::size_t open = line.find('['), close = line.find(']');
    if (open != std::string::npos && close != std::string::npos && close > open) {
      memory.transparent_hugepage = line.substr(open + 1, close - open - 1);
    }
  }
  return memory;
}

// --- CUDA -------------------------------------------------------------------

#if defined(TIERZERO_WITH_CUDA)
int pci_numa_node(std::string bus_id) {
  std::transform(bus_id.begin(), bus_id.end(), bus_id.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  auto text = read_text_file("/sys/bus/pci/devices/" + bus_id + "/numa_node");
  if (!text) return -1;
  return std::atoi(text->c_str());  // the kernel writes -1 when it does not know
}

Status probe_cuda_device(int index, GpuDevice& device) {
  cudaDeviceProp prop{};
  TZ_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  device.index = index;
  device.name = prop.name;
  device.cc_major = prop.major;
  device.cc_minor = prop.minor;
  device.total_memory_bytes = prop.totalGlobalMem;
  char bus_id[32] = {};
  TZ_CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), index));
  device.pci_bus_id = bus_id;
  device.numa_node = pci_numa_node(device.pci_bus_id);
  return ok_status();
}

Status probe_cuda_devices(CudaCapabilities& cuda) {
  cudaError_t err = cudaGetDeviceCount(&cuda.device_count);
  if (err != cudaSuccess) {
    // The usual answer on a machine without a GPU; say it plainly.
    (void)cudaGetLastError();
    return unavailable("{} ({})", cudaGetErrorString(err), cudaGetErrorName(err));
  }
  for (int i = 0; i < cuda.device_count; ++i) {
    GpuDevice device;
    TZ_TRY_CTX(probe_cuda_device(i, device), "CUDA device {}", i);
    cuda.devices.push_back(std::move(device));
  }
  return ok_status();
}
#endif

CudaCapabilities probe_cuda() {
  CudaCapabilities cuda;
#if defined(TIERZERO_WITH_CUDA)
  cuda.compiled = true;
  // Both succeed without a driver (the driver version is then 0).
  if (cudaDriverGetVersion(&cuda.driver_version) != cudaSuccess) cuda.driver_version = 0;
  if (cudaRuntimeGetVersion(&cuda.runtime_version) != cudaSuccess) cuda.runtime_version = 0;
  Status status = probe_cuda_devices(cuda);
  if (status.ok()) {
    cuda.status = cuda.device_count > 0 ? "ok" : "no CUDA device";
  } else if (cuda.driver_version == 0) {
    // No libcuda.so at all: the runtime then reports an "insufficient" driver
    // (cudaErrorInsufficientDriver), which reads as if one were installed but old.
    cuda.status = fmt::format("no CUDA driver (no NVIDIA driver is installed or visible here; the runtime says: {})",
                              status.message());
    cuda.device_count = 0;
    cuda.devices.clear();
  } else {
    // No device is an answer, not an error.
    cuda.status = status.message();
    cuda.device_count = 0;
    cuda.devices.clear();
  }
  (void)cudaGetLastError();
#else
  cuda.status = "built without CUDA (-DTIERZERO_CUDA=OFF)";
#endif
  return cuda;
}

// --- describe ---------------------------------------------------------------

// {0,1,2,3,6} -> "0-3,6"
std::string cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? fmt::format("{}", cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

std::string describe_uring(const UringCapabilities& uring) {
  if (!uring.available) return fmt::format("io_uring: unavailable ({})", uring.unavailable_reason);
  std::string ops = uring.missing_ops.empty() ? "all present"
                                              : fmt::format("missing {}", fmt::join(uring.missing_ops, ", "));
  return fmt::format("io_uring: available (features 0x{:x}), opcodes: {}", uring.features, ops);
}

std::string describe_cpu(const CpuCapabilities& cpu) {
  std::vector<std::string> flags, avx512;
  if (cpu.sse4_2) flags.emplace_back("sse4.2");
  if (cpu.avx2) flags.emplace_back("avx2");
  if (cpu.fma) flags.emplace_back("fma");
  if (cpu.f16c) flags.emplace_back("f16c");
  if (cpu.avx512f) avx512.emplace_back("f");
  if (cpu.avx512bw) avx512.emplace_back("bw");
  if (cpu.avx512vl) avx512.emplace_back("vl");
  if (cpu.avx512_bf16) avx512.emplace_back("bf16");
  if (cpu.avx512_fp16) avx512.emplace_back("fp16");
  return fmt::format("CPU: {}, {} logical CPU{}, SIMD: {} (flags: {}; avx512: {})", cpu.model,
                     cpu.logical_cpus, cpu.logical_cpus == 1 ? "" : "s", cpu.best_simd,
                     flags.empty() ? "none" : fmt::format("{}", fmt::join(flags, " ")),
                     avx512.empty() ? "no" : fmt::format("{}", fmt::join(avx512, " ")));
}

std::string describe_numa(const Capabilities& caps) {
  if (caps.numa_nodes.empty()) return fmt::format("NUMA: unknown ({})", caps.numa_error);
  std::vector<std::string> nodes;
  for (const NumaNode& node : caps.numa_nodes) {
    nodes.push_back(fmt::format("node{} cpus {} {}", node.os_index, cpu_list(node.cpus),
                                format_bytes(node.memory_bytes)));
  }
  return fmt::format("NUMA: {} node{}: {}", nodes.size(), nodes.size() == 1 ? "" : "s",
                     fmt::join(nodes, "; "));
}

std::string describe_memory(const MemoryCapabilities& memory) {
  bool unlimited = memory.memlock_limit_bytes == std::numeric_limits<std::uint64_t>::max();
  std::string limit = unlimited ? "unlimited" : format_bytes(memory.memlock_limit_bytes);
  std::string cap = memory.cap_ipc_lock ? (unlimited ? "yes" : "yes, limit does not apply") : "no";
  return fmt::format("memory: {} total, {} available, memlock limit {} (CAP_IPC_LOCK: {}), transparent huge "
                     "pages: {}", format_bytes(memory.total_bytes), format_bytes(memory.available_bytes), limit,
                     cap, memory.transparent_hugepage.empty() ? "not offered" : memory.transparent_hugepage);
}

std::string cuda_version(int version) {
  if (version == 0) return "none";
  return fmt::format("{}.{}", version / 1000, version % 1000 / 10);
}

std::string describe_cuda(const CudaCapabilities& cuda) {
  if (!cuda.compiled) return fmt::format("CUDA: {}", cuda.status);
  std::string out = fmt::format("CUDA: {} device{} ({}); runtime {}, driver {}", cuda.device_count,
                                cuda.device_count == 1 ? "" : "s", cuda.status,
                                cuda_version(cuda.runtime_version), cuda_version(cuda.driver_version));
  for (const GpuDevice& d : cuda.devices) {
    out += fmt::format("\n  gpu{}: {}, sm_{}{}, {}, PCI {}, NUMA node {}", d.index, d.name,
                       d.cc_major, d.cc_minor, format_bytes(d.total_memory_bytes), d.pci_bus_id,
                       d.numa_node < 0 ? std::string("unknown") : std::to_string(d.numa_node));
  }
  return out;
}

}  // namespace

Capabilities probe_capabilities() {
  Capabilities caps;
  caps.kernel_release = probe_kernel_release();
  caps.uring = probe_uring();
  caps.cpu = probe_cpu();
  probe_numa(caps);
  caps.memory = probe_memory();
  caps.cuda = probe_cuda();
  TZ_LOG_DEBUG("common", "capabilities probed:\n{}", describe(caps));
  return caps;
}

const Capabilities& capabilities() {
  // C++11 guarantees one initialisation even when threads race to the first call.
  static const Capabilities caps = probe_capabilities();
  return caps;
}

std::string describe(const Capabilities& caps) {
  std::string out = fmt::format("kernel: {}\n", caps.kernel_release);
  out += describe_uring(caps.uring) + "\n";
  out += describe_cpu(caps.cpu) + "\n";
  out += describe_numa(caps) + "\n";
  out += describe_memory(caps.memory) + "\n";
  out += describe_cuda(caps.cuda) + "\n";
  return out;
}

}  // namespace tz
