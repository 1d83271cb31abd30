#include "nvme_bench_common.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <csignal>
#include <cstring>
#include <fstream>
#include <utility>

namespace tzbench {

tz::Expected<std::uint64_t> parse_size(const std::string& flag, const std::string& text) {
  // fio and dd read "128K" and "4G" as binary units; so do we. "4GB" stays SI
  // (tz::parse_bytes), "4GiB" is explicit.
  std::string spelled = text;
  if (!spelled.empty() && std::strchr("kKmMgGtT", spelled.back()) != nullptr) spelled += "iB";
  tz::Expected<std::uint64_t> bytes = tz::parse_bytes(spelled);
  if (!bytes.ok()) return tz::invalid_argument("{} '{}': {}", flag, text, bytes.status().message());
  return *bytes;
}

tz::Expected<std::vector<std::uint64_t>> parse_byte_list(const std::string& flag, const std::string& text) {
  std::vector<std::uint64_t> out;
  for (const std::string& item : split_list(text)) {
    TZ_ASSIGN_OR_RETURN(std::uint64_t bytes, parse_size(flag, item));
    out.push_back(bytes);
  }
  if (out.empty()) return tz::invalid_argument("{}: no sizes given (e.g. 128K,1M,8M)", flag);
  return out;
}

tz::Expected<std::vector<int>> parse_int_list(const std::string& flag, const std::string& text, int lo, int hi) {
  std::vector<int> out;
  for (const std::string& item : split_list(text)) {
    char* end = nullptr;
    errno = 0;
    const long value = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno != 0 || value < lo || value > hi) {
      return tz::invalid_argument("{}: '{}' is not a whole number in [{}, {}]", flag, item, lo, hi);
    }
    out.push_back(static_cast<int>(value));
  }
  if (out.empty()) return tz::invalid_argument("{}: no values given", flag);
  return out;
}

// ---------------------------------------------------------------- buffers

namespace {

// Note [First touch by pinning]: a registration with a throwaway engine
// faults every page in; where the kernel refuses (memlock), the pages are left
// to whoever touches them first, said once.
void fault_in_by_pinning(char* data, std::size_t bytes) {
  tz::Expected<std::unique_ptr<tz::nvme::IoEngine>> engine =
      tz::nvme::IoEngine::create({.queue_depth = 1, .rings = 1});
  if (!engine.ok()) {
    TZ_LOG_ONCE_WARN("bench", "no I/O engine to fault buffers in with ({}); they are first touched by the fill",
                     engine.status().message());
    return;
  }
  tz::Expected<std::vector<void*>> chunks = register_chunks(**engine, data, bytes, std::size_t{1} << 20);
  if (!chunks.ok()) {
    TZ_LOG_ONCE_WARN("bench", "faulting buffers in by pinning: {}; they are first touched by the fill",
                     chunks.status().message());
    return;
  }
  unregister_chunks(**engine, *chunks);
}

}  // namespace

tz::Expected<HostBuffer> HostBuffer::map(std::size_t bytes, bool hugepages) {
  constexpr std::size_t kAlign = std::size_t{2} << 20;
  const std::size_t used = tz::align_up(std::max<std::size_t>(bytes, 1), kAlign);
  const std::size_t mapped = used + kAlign;  // room to align the start
  void* base = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return tz::errno_status(errno, fmt::format("mmap of {}", tz::format_bytes(bytes)));
  HostBuffer b;
  b.region_ = tz::MappedRegion(base, mapped);
  b.data_ = reinterpret_cast<char*>(tz::align_up(reinterpret_cast<std::uintptr_t>(base), kAlign));
  b.bytes_ = bytes;
  if (hugepages && ::madvise(b.data_, used, MADV_HUGEPAGE) != 0) {
    TZ_LOG_ONCE_WARN("bench", "madvise(MADV_HUGEPAGE): {}; buffers stay on small pages", std::strerror(errno));
  }
  if (!hugepages) fault_in_by_pinning(b.data_, used);
  return b;
}



void HostBuffer::fill_random(std::uint64_t seed) {
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
  auto* words = reinterpret_cast<std::uint64_t*>(data());
  for (std::size_t i = 0; i < bytes_ / 8; ++i) {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    words[i] = s * 0x2545F4914F6CDD1DULL;
  }
}

tz::Expected<std::vector<void*>> register_chunks(tz::nvme::IoEngine& engine, char* data, std::size_t bytes,
                                                 std::size_t unit) {
  const std::size_t chunk = std::max(unit, kMaxFixedBufferBytes / unit * unit);
  if (chunk > kMaxFixedBufferBytes) {
    TZ_LOG_WARN("bench", "a request of {} is larger than one fixed buffer may be ({}); not registering",
                tz::format_bytes(unit), tz::format_bytes(kMaxFixedBufferBytes));
    return std::vector<void*>{};
  }
  std::vector<void*> chunks;
  for (std::size_t at = 0; at < bytes; at += chunk) {
    TZ_TRY(engine.register_buffer(data + at, std::min(chunk, bytes - at)));
    chunks.push_back(data + at);
  }
  return chunks;
}

void unregister_chunks(tz::nvme::IoEngine& engine, const std::vector<void*>& chunks) {
  for (void* c : chunks) engine.unregister_buffer(c).ignore_error();  // only fails for unknown memory
}

