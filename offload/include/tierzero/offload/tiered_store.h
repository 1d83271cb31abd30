// TieredStore: one state class's shards for this rank, one per block, on one
// tier: device memory, pinned host memory, or NVMe extents (nvme's swap
// store). The engine keeps one per state array (16-bit parameters, gradient,
// master weights, each moment) and asks it to move a shard; only the store
// knows how its tier does that.
//
//   TZ_ASSIGN_OR_RETURN(auto master, TieredStore::create(
//       {.state = StateClass::kMaster, .tier = Tier::kNvme, .elem_bytes = 4, .device = device,
//        .host_pool = host_pool, .swap = swap, .traffic = &traffic}, shards));
//   TZ_TRY(master->put(b, values, *stream));   // whatever the tier
//   TZ_TRY(master->get(b, values, *stream));
//
// put()/get() move a whole shard between ordinary host memory and the tier,
// and return when it has moved (the GPU tier copies on `stream` and waits;
// NVMe goes through a staging block of the host pool, aligned for O_DIRECT).
// The optimizer pass and the prefetcher stream NVMe shards themselves through
// their own staging (read()/write(), asynchronous); resident() says whether a
// shard has memory() to work on in place. Every NVMe byte a store moves is
// counted in its NvmeTraffic, which the engine's step report reads.
//
// Threads: put/get/read/write may run on several threads for different
// blocks; creation and destruction are single-threaded.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tierzero/nvme.h"
#include "tierzero/offload/device.h"
#include "tierzero/offload/planner.h"
#include "tierzero/offload/pool.h"

namespace tz {

// NVMe bytes moved by the stores that share it, since the last reset().
struct NvmeTraffic {
  std::atomic<std::uint64_t> read_bytes{0}, write_bytes{0};
  void reset() { read_bytes = write_bytes = 0; }
};

// A block's shard as the store sees it: its name (for errors) and size.
struct ShardSpec {
  std::string name;
  std::uint64_t numel = 0;
};

struct TieredStoreArgs {
  StateClass state = StateClass::kMaster;
  Tier tier = Tier::kCpu;
  std::size_t elem_bytes = 4;
  // A shard's bytes for a format that is not a whole number of bytes an
  // element (a remainder master: stored_master_bytes); numel x elem_bytes when empty.
  std::function<std::uint64_t(std::uint64_t numel)> bytes_of;
  Colour colour = Colour::kMaster;       // gpu and cpu tiers, and NVMe staging (Note [Coloured arrays])
  Device* device = nullptr;              // copies to and from the gpu tier
  MemoryPool* device_pool = nullptr;     // for Tier::kGpu
  MemoryPool* host_pool = nullptr;       // for Tier::kCpu, and staging for Tier::kNvme
  nvme::SwapStore* swap = nullptr;       // for Tier::kNvme
  NvmeTraffic* traffic = nullptr;        // for Tier::kNvme: counts what read/write/put/get move
};

class TieredStore {
 public:
  // Reserves a shard per block (numel x elem_bytes, or bytes_of(numel), each) on the tier. Errors
  // name the state class, the block and the tier (a pool over its budget, NVMe
  // out of room, a shard the NVMe paths' direct-I/O alignment does not divide).
  static Expected<std::unique_ptr<TieredStore>> create(const TieredStoreArgs& args, std::span<const ShardSpec> shards);
  ~TieredStore();
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  StateClass state() const { return args_.state; }
  Tier tier() const { return args_.tier; }
  std::size_t elem_bytes() const { return args_.elem_bytes; }
  Colour colour() const { return args_.colour; }
  std::size_t blocks() const { return shard_bytes_.size(); }
  std::size_t shard_bytes(std::size_t block) const { return shard_bytes_[block]; }
  std::uint64_t total_bytes() const;
  // Whether shards have memory() (the gpu and cpu tiers), or live on NVMe.
  bool resident() const { return args_.tier != Tier::kNvme; }
  // The shard's memory on the gpu and cpu tiers; nullptr on NVMe.
  void* memory(std::size_t block) const { return memory_.empty() ? nullptr : memory_[block].data(); }
  // Where host code may work on the shard in place (the cpu tier), and where
  // device code may (the gpu tier); nullptr where it may not.
  void* host_memory(std::size_t block) const { return args_.tier == Tier::kCpu ? memory(block) : nullptr; }
  void* device_memory(std::size_t block) const { return args_.tier == Tier::kGpu ? memory(block) : nullptr; }
  nvme::ExtentId extent(std::size_t block) const { return extents_[block]; }

