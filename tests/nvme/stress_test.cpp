// 10,000 mixed requests in flight at once across two paths, every byte checked.
#include <gtest/gtest.h>

#include <latch>
#include <mutex>
#include <random>

#include "nvme_test_util.h"

namespace tzt {
namespace {

using tz::nvme::ExtentId;
using tz::nvme::IoResult;

constexpr int kExtents = 10'000;

struct Slot {
  ExtentId id = 0;
  std::size_t padded = 0;
  std::uint64_t seed = 0;            // content written last
  std::unique_ptr<AlignedBuffer> out, in;
};

class Failures {
 public:
  void record(const tz::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (count_++ == 0) first_ = s.to_string();
  }
  int count() const { return count_; }
  const std::string& first() const { return first_; }

 private:
  std::mutex mu_;
  int count_ = 0;
  std::string first_;
};

TEST(NvmeStress, TenThousandMixedRequestsInFlightAcrossTwoPathsKeepEveryByte) {
  for (tz::nvme::IoBackend backend : runnable_backends()) {
    TempDir a, b;
    auto made = tz::nvme::SwapStore::create(
        {.paths = {a.path(), b.path()},
         .capacity_bytes = std::uint64_t{1} << 30,
         .stripe_bytes = 16384,
         .engine = {.block_size_bytes = 16384, .queue_depth = 32, .rings = 2, .backend = backend}});
    ASSERT_TRUE(made.ok()) << made.status().to_string();
    auto& store = **made;
    std::mt19937_64 rng(std::random_device{}());
    std::vector<Slot> slots(kExtents);
    for (int i = 0; i < kExtents; ++i) {
      Slot& s = slots[i];
      const std::size_t bytes = 4096 * (1 + rng() % 16) - rng() % 4096;  // 1..64 KiB, odd sizes
      auto e = store.allocate(bytes);
      ASSERT_TRUE(e.ok()) << e.status().to_string();
      s.id = *e;
      s.padded = store.padded_bytes(bytes);
      s.out = std::make_unique<AlignedBuffer>(s.padded);
      s.in = std::make_unique<AlignedBuffer>(s.padded);
      s.seed = rng();
      s.out->fill_random(s.seed);
    }
    Failures failures;
    auto done_cb = [&](std::latch& latch) {
      return [&failures, &latch](const tz::Status& s, const IoResult&) {
        if (!s.ok()) failures.record(s);
        latch.count_down();
      };
    };
    // Phase 1: every extent written, all requests in flight at once.
    {
      std::latch latch(kExtents);
      for (Slot& s : slots) store.write(s.id, s.out->data(), done_cb(latch));
      latch.wait();
    }
    ASSERT_EQ(failures.count(), 0) << failures.first();
    // Phase 2: a random mix, all in flight at once: half the extents are read
    // back, the other half rewritten with new contents.
    std::vector<bool> rewritten(kExtents);
    {
      std::latch latch(kExtents);
      for (int i = 0; i < kExtents; ++i) {
        Slot& s = slots[i];
        rewritten[i] = rng() % 2 == 0;
        if (rewritten[i]) {
          s.seed = rng();
          s.out->fill_random(s.seed);
          store.write(s.id, s.out->data(), done_cb(latch));
        } else {
          s.in->fill(0);
          store.read(s.id, s.in->data(), done_cb(latch));
        }
      }
      latch.wait();
    }
    ASSERT_EQ(failures.count(), 0) << failures.first();
    int bad = 0;
    for (int i = 0; i < kExtents; ++i) {
      if (!rewritten[i] && !slots[i].in->same_as(*slots[i].out)) ++bad;
    }
    EXPECT_EQ(bad, 0) << "extents read back wrong in the mixed phase";
    // Phase 3: everything read back.
    {
      std::latch latch(kExtents);
      for (Slot& s : slots) {
        s.in->fill(0);
        store.read(s.id, s.in->data(), done_cb(latch));
      }
      latch.wait();
    }
    ASSERT_EQ(failures.count(), 0) << failures.first();
    for (const Slot& s : slots) bad += s.in->same_as(*s.out) ? 0 : 1;
    EXPECT_EQ(bad, 0) << "extents read back wrong at the end";
    const auto stats = store.stats();
    std::printf("[ nvme ] %s: %d extents, %s written, %s read, all verified\n",
                std::string(tz::nvme::io_backend_name(backend)).c_str(), kExtents,
                tz::format_bytes(stats.bytes_written).c_str(), tz::format_bytes(stats.bytes_read).c_str());
    EXPECT_EQ(stats.corrupt_reads, 0U);
  }
}

}  // namespace
}  // namespace tzt
