// CpuOptimizer itself: options, thread count, tiling and concurrent callers.
#include <gtest/gtest.h>

#include <algorithm>
#include <thread>

#include "reference.h"
#include "tierzero/common.h"

namespace tzt {
namespace {

using tz::cpu_adam::CpuOptimizer;
using tz::cpu_adam::Options;
using tz::cpu_adam::simd_name;

TEST(CpuAdamOptimizer, ZeroLengthSpansAreANoOp) {
  const auto opt = make_optimizer(tz::cpu_adam::best_supported(), 2);
  EXPECT_TRUE(opt->step(Hyper{}, StepArgs{}, Spans{}).ok());
  const auto stats = opt->accumulate_grad(nullptr, nullptr, DType::kFp16, 0, false);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sum_squares, 0.0);
  EXPECT_FALSE(stats->non_finite);
}

TEST(CpuAdamOptimizer, BadOptionsAreRefusedByName) {
  const struct {
    Options options;
    const char* expect;
  } cases[] = {
      {{.threads = -1}, "Options::threads = -1"},
      {{.tile_elems = 100}, "Options::tile_elems = 100 must be a multiple of 16"},
      {{.numa_node = -2}, "Options::numa_node = -2"},
      {{.numa_node = 4000}, "Options::numa_node = 4000 does not exist"},
  };
  for (const auto& c : cases) {
    const auto opt = CpuOptimizer::create(c.options);
    ASSERT_FALSE(opt.ok()) << c.expect;
    EXPECT_NE(opt.status().message().find(c.expect), std::string::npos) << opt.status().message();
  }
}

TEST(CpuAdamOptimizer, ThreadsDefaultToTheCpusOfTheNode) {
  const auto opt = CpuOptimizer::create({});
  ASSERT_TRUE(opt.ok()) << opt.status().to_string();
  const tz::Capabilities& caps = tz::capabilities();
  if (caps.numa_nodes.size() <= 1) {
    EXPECT_EQ((*opt)->threads(), caps.cpu.logical_cpus);
  } else {
    EXPECT_EQ((*opt)->threads(), static_cast<int>(caps.numa_nodes.front().cpus.size()));
  }
  // More than the CPUs would only queue: capped at one thread per CPU.
  const auto many = CpuOptimizer::create({.threads = 1000});
  ASSERT_TRUE(many.ok());
  EXPECT_EQ((*many)->threads(), static_cast<int>(std::thread::hardware_concurrency()));
  const auto one = CpuOptimizer::create({.threads = 1});
  ASSERT_TRUE(one.ok());
  EXPECT_EQ((*one)->threads(), 1);
}

// Every element gets the same arithmetic wherever its tile starts and
// whichever thread runs it, so outputs are identical bit for bit.
TEST(CpuAdamOptimizer, ResultsDoNotDependOnThreadsOrTiles) {
  for (Simd simd : runnable_variants()) {
    StepSetup setup;
    setup.hyper = random_hyper(Algorithm::kAdam, true, 0.01);
    setup.grad_dtype = DType::kBf16;
    setup.moment_dtype = DType::kBf16;
    setup.copy = DType::kFp16;
    setup.n = 100'003;
    setup.unaligned = true;
    StepProblem original(setup);
    original.fresh_grads();
    std::vector<std::vector<std::uint8_t>> first;
    for (const ThreadsAndTile& c : kThreadsAndTiles) {
      StepProblem p = original;
      ASSERT_TRUE(make_optimizer(simd, c.threads, c.tile)->step(setup.hyper, {.step = 7}, p.spans()).ok());
      const std::vector<std::vector<std::uint8_t>> out = {p.param.snapshot(), p.exp_avg.snapshot(),
                                                          p.exp_avg_sq.snapshot(), p.max_exp_avg_sq.snapshot(),
                                                          p.param16.snapshot()};
      if (first.empty()) {
        first = out;
      } else {
        EXPECT_TRUE(out == first) << simd_name(simd) << ": " << c.threads << " threads, tile " << c.tile;
      }
    }
  }
}

TEST(CpuAdamOptimizer, AccumulateIsIndependentOfThreadCount) {
  constexpr std::size_t kN = 300'007;
  for (Simd simd : runnable_variants()) {
    Buffer grad(DType::kFp16, kN, true);
    for (std::size_t i = 0; i < kN; ++i) grad.set(i, uniform(-1, 1));
    double first = -1;
    for (int threads = 1; threads <= 4; ++threads) {
      Buffer acc(DType::kFp32, kN, true);
      const auto stats = make_optimizer(simd, threads, 4096)->accumulate_grad(acc.f32(), grad.data(), DType::kFp16, kN,
                                                                              true, 0.5);
      ASSERT_TRUE(stats.ok());
      if (first < 0) first = stats->sum_squares;
      EXPECT_EQ(stats->sum_squares, first) << simd_name(simd) << ", " << threads << " threads";
    }
  }
}

TEST(CpuAdamOptimizer, ConcurrentCallersAreSerializedAndCorrect) {
  const auto opt = make_optimizer(tz::cpu_adam::best_supported(), 2, 256);
  StepSetup setup;
  setup.hyper = random_hyper(Algorithm::kAdamW, false, 0.1);
  setup.copy = DType::kBf16;
  setup.n = 20'000;
  std::vector<StepProblem> concurrent, sequential;
  for (int i = 0; i < 4; ++i) {
    concurrent.emplace_back(setup);
    concurrent.back().fresh_grads();
    sequential.push_back(concurrent.back());
  }
  std::vector<std::thread> callers;
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&, i] {
      for (int k = 1; k <= 5; ++k) EXPECT_TRUE(opt->step(setup.hyper, {.step = k}, concurrent[i].spans()).ok());
    });
  }
  for (std::thread& t : callers) t.join();
  for (int i = 0; i < 4; ++i) {
    for (int k = 1; k <= 5; ++k) ASSERT_TRUE(opt->step(setup.hyper, {.step = k}, sequential[i].spans()).ok());
    EXPECT_TRUE(concurrent[i].param.snapshot() == sequential[i].param.snapshot()) << "caller " << i;
    EXPECT_TRUE(concurrent[i].param16.snapshot() == sequential[i].param16.snapshot()) << "caller " << i;
  }
}

