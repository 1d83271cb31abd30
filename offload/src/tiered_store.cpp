#include "tierzero/offload/tiered_store.h"

#include <utility>
#include <cstring>

#include "tierzero/common/log.h"
#include "tierzero/common/units.h"

namespace tz {

Expected<std::unique_ptr<TieredStore>> TieredStore::create(const TieredStoreArgs& args,
                                                           std::span<const ShardSpec> shards) {
  std::unique_ptr<TieredStore> store(new TieredStore(args));
  store->versions_ = std::make_unique<std::atomic<std::uint64_t>[]>(shards.size());
  const std::string_view what = state_class_name(args.state);
  for (const ShardSpec& shard : shards) {
    const std::size_t bytes = args.bytes_of ? args.bytes_of(shard.numel) : shard.numel * args.elem_bytes;
    store->names_.push_back(shard.name);
    store->shard_bytes_.push_back(bytes);
    switch (args.tier) {
      case Tier::kGpu:
      case Tier::kCpu: {
        MemoryPool* pool = args.tier == Tier::kGpu ? args.device_pool : args.host_pool;
        Expected<PoolBlock> block = pool->allocate(bytes, args.colour);
        TZ_TRY_CTX(block, "{} shard of {} ({} on the {} tier)", what, shard.name, format_bytes(bytes),
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
                                  what, shard.name, bytes, args.swap->padded_bytes(1));
        }
        Expected<nvme::ExtentId> extent = args.swap->allocate(bytes);
        TZ_TRY_CTX(extent, "{} shard of {} ({} on NVMe)", what, shard.name, format_bytes(bytes));
        store->extents_.push_back(*extent);
        break;
      }
    }
  }
  return store;
}

TieredStore::~TieredStore() {
  for (nvme::ExtentId e : extents_) {
    Status s = args_.swap->free(e);
    if (!s.ok()) TZ_LOG_WARN("engine", "freeing a {} extent: {}", state_class_name(args_.state), s.message());
  }
}

std::uint64_t TieredStore::total_bytes() const {
  std::uint64_t total = 0;
  for (std::size_t b : shard_bytes_) total += b;
  return total;
}

Status TieredStore::put(std::size_t block, const void* host, Stream& stream) {
  const std::size_t bytes = shard_bytes_[block];
  if (args_.tier != Tier::kNvme) changed(block);  // NVMe: write() counts it
  switch (args_.tier) {
    case Tier::kGpu:
      TZ_TRY(args_.device->copy_async(memory(block), host, bytes, stream));
      return args_.device->synchronize_stream(stream);
    case Tier::kCpu:
      std::memcpy(memory(block), host, bytes);
      return ok_status();
    case Tier::kNvme: {
      // O_DIRECT wants aligned memory: go through a pool block.
      TZ_ASSIGN_OR_RETURN(PoolBlock staging, args_.host_pool->allocate(bytes));
      std::memcpy(staging.data(), host, bytes);
      return write(block, staging.data()).wait();
    }
  }
  return ok_status();
}

Status TieredStore::get(std::size_t block, void* host, Stream& stream) const {
  const std::size_t bytes = shard_bytes_[block];
  switch (args_.tier) {
    case Tier::kGpu:
      TZ_TRY(args_.device->copy_async(host, memory(block), bytes, stream));
      return args_.device->synchronize_stream(stream);
    case Tier::kCpu:
      std::memcpy(host, memory(block), bytes);
      return ok_status();
    case Tier::kNvme: {
      TZ_ASSIGN_OR_RETURN(PoolBlock staging, args_.host_pool->allocate(bytes));
      TZ_TRY(read(block, staging.data()).wait());
      std::memcpy(host, staging.data(), bytes);
      return ok_status();
    }
  }
  return ok_status();
}

nvme::IoFuture TieredStore::read(std::size_t block, void* host) const {
  args_.traffic->read_bytes += shard_bytes_[block];
  return args_.swap->read(extents_[block], host);
}

void TieredStore::read(std::size_t block, void* host, nvme::IoCallback done) const {
  args_.traffic->read_bytes += shard_bytes_[block];
  args_.swap->read(extents_[block], host, std::move(done));
}

nvme::IoFuture TieredStore::write(std::size_t block, const void* host) const {
  changed(block);
  args_.traffic->write_bytes += shard_bytes_[block];
  return args_.swap->write(extents_[block], host);
}

Status TieredStore::write_back(std::size_t block, const void* host, Stream& stream,
                               std::vector<nvme::IoFuture>& pending) const {
  const std::size_t bytes = shard_bytes_[block];
  if (args_.tier != Tier::kNvme) changed(block);  // NVMe: write() counts it (in place too: its owner rewrote it)
  switch (args_.tier) {
    case Tier::kGpu:
      return args_.device->copy_async(memory(block), host, bytes, stream);
    case Tier::kCpu:
      if (host != memory(block)) std::memcpy(memory(block), host, bytes);
      return ok_status();
    case Tier::kNvme:
      pending.push_back(write(block, host));
      return ok_status();
  }
  return ok_status();
}

Status TieredStore::read_into(std::size_t block, void* host, Stream& stream,
                              std::vector<nvme::IoFuture>& pending) const {
  const std::size_t bytes = shard_bytes_[block];
  switch (args_.tier) {
    case Tier::kGpu:
      return args_.device->copy_async(host, memory(block), bytes, stream);
    case Tier::kCpu:
      if (host != memory(block)) std::memcpy(host, memory(block), bytes);
      return ok_status();
    case Tier::kNvme:
      pending.push_back(read(block, host));
      return ok_status();
  }
  return ok_status();
}

Status TieredStore::swap_shard(std::size_t block, TieredStore& other) {
  if (other.args_.tier != args_.tier || block >= shard_bytes_.size() || block >= other.shard_bytes_.size() ||
      other.shard_bytes_[block] != shard_bytes_[block]) {
    return invalid_argument("swap_shard: block {} of a {} store on {} cannot trade with one on {}", block,
                            state_class_name(args_.state), tier_name(args_.tier), tier_name(other.args_.tier));
  }
  changed(block);
  other.changed(block);
  if (args_.tier == Tier::kNvme) {
    std::swap(extents_[block], other.extents_[block]);
  } else {
    std::swap(memory_[block], other.memory_[block]);
  }
  return ok_status();
}

Status TieredStore::settle(Stream& stream) const {
  return args_.tier == Tier::kGpu ? args_.device->synchronize_stream(stream) : ok_status();
}

}  // namespace tz
