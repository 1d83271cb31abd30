// RankAgreement over 1, 2 and 3 ranks (processes on this machine, Gloo), on
// its own: no engine. agree() with equal and different values and with a
// refusal; broadcast() of the root's bytes, and of sizes the ranks disagree on;
// the serialiser runs every collective.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <vector>

#include "tierzero/comm/agreement.h"
#include "tierzero/testing/ranks.h"

namespace tz {
namespace {

using test::next_port;
using test::run_ranks;
using test::TempDir;
using test::test_options;

// One rank's device (the Host backend) and a small device pool, as the engine's.
struct RankSide {
  std::unique_ptr<Device> device = create_host_device();
  std::unique_ptr<MemoryPool> pool;
  std::string make() {
    auto made = make_device_pool(*device, 1 << 20);
    if (!made.ok()) return made.status().to_string();
    pool = std::move(*made);
    return "";
  }
};

TEST(RankAgreement, OneRankAgreesWithItselfWithoutTheNetwork) {
  auto comm = create_communicator({});
  ASSERT_TRUE(comm.ok()) << comm.status().to_string();
  RankSide side;
  ASSERT_EQ(side.make(), "");
  RankAgreement ranks(**comm, *side.device, *side.pool);
  EXPECT_TRUE(ranks.agree("anything", Status(), "test").ok());
  const Status refused = ranks.agree("x", invalid_argument("no, because"), "test");
  EXPECT_EQ(refused.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("no, because"), std::string::npos) << refused.to_string();
  std::vector<std::uint8_t> bytes(16, 7);
  EXPECT_TRUE(ranks.broadcast(bytes.data(), bytes.size(), 0).ok());
  EXPECT_EQ(bytes, std::vector<std::uint8_t>(16, 7));
  const Status root = ranks.broadcast(bytes.data(), bytes.size(), 1);
  EXPECT_EQ(root.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(root.message().find("root rank 1 is not one of the 1 rank(s)"), std::string::npos) << root.to_string();
}

// Equal values pass; different values fail on every rank, quoting its own;
// one rank's refusal fails it with its reason and the others with a count;
// broadcast puts the root's bytes on every rank and refuses sizes that differ.
TEST(RankAgreement, AgreeAndBroadcastAreCollectives) {
  for (const int world : {2, 3}) {
    TempDir dir;
    const int port = next_port();
    const auto outcomes = run_ranks(world, [&](int rank) -> std::string {
      auto comm = create_communicator(test_options(rank, world, dir.path(), port));
      if (!comm.ok()) return comm.status().to_string();
      RankSide side;
      if (std::string failed = side.make(); !failed.empty()) return failed;
      int serialised = 0;
      RankAgreement ranks(**comm, *side.device, *side.pool, [&](const std::function<Status()>& collective) {
        ++serialised;
        return collective();
      });
      if (Status s = ranks.agree("same", Status(), "test"); !s.ok()) return "equal: " + s.to_string();
      const Status differ = ranks.agree(rank == 0 ? "zero" : "one", Status(), "test");
      if (differ.code() != ErrorCode::kInvalidArgument ||
          differ.message().find("the ranks name different values (this rank: '" +
                                std::string(rank == 0 ? "zero" : "one") + "')") == std::string::npos) {
        return "different: " + differ.to_string();
      }
      const Status refused = ranks.agree("same", rank == 1 ? invalid_argument("rank 1 says no") : Status(), "test");
      const std::string want = rank == 1 ? "rank 1 says no" : "test: 1 other rank(s) failed";
      if (refused.ok() || refused.message().find(want) == std::string::npos) return "refused: " + refused.to_string();
      std::vector<std::uint8_t> bytes(1000, static_cast<std::uint8_t>(rank + 10));
      if (Status s = ranks.broadcast(bytes.data(), bytes.size(), 1); !s.ok()) return "broadcast: " + s.to_string();
      if (bytes != std::vector<std::uint8_t>(1000, 11)) return "broadcast: not the root's bytes";
      const Status sizes = ranks.broadcast(bytes.data(), rank == 0 ? 10 : 20, 0);
      if (sizes.message().find("the ranks name different sizes or roots") == std::string::npos) {
        return "sizes: " + sizes.to_string();
      }
      if (bytes != std::vector<std::uint8_t>(1000, 11)) return "a refused broadcast wrote";
      if (Status s = ranks.barrier(); !s.ok()) return "barrier: " + s.to_string();
      // Every collective above went through the serialiser: 7 agreements' and
      // broadcasts' reductions, 1 broadcast, 1 barrier.
      if (serialised != 9) return fmt::format("{} collectives went through the serialiser, want 9", serialised);
      return "";
    });
    EXPECT_ALL_RANKS_PASS(outcomes);
  }
}

// Settings that agree pass with one reduction; settings that differ fail on
// every rank naming the first differing setting, rank 0's value and the
// lowest differing rank's, whichever rank is asked (Note [Agreeing on settings]).
TEST(RankAgreement, SettingsThatDifferAreNamedOnEveryRank) {
  const int world = 3;
  TempDir dir;
  const int port = next_port();
  const auto outcomes = run_ranks(world, [&](int rank) -> std::string {
    auto comm = create_communicator(test_options(rank, world, dir.path(), port));
    if (!comm.ok()) return comm.status().to_string();
    RankSide side;
    if (std::string failed = side.make(); !failed.empty()) return failed;
    RankAgreement ranks(**comm, *side.device, *side.pool);
    RankAgreement::Settings settings = {{"stage", "3"}, {"optimizer.lr", "0.0003"}, {"gradient_clipping", "1"}};
    if (Status s = ranks.agree_on_settings(settings, "test", "load one config"); !s.ok()) return "same: " + s.to_string();
    // Rank 2 differs at lr and clipping, rank 1 only at clipping: lr is first.
    if (rank == 2) settings[1].second = "0.001";
    if (rank >= 1) settings[2].second = "0";
    Status s = ranks.agree_on_settings(settings, "test", "load one config");
    const std::string want =
        "test: the ranks' settings differ, first at optimizer.lr: rank 0 has 'optimizer.lr = 0.0003', rank 2 has "
        "'optimizer.lr = 0.001'; load one config";
    if (s.code() != ErrorCode::kInvalidArgument || s.message() != want) return "lr: " + s.to_string();
    // One more setting on rank 1 only.
    settings = {{"stage", "3"}};
    if (rank == 1) settings.push_back({"fp16", "true"});
    s = ranks.agree_on_settings(settings, "test", "do the same");
    if (s.message().find("first at fp16: rank 0 has '(no more settings)', rank 1 has 'fp16 = true'") == std::string::npos) {
      return "extra: " + s.to_string();
    }
    return "";
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

}  // namespace
}  // namespace tz
