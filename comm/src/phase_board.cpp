// Note [What the other ranks were doing]
// A collective that times out used to say only that "a peer rank stopped
// answering": not which of its collectives this rank was in, nor whether the
// peer was stuck in the same one, busy outside collectives (a slow step, a
// debugger, SIGSTOP), ahead in another one, or gone. The peer cannot be asked
// then, so each rank posts as it goes, and the one that times out reads:
// - Each rank has a small file in the rendezvous directory,
//   `<addr>-<port>.<run>.rank<N>.phase`, mapped shared. Before a collective
//   it writes the collective's number on this communicator, its description,
//   the optimizer step under way, the activity around it (a RankAgreement
//   names what it agrees on) and the time; after, that it left. A seqlock
//   (a version, odd while writing) lets a reader take a consistent copy.
//   That is a few dozen bytes into memory: no system call, nothing flushed.
// - The rank holds an OFD lock on its file for the communicator's life
//   (Note [Open file description locks]); a reader that can take the lock
//   knows the process is gone. The file is made under a temporary name and
//   locked before it is renamed into place, so the reclaim below never takes
//   a live rank's new file for a dead one's.
// - On a timeout this rank compares numbers: the peer in the same one (stopped
//   or stuck inside it, its link down, or sizes that differ), finished the one before and
//   not entered this one (busy or stuck outside collectives: the step it is
//   in says where), ahead in a later one (the ranks issue different
//   collectives), or gone.
// - A clean end removes the file; a killed run's stays until the next board
//   opened in that directory finds it unlocked and removes it.
// On one node the page cache makes a peer's writes visible at once. A
// rendezvous directory shared across nodes shows what the file system has
// written back (Linux writes dirty pages within about 30 s), so each clause
// carries the age of what it read.
#include "phase_board.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "tierzero/common/file_lock.h"

namespace tz::comm_detail {

// The file's first bytes. Plain data, so a reader can pread() it whole; the
// version is accessed through std::atomic_ref.
struct PhaseBoard::Record {
  static constexpr std::uint64_t kMagic = 0x31'65'73'61'68'70'7a'74;  // "tzphase1"
  std::uint64_t magic;
  std::uint64_t version;         // odd while the fields below change
  std::uint64_t seq;             // collectives entered on this communicator
  std::int64_t step;             // the optimizer step under way (<= 0: none)
  std::int64_t posted_unix_ns;   // when it entered or left (CLOCK_REALTIME: read by other processes)
  std::uint32_t inside;          // 1 between enter() and leave()
  std::int32_t pid;
  char call[160];                // NUL-terminated, cut to fit
  char activity[160];
};

namespace {

constexpr std::size_t kFileBytes = 4096;
static_assert(std::atomic_ref<std::uint64_t>::is_always_lock_free, "the version is shared between processes");

std::atomic_ref<std::uint64_t> version_of(PhaseBoard::Record& r) { return std::atomic_ref<std::uint64_t>(r.version); }

std::int64_t unix_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

template <std::size_t N>
void copy_text(char (&to)[N], std::string_view from) {
  const std::size_t n = std::min(from.size(), N - 1);
  std::memcpy(to, from.data(), n);
  to[n] = '\0';
}

template <std::size_t N>
std::string_view text_of(const char (&from)[N]) {
  return {from, ::strnlen(from, N)};
}

// What a record says about the collective it names: "#57 (all_reduce ..., step 13, for X)".
std::string describe_record(std::uint64_t seq, std::string_view call, std::int64_t step, std::string_view activity) {
  std::string s = fmt::format("#{}", seq);
  std::vector<std::string> parts;
  if (!call.empty()) parts.emplace_back(call);
  if (step > 0) parts.push_back(fmt::format("step {}", step));
  if (!activity.empty()) parts.push_back(fmt::format("for {}", activity));
  if (!parts.empty()) s += fmt::format(" ({})", fmt::join(parts, ", "));
  return s;
}

// Unlinks the phase files in `dir` that no live process holds (Note [What
// the other ranks were doing]: dead runs'). A temporary one is unlocked for a
// moment after it is made, so it counts as dead only once a minute old.
void remove_dead_phase_files(const std::string& dir) {
  std::error_code ec;
  const auto minute_ago = std::filesystem::file_time_type::clock::now() - std::chrono::minutes(1);
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool temporary = name.find(".phase.tmp-") != std::string::npos;
    if (!name.ends_with(".phase") && !temporary) continue;
    std::error_code time_ec;
    if (temporary && !(entry.last_write_time(time_ec) < minute_ago && !time_ec)) continue;
    const int raw = ::open(entry.path().c_str(), O_RDWR | O_CLOEXEC);
    if (raw < 0) continue;
    UniqueFd fd(raw);
    const Expected<bool> free = try_lock_file(fd.get(), entry.path().string());
    if (free.ok() && *free) {
      ::unlink(entry.path().c_str());
      TZ_LOG_DEBUG("comm", "removed {}, a dead run's phase file", entry.path().string());
    }
  }
}

}  // namespace

