// Faults in a running job: a rank killed (SIGKILL) before or during a
// collective, and a rank that stays alive but stops taking part. The others
// must return an error (IoError or Timeout) naming the collective, its size
// and their rank, within a few timeouts, and must not die themselves (Gloo
// writing to a dead peer raises SIGPIPE; see Note [SIGPIPE]).
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tierzero/testing/ranks.h"
#include "tierzero/comm/communicator.h"

namespace tz {
namespace {

using test::Clock;
using test::elapsed_ms;
constexpr auto kTimeout = std::chrono::milliseconds(3000);
constexpr std::size_t kCount = std::size_t{1} << 20;

enum class Collective { kAllReduce, kAllGather, kReduceScatter, kBroadcast };

std::string_view collective_name(Collective c) {
  switch (c) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kBroadcast: return "broadcast";
  }
  return "?";
}

// Buffers for one collective of kCount fp32 per rank, reused across calls.
struct Workload {
  Workload(Collective c, int world) : collective(c), send(kCount * static_cast<std::size_t>(world), 1.0F),
                                      recv(kCount * static_cast<std::size_t>(world), 0.0F) {}
  Status issue(Communicator& comm) {
    switch (collective) {
      case Collective::kAllReduce: return comm.all_reduce(send.data(), kCount, DType::kFp32, ReduceOp::kSum);
      case Collective::kAllGather: return comm.all_gather(send.data(), recv.data(), kCount, DType::kFp32);
      case Collective::kReduceScatter:
        return comm.reduce_scatter(send.data(), recv.data(), kCount, DType::kFp32, ReduceOp::kSum);
      case Collective::kBroadcast: return comm.broadcast(send.data(), kCount * sizeof(float), 0);
    }
    return internal_error("unknown collective");
  }
  Collective collective;
  std::vector<float> send;
  std::vector<float> recv;
};

// What a surviving rank must see from its failed collective.
std::string check_failure(const Status& st, double ms, Collective c, int rank, int world) {
  if (st.code() != ErrorCode::kIoError && st.code() != ErrorCode::kTimeout) {
    return "neither IoError nor Timeout: " + st.to_string();
  }
  if (ms > 3.0 * static_cast<double>(kTimeout.count())) {
    return fmt::format("took {:.0f} ms, over 3x the {} ms timeout: {}", ms, kTimeout.count(), st.to_string());
  }
  const std::string size = c == Collective::kBroadcast ? fmt::format("{} bytes", kCount * sizeof(float))
                                                       : fmt::format("{} fp32", kCount);
  for (const std::string& part : {std::string(collective_name(c)), size, fmt::format("rank {} of {}", rank, world)}) {
    if (st.message().find(part) == std::string::npos) return fmt::format("message lacks \"{}\": {}", part, st.message());
  }
  std::fprintf(stderr, "  rank %d after %.0f ms: %s\n", rank, ms, st.to_string().c_str());
  return "";
}

// After a failure the communicator is closed: the next call says so at once.
std::string check_closed(Communicator& comm) {
  Status again = comm.barrier();
  if (again.code() != ErrorCode::kFailedPrecondition) return "a call after the failure: " + again.to_string();
  return "";
}

struct KillCase {
  int world;
  int victim;
  Collective collective;
  bool mid_collective;  // else the victim dies between collectives
};

std::string kill_case_name(const ::testing::TestParamInfo<KillCase>& info) {
  return fmt::format("World{}_Rank{}_{}_{}", info.param.world, info.param.victim,
                     collective_name(info.param.collective), info.param.mid_collective ? "Mid" : "Before");
}

class KilledRank : public ::testing::TestWithParam<KillCase> {};

TEST_P(KilledRank, OtherRanksFailWithinTheTimeout) {
  const KillCase kc = GetParam();
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_ranks(kc.world, [&](int rank) -> std::string {
    auto created = create_communicator(test::test_options(rank, kc.world, dir.path(), port, kTimeout));
    if (!created.ok()) return created.status().to_string();
    Communicator& comm = **created;
    if (Status st = comm.barrier(); !st.ok()) return st.to_string();
    Workload work(kc.collective, kc.world);
    if (rank == kc.victim) {
      if (!kc.mid_collective) ::kill(::getpid(), SIGKILL);
      std::thread([] {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        ::kill(::getpid(), SIGKILL);
      }).detach();
    } else if (!kc.mid_collective) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the victim is gone before we start
    }
    const Clock::time_point give_up = Clock::now() + std::chrono::seconds(30);
    while (Clock::now() < give_up) {
      const Clock::time_point start = Clock::now();
      Status st = work.issue(comm);
      if (st.ok()) continue;
      if (std::string e = check_failure(st, elapsed_ms(start), kc.collective, rank, kc.world); !e.empty()) return e;
      return check_closed(comm);
    }
    return rank == kc.victim ? "the victim outlived its kill" : "no error 30 s after the victim died";
  });
  for (const test::RankOutcome& o : outcomes) {
    if (o.rank == kc.victim) {
      EXPECT_EQ(o.signal, SIGKILL) << test::describe(o);
    } else {
      EXPECT_TRUE(o.passed()) << test::describe(o);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, KilledRank,
    ::testing::Values(KillCase{2, 1, Collective::kAllReduce, false}, KillCase{4, 1, Collective::kAllReduce, false},
                      KillCase{4, 0, Collective::kAllGather, false}, KillCase{2, 0, Collective::kAllReduce, true},
                      KillCase{4, 2, Collective::kAllReduce, true}, KillCase{4, 1, Collective::kAllGather, true},
                      KillCase{4, 3, Collective::kReduceScatter, true}, KillCase{4, 0, Collective::kBroadcast, true},
                      KillCase{4, 2, Collective::kReduceScatter, false}),
    kill_case_name);

// The victim never posts its receive for a large broadcast, so the root sits
// in Gloo's send handshake (Gloo pushes data only once the receiver is
// ready), and then dies: the root must notice the closed connection there too.
TEST(KilledRank, RootWaitingForAPeerThatDiesFailsFast) {
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
    auto created = create_communicator(test::test_options(rank, 2, dir.path(), port, kTimeout));
    if (!created.ok()) return created.status().to_string();
    Communicator& comm = **created;
    if (Status st = comm.barrier(); !st.ok()) return st.to_string();
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      ::kill(::getpid(), SIGKILL);
    }
    std::vector<std::uint8_t> big(std::size_t{64} << 20, 1);
    const Clock::time_point start = Clock::now();
    Status st = comm.broadcast(big.data(), big.size(), 0);
    const double ms = elapsed_ms(start);
    if (st.ok()) return "a broadcast to a rank that never joined succeeded";
    if (st.code() != ErrorCode::kIoError) return "not an IoError: " + st.to_string();
    if (ms > static_cast<double>(kTimeout.count())) return fmt::format("took {:.0f} ms: {}", ms, st.to_string());
    std::fprintf(stderr, "  rank 0 after %.0f ms: %s\n", ms, st.to_string().c_str());
    return "";
  });
  EXPECT_TRUE(outcomes[0].passed()) << test::describe(outcomes[0]);
  EXPECT_EQ(outcomes[1].signal, SIGKILL) << test::describe(outcomes[1]);
}

