// Every collective of the Gloo backend (and the single-rank communicator, at
// world size 1) against a plain reference, on fresh random data, with ranks
// as processes on localhost.
//
// Tolerance for floating-point sums. A sum over N ranks takes N - 1 additions,
// each rounded once to the element type (fp32 in fp32; bf16 added in fp32 and
// rounded to bf16), whatever order the ring adds in. With unit roundoff u
// (2^-24 for fp32, 2^-8 for bf16: 8 significant bits, round to nearest) the
// classic bound for recursive summation is
//     |computed - exact| <= gamma(N-1) * sum |x_r|,  gamma(n) = n*u / (1 - n*u).
// The exact sum is taken in double (exact for these inputs). Max and min pick
// one input and must match exactly; integer sums wrap and must match exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tierzero/testing/ranks.h"
#include "tierzero/comm/communicator.h"
#include "tierzero/kernels.h"

namespace tz {
namespace {

using test::mix;
using test::uniform;

struct Fp32 {
  using T = float;
  static constexpr DType kType = DType::kFp32;
  static constexpr bool kInteger = false;
  static constexpr double kUnitRoundoff = 0x1.0p-24;
  static T make(std::uint64_t seed, int rank, std::uint64_t i) { return static_cast<float>(uniform(seed, rank, i)); }
  static double value(T v) { return v; }
};
struct Bf16 {
  using T = std::uint16_t;
  static constexpr DType kType = DType::kBf16;
  static constexpr bool kInteger = false;  // stored as uint16_t bits, reduced as a float
  static constexpr double kUnitRoundoff = 0x1.0p-8;
  static T make(std::uint64_t seed, int rank, std::uint64_t i) {
    return kernels::fp32_to_bf16(static_cast<float>(uniform(seed, rank, i)));
  }
  static double value(T v) { return kernels::bf16_to_fp32(v); }
};
struct Int64 {
  using T = std::int64_t;
  static constexpr DType kType = DType::kInt64;
  static constexpr bool kInteger = true;
  static constexpr double kUnitRoundoff = 0.0;
  static T make(std::uint64_t seed, int rank, std::uint64_t i) { return static_cast<T>(mix(seed, rank, i)); }
};

constexpr std::size_t kCounts[] = {0, 1, 1000, std::size_t{1} << 20};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin};

std::string_view op_name(ReduceOp op) {
  return op == ReduceOp::kSum ? "sum" : op == ReduceOp::kMax ? "max" : "min";
}

double gamma(int additions, double unit_roundoff) {
  return additions * unit_roundoff / (1.0 - additions * unit_roundoff);
}

// The largest error a check saw, as a fraction of its bound.
struct ErrorStats {
  double max_abs = 0.0;
  double max_ratio = 0.0;
};

// Checks got[i] == op over ranks r of input(r, i).
template <typename Tr, typename Input>
std::string check_reduced(std::string_view what, ReduceOp op, const typename Tr::T* got, std::size_t count,
                          int world, Input&& input, ErrorStats& stats) {
  using T = typename Tr::T;
  for (std::size_t i = 0; i < count; ++i) {
    if constexpr (Tr::kInteger) {
      std::uint64_t sum = 0;
      T best = input(0, i);
      for (int r = 0; r < world; ++r) {
        const T x = input(r, i);
        sum += static_cast<std::uint64_t>(x);
        best = op == ReduceOp::kMax ? std::max(best, x) : std::min(best, x);
      }
      const T want = op == ReduceOp::kSum ? static_cast<T>(sum) : best;
      if (got[i] != want) return fmt::format("{}: element {} is {}, want {}", what, i, got[i], want);
    } else {
      double exact = 0.0, magnitude = 0.0, best = Tr::value(input(0, i));
      for (int r = 0; r < world; ++r) {
        const double x = Tr::value(input(r, i));
        exact += x;
        magnitude += std::fabs(x);
        best = op == ReduceOp::kMax ? std::max(best, x) : std::min(best, x);
      }
      const double have = Tr::value(got[i]);
      if (op != ReduceOp::kSum) {
        if (have != best) return fmt::format("{}: element {} is {}, want {}", what, i, have, best);
        continue;
      }
      const double bound = gamma(world - 1, Tr::kUnitRoundoff) * magnitude;
      const double err = std::fabs(have - exact);
      stats.max_abs = std::max(stats.max_abs, err);
      if (bound > 0) stats.max_ratio = std::max(stats.max_ratio, err / bound);
      if (err > bound) {
        return fmt::format("{}: element {} is {}, exact sum {}, error {:.3g} > bound {:.3g}", what, i, have, exact,
                           err, bound);
      }
    }
  }
  return "";
}

std::uint64_t fnv1a(const void* data, std::size_t bytes) {
  std::uint64_t h = 1469598103934665603ULL;
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ static_cast<const std::uint8_t*>(data)[i]) * 1099511628211ULL;
  return h;
}

