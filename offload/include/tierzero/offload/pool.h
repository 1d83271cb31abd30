// MemoryPool: a budgeted caching allocator for one tier (device memory, or
// pinned host memory), after PyTorch's CUDACachingAllocator.
//
// Blocks are carved by a RawAllocator (the device, or page-locked host memory)
// and cached when released, keyed by size, so a workload that asks for the same
// sizes every step allocates nothing from the backend after its first step.
// Every block counts against a fixed budget; a request that would exceed it
// first releases cached blocks, and then fails with an OutOfMemory Status that
// names the tier, the budget, the request, what is in use, and the config key
// that raises the budget. Nothing aborts.
//
//   TZ_ASSIGN_OR_RETURN(auto pool, tz::make_device_pool(*device, 8 * tz::kGiB));
//   TZ_ASSIGN_OR_RETURN(tz::PoolBlock buf, pool->allocate(64 * tz::kMiB));
//   TZ_TRY(device->copy_async(buf.data(), h_src, buf.size_bytes(), *stream));
//   TZ_TRY(pool->release_after(std::move(buf), *stream));  // reusable once the copy is done
//
// Sizes: requests round up to the granularity (4 KiB default); a cached block
// up to `max_slack` larger than the rounded request is reused, larger ones are
// left for bigger requests. Blocks are never split.
// Threads: every method is thread-safe. The pool must outlive its blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tierzero/common.h"
#include "tierzero/offload/device.h"

namespace tz {

// Note [Coloured arrays]
// One optimizer kernel streams five arrays at once (the master, the gradient,
// two moments, the 16-bit copy). Arrays that lie an exact multiple of a large
// power of two apart map every element to the same cache sets (and DRAM
// banks) as its partners: with the optimizer's arrays 128 MiB apart every
// Adam kernel on an AVX2 host ran ~2x slower (issue #25). Shards of a GPT
// block at width 4096 are multiples of 128 MiB, adjacent mmaps are adjacent
// in the address space, and host blocks of 2 MiB or more start on a huge page
// (Note [Host memory on huge pages]): left alone they would all alias. So
// each array a kernel streams together gets its own colour, and the host
// allocator starts a block of kColourMinBytes or more kColourStepBytes x
// colour past a 2 MiB boundary. 68 KiB = 17 pages: a different 4 KiB page
// offset within each 64 KiB and a different 64 KiB window, so partners fall in
// different L2/L3 sets whatever the set count, while every block stays
// page-aligned (O_DIRECT). The offset is cut from the 2 MiB slack the
// alignment maps anyway: a coloured block costs no byte more than an
// uncoloured one. Below 32 MiB blocks are not coloured: the offset would keep
// a smaller block off huge pages altogether (at 32 MiB it costs at most 340
// KiB of them), and the 128 MiB strides that alias are far larger. A pool
// reuses a cached block only for a request of the same colour.
enum class Colour : unsigned { kMaster = 0, kGrad = 1, kExpAvg = 2, kExpAvgSq = 3, kParam16 = 4, kArrivingGrad = 5 };
inline constexpr std::size_t kColourStepBytes = std::size_t{68} << 10;
inline constexpr std::size_t kColourMinBytes = std::size_t{32} << 20;

// Where a pool's blocks come from. deallocate() logs failures (it runs from
// destructors) and never throws.
class RawAllocator {
 public:
  virtual ~RawAllocator() = default;
  virtual Expected<void*> allocate(std::size_t bytes) = 0;
  // Note [Coloured arrays]: allocators that can place a block by colour do; the rest ignore it.
  virtual Expected<void*> allocate_coloured(std::size_t bytes, Colour /*colour*/) { return allocate(bytes); }
  virtual void deallocate(void* ptr, std::size_t bytes) = 0;
};

struct PoolOptions {
  std::string tier = "gpu";                          // named in errors and stats
  std::string budget_key = "tierzero.tiers.gpu_bytes";  // the setting that raises the budget
  std::string hint;                                  // extra advice for out-of-memory messages
  std::uint64_t budget_bytes = 0;
  std::size_t granularity_bytes = 4096;
  double max_slack = 0.125;
  // Whether the allocator places blocks by colour (the host pool's does):
  // then a cached block of kColourMinBytes or more serves only its colour.
  bool coloured = false;
};

struct PoolStats {
  std::uint64_t budget_bytes = 0;
  std::uint64_t in_use_bytes = 0;          // handed out now (rounded sizes)
  std::uint64_t peak_in_use_bytes = 0;
  std::uint64_t reserved_bytes = 0;        // held from the backend: in use + cached + pending
  std::uint64_t peak_reserved_bytes = 0;
  std::uint64_t cached_bytes = 0;          // free, ready for reuse
  std::uint64_t pending_bytes = 0;         // released, waiting for a stream to finish with them
  std::uint64_t requests = 0;
  std::uint64_t cache_hits = 0;
  std::uint64_t backend_allocations = 0;   // raw allocations ever made
  std::uint64_t backend_frees = 0;
};

class MemoryPool;

// A block handed out by a pool; returns itself to the pool when destroyed.
class PoolBlock {
 public:
  PoolBlock() = default;
  ~PoolBlock() { reset(); }
  PoolBlock(PoolBlock&& other) noexcept { *this = std::move(other); }
  PoolBlock& operator=(PoolBlock&& other) noexcept;
  PoolBlock(const PoolBlock&) = delete;
  PoolBlock& operator=(const PoolBlock&) = delete;

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  std::size_t size_bytes() const { return size_bytes_; }          // as requested
  std::size_t capacity_bytes() const { return capacity_bytes_; }  // as reserved
  bool valid() const { return ptr_ != nullptr; }
  void reset();  // returns the block to its pool now