// CpuOptimizer::copy spreads 1 MiB chunks over the threads: every byte of
// every job arrives, jobs that are not whole chunks and empty ones included,
// nothing past a job's end is written, and a null pointer is refused by job.
TEST(CpuAdamOptimizer, CopyMovesEveryByteOfEveryJobAndNothingElse) {
  for (int threads : {1, 2}) {
    const auto opt = make_optimizer(tz::cpu_adam::best_supported(), threads);
    const std::size_t sizes[] = {(std::size_t{3} << 20) + 4097, 0, 1, std::size_t{1} << 20, 777};
    std::vector<std::vector<unsigned char>> src, dst;
    std::vector<CpuOptimizer::CopyJob> jobs;
    std::uint32_t x = 12345 + threads;
    for (std::size_t n : sizes) {
      src.emplace_back(n);
      for (auto& b : src.back()) b = static_cast<unsigned char>((x = x * 1664525u + 1013904223u) >> 24);
      dst.emplace_back(n + 64, 0xA5);  // 64 guard bytes past the end
    }
    for (std::size_t j = 0; j < src.size(); ++j) jobs.push_back({dst[j].data(), src[j].data(), src[j].size()});
    ASSERT_TRUE(opt->copy(jobs).ok());
    for (std::size_t j = 0; j < src.size(); ++j) {
      EXPECT_TRUE(std::equal(src[j].begin(), src[j].end(), dst[j].begin())) << "job " << j << ", " << threads << " threads";
      EXPECT_TRUE(std::all_of(dst[j].begin() + static_cast<std::ptrdiff_t>(src[j].size()), dst[j].end(),
                              [](unsigned char b) { return b == 0xA5; }))
          << "job " << j << " wrote past its end";
    }
    EXPECT_TRUE(opt->copy({}).ok());
    jobs[3].src = nullptr;
    const tz::Status bad = opt->copy(jobs);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.message().find("job 3 of 1048576 bytes has a null pointer"), std::string::npos) << bad.message();
  }
}

}  // namespace
}  // namespace tzt
