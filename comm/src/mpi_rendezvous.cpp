// Note [MPI rendezvous]
//
// Under mpirun the ranks already share a channel that crosses machines: MPI.
// Gloo's own MPI context is not in Debian's Gloo (built with
// GLOO_USE_MPI=0), so the key-value store Gloo's connectFullMesh asks for is
// made of MPI messages, and MPI carries nothing after the rendezvous:
//
//   - set() keeps the key and sends it to every other rank at once
//     (MPI_Isend on a duplicate of MPI_COMM_WORLD, so it cannot match a
//     program's own messages); wait() takes in whatever has arrived
//     (MPI_Iprobe, MPI_Recv) until it holds the keys or the deadline
//     passes. Every rank thus sees every key, in whatever order the ranks
//     set and wait (Gloo's has each rank wait for the lower ranks' host
//     keys before it sets its addresses; a lock-step exchange deadlocks on
//     that), and a key that never came names the rank that did not send it.
//   - NCCL's unique id is one more key: rank 0 sets it, the others wait.
//   - Once every rank is past the barrier that ends creation (completed()),
//     each sends every other an end marker and takes in messages until it
//     has every peer's: a rank may have been sent keys it never waited for,
//     and a send larger than MPI's eager limit completes only when received.
//     Messages from one peer arrive in order (MPI's non-overtaking rule), so
//     the marker comes after that peer's keys.
//
// MPI_Init: Open MPI's waits for every rank of the job (a PMIx fence) and
// takes no timeout, so it runs on a helper thread that the caller waits for
// until the deadline. A rank stuck there fails with Timeout; the helper
// thread stays blocked, and the process is about to exit with the error.
// MPI_Finalize runs at exit (std::atexit) when tierzero initialised MPI and
// every rendezvous went well; after a failed one it is skipped (its fence
// would wait for the missing rank), and mpirun, seeing this rank exit
// without it, ends the job. Sends still pending after a failure keep their
// buffers until exit rather than have MPI read freed memory.
#include <mpi.h>

#include <gloo/common/error.h>
#include <gloo/rendezvous/store.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "internal.h"
#include "rendezvous.h"

namespace tz::comm_detail {
namespace {

using Clock = Rendezvous::Clock;
using std::chrono::milliseconds;

constexpr int kTag = 7101;
constexpr char kKeyMessage = 'K';
constexpr char kEndMessage = 'E';

// MPI's state in this process; MPI_Init and MPI_Finalize happen once.
struct MpiProcess {
  std::mutex mu;
  bool we_initialised = false;
  std::atomic<bool> failed{false};
  std::shared_future<int> init;  // MPI_Init_thread's result, once started
};

MpiProcess& mpi_process() {
  static MpiProcess* process = new MpiProcess();  // never destroyed: read by the atexit handler
  return *process;
}

void finalize_at_exit() {
  MpiProcess& p = mpi_process();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!p.failed.load() && finalized == 0) MPI_Finalize();
}

std::string mpi_error(int code) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<std::size_t>(length));
}

std::string library_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int length = 0;
  MPI_Get_library_version(text, &length);
  std::string version(text, static_cast<std::size_t>(length));
  return version.substr(0, version.find_first_of(",\n"));
}

// MPI_Init_thread, bounded by `deadline` (see the Note).
Status ensure_initialised(Clock::time_point deadline, milliseconds timeout, const RankInfo& ranks) {
  MpiProcess& p = mpi_process();
  std::shared_future<int> init;
  {
    std::lock_guard lock(p.mu);
    int initialised = 0;
    MPI_Initialized(&initialised);
    if (initialised != 0 && !p.init.valid()) return ok_status();  // the program initialised MPI itself
    if (!p.init.valid()) {
      std::packaged_task<int()> task([] {
        int provided = 0;
        const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
        return rc != MPI_SUCCESS ? -1 : provided;
      });
      p.init = task.get_future().share();
      std::thread(std::move(task)).detach();
      p.we_initialised = true;
      std::atexit(finalize_at_exit);
    }
    init = p.init;
  }
  if (init.wait_until(deadline) != std::future_status::ready) {
    p.failed = true;
    return timeout_error(
        "MPI_Init did not finish within {} ms on rank {} of {} ({}): under mpirun the ranks meet inside MPI_Init, so "
        "some rank of this job has not reached it (stuck before creating its communicator, or not a tierzero "
        "program)", timeout.count(), ranks.rank, ranks.world_size, host_name());
  }
  const int provided = init.get();
  if (provided < 0) {
    p.failed = true;  // no MPI_Finalize at exit for an MPI that never started
    return unavailable("MPI_Init_thread failed on {} (rank {} of {})", host_name(), ranks.rank, ranks.world_size);
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    return unavailable("{} provides thread level {} only; tierzero needs MPI_THREAD_SERIALIZED ({})",
                       library_version(), provided, MPI_THREAD_SERIALIZED);
  }
  return ok_status();
}