 private:
  friend class MemoryPool;
  PoolBlock(MemoryPool* pool, void* ptr, std::size_t size, std::size_t capacity, Colour colour)
      : pool_(pool), ptr_(ptr), size_bytes_(size), capacity_bytes_(capacity), colour_(colour) {}
  MemoryPool* pool_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t size_bytes_ = 0;
  std::size_t capacity_bytes_ = 0;
  Colour colour_ = Colour::kMaster;  // as the pool keys its cache (Note [Coloured arrays])
};

class MemoryPool {
 public:
  // `device` is needed only for release_after() (it records events).
  MemoryPool(PoolOptions options, std::unique_ptr<RawAllocator> allocator, Device* device = nullptr);
  ~MemoryPool();  // frees cached blocks; waits for pending ones
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  // `colour`: where a fresh block is placed (Note [Coloured arrays]); a
  // cached block is reused whatever colour it was made with.
  Expected<PoolBlock> allocate(std::size_t bytes, Colour colour = Colour::kMaster);
  // Releases a block that work already issued on `stream` may still use: it is
  // reused only after that work completes (an event recorded now).
  Status release_after(PoolBlock block, Stream& stream);

  PoolStats stats() const;
  void reset_peak();
  // Frees every cached block to the backend; returns the bytes freed.
  std::uint64_t trim();
  const PoolOptions& options() const { return options_; }

 private:
  friend class PoolBlock;
  struct Pending {
    void* ptr;
    std::size_t capacity;
    Colour colour;
    std::unique_ptr<Event> done;
  };
  struct Cached {
    void* ptr;
    Colour colour;
  };

  void release(void* ptr, std::size_t capacity, Colour colour);
  // The colour a block of `capacity` is placed and cached by: kMaster unless the pool is coloured and the block large.
  Colour effective_colour(std::size_t capacity, Colour colour) const {
    return options_.coloured && capacity >= kColourMinBytes ? colour : Colour::kMaster;
  }
  // With mu_ held:
  void reap_pending_locked();  // moves finished pending blocks to the cache, never blocks
  // Waits, with mu_ released, for every block pending now; then reaps.
  void wait_for_pending(std::unique_lock<std::mutex>& lock);
  std::uint64_t trim_locked();
  // A cached block of at least `capacity` within the slack: {ptr, its capacity}, or {nullptr, 0}.
  std::pair<void*, std::size_t> take_cached_locked(std::size_t capacity, Colour colour);
  Status over_budget_locked(std::size_t request, std::size_t capacity) const;
  void note_in_use_locked(std::size_t capacity);

  PoolOptions options_;
  std::unique_ptr<RawAllocator> allocator_;
  Device* device_;
  mutable std::mutex mu_;
  std::multimap<std::size_t, Cached> cached_;    // capacity -> block
  std::deque<Pending> pending_;
  std::vector<std::unique_ptr<Event>> spare_events_;
  PoolStats stats_;
};

}  // namespace tz
