#include "tierzero/offload/pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <limits>
#include <thread>
#include <vector>

#include "faulty_device.h"
#include "tierzero/offload.h"

namespace tz {
namespace {

// A backend that counts, and can be told to fail.
class CountingAllocator final : public RawAllocator {
 public:
  Expected<void*> allocate(std::size_t bytes) override {
    if (fail_next) {
      fail_next = false;
      return out_of_memory("backend refused {} bytes", bytes);
    }
    ++allocations;
    return ::operator new(bytes, std::align_val_t(4096));
  }
  void deallocate(void* ptr, std::size_t /*bytes*/) override {
    ++frees;
    ::operator delete(ptr, std::align_val_t(4096));
  }
  int allocations = 0;
  int frees = 0;
  bool fail_next = false;
};

struct PoolFixture {
  explicit PoolFixture(std::uint64_t budget, Device* device = nullptr) {
    auto backend_owner = std::make_unique<CountingAllocator>();
    backend = backend_owner.get();
    PoolOptions options;
    options.tier = "gpu";
    options.budget_key = "tierzero.tiers.gpu_bytes";
    options.budget_bytes = budget;
    pool = std::make_unique<MemoryPool>(options, std::move(backend_owner), device);
  }
  CountingAllocator* backend;
  std::unique_ptr<MemoryPool> pool;
};

TEST(MemoryPool, NoBackendAllocationAfterWarmUp) {
  PoolFixture f(256 * kMiB);
  const std::vector<std::size_t> step_sizes = {1 * kMiB, 3 * kMiB + 17, 64 * kKiB, 1 * kMiB, 8 * kMiB};
  std::uint64_t after_first_step = 0;
  for (int step = 0; step < 10; ++step) {
    std::vector<PoolBlock> live;
    for (std::size_t size : step_sizes) {
      Expected<PoolBlock> block = f.pool->allocate(size);
      ASSERT_TRUE(block.ok()) << block.status().to_string();
      EXPECT_GE(block->capacity_bytes(), size);
      EXPECT_EQ(block->size_bytes(), size);
      live.push_back(std::move(*block));
    }
    if (step == 0) after_first_step = f.pool->stats().backend_allocations;
  }
  PoolStats stats = f.pool->stats();
  EXPECT_EQ(after_first_step, step_sizes.size());
  EXPECT_EQ(stats.backend_allocations, after_first_step) << "steady state must not allocate";
  EXPECT_EQ(stats.requests, 50u);
  EXPECT_EQ(stats.cache_hits, 45u);
  EXPECT_EQ(stats.in_use_bytes, 0u);
  EXPECT_EQ(f.backend->allocations, 5);
}

TEST(MemoryPool, TracksCurrentAndPeak) {
  PoolFixture f(64 * kMiB);
  {
    auto a = f.pool->allocate(4 * kMiB);
    auto b = f.pool->allocate(2 * kMiB);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(f.pool->stats().in_use_bytes, 6 * kMiB);
  }
  PoolStats stats = f.pool->stats();
  EXPECT_EQ(stats.in_use_bytes, 0u);
  EXPECT_EQ(stats.peak_in_use_bytes, 6 * kMiB);
  EXPECT_EQ(stats.cached_bytes, 6 * kMiB);
  EXPECT_EQ(stats.reserved_bytes, 6 * kMiB);
  f.pool->reset_peak();
  EXPECT_EQ(f.pool->stats().peak_in_use_bytes, 0u);
  EXPECT_EQ(f.pool->trim(), 6 * kMiB);
  EXPECT_EQ(f.pool->stats().reserved_bytes, 0u);
  EXPECT_EQ(f.backend->frees, 2);
}

TEST(MemoryPool, OverBudgetNamesTierBudgetRequestAndKey) {
  PoolFixture f(10 * kMiB);
  auto held = f.pool->allocate(8 * kMiB);
  ASSERT_TRUE(held.ok());
  Expected<PoolBlock> over = f.pool->allocate(3 * kMiB);
  ASSERT_FALSE(over.ok());
  const Status& s = over.status();
  EXPECT_EQ(s.code(), ErrorCode::kOutOfMemory);
  for (const char* needle : {"gpu tier", "3.00 MiB", "budget 10.00 MiB", "in use 8.00 MiB", "tierzero.tiers.gpu_bytes"}) {
    EXPECT_NE(s.message().find(needle), std::string::npos) << "missing '" << needle << "' in: " << s.message();
  }
  // Nothing was lost: the held block is intact and the pool still serves what fits.
  EXPECT_EQ(f.pool->stats().in_use_bytes, 8 * kMiB);
  EXPECT_TRUE(f.pool->allocate(2 * kMiB).ok());
}

TEST(MemoryPool, FreesCachedBlocksBeforeFailing) {
  PoolFixture f(8 * kMiB);
  { auto big = f.pool->allocate(6 * kMiB); ASSERT_TRUE(big.ok()); }
  // 6 MiB is cached but too large to reuse for 4 MiB (more than 12.5% slack),
  // and 6 + 4 > 8: the pool must free the cached block, not fail.
  Expected<PoolBlock> small = f.pool->allocate(4 * kMiB);
  ASSERT_TRUE(small.ok()) << small.status().to_string();
  EXPECT_EQ(f.backend->frees, 1);
  EXPECT_EQ(f.pool->stats().reserved_bytes, 4 * kMiB);
}

TEST(MemoryPool, ReusesSlightlyLargerBlocksOnly) {
  PoolFixture f(64 * kMiB);
  { auto b = f.pool->allocate(4 * kMiB); ASSERT_TRUE(b.ok()); }
  {
    auto b = f.pool->allocate(4 * kMiB - 100 * kKiB);  // within slack: reused
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(b->capacity_bytes(), 4 * kMiB);
    EXPECT_EQ(b->size_bytes(), 4 * kMiB - 100 * kKiB);
    EXPECT_EQ(f.pool->stats().in_use_bytes, 4 * kMiB);
  }
  EXPECT_EQ(f.backend->allocations, 1);
  EXPECT_EQ(f.pool->stats().in_use_bytes, 0u);
  { auto b = f.pool->allocate(1 * kMiB); ASSERT_TRUE(b.ok()); }  // far smaller: new block
  EXPECT_EQ(f.backend->allocations, 2);
}

TEST(MemoryPool, BackendFailureCarriesPoolContext) {
  PoolFixture f(64 * kMiB);
  f.backend->fail_next = true;
  Expected<PoolBlock> b = f.pool->allocate(1 * kMiB);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), ErrorCode::kOutOfMemory);
  EXPECT_NE(b.status().message().find("gpu pool"), std::string::npos) << b.status().message();
  EXPECT_NE(b.status().message().find("backend refused"), std::string::npos) << b.status().message();
}

