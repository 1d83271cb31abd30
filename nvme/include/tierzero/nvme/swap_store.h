// SwapStore: byte extents (tensors) in preallocated swap files on one or more
// paths, for the NVMe tier.
//
// create() makes one swap file per path (named tierzero-swap-<16 random hex
// digits>.bin, created exclusively) and reserves capacity_bytes / paths in
// each with fallocate, so a disk too small is reported at start-up with the
// path, the size asked and the space free, not mid-run. The files are scratch
// for the life of the store and are removed when it is destroyed (checkpoints
// are the engine's, with their own manifest).
//
// Ownership: the store holds an advisory lock on each of its files for its
// whole life, and the kernel drops it when the process ends, however it ends.
// Before making its own, create() removes every swap file in the folder whose
// lock is free (left by a run that has ended: kill -9, a crash, a container
// restarted), logging each with its size, and leaves those of live runs (in
// this process or any other sharing the folder) alone. When the disk is then
// too small, the NoSpace error names the files it removed, and those live
// runs hold (Note [Swap file ownership] in src/swap_files.cpp).
//
// An extent of n bytes occupies padded_bytes(n) (n rounded up to the direct-I/O
// alignment, 4 KiB). With several paths it is striped: stripe units of
// stripe_bytes go round-robin over the paths (the first path rotating from
// extent to extent), each path holding its share contiguously, so one extent's
// read or write keeps every drive busy.
//
// Integrity: each extent carries one XXH3-64 per I/O piece, computed by the
// write and checked by every read. A read whose data does not match (a flipped
// bit on the drive, a torn or lost write, a file truncated or overwritten
// behind our back) fails with DataCorruption naming the extent, the file and
// the offset; the caller's buffer then holds no promise and must not be used.
// An extent whose write failed (EIO, ENOSPC) holds nothing: reading it is
// FailedPrecondition naming the failed write, until a later write succeeds.
//
// Buffers: the caller's buffer must be padded_bytes(extent) long and aligned to
// buffer_alignment(); it must stay valid and unchanged (write) or unread
// (read) until the future completes. Register long-lived staging memory with
// register_buffer() for the engine's fixed-buffer path.
//
// Example:
//   tz::nvme::SwapOptions o{.paths = {"/nvme0/tz", "/nvme1/tz"}, .capacity_bytes = 64ULL << 30};
//   TZ_ASSIGN_OR_RETURN(auto store, tz::nvme::SwapStore::create(o));
//   TZ_ASSIGN_OR_RETURN(tz::nvme::ExtentId e, store->allocate(bytes));
//   TZ_TRY(store->write(e, host_buf).wait());
//   ...
//   TZ_TRY(store->read(e, host_buf).wait());
//   TZ_TRY(store->free(e));
//
// Thread safety: every member may be called from any thread. Reads of one
// extent may overlap each other; a write may not overlap anything on its
// extent, nor a free anything (FailedPrecondition).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tierzero/nvme/io_engine.h"

namespace tz::nvme {

struct SwapOptions {
  std::vector<std::string> paths;        // directories, one swap file each; must exist
  std::uint64_t capacity_bytes = 0;      // total over the paths (> 0), split evenly
  std::size_t stripe_bytes = 0;          // stripe unit; 0: the engine's block size. Multiple of 4096
  bool checksums = true;
  bool allow_buffered = false;           // aio.allow_buffered_io: a path refusing O_DIRECT goes buffered
  EngineOptions engine;                  // used when create() is not handed an engine
};

using ExtentId = std::uint64_t;

// Where an extent's bytes live (for tests and diagnostics).
struct ExtentPlacement {
  std::string path;                      // the swap file
  std::uint64_t offset = 0;              // of the path's share in the file
  std::size_t bytes = 0;                 // of the share (padded)
};

struct SwapStats {
  std::uint64_t capacity_bytes = 0;
  std::uint64_t used_bytes = 0;          // padded bytes of live extents
  std::uint64_t peak_used_bytes = 0;
  std::uint64_t extents = 0;             // live
  std::uint64_t bytes_written = 0;       // by successful writes
  std::uint64_t bytes_read = 0;          // by successful, verified reads
  std::uint64_t corrupt_reads = 0;
  std::uint64_t failed_writes = 0;
};

class SwapStore {
 public:
  // Creates and reserves the swap files; on any failure removes what it made.
  // `engine` may be shared with other users; when null, one is made from
  // options.engine.
  static Expected<std::unique_ptr<SwapStore>> create(const SwapOptions& options,
                                                     std::shared_ptr<IoEngine> engine = nullptr);
  virtual ~SwapStore() = default;  // waits for its requests, closes and removes the swap files

  // Reserves padded_bytes(bytes) of swap space. OutOfMemory-like NoSpace
  // error naming the capacity, the use and the request when it does not fit.
  virtual Expected<ExtentId> allocate(std::size_t bytes) = 0;
  virtual Status free(ExtentId extent) = 0;

  virtual IoFuture write(ExtentId extent, const void* buffer) = 0;
  virtual IoFuture read(ExtentId extent, void* buffer) = 0;
  virtual void write(ExtentId extent, const void* buffer, IoCallback done) = 0;
  virtual void read(ExtentId extent, void* buffer, IoCallback done) = 0;

  virtual Expected<std::size_t> extent_bytes(ExtentId extent) const = 0;   // as allocated
  virtual std::size_t padded_bytes(std::size_t bytes) const = 0;
  virtual std::size_t buffer_alignment() const = 0;
  virtual Expected<std::vector<ExtentPlacement>> placement(ExtentId extent) const = 0;

  virtual Status register_buffer(void* data, std::size_t bytes) = 0;  // see IoEngine::register_buffer
  virtual Status unregister_buffer(void* data) = 0;

  // The swap files, one per path. An outsider may open them to look, but
  // must not take their lock (Note [Swap file ownership]).
  virtual std::vector<std::string> file_paths() const = 0;
  virtual SwapStats stats() const = 0;
  virtual IoEngine& engine() = 0;
};

// A swap file reclaim_stale_swap_files found.
struct SwapFileSeen {
  std::string path;
  std::uint64_t bytes = 0;     // disk space it holds (allocated blocks)
  std::string why;             // for one that could not be checked: the error
};

// What reclaim_stale_swap_files found in one folder.
struct SwapFolderReport {
  std::string dir;
  std::vector<SwapFileSeen> removed;    // no process held their lock: left by runs that have ended
  std::vector<SwapFileSeen> held;       // a live process holds their lock: left alone
  std::vector<SwapFileSeen> unchecked;  // could not be opened or locked (another user's, say): left alone
  // "; in <dir>, 1 stale swap file ... was removed first: ...; 2 swap files
  // are held by another live run ...": the clause an out-of-space message
  // ends with ("" when there was nothing to say).
  std::string describe() const;
};

// Removes each swap file in `dir` that no live store holds (its lock is
// free), logging its name and size, and lists those that live runs hold.
// create() does it for each of its paths; an engine does it before it reads
// the free space there (a "nvme_bytes": "auto" budget), so a dead run's file
// is not counted against the next. A folder that cannot be read gives an
// empty report.
SwapFolderReport reclaim_stale_swap_files(const std::string& dir);

// Removes (unlinks) the swap files of every SwapStore alive in this process,
// now, for a process about to end abnormally: a second SIGINT or SIGTERM, a
// fatal signal. Async-signal-safe, so a signal handler may call it; the
// stores are left unusable (their I/O goes on to files no longer named), so
// call it only on the way out (Note [Swap files removed at abort] in
// src/swap_files.cpp).
void remove_swap_files_now() noexcept;

}  // namespace tz::nvme
