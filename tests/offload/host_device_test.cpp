#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "tierzero/offload.h"

namespace tz {
namespace {

// Blocks a stream until open() is called, so a test can observe that work
// issued behind it has not run yet. The constructor returns once the stream
// is inside the gate (running it, not merely holding it in its queue).
class Gate {
 public:
  explicit Gate(Device& device, Stream& stream) {
    std::promise<void> entered;
    std::future<void> inside = entered.get_future();
    Status s = device.launch_host_func(stream, [f = opened_.get_future().share(), &entered] {
      entered.set_value();
      f.wait();
    });
    EXPECT_TRUE(s.ok()) << s.to_string();
    if (s.ok()) inside.wait();
  }
  void open() { opened_.set_value(); }

 private:
  std::promise<void> opened_;
};

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint8_t> v(n);
  for (auto& b : v) b = static_cast<std::uint8_t>(rng());
  return v;
}

class HostDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = create_host_device();
    auto s = device_->create_stream();
    ASSERT_TRUE(s.ok());
    stream_ = std::move(*s);
  }
  std::unique_ptr<Event> event() {
    auto e = device_->create_event();
    EXPECT_TRUE(e.ok());
    return std::move(*e);
  }
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
};

TEST_F(HostDeviceTest, RoundTripThroughDeviceMemoryPreservesBytes) {
  constexpr std::size_t kBytes = (1 << 20) + 123;
  std::vector<std::uint8_t> src = random_bytes(kBytes, std::random_device{}());
  std::vector<std::uint8_t> back(kBytes, 0);
  Expected<void*> d_buf = device_->allocate(kBytes, stream_.get());
  ASSERT_TRUE(d_buf.ok());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(*d_buf) % 4096, 0u);
  ASSERT_TRUE(device_->copy_async(*d_buf, src.data(), kBytes, *stream_).ok());
  ASSERT_TRUE(device_->copy_async(back.data(), *d_buf, kBytes, *stream_).ok());
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
  EXPECT_EQ(back, src);
  ASSERT_TRUE(device_->deallocate(*d_buf, kBytes, stream_.get()).ok());
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
}

// Every host wait counts once (the step report's host_waits); queuing work,
// recording and polling events do not block and do not count.
TEST_F(HostDeviceTest, HostWaitsCountEverySynchronisation) {
  const std::uint64_t before = device_->host_waits();
  std::uint8_t a[64] = {}, b[64] = {};
  auto e = event();
  ASSERT_TRUE(device_->copy_async(b, a, sizeof a, *stream_).ok());
  ASSERT_TRUE(device_->record_event(*e, *stream_).ok());
  ASSERT_TRUE(device_->event_done(*e).ok());
  EXPECT_EQ(device_->host_waits(), before);
  ASSERT_TRUE(device_->synchronize_event(*e).ok());
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
  EXPECT_EQ(device_->host_waits(), before + 3);
}

TEST_F(HostDeviceTest, CopiesAreAsynchronousAndOrdered) {
  std::vector<int> a(1024, 1), b(1024, 0), c(1024, 0);
  auto done = event();
  Gate gate(*device_, *stream_);
  ASSERT_TRUE(device_->copy_async(b.data(), a.data(), a.size() * sizeof(int), *stream_).ok());
  ASSERT_TRUE(device_->copy_async(c.data(), b.data(), b.size() * sizeof(int), *stream_).ok());
  ASSERT_TRUE(device_->record_event(*done, *stream_).ok());
  // Nothing has run: the copies wait behind the gate, and the call returned.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(*device_->event_done(*done));
  EXPECT_EQ(b[0], 0);
  gate.open();
  ASSERT_TRUE(device_->synchronize_event(*done).ok());
  EXPECT_TRUE(*device_->event_done(*done));
  EXPECT_EQ(c, a);  // c copied from b after b was filled: issue order held
}

