// The per-directory half of the capability probe: can this directory hold the
// NVMe tier, and with what O_DIRECT alignment?
//
// Note [O_DIRECT that is not direct]
// open(O_DIRECT) succeeding proves little: tmpfs accepts the flag since Linux
// 6.6 and keeps the data in memory anyway, and a file system may accept it and
// quietly fall back to buffered I/O. So we believe O_DIRECT only when the
// kernel reports a direct-I/O alignment (statx STATX_DIOALIGN, Linux 6.1+) or,
// on older kernels, when misaligned requests are refused the way real direct
// I/O refuses them; and tmpfs/ramfs never count, whatever they accept. One
// aligned write and read back then checks that the path really works.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>

#include "tierzero/common/checks.h"
#include "tierzero/common/handles.h"
#include "tierzero/common/log.h"
#include "tierzero/common/probe.h"
#include "tierzero/common/units.h"

namespace tz {
namespace {

constexpr std::uint32_t kProbeAlignments[] = {512, 1024, 2048, 4096};
constexpr std::uint32_t kMaxProbeAlignment = 4096;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<unsigned char[], FreeDeleter>;

AlignedBuffer make_aligned_buffer(size_t alignment, size_t size_bytes) {
  auto* p = static_cast<unsigned char*>(std::aligned_alloc(alignment, align_up(size_bytes, alignment)));
  if (p != nullptr) std::memset(p, 0, size_bytes);
  return AlignedBuffer(p);
}

std::string filesystem_name(std::uint64_t magic) {
  switch (magic) {
    case 0xEF53: return "ext4";  // ext2/ext3/ext4 share the magic
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    case 0x858458f6: return "ramfs";
    case 0x794c7630: return "overlayfs";
    case 0x6969: return "nfs";
    case 0x2fc12fc1: return "zfs";
    case 0xF2F52010: return "f2fs";
    case 0x65735546: return "fuse";
    default: return fmt::format("unknown(0x{:x})", magic);
  }
}

bool is_memory_filesystem(std::uint64_t magic) { return magic == 0x01021994 || magic == 0x858458f6; }

// "vda", "nvme0n1p1"; "" for file systems without a block device (tmpfs,
// overlayfs, btrfs subvolumes report an anonymous device).
std::string block_device_name(dev_t dev) {
  if (major(dev) == 0) return "";
  std::string link = fmt::format("/sys/dev/block/{}:{}", major(dev), minor(dev));
  char target[4096];
  ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
  if (n <= 0) return "";
  std::string_view path(target, static_cast<size_t>(n));
  auto slash = path.rfind('/');
  return std::string(slash == std::string_view::npos ? path : path.substr(slash + 1));
}

Status check_directory(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOENT) return not_found("{} does not exist", dir);
    return errno_status(err, fmt::format("stat {}", dir));
  }
  if (!S_ISDIR(st.st_mode)) return invalid_argument("{} is not a directory", dir);
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    int err = errno;
    return Status(ErrorCode::kPermissionDenied,
                  fmt::format("{} is not writable: {} (errno {})", dir, std::strerror(err), err), err);
  }
  return ok_status();
}

// A temporary file in `dir` that has no name by the time this returns, so no
// failure later can leave it behind.
Expected<UniqueFd> create_temp_file(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) return UniqueFd(fd);
  // No O_TMPFILE (old kernel, or a file system without it): a named file,
  // unlinked at once.
  std::string name = fmt::format("{}/.tierzero-probe-{}-XXXXXX", dir, ::getpid());
  do {
    fd = ::mkostemp(name.data(), O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    int err = errno;
    // Out of space, memory or descriptors is that; anything else means the
    // directory takes no new files (EACCES, EROFS, or ENOENT from /proc and
    // sysfs, which have no create operation).
    bool resources = err == ENOSPC || err == EDQUOT || err == ENOMEM || err == EMFILE || err == ENFILE;
    if (!resources) {
      return Status(ErrorCode::kPermissionDenied,
                    fmt::format("{} is not writable: creating a file there: {} (errno {})", dir,
                                std::strerror(err), err),
                    err);
    }
    return errno_status(err, fmt::format("creating a temporary file in {}", dir));
  }
  UniqueFd file(fd);
  Cleanup remove_name([&name] { ::unlink(name.c_str()); });
  return file;
}

