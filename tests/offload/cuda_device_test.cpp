// The CUDA backend's tests. They run where a GPU is present and skip, saying
// why, everywhere else (CI has none; the sources are still compiled there).
#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "tierzero/offload.h"

namespace tz {
namespace {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const CudaCapabilities& cuda = capabilities().cuda;
    if (cuda.device_count == 0) GTEST_SKIP() << "no CUDA device: " << cuda.status;
    auto device = create_device({.backend = BackendChoice::kCuda});
    ASSERT_TRUE(device.ok()) << device.status().to_string();
    device_ = std::move(*device);
    auto stream = device_->create_stream();
    ASSERT_TRUE(stream.ok());
    stream_ = std::move(*stream);
  }
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
};

TEST_F(CudaDeviceTest, PinnedRoundTripThroughDeviceMemory) {
  constexpr std::size_t kBytes = 64 * kMiB + 4096;
  auto pinned = make_host_pool(*device_, 256 * kMiB, {.pinned = true, .numa_node = device_->numa_node()});
  ASSERT_TRUE(pinned.ok()) << pinned.status().to_string();
  auto h_src = (*pinned)->allocate(kBytes);
  auto h_dst = (*pinned)->allocate(kBytes);
  ASSERT_TRUE(h_src.ok() && h_dst.ok());
  std::mt19937 rng(std::random_device{}());
  for (std::size_t i = 0; i < kBytes / 4; ++i) h_src->as<std::uint32_t>()[i] = rng();
  Expected<void*> d_buf = device_->allocate(kBytes, stream_.get());
  ASSERT_TRUE(d_buf.ok());
  ASSERT_TRUE(device_->copy_async(*d_buf, h_src->data(), kBytes, *stream_).ok());
  ASSERT_TRUE(device_->copy_async(h_dst->data(), *d_buf, kBytes, *stream_).ok());
  ASSERT_TRUE(device_->deallocate(*d_buf, kBytes, stream_.get()).ok());
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
  EXPECT_EQ(std::memcmp(h_src->data(), h_dst->data(), kBytes), 0);
}

TEST_F(CudaDeviceTest, DevicePoolReusesBlocksAndEnforcesBudget) {
  auto pool = make_device_pool(*device_, 512 * kMiB);
  ASSERT_TRUE(pool.ok());
  std::uint64_t after_warm_up = 0;
  for (int step = 0; step < 5; ++step) {
    auto a = (*pool)->allocate(128 * kMiB);
    auto b = (*pool)->allocate(64 * kMiB);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_TRUE(device_->memset_async(a->data(), step, a->size_bytes(), *stream_).ok());
    ASSERT_TRUE((*pool)->release_after(std::move(*a), *stream_).ok());
    ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());  // each step ends with its stream drained
    if (step == 0) after_warm_up = (*pool)->stats().backend_allocations;
  }
  EXPECT_EQ((*pool)->stats().backend_allocations, after_warm_up) << "steady state must not allocate";
  auto over = (*pool)->allocate(1 * kGiB);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.status().message().find("tierzero.tiers.gpu_bytes"), std::string::npos);
}

TEST_F(CudaDeviceTest, EventsOrderStreams) {
  auto other = device_->create_stream();
  auto e = device_->create_event();
  ASSERT_TRUE(other.ok() && e.ok());
  constexpr std::size_t kBytes = 16 * kMiB;
  Expected<void*> d_a = device_->allocate(kBytes, nullptr);
  Expected<void*> d_b = device_->allocate(kBytes, nullptr);
  ASSERT_TRUE(d_a.ok() && d_b.ok());
  std::vector<std::uint8_t> host(kBytes, 0);
  ASSERT_TRUE(device_->memset_async(*d_a, 0x3C, kBytes, *stream_).ok());
  ASSERT_TRUE(device_->record_event(**e, *stream_).ok());
  ASSERT_TRUE(device_->stream_wait_event(**other, **e).ok());
  ASSERT_TRUE(device_->copy_async(*d_b, *d_a, kBytes, **other).ok());
  ASSERT_TRUE(device_->copy_async(host.data(), *d_b, kBytes, **other).ok());
  ASSERT_TRUE(device_->synchronize_stream(**other).ok());
  for (std::uint8_t v : host) ASSERT_EQ(v, 0x3C);
  EXPECT_TRUE(device_->deallocate(*d_a, kBytes, nullptr).ok());
  EXPECT_TRUE(device_->deallocate(*d_b, kBytes, nullptr).ok());
}

// Another library's stream (here one the test made, used only by its raw
// handle) is held up by a host function for 200 ms before it writes; a copy
// on our stream after stream_wait_native must see the write. Without the wait
// the copy would run during the hold and read the old bytes.
TEST_F(CudaDeviceTest, StreamWaitNativeOrdersAfterAForeignStream) {
  auto foreign = device_->create_stream();
  ASSERT_TRUE(foreign.ok());
  constexpr std::size_t kBytes = 4 * kMiB;
  Expected<void*> d_a = device_->allocate(kBytes, nullptr);
  ASSERT_TRUE(d_a.ok());
  ASSERT_TRUE(device_->memset_async(*d_a, 0x11, kBytes, *stream_).ok());
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
  ASSERT_TRUE(device_->launch_host_func(**foreign, [] { std::this_thread::sleep_for(std::chrono::milliseconds(200)); }).ok());
  ASSERT_TRUE(device_->memset_async(*d_a, 0x5A, kBytes, **foreign).ok());
  ASSERT_TRUE(device_->stream_wait_native(*stream_, (*foreign)->native_handle()).ok());
  std::vector<std::uint8_t> host(kBytes, 0);
  ASSERT_TRUE(device_->copy_async(host.data(), *d_a, kBytes, *stream_).ok());
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
  EXPECT_EQ(host.front(), 0x5A);
  EXPECT_EQ(host.back(), 0x5A);
  // nullptr is CUDA's legacy default stream: nothing queued there, nothing to wait for.
  EXPECT_TRUE(device_->stream_wait_native(*stream_, nullptr).ok());
  EXPECT_TRUE(device_->synchronize_stream(*stream_).ok());
  EXPECT_TRUE(device_->deallocate(*d_a, kBytes, nullptr).ok());
}

TEST_F(CudaDeviceTest, HostFuncRunsInStreamOrder) {
  std::vector<int> order;
  ASSERT_TRUE(device_->launch_host_func(*stream_, [&] { order.push_back(1); }).ok());
  ASSERT_TRUE(device_->launch_host_func(*stream_, [&] { order.push_back(2); }).ok());
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
}

TEST_F(CudaDeviceTest, MemoryInfoIsTheGpus) {
  auto info = device_->memory_info();
  ASSERT_TRUE(info.ok());
  EXPECT_GT(info->total_bytes, 1 * kGiB);
  EXPECT_NE(device_->name().find("cuda:0"), std::string::npos);
}

}  // namespace
}  // namespace tz
