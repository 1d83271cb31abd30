// Note [Rendezvous runs]
//
// Gloo's FileStore refuses to set a key that exists and happily reads one
// that a crashed earlier job left behind, so a rendezvous directory reused
// with the same MASTER_ADDR/MASTER_PORT (the default directory always is)
// must not be read as it is. Each job therefore rendezvouses in a fresh
// namespace, a run, that rank 0 creates:
//
//   1. Rank 0 writes a new run id into "<addr>-<port>.run.tmp-<id>", takes an
//      exclusive flock() on it and renames it to "<addr>-<port>.run". The lock
//      travels with the file and is held until the rendezvous is over; the
//      kernel drops it when rank 0 dies.
//   2. Every other rank opens "<addr>-<port>.run" and asks for a shared lock
//      without blocking. Refused: a live rank 0 holds it, and the id in it is
//      this job's. Granted: the file is stale (its rank 0 died or finished),
//      so the rank lets go and polls again until the timeout.
//   3. All keys go through PrefixStore("tierzero/<addr>:<port>/<run id>"), so
//      nothing an earlier run wrote can be read or collide.
//   4. After a barrier (everyone has read everything), each rank deletes the
//      files it wrote and rank 0 removes the run file: a clean run leaves the
//      directory as it found it; a crashed one leaves files nobody will read.
//
// A rank 0 that finds the run file locked by someone else refuses to start
// (AlreadyExists): two live jobs with one address, port and directory would
// otherwise steal each other's ranks. flock() works on local file systems
// and on NFS (Linux maps it to NFS byte-range locks); a shared directory
// across nodes must support it.
#include "rendezvous.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <filesystem>
#include <random>
#include <thread>

#include <gloo/common/error.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>

#include "internal.h"
#include "tierzero/common/durable_file.h"

namespace tz::comm_detail {

// A FileStore whose every wait ends at one deadline. FileStore's own wait
// measures whole seconds and get() waits a fixed 30 s, whatever the caller's
// timeout; the rendezvous as a whole gets CommOptions::timeout.
class DeadlineFileStore final : public gloo::rendezvous::FileStore {
 public:
  DeadlineFileStore(const std::string& dir, Rendezvous::Clock::time_point deadline)
      : FileStore(dir), deadline_(deadline) {}

