// TieredStore on its own (no engine): a shard put on each tier comes back
// byte for byte; only NVMe moves count as NVMe traffic, and every byte they
// move is counted; a pool over its budget and NVMe out of room fail naming
// the state, the block and the tier; NVMe extents are freed with the store.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "../nvme/nvme_test_util.h"
#include "tierzero/offload.h"

namespace tz {
namespace {

std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::uint8_t> v(n);
  for (auto& x : v) x = static_cast<std::uint8_t>(rng());
  return v;
}

struct Tiers {
  std::unique_ptr<Device> device = create_host_device();
  std::unique_ptr<Stream> stream = device->create_stream().value();
  std::unique_ptr<MemoryPool> device_pool = make_device_pool(*device, 8 << 20).value();
  std::unique_ptr<MemoryPool> host_pool = make_host_pool(*device, 8 << 20, {}).value();
  tzt::TempDir dir;
  std::unique_ptr<nvme::SwapStore> swap =
      nvme::SwapStore::create({.paths = {dir.path()}, .capacity_bytes = 4 << 20, .allow_buffered = true}).value();
  NvmeTraffic traffic;

  TieredStoreArgs args(Tier tier) {
    return {.state = StateClass::kMaster, .tier = tier, .elem_bytes = 4, .device = device.get(),
            .device_pool = device_pool.get(), .host_pool = host_pool.get(), .swap = swap.get(), .traffic = &traffic};
  }
};

const std::vector<ShardSpec> kShards = {{"layer0", 1024}, {"layer1", 4096}, {"layer2", 2048}};

// body(tiers, store, tier) on a fresh store of kShards on each tier.
template <class Body>
void on_every_tier(Body body) {
  for (Tier tier : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) {
    SCOPED_TRACE(tier_name(tier));
    Tiers t;
    auto store = TieredStore::create(t.args(tier), kShards);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    body(t, **store, tier);
  }
}

TEST(TieredStore, EveryTierGivesBackWhatWasPut) {
  on_every_tier([](Tiers& t, TieredStore& s, Tier tier) {
    EXPECT_EQ(s.blocks(), 3u);
    EXPECT_EQ(s.total_bytes(), (1024u + 4096 + 2048) * 4);
    EXPECT_EQ(s.resident(), tier != Tier::kNvme);
    EXPECT_EQ(s.memory(1) != nullptr, tier != Tier::kNvme);
    for (std::size_t b = 0; b < 3; ++b) {
      const auto bytes = random_bytes(s.shard_bytes(b), 100 + b);
      ASSERT_TRUE(s.put(b, bytes.data(), *t.stream).ok());
    }
    for (std::size_t b = 0; b < 3; ++b) {
      std::vector<std::uint8_t> back(s.shard_bytes(b));
      ASSERT_TRUE(s.get(b, back.data(), *t.stream).ok());
      EXPECT_EQ(back, random_bytes(s.shard_bytes(b), 100 + b)) << "block " << b;
    }
    const std::uint64_t moved = tier == Tier::kNvme ? s.total_bytes() : 0;
    EXPECT_EQ(t.traffic.write_bytes, moved);
    EXPECT_EQ(t.traffic.read_bytes, moved);
  });
}

// Note [Stepping under backward]: swap_shard trades one block's shard with a
// second store's, on every tier, and nothing else; stores that do not match
// are refused.
TEST(TieredStore, SwapShardTradesOneBlocksShardWithASecondCopy) {
  on_every_tier([](Tiers& t, TieredStore& s, Tier tier) {
    auto copy = TieredStore::create(t.args(tier), kShards);
    ASSERT_TRUE(copy.ok()) << copy.status().to_string();
    for (std::size_t b = 0; b < 3; ++b) {
      ASSERT_TRUE(s.put(b, random_bytes(s.shard_bytes(b), 10 + b).data(), *t.stream).ok());
      ASSERT_TRUE((*copy)->put(b, random_bytes(s.shard_bytes(b), 20 + b).data(), *t.stream).ok());
    }
    ASSERT_TRUE(s.swap_shard(1, **copy).ok());
    for (std::size_t b = 0; b < 3; ++b) {
      std::vector<std::uint8_t> mine(s.shard_bytes(b)), theirs(s.shard_bytes(b));
      ASSERT_TRUE(s.get(b, mine.data(), *t.stream).ok());
      ASSERT_TRUE((*copy)->get(b, theirs.data(), *t.stream).ok());
      EXPECT_EQ(mine, random_bytes(s.shard_bytes(b), (b == 1 ? 20 : 10) + b)) << "block " << b;
      EXPECT_EQ(theirs, random_bytes(s.shard_bytes(b), (b == 1 ? 10 : 20) + b)) << "block " << b;
    }
    auto other_shards = TieredStore::create(t.args(tier), std::vector<ShardSpec>{{"layer0", 1024}, {"layer1", 2048}});
    ASSERT_TRUE(other_shards.ok());
    const Status refused = s.swap_shard(1, **other_shards);
    EXPECT_EQ(refused.code(), ErrorCode::kInvalidArgument) << refused.to_string();
    const Tier elsewhere = tier == Tier::kNvme ? Tier::kCpu : Tier::kNvme;
    auto other_tier = TieredStore::create(t.args(elsewhere), kShards);
    ASSERT_TRUE(other_tier.ok());
    EXPECT_EQ(s.swap_shard(0, **other_tier).code(), ErrorCode::kInvalidArgument);
  });
}

// The asynchronous NVMe path the optimizer pass and the prefetcher use is
// counted too, and reads what put() wrote.
TEST(TieredStore, NvmeReadsAndWritesAreCounted) {
  Tiers t;
  auto store = TieredStore::create(t.args(Tier::kNvme), kShards);
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  TieredStore& s = **store;
  tzt::AlignedBuffer buf(s.shard_bytes(1));
  buf.fill_random(7);
  ASSERT_TRUE(s.write(1, buf.data()).wait().ok());
  tzt::AlignedBuffer back(s.shard_bytes(1));
  ASSERT_TRUE(s.read(1, back.data()).wait().ok());
  EXPECT_EQ(std::memcmp(back.data(), buf.data(), buf.size()), 0);
  EXPECT_EQ(t.traffic.write_bytes, s.shard_bytes(1));
  EXPECT_EQ(t.traffic.read_bytes, s.shard_bytes(1));
  t.traffic.reset();
  EXPECT_EQ(t.traffic.read_bytes + t.traffic.write_bytes, 0u);
}

// write_back is how the optimizer pass returns new values whatever the tier:
// after the pending writes and settle(), get() sees them; host_memory and
// device_memory say where code may work in place.
TEST(TieredStore, WriteBackReachesEveryTier) {
  for (Tier tier : {Tier::kGpu, Tier::kCpu, Tier::kNvme}) {
    SCOPED_TRACE(tier_name(tier));
    Tiers t;
    auto store = TieredStore::create(t.args(tier), kShards);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    const TieredStore& s = **store;
    EXPECT_EQ(s.host_memory(2) != nullptr, tier == Tier::kCpu);
    EXPECT_EQ(s.device_memory(2) != nullptr, tier == Tier::kGpu);
    std::vector<tzt::AlignedBuffer> values;
    std::vector<nvme::IoFuture> pending;
    for (std::size_t b = 0; b < 3; ++b) {
      values.emplace_back(s.shard_bytes(b));
      values.back().fill_random(200 + b);
      ASSERT_TRUE(s.write_back(b, values.back().data(), *t.stream, pending).ok());
    }
    EXPECT_EQ(pending.size(), tier == Tier::kNvme ? 3u : 0u);
    for (nvme::IoFuture& f : pending) ASSERT_TRUE(f.wait().ok());
    ASSERT_TRUE(s.settle(*t.stream).ok());
    for (std::size_t b = 0; b < 3; ++b) {
      std::vector<std::uint8_t> back(s.shard_bytes(b));
      ASSERT_TRUE(s.get(b, back.data(), *t.stream).ok());
      EXPECT_EQ(std::memcmp(back.data(), values[b].data(), back.size()), 0) << "block " << b;
    }
    // Values written in place on the cpu tier are already there: nothing moves.
    if (tier == Tier::kCpu) {
      std::memset(s.host_memory(0), 0x5a, s.shard_bytes(0));
      ASSERT_TRUE(s.write_back(0, s.host_memory(0), *t.stream, pending).ok());
      EXPECT_EQ(static_cast<const std::uint8_t*>(s.host_memory(0))[7], 0x5a);
    }
  }
}

// read_into mirrors write_back: whatever the tier, the shard's values arrive
// in the caller's buffer (NVMe through `pending`, the gpu tier once settled).
TEST(TieredStore, ReadIntoBringsAShardFromEveryTier) {
  on_every_tier([](Tiers& t, TieredStore& s, Tier tier) {
    std::vector<tzt::AlignedBuffer> values, back;
    std::vector<nvme::IoFuture> pending;
    for (std::size_t b = 0; b < 3; ++b) {
      values.emplace_back(s.shard_bytes(b));
      values.back().fill_random(300 + b);
      ASSERT_TRUE(s.put(b, values.back().data(), *t.stream).ok());
      back.emplace_back(s.shard_bytes(b));
      back.back().fill_random(400 + b);  // not the values
      ASSERT_TRUE(s.read_into(b, back.back().data(), *t.stream, pending).ok());
    }
    EXPECT_EQ(pending.size(), tier == Tier::kNvme ? 3u : 0u);
    for (nvme::IoFuture& f : pending) ASSERT_TRUE(f.wait().ok());
    ASSERT_TRUE(s.settle(*t.stream).ok());
    for (std::size_t b = 0; b < 3; ++b) {
      EXPECT_EQ(std::memcmp(back[b].data(), values[b].data(), s.shard_bytes(b)), 0) << "block " << b;
    }
  });
}

// shard_version counts the changes issued to one shard, whatever the path
// (put, write, write_back, swap_shard, on both stores), and nothing else:
// reads and other blocks' changes leave it (Note [The step keeps backward's
// parameter shards] in engine/src/kept_params.h).
TEST(TieredStore, EveryChangeOfAShardCountsInItsVersion) {
  on_every_tier([](Tiers& t, TieredStore& s, Tier tier) {
    auto copy = TieredStore::create(t.args(tier), kShards);
    ASSERT_TRUE(copy.ok()) << copy.status().to_string();
    for (std::size_t b = 0; b < 3; ++b) EXPECT_EQ(s.shard_version(b), 0u);
    tzt::AlignedBuffer value(s.shard_bytes(1));
    value.fill_random(5);
    ASSERT_TRUE(s.put(1, value.data(), *t.stream).ok());
    EXPECT_EQ(s.shard_version(1), 1u);
    std::vector<nvme::IoFuture> pending;
    ASSERT_TRUE(s.write_back(1, value.data(), *t.stream, pending).ok());
    EXPECT_EQ(s.shard_version(1), 2u);
    for (nvme::IoFuture& f : pending) ASSERT_TRUE(f.wait().ok());
    pending.clear();
    if (tier == Tier::kNvme) {
      nvme::IoFuture written = s.write(1, value.data());
      EXPECT_EQ(s.shard_version(1), 3u);
      ASSERT_TRUE(written.wait().ok());
    }
    ASSERT_TRUE(s.settle(*t.stream).ok());
    const std::uint64_t written = s.shard_version(1);
    tzt::AlignedBuffer back(s.shard_bytes(1));
    ASSERT_TRUE(s.get(1, back.data(), *t.stream).ok());
    ASSERT_TRUE(s.read_into(1, back.data(), *t.stream, pending).ok());
    for (nvme::IoFuture& f : pending) ASSERT_TRUE(f.wait().ok());
    EXPECT_EQ(s.shard_version(1), written) << "reads change nothing";
    EXPECT_EQ(s.shard_version(0) + s.shard_version(2), 0u) << "block 1's changes are block 1's";
    ASSERT_TRUE(s.swap_shard(2, **copy).ok());
    EXPECT_EQ(s.shard_version(2), 1u);
    EXPECT_EQ((*copy)->shard_version(2), 1u);
  });
}

// A format that is not a whole number of bytes an element sizes its shards
// with bytes_of: a remainder master's 2.125 B an element, padded to 4 KiB.
TEST(TieredStore, BytesOfSizesEachShard) {
  for (Tier tier : {Tier::kCpu, Tier::kNvme}) {
    Tiers t;
    TieredStoreArgs args = t.args(tier);
    args.bytes_of = [](std::uint64_t n) { return stored_master_bytes(MasterFormat::kRemainder, n); };
    const std::vector<ShardSpec> shards = {{"a", 2048}, {"b", 16 * 2048}};
    auto store = TieredStore::create(args, shards);
    ASSERT_TRUE(store.ok()) << store.status().to_string();
    EXPECT_EQ((*store)->shard_bytes(0), 8192u);             // 4096 + 256, padded
    EXPECT_EQ((*store)->shard_bytes(1), 16u * 4352u);       // 69632: already whole 4 KiB
    EXPECT_EQ((*store)->total_bytes(), 8192u + 69632u);
  }
}

TEST(TieredStore, APoolOverItsBudgetNamesTheStateBlockAndTier) {
  Tiers t;
  const std::vector<ShardSpec> big = {{"small", 1024}, {"huge", std::uint64_t{4} << 20}};  // 16 MiB > 8 MiB
  auto store = TieredStore::create(t.args(Tier::kCpu), big);
  ASSERT_FALSE(store.ok());
  const std::string message = store.status().to_string();
  EXPECT_NE(message.find("master shard of huge"), std::string::npos) << message;
  EXPECT_NE(message.find("on the cpu tier"), std::string::npos) << message;
}

TEST(TieredStore, NvmeOutOfRoomNamesTheBlockAndFreesWithTheStore) {
  Tiers t;
  const std::uint64_t before = t.swap->stats().used_bytes;
  {
    auto fits = TieredStore::create(t.args(Tier::kNvme), kShards);
    ASSERT_TRUE(fits.ok()) << fits.status().to_string();
    EXPECT_GT(t.swap->stats().used_bytes, before);
  }
  EXPECT_EQ(t.swap->stats().used_bytes, before);  // extents freed with the store
  const std::vector<ShardSpec> big = {{"first", 1024}, {"too_big", std::uint64_t{2} << 20}};  // 8 MiB > 4 MiB
  auto store = TieredStore::create(t.args(Tier::kNvme), big);
  ASSERT_FALSE(store.ok());
  const std::string message = store.status().to_string();
  EXPECT_NE(message.find("master shard of too_big"), std::string::npos) << message;
  EXPECT_NE(message.find("on NVMe"), std::string::npos) << message;
  EXPECT_EQ(t.swap->stats().used_bytes, before);  // the first block's extent went back too
}

}  // namespace
}  // namespace tz
