// Ranks meeting through a RendezvousStore (Note [Store rendezvous]): an
// in-memory store shared by ranks run as threads of this process, so a test
// can look inside the store and make it fail. The network store itself
// (torch's TCPStore, across machines) is tests/python/test_store.py's and
// tests/multinode's.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tierzero/comm.h"

namespace tz {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

class MemoryStore final : public RendezvousStore {
 public:
  Status set(const std::string& key, const std::vector<char>& value) override {
    std::lock_guard lock(mu_);
    values_[key] = value;
    changed_.notify_all();
    return ok_status();
  }
  Expected<std::vector<char>> get(const std::string& key, milliseconds timeout) override {
    std::unique_lock lock(mu_);
    if (!changed_.wait_for(lock, timeout, [&] { return values_.contains(key); })) {
      return timeout_error("memory store: key {} was not set within {} ms", key, timeout.count());
    }
    return values_.at(key);
  }
  Expected<std::int64_t> add(const std::string& key, std::int64_t delta) override {
    if (!fail_with_.empty()) return io_error("{}", fail_with_);
    std::lock_guard lock(mu_);
    std::vector<char>& value = values_[key];
    const std::int64_t sum = (value.empty() ? 0 : std::stoll(std::string(value.begin(), value.end()))) + delta;
    const std::string text = std::to_string(sum);
    value.assign(text.begin(), text.end());
    return sum;
  }
  Status erase(const std::string& key) override {
    std::lock_guard lock(mu_);
    values_.erase(key);
    return ok_status();
  }
  std::string describe() const override { return "memory store (test)"; }

  std::vector<std::string> keys() {
    std::lock_guard lock(mu_);
    std::vector<std::string> out;
    for (const auto& [key, value] : values_) out.push_back(key);
    return out;
  }
  void fail_with(std::string message) { fail_with_ = std::move(message); }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::vector<char>> values_;
  std::string fail_with_;
};

CommOptions store_options(int rank, int world, std::shared_ptr<RendezvousStore> store,
                          milliseconds timeout = milliseconds(30000)) {
  CommOptions options;
  options.backend = CommBackend::kGloo;
  options.ranks = RankInfo{.rank = rank, .world_size = world, .local_rank = rank, .local_world_size = world,
                           .master_addr = "127.0.0.1", .master_port = 1, .source = "test"};
  options.timeout = timeout;
  options.store = std::move(store);
  return options;
}

// Runs body(rank) for each listed rank on its own thread; returns each one's verdict ("" = passed).
std::vector<std::string> run_threads(const std::vector<int>& ranks, const std::function<std::string(int)>& body) {
  std::vector<std::string> verdicts(ranks.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] { verdicts[i] = body(ranks[i]); });
  }
  for (std::thread& t : threads) t.join();
  return verdicts;
}

void expect_all_pass(const std::vector<std::string>& verdicts) {
  for (std::size_t i = 0; i < verdicts.size(); ++i) EXPECT_EQ(verdicts[i], "") << "rank thread " << i;
}

std::string sum_of_ranks(Communicator& comm) {
  std::int64_t v = comm.rank() + 1;
  if (Status st = comm.all_reduce(&v, 1, DType::kInt64, ReduceOp::kSum); !st.ok()) return st.to_string();
  const std::int64_t want = static_cast<std::int64_t>(comm.size()) * (comm.size() + 1) / 2;
  return v == want ? "" : fmt::format("sum {}, want {}", v, want);
}

TEST(StoreRendezvous, RanksMeetThroughTheStoreAndEraseTheirKeys) {
  auto store = std::make_shared<MemoryStore>();
  expect_all_pass(run_threads({0, 1, 2}, [&](int rank) -> std::string {
    auto comm = create_communicator(store_options(rank, 3, store));
    if (!comm.ok()) return comm.status().to_string();
    return sum_of_ranks(**comm);
  }));
  // Only each rank's communicator counter is left: the addresses went after the barrier.
  EXPECT_EQ(store->keys(), (std::vector<std::string>{"tierzero/communicators/0", "tierzero/communicators/1",
                                                     "tierzero/communicators/2"}));
}

