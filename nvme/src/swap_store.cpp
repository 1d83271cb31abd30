// SwapStore: extents striped over preallocated swap files, with per-piece
// checksums kept beside each extent.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <unordered_map>

#include "swap_files.h"
#include "tierzero/nvme/swap_store.h"

namespace tz::nvme {
namespace {

constexpr std::size_t kMinAlign = 4096;

std::uint64_t round_up(std::uint64_t x, std::uint64_t a) { return (x + a - 1) / a * a; }

// First-fit free space of one swap file, coalescing on release.
class FreeList {
 public:
  explicit FreeList(std::uint64_t capacity) : capacity_(capacity) {
    if (capacity > 0) free_[0] = capacity;
  }
  std::optional<std::uint64_t> take(std::uint64_t bytes) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes) continue;
      const std::uint64_t at = it->first, left = it->second - bytes;
      free_.erase(it);
      if (left > 0) free_[at + bytes] = left;
      return at;
    }
    return std::nullopt;
  }
  void give(std::uint64_t at, std::uint64_t bytes) {
    auto next = free_.lower_bound(at);
    if (next != free_.end() && at + bytes == next->first) {
      bytes += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == at) {
        prev->second += bytes;
        return;
      }
    }
    free_[at] = bytes;
  }
  std::uint64_t largest() const {
    std::uint64_t best = 0;
    for (const auto& [at, len] : free_) best = std::max(best, len);
    return best;
  }
  std::uint64_t capacity() const { return capacity_; }

 private:
  std::uint64_t capacity_;
  std::map<std::uint64_t, std::uint64_t> free_;  // offset -> bytes
};

struct SwapFile {
  std::string path;
  FileId id;                      // the I/O engine's open of it; invalid until opened
  FreeList free{0};
  UniqueFd lock;                  // the store's own open, holding its lock (Note [Swap file ownership])
  detail::ExitRemoval exit_removal;
};

struct Share {
  std::size_t file = 0;     // index into files_
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};

enum class ExtentState : std::uint8_t { kEmpty, kValid, kFailed };

struct Extent {
  std::size_t bytes = 0, padded = 0;
  std::vector<Share> shares;
  std::vector<Segment> segments;          // the buffer's bytes in order
  std::vector<std::uint64_t> checksums;   // of the last successful write
  std::vector<std::uint64_t> pending;     // being computed by a write in flight
  ExtentState state = ExtentState::kEmpty;
  std::string failure;                    // why, when kFailed
  int readers = 0;                        // reads in flight (several may share an extent)
  bool writing = false;                   // a write in flight (excludes everything else)
  bool busy() const { return writing || readers > 0; }
};

class SwapStoreImpl final : public SwapStore {
 public:
  SwapStoreImpl(const SwapOptions& options, std::shared_ptr<IoEngine> engine)
      : options_(options), engine_(std::move(engine)) {}
  ~SwapStoreImpl() override;

  Status init();

  Expected<ExtentId> allocate(std::size_t bytes) override;
  Status free(ExtentId extent) override;
  IoFuture write(ExtentId extent, const void* buffer) override { return as_future(IoOp::kWrite, extent, buffer); }
  IoFuture read(ExtentId extent, void* buffer) override { return as_future(IoOp::kRead, extent, buffer); }
  void write(ExtentId extent, const void* buffer, IoCallback done) override {
    start(IoOp::kWrite, extent, const_cast<void*>(buffer), std::move(done));
  }
  void read(ExtentId extent, void* buffer, IoCallback done) override {
    start(IoOp::kRead, extent, buffer, std::move(done));
  }
  Expected<std::size_t> extent_bytes(ExtentId extent) const override;
  std::size_t padded_bytes(std::size_t bytes) const override { return round_up(std::max<std::size_t>(bytes, 1), align_); }
  std::size_t buffer_alignment() const override { return mem_align_; }
  Expected<std::vector<ExtentPlacement>> placement(ExtentId extent) const override;
  Status register_buffer(void* data, std::size_t bytes) override { return engine_->register_buffer(data, bytes); }
  Status unregister_buffer(void* data) override { return engine_->unregister_buffer(data); }
  std::vector<std::string> file_paths() const override;
  SwapStats stats() const override;
  IoEngine& engine() override { return *engine_; }

