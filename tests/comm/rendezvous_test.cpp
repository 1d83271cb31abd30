// The rendezvous (Note [Rendezvous runs] in comm/src/rendezvous.cpp):
// ranks that never arrive, stale files from a crashed job, two jobs on one
// directory and port, and a clean run leaving nothing behind.
#include <gtest/gtest.h>
#include <signal.h>

#include <string>
#include <thread>
#include <vector>

#include "tierzero/testing/ranks.h"
#include "tierzero/comm/communicator.h"

namespace tz {
namespace {

using test::Clock;
using test::elapsed_ms;
constexpr auto kShortTimeout = std::chrono::milliseconds(3000);

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// One all_reduce whose answer every rank can check.
std::string sum_of_ranks(Communicator& comm) {
  std::int64_t v = comm.rank() + 1;
  if (Status st = comm.all_reduce(&v, 1, DType::kInt64, ReduceOp::kSum); !st.ok()) return st.to_string();
  const std::int64_t want = static_cast<std::int64_t>(comm.size()) * (comm.size() + 1) / 2;
  return v == want ? "" : fmt::format("sum {}, want {}", v, want);
}

// A rank that fails to create its communicator must fail with Timeout, in
// about one timeout, naming the directory and every part in `message_has`.
std::string expect_rendezvous_timeout(const CommOptions& options, const std::vector<std::string>& message_has) {
  const Clock::time_point start = Clock::now();
  auto created = create_communicator(options);
  const double ms = elapsed_ms(start);
  if (created.ok()) return "create_communicator succeeded without the missing rank";
  const Status& st = created.status();
  if (st.code() != ErrorCode::kTimeout) return "not a Timeout: " + st.to_string();
  const double timeout_ms = static_cast<double>(options.timeout.count());
  if (ms < 0.9 * timeout_ms || ms > 3 * timeout_ms) {
    return fmt::format("failed after {:.0f} ms with a {:.0f} ms timeout: {}", ms, timeout_ms, st.to_string());
  }
  std::vector<std::string> parts = message_has;
  parts.push_back(options.rendezvous_dir);
  for (const std::string& part : parts) {
    if (!contains(st.message(), part)) return fmt::format("message lacks \"{}\": {}", part, st.message());
  }
  std::fprintf(stderr, "  rank %d after %.0f ms: %s\n", options.ranks.rank, ms, st.to_string().c_str());
  return "";
}

TEST(Rendezvous, MissingRankTimesOutNamingTheDirectoryAndTheRank) {
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_listed_ranks({0}, [&](int rank) {
    return expect_rendezvous_timeout(test::test_options(rank, 2, dir.path(), port, kShortTimeout), {"rank(s) 1"});
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

TEST(Rendezvous, MissingRankZeroTimesOutNamingTheDirectory) {
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_listed_ranks({1}, [&](int rank) {
    return expect_rendezvous_timeout(test::test_options(rank, 2, dir.path(), port, kShortTimeout),
                                     {"rank 1 of 2", "no run file"});
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

// Rank 2 of 4 never starts: every other rank reports it by number.
TEST(Rendezvous, EveryRankNamesTheOneThatNeverArrived) {
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_listed_ranks({0, 1, 3}, [&](int rank) {
    return expect_rendezvous_timeout(test::test_options(rank, 4, dir.path(), port, kShortTimeout), {"rank(s) 2"});
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

TEST(Rendezvous, CleanRunLeavesTheDirectoryEmptyAndCanRunAgain) {
  test::TempDir dir;
  const int port = test::next_port();
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto outcomes = test::run_ranks(4, [&](int rank) -> std::string {
      auto created = create_communicator(test::test_options(rank, 4, dir.path(), port));
      if (!created.ok()) return created.status().to_string();
      return sum_of_ranks(**created);
    });
    EXPECT_ALL_RANKS_PASS(outcomes);
    EXPECT_TRUE(dir.entries().empty()) << "left behind: " << fmt::format("{}", fmt::join(dir.entries(), ", "));
  }
}

// A job killed during its rendezvous leaves its run file and keys behind. The
// next job with the same directory and port must neither read them nor trip
// over them, even when a non-zero rank starts before the new rank 0.
TEST(Rendezvous, StaleFilesFromACrashedJobAreIgnored) {
  test::TempDir dir;
  const int port = test::next_port();
  auto crashed = test::run_listed_ranks({0}, [&](int rank) -> std::string {
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      ::kill(::getpid(), SIGKILL);
    }).detach();
    auto created = create_communicator(test::test_options(rank, 2, dir.path(), port, std::chrono::seconds(60)));
    return "create_communicator returned before the kill: " + created.status().to_string();
  });
  ASSERT_EQ(crashed[0].signal, SIGKILL) << test::describe(crashed[0]);
  const std::vector<std::string> stale = dir.entries();
  ASSERT_NE(std::find(stale.begin(), stale.end(), fmt::format("127.0.0.1-{}.run", port)), stale.end())
      << "the crashed job left no run file: " << fmt::format("{}", fmt::join(stale, ", "));

  auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
    if (rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1000));  // rank 1 meets the stale file
    auto created = create_communicator(test::test_options(rank, 2, dir.path(), port));
    if (!created.ok()) return created.status().to_string();
    return sum_of_ranks(**created);
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
  const std::vector<std::string> after = dir.entries();
  EXPECT_EQ(std::find(after.begin(), after.end(), fmt::format("127.0.0.1-{}.run", port)), after.end());
}

// Two live jobs with one directory and port would steal each other's ranks:
// the second rank 0 refuses to start.
TEST(Rendezvous, SecondLiveJobOnTheSameDirectoryAndPortIsRefused) {
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_ranks(2, [&](int job) -> std::string {
    if (job == 0) {  // job A's rank 0, waiting for a rank 1 that never comes
      return expect_rendezvous_timeout(test::test_options(0, 2, dir.path(), port, kShortTimeout), {"rank(s) 1"});
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    auto created = create_communicator(test::test_options(0, 2, dir.path(), port, kShortTimeout));
    if (created.ok()) return "job B's rank 0 joined job A's rendezvous";
    if (created.status().code() != ErrorCode::kAlreadyExists || !contains(created.status().message(), "another job")) {
      return "not the AlreadyExists we want: " + created.status().to_string();
    }
    return "";
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

TEST(Rendezvous, MissingDirectoryIsCreated) {
  test::TempDir parent;
  const std::string dir = parent.path() + "/nested/rendezvous";
  const int port = test::next_port();
  auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
    auto created = create_communicator(test::test_options(rank, 2, dir, port));
    if (!created.ok()) return created.status().to_string();
    return sum_of_ranks(**created);
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

}  // namespace
}  // namespace tz
