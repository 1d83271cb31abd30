#include "tierzero/common/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>

#include "tierzero/common/handles.h"

namespace tz {
namespace {

// The directory that holds `path` ("." for a bare name).
std::string parent_dir(const std::string& path) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

Status fsync_fd(int fd, const std::string& path, std::string_view what) {
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return errno_status(errno, fmt::format("syncing {} {}", what, path));
  return ok_status();
}

}  // namespace

std::string durable_temp_path(const std::string& path) { return path + ".tmp"; }

Status write_all(int fd, const void* data, std::size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_status(errno, "writing " + path);
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return ok_status();
}

Status write_file_synced(const std::string& path, std::string_view bytes) {
  TZ_ASSIGN_OR_RETURN(UniqueFd fd, open_file(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC));
  TZ_TRY(write_all(fd.get(), bytes.data(), bytes.size(), path));
  TZ_TRY(fsync_fd(fd.get(), path, "the file"));
  return fd.close();
}

Status sync_directory(const std::string& dir) {
  TZ_ASSIGN_OR_RETURN(UniqueFd fd, open_file(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  TZ_TRY(fsync_fd(fd.get(), dir, "the directory"));
  return fd.close();
}

Status replace_file_durably(const std::string& temp_path, const std::string& path) {
  if (std::rename(temp_path.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp_path.c_str());
    return errno_status(err, fmt::format("renaming {} to {}", temp_path, path));
  }
  // The new content is in place; a failed directory sync only means the
  // rename might not survive a power loss, which the caller hears about.
  return sync_directory(parent_dir(path));
}

Status write_file_durably(const std::string& path, std::string_view bytes) {
  TZ_TRY(check_path(path, "write_file_durably"));
  const std::string temp = durable_temp_path(path);
  if (Status written = write_file_synced(temp, bytes); !written.ok()) {
    ::unlink(temp.c_str());  // a partial one, when it was created at all
    return written;
  }
  return replace_file_durably(temp, path);
}

}  // namespace tz