 private:
  Status begin(IoOp op, ExtentId id, IoRequest& request);
  void start(IoOp op, ExtentId id, void* buffer, IoCallback done);
  IoFuture as_future(IoOp op, ExtentId id, const void* buffer);
  void finished(IoOp op, ExtentId id, const Status& status);
  void lay_out(Extent& e, std::size_t first_file) const;

  const SwapOptions options_;
  std::shared_ptr<IoEngine> engine_;
  std::size_t stripe_ = 0, align_ = kMinAlign, mem_align_ = kMinAlign;

  mutable std::mutex mu_;
  std::condition_variable idle_;
  std::vector<SwapFile> files_;
  std::unordered_map<ExtentId, Extent> extents_;  // guarded by mu_; nodes stay put
  ExtentId next_id_ = 1;
  std::size_t next_first_file_ = 0;
  int in_flight_ = 0;
  SwapStats stats_;
};

Status SwapStoreImpl::init() {
  if (options_.paths.empty()) return invalid_argument("swap store: no paths given (zero_optimization nvme_path)");
  if (options_.capacity_bytes == 0) return invalid_argument("swap store: capacity_bytes = 0");
  stripe_ = options_.stripe_bytes != 0 ? options_.stripe_bytes : engine_->options().block_size_bytes;
  if (stripe_ % kMinAlign != 0) {
    return invalid_argument("swap store: stripe_bytes = {} is not a multiple of {}", stripe_, kMinAlign);
  }
  const std::uint64_t per_file = round_up((options_.capacity_bytes + options_.paths.size() - 1) / options_.paths.size(),
                                          kMinAlign);
  Cleanup undo([&] {
    for (SwapFile& f : files_) {
      if (f.id.valid()) engine_->close(f.id).ignore_error();
      ::unlink(f.path.c_str());
    }
    files_.clear();  // then their locks go
  });
  for (const std::string& dir : options_.paths) {
    const auto what = [&] {
      return fmt::format("creating swap file in {} ({} of {} total over {} path{})", dir, format_bytes(per_file),
                         format_bytes(options_.capacity_bytes), options_.paths.size(),
                         options_.paths.size() == 1 ? "" : "s");
    };
    const SwapFolderReport seen = reclaim_stale_swap_files(dir);  // Note [Swap file ownership]
    Expected<detail::OwnedSwapFile> owned = detail::create_owned_swap_file(dir);
    TZ_TRY_CTX(owned, "{}", what());
    files_.push_back(SwapFile{.path = owned->path, .lock = std::move(owned->lock)});
    SwapFile& file = files_.back();
    FileOptions fo{.size_bytes = per_file, .allow_buffered = options_.allow_buffered};
    Expected<FileId> id = engine_->open(file.path, fo);
    if (!id.ok() && id.status().code() == ErrorCode::kNoSpace) {  // say what else is in the folder
      return Status(ErrorCode::kNoSpace, fmt::format("{}: {}{}", what(), id.status().message(), seen.describe()),
                    id.status().sys_errno());
    }
    TZ_TRY_CTX(id, "{}", what());
    file.id = *id;
    file.free = FreeList(per_file);
    file.exit_removal = detail::ExitRemoval(file.path);
    TZ_ASSIGN_OR_RETURN(FileInfo info, engine_->file_info(*id));
    align_ = std::max<std::size_t>(align_, info.offset_align);
    mem_align_ = std::max<std::size_t>(mem_align_, info.mem_align);
  }
  if (stripe_ % align_ != 0) {
    return invalid_argument("swap store: stripe_bytes = {} is not a multiple of the paths' direct-I/O alignment {}",
                            stripe_, align_);
  }
  undo.cancel();
  stats_.capacity_bytes = per_file * files_.size();
  TZ_LOG_DEBUG("nvme", "swap store: {} over {} file(s), stripe {}, {}", format_bytes(stats_.capacity_bytes),
               files_.size(), format_bytes(stripe_), engine_->describe());
  return ok_status();
}

SwapStoreImpl::~SwapStoreImpl() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [&] { return in_flight_ == 0; });
  for (SwapFile& f : files_) {
    Status s = engine_->close(f.id);
    if (!s.ok()) TZ_LOG_WARN("nvme", "closing swap file {}: {}", f.path, s.message());
    // ENOENT: remove_swap_files_now() was first.
    if (::unlink(f.path.c_str()) != 0 && errno != ENOENT) {
      TZ_LOG_WARN("nvme", "removing swap file {}: {}", f.path, std::strerror(errno));
    }
  }
}

