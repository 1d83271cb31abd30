// ShardStore: one state class's shards (one per block) for this rank, on one
// tier: device memory, pinned host memory, or NVMe extents.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "tierzero/engine/model.h"
#include "tierzero/nvme.h"
#include "tierzero/offload.h"

namespace tz::detail {

struct ShardStoreArgs {
  StateClass state = StateClass::kMaster;
  Tier tier = Tier::kCpu;
  std::size_t elem_bytes = 4;
  Colour colour = Colour::kMaster;       // gpu and cpu tiers, and its staging (Note [Coloured arrays])
  MemoryPool* device_pool = nullptr;     // for Tier::kGpu
  MemoryPool* host_pool = nullptr;       // for Tier::kCpu
  nvme::SwapStore* swap = nullptr;       // for Tier::kNvme
};

class ShardStore {
 public:
  // Reserves a shard per block (shard_numel elements each) on the tier.
  static Expected<std::unique_ptr<ShardStore>> create(const ShardStoreArgs& args, const ModelLayout& layout);
  ~ShardStore();

  StateClass state() const { return args_.state; }
  Tier tier() const { return args_.tier; }
  std::size_t elem_bytes() const { return args_.elem_bytes; }
  Colour colour() const { return args_.colour; }
  std::size_t shard_bytes(std::size_t block) const { return shard_bytes_[block]; }
  // The shard's memory on the gpu and cpu tiers; nullptr on nvme.
  void* memory(std::size_t block) const { return memory_.empty() ? nullptr : memory_[block].data(); }
  nvme::ExtentId extent(std::size_t block) const { return extents_[block]; }

  // NVMe tier: the shard to or from `host` (pinned, shard_bytes long, aligned
  // for O_DIRECT). Errors name the state class and block.
  nvme::IoFuture read(std::size_t block, void* host) const;
  nvme::IoFuture write(std::size_t block, const void* host) const;
  void read(std::size_t block, void* host, nvme::IoCallback done) const;

  std::uint64_t total_bytes() const;

 private:
  explicit ShardStore(const ShardStoreArgs& args) : args_(args) {}
  ShardStoreArgs args_;
  std::vector<std::size_t> shard_bytes_;
  std::vector<PoolBlock> memory_;          // gpu, cpu
  std::vector<nvme::ExtentId> extents_;    // nvme
};

}  // namespace tz::detail
