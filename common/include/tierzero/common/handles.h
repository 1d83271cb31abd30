// Move-only RAII owners for OS handles, and Cleanup for multi-step setup.
//
//   TZ_ASSIGN_OR_RETURN(tz::UniqueFd fd, tz::open_file(path, O_RDWR | O_DIRECT));
//   tz::Cleanup unlink_on_error([&] { ::unlink(path.c_str()); });
//   TZ_TRY(size_file(fd.get(), bytes));
//   unlink_on_error.cancel();   // success: keep the file
//
// Ownership: each type closes/frees what it holds exactly once, in its
// destructor or on reset(); release() hands the raw handle back to the caller.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <string>
#include <utility>

#include "tierzero/common/status.h"

namespace tz {

// An owned file descriptor (-1 when empty). close() errors at destruction are
// logged, not lost; call close() explicitly where the result matters.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);
  // Closes now and reports the result (EIO on close is a lost write).
  Status close();

 private:
  int fd_ = -1;
};

// open(2) with EINTR retry; the error names the path.
Expected<UniqueFd> open_file(const std::string& path, int flags, mode_t mode = 0644);
// A path the system can take as given: not empty, no NUL character (which
// would cut it short, so another file would be used). The error names `what`.
Status check_path(const std::string& path, std::string_view what);

// An owned anonymous or file mapping (munmap on destruction).
class MappedRegion {
 public:
  MappedRegion() = default;
  MappedRegion(void* addr, size_t size_bytes) : addr_(addr), size_bytes_(size_bytes) {}
  ~MappedRegion() { reset(); }
  MappedRegion(MappedRegion&& other) noexcept
      : addr_(std::exchange(other.addr_, nullptr)), size_bytes_(std::exchange(other.size_bytes_, 0)) {}
  MappedRegion& operator=(MappedRegion&& other) noexcept {
    if (this != &other) {
      reset();
      addr_ = std::exchange(other.addr_, nullptr);
      size_bytes_ = std::exchange(other.size_bytes_, 0);
    }
    return *this;
  }
  MappedRegion(const MappedRegion&) = delete;
  MappedRegion& operator=(const MappedRegion&) = delete;

  void* data() const { return addr_; }
  size_t size_bytes() const { return size_bytes_; }
  // Gives up ownership without unmapping; returns the address.
  void* release() {
    size_bytes_ = 0;
    return std::exchange(addr_, nullptr);
  }
  void reset();

 private:
  void* addr_ = nullptr;
  size_t size_bytes_ = 0;
};

// Runs a callable at scope exit unless cancel()ed (abseil's Cleanup).
class Cleanup {
 public:
  explicit Cleanup(std::function<void()> fn) : fn_(std::move(fn)) {}
  ~Cleanup() {
    if (fn_) fn_();
  }
  Cleanup(Cleanup&& other) noexcept : fn_(std::exchange(other.fn_, nullptr)) {}
  Cleanup& operator=(Cleanup&&) = delete;
  Cleanup(const Cleanup&) = delete;
  Cleanup& operator=(const Cleanup&) = delete;
  void cancel() { fn_ = nullptr; }

 private:
  std::function<void()> fn_;
};

}  // namespace tz