TEST(MemoryPool, ReleaseAfterWaitsForTheStream) {
  std::unique_ptr<Device> device = create_host_device();
  auto stream = device->create_stream();
  ASSERT_TRUE(stream.ok());
  PoolFixture f(64 * kMiB, device.get());
  std::promise<void> gate;
  ASSERT_TRUE(device->launch_host_func(**stream, [g = gate.get_future().share()] { g.wait(); }).ok());
  {
    auto block = f.pool->allocate(2 * kMiB);
    ASSERT_TRUE(block.ok());
    ASSERT_TRUE(f.pool->release_after(std::move(*block), **stream).ok());
  }
  EXPECT_EQ(f.pool->stats().pending_bytes, 2 * kMiB);
  {
    auto again = f.pool->allocate(2 * kMiB);  // the stream may still use the first block
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(f.backend->allocations, 2);
  }
  gate.set_value();
  ASSERT_TRUE(device->synchronize_stream(**stream).ok());
  auto a = f.pool->allocate(2 * kMiB);
  auto b = f.pool->allocate(2 * kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(f.backend->allocations, 2) << "both blocks reused once the stream finished";
  EXPECT_EQ(f.pool->stats().pending_bytes, 0u);
}

TEST(MemoryPool, OverBudgetWaitsForPendingBlocks) {
  std::unique_ptr<Device> device = create_host_device();
  auto stream = device->create_stream();
  ASSERT_TRUE(stream.ok());
  PoolFixture f(4 * kMiB, device.get());
  std::promise<void> gate;
  ASSERT_TRUE(device->launch_host_func(**stream, [g = gate.get_future().share()] { g.wait(); }).ok());
  auto block = f.pool->allocate(4 * kMiB);
  ASSERT_TRUE(block.ok());
  ASSERT_TRUE(f.pool->release_after(std::move(*block), **stream).ok());
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    gate.set_value();
  });
  auto next = f.pool->allocate(4 * kMiB);  // must wait for the stream, then reuse
  opener.join();
  ASSERT_TRUE(next.ok()) << next.status().to_string();
  EXPECT_EQ(f.backend->allocations, 1);
}