TEST_F(HostDeviceTest, StreamWaitEventOrdersWorkAcrossStreams) {
  auto other = device_->create_stream();
  ASSERT_TRUE(other.ok());
  std::vector<int> src(4096, 7), mid(4096, 0), dst(4096, 0);
  auto produced = event();
  Gate gate(*device_, *stream_);
  ASSERT_TRUE(device_->copy_async(mid.data(), src.data(), src.size() * sizeof(int), *stream_).ok());
  ASSERT_TRUE(device_->record_event(*produced, *stream_).ok());
  ASSERT_TRUE(device_->stream_wait_event(**other, *produced).ok());
  ASSERT_TRUE(device_->copy_async(dst.data(), mid.data(), mid.size() * sizeof(int), **other).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(dst[0], 0);  // the other stream is waiting, not racing ahead
  gate.open();
  ASSERT_TRUE(device_->synchronize_stream(**other).ok());
  EXPECT_EQ(dst, src);
}

// Note [Idle streams run cheap work inline]: small copies, fills and event
// records may run on the caller when the stream is idle, but never ahead of
// work queued before them, whichever thread issued it.
TEST_F(HostDeviceTest, SmallWorkBehindQueuedWorkWaitsItsTurn) {
  std::vector<std::uint8_t> a(4096, 1), b(4096, 0);
  auto done = event();
  {
    Gate gate(*device_, *stream_);
    ASSERT_TRUE(device_->memset_async(a.data(), 7, a.size(), *stream_).ok());
    std::thread other([&] { ASSERT_TRUE(device_->copy_async(b.data(), a.data(), a.size(), *stream_).ok()); });
    other.join();
    ASSERT_TRUE(device_->record_event(*done, *stream_).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(a[0], 1) << "the fill ran ahead of the gate";
    EXPECT_EQ(b[0], 0) << "the copy ran ahead of the gate";
    EXPECT_FALSE(*device_->event_done(*done));
    gate.open();
  }
  ASSERT_TRUE(device_->synchronize_event(*done).ok());
  EXPECT_EQ(a, std::vector<std::uint8_t>(4096, 7));
  EXPECT_EQ(b, std::vector<std::uint8_t>(4096, 7)) << "the copy ran before the fill";
  // Idle again: the same work is done by the time the calls return or by the next sync.
  ASSERT_TRUE(device_->memset_async(a.data(), 9, a.size(), *stream_).ok());
  ASSERT_TRUE(device_->copy_async(b.data(), a.data(), a.size(), *stream_).ok());
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
  EXPECT_EQ(b, std::vector<std::uint8_t>(4096, 9));
}

// Several threads issue small copies (inline when the stream is idle, queued
// when not), fills, events, large copies and frees on one stream, with no lock
// of their own. Each thread's copies go through its own cell into its own log
// in issue order, so each log must read 0, 1, 2, ...; every issue also fills
// one shared scratch buffer, which is only race-free because a stream runs
// one operation at a time (ThreadSanitizer reports a worker running beside an
// inline caller there).
TEST_F(HostDeviceTest, ManyThreadsOnOneStreamKeepEachThreadsOrder) {
  constexpr int kThreads = 3, kPerThread = 400;
  std::vector<int> source(kPerThread);
  for (int i = 0; i < kPerThread; ++i) source[i] = i;
  std::vector<std::vector<int>> log(kThreads, std::vector<int>(kPerThread, -1));
  std::vector<int> cell(kThreads * 16, -1);  // a cache line apart
  std::vector<std::uint8_t> scratch(64 * 1024);  // the largest fill that runs inline: the longest window
  auto work = [&](int t) {
    for (int k = 0; k < kPerThread; ++k) {
      ASSERT_TRUE(device_->copy_async(&cell[t * 16], &source[k], sizeof(int), *stream_).ok());
      ASSERT_TRUE(device_->memset_async(scratch.data(), k & 0xff, scratch.size(), *stream_).ok());
      ASSERT_TRUE(device_->copy_async(&log[t][k], &cell[t * 16], sizeof(int), *stream_).ok());
      if (k % 7 == 0) {
        auto e = device_->create_event();
        ASSERT_TRUE(e.ok());
        ASSERT_TRUE(device_->record_event(**e, *stream_).ok());
        ASSERT_TRUE(device_->synchronize_event(**e).ok());
      }
      if (k % 50 == t) {  // a large copy: always the stream's thread
        std::vector<std::uint8_t> big(256 * 1024, static_cast<std::uint8_t>(k));
        std::vector<std::uint8_t> back(big.size());
        ASSERT_TRUE(device_->copy_async(back.data(), big.data(), big.size(), *stream_).ok());
        ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
        ASSERT_EQ(back, big);
      }
      if (k % 13 == 0) {
        auto d = device_->allocate(64, nullptr);
        ASSERT_TRUE(d.ok());
        ASSERT_TRUE(device_->deallocate(*d, 64, stream_.get()).ok());
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(work, t);
  for (auto& t : threads) t.join();
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
  for (int t = 0; t < kThreads; ++t) {
    for (int k = 0; k < kPerThread; ++k) ASSERT_EQ(log[t][k], k) << "thread " << t << ", issue " << k;
  }
}

TEST_F(HostDeviceTest, UnrecordedEventIsComplete) {
  auto e = event();
  EXPECT_TRUE(*device_->event_done(*e));
  EXPECT_TRUE(device_->synchronize_event(*e).ok());
  EXPECT_TRUE(device_->stream_wait_event(*stream_, *e).ok());
  EXPECT_TRUE(device_->stream_wait_native(*stream_, nullptr).ok());  // no foreign queued work on the CPU
  EXPECT_TRUE(device_->synchronize_stream(*stream_).ok());
}

TEST_F(HostDeviceTest, ReRecordingMovesTheEvent) {
  auto e = event();
  ASSERT_TRUE(device_->record_event(*e, *stream_).ok());
  ASSERT_TRUE(device_->synchronize_event(*e).ok());
  Gate gate(*device_, *stream_);
  ASSERT_TRUE(device_->record_event(*e, *stream_).ok());
  EXPECT_FALSE(*device_->event_done(*e));
  gate.open();
  ASSERT_TRUE(device_->synchronize_event(*e).ok());
  EXPECT_TRUE(*device_->event_done(*e));
}

TEST_F(HostDeviceTest, MemsetAsync) {
  std::vector<std::uint8_t> buf(10000, 0);
  ASSERT_TRUE(device_->memset_async(buf.data(), 0xAB, buf.size(), *stream_).ok());
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
  for (std::uint8_t b : buf) ASSERT_EQ(b, 0xAB);
}

TEST_F(HostDeviceTest, DestroyingAStreamFinishesItsWork) {
  std::vector<int> src(1 << 16, 3), dst(1 << 16, 0);
  {
    auto s = device_->create_stream();
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(device_->copy_async(dst.data(), src.data(), src.size() * sizeof(int), **s).ok());
  }
  EXPECT_EQ(dst, src);
}

TEST_F(HostDeviceTest, ManyThreadsIssueToOneStream) {
  std::atomic<int> ran{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 250; ++i) EXPECT_TRUE(device_->launch_host_func(*stream_, [&] { ++ran; }).ok());
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(device_->synchronize_stream(*stream_).ok());
  EXPECT_EQ(ran.load(), 1000);
}

TEST_F(HostDeviceTest, MemoryInfoReportsHostMemory) {
  Expected<DeviceMemoryInfo> info = device_->memory_info();
  ASSERT_TRUE(info.ok());
  EXPECT_GT(info->total_bytes, 0u);
  EXPECT_LE(info->free_bytes, info->total_bytes);
}

TEST(CreateDevice, PicksTheBackendByWhatTheMachineHas) {
  const CudaCapabilities& cuda = capabilities().cuda;
  Expected<std::unique_ptr<Device>> host = create_device({.backend = BackendChoice::kHost});
  ASSERT_TRUE(host.ok());
  EXPECT_EQ((*host)->kind(), BackendKind::kHost);

  Expected<std::unique_ptr<Device>> automatic = create_device({});
  ASSERT_TRUE(automatic.ok()) << automatic.status().to_string();
  EXPECT_EQ((*automatic)->kind(), cuda.device_count > 0 ? BackendKind::kCuda : BackendKind::kHost);

  Expected<std::unique_ptr<Device>> forced = create_device({.backend = BackendChoice::kCuda});
  if (cuda.device_count > 0) {
    ASSERT_TRUE(forced.ok()) << forced.status().to_string();
    EXPECT_EQ((*forced)->kind(), BackendKind::kCuda);
  } else {
    ASSERT_FALSE(forced.ok());
    EXPECT_EQ(forced.status().code(), ErrorCode::kUnavailable);
    EXPECT_NE(forced.status().message().find("tierzero.backend"), std::string::npos) << forced.status().message();
    EXPECT_NE(forced.status().message().find(cuda.status), std::string::npos) << forced.status().message();
  }
}

}  // namespace
}  // namespace tz