  // The whole shard from / into `host` (ordinary host memory), whatever the
  // tier; returns once moved. `stream`: the GPU tier's copies.
  Status put(std::size_t block, const void* host, Stream& stream);
  Status get(std::size_t block, void* host, Stream& stream) const;

  // NVMe tier: the shard to or from `host` (pinned, shard_bytes long, aligned
  // for O_DIRECT), asynchronously. Errors are the swap store's (the file and
  // extent); callers add the block.
  nvme::IoFuture read(std::size_t block, void* host) const;
  nvme::IoFuture write(std::size_t block, const void* host) const;
  void read(std::size_t block, void* host, nvme::IoCallback done) const;

  // Starts moving the shard's new values at `host` (pinned, shard_bytes
  // long; aligned for O_DIRECT) to the tier, whatever it is, and adds what to
  // wait for to `pending`: the cpu tier copies now (nothing when `host` is
  // the shard's own memory), the gpu tier queues the copy on `stream` (moved
  // once settle(stream) returns), NVMe writes asynchronously.
  Status write_back(std::size_t block, const void* host, Stream& stream, std::vector<nvme::IoFuture>& pending) const;
  // Its mirror: starts moving the shard's values from the tier, whatever it
  // is, into `host` (pinned, shard_bytes long; aligned for O_DIRECT): the cpu
  // tier copies now (nothing when `host` is the shard's own memory), the gpu
  // tier queues the copy on `stream` (there once settle(stream) returns), NVMe
  // reads asynchronously into `pending`.
  Status read_into(std::size_t block, void* host, Stream& stream, std::vector<nvme::IoFuture>& pending) const;
  // Waits for the copies write_back or read_into queued on `stream`; nothing to do off the gpu tier.
  Status settle(Stream& stream) const;

  // Exchanges `block`'s shard (its NVMe extent, or its memory) with
  // `other`'s, a store of the same tier and shard sizes: new values written
  // to a second copy become the store's at once (Note [Stepping under
  // backward] in engine/src/step_ahead.h). Nothing moves.
  Status swap_shard(std::size_t block, TieredStore& other);

  // How many changes of `block`'s shard have been issued: put, write,
  // write_back and swap_shard each add one as they start (a memory() shard
  // written in place by its owner is not counted). The same count at two
  // points means nothing was issued to change the shard in between, so a copy
  // read after the first, once landed, still holds its bytes at the second
  // (Note [The step keeps backward's parameter shards] in
  // engine/src/kept_params.h). Any thread.
  std::uint64_t shard_version(std::size_t block) const { return versions_[block].load(std::memory_order_acquire); }

 private:
  explicit TieredStore(const TieredStoreArgs& args) : args_(args) {}
  void changed(std::size_t block) const { versions_[block].fetch_add(1, std::memory_order_acq_rel); }
  TieredStoreArgs args_;
  std::vector<std::string> names_;
  std::vector<std::size_t> shard_bytes_;
  std::vector<PoolBlock> memory_;          // gpu, cpu
  std::vector<nvme::ExtentId> extents_;    // nvme
  // shard_version's counts, per block. Mutable: write() and write_back() are
  // const (they move bytes, not the store's shape) and count too.
  mutable std::unique_ptr<std::atomic<std::uint64_t>[]> versions_;
};

}  // namespace tz