// Stripe units go round-robin over the files from `first_file`; unit k lands
// in its file's share at (k / files) * stripe. Caller holds mu_ and has set
// e.padded; fills e.shares' bytes (offsets follow) and, after offsets are
// known, e.segments.
void SwapStoreImpl::lay_out(Extent& e, std::size_t first_file) const {
  const std::size_t files = files_.size();
  const std::size_t units = (e.padded + stripe_ - 1) / stripe_;
  e.shares.clear();
  for (std::size_t i = 0; i < std::min(files, units); ++i) e.shares.push_back(Share{(first_file + i) % files, 0, 0});
  for (std::size_t k = 0; k < units; ++k) {
    e.shares[k % files].bytes += std::min<std::uint64_t>(stripe_, e.padded - k * stripe_);
  }
}

Expected<ExtentId> SwapStoreImpl::allocate(std::size_t bytes) {
  if (bytes == 0) return invalid_argument("swap store: allocating an empty extent");
  std::lock_guard<std::mutex> lock(mu_);
  if (bytes > stats_.capacity_bytes) {  // also keeps the padding below from wrapping around
    return Status(ErrorCode::kNoSpace, fmt::format("swap store: an extent of {} is larger than the whole store ({}); "
                                                   "raise the NVMe budget (tierzero.tiers.nvme_bytes)",
                                                   format_bytes(bytes), format_bytes(stats_.capacity_bytes)));
  }
  Extent e;
  e.bytes = bytes;
  e.padded = padded_bytes(bytes);
  lay_out(e, next_first_file_);
  for (std::size_t i = 0; i < e.shares.size(); ++i) {
    Share& s = e.shares[i];
    std::optional<std::uint64_t> at = files_[s.file].free.take(s.bytes);
    if (!at) {
      for (std::size_t j = 0; j < i; ++j) files_[e.shares[j].file].free.give(e.shares[j].offset, e.shares[j].bytes);
      return Status(ErrorCode::kNoSpace,
                    fmt::format("swap store full: an extent of {} needs {} in {}, whose largest free run is {} "
                                "({} of {} in use over {} file(s)); raise the NVMe budget (tierzero.tiers.nvme_bytes)",
                                format_bytes(bytes), format_bytes(s.bytes), files_[s.file].path,
                                format_bytes(files_[s.file].free.largest()), format_bytes(stats_.used_bytes),
                                format_bytes(stats_.capacity_bytes), files_.size()));
    }
    s.offset = *at;
  }
  next_first_file_ = (next_first_file_ + 1) % files_.size();
  // Segments in buffer order; consecutive units in one file (a single path) merge.
  const std::size_t files = e.shares.size();
  for (std::size_t k = 0, at = 0; at < e.padded; ++k) {
    const std::size_t len = std::min<std::size_t>(stripe_, e.padded - at);
    const Share& s = e.shares[k % files];
    const Segment seg{files_[s.file].id, s.offset + (k / files) * stripe_, len};
    if (!e.segments.empty() && e.segments.back().file == seg.file &&
        e.segments.back().offset + e.segments.back().length == seg.offset) {
      e.segments.back().length += len;
    } else {
      e.segments.push_back(seg);
    }
    at += len;
  }
  const ExtentId id = next_id_++;
  stats_.used_bytes += e.padded;
  stats_.peak_used_bytes = std::max(stats_.peak_used_bytes, stats_.used_bytes);
  ++stats_.extents;
  extents_.emplace(id, std::move(e));
  return id;
}

Status SwapStoreImpl::free(ExtentId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = extents_.find(id);
  if (it == extents_.end()) return invalid_argument("swap store: freeing extent {}, which does not exist", id);
  if (it->second.busy()) return failed_precondition("swap store: freeing extent {} while a read or write is in flight", id);
  for (const Share& s : it->second.shares) files_[s.file].free.give(s.offset, s.bytes);
  stats_.used_bytes -= it->second.padded;
  --stats_.extents;
  extents_.erase(it);
  return ok_status();
}