// A rank that is alive but never joins the collective: the others time out
// (Timeout, not IoError) after about one timeout, not before.
class StalledRank : public ::testing::TestWithParam<Collective> {};

TEST_P(StalledRank, OtherRanksTimeOut) {
  const Collective collective = GetParam();
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
    auto created = create_communicator(test::test_options(rank, 2, dir.path(), port, kTimeout));
    if (!created.ok()) return created.status().to_string();
    Communicator& comm = **created;
    if (Status st = comm.barrier(); !st.ok()) return st.to_string();
    if (rank == 1) {
      std::this_thread::sleep_for(kTimeout * 3 / 2);  // alive and silent until after rank 0 gives up
      return "";
    }
    Workload work(collective, 2);
    const Clock::time_point start = Clock::now();
    Status st = work.issue(comm);
    const double ms = elapsed_ms(start);
    if (st.code() != ErrorCode::kTimeout) return "not a Timeout: " + st.to_string();
    if (ms < 0.9 * static_cast<double>(kTimeout.count())) return fmt::format("gave up early, after {:.0f} ms", ms);
    if (std::string e = check_failure(st, ms, collective, rank, 2); !e.empty()) return e;
    return check_closed(comm);
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

// The timeout names what this rank was in and what the silent one last did
// (Note [What the other ranks were doing]): after 1000 timed all-reduces,
// rank 1 takes part in collective #1001 of step 7 for a checkpoint, then goes
// quiet; rank 0's #1002 of step 8 times out.
TEST(StalledRank, TheTimeoutSaysWhatTheSilentRankLastDid) {
  test::TempDir dir;
  const int port = test::next_port();
  constexpr auto kShort = std::chrono::milliseconds(1500);
  auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
    auto created = create_communicator(test::test_options(rank, 2, dir.path(), port, kShort));
    if (!created.ok()) return created.status().to_string();
    Communicator& comm = **created;
    // What a collective costs here, posting included (PhaseBoard.PostingCosts... times the posting alone).
    std::int64_t one = 1;
    constexpr int kTimed = 1000;
    const Clock::time_point start = Clock::now();
    for (int i = 0; i < kTimed; ++i) {
      if (Status st = comm.all_reduce(&one, 1, DType::kInt64, ReduceOp::kMax); !st.ok()) return st.to_string();
    }
    if (rank == 0) std::fprintf(stderr, "  all_reduce of 1 int64 over loopback: %.1f us\n", elapsed_ms(start) * 1e3 / kTimed);
    comm.note_step(7);
    comm.note_activity("checkpoint /ckpt");
    if (Status st = comm.all_reduce(&one, 1, DType::kInt64, ReduceOp::kSum); !st.ok()) return st.to_string();
    comm.note_activity("");
    if (rank == 1) {
      std::this_thread::sleep_for(kShort * 2);  // alive, busy elsewhere
      return "";
    }
    comm.note_step(8);
    Status st = comm.all_reduce(&one, 1, DType::kInt64, ReduceOp::kSum);
    if (st.code() != ErrorCode::kTimeout) return "not a Timeout: " + st.to_string();
    std::fprintf(stderr, "  rank 0: %s\n", st.message().c_str());
    for (const char* part : {"this rank was in its collective #1002 (step 8)",
                             "rank 1 has not entered #1002: it left #1001 (all_reduce of 1 int64 (rank 1 of 2), "
                             "step 7, for checkpoint /ckpt)"}) {
      if (st.message().find(part) == std::string::npos) return fmt::format("lacks \"{}\": {}", part, st.message());
    }
    return "";
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) left.push_back(e.path().filename().string());
  EXPECT_TRUE(left.empty()) << "left in the rendezvous directory: " << fmt::format("{}", fmt::join(left, ", "));
}

std::string stalled_case_name(const ::testing::TestParamInfo<Collective>& info) {
  return std::string(collective_name(info.param));
}

INSTANTIATE_TEST_SUITE_P(Collectives, StalledRank,
                         ::testing::Values(Collective::kAllReduce, Collective::kReduceScatter,
                                           Collective::kAllGather),
                         stalled_case_name);

}  // namespace
}  // namespace tz