// Polls `requests` until all complete or the deadline; whether they did.
bool wait_all(std::vector<MPI_Request>& requests, Clock::time_point deadline) {
  for (;;) {
    int done = 0;
    MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
    if (done != 0) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
}

// Messages still being sent after a failure: kept until exit (see the Note).
std::vector<std::shared_ptr<const std::string>>& abandoned_messages() {
  static auto* kept = new std::vector<std::shared_ptr<const std::string>>();
  return *kept;
}

// Gloo's Store over MPI messages (the Note's first point).
class MpiMailboxStore final : public gloo::rendezvous::Store {
 public:
  MpiMailboxStore(MPI_Comm comm, int rank, int size, Clock::time_point deadline)
      : comm_(comm), rank_(rank), size_(size), deadline_(deadline) {}
  ~MpiMailboxStore() override {
    if (!sends_.empty()) {  // never finished: MPI may still read them
      for (auto& send : sends_) abandoned_messages().push_back(send.message);
    }
  }
  MpiMailboxStore(const MpiMailboxStore&) = delete;
  MpiMailboxStore& operator=(const MpiMailboxStore&) = delete;

  void set(const std::string& key, const std::vector<char>& data) override {
    TZ_LOG_TRACE("comm", "MPI rendezvous: set {} ({} bytes)", key, data.size());
    known_[key] = data;
    std::string message(1, kKeyMessage);
    const auto key_size = static_cast<std::uint32_t>(key.size());
    message.append(reinterpret_cast<const char*>(&key_size), sizeof(key_size));
    message += key;
    message.append(data.data(), data.size());
    post(std::move(message));
  }
  std::vector<char> get(const std::string& key) override {
    wait({key});
    return known_.at(key);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, milliseconds(0)); }
  void wait(const std::vector<std::string>& keys, const milliseconds& /*gloo's*/) override {
    while (!all_known(keys)) {
      if (receive_one()) continue;
      if (Clock::now() >= deadline_) {
        mpi_process().failed = true;
        timed_out_keys_.clear();
        for (const std::string& key : keys) {
          if (!known_.contains(key)) timed_out_keys_.push_back(key);
        }
        throw gloo::IoException(fmt::format("rendezvous deadline passed waiting for key(s) {}",
                                            fmt::join(timed_out_keys_, ", ")));
      }
      progress_sends();
      std::this_thread::sleep_for(milliseconds(1));
    }
  }

  // The Note's third point; whether every peer's marker came and every send
  // completed by `deadline`.
  bool finish(Clock::time_point deadline) {
    post(std::string(1, kEndMessage));
    while (ends_ < size_ - 1) {
      if (receive_one()) continue;
      if (Clock::now() >= deadline) return false;
      progress_sends();
      std::this_thread::sleep_for(milliseconds(1));
    }
    std::vector<MPI_Request> requests;
    for (const Send& send : sends_) requests.push_back(send.request);
    if (!wait_all(requests, deadline)) return false;
    sends_.clear();
    return true;
  }

  std::optional<std::string> peek(const std::string& key) {
    while (receive_one()) {
    }
    auto it = known_.find(key);
    if (it == known_.end()) return std::nullopt;
    return std::string(it->second.begin(), it->second.end());
  }
  const std::vector<std::string>& timed_out_keys() const { return timed_out_keys_; }

 private:
  struct Send {
    std::shared_ptr<const std::string> message;
    MPI_Request request = MPI_REQUEST_NULL;
  };

  bool all_known(const std::vector<std::string>& keys) const {
    for (const std::string& key : keys) {
      if (!known_.contains(key)) return false;
    }
    return true;
  }

  void post(std::string text) {
    auto message = std::make_shared<const std::string>(std::move(text));
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      Send& send = sends_.emplace_back(Send{message, MPI_REQUEST_NULL});
      MPI_Isend(message->data(), static_cast<int>(message->size()), MPI_BYTE, peer, kTag, comm_, &send.request);
    }
  }

  void progress_sends() {
    for (Send& send : sends_) {
      int done = 0;
      if (send.request != MPI_REQUEST_NULL) MPI_Test(&send.request, &done, MPI_STATUS_IGNORE);
    }
  }

  // Takes in one message if one has arrived; whether one had.
  bool receive_one() {
    int arrived = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, kTag, comm_, &arrived, &status);
    if (arrived == 0) return false;
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    std::string in(static_cast<std::size_t>(bytes), '\0');
    MPI_Recv(in.data(), bytes, MPI_BYTE, status.MPI_SOURCE, kTag, comm_, MPI_STATUS_IGNORE);
    if (!in.empty() && in[0] == kEndMessage) {
      ++ends_;
      return true;
    }
    std::uint32_t key_size = 0;
    if (in.size() < 1 + sizeof(key_size) || in[0] != kKeyMessage) {
      throw gloo::IoException(fmt::format("MPI rendezvous: a malformed message from rank {}", status.MPI_SOURCE));
    }
    std::memcpy(&key_size, in.data() + 1, sizeof(key_size));
    const std::size_t at = 1 + sizeof(key_size);
    if (at + key_size > in.size()) {
      throw gloo::IoException(fmt::format("MPI rendezvous: a truncated message from rank {}", status.MPI_SOURCE));
    }
    known_[in.substr(at, key_size)] = std::vector<char>(in.begin() + static_cast<std::ptrdiff_t>(at + key_size), in.end());
    return true;
  }

  MPI_Comm comm_;
  int rank_;
  int size_;
  Clock::time_point deadline_;
  std::map<std::string, std::vector<char>> known_;
  std::vector<Send> sends_;  // a deque would do; a vector is fine: Send holds the request by value
  int ends_ = 0;
  std::vector<std::string> timed_out_keys_;
};