PhaseBoard::PhaseBoard(std::string dir, std::string tag, int rank, int size)
    : dir_(std::move(dir)), tag_(std::move(tag)), rank_(rank), size_(size) {}

std::string PhaseBoard::path_of(int rank) const { return fmt::format("{}/{}.rank{}.phase", dir_, tag_, rank); }

Expected<std::unique_ptr<PhaseBoard>> PhaseBoard::open(const std::string& dir, const std::string& tag, int rank,
                                                       int size) {
  std::unique_ptr<PhaseBoard> b(new PhaseBoard(dir, tag, rank, size));
  remove_dead_phase_files(dir);
  const std::string path = b->path_of(rank);
  std::random_device random;
  const std::string tmp = fmt::format("{}.tmp-{:08x}", path, random());
  TZ_ASSIGN_OR_RETURN(b->fd_, open_file(tmp, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0644));
  Cleanup remove_tmp([&] { ::unlink(tmp.c_str()); });
  TZ_ASSIGN_OR_RETURN(const bool locked, try_lock_file(b->fd_.get(), tmp));
  if (!locked) return internal_error("{}: a file made a moment ago is locked by another process", tmp);
  if (::ftruncate(b->fd_.get(), kFileBytes) != 0) return errno_status(errno, fmt::format("ftruncate {}", tmp));
  void* addr = ::mmap(nullptr, kFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, b->fd_.get(), 0);
  if (addr == MAP_FAILED) return errno_status(errno, fmt::format("mmap {}", tmp));
  b->mapping_ = MappedRegion(addr, kFileBytes);
  b->mine_ = new (addr) Record{};  // the file is zeros: version 0, nothing entered
  b->mine_->pid = static_cast<std::int32_t>(::getpid());
  b->mine_->posted_unix_ns = unix_ns();
  b->mine_->magic = Record::kMagic;
  if (::rename(tmp.c_str(), path.c_str()) != 0) return errno_status(errno, fmt::format("rename {} -> {}", tmp, path));
  remove_tmp.cancel();
  return b;
}

PhaseBoard::~PhaseBoard() {
  if (mine_ != nullptr) ::unlink(path_of(rank_).c_str());
}

void PhaseBoard::set_activity(std::string_view activity) {
  std::lock_guard lock(activity_mu_);
  activity_.assign(activity);
}

void PhaseBoard::enter(std::string_view call) {
  Record& r = *mine_;
  std::atomic_ref<std::uint64_t> version = version_of(r);
  const std::uint64_t v = version.load(std::memory_order_relaxed);
  version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  ++r.seq;
  r.step = step_.load(std::memory_order_relaxed);
  r.posted_unix_ns = unix_ns();
  r.inside = 1;
  copy_text(r.call, call);
  {
    std::lock_guard lock(activity_mu_);
    copy_text(r.activity, activity_);
  }
  version.store(v + 2, std::memory_order_release);
}

