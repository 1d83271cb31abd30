// KeptParams: the 16-bit parameter shards the prefetcher read from NVMe,
// kept in CPU memory for the optimizer step that rebuilds remainder masters
// from them.
//
// Note [The step keeps backward's parameter shards]
// With a remainder master (Note [Remainder masters in the engine]) the CPU
// optimizer rebuilds each fp32 master from the bf16 parameter shard and its
// remainder, so its step needs the parameter shard in CPU memory. With the
// parameters on NVMe it read each block's shard there (2 B/param of NVMe
// reads a step, Note [Remainder traffic]) a moment after backward had read
// the same shard to gather the block. Instead, the prefetcher hands the
// staging its read landed in (the shard as stored: the read checked its
// checksum, and the host-to-device copy only read it) to this component
// rather than back to the pool, and the step copies the shard from there:
// run() into its sub-group's staging, a step under backward into its slot.
//
// Exact: a kept copy is used only while it is the stored shard's bytes.
// TieredStore counts the changes issued to each shard (shard_version: put,
// write, write_back, swap_shard); a copy carries the count its read was
// issued at, and is used only while the count is still that. So whatever
// rewrites the shard between the fetch and the step (set_master, which a
// user's weight edit goes through; a checkpoint load; the commit of a step
// under backward; the step itself) makes the copy stale, by whichever path
// it wrote, and the step reads the shard from NVMe as before. The engine
// never reads a shard while a write to it is in flight (its fetches would
// be wrong too: step() and set_master drop the reads in flight first), so a
// read issued at an unchanged count landed the stored bytes.
//
// Which fetch: each fetch's copy replaces the block's last one, so the copy
// the step finds is from the last read before it, normally the backward fetch
// of the accumulation window's last micro-batch (the forward fetches of every
// micro-batch, and the earlier backward ones, are replaced on the way; an
// evaluation's fetch is as good). A step under backward copies the shard and
// leaves the kept one, so run() finds it again after an undo (the redo).
// Ranks: each rank reads only its own shard from NVMe and all-gathers the
// block on the device (Note [Prefetch window]), so each keeps its own shard.
// Persistent blocks are gathered whole after each step, outside the window,
// and are not kept.
//
// Memory: a copy is held from the block's first fetch in a window to the
// step, whose end drops them all (run() rewrote every shard it stepped); so
// does whatever reads or writes states outside a step (checkpoints,
// set_master, gather_master, exports: they cancel the steps under backward,
// and this with them), so their staging finds the headroom free. The blocks
// that may be kept are chosen at creation (choose_kept_blocks): from the
// last block (backward reaches it first) while their shards, as the host
// pool reserves them, fit in this rank's share of the CPU tier's headroom in
// the plan, before the steps under backward take theirs (a kept shard saves
// its NVMe read for certain, a step under backward only may hide time). The
// engine adds them to its plan's CPU breakdown, and the planner counts the
// same from the layout (add_kept_params in offload/src/planner.cpp), so
// tierzero-estimate shows it. Blocks not kept are read from NVMe at the step
// as before; the step report counts both (kept_param_blocks and _bytes, the
// NVMe reads saved, and reread_param_blocks), and the NVMe bytes it reports
// drop by themselves (the stores count what they move).
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "tierzero/engine/model.h"
#include "tierzero/offload.h"

namespace tz::detail {

struct KeptParamsDeps {
  const TieredStore* param16 = nullptr;  // on NVMe
  const ModelLayout* layout = nullptr;
};

// The blocks that may be kept and the CPU memory they take.
struct KeptChoice {
  std::vector<bool> may;   // per block
  std::size_t blocks = 0;  // how many may
  std::uint64_t bytes = 0; // their shards as the host pool reserves them (whole pages)
};

// From the last block back, the non-persistent blocks whose shards fit in
// `share` bytes (this rank's share of the CPU tier's headroom); stops at the
// first that does not.
KeptChoice choose_kept_blocks(const ModelLayout& layout, const TieredStore& param16, std::int64_t share);

// What the steps took since the last take_counts().
struct KeptCounts {
  std::uint64_t blocks = 0, bytes = 0;  // shards copied from kept copies (NVMe reads saved)
  std::uint64_t reread = 0;             // shards asked for with no current copy (read from NVMe)
};

// Threads: keep() from the training thread (the prefetcher), copy_to() from
// the training thread (run()) and the optimizer thread (steps under
// backward) at once; a mutex orders them.
class KeptParams {
 public:
  KeptParams(const KeptParamsDeps& deps, std::vector<bool> may);

  bool may_keep(std::size_t block) const { return may_[block]; }
  // After a fetch of `block` read its shard from NVMe into `shard` (landed;
  // shard_bytes long) with the read issued at `version` (the store's
  // shard_version then): kept in place of the block's last copy, or released
  // now where the block may not be kept.
  void keep(std::size_t block, PoolBlock shard, std::uint64_t version);
  // The step: copies `block`'s kept shard into `out` (shard_bytes) and
  // returns true when it is still the stored shard's bytes; else false, and
  // the caller reads the shard from its tier. Either way counted.
  bool copy_to(std::size_t block, void* out);
  // Releases `block`'s copy to the pool: the step's last use of it (the
  // pass frees each copy as it takes it, not all at its end).
  void release(std::size_t block);
  // Releases every copy to the pool.
  void drop_all();
  KeptCounts take_counts();

 private:
  struct Copy {
    PoolBlock shard;  // (shard_numel,) 16-bit, as read from NVMe
    std::uint64_t version = 0;
  };
  KeptParamsDeps deps_;
  std::vector<bool> may_;
  std::mutex mu_;
  std::vector<Copy> copies_;  // per block; guarded by mu_
  KeptCounts counts_;         // guarded by mu_
};

}  // namespace tz::detail