TEST(MemoryPool, ConcurrentUseKeepsAccountsStraight) {
  PoolFixture f(512 * kMiB);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        auto b = f.pool->allocate(static_cast<std::size_t>((i % 5) + 1 + t) * 64 * kKiB);
        ASSERT_TRUE(b.ok());
        static_cast<char*>(b->data())[0] = 1;
      }
    });
  }
  for (auto& t : threads) t.join();
  PoolStats stats = f.pool->stats();
  EXPECT_EQ(stats.in_use_bytes, 0u);
  EXPECT_EQ(stats.requests, 800u);
  EXPECT_EQ(stats.reserved_bytes, stats.cached_bytes);
  EXPECT_LE(stats.backend_allocations, 4u * 8u);
}

}  // namespace
}  // namespace tz

namespace tz {
namespace {

TEST(MemoryPool, HugeRequestIsRefusedWithoutWrapping) {
  PoolFixture f(64 * kMiB);
  Expected<PoolBlock> b = f.pool->allocate(std::numeric_limits<std::size_t>::max() - 100);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), ErrorCode::kOutOfMemory);
  EXPECT_EQ(f.backend->allocations, 0);
  EXPECT_EQ(f.pool->stats().reserved_bytes, 0u);
}

TEST(MemoryPool, WaitingForAStreamDoesNotHoldThePoolLock) {
  // Work on the stream calls into the pool (as an engine callback might) while
  // another thread's allocate waits for that stream to free a block.
  std::unique_ptr<Device> device = create_host_device();
  auto stream = device->create_stream();
  ASSERT_TRUE(stream.ok());
  PoolFixture f(4 * kMiB, device.get());
  std::promise<void> gate;
  std::atomic<bool> callback_ran{false};
  ASSERT_TRUE(device->launch_host_func(**stream, [&, g = gate.get_future().share()] {
    g.wait();
    (void)f.pool->stats();  // takes the pool's lock
    callback_ran = true;
  }).ok());
  auto block = f.pool->allocate(4 * kMiB);
  ASSERT_TRUE(block.ok());
  ASSERT_TRUE(f.pool->release_after(std::move(*block), **stream).ok());
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    gate.set_value();
  });
  auto next = f.pool->allocate(4 * kMiB);  // over budget: waits for the stream, lock released
  opener.join();
  ASSERT_TRUE(next.ok()) << next.status().to_string();
  EXPECT_TRUE(callback_ran.load());
}

TEST(MemoryPool, FailedReleaseAfterWaitsForTheStreamBeforeReuse) {
  FaultyDevice device(create_host_device());  // to see where a block goes when its event cannot be recorded
  device.fail_record_event = true;
  auto stream = device.create_stream();
  ASSERT_TRUE(stream.ok());
  PoolFixture f(64 * kMiB, &device);
  auto block = f.pool->allocate(1 * kMiB);
  ASSERT_TRUE(block.ok());
  char* data = block->as<char>();
  std::atomic<bool> stream_done{false};
  ASSERT_TRUE(device.launch_host_func(**stream, [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    data[0] = 42;  // the stream still writes to the block
    stream_done = true;
  }).ok());
  Status s = f.pool->release_after(std::move(*block), **stream);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("injected record_event failure"), std::string::npos) << s.message();
  EXPECT_TRUE(stream_done.load()) << "the block reached the cache while the stream could still use it";
  auto reused = f.pool->allocate(1 * kMiB);
  ASSERT_TRUE(reused.ok());
  EXPECT_EQ(reused->as<char>(), data);
  EXPECT_EQ(f.pool->stats().pending_bytes, 0u);
}

}  // namespace
}  // namespace tz