// Reopens `fd`'s file with O_DIRECT. EINVAL is the kernel's "no direct I/O
// here" and comes back as an InvalidArgument with sys_errno EINVAL.
Expected<UniqueFd> reopen_direct(int fd) {
  std::string self = fmt::format("/proc/self/fd/{}", fd);
  Expected<UniqueFd> direct = open_file(self, O_RDWR | O_DIRECT);
  if (direct.ok() || direct.status().sys_errno() != ENOENT) return direct;
  // No /proc: set the flag on the open file instead (the kernel applies the
  // same check as open).
  int dup_fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) return errno_status(errno, "fcntl(F_DUPFD_CLOEXEC)");
  UniqueFd dup(dup_fd);
  int flags = ::fcntl(dup_fd, F_GETFL);
  if (flags < 0 || ::fcntl(dup_fd, F_SETFL, flags | O_DIRECT) != 0) {
    return errno_status(errno, "fcntl(F_SETFL, O_DIRECT)");
  }
  return dup;
}

// Does a pwrite then pread of `length` bytes at `offset` from `buf` succeed?
bool direct_io_works(int fd, unsigned char* buf, size_t length, off_t offset) {
  ssize_t n;
  do {
    n = ::pwrite(fd, buf, length, offset);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(length)) return false;
  do {
    n = ::pread(fd, buf, length, offset);
  } while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(length);
}

// One aligned block out and back; the bytes must match.
Status direct_round_trip(int fd, std::uint32_t mem_align, std::uint32_t offset_align) {
  size_t block = std::max<size_t>(kMaxProbeAlignment, offset_align);
  size_t alignment = std::max<size_t>(kMaxProbeAlignment, mem_align);
  AlignedBuffer out = make_aligned_buffer(alignment, block);
  AlignedBuffer in = make_aligned_buffer(alignment, block);
  if (!out || !in) return out_of_memory("allocating two {} buffers", format_bytes(block));
  for (size_t i = 0; i < block; ++i) out[i] = static_cast<unsigned char>((i * 131 + 7) & 0xff);

  TZ_SYSCALL(written, ::pwrite(fd, out.get(), block, 0));
  if (static_cast<size_t>(written) != block) {
    return io_error("short O_DIRECT write: {} of {} bytes", written, block);
  }
  TZ_SYSCALL(got, ::pread(fd, in.get(), block, 0));
  if (static_cast<size_t>(got) != block) return io_error("short O_DIRECT read: {} of {} bytes", got, block);
  if (std::memcmp(out.get(), in.get(), block) != 0) {
    return data_corruption("O_DIRECT read back different bytes than were written ({} block)",
                           format_bytes(block));
  }
  return ok_status();
}

struct DioAlignment {
  bool reported = false;  // the kernel answered STATX_DIOALIGN
  std::uint32_t mem_align = 0;
  std::uint32_t offset_align = 0;
};

DioAlignment statx_dio_alignment(int fd) {
  DioAlignment out;
#ifdef STATX_DIOALIGN
  struct statx sx {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) != 0) {
    out.reported = true;
    out.mem_align = sx.stx_dio_mem_align;
    out.offset_align = sx.stx_dio_offset_align;
  }
#else
  (void)fd;
#endif
  return out;
}

// Decides o_direct and the alignments for an O_DIRECT descriptor; see
// Note [O_DIRECT that is not direct].
void classify_direct_io(int direct_fd, PathCapabilities& caps) {
  DioAlignment align = statx_dio_alignment(direct_fd);
  if (align.reported && align.offset_align == 0) {
    caps.note = fmt::format(
        "{}: O_DIRECT is accepted but the kernel reports no direct-I/O alignment "
        "(STATX_DIOALIGN 0): I/O goes through the page cache",
        caps.filesystem);
    return;
  }
  if (!align.reported) {
    Status measured = detail::measure_dio_alignment(direct_fd, &align.mem_align, &align.offset_align);
    if (!measured.ok()) {
      caps.note = fmt::format("{}: O_DIRECT is accepted but {}", caps.filesystem, measured.message());
      return;
    }
  }
  Status round_trip = direct_round_trip(direct_fd, align.mem_align, align.offset_align);
  if (!round_trip.ok()) {
    caps.note = fmt::format("O_DIRECT round trip failed: {}", round_trip.message());
    return;
  }
  caps.o_direct = true;
  caps.dio_mem_align = align.mem_align;
  caps.dio_offset_align = align.offset_align;
}

Status probe_direct_io(const std::string& dir, std::uint64_t magic, PathCapabilities& caps) {
  TZ_ASSIGN_OR_RETURN(UniqueFd file, create_temp_file(dir));
  Expected<UniqueFd> direct = reopen_direct(file.get());
  if (!direct.ok() && direct.status().sys_errno() != EINVAL) {
    return std::move(direct).status().with_context(fmt::format("opening a file in {} with O_DIRECT", dir));
  }
  caps.o_direct_accepted = direct.ok();
  if (is_memory_filesystem(magic)) {
    caps.note = fmt::format(
        "{}: O_DIRECT is {} but data stays in page cache/memory; not a real NVMe tier",
        caps.filesystem, caps.o_direct_accepted ? "accepted" : "refused");
    return ok_status();
  }
  if (!caps.o_direct_accepted) {
    caps.note = fmt::format("{}: open(O_DIRECT) fails with EINVAL: no direct I/O on this file system",
                            caps.filesystem);
    return ok_status();
  }
  classify_direct_io(direct->get(), caps);
  return ok_status();
}