template <typename Tr>
struct RankCheck {
  Communicator& comm;
  std::uint64_t seed;
  int rank;
  int world;

  using T = typename Tr::T;
  std::uint64_t seed_for(std::string_view what, std::size_t count) const {
    return mix(seed, static_cast<int>(count), fnv1a(what.data(), what.size()));
  }
  std::string label(std::string_view what, std::size_t count) const {
    return fmt::format("{} {} count {} world {}", what, dtype_name(Tr::kType), count, world);
  }
  void report(std::string_view what, std::size_t count, const ErrorStats& stats) const {
    if (rank == 0 && world > 1 && count == kCounts[std::size(kCounts) - 1] && Tr::kUnitRoundoff > 0) {
      std::fprintf(stderr, "  %s: largest |error| %.3g = %.3f of the bound\n", label(what, count).c_str(),
                   stats.max_abs, stats.max_ratio);
    }
  }

  std::string all_gather(std::size_t count, bool in_place) const {
    const std::string what = label(in_place ? "all_gather in place" : "all_gather", count);
    const std::uint64_t s = seed_for("all_gather", count);
    std::vector<T> recv(count * static_cast<std::size_t>(world), T{});
    if (!recv.empty()) std::memset(recv.data(), 0xA5, recv.size() * sizeof(T));  // not what any rank sends
    std::vector<T> send(count);
    T* own = in_place ? recv.data() + static_cast<std::size_t>(rank) * count : send.data();
    for (std::size_t i = 0; i < count; ++i) own[i] = Tr::make(s, rank, i);
    Status st = comm.all_gather(own, recv.data(), count, Tr::kType);
    if (!st.ok()) return fmt::format("{}: {}", what, st.to_string());
    for (int r = 0; r < world; ++r) {
      for (std::size_t i = 0; i < count; ++i) {
        const T want = Tr::make(s, r, i);
        if (std::memcmp(&recv[static_cast<std::size_t>(r) * count + i], &want, sizeof(T)) != 0) {
          return fmt::format("{}: element {} of rank {}'s shard differs", what, i, r);
        }
      }
    }
    return "";
  }

  std::string reduce_scatter(std::size_t count, ReduceOp op, bool in_place) const {
    const std::string what = label(fmt::format("reduce_scatter {}{}", op_name(op), in_place ? " in place" : ""), count);
    const std::uint64_t s = seed_for(what, 0);
    const std::size_t total = count * static_cast<std::size_t>(world);
    std::vector<T> send(total);
    for (std::size_t j = 0; j < total; ++j) send[j] = Tr::make(s, rank, j);
    std::vector<T> out(in_place ? 0 : count);
    T* recv = in_place ? send.data() + static_cast<std::size_t>(rank) * count : out.data();
    Status st = comm.reduce_scatter(send.data(), recv, count, Tr::kType, op);
    if (!st.ok()) return fmt::format("{}: {}", what, st.to_string());
    ErrorStats stats;
    const std::size_t base = static_cast<std::size_t>(rank) * count;
    std::string error = check_reduced<Tr>(what, op, recv, count, world,
                                          [&](int r, std::size_t i) { return Tr::make(s, r, base + i); }, stats);
    if (op == ReduceOp::kSum && !in_place) report("reduce_scatter sum", count, stats);
    return error;
  }

  std::string all_reduce(std::size_t count, ReduceOp op) const {
    const std::string what = label(fmt::format("all_reduce {}", op_name(op)), count);
    const std::uint64_t s = seed_for(what, 0);
    std::vector<T> buf(count);
    for (std::size_t i = 0; i < count; ++i) buf[i] = Tr::make(s, rank, i);
    Status st = comm.all_reduce(buf.data(), count, Tr::kType, op);
    if (!st.ok()) return fmt::format("{}: {}", what, st.to_string());
    ErrorStats stats;
    std::string error = check_reduced<Tr>(what, op, buf.data(), count, world,
                                          [&](int r, std::size_t i) { return Tr::make(s, r, i); }, stats);
    if (!error.empty()) return error;
    if (op == ReduceOp::kSum) report("all_reduce sum", count, stats);
    // Replicas must not drift apart: every rank holds the same bits.
    std::int64_t mine = static_cast<std::int64_t>(fnv1a(buf.data(), buf.size() * sizeof(T)));
    std::vector<std::int64_t> all(static_cast<std::size_t>(world));
    st = comm.all_gather(&mine, all.data(), 1, DType::kInt64);
    if (!st.ok()) return fmt::format("{}: gathering result hashes: {}", what, st.to_string());
    for (int r = 0; r < world; ++r) {
      if (all[static_cast<std::size_t>(r)] != mine) return fmt::format("{}: rank {}'s result differs", what, r);
    }
    return "";
  }

