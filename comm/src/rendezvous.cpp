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
  bool has(const std::string& full_key) { return check({full_key}); }

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

// Note [Rendezvous runs], as a Rendezvous.
class FileRendezvous final : public Rendezvous {
 public:
  static Expected<std::unique_ptr<Rendezvous>> join(const RankInfo& ranks, const std::string& dir,
                                                    std::chrono::milliseconds timeout);
  ~FileRendezvous() override;

  gloo::rendezvous::Store& store() override { return *store_; }
  std::string describe() const override { return fmt::format("file rendezvous in {} (run {})", dir_, run_id_); }
  std::optional<std::pair<std::string, std::string>> shared_dir_and_run() const override {
    return std::pair{dir_, run_id_};
  }
  void publish_host(const std::string& address) override;

 protected:
  std::optional<std::string> peek(const std::string& key) override;
  std::vector<std::string> timed_out_keys() const override {
    return files_ ? files_->timed_out_keys() : std::vector<std::string>{};
  }
  std::string hint() const override {
    return fmt::format("are they running with MASTER_ADDR={} MASTER_PORT={} and the same rendezvous directory "
                       "(on several machines, one they share, or launch with mpirun or torchrun's store)?",
                       ranks_.master_addr, ranks_.master_port);
  }

 private:
  FileRendezvous(const RankInfo& ranks, std::string dir, std::chrono::milliseconds timeout)
      : Rendezvous(ranks, timeout),
        dir_(std::move(dir)),
        run_path_(fmt::format("{}/{}-{}.run", dir_, file_name_safe(ranks_.master_addr), ranks_.master_port)) {}
  Status open_store();
  std::string prefix() const { return fmt::format("tierzero/{}:{}/{}", ranks_.master_addr, ranks_.master_port, run_id_); }

  std::string dir_;
  std::string run_path_;
  std::string run_id_;
  UniqueFd run_fd_;  // rank 0: the published run file, flock()ed while the rendezvous is open
  std::unique_ptr<DeadlineFileStore> files_;
  std::unique_ptr<gloo::rendezvous::PrefixStore> store_;
};

}  // namespace

int rank_of_key(std::string_view key) {
  std::string_view last = key.substr(key.rfind('/') + 1);
  if (last.starts_with("rank_")) last.remove_prefix(5);
  int rank = -1;
  auto [ptr, ec] = std::from_chars(last.data(), last.data() + last.size(), rank);
  return ec == std::errc() && ptr == last.data() + last.size() ? rank : -1;
}

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "?";
  return name;
}

std::string host_key(int rank) { return fmt::format("tierzero_host_of_rank_{}", rank); }

std::string Rendezvous::hosts_line() {
  std::vector<std::string> parts;
  for (int r = 0; r < ranks_.world_size; ++r) {
    std::optional<std::string> host = peek(host_key(r));
    parts.push_back(host ? fmt::format("rank {} on {}", r, *host) : fmt::format("rank {} not heard from", r));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

Status Rendezvous::failure_status(std::string_view what, Status fallback) {
  const std::vector<std::string> keys = timed_out_keys();
  if (keys.empty()) {
    return Status(fallback.code(), fmt::format("{} [via {}; {}]", fallback.message(), describe(), hosts_line()));
  }
  std::vector<int> missing;
  for (const std::string& key : keys) missing.push_back(rank_of_key(key));
  return timeout_error(
      "rendezvous through {} timed out after {} ms: rank {} of {} on {} is still waiting for rank(s) {} to "
      "arrive ({}); {} ({})",
      describe(), timeout_.count(), ranks_.rank, ranks_.world_size, host_name(), fmt::join(missing, ", "),
      hosts_line(), hint(), what);
}

Expected<std::unique_ptr<Rendezvous>> FileRendezvous::join(const RankInfo& ranks, const std::string& dir,
                                                           std::chrono::milliseconds timeout) {
  std::unique_ptr<FileRendezvous> r(new FileRendezvous(ranks, dir, timeout));
  if (ranks.rank == 0) {
    r->run_id_ = make_run_id();
    TZ_ASSIGN_OR_RETURN(r->run_fd_, publish_run(r->run_path_, r->run_id_));
  } else {
    TZ_ASSIGN_OR_RETURN(r->run_id_, await_run(r->run_path_, ranks, timeout, r->deadline_));
  }
  TZ_TRY(r->open_store());
  TZ_LOG_DEBUG("comm", "rank {} of {} joined run {} in {}", ranks.rank, ranks.world_size, r->run_id_, dir);
  return std::unique_ptr<Rendezvous>(std::move(r));
}

Expected<std::unique_ptr<Rendezvous>> open_file_rendezvous(const RankInfo& ranks, const std::string& dir,
                                                           std::chrono::milliseconds timeout) {
  return FileRendezvous::join(ranks, dir, timeout);
}

void FileRendezvous::publish_host(const std::string& address) {
  try {
    const std::string text = fmt::format("{} ({})", host_name(), address);
    store_->set(host_key(ranks_.rank), std::vector<char>(text.begin(), text.end()));
  } catch (const std::exception& e) {
    TZ_LOG_DEBUG("comm", "{}: could not publish this rank's host: {}", describe(), e.what());
  }
}

std::optional<std::string> FileRendezvous::peek(const std::string& key) {
  try {
    const std::string full = prefix() + "/" + key;
    if (!files_ || !files_->has(full)) return std::nullopt;
    std::vector<char> value = files_->get(full);
    return std::string(value.begin(), value.end());
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

Status FileRendezvous::open_store() {
  try {
    files_ = std::make_unique<DeadlineFileStore>(dir_, deadline_);
    store_ = std::make_unique<gloo::rendezvous::PrefixStore>(prefix(), *files_);
  } catch (const std::exception& e) {
    return io_error("rendezvous: opening the file store in {}: {}", dir_, e.what());
  }
  return ok_status();
}

FileRendezvous::~FileRendezvous() {
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

#if !defined(TIERZERO_WITH_MPI)
bool mpi_built() { return false; }
#endif

namespace {

Expected<std::unique_ptr<Rendezvous>> open_kind(const ResolvedCommOptions& options) {
  switch (options.rendezvous) {
    case RendezvousKind::kStore: return open_store_rendezvous(options.ranks, options.store, options.timeout);
    case RendezvousKind::kMpi:
#if defined(TIERZERO_WITH_MPI)
      return open_mpi_rendezvous(options.ranks, options.timeout);
#else
      return unavailable("the MPI rendezvous was asked for, but this tierzero was built without MPI");
#endif
    case RendezvousKind::kFile: return open_file_rendezvous(options.ranks, options.rendezvous_dir, options.timeout);
  }
  return invalid_argument("RendezvousKind {} is not a rendezvous", static_cast<int>(options.rendezvous));
}

}  // namespace

Expected<std::unique_ptr<Rendezvous>> open_rendezvous(const ResolvedCommOptions& options) {
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<Rendezvous> rendezvous, open_kind(options));
  TZ_LOG_INFO("comm", "rank {} of {} on {} (launched by {}) meets the others through {}", options.ranks.rank,
              options.ranks.world_size, host_name(), options.ranks.source, rendezvous->describe());
  return rendezvous;
}

}  // namespace tz::comm_detail
