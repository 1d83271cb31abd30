#include "shard_store.h"

namespace tz::detail {

Expected<std::unique_ptr<ShardStore>> ShardStore::create(const ShardStoreArgs& args, const ModelLayout& layout) {
  std::unique_ptr<ShardStore> store(new ShardStore(args));
  const std::string_view what = state_class_name(args.state);
  for (std::size_t b = 0; b < layout.blocks.size(); ++b) {
    const std::size_t bytes = layout.blocks[b].shard_numel * args.elem_bytes;
    store->shard_bytes_.push_back(bytes);
    switch (args.tier) {
      case Tier::kGpu:
      case Tier::kCpu: {
        MemoryPool* pool = args.tier == Tier::kGpu ? args.device_pool : args.host_pool;
        Expected<PoolBlock> block = pool->allocate(bytes, args.colour);
        TZ_TRY_CTX(block, "{} shard of {} ({} on the {} tier)", what, layout.blocks[b].name, format_bytes(bytes),
                   tier_name(args.tier));
        store->memory_.push_back(std::move(*block));
        break;
      }
      case Tier::kNvme: {
        // Staging buffers hold exactly a shard: a path whose direct-I/O
        // alignment does not divide it would make reads overrun them.
        if (args.swap->padded_bytes(bytes) != bytes) {
          return invalid_argument("{} shard of {} is {} bytes, not a multiple of the NVMe paths' direct-I/O "
                                  "alignment ({} bytes); use a path with 4 KiB or smaller alignment",
                                  what, layout.blocks[b].name, bytes, args.swap->padded_bytes(1));
        }
        Expected<nvme::ExtentId> extent = args.swap->allocate(bytes);
        TZ_TRY_CTX(extent, "{} shard of {} ({} on NVMe)", what, layout.blocks[b].name, format_bytes(bytes));
        store->extents_.push_back(*extent);
        break;
      }
    }
  }
  return store;
}

ShardStore::~ShardStore() {
  for (nvme::ExtentId e : extents_) {
    Status s = args_.swap->free(e);
    if (!s.ok()) TZ_LOG_WARN("engine", "freeing a {} extent: {}", state_class_name(args_.state), s.message());
  }
}

nvme::IoFuture ShardStore::read(std::size_t block, void* host) const { return args_.swap->read(extents_[block], host); }

void ShardStore::read(std::size_t block, void* host, nvme::IoCallback done) const {
  args_.swap->read(extents_[block], host, std::move(done));
}

nvme::IoFuture ShardStore::write(std::size_t block, const void* host) const {
  return args_.swap->write(extents_[block], host);
}

std::uint64_t ShardStore::total_bytes() const {
  std::uint64_t total = 0;
  for (std::size_t b : shard_bytes_) total += b;
  return total;
}

}  // namespace tz::detail