  std::string broadcast(std::size_t count, int root) const {
    const std::string what = label(fmt::format("broadcast from {}", root), count);
    const std::uint64_t s = seed_for(what, 0);
    std::vector<T> buf(count);
    if (!buf.empty()) std::memset(buf.data(), 0x5A, buf.size() * sizeof(T));
    if (rank == root) {
      for (std::size_t i = 0; i < count; ++i) buf[i] = Tr::make(s, root, i);
    }
    Status st = comm.broadcast(buf.data(), count * sizeof(T), root);
    if (!st.ok()) return fmt::format("{}: {}", what, st.to_string());
    for (std::size_t i = 0; i < count; ++i) {
      const T want = Tr::make(s, root, i);
      if (std::memcmp(&buf[i], &want, sizeof(T)) != 0) return fmt::format("{}: element {} differs", what, i);
    }
    return "";
  }

  std::string all() const {
    for (std::size_t count : kCounts) {
      std::vector<std::string> errors = {all_gather(count, false), all_gather(count, true),
                                         reduce_scatter(count, ReduceOp::kSum, true), broadcast(count, 0),
                                         broadcast(count, world - 1)};
      for (ReduceOp op : kOps) {
        errors.push_back(reduce_scatter(count, op, false));
        errors.push_back(all_reduce(count, op));
      }
      for (const std::string& e : errors) {
        if (!e.empty()) return e;
      }
      if (Status st = comm.barrier(); !st.ok()) return st.to_string();
    }
    return "";
  }
};

struct CollectiveCase {
  int world;
  DType type;
};

std::string case_name(const ::testing::TestParamInfo<CollectiveCase>& info) {
  return fmt::format("World{}_{}", info.param.world, dtype_name(info.param.type));
}

class GlooCollectives : public ::testing::TestWithParam<CollectiveCase> {};

