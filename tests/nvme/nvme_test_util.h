// Helpers for the nvme tests: temporary directories, aligned random buffers,
// and fault injectors.
#pragma once

#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tierzero/nvme.h"

namespace tzt {

// A fresh directory under $TMPDIR (default /tmp), removed with its contents.
class TempDir {
 public:
  explicit TempDir(const std::string& parent = "") {
    std::string base = parent;
    if (base.empty()) {
      const char* env = std::getenv("TMPDIR");
      base = env != nullptr && *env != '\0' ? env : "/tmp";
    }
    std::string templ = base + "/tierzero-test-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) std::abort();
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  // Every file below the directory, relative to it, sorted: what a run left
  // behind (the fault suite asserts there is nothing unexpected).
  std::vector<std::string> files() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::recursive_directory_iterator(path_)) {
      if (!e.is_directory()) names.push_back(std::filesystem::relative(e.path(), path_).string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::string path_;
};

// 4 KiB-aligned bytes.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(std::size_t bytes, std::size_t align = 4096)
      : bytes_(bytes), data_(static_cast<std::uint8_t*>(std::aligned_alloc(align, round(bytes, align)))) {}
  std::uint8_t* data() const { return data_.get(); }
  std::size_t size() const { return bytes_; }
  void fill_random(std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::size_t i = 0;
    for (; i + 8 <= bytes_; i += 8) {
      const std::uint64_t x = rng();
      std::memcpy(data_.get() + i, &x, 8);
    }
    for (; i < bytes_; ++i) data_[i] = static_cast<std::uint8_t>(rng());
  }
  void fill(std::uint8_t value) { std::memset(data_.get(), value, bytes_); }
  bool same_as(const AlignedBuffer& other) const {
    return bytes_ == other.bytes_ && std::memcmp(data_.get(), other.data_.get(), bytes_) == 0;
  }

 private:
  static std::size_t round(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }
  struct Free {
    void operator()(std::uint8_t* p) const { std::free(p); }
  };
  std::size_t bytes_;
  std::unique_ptr<std::uint8_t[], Free> data_;
};

// Fails the submission with sequence number `nth` (0-based) with `error`.
inline tz::nvme::FaultInjector fail_nth(std::uint64_t nth, int error) {
  return [nth, error](const tz::nvme::PieceInfo& p) {
    return p.sequence == nth ? tz::nvme::Fault{.error = error} : tz::nvme::Fault{};
  };
}

// Runs `fn` for each backend this machine can run: io_uring (when the kernel
// allows it) and the thread pool.
inline std::vector<tz::nvme::IoBackend> runnable_backends() {
  std::vector<tz::nvme::IoBackend> out;
  if (tz::capabilities().uring.available) out.push_back(tz::nvme::IoBackend::kUring);
  out.push_back(tz::nvme::IoBackend::kThreads);
  return out;
}

// A real file system that fills up: an ext4 image of `mib` MiB (16 by
// default), loop-mounted. Needs root (CAP_SYS_ADMIN) and loop devices; tests
// skip, with the reason, without them.
class LoopMount {
 public:
  explicit LoopMount(const TempDir& dir, int mib = 16) : image_(dir.file("fs.img")), mount_(dir.file("mnt")) {
    if (::geteuid() != 0) {
      why_ = "not root: cannot loop-mount a small file system";
      return;
    }
    ::mkdir(mount_.c_str(), 0755);
    const std::string cmd = "truncate -s " + std::to_string(mib) + "M " + image_ + " && mkfs.ext4 -q -F " + image_ + " >/dev/null 2>&1 && mount -o loop " +
                            image_ + " " + mount_ + " 2>/dev/null";
    if (std::system(cmd.c_str()) != 0) {
      why_ = "loop mount refused here (no loop devices, or mkfs.ext4 missing)";
      return;
    }
    mounted_ = true;
  }
  ~LoopMount() {
    if (mounted_) ::umount2(mount_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& why_not() const { return why_; }
  const std::string& path() const { return mount_; }

 private:
  std::string image_, mount_, why_;
  bool mounted_ = false;
};

}  // namespace tzt
