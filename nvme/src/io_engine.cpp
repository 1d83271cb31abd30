// IoEngine: options, the file table, registered buffers, and requests split
// into pieces dealt to the rings.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <shared_mutex>

#include "io_engine_internal.h"

namespace tz::nvme {

std::string_view io_op_name(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

std::string_view io_backend_name(IoBackend backend) {
  switch (backend) {
    case IoBackend::kAuto: return "auto";
    case IoBackend::kUring: return "io_uring";
    case IoBackend::kThreads: return "threads";
  }
  return "?";
}

EngineOptions EngineOptions::from_config(const AioConfig& aio) {
  return {.block_size_bytes = static_cast<std::size_t>(aio.block_size),
          .queue_depth = aio.queue_depth,
          .rings = aio.intra_op_parallelism,
          .single_submit = aio.single_submit,
          .sqpoll = aio.sqpoll,
          .fixed_buffers = aio.fixed_buffers};
}

struct IoFuture::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  IoResult result;
};

std::pair<IoFuture, IoCallback> IoFuture::make() {
  auto state = std::make_shared<State>();
  IoCallback complete = [state](const Status& status, const IoResult& result) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->status = status;
    state->result = result;
    state->done = true;
    state->cv.notify_all();
  };
  return {IoFuture(std::move(state)), std::move(complete)};
}

bool IoFuture::ready() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

Status IoFuture::wait() {
  if (!state_) return failed_precondition("waiting on an empty IoFuture");
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  return state_->status;
}

Status IoFuture::wait_for(std::chrono::milliseconds timeout) {
  if (!state_) return failed_precondition("waiting on an empty IoFuture");
  std::unique_lock<std::mutex> lock(state_->mu);
  if (!state_->cv.wait_for(lock, timeout, [&] { return state_->done; })) {
    return timeout_error("I/O request not complete after {} ms", timeout.count());
  }
  return state_->status;
}

