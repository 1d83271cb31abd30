#include "tierzero/offload/pool.h"

#include <algorithm>

namespace tz {

PoolBlock& PoolBlock::operator=(PoolBlock&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    capacity_bytes_ = std::exchange(other.capacity_bytes_, 0);
    colour_ = other.colour_;
  }
  return *this;
}

void PoolBlock::reset() {
  if (ptr_ != nullptr) pool_->release(ptr_, capacity_bytes_, colour_);
  pool_ = nullptr;
  ptr_ = nullptr;
  size_bytes_ = capacity_bytes_ = 0;
}

MemoryPool::MemoryPool(PoolOptions options, std::unique_ptr<RawAllocator> allocator, Device* device)
    : options_(std::move(options)), allocator_(std::move(allocator)), device_(device) {
  stats_.budget_bytes = options_.budget_bytes;
}

MemoryPool::~MemoryPool() {
  std::unique_lock lock(mu_);
  wait_for_pending(lock);
  trim_locked();
  if (stats_.in_use_bytes != 0) {
    // Blocks still out would dangle; they are a caller bug, not a run-time condition.
    TZ_LOG_ERROR("offload", "{} pool destroyed with {} still in use", options_.tier,
                 format_bytes(stats_.in_use_bytes));
  }
}

Expected<PoolBlock> MemoryPool::allocate(std::size_t bytes, Colour colour) {
  std::unique_lock lock(mu_);
  ++stats_.requests;
  // Checked before rounding, so a huge request cannot wrap around align_up.
  if (bytes > options_.budget_bytes) return over_budget_locked(bytes, bytes);
  const std::size_t capacity = align_up(std::max<std::size_t>(bytes, 1), options_.granularity_bytes);
  colour = effective_colour(capacity, colour);
  reap_pending_locked();
  if (auto [ptr, block_capacity] = take_cached_locked(capacity, colour); ptr != nullptr) {
    ++stats_.cache_hits;
    return PoolBlock(this, ptr, bytes, block_capacity, colour);
  }
  if (stats_.reserved_bytes + capacity > options_.budget_bytes) {
    // Make room: cached blocks first, then blocks still pending on a stream.
    trim_locked();
    if (stats_.reserved_bytes + capacity > options_.budget_bytes && !pending_.empty()) {
      wait_for_pending(lock);
      if (auto [ptr, block_capacity] = take_cached_locked(capacity, colour); ptr != nullptr) {
        ++stats_.cache_hits;
        return PoolBlock(this, ptr, bytes, block_capacity, colour);
      }
      trim_locked();
    }
    if (stats_.reserved_bytes + capacity > options_.budget_bytes) return over_budget_locked(bytes, capacity);
  }
  Expected<void*> ptr = allocator_->allocate_coloured(capacity, colour);
  if (!ptr.ok() && trim_locked() > 0) ptr = allocator_->allocate_coloured(capacity, colour);  // fragmentation: one retry
  if (!ptr.ok()) {
    return std::move(ptr).status().with_context(
        fmt::format("{} pool: allocating {} ({} in use of a {} budget)", options_.tier, format_bytes(capacity),
                    format_bytes(stats_.in_use_bytes), format_bytes(options_.budget_bytes)));
  }
  ++stats_.backend_allocations;
  stats_.reserved_bytes += capacity;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  note_in_use_locked(capacity);
  return PoolBlock(this, *ptr, bytes, capacity, colour);
}

Status MemoryPool::release_after(PoolBlock block, Stream& stream) {
  if (!block.valid()) return ok_status();
  if (block.pool_ != this) return invalid_argument("{} pool: block belongs to another pool", options_.tier);
  if (device_ == nullptr) {
    return failed_precondition("{} pool: release_after needs a pool created with a device", options_.tier);
  }
  std::unique_ptr<Event> done;
  {
    std::lock_guard lock(mu_);
    if (!spare_events_.empty()) {
      done = std::move(spare_events_.back());
      spare_events_.pop_back();
    }
  }
  Status recorded = ok_status();
  if (!done) {
    Expected<std::unique_ptr<Event>> created = device_->create_event();
    if (created.ok()) done = std::move(*created);
    else recorded = std::move(created).status();
  }
  if (recorded.ok()) recorded = device_->record_event(*done, stream);
  if (!recorded.ok()) {
    // The stream may still be using the block: it must not reach the cache
    // before that work is done. Wait for the stream, then let `block` go.
    Status drained = device_->synchronize_stream(stream);
    if (!drained.ok()) TZ_LOG_ERROR("offload", "{} pool: draining a stream: {}", options_.tier, drained.to_string());
    if (done) {
      std::lock_guard lock(mu_);
      spare_events_.push_back(std::move(done));
    }
    return recorded.with_context(fmt::format("{} pool: release_after", options_.tier));
  }
  std::lock_guard lock(mu_);
  void* ptr = std::exchange(block.ptr_, nullptr);
  std::size_t capacity = block.capacity_bytes_;
  stats_.in_use_bytes -= capacity;
  stats_.pending_bytes += capacity;
  pending_.push_back(Pending{ptr, capacity, block.colour_, std::move(done)});
  return ok_status();
}

