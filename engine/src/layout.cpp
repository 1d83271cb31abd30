// ModelLayout: flattening, padding and sharding of the model's blocks.
//
// Note [Chunk layout]
// One flat chunk per block keeps every hop a single transfer: one NVMe extent
// per shard, one host-to-device copy, one all-gather into a contiguous buffer
// whose parameter views the caller uses as they are. Parameters start at
// multiples of 32 elements so each view is 64-byte aligned (vector loads, and
// cuBLAS's preferred alignment); shards are multiples of 2048 elements so a
// 16-bit shard is whole 4 KiB pages for O_DIRECT and an fp32 one whole 8 KiB.
#include <algorithm>
#include <set>

#include <fmt/ranges.h>

#include "tierzero/engine/model.h"

namespace tz {

std::uint64_t ParamSpec::numel() const {
  std::uint64_t n = 1;
  for (std::int64_t d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

Expected<ModelLayout> ModelLayout::make(const std::vector<BlockSpec>& model, int ranks, std::uint64_t persist_below) {
  if (ranks < 1) return invalid_argument("model layout: ranks = {} must be >= 1", ranks);
  if (model.empty()) return invalid_argument("model layout: the model has no blocks");
  ModelLayout out;
  out.ranks = ranks;
  std::set<std::string> block_names;
  for (std::size_t b = 0; b < model.size(); ++b) {
    const BlockSpec& spec = model[b];
    const std::string block_name = spec.name.empty() ? fmt::format("block {}", b) : spec.name;
    if (!spec.name.empty() && !block_names.insert(spec.name).second) {
      return invalid_argument("model layout: two blocks are named '{}'", spec.name);
    }
    if (spec.params.empty()) return invalid_argument("model layout: {} has no parameters", block_name);
    BlockLayout block{.name = block_name};
    std::set<std::string> param_names;
    for (const ParamSpec& p : spec.params) {
      if (p.name.empty()) return invalid_argument("model layout: {} has a parameter with no name", block_name);
      if (!param_names.insert(p.name).second) {
        return invalid_argument("model layout: {} has two parameters named '{}'", block_name, p.name);
      }
      // Every dimension >= 1, and the product well inside 64 bits (2^50 elements is 4 PiB of fp32: no model
      // has a parameter that size, and offsets and byte counts derived from it cannot overflow).
      constexpr std::uint64_t kMaxNumel = std::uint64_t{1} << 50;
      std::uint64_t numel = 1;
      for (std::int64_t d : p.shape) {
        if (d < 1) {
          return invalid_argument("model layout: {}.{} has a dimension of {} (every dimension must be >= 1)",
                                  block_name, p.name, d);
        }
        if (static_cast<std::uint64_t>(d) > kMaxNumel / numel) {
          return invalid_argument("model layout: {}.{} of shape ({}) has more than 2^50 elements", block_name, p.name,
                                  fmt::join(p.shape, ", "));
        }
        numel *= static_cast<std::uint64_t>(d);
      }
      if (block.used_numel > kMaxNumel) {
        return invalid_argument("model layout: {} has more than 2^50 elements", block_name);
      }
      const std::uint64_t offset = align_up(block.used_numel, kParamAlignElems);
      block.params.push_back(ParamLayout{p.name, p.shape, offset, numel});
      block.used_numel = offset + numel;
      block.param_numel += numel;
    }
    block.shard_numel = align_up((block.used_numel + ranks - 1) / ranks, kShardAlignElems);
    block.whole_numel = block.shard_numel * static_cast<std::uint64_t>(ranks);
    block.persistent = block.param_numel < persist_below;
    out.param_numel += block.param_numel;
    out.shard_numel += block.shard_numel;
    out.blocks.push_back(std::move(block));
  }
  return out;
}

std::vector<std::uint64_t> ModelLayout::block_numel() const {
  std::vector<std::uint64_t> out;
  out.reserve(blocks.size());
  for (const BlockLayout& b : blocks) out.push_back(b.param_numel);
  return out;
}

std::uint64_t ModelLayout::largest_shard_numel() const {
  std::uint64_t n = 0;
  for (const BlockLayout& b : blocks) n = std::max(n, b.shard_numel);
  return n;
}

}  // namespace tz
