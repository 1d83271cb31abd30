// Swap files: named at random, owned through an advisory lock, reclaimed from
// runs that have ended.
//
// Note [Swap file ownership]
// A swap file is scratch for one SwapStore's life. It used to be named by the
// process ID, which says nothing once the process is gone: in a container the
// trainer is PID 1 again after a restart and found its own dead file in the
// way ("File exists"); two containers sharing a folder collided the same
// way; and a dead run's file, the size of its NVMe states, sat beside a
// restart that was told to lower its budget. Now:
// - The name is tierzero-swap-<64 random bits in hex>.bin, created with
//   O_EXCL (a clash, however unlikely, takes another name).
// - The store holds an exclusive OFD lock on its own open of the file for
//   its whole life (Note [Open file description locks] in
//   common/src/file_lock.cpp): a live owner, in this process or another
//   container, is one whose lock is taken; the kernel drops it when the
//   owner ends, however it ends (kill -9, OOM killer, power cut aside).
// - Before creating its own file, a store looks at every swap file in the
//   folder: one whose lock it can take belongs to no live run, and is
//   removed, with a log line naming it and its size; one whose lock is taken
//   is left alone, and named if the disk is then too full.
// Creating and locking are two steps, so a reclaimer may find a new file
// before its creator locks it, take the lock and remove it. The creator
// therefore takes the lock waiting, and then checks that its file is still
// linked (st_nlink > 0); if not, it starts again under a new name. A
// reclaimer, having taken a lock, checks the name still leads to the file it
// locked before removing it. Files of older versions (tierzero-swap-<pid>-
// <n>.bin) carry no lock and are reclaimed like dead ones; were such a run
// still alive, removing the name does not disturb it (its open descriptor
// keeps the data), and its space comes back when it ends.
#include "swap_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "tierzero/nvme/swap_store.h"

