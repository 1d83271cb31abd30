// Note [The step keeps backward's parameter shards] (kept_params.h).
#include "kept_params.h"

#include <cstring>
#include <utility>

#include "optimizer_pass.h"  // pool_bytes

namespace tz::detail {

KeptChoice choose_kept_blocks(const ModelLayout& layout, const TieredStore& param16, std::int64_t share) {
  KeptChoice c;
  c.may.assign(layout.blocks.size(), false);
  for (std::size_t b = layout.blocks.size(); b-- > 0;) {
    if (layout.blocks[b].persistent) continue;
    const std::uint64_t bytes = pool_bytes(param16.shard_bytes(b));
    if (static_cast<std::int64_t>(c.bytes + bytes) > share) break;
    c.bytes += bytes;
    c.may[b] = true;
    ++c.blocks;
  }
  return c;
}

KeptParams::KeptParams(const KeptParamsDeps& deps, std::vector<bool> may)
    : deps_(deps), may_(std::move(may)), copies_(deps.layout->blocks.size()) {}

void KeptParams::keep(std::size_t block, PoolBlock shard, std::uint64_t version) {
  if (!may_[block]) return;  // `shard` goes back to the pool here
  PoolBlock old;
  {
    std::lock_guard<std::mutex> lock(mu_);
    old = std::exchange(copies_[block].shard, std::move(shard));
    copies_[block].version = version;
  }
  // `old` is released outside the lock.
}

bool KeptParams::copy_to(std::size_t block, void* out) {
  std::lock_guard<std::mutex> lock(mu_);
  const Copy& copy = copies_[block];
  const std::size_t bytes = deps_.param16->shard_bytes(block);
  if (!copy.shard.valid() || copy.version != deps_.param16->shard_version(block)) {
    ++counts_.reread;
    return false;
  }
  std::memcpy(out, copy.shard.data(), bytes);
  ++counts_.blocks;
  counts_.bytes += bytes;
  return true;
}

void KeptParams::release(std::size_t block) {
  Copy dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (block < copies_.size()) std::swap(dropped, copies_[block]);
  }
}

void KeptParams::drop_all() {
  std::vector<Copy> dropped(copies_.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::swap(dropped, copies_);
  }
}

KeptCounts KeptParams::take_counts() {
  std::lock_guard<std::mutex> lock(mu_);
  return std::exchange(counts_, KeptCounts{});
}

}  // namespace tz::detail
