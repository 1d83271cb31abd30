// Helpers for the communicator tests: ranks as fork()ed processes on
// localhost, a fresh rendezvous directory per test, deterministic random data
// and plain references.
//
//   TempDir dir;
//   auto outcomes = run_ranks(4, [&](int rank) -> std::string {
//     auto comm = create_communicator(test_options(rank, 4, dir.path(), next_port()));
//     if (!comm.ok()) return comm.status().to_string();
//     ...
//     return "";   // passed; anything else is the failure message
//   });
//   EXPECT_ALL_RANKS_PASS(outcomes);
//
// Each child returns its verdict through a pipe and _exit()s (it never runs
// the rest of the test binary); the parent stays single-threaded, so fork()
// is safe. Children still running after the limit are killed.
#pragma once

#include <gtest/gtest.h>
#include <poll.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "tierzero/comm/communicator.h"

namespace tz::test {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct RankOutcome {
  int rank = -1;
  int exit_code = -1;   // when the child exited
  int signal = 0;       // when a signal ended it
  std::string message;  // what the child reported ("" when it passed)
  bool passed() const { return signal == 0 && exit_code == 0; }
};

inline std::string describe(const RankOutcome& o) {
  if (o.signal != 0) return fmt::format("rank {}: killed by signal {} {}", o.rank, o.signal, o.message);
  return fmt::format("rank {}: exit {} {}", o.rank, o.exit_code, o.message);
}

namespace detail {

// The child's side: run the body, write its verdict, _exit() (never return
// into the test binary).
[[noreturn]] inline void run_child(int rank, const std::function<std::string(int)>& body, int report_fd) {
  std::string message;
  try {
    message = body(rank);
  } catch (const std::exception& e) {
    message = fmt::format("exception: {}", e.what());
  }
#if defined(__SANITIZE_ADDRESS__)
  // _exit() skips LeakSanitizer's exit-time check; run it here, after the
  // communicator the body made is gone.
  if (message.empty() && __lsan_do_recoverable_leak_check() != 0) message = "LeakSanitizer found leaks";
#endif
  for (std::size_t done = 0; done < message.size();) {
    const ssize_t n = ::write(report_fd, message.data() + done, message.size() - done);
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  ::_exit(message.empty() ? 0 : 1);
}

// Reads every child's report until EOF (its exit) or the deadline; returns
// which pipes are still open.
inline std::vector<bool> read_reports(const std::vector<int>& fds, std::vector<RankOutcome>& outcomes,
                                      Clock::time_point deadline) {
  std::vector<bool> open(fds.size(), true);
  for (std::size_t remaining = fds.size(); remaining > 0 && Clock::now() < deadline;) {
    std::vector<pollfd> polls;
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (open[i]) polls.push_back({fds[i], POLLIN, 0});
    }
    if (::poll(polls.data(), polls.size(), 100) <= 0) continue;
    for (const pollfd& p : polls) {
      if (p.revents == 0) continue;
      const auto i = static_cast<std::size_t>(std::find(fds.begin(), fds.end(), p.fd) - fds.begin());
      char chunk[4096];
      const ssize_t n = ::read(p.fd, chunk, sizeof(chunk));
      if (n > 0) {
        outcomes[i].message.append(chunk, static_cast<std::size_t>(n));
      } else {
        open[i] = false;
        --remaining;
      }
    }
  }
  return open;
}

}  // namespace detail

// Runs body(rank) for each of `ranks` in its own child process (a job with
// some ranks missing, or a single rank).
inline std::vector<RankOutcome> run_listed_ranks(const std::vector<int>& ranks,
                                                 const std::function<std::string(int)>& body,
                                                 std::chrono::seconds limit = std::chrono::seconds(120)) {
  std::fflush(nullptr);  // or buffered output would be written twice
  std::vector<RankOutcome> outcomes;
  std::vector<pid_t> pids;
  std::vector<int> fds;
  for (int rank : ranks) {
    int pipe_fds[2];
    if (::pipe(pipe_fds) != 0) std::abort();
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(pipe_fds[0]);
      detail::run_child(rank, body, pipe_fds[1]);
    }
    ::close(pipe_fds[1]);
    outcomes.push_back({.rank = rank});
    pids.push_back(pid);
    fds.push_back(pipe_fds[0]);
  }
  const std::vector<bool> open = detail::read_reports(fds, outcomes, Clock::now() + limit);
  for (std::size_t i = 0; i < pids.size(); ++i) {
    if (open[i]) {
      ::kill(pids[i], SIGKILL);
      outcomes[i].message += fmt::format(" [still running after {} s: killed by the test]", limit.count());
    }
    int status = 0;
    ::waitpid(pids[i], &status, 0);
    ::close(fds[i]);
    if (WIFEXITED(status)) outcomes[i].exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) outcomes[i].signal = WTERMSIG(status);
  }
  return outcomes;
}

// Runs ranks 0 .. world-1.
inline std::vector<RankOutcome> run_ranks(int world, const std::function<std::string(int)>& body,
                                          std::chrono::seconds limit = std::chrono::seconds(120)) {
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(r);
  return run_listed_ranks(ranks, body, limit);
}

#define EXPECT_ALL_RANKS_PASS(outcomes)                                     \
  for (const ::tz::test::RankOutcome& tz_outcome_ : (outcomes)) {           \
    EXPECT_TRUE(tz_outcome_.passed()) << ::tz::test::describe(tz_outcome_); \
  }

// A fresh rendezvous directory, removed with its contents at the end.
class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/tz-comm-test-XXXXXX";
    if (::mkdtemp(pattern) == nullptr) std::abort();
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path_)) names.push_back(e.path().filename().string());
    return names;
  }

 private:
  std::string path_;
};

// MASTER_PORT only names the run (Gloo binds ephemeral ports), but distinct
// ports keep concurrently running tests apart even in a shared directory.
inline int next_port() {
  static std::atomic<int> counter{0};
  return 20000 + static_cast<int>(::getpid() % 2000) * 16 + counter.fetch_add(1) % 16;
}

inline CommOptions test_options(int rank, int world, const std::string& dir, int port,
                                milliseconds timeout = milliseconds(30000)) {
  CommOptions options;
  options.backend = CommBackend::kGloo;
  options.ranks = RankInfo{.rank = rank,
                           .world_size = world,
                           .local_rank = rank,
                           .local_world_size = world,
                           .master_addr = "127.0.0.1",
                           .master_port = port,
                           .source = "test"};
  options.timeout = timeout;
  options.rendezvous_dir = dir;
  return options;
}

// Deterministic "random" bits for (seed, rank, index): each rank can compute
// every other rank's input, so the reference needs no communication.
inline std::uint64_t mix(std::uint64_t seed, int rank, std::uint64_t index) {
  std::uint64_t z = seed * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(rank) * 0xD1B54A32D192ED03ULL + index;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Uniform in [-1, 1).
inline double uniform(std::uint64_t seed, int rank, std::uint64_t index) {
  return static_cast<double>(mix(seed, rank, index) >> 11) * 0x1.0p-52 - 1.0;
}

inline double elapsed_ms(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

}  // namespace tz::test