namespace {

using detail::OpenFile;
using detail::Piece;
using detail::RequestState;

Status validate(const EngineOptions& o) {
  if (o.block_size_bytes == 0 || o.block_size_bytes % kBlockSizeAlignBytes != 0 ||
      o.block_size_bytes > kMaxBlockSizeBytes) {
    return invalid_argument("aio block_size = {} must be a multiple of {} in [{}, {}]", o.block_size_bytes,
                            kBlockSizeAlignBytes, kBlockSizeAlignBytes, kMaxBlockSizeBytes);
  }
  if (o.queue_depth < 1 || o.queue_depth > kMaxQueueDepth) {
    return invalid_argument("aio queue_depth = {} is outside [1, {}]", o.queue_depth, kMaxQueueDepth);
  }
  if (o.rings < 1 || o.rings > kMaxRings) {
    return invalid_argument("aio intra_op_parallelism (rings) = {} is outside [1, {}]", o.rings, kMaxRings);
  }
  if (o.fixed_buffer_slot_bytes == 0 || o.fixed_buffer_slot_bytes % 4096 != 0 ||
      o.fixed_buffer_slot_bytes > detail::kMaxFixedBufferSlotBytes) {
    return invalid_argument("fixed_buffer_slot_bytes = {} must be a multiple of 4096 in [4096, 1 GiB]",
                            o.fixed_buffer_slot_bytes);
  }
  return ok_status();
}

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

// Reserves `bytes` for an open file with fallocate, so a full disk shows now
// and not on a write mid-run. A request beyond the space free is refused
// before fallocate, which would otherwise fill the disk for everyone until it
// fails.
Status reserve(int fd, const std::string& path, std::uint64_t bytes) {
  struct stat st {};
  struct statvfs vfs {};
  TZ_SYSCALL_CHECK(::fstat(fd, &st));
  TZ_SYSCALL_CHECK(::fstatvfs(fd, &vfs));
  const std::uint64_t have = static_cast<std::uint64_t>(st.st_blocks) * 512;
  const std::uint64_t free = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  if (bytes > have && bytes - have > free) {
    return Status(ErrorCode::kNoSpace, fmt::format("reserving {} for {}: only {} free there", format_bytes(bytes),
                                                   path, format_bytes(free)), ENOSPC);
  }
  int rc = 0;
  do {
    rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (rc == EINTR);
  if (rc == EOPNOTSUPP || rc == EINVAL) {
    TZ_LOG_WARN("nvme", "{}: the file system cannot preallocate ({}); a full disk will show on the failing write",
                path, std::strerror(rc));
    TZ_SYSCALL_CHECK(::ftruncate(fd, static_cast<off_t>(bytes)));
    return ok_status();
  }
  if (rc != 0) {
    return errno_status(rc, fmt::format("reserving {} for {} (free there: {})", format_bytes(bytes), path,
                                        format_bytes(free)));
  }
  return ok_status();
}

// A range given to register_buffer: slot_bytes-long slots from base, the
// last one shorter (Note [Registered buffer slots]).
struct Region {
  char* base = nullptr;
  std::size_t bytes = 0;
  std::vector<int> slots;  // registered-buffer index of each slot, in address order
};

// Note [Registered buffer slots]
// The kernel registers at most 1 GiB per buffer slot (io_uring/rsrc.c refuses
// a longer iovec with EFAULT), so register_buffer cuts a larger range into
// slots of fixed_buffer_slot_bytes from its start. A piece may use a slot only
// if it lies wholly inside it: READ_FIXED/WRITE_FIXED name one slot. A piece
// that straddles a boundary goes the plain way rather than being split: the
// pieces of a request (and so its checksums) must not depend on what is
// registered, or a read could not be checked against its write. With
// power-of-two blocks and a 2 MiB-aligned range no piece straddles.


class IoEngineImpl final : public IoEngine {
 public:
  IoEngineImpl(const EngineOptions& options, IoBackend backend)
      : core_(options), backend_(backend), files_(detail::kMaxFiles) {}
  ~IoEngineImpl() override { rings_.clear(); }  // each ring drains first

  Status start();

  Expected<FileId> open(const std::string& path, const FileOptions& options) override;
  Status close(FileId file) override;
  Expected<FileInfo> file_info(FileId file) const override;
  Status register_buffer(void* data, std::size_t bytes) override;
  Status unregister_buffer(void* data) override;
  IoFuture submit(IoRequest request) override;
  void submit(IoRequest request, IoCallback done) override;
  std::size_t piece_count(const IoRequest& request) const override;
  IoBackend backend() const override { return backend_; }
  const EngineOptions& options() const override { return core_.options(); }
  EngineStats stats() const override { return core_.stats(); }
  void record_log(bool on) override {
    std::lock_guard<std::mutex> lock(log_mu_);
    if (on && !logging_) log_.clear();
    logging_ = on;
  }
  std::vector<IoLogEntry> take_log() override {
    std::lock_guard<std::mutex> lock(log_mu_);
    return std::exchange(log_, {});
  }
  std::string describe() const override;

 private:
  Expected<std::unique_ptr<RequestState>> build(IoRequest& request);
  int buffer_index(const char* data, std::size_t length) const;  // caller holds regions_mu_ (shared)

  detail::IoEngineCore core_;
  IoBackend backend_;
  bool fixed_files_ = false;
  std::vector<std::unique_ptr<detail::Ring>> rings_;
  std::atomic<std::size_t> next_ring_{0};

  mutable std::shared_mutex files_mu_;
  std::vector<std::unique_ptr<OpenFile>> files_;  // by FileId index; null where free

  // Free registered-buffer slots, `count` of them; caller holds regions_mu_.
  std::vector<int> free_slots(std::size_t count) const;
  // Clears `slots` on every ring; caller holds regions_mu_.
  void clear_slots(const std::vector<int>& slots);

  std::mutex log_mu_;
  bool logging_ = false;               // guarded by log_mu_
  std::vector<IoLogEntry> log_;        // guarded by log_mu_
  mutable std::shared_mutex regions_mu_;
  std::vector<Region> regions_;          // guarded by regions_mu_
  int fixed_buffers_refused_errno_ = 0;  // guarded by regions_mu_: ENOMEM/EPERM, then no more tries
};

Status IoEngineImpl::start() {
  const int rings = core_.options().rings;
  if (backend_ != IoBackend::kThreads) {
    bool fixed_files = core_.options().fixed_files;
    for (int i = 0; i < rings; ++i) {
      Expected<std::unique_ptr<detail::Ring>> ring = detail::make_uring_ring(core_, i, fixed_files);
      if (!ring.ok()) {
        if (backend_ == IoBackend::kUring || i > 0) return std::move(ring).status();
        TZ_LOG_ONCE_WARN("nvme", "io_uring refused ({}): using a pread/pwrite thread pool", ring.status().message());
        backend_ = IoBackend::kThreads;
        break;
      }
      rings_.push_back(std::move(*ring));
    }
    fixed_files_ = fixed_files;
  }
  if (backend_ != IoBackend::kThreads) {
    backend_ = IoBackend::kUring;
    return ok_status();
  }
  rings_.clear();
  for (int i = 0; i < rings; ++i) rings_.push_back(detail::make_thread_ring(core_, i));
  return ok_status();
}

Expected<FileId> IoEngineImpl::open(const std::string& path, const FileOptions& options) {
  TZ_ASSIGN_OR_RETURN(PathCapabilities caps, probe_path(parent_dir(path)));
  bool direct = options.direct;
  if (direct && !caps.o_direct) {
    const std::string why = caps.note.empty() ? fmt::format("{} refuses O_DIRECT", caps.filesystem) : caps.note;
    if (!options.allow_buffered) {
      return invalid_argument("{}: direct I/O is not possible there ({}); use a directory on a real drive, or set "
                              "tierzero.aio.allow_buffered_io to accept buffered I/O",
                              path, why);
    }
    TZ_LOG_WARN("nvme", "{}: direct I/O is not possible there ({}); using buffered I/O as allowed", path, why);
    direct = false;
  }
  int flags = options.writable ? O_RDWR : O_RDONLY;
  if (options.create) flags |= O_CREAT;
  if (options.create && options.exclusive) flags |= O_EXCL;
  if (options.truncate) flags |= O_TRUNC;
  if (direct) flags |= O_DIRECT;
  flags |= O_CLOEXEC;
  const bool existed = ::access(path.c_str(), F_OK) == 0;
  TZ_ASSIGN_OR_RETURN(UniqueFd fd, open_file(path, flags));
  // A file this call created and could not size is removed again.
  Cleanup remove_created([&] {
    if (!existed) ::unlink(path.c_str());
  });
  if (options.size_bytes > 0) TZ_TRY(reserve(fd.get(), path, options.size_bytes));
  auto file = std::make_unique<OpenFile>();
  file->path = path;
  file->writable = options.writable;
  file->info = FileInfo{.path = path,
                        .direct = direct,
                        .mem_align = direct ? std::max<std::uint32_t>(caps.dio_mem_align, 1) : 1,
                        .offset_align = direct ? std::max<std::uint32_t>(caps.dio_offset_align, 1) : 1,
                        .filesystem = caps.filesystem,
                        .device = caps.device};
  std::unique_lock<std::shared_mutex> lock(files_mu_);
  auto slot = std::find(files_.begin(), files_.end(), nullptr);
  if (slot == files_.end()) return out_of_memory("{}: the engine has {} files open, its limit", path, files_.size());
  file->index = static_cast<std::uint32_t>(slot - files_.begin());
  file->fd = std::move(fd);
  file->fixed = fixed_files_;
  for (auto& ring : rings_) ring->set_file(file->index, file->fd.get());
  remove_created.cancel();
  const FileId id{file->index};
  *slot = std::move(file);
  return id;
}

Status IoEngineImpl::close(FileId id) {
  std::unique_ptr<OpenFile> file;
  {
    std::unique_lock<std::shared_mutex> lock(files_mu_);
    if (!id.valid() || id.index >= files_.size() || !files_[id.index]) {
      return invalid_argument("closing file id {}: not open", id.index);
    }
    if (files_[id.index]->active_requests.load() != 0) {
      return failed_precondition("closing {}: {} requests still in flight", files_[id.index]->path,
                                 files_[id.index]->active_requests.load());
    }
    file = std::move(files_[id.index]);
    for (auto& ring : rings_) ring->set_file(id.index, -1);
  }
  return file->fd.close();
}

Expected<FileInfo> IoEngineImpl::file_info(FileId id) const {
  std::shared_lock<std::shared_mutex> lock(files_mu_);
  if (!id.valid() || id.index >= files_.size() || !files_[id.index]) return invalid_argument("file id {}: not open", id.index);
  return files_[id.index]->info;
}

std::vector<int> IoEngineImpl::free_slots(std::size_t count) const {
  std::vector<bool> used(detail::kMaxFixedBuffers, false);
  for (const Region& r : regions_) {
    for (int slot : r.slots) used[static_cast<std::size_t>(slot)] = true;
  }
  std::vector<int> out;
  for (int i = 0; i < detail::kMaxFixedBuffers && out.size() < count; ++i) {
    if (!used[static_cast<std::size_t>(i)]) out.push_back(i);
  }
  return out;
}

void IoEngineImpl::clear_slots(const std::vector<int>& slots) {
  for (auto& ring : rings_) {
    for (int slot : slots) ring->set_buffer(slot, nullptr, 0);  // clearing a slot does not fail
  }
}

Status IoEngineImpl::register_buffer(void* data, std::size_t bytes) {
  if (data == nullptr || bytes == 0) return invalid_argument("register_buffer: empty range");
  std::unique_lock<std::shared_mutex> lock(regions_mu_);
  if (!core_.options().fixed_buffers || backend_ != IoBackend::kUring || fixed_buffers_refused_errno_ != 0) {
    return ok_status();
  }
  const std::size_t slot_bytes = core_.options().fixed_buffer_slot_bytes;
  const std::size_t count = (bytes + slot_bytes - 1) / slot_bytes;
  Region region{static_cast<char*>(data), bytes, free_slots(count)};
  if (region.slots.size() < count) {
    TZ_LOG_DEBUG("nvme", "register_buffer: {} needs {} slots of {}, {} of {} are free; it goes unregistered",
                 format_bytes(bytes), count, format_bytes(slot_bytes), region.slots.size(), detail::kMaxFixedBuffers);
    return ok_status();
  }
  std::vector<int> filled;
  for (std::size_t k = 0; k < count; ++k) {
    const std::size_t at = k * slot_bytes;
    const std::size_t len = std::min(slot_bytes, bytes - at);
    for (auto& ring : rings_) {
      const int err = ring->set_buffer(region.slots[k], region.base + at, len);
      if (err == 0) continue;
      filled.push_back(region.slots[k]);  // possibly filled on the rings before this one
      clear_slots(filled);
      if (err == ENOMEM || err == EPERM) {
        fixed_buffers_refused_errno_ = err;
        TZ_LOG_WARN("nvme", "the kernel refused to register {} as fixed buffers: {} (over the memlock limit? see "
                    "ulimit -l); I/O goes on without fixed buffers", format_bytes(bytes), std::strerror(err));
      } else {
        TZ_LOG_ONCE_WARN("nvme", "the kernel refused to register {} at {} as fixed buffers ({} slot(s) of at most {}): "
                         "{}; this range goes the plain way, later ones are still tried (further refusals are "
                         "logged at debug level)", format_bytes(bytes), data, count, format_bytes(slot_bytes),
                         std::strerror(err));
        TZ_LOG_DEBUG("nvme", "register_buffer of {} at {}: slot {} of {} refused: {}", format_bytes(bytes), data,
                     k, count, std::strerror(err));
      }
      return ok_status();
    }
    filled.push_back(region.slots[k]);
  }
  regions_.push_back(std::move(region));
  return ok_status();
}

Status IoEngineImpl::unregister_buffer(void* data) {
  std::unique_lock<std::shared_mutex> lock(regions_mu_);
  auto it = std::find_if(regions_.begin(), regions_.end(), [&](const Region& r) { return r.base == data; });
  if (it == regions_.end()) return ok_status();  // never registered (or refused): nothing to undo
  clear_slots(it->slots);
  regions_.erase(it);
  return ok_status();
}

int IoEngineImpl::buffer_index(const char* data, std::size_t length) const {
  for (const Region& r : regions_) {
    if (data < r.base || data + length > r.base + r.bytes) continue;
    // Note [Registered buffer slots]: only a piece inside one slot uses it.
    const std::size_t slot_bytes = core_.options().fixed_buffer_slot_bytes;
    const auto first = static_cast<std::size_t>(data - r.base);
    const std::size_t slot = first / slot_bytes;
    return (first + length - 1) / slot_bytes == slot ? r.slots[slot] : -1;
  }
  return -1;
}

std::size_t IoEngineImpl::piece_count(const IoRequest& request) const {
  const std::size_t block = core_.options().block_size_bytes;
  std::size_t n = 0;
  for (const Segment& s : request.segments) n += (s.length + block - 1) / block;
  return n;
}

Expected<std::unique_ptr<RequestState>> IoEngineImpl::build(IoRequest& request) {
  if (request.buffer == nullptr) return invalid_argument("I/O request with a null buffer");
  if (request.segments.empty()) return invalid_argument("I/O request with no segments");
  for (const Segment& s : request.segments) {  // sizes no buffer has, or an end past 2^64, before anything is sized
    if (s.length > (std::uint64_t{1} << 48) || s.offset > UINT64_MAX - s.length) {
      return invalid_argument("I/O request segment of {} bytes at offset {} is out of range", s.length, s.offset);
    }
  }
  auto state = std::make_unique<RequestState>();
  state->op = request.op;
  state->label = std::move(request.label);
  state->checksums = request.checksums;
  state->core = &core_;
  state->pieces.reserve(piece_count(request));
  const std::size_t block = core_.options().block_size_bytes;
  char* cursor = static_cast<char*>(request.buffer);
  std::shared_lock<std::shared_mutex> files_lock(files_mu_);
  std::shared_lock<std::shared_mutex> regions_lock(regions_mu_);
  for (const Segment& s : request.segments) {
    if (!s.file.valid() || s.file.index >= files_.size() || !files_[s.file.index]) {
      return invalid_argument("I/O request names file id {}, which is not open", s.file.index);
    }
    OpenFile* f = files_[s.file.index].get();
    if (s.length == 0) return invalid_argument("I/O request on {} with an empty segment at offset {}", f->path, s.offset);
    const FileInfo& info = f->info;
    if (reinterpret_cast<std::uintptr_t>(cursor) % info.mem_align != 0) {
      return invalid_argument("{} of {}: buffer address {} is not aligned to {} bytes (O_DIRECT on {})",
                              io_op_name(request.op), f->path, static_cast<const void*>(cursor), info.mem_align,
                              info.filesystem);
    }
    if (s.offset % info.offset_align != 0 || s.length % info.offset_align != 0) {
      return invalid_argument("{} of {}: offset {} and length {} must be multiples of {} bytes (O_DIRECT on {})",
                              io_op_name(request.op), f->path, s.offset, s.length, info.offset_align,
                              info.filesystem);
    }
    if (request.op == IoOp::kWrite && !f->writable) {
      return invalid_argument("write to {}: the file was opened read-only", f->path);
    }
    if (std::find(state->files.begin(), state->files.end(), f) == state->files.end()) state->files.push_back(f);
    for (std::size_t at = 0; at < s.length; at += block) {
      Piece p;
      p.request = state.get();
      p.file = f;
      p.data = cursor + at;
      p.offset = s.offset + at;
      p.length = std::min(block, s.length - at);
      p.index = state->pieces.size();
      p.buffer_index = buffer_index(p.data, p.length);
      state->pieces.push_back(p);
    }
    cursor += s.length;
    state->total_bytes += s.length;
  }
  for (OpenFile* f : state->files) f->active_requests.fetch_add(1, std::memory_order_acq_rel);
  state->pieces_left.store(state->pieces.size());
  return state;
}

void IoEngineImpl::submit(IoRequest request, IoCallback done) {
  core_.count_request();
  Expected<std::unique_ptr<RequestState>> built = build(request);
  if (!built.ok()) {
    done(built.status(), IoResult{});
    return;
  }
  {
    std::lock_guard<std::mutex> lock(log_mu_);
    if (logging_) {
      std::shared_lock<std::shared_mutex> files_lock(files_mu_);
      for (const Segment& s : request.segments) {
        log_.push_back({request.op, files_[s.file.index]->path, s.offset, s.length});
      }
    }
  }
  RequestState* state = built->release();  // owned by its pieces now; the last one frees it
  state->callback = std::move(done);
  core_.busy_begin(state->op);
  // Deal pieces round-robin over the rings, starting where the last request
  // stopped, so small requests spread too.
  const std::size_t rings = rings_.size();
  std::vector<std::vector<Piece*>> per_ring(rings);
  std::size_t next = next_ring_.fetch_add(state->pieces.size(), std::memory_order_relaxed);
  for (Piece& p : state->pieces) per_ring[next++ % rings].push_back(&p);
  for (std::size_t i = 0; i < rings; ++i) {
    if (!per_ring[i].empty()) rings_[i]->enqueue(std::move(per_ring[i]));
  }
}

IoFuture IoEngineImpl::submit(IoRequest request) {
  auto [future, complete] = IoFuture::make();
  submit(std::move(request), std::move(complete));
  return std::move(future);
}

std::string IoEngineImpl::describe() const {
  const EngineOptions& o = core_.options();
  std::string buffers;
  {
    std::shared_lock<std::shared_mutex> lock(regions_mu_);
    if (backend_ == IoBackend::kUring && o.fixed_buffers) {
      buffers = fixed_buffers_refused_errno_ == 0
                    ? ", fixed buffers"
                    : fmt::format(", fixed buffers refused ({})", std::strerror(fixed_buffers_refused_errno_));
    }
  }
  return fmt::format("{}, {} ring{} x depth {}, {} blocks{}{}{}{}", io_backend_name(backend_), o.rings,
                     o.rings == 1 ? "" : "s", o.queue_depth, format_bytes(o.block_size_bytes), buffers,
                     fixed_files_ ? ", fixed files" : "", o.sqpoll && backend_ == IoBackend::kUring ? ", sqpoll" : "",
                     o.single_submit ? ", single submit" : "");
}

}  // namespace

Expected<std::unique_ptr<IoEngine>> IoEngine::create(const EngineOptions& options) {
  TZ_TRY(validate(options));
  checksum_variant();  // picks and logs the XXH3 build now rather than on a ring thread
  auto engine = std::make_unique<IoEngineImpl>(options, options.backend);
  TZ_TRY(engine->start());
  TZ_LOG_DEBUG("nvme", "I/O engine: {}", engine->describe());
  return std::unique_ptr<IoEngine>(std::move(engine));
}

}  // namespace tz::nvme