void MemoryPool::release(void* ptr, std::size_t capacity, Colour colour) {
  std::lock_guard lock(mu_);
  stats_.in_use_bytes -= capacity;
  stats_.cached_bytes += capacity;
  cached_.emplace(capacity, Cached{ptr, colour});
}

void MemoryPool::reap_pending_locked() {
  // Events complete in order only within one stream; scan them all.
  for (auto it = pending_.begin(); it != pending_.end();) {
    Expected<bool> done = device_->event_done(*it->done);
    if (done.ok() && !*done) {
      ++it;
      continue;
    }
    // Done, or the stream failed and no longer runs anything that could use the block.
    stats_.pending_bytes -= it->capacity;
    stats_.cached_bytes += it->capacity;
    cached_.emplace(it->capacity, Cached{it->ptr, it->colour});
    spare_events_.push_back(std::move(it->done));
    it = pending_.erase(it);
  }
}

void MemoryPool::wait_for_pending(std::unique_lock<std::mutex>& lock) {
  if (pending_.empty()) return;
  // Wait without the lock: work on those streams (a host function) may call
  // into this pool. Events are owned by the pool until it is destroyed, so the
  // pointers stay valid even if another thread reaps the entries meanwhile.
  std::vector<Event*> events;
  events.reserve(pending_.size());
  for (const Pending& p : pending_) events.push_back(p.done.get());
  lock.unlock();
  for (Event* event : events) {
    Status s = device_->synchronize_event(*event);
    if (!s.ok()) TZ_LOG_ERROR("offload", "{} pool: waiting for a released block: {}", options_.tier, s.to_string());
  }
  lock.lock();
  reap_pending_locked();
}

std::uint64_t MemoryPool::trim_locked() {
  std::uint64_t freed = 0;
  for (auto& [capacity, block] : cached_) {
    allocator_->deallocate(block.ptr, capacity);
    freed += capacity;
    ++stats_.backend_frees;
  }
  cached_.clear();
  stats_.cached_bytes -= freed;
  stats_.reserved_bytes -= freed;
  return freed;
}

std::pair<void*, std::size_t> MemoryPool::take_cached_locked(std::size_t capacity, Colour colour) {
  const auto limit = static_cast<std::size_t>(static_cast<double>(capacity) * (1.0 + options_.max_slack));
  // The smallest block within the slack that has the request's colour.
  auto it = cached_.lower_bound(capacity);
  while (it != cached_.end() && it->first <= std::max(limit, capacity) && it->second.colour != colour) ++it;
  if (it == cached_.end() || it->first > std::max(limit, capacity)) return {nullptr, 0};
  const std::size_t block_capacity = it->first;
  void* ptr = it->second.ptr;
  cached_.erase(it);
  stats_.cached_bytes -= block_capacity;
  note_in_use_locked(block_capacity);
  return {ptr, block_capacity};
}

void MemoryPool::note_in_use_locked(std::size_t capacity) {
  stats_.in_use_bytes += capacity;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
}

Status MemoryPool::over_budget_locked(std::size_t request, std::size_t capacity) const {
  return out_of_memory(
      "{} tier out of budget: requested {} ({} reserved), budget {} ({}), in use {}, pending release {}, "
      "peak in use {}. Raise {}{}{}",
      options_.tier, format_bytes(request), format_bytes(capacity), format_bytes(options_.budget_bytes),
      options_.budget_key, format_bytes(stats_.in_use_bytes), format_bytes(stats_.pending_bytes),
      format_bytes(stats_.peak_in_use_bytes), options_.budget_key, options_.hint.empty() ? "" : ", or ",
      options_.hint);
}

PoolStats MemoryPool::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void MemoryPool::reset_peak() {
  std::lock_guard lock(mu_);
  stats_.peak_in_use_bytes = stats_.in_use_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

std::uint64_t MemoryPool::trim() {
  std::lock_guard lock(mu_);
  reap_pending_locked();
  return trim_locked();
}

}  // namespace tz