  void wait(const std::vector<std::string>& keys) override { wait(keys, std::chrono::milliseconds(0)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& /*gloo's*/) override {
    while (!check(keys)) {
      if (Rendezvous::Clock::now() >= deadline_) {
        timed_out_keys_ = keys;
        throw gloo::IoException(fmt::format("rendezvous deadline passed waiting for key(s) {}",
                                            fmt::join(keys, ", ")));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  const std::vector<std::string>& timed_out_keys() const { return timed_out_keys_; }

 private:
  Rendezvous::Clock::time_point deadline_;
  std::vector<std::string> timed_out_keys_;
};

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(10);

std::string make_run_id() {
  std::random_device random;
  const std::uint64_t bits = (static_cast<std::uint64_t>(random()) << 32) | random();
  return fmt::format("{:016x}-pid{}", bits, ::getpid());
}

Expected<std::string> read_all(int fd, const std::string& path) {
  std::string text;
  char chunk[256];
  for (;;) {
    TZ_SYSCALL(n, ::read(fd, chunk, sizeof(chunk)));
    if (n == 0) break;
    text.append(chunk, static_cast<std::size_t>(n));
    if (text.size() > 4096) return data_corruption("run file {} is larger than any run id", path);
  }
  return text;
}

// Whether a live process holds `fd`'s file locked (the run is current).
Expected<bool> held_by_live_rank0(int fd, const std::string& path) {
  if (::flock(fd, LOCK_SH | LOCK_NB) == 0) {
    ::flock(fd, LOCK_UN);
    return false;
  }
  if (errno == EWOULDBLOCK) return true;
  return errno_status(errno, fmt::format("flock {} (the rendezvous directory must support file locks)", path));
}

Status refuse_live_run(const std::string& path) {
  const int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (raw < 0) return errno == ENOENT ? ok_status() : errno_status(errno, fmt::format("open {}", path));
  UniqueFd fd(raw);
  TZ_ASSIGN_OR_RETURN(bool live, held_by_live_rank0(fd.get(), path));
  if (!live) return ok_status();  // stale: replaced below
  TZ_ASSIGN_OR_RETURN(std::string other, read_all(fd.get(), path));
  return already_exists(
      "rendezvous: another job's rank 0 (run {}) holds {}; two jobs cannot share MASTER_ADDR, MASTER_PORT and "
      "rendezvous directory: give this one another MASTER_PORT or TIERZERO_RENDEZVOUS_DIR",
      other, path);
}

// Step 1 of Note [Rendezvous runs]; returns the locked file.
Expected<UniqueFd> publish_run(const std::string& path, const std::string& run_id) {
  TZ_TRY(refuse_live_run(path));
  const std::string tmp = fmt::format("{}.tmp-{}", path, run_id);
  TZ_ASSIGN_OR_RETURN(UniqueFd fd, open_file(tmp, O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644));
  Cleanup remove_tmp([&] { ::unlink(tmp.c_str()); });
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    return errno_status(errno, fmt::format("flock {} (the rendezvous directory must support file locks)", tmp));
  }
  TZ_TRY(write_all(fd.get(), run_id.data(), run_id.size(), tmp));  // common/durable_file.h
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    return errno_status(errno, fmt::format("rename {} -> {}", tmp, path));
  }
  remove_tmp.cancel();
  return fd;
}

// Step 2 of Note [Rendezvous runs]: the id of the run a live rank 0 holds.
Expected<std::string> await_run(const std::string& path, const RankInfo& ranks, std::chrono::milliseconds timeout,
                                Rendezvous::Clock::time_point deadline) {
  bool saw_stale = false;
  for (;;) {
    const int raw = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (raw < 0 && errno != ENOENT) return errno_status(errno, fmt::format("open {}", path));
    if (raw >= 0) {
      UniqueFd fd(raw);
      TZ_ASSIGN_OR_RETURN(bool live, held_by_live_rank0(fd.get(), path));
      if (live) return read_all(fd.get(), path);
      saw_stale = true;
    }
    if (Rendezvous::Clock::now() >= deadline) break;
    std::this_thread::sleep_for(kPollInterval);
  }
  return timeout_error(
      "rendezvous in {} timed out after {} ms: rank {} of {} found {} from rank 0; is rank 0 running with "
      "MASTER_ADDR={} MASTER_PORT={} and the same rendezvous directory?",
      std::filesystem::path(path).parent_path().string(), timeout.count(), ranks.rank, ranks.world_size,
      saw_stale ? "only a stale run file (an earlier job's)" : "no run file", ranks.master_addr,
      ranks.master_port);
}

// "tierzero/127.0.0.1:29500/<run>/3" or ".../rank_3" -> 3; -1 for other keys.
int rank_of_key(std::string_view key) {
  std::string_view last = key.substr(key.rfind('/') + 1);
  if (last.starts_with("rank_")) last.remove_prefix(5);
  int rank = -1;
  auto [ptr, ec] = std::from_chars(last.data(), last.data() + last.size(), rank);
  return ec == std::errc() && ptr == last.data() + last.size() ? rank : -1;
}

}  // namespace

Rendezvous::Rendezvous(RankInfo ranks, std::string dir, std::chrono::milliseconds timeout)
    : ranks_(std::move(ranks)),
      dir_(std::move(dir)),
      timeout_(timeout),
      deadline_(Clock::now() + timeout),
      run_path_(fmt::format("{}/{}-{}.run", dir_, file_name_safe(ranks_.master_addr), ranks_.master_port)) {}

Expected<std::unique_ptr<Rendezvous>> Rendezvous::join(const RankInfo& ranks, const std::string& dir,
                                                       std::chrono::milliseconds timeout) {
  std::unique_ptr<Rendezvous> r(new Rendezvous(ranks, dir, timeout));
  if (ranks.rank == 0) {
    r->run_id_ = make_run_id();
    TZ_ASSIGN_OR_RETURN(r->run_fd_, publish_run(r->run_path_, r->run_id_));
  } else {
    TZ_ASSIGN_OR_RETURN(r->run_id_, await_run(r->run_path_, ranks, timeout, r->deadline_));
  }
  TZ_TRY(r->open_store());
  TZ_LOG_DEBUG("comm", "rank {} of {} joined run {} in {}", ranks.rank, ranks.world_size, r->run_id_, dir);
  return r;
}

Status Rendezvous::open_store() {
  try {
    files_ = std::make_unique<DeadlineFileStore>(dir_, deadline_);
    store_ = std::make_unique<gloo::rendezvous::PrefixStore>(
        fmt::format("tierzero/{}:{}/{}", ranks_.master_addr, ranks_.master_port, run_id_), *files_);
  } catch (const std::exception& e) {
    return io_error("rendezvous: opening the file store in {}: {}", dir_, e.what());
  }
  return ok_status();
}

Rendezvous::~Rendezvous() {
  if (files_) {
    for (const std::string& path : files_->getAllKeyFilePaths()) ::unlink(path.c_str());
  }
  if (run_fd_.valid()) {
    // Withdraw the run file only while it is still ours (same inode).
    struct stat ours {};
    struct stat named {};
    if (::fstat(run_fd_.get(), &ours) == 0 && ::stat(run_path_.c_str(), &named) == 0 &&
        ours.st_dev == named.st_dev && ours.st_ino == named.st_ino) {
      ::unlink(run_path_.c_str());
    }
    run_fd_.reset();  // closing drops the lock
  }
}

gloo::rendezvous::Store& Rendezvous::store() { return *store_; }

Status Rendezvous::failure_status(std::string_view what, Status fallback) const {
  if (!files_ || files_->timed_out_keys().empty()) return fallback;
  std::vector<int> missing;
  for (const std::string& key : files_->timed_out_keys()) missing.push_back(rank_of_key(key));
  return timeout_error(
      "rendezvous in {} (run {}) timed out after {} ms: rank {} of {} is still waiting for rank(s) {} to "
      "arrive; are they running with MASTER_ADDR={} MASTER_PORT={} and the same rendezvous directory? ({})",
      dir_, run_id_, timeout_.count(), ranks_.rank, ranks_.world_size, fmt::join(missing, ", "),
      ranks_.master_addr, ranks_.master_port, what);
}

}  // namespace tz::comm_detail