void PhaseBoard::leave() {
  Record& r = *mine_;
  std::atomic_ref<std::uint64_t> version = version_of(r);
  const std::uint64_t v = version.load(std::memory_order_relaxed);
  version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  r.posted_unix_ns = unix_ns();
  r.inside = 0;
  version.store(v + 2, std::memory_order_release);
}

std::string PhaseBoard::describe_mine() const {
  const Record& r = *mine_;
  return describe_record(r.seq, "", r.step, text_of(r.activity));
}

namespace {

// A consistent copy of the record in `fd`, or why there is none. Read, not
// mapped: a fresh read sees what a shared file system has of the file now.
Expected<PhaseBoard::Record> read_record(int fd, const std::string& path) {
  PhaseBoard::Record r{};
  for (int attempt = 0; attempt < 100; ++attempt) {
    const ssize_t n = ::pread(fd, &r, sizeof r, 0);
    if (n < 0) return errno_status(errno, fmt::format("reading {}", path));
    if (static_cast<std::size_t>(n) < sizeof r) return data_corruption("{} is {} bytes, not a phase record", path, n);
    if (r.magic != PhaseBoard::Record::kMagic) return data_corruption("{} is not a phase record", path);
    if (r.version % 2 == 1) continue;  // being written
    // One pread of a local file copies the page at one moment; the version
    // read again guards a file system that copies in pieces.
    std::uint64_t again = 0;
    if (::pread(fd, &again, sizeof again, offsetof(PhaseBoard::Record, version)) == sizeof again &&
        again != r.version) {
      continue;
    }
    return r;
  }
  return unavailable("{} kept changing while read", path);
}

}  // namespace

std::string PhaseBoard::describe_others() const {
  const Record& me = *mine_;
  const std::int64_t now = unix_ns();
  std::vector<std::string> clauses;
  for (int rank = 0; rank < size_; ++rank) {
    if (rank == rank_) continue;
    const std::string path = path_of(rank);
    const int raw = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (raw < 0) {
      clauses.push_back(fmt::format("rank {} posted nothing ({}: {})", rank, path, std::strerror(errno)));
      continue;
    }
    UniqueFd fd(raw);
    const Expected<Record> read = read_record(fd.get(), path);
    if (!read.ok()) {
      clauses.push_back(fmt::format("rank {}: {}", rank, read.status().message()));
      continue;
    }
    const Record& s = *read;
    const double ago_s = static_cast<double>(now - s.posted_unix_ns) / 1e9;
    const std::string what = describe_record(s.seq, text_of(s.call), s.step, text_of(s.activity));
    const Expected<bool> free = try_lock_file(fd.get(), path);
    if (free.ok() && *free) {
      clauses.push_back(fmt::format("rank {}'s process is gone (it last posted {}, {:.1f} s ago)", rank, what, ago_s));
    } else if (s.inside && s.seq == me.seq) {
      clauses.push_back(fmt::format("rank {} is in the same collective {} since {:.1f} s ago and has not finished "
                                    "it either: it stopped answering inside it (stopped, stuck, or its link is "
                                    "down), or the ranks passed different sizes", rank, what, ago_s));
    } else if (s.inside && s.seq > me.seq) {
      clauses.push_back(fmt::format("rank {} is ahead, in {} since {:.1f} s ago: the ranks issue different "
                                    "collectives", rank, what, ago_s));
    } else if (s.seq < me.seq) {
      clauses.push_back(fmt::format("rank {} has not entered #{}: it {} {} {:.1f} s ago (busy outside "
                                    "collectives, stopped, or stuck; the step says where)", rank, me.seq,
                                    s.inside ? "entered" : "left", what, ago_s));
    } else {
      clauses.push_back(fmt::format("rank {} left {} {:.1f} s ago", rank, what, ago_s));
    }
  }
  return fmt::format("{}", fmt::join(clauses, "; "));
}

}  // namespace tz::comm_detail
