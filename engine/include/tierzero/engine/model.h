// The model as the engine sees it: an ordered list of blocks (a layer, a
// module), each a list of parameters, and how each block is flattened,
// padded and sharded over the data-parallel ranks.
//
// Layout of block b (see Note [Chunk layout] in layout.cpp):
//   - its parameters lie one after another in one flat chunk, each starting
//     at a multiple of kParamAlignElems elements (so every view is 64-byte
//     aligned in 16-bit);
//   - the chunk is padded to whole_numel = ranks * shard_numel, where
//     shard_numel = align_up(ceil(used / ranks), kShardAlignElems) (4 KiB of
//     16-bit, 8 KiB of fp32: every shard is an O_DIRECT-aligned extent and a
//     NCCL-friendly size); this is the planner's formula (docs/placement.md);
//   - rank r owns elements [r * shard_numel, (r + 1) * shard_numel).
// Padding elements are zero and stay zero (their gradients are zero, so Adam
// leaves them at zero).
//
//   std::vector<tz::BlockSpec> model = {{"layer0", {{"w", {1024, 1024}}, {"b", {1024}}}}, ...};
//   TZ_ASSIGN_OR_RETURN(tz::ModelLayout layout, tz::ModelLayout::make(model, ranks, persistence_threshold));
//   const tz::BlockLayout& b = layout.blocks[0];   // b.shard_numel, b.params[1].offset ...
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tierzero/common.h"

namespace tz {

struct ParamSpec {
  std::string name;
  std::vector<std::int64_t> shape;  // every dimension >= 1; {} is a scalar
  std::uint64_t numel() const;
};

struct BlockSpec {
  std::string name;
  std::vector<ParamSpec> params;    // at least one
};

inline constexpr std::uint64_t kParamAlignElems = 32;    // 64 bytes of 16-bit
inline constexpr std::uint64_t kShardAlignElems = 2048;  // 4 KiB of 16-bit

struct ParamLayout {
  std::string name;
  std::vector<std::int64_t> shape;
  std::uint64_t offset = 0;         // elements from the start of the block's chunk
  std::uint64_t numel = 0;
};

struct BlockLayout {
  std::string name;
  std::vector<ParamLayout> params;
  std::uint64_t used_numel = 0;     // end of the last parameter (alignment gaps included)
  std::uint64_t param_numel = 0;    // sum of the parameters' numel
  std::uint64_t shard_numel = 0;    // per rank
  std::uint64_t whole_numel = 0;    // ranks * shard_numel
  bool persistent = false;          // stays whole on the device (stage 3: below the persistence threshold)
};

struct ModelLayout {
  std::vector<BlockLayout> blocks;
  int ranks = 1;
  std::uint64_t param_numel = 0;    // sum over blocks of param_numel (the model's size)
  std::uint64_t shard_numel = 0;    // sum over blocks of shard_numel (one rank's share)

  // Validates the model (names non-empty and unique per block, shapes
  // positive, no empty block) and lays it out. Errors name the block and
  // parameter. `persist_below`: blocks with fewer parameters stay whole.
  static Expected<ModelLayout> make(const std::vector<BlockSpec>& model, int ranks, std::uint64_t persist_below);

  // Elements per block in planner order (tz::PlanInput::block_numel).
  std::vector<std::uint64_t> block_numel() const;
  // The largest block's shard_numel (a buffer that holds any one shard).
  std::uint64_t largest_shard_numel() const;
};

}  // namespace tz