namespace tz::nvme {
namespace detail {
namespace {

bool is_swap_name(std::string_view name) {
  return name.size() > kSwapPrefix.size() + kSwapSuffix.size() && name.starts_with(kSwapPrefix) &&
         name.ends_with(kSwapSuffix);
}

std::uint64_t random_bits() {
  std::uint64_t bits = 0;
  if (::getrandom(&bits, sizeof bits, GRND_NONBLOCK) == static_cast<ssize_t>(sizeof bits)) return bits;
  // No entropy to be had (very early boot, a seccomp filter): the time, the
  // process and a counter, mixed (splitmix64). O_EXCL still guards a clash.
  static std::atomic<std::uint64_t> counter{0};
  struct timespec ts {};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  std::uint64_t z = static_cast<std::uint64_t>(ts.tv_nsec) ^ (static_cast<std::uint64_t>(ts.tv_sec) << 30) ^
                    (static_cast<std::uint64_t>(::getpid()) << 17) ^ (counter++ * 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

std::string list(const std::vector<SwapFileSeen>& files) {
  std::string out;
  for (const SwapFileSeen& f : files) {
    if (!out.empty()) out += ", ";
    out += f.why.empty() ? fmt::format("{} ({})", f.path, format_bytes(f.bytes)) : fmt::format("{} ({})", f.path, f.why);
  }
  return out;
}

// Looks at one swap file: removes it when its lock is free.
void reclaim_one(const std::string& path, SwapFolderReport& report) {
  int raw;
  do {
    raw = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  } while (raw < 0 && errno == EINTR);
  if (raw < 0) {
    if (errno != ENOENT) report.unchecked.push_back({path, 0, std::strerror(errno)});  // ENOENT: its owner removed it
    return;
  }
  UniqueFd fd(raw);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return;  // not a file a store made
  const std::uint64_t bytes = static_cast<std::uint64_t>(st.st_blocks) * 512;
  Expected<bool> mine = try_lock_file(fd.get(), path);
  if (!mine.ok()) {
    report.unchecked.push_back({path, bytes, mine.status().message()});
    return;
  }
  if (!*mine) {
    report.held.push_back({path, bytes, ""});
    return;
  }
  struct stat now {};
  if (::stat(path.c_str(), &now) != 0 || now.st_ino != st.st_ino || now.st_dev != st.st_dev) return;  // replaced
  if (::unlink(path.c_str()) != 0) {
    report.unchecked.push_back({path, bytes, fmt::format("removing it: {}", std::strerror(errno))});
    return;
  }
  TZ_LOG_INFO("nvme", "removed the stale swap file {} ({}): no live run holds its lock, so the run that made it has "
              "ended", path, format_bytes(bytes));
  report.removed.push_back({path, bytes, ""});
}

// Note [Space of a removed file]
// Removing a dead run's swap file frees its space only once nothing holds
// the file: a process killed with io_uring rings has them torn down by the
// kernel a moment after it is reaped (the rings' registered files go last),
// and a journaling file system may hand the blocks back when the removal
// commits. A store made right after (a container restarted at once) would
// see the space still taken and be refused, or an "auto" NVMe budget
// planned without it. So after removing files the folder is fsynced (which
// commits the removal) and the free space watched, for up to
// kSettleLimit, until it has grown by what was removed.
constexpr auto kSettleLimit = std::chrono::seconds(5);

std::uint64_t free_bytes(const std::string& dir) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return 0;
  return static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

void settle_removals(const std::string& dir, std::uint64_t free_before, std::uint64_t removed) {
  if (Expected<UniqueFd> fd = open_file(dir, O_RDONLY | O_DIRECTORY); fd.ok()) (void)::fsync(fd->get());
  const auto give_up = std::chrono::steady_clock::now() + kSettleLimit;
  const std::uint64_t want = free_before + removed - removed / 16;  // metadata blocks aside
  while (free_bytes(dir) < want) {
    if (std::chrono::steady_clock::now() > give_up) {
      TZ_LOG_WARN("nvme", "{}: the space of the removed swap files ({}) has not all come back after {} s (another "
                  "process may still hold them open, or be filling the disk)", dir, format_bytes(removed),
                  kSettleLimit.count());
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Note [Swap files removed at abort]: one slot per live swap file. `state`
// says whether `pid` and `path` may be read: a handler reads only slots that
// are listed (2); an owner fills a slot while it is claimed (1), lists it,
// and claims it back before emptying it.
struct ExitSlot {
  std::atomic<int> state{0};  // 0 free, 1 claimed, 2 listed
  pid_t pid = 0;
  char path[ExitRemoval::kMaxPathBytes] = {};
};
static_assert(std::atomic<int>::is_always_lock_free, "read from a signal handler");
ExitSlot g_exit_slots[ExitRemoval::kExitSlots];

}  // namespace

Expected<OwnedSwapFile> create_owned_swap_file(const std::string& dir) {
  constexpr int kTries = 16;
  for (int attempt = 0; attempt < kTries; ++attempt) {
    const std::string path = fmt::format("{}/{}{:016x}{}", dir, kSwapPrefix, random_bits(), kSwapSuffix);
    Expected<UniqueFd> fd = open_file(path, O_RDWR | O_CREAT | O_EXCL);
    if (!fd.ok() && fd.status().code() == ErrorCode::kAlreadyExists) continue;
    TZ_TRY(fd);
    Cleanup remove([&] { ::unlink(path.c_str()); });
    // Note [Swap file ownership]: waits out a reclaimer looking at it, then checks it is still there.
    TZ_TRY(lock_file(fd->get(), path));
    struct stat st {};
    TZ_SYSCALL_CHECK(::fstat(fd->get(), &st));
    if (st.st_nlink == 0) {
      remove.cancel();  // removed by a reclaimer: not ours to unlink any more
      continue;
    }
    remove.cancel();
    return OwnedSwapFile{path, std::move(*fd)};
  }
  return already_exists("creating a swap file in {}: {} fresh names were taken or removed at once", dir, kTries);
}

ExitRemoval::ExitRemoval(const std::string& path) {
  if (path.size() >= kMaxPathBytes) {
    TZ_LOG_ONCE_WARN("nvme", "swap file {}: its path is too long to be removed by a signal handler; it is removed "
                     "by its store, or by the next run", path);
    return;
  }
  for (int i = 0; i < kExitSlots; ++i) {
    int expected = 0;
    if (!g_exit_slots[i].state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) continue;
    g_exit_slots[i].pid = ::getpid();
    std::memcpy(g_exit_slots[i].path, path.c_str(), path.size() + 1);
    g_exit_slots[i].state.store(2, std::memory_order_release);
    slot_ = i;
    return;
  }
  TZ_LOG_ONCE_WARN("nvme", "more than {} swap files at once: {} is removed by its store, or by the next run, but not "
                   "by a signal handler", kExitSlots, path);
}

void ExitRemoval::reset() {
  if (slot_ < 0) return;
  g_exit_slots[slot_].state.store(1, std::memory_order_release);
  g_exit_slots[slot_].path[0] = '\0';
  g_exit_slots[slot_].state.store(0, std::memory_order_release);
  slot_ = -1;
}

ExitRemoval& ExitRemoval::operator=(ExitRemoval&& other) noexcept {
  if (this != &other) {
    reset();
    slot_ = std::exchange(other.slot_, -1);
  }
  return *this;
}

}  // namespace detail

std::string SwapFolderReport::describe() const {
  std::string out;
  if (!removed.empty()) {
    out += fmt::format("; in {}, {} stale swap file(s) of runs that have ended were removed first: {}", dir,
                       removed.size(), detail::list(removed));
  }
  if (!held.empty()) {
    out += fmt::format("; in {}, {} swap file(s) belong to another live run, which holds their lock, and were left "
                       "alone: {}", dir, held.size(), detail::list(held));
  }
  if (!unchecked.empty()) {
    out += fmt::format("; in {}, swap file(s) that could not be checked: {}", dir, detail::list(unchecked));
  }
  return out;
}

SwapFolderReport reclaim_stale_swap_files(const std::string& dir) {
  SwapFolderReport report{.dir = dir};
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const struct dirent* e = ::readdir(d)) {
      if (detail::is_swap_name(e->d_name)) names.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  const std::uint64_t free_before = names.empty() ? 0 : detail::free_bytes(dir);
  for (const std::string& name : names) detail::reclaim_one(dir + "/" + name, report);
  std::uint64_t removed = 0;
  for (const SwapFileSeen& f : report.removed) removed += f.bytes;
  if (removed > 0) detail::settle_removals(dir, free_before, removed);  // Note [Space of a removed file]
  return report;
}

// Note [Swap files removed at abort]
// unlink(2) and getpid(2) are async-signal-safe, and the slots are fixed
// memory read through a lock-free atomic, so a handler may call this at any
// point. Only the process that listed a file removes it: a fork()ed child
// shares the parent's list (and its lock: Note [Open file description
// locks]), but not its files. A slot emptied and filled again while a handler
// reads it could give it a torn path; that needs a store made while the
// process is being aborted, and at worst removes nothing.
void remove_swap_files_now() noexcept {
  const pid_t me = ::getpid();
  for (detail::ExitSlot& s : detail::g_exit_slots) {
    if (s.state.load(std::memory_order_acquire) == 2 && s.pid == me) (void)::unlink(s.path);
  }
}

}  // namespace tz::nvme
