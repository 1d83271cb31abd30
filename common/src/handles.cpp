#include "tierzero/common/handles.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "tierzero/common/checks.h"
#include "tierzero/common/log.h"

namespace tz {

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) {
    // Linux closes the descriptor even when close() reports EINTR: never retry.
    if (::close(fd_) != 0) TZ_LOG_WARN("common", "close(fd {}) failed: errno {}", fd_, errno);
  }
  fd_ = fd;
}

Status UniqueFd::close() {
  if (fd_ < 0) return ok_status();
  int fd = release();
  if (::close(fd) != 0 && errno != EINTR) return errno_status(errno, fmt::format("close(fd {})", fd));
  return ok_status();
}

Status check_path(const std::string& path, std::string_view what) {
  if (path.empty()) return invalid_argument("{}: the path is empty", what);
  if (const auto nul = path.find('\0'); nul != std::string::npos) {
    return invalid_argument("{}: the path '{}' has a NUL character at {}", what, path.substr(0, nul), nul);
  }
  return ok_status();
}

Expected<UniqueFd> open_file(const std::string& path, int flags, mode_t mode) {
  TZ_TRY(check_path(path, "open"));
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return errno_status(errno, fmt::format("open {}", path));
  return UniqueFd(fd);
}

void MappedRegion::reset() {
  if (addr_ != nullptr && ::munmap(addr_, size_bytes_) != 0) {
    TZ_LOG_WARN("common", "munmap({} bytes) failed: errno {}", size_bytes_, errno);
  }
  addr_ = nullptr;
  size_bytes_ = 0;
}

}  // namespace tz