TEST(StoreRendezvous, EachCommunicatorTakesAFreshNamespace) {
  auto store = std::make_shared<MemoryStore>();
  for (int round = 1; round <= 2; ++round) {
    expect_all_pass(run_threads({0, 1}, [&](int rank) -> std::string {
      auto comm = create_communicator(store_options(rank, 2, store));
      if (!comm.ok()) return comm.status().to_string();
      return sum_of_ranks(**comm);
    }));
    auto count = store->get("tierzero/communicators/1", milliseconds(1));
    ASSERT_TRUE(count.ok());
    EXPECT_EQ(std::string(count->begin(), count->end()), std::to_string(round));
  }
}

// Rank 1 of 3 never starts: ranks 0 and 2 fail in about one timeout, naming
// the store, the missing rank, and the rank they did hear from with its host.
TEST(StoreRendezvous, MissingRankTimesOutNamingTheStoreTheRankAndTheHosts) {
  auto store = std::make_shared<MemoryStore>();
  const milliseconds timeout(1500);
  expect_all_pass(run_threads({0, 2}, [&](int rank) -> std::string {
    const Clock::time_point start = Clock::now();
    auto comm = create_communicator(store_options(rank, 3, store, timeout));
    const auto ms = std::chrono::duration_cast<milliseconds>(Clock::now() - start).count();
    if (comm.ok()) return "met without rank 1";
    const Status& st = comm.status();
    std::fprintf(stderr, "  rank %d after %lld ms: %s\n", rank, static_cast<long long>(ms), st.to_string().c_str());
    if (st.code() != ErrorCode::kTimeout) return "not a Timeout: " + st.to_string();
    if (ms < 0.9 * timeout.count() || ms > 3 * timeout.count()) return fmt::format("took {} ms", ms);
    const int other = rank == 0 ? 2 : 0;
    for (const std::string& part : {std::string("memory store (test)"), std::string("rank(s) 1 to arrive"),
                                    std::string("rank 1 not heard from"), fmt::format("rank {} on ", other)}) {
      if (!contains(st.message(), part)) return fmt::format("message lacks \"{}\"", part);
    }
    return "";
  }));
}

TEST(StoreRendezvous, AStoreThatFailsIsNamed) {
  auto store = std::make_shared<MemoryStore>();
  store->fail_with("connection refused (test)");
  auto comm = create_communicator(store_options(0, 2, store, milliseconds(1000)));
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), ErrorCode::kIoError);
  EXPECT_TRUE(contains(comm.status().message(), "memory store (test)")) << comm.status().to_string();
  EXPECT_TRUE(contains(comm.status().message(), "connection refused (test)")) << comm.status().to_string();
}

// GLOO_SOCKET_IFNAME picks the interface Gloo binds to, and a name that is
// no interface here is refused naming it.
TEST(StoreRendezvous, GlooSocketIfnameNamesTheInterface) {
  auto store = std::make_shared<MemoryStore>();
  ::setenv("GLOO_SOCKET_IFNAME", "lo", 1);
  expect_all_pass(run_threads({0, 1}, [&](int rank) -> std::string {
    auto comm = create_communicator(store_options(rank, 2, store));
    if (!comm.ok()) return comm.status().to_string();
    if (!contains((*comm)->describe(), "(lo)")) return "not bound to lo: " + (*comm)->describe();
    return sum_of_ranks(**comm);
  }));
  ::setenv("GLOO_SOCKET_IFNAME", "tz-none0", 1);
  auto comm = create_communicator(store_options(0, 2, store, milliseconds(1000)));
  ::unsetenv("GLOO_SOCKET_IFNAME");
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(comm.status().message(), "\"tz-none0\"")) << comm.status().to_string();
  EXPECT_TRUE(contains(comm.status().message(), "GLOO_SOCKET_IFNAME")) << comm.status().to_string();
}

}  // namespace
}  // namespace tz