Expected<PathCapabilities> probe_path_uncached(const std::string& dir) {
  TZ_TRY(check_directory(dir));
  PathCapabilities caps;
  caps.path = dir;
  struct statfs fs {};
  TZ_SYSCALL_CHECK(::statfs(dir.c_str(), &fs));
  auto magic = static_cast<std::uint64_t>(fs.f_type) & 0xffffffffULL;
  caps.filesystem = filesystem_name(magic);
  caps.total_bytes = static_cast<std::uint64_t>(fs.f_blocks) * static_cast<std::uint64_t>(fs.f_bsize);
  caps.free_bytes = static_cast<std::uint64_t>(fs.f_bavail) * static_cast<std::uint64_t>(fs.f_bsize);
  struct stat st {};
  TZ_SYSCALL_CHECK(::stat(dir.c_str(), &st));
  caps.device = block_device_name(st.st_dev);
  TZ_TRY(probe_direct_io(dir, magic, caps));
  return caps;
}

// The cache key: the resolved path, so "/nvme0/tz/" and "/nvme0/./tz" share.
std::string canonical_path(const std::string& dir) {
  std::unique_ptr<char, FreeDeleter> resolved(::realpath(dir.c_str(), nullptr));
  return resolved ? std::string(resolved.get()) : dir;
}

}  // namespace

namespace detail {
Status measure_dio_alignment(int fd, std::uint32_t* mem_align, std::uint32_t* offset_align) {
  // A buffer aligned to twice the largest candidate, so base + a is aligned to
  // exactly a and no more.
  constexpr size_t kBufferBytes = 2 * size_t{kMaxProbeAlignment};
  AlignedBuffer buf = make_aligned_buffer(kBufferBytes, 2 * kBufferBytes);
  if (!buf) return out_of_memory("allocating a {} buffer", format_bytes(2 * kBufferBytes));
  *offset_align = 0;
  *mem_align = 0;
  for (std::uint32_t a : kProbeAlignments) {
    if (direct_io_works(fd, buf.get(), a, static_cast<off_t>(a))) {
      *offset_align = a;
      break;
    }
  }
  if (*offset_align == 0) {
    return invalid_argument("O_DIRECT I/O fails at every offset alignment up to {} B", kMaxProbeAlignment);
  }
  for (std::uint32_t a : kProbeAlignments) {
    if (direct_io_works(fd, buf.get() + a, *offset_align, 0)) {
      *mem_align = a;
      break;
    }
  }
  if (*mem_align == 0) {
    return invalid_argument("O_DIRECT I/O fails at every buffer alignment up to {} B", kMaxProbeAlignment);
  }
  return ok_status();
}
}  // namespace detail

Expected<PathCapabilities> probe_path(const std::string& directory) {
  static std::mutex mutex;
  static std::map<std::string, PathCapabilities> cache;
  // Held across the probe: two threads asking about one path probe it once.
  std::lock_guard<std::mutex> lock(mutex);
  TZ_TRY(check_directory(directory));
  std::string key = canonical_path(directory);
  if (auto it = cache.find(key); it != cache.end()) {
    PathCapabilities caps = it->second;
    caps.path = directory;
    return caps;
  }
  TZ_ASSIGN_OR_RETURN(PathCapabilities caps, probe_path_uncached(directory));
  TZ_LOG_DEBUG("common", "probed {}", describe(caps));
  cache.emplace(key, caps);
  return caps;
}

std::string describe(const PathCapabilities& path) {
  std::string device = path.device.empty() ? " (no block device)" : " on " + path.device;
  std::string direct;
  if (path.o_direct) {
    direct = fmt::format("O_DIRECT yes (memory align {}, offset align {})", format_bytes(path.dio_mem_align),
                         format_bytes(path.dio_offset_align));
  } else {
    direct = fmt::format("O_DIRECT no ({} by open)", path.o_direct_accepted ? "accepted" : "refused");
  }
  std::string out = fmt::format("{}: {}{}, {} free of {}, {}\n", path.path, path.filesystem, device,
                                format_bytes(path.free_bytes), format_bytes(path.total_bytes), direct);
  if (!path.note.empty()) out += fmt::format("  note: {}\n", path.note);
  return out;
}

}  // namespace tz