TEST_P(GlooCollectives, MatchThePlainReference) {
  const auto [world, type] = GetParam();
  const std::uint64_t seed = std::random_device{}();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_ranks(world, [&](int rank) -> std::string {
    auto created = create_communicator(test::test_options(rank, world, dir.path(), port));
    if (!created.ok()) return created.status().to_string();
    Communicator& comm = **created;
    if (comm.rank() != rank || comm.size() != world) return "wrong rank or size: " + comm.describe();
    switch (type) {
      case DType::kFp32: return RankCheck<Fp32>{comm, seed, rank, world}.all();
      case DType::kBf16: return RankCheck<Bf16>{comm, seed, rank, world}.all();
      default: return RankCheck<Int64>{comm, seed, rank, world}.all();
    }
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

INSTANTIATE_TEST_SUITE_P(WorldsAndTypes, GlooCollectives,
                         ::testing::Values(CollectiveCase{1, DType::kFp32}, CollectiveCase{1, DType::kBf16},
                                           CollectiveCase{1, DType::kInt64}, CollectiveCase{2, DType::kFp32},
                                           CollectiveCase{2, DType::kBf16}, CollectiveCase{2, DType::kInt64},
                                           CollectiveCase{4, DType::kFp32}, CollectiveCase{4, DType::kBf16},
                                           CollectiveCase{4, DType::kInt64}),
                         case_name);

// bf16 sums round to nearest, ties to even, once per addition: with 1.0 and
// 2^-8 (half a bf16 ulp at 1.0) the tie goes down to 1.0; from 1 + 2^-7 it
// goes up to 1 + 2^-6. Truncation or round-half-up would give other bits.
// fp16 and the remaining types get a smaller exact check.
TEST(GlooCollectives, Bf16SumRoundsToNearestEvenAndOtherTypesReduce) {
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
    auto created = create_communicator(test::test_options(rank, 2, dir.path(), port));
    if (!created.ok()) return created.status().to_string();
    Communicator& comm = **created;
    std::vector<std::uint16_t> bf16 = rank == 0 ? std::vector<std::uint16_t>{0x3F80, 0x3F81, 0xBF80}
                                                : std::vector<std::uint16_t>{0x3B80, 0x3B80, 0x3F80};
    if (Status st = comm.all_reduce(bf16.data(), 3, DType::kBf16, ReduceOp::kSum); !st.ok()) {
      return st.to_string();
    }
    if (bf16 != std::vector<std::uint16_t>{0x3F80, 0x3F82, 0x0000}) {
      return fmt::format("bf16 sums {:#06x} {:#06x} {:#06x}, want 0x3f80 0x3f82 0x0000", bf16[0], bf16[1], bf16[2]);
    }
    // fp16: 1 + 2^-11 is a tie at 1.0 (fp16 has 11 significant bits) -> 1.0.
    std::vector<std::uint16_t> fp16 = {rank == 0 ? std::uint16_t{0x3C00} : std::uint16_t{0x1000}};
    if (Status st = comm.all_reduce(fp16.data(), 1, DType::kFp16, ReduceOp::kSum); !st.ok()) {
      return st.to_string();
    }
    if (fp16[0] != 0x3C00) return fmt::format("fp16 1 + 2^-11 = {:#06x}, want 0x3c00", fp16[0]);
    std::int32_t i32[2] = {rank == 0 ? 2147483647 : 1, -rank};
    if (Status st = comm.all_reduce(i32, 2, DType::kInt32, ReduceOp::kSum); !st.ok()) return st.to_string();
    if (i32[0] != -2147483647 - 1 || i32[1] != -1) return fmt::format("int32 sums {} {}", i32[0], i32[1]);
    double f64[2] = {rank + 0.5, -1.0 * rank};
    if (Status st = comm.all_reduce(f64, 2, DType::kFp64, ReduceOp::kMin); !st.ok()) return st.to_string();
    if (f64[0] != 0.5 || f64[1] != -1.0) return fmt::format("fp64 mins {} {}", f64[0], f64[1]);
    std::uint8_t u8[2] = {static_cast<std::uint8_t>(200 + rank), 7};
    if (Status st = comm.all_reduce(u8, 2, DType::kUint8, ReduceOp::kSum); !st.ok()) return st.to_string();
    if (u8[0] != static_cast<std::uint8_t>(401) || u8[1] != 14) return fmt::format("uint8 sums {} {}", u8[0], u8[1]);
    // A NaN must survive max (an overflow flag must not vanish).
    float nan_max[1] = {rank == 0 ? std::nanf("") : 1.0F};
    if (Status st = comm.all_reduce(nan_max, 1, DType::kFp32, ReduceOp::kMax); !st.ok()) return st.to_string();
    if (!std::isnan(nan_max[0])) return fmt::format("max(NaN, 1) = {}", nan_max[0]);
    return "";
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

TEST(GlooCollectives, DescribeNamesTransportAndRank) {
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
    auto created = create_communicator(test::test_options(rank, 2, dir.path(), port));
    if (!created.ok()) return created.status().to_string();
    const std::string text = (*created)->describe();
    const std::string want = fmt::format("gloo over tcp (lo 127.0.0.1), rank {} of 2", rank);
    if ((*created)->backend() != CommBackend::kGloo) return "backend is not gloo";
    return text == want ? "" : fmt::format("describe() = \"{}\", want \"{}\"", text, want);
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

// Calls from several threads on one communicator run one at a time; with the
// same order on every rank (a barrier between rounds fixes it) they all match.
TEST(GlooCollectives, CallsFromSeveralThreadsAreSerialised) {
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
    auto created = create_communicator(test::test_options(rank, 2, dir.path(), port));
    if (!created.ok()) return created.status().to_string();
    Communicator& comm = **created;
    std::string error;
    std::mutex error_mu;
    for (int round = 0; round < 20; ++round) {
      // Both ranks issue the same kind of collective from two threads; whichever
      // order the lock picks, it is an all_reduce of the same size each time.
      std::vector<std::thread> threads;
      for (int t = 0; t < 2; ++t) {
        threads.emplace_back([&] {
          std::vector<std::int64_t> v(4096, 1);
          Status st = comm.all_reduce(v.data(), v.size(), DType::kInt64, ReduceOp::kSum);
          std::lock_guard lock(error_mu);
          if (!st.ok()) error = st.to_string();
          else if (v[0] != 2 || v[4095] != 2) error = fmt::format("sum {} {}", v[0], v[4095]);
        });
      }
      for (auto& th : threads) th.join();
      if (!error.empty()) return error;
    }
    return "";
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

// The default rendezvous directory comes from TIERZERO_RENDEZVOUS_DIR, and the
// ranks from the torchrun variables: the way a user's job starts.
TEST(GlooCollectives, RanksFromTorchrunEnvironment) {
  test::TempDir dir;
  const int port = test::next_port();
  auto outcomes = test::run_ranks(2, [&](int rank) -> std::string {
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", "2", 1);
    ::setenv("MASTER_ADDR", "localhost", 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    ::setenv("TIERZERO_RENDEZVOUS_DIR", dir.path().c_str(), 1);
    auto ranks = rank_info_from_env();
    if (!ranks.ok()) return ranks.status().to_string();
    auto created = create_communicator({.ranks = *ranks, .timeout = std::chrono::seconds(30)});
    if (!created.ok()) return created.status().to_string();
    std::int64_t v = rank + 1;
    if (Status st = (*created)->all_reduce(&v, 1, DType::kInt64, ReduceOp::kSum); !st.ok()) {
      return st.to_string();
    }
    return v == 3 ? "" : fmt::format("sum {}", v);
  });
  EXPECT_ALL_RANKS_PASS(outcomes);
}

}  // namespace
}  // namespace tz