// Checks the extent can take the operation, marks it busy and fills in the
// request's segments and checksums. Caller holds mu_.
Status SwapStoreImpl::begin(IoOp op, ExtentId id, IoRequest& request) {
  auto it = extents_.find(id);
  if (it == extents_.end()) {
    return invalid_argument("swap store: {} of extent {}, which does not exist", io_op_name(op), id);
  }
  Extent& e = it->second;
  if (e.writing || (op == IoOp::kWrite && e.readers > 0)) {
    return failed_precondition("swap store: {} of extent {} while a {} of it is in flight", io_op_name(op), id,
                               e.writing ? "write" : "read");
  }
  if (op == IoOp::kRead && e.state == ExtentState::kEmpty) {
    return failed_precondition("swap store: reading extent {}, which was never written", id);
  }
  if (op == IoOp::kRead && e.state == ExtentState::kFailed) {
    return failed_precondition("swap store: reading extent {}, whose last write failed ({}): it holds no data", id,
                               e.failure);
  }
  if (op == IoOp::kWrite) {
    e.writing = true;
  } else {
    ++e.readers;
  }
  ++in_flight_;
  request.segments = e.segments;
  if (options_.checksums) {
    if (op == IoOp::kWrite) {
      e.pending.assign(engine_->piece_count(request), 0);
      request.checksums = e.pending.data();
    } else {
      request.checksums = e.checksums.data();
    }
  }
  return ok_status();
}

void SwapStoreImpl::start(IoOp op, ExtentId id, void* buffer, IoCallback done) {
  IoRequest request{.op = op, .buffer = buffer, .label = fmt::format("swap extent {}", id)};
  Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    status = begin(op, id, request);
  }
  if (!status.ok()) {
    done(status, IoResult{});
    return;
  }
  engine_->submit(std::move(request), [this, op, id, done = std::move(done)](const Status& s, const IoResult& r) {
    finished(op, id, s);
    done(s, r);
  });
}

void SwapStoreImpl::finished(IoOp op, ExtentId id, const Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  Extent& e = extents_.at(id);  // busy extents are never freed
  if (op == IoOp::kWrite) {
    e.writing = false;
  } else {
    --e.readers;
  }
  if (op == IoOp::kWrite) {
    if (status.ok()) {
      e.checksums.swap(e.pending);
      e.state = ExtentState::kValid;
      stats_.bytes_written += e.padded;
    } else {
      e.state = ExtentState::kFailed;
      e.failure = status.message();
      ++stats_.failed_writes;
    }
  } else if (status.ok()) {
    stats_.bytes_read += e.padded;
  } else if (status.code() == ErrorCode::kDataCorruption) {
    ++stats_.corrupt_reads;
  }
  if (--in_flight_ == 0) idle_.notify_all();
}

IoFuture SwapStoreImpl::as_future(IoOp op, ExtentId id, const void* buffer) {
  auto [future, complete] = IoFuture::make();
  start(op, id, const_cast<void*>(buffer), std::move(complete));
  return std::move(future);
}

Expected<std::size_t> SwapStoreImpl::extent_bytes(ExtentId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = extents_.find(id);
  if (it == extents_.end()) return invalid_argument("swap store: extent {} does not exist", id);
  return it->second.bytes;
}

Expected<std::vector<ExtentPlacement>> SwapStoreImpl::placement(ExtentId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = extents_.find(id);
  if (it == extents_.end()) return invalid_argument("swap store: extent {} does not exist", id);
  std::vector<ExtentPlacement> out;
  for (const Share& s : it->second.shares) out.push_back({files_[s.file].path, s.offset, s.bytes});
  return out;
}

std::vector<std::string> SwapStoreImpl::file_paths() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const SwapFile& f : files_) out.push_back(f.path);
  return out;
}

SwapStats SwapStoreImpl::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace

Expected<std::unique_ptr<SwapStore>> SwapStore::create(const SwapOptions& options, std::shared_ptr<IoEngine> engine) {
  if (!engine) {
    TZ_ASSIGN_OR_RETURN(std::unique_ptr<IoEngine> made, IoEngine::create(options.engine));
    engine = std::move(made);
  }
  auto store = std::make_unique<SwapStoreImpl>(options, std::move(engine));
  TZ_TRY(store->init());
  return std::unique_ptr<SwapStore>(std::move(store));
}

}  // namespace tz::nvme