class MpiRendezvous final : public Rendezvous {
 public:
  MpiRendezvous(const RankInfo& ranks, MPI_Comm comm, milliseconds timeout)
      : Rendezvous(ranks, timeout), comm_(comm), store_(comm, ranks.rank, ranks.world_size, deadline_) {}
  ~MpiRendezvous() override {
    if (finished_) MPI_Comm_free(&comm_);  // else messages may still be in flight on it
  }

  gloo::rendezvous::Store& store() override { return store_; }
  std::string describe() const override { return fmt::format("MPI ({})", library_version()); }
  void completed() override {
    finished_ = store_.finish(Clock::now() + timeout_);
    if (!finished_) {
      TZ_LOG_WARN("comm", "MPI rendezvous: rank {} of {} did not hear every rank's end marker within {} ms after "
                  "the communicator was made (the communicator works; the rendezvous' messages are left to exit)",
                  ranks_.rank, ranks_.world_size, timeout_.count());
    }
  }
  void publish_host(const std::string& address) override {
    const std::string text = fmt::format("{} ({})", host_name(), address);
    store_.set(host_key(ranks_.rank), std::vector<char>(text.begin(), text.end()));
  }

 protected:
  std::optional<std::string> peek(const std::string& key) override { return store_.peek(key); }
  std::vector<std::string> timed_out_keys() const override { return store_.timed_out_keys(); }
  std::string hint() const override {
    return "is every rank of the mpirun job a tierzero program creating its communicator?";
  }

 private:
  MPI_Comm comm_;
  MpiMailboxStore store_;
  bool finished_ = false;
};

// MPI_Comm_idup of MPI_COMM_WORLD, polled until the deadline (it is collective).
Expected<MPI_Comm> duplicate_world(Clock::time_point deadline, milliseconds timeout, const RankInfo& ranks) {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Request request = MPI_REQUEST_NULL;
  if (const int rc = MPI_Comm_idup(MPI_COMM_WORLD, &comm, &request); rc != MPI_SUCCESS) {
    return io_error("MPI_Comm_idup on {}: {}", host_name(), mpi_error(rc));
  }
  std::vector<MPI_Request> requests{request};
  if (!wait_all(requests, deadline)) {
    mpi_process().failed = true;
    return timeout_error("rendezvous through MPI timed out after {} ms: rank {} of {} on {} waited for every rank "
                         "to join MPI_Comm_idup; is every rank of the mpirun job a tierzero program creating its "
                         "communicator?", timeout.count(), ranks.rank, ranks.world_size, host_name());
  }
  return comm;
}

}  // namespace

bool mpi_built() { return true; }

Expected<std::unique_ptr<Rendezvous>> open_mpi_rendezvous(const RankInfo& ranks, milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  TZ_TRY(ensure_initialised(deadline, timeout, ranks));
  std::lock_guard lock(mpi_process().mu);  // MPI_THREAD_SERIALIZED: one MPI caller at a time
  int rank = -1;
  int size = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (rank != ranks.rank || size != ranks.world_size) {
    return invalid_argument(
        "{} sees this process as rank {} of {}, but the launcher's variables ({}) say rank {} of {}: launch with the "
        "mpirun of the MPI tierzero was built with ({}), or name a rendezvous directory (TIERZERO_RENDEZVOUS_DIR)",
        library_version(), rank, size, ranks.source, ranks.rank, ranks.world_size, library_version());
  }
  TZ_ASSIGN_OR_RETURN(MPI_Comm comm, duplicate_world(deadline, timeout, ranks));
  return std::unique_ptr<Rendezvous>(std::make_unique<MpiRendezvous>(ranks, comm, timeout));
}

}  // namespace tz::comm_detail