// ---------------------------------------------------------------- cleanup

namespace {

constexpr std::size_t kMaxCleanupPaths = 64;
constexpr std::size_t kMaxPathChars = 4096;
// Written by the main thread before it is published through `used`; read by
// the signal handler, which only calls unlink (async-signal-safe).
std::array<std::array<char, kMaxPathChars>, kMaxCleanupPaths> g_cleanup_paths{};
std::array<std::atomic<bool>, kMaxCleanupPaths> g_cleanup_used{};

extern "C" void cleanup_on_signal(int sig) {
  for (std::size_t i = 0; i < kMaxCleanupPaths; ++i) {
    if (g_cleanup_used[i].load()) ::unlink(g_cleanup_paths[i].data());
  }
  ::_exit(128 + sig);
}

}  // namespace

void install_signal_cleanup() {
  struct sigaction sa {};
  sa.sa_handler = cleanup_on_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGHUP, &sa, nullptr);
}

void add_cleanup_path(const std::string& path) {
  if (path.size() >= kMaxPathChars) return;
  for (std::size_t i = 0; i < kMaxCleanupPaths; ++i) {
    if (g_cleanup_used[i].load()) continue;
    std::memcpy(g_cleanup_paths[i].data(), path.c_str(), path.size() + 1);
    g_cleanup_used[i].store(true);
    return;
  }
}

void remove_cleanup_path(const std::string& path) {
  for (std::size_t i = 0; i < kMaxCleanupPaths; ++i) {
    if (g_cleanup_used[i].load() && path == g_cleanup_paths[i].data()) g_cleanup_used[i].store(false);
  }
}

// ---------------------------------------------------------------- scratch files

tz::Status check_free_space(const std::string& dir, std::uint64_t need_bytes, const std::string& what) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) return tz::errno_status(errno, fmt::format("statvfs {}", dir));
  const std::uint64_t free_bytes = static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize;
  if (need_bytes > free_bytes) {
    return tz::Status(tz::ErrorCode::kNoSpace,
                      fmt::format("{}: needs {} ({} bytes) for {}, but only {} is free there; give a smaller --size "
                                  "(or --swap-size), or a --path with more room",
                                  dir, tz::format_bytes(need_bytes), need_bytes, what, tz::format_bytes(free_bytes)));
  }
  return tz::ok_status();
}

tz::Expected<ScratchFiles> ScratchFiles::create(const std::vector<std::string>& dirs, std::uint64_t file_bytes,
                                                const std::string& tag) {
  static int counter = 0;
  ScratchFiles files;  // removes what it holds if a later step fails
  files.file_bytes_ = file_bytes;
  for (const std::string& dir : dirs) {
    const std::string path = fmt::format("{}/tierzero-nvme-bench-{}-{}-{}.bin", dir, ::getpid(), tag, counter++);
    TZ_ASSIGN_OR_RETURN(tz::UniqueFd fd, tz::open_file(path, O_RDWR | O_CREAT | O_EXCL));
    add_cleanup_path(path);
    files.paths_.push_back(path);
    int rc = 0;
    do {
      rc = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(file_bytes));
    } while (rc == EINTR);
    if (rc != 0) {
      return tz::errno_status(rc, fmt::format("reserving {} for {}", tz::format_bytes(file_bytes), path));
    }
    TZ_TRY_CTX(fd.close(), "closing {}", path);
  }
  return files;
}

ScratchFiles::ScratchFiles(ScratchFiles&& other) noexcept
    : paths_(std::exchange(other.paths_, {})), file_bytes_(other.file_bytes_) {}

ScratchFiles& ScratchFiles::operator=(ScratchFiles&& other) noexcept {
  if (this != &other) {
    remove_all();
    paths_ = std::exchange(other.paths_, {});
    file_bytes_ = other.file_bytes_;
  }
  return *this;
}

ScratchFiles::~ScratchFiles() { remove_all(); }

void ScratchFiles::remove_all() {
  for (const std::string& p : paths_) {
    if (::unlink(p.c_str()) != 0 && errno != ENOENT) {
      TZ_LOG_WARN("bench", "removing {}: {}", p, std::strerror(errno));
    }
    remove_cleanup_path(p);
  }
  paths_.clear();
}

// ---------------------------------------------------------------- page cache

namespace {
constexpr const char* kDropCaches = "/proc/sys/vm/drop_caches";
}

PageCache::PageCache(bool buffered) : buffered_(buffered) {
  if (buffered_) can_drop_ = ::access(kDropCaches, W_OK) == 0;
}

void PageCache::drop() const {
  if (!buffered_ || !can_drop_) return;
  ::sync();  // drop_caches only frees clean pages
  std::ofstream out(kDropCaches);
  out << "1\n";
  if (!out) TZ_LOG_ONCE_WARN("bench", "writing {} failed; buffered figures may include the page cache", kDropCaches);
}

std::string PageCache::note() const {
  if (!buffered_) return "";
  if (can_drop_) return "buffered I/O; the page cache is dropped before each run (sync; echo 1 > " +
                        std::string(kDropCaches) + "), writes end with fdatasync";
  return "buffered I/O; " + std::string(kDropCaches) +
         " is not writable here, so the buffered figures include the page cache";
}

}  // namespace tzbench
