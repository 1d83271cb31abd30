#include "tierzero/offload/device.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <limits>

#include "device_internal.h"

namespace tz {

std::string_view backend_name(BackendKind kind) { return kind == BackendKind::kCuda ? "cuda" : "host"; }

std::string memlock_advice(std::size_t requested_bytes) {
  std::uint64_t limit = memlock_limit_bytes();
  std::string limit_text =
      limit == std::numeric_limits<std::uint64_t>::max() ? "unlimited" : format_bytes(limit);
  return fmt::format(
      "pinning {} needs RLIMIT_MEMLOCK of at least that; the limit is {} and this process {} "
      "CAP_IPC_LOCK. Raise it (`ulimit -l unlimited`, `memlock` in /etc/security/limits.conf, "
      "LimitMEMLOCK= for systemd, `--ulimit memlock=-1` for docker), or set "
      "zero_optimization.offload_param/offload_optimizer.pin_memory to false, or lower "
      "tierzero.tiers.cpu_bytes",
      format_bytes(requested_bytes), limit_text, has_cap_ipc_lock() ? "has" : "lacks");
}

// Note [mlock through syscall]: AddressSanitizer intercepts mlock/munlock and
// turns them into no-ops, which would make the sanitizer build test a pinned
// tier that is not pinned. The raw system calls lock pages in every build.
Status lock_host_pages(void* h_ptr, std::size_t bytes) {
  if (::syscall(SYS_mlock, h_ptr, bytes) == 0) return ok_status();
  int err = errno;
  Status status = errno_status(err, fmt::format("mlock({})", format_bytes(bytes)));
  if (err != ENOMEM && err != EPERM && err != EAGAIN) return status;
  return Status(status.code(), fmt::format("{}; {}", status.message(), memlock_advice(bytes)), err);
}

Status unlock_host_pages(void* h_ptr, std::size_t bytes) {
  TZ_SYSCALL_CHECK(::syscall(SYS_munlock, h_ptr, bytes));  // see Note [mlock through syscall]
  return ok_status();
}

Expected<std::unique_ptr<Device>> create_device(const DeviceOptions& options) {
  const CudaCapabilities& cuda = capabilities().cuda;
  switch (options.backend) {
    case BackendChoice::kHost:
      return create_host_device();
    case BackendChoice::kCuda:
#if defined(TIERZERO_WITH_CUDA)
      if (cuda.device_count > options.ordinal) return create_cuda_device(options.ordinal);
#endif
      return unavailable("tierzero.backend is 'cuda' but CUDA device {} is not usable: {}", options.ordinal,
                         cuda.compiled ? fmt::format("{} device(s), {}", cuda.device_count, cuda.status)
                                       : cuda.status);
    case BackendChoice::kAuto:
      break;
  }
#if defined(TIERZERO_WITH_CUDA)
  if (cuda.device_count > options.ordinal) return create_cuda_device(options.ordinal);
#endif
  TZ_LOG_ONCE_INFO("offload", "no usable CUDA device ({}); using the Host backend", cuda.status);
  return create_host_device();
}

}  // namespace tz
