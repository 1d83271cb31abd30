// IoEngine: asynchronous file I/O for the NVMe tier.
//
// A request moves one caller buffer to or from one or more file segments (a
// tensor striped over several files on several drives is one request). The
// engine splits it into pieces of at most block_size bytes that never cross a
// segment, deals the pieces round-robin to its rings, and keeps up to
// queue_depth pieces in flight per ring. Each ring has its own thread that
// submits and reaps; submit() only enqueues, so it never blocks on the device,
// and only IoFuture::wait() (or the caller's own synchronisation around a
// callback) waits.
//
// Every completion's result is read: a short transfer is resubmitted for the
// rest; EAGAIN and EINTR are retried; end of file before a read is
// satisfied, a write of which the device accepts no bytes, or any other error,
// fails the request with a Status naming the file, offset, length and errno
// (code IoError, NoSpace for ENOSPC). A failed
// request's other pieces are not submitted, and those already in flight are
// waited for before the request completes, so the caller's buffer is never
// touched after completion.
//
// Checksums: a request may carry one XXH3-64 per piece. A write computes them
// while its pieces are in flight (the buffer does not change until completion,
// as for any request), so they are final when the request completes; a read
// verifies each piece after it arrives and fails with DataCorruption naming
// the file and offset of the first piece whose data does not match.
// piece_count() tells how many a request needs. XXH3 is built for each
// instruction set and the widest this CPU runs is picked once, and logged
// (checksum_variant()).
//
// Backends: io_uring (liburing) with O_DIRECT, registered buffers
// (register_buffer) and registered files where the kernel allows; or a thread
// pool of pread/pwrite where io_uring is refused (seccomp, old kernel) or
// forced. The fallback is logged once per process.
//
// O_DIRECT: open() probes the file's directory (tz::probe_path). A directory
// that refuses O_DIRECT, or accepts the flag but keeps data in the page cache
// (tmpfs), is an error naming the path unless FileOptions::allow_buffered,
// in which case the file uses buffered I/O and says so once. Requests on a
// direct file must have buffer, offsets and lengths aligned to the path's
// direct-I/O alignment; a misaligned request fails at submit() with
// InvalidArgument naming the value and the alignment, before any I/O.
//
// Example:
//   TZ_ASSIGN_OR_RETURN(auto engine, tz::nvme::IoEngine::create({.block_size_bytes = 1 << 20, .queue_depth = 32}));
//   TZ_ASSIGN_OR_RETURN(tz::nvme::FileId f, engine->open("/nvme0/x.bin", {.create = true, .size_bytes = n}));
//   TZ_TRY(engine->submit({.op = tz::nvme::IoOp::kWrite, .buffer = buf, .segments = {{f, 0, n}}}).wait());
//
// Thread safety: every member may be called from any thread. Callbacks run on
// a ring's thread: they must be short and must not wait on the engine.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tierzero/common.h"
#include "tierzero/nvme/limits.h"

namespace tz::nvme {

enum class IoOp : std::uint8_t { kRead, kWrite };
std::string_view io_op_name(IoOp op);  // "read" | "write"

enum class IoBackend : std::uint8_t { kAuto, kUring, kThreads };
std::string_view io_backend_name(IoBackend backend);  // "auto" | "io_uring" | "threads"

// Test hook: decides, for each piece about to be submitted, whether to fail it
// or shorten it. Called on the ring's thread; must be thread-safe when the
// engine has several rings.
struct PieceInfo {
  std::uint64_t sequence = 0;   // 0-based count of pieces submitted by this engine, resubmissions included
  IoOp op = IoOp::kRead;
  std::string path;
  std::uint64_t offset = 0;     // file offset of this submission
  std::size_t length = 0;       // bytes this submission asks for
};
struct Fault {
  int error = 0;                // > 0: complete the submission with -error without doing it
  std::size_t short_bytes = 0;  // > 0 (and < length): submit only this many bytes (a real short transfer)
  bool no_bytes = false;        // complete the submission with 0 bytes without doing it (a device that
                                // accepts nothing; for a read, end of file)
};
using FaultInjector = std::function<Fault(const PieceInfo&)>;

struct EngineOptions {
  std::size_t block_size_bytes = 1 << 20;  // aio.block_size: largest piece; a multiple of 4096, <= 1 GiB
  int queue_depth = 8;                     // aio.queue_depth: pieces in flight per ring, 1..kMaxQueueDepth
  int rings = 1;                           // aio.intra_op_parallelism: rings (each with a thread), 1..kMaxRings
  bool single_submit = false;              // aio.single_submit: one io_uring_enter per piece
  bool sqpoll = false;                     // IORING_SETUP_SQPOLL (a kernel thread polls each ring)
  bool fixed_buffers = true;               // use registered buffers for memory given to register_buffer()
  bool fixed_files = true;                 // register files with the rings
  std::size_t fixed_buffer_slot_bytes = std::size_t{1} << 30;  // largest registered-buffer slot: the
                                           // kernel's limit (1 GiB); lower only to test the split
  IoBackend backend = IoBackend::kAuto;    // kAuto: io_uring, else (refused) threads
  FaultInjector fault_injector;            // tests only

  // From the config's aio block (tz::AioConfig). overlap_events is always on
  // here (submission and completion overlap by design).
  static EngineOptions from_config(const AioConfig& aio);
};

struct FileOptions {
  bool create = false;            // create if missing (0644)
  bool exclusive = false;         // with create: fail if it exists
  bool truncate = false;
  bool writable = true;
  std::uint64_t size_bytes = 0;   // > 0: reserve this size with fallocate (ENOSPC here, not mid-run)
  bool direct = true;             // O_DIRECT
  bool allow_buffered = false;    // a path that refuses O_DIRECT uses buffered I/O (logged) instead of failing
};

// An open file of one engine. Valid until close().
struct FileId {
  std::uint32_t index = UINT32_MAX;
  bool valid() const { return index != UINT32_MAX; }
  friend bool operator==(FileId, FileId) = default;
};

struct FileInfo {
  std::string path;
  bool direct = false;               // O_DIRECT in effect
  std::uint32_t mem_align = 1;       // buffer alignment required (1 for buffered)
  std::uint32_t offset_align = 1;    // offset and length alignment required
  std::string filesystem;            // "ext4", ...
  std::string device;                // "nvme0n1", "vda", "" when none
};

// A run of bytes in one file.
struct Segment {
  FileId file;
  std::uint64_t offset = 0;
  std::size_t length = 0;
};

struct IoRequest {
  IoOp op = IoOp::kRead;
  void* buffer = nullptr;                // sum(segment lengths) bytes; untouched after completion
  std::vector<Segment> segments;         // the buffer's bytes, in order
  std::uint64_t* checksums = nullptr;    // nullptr, or piece_count() XXH3-64s: computed (write) / verified (read)
  std::string label;                     // prefixed to errors ("extent 7"), may be empty
};

struct IoResult {
  std::size_t bytes = 0;  // transferred (the whole request on success)
};

// The completion of one request. Move-only; wait() may be called once or more.
class IoFuture {
 public:
  IoFuture() = default;
  bool valid() const { return state_ != nullptr; }
  bool ready() const;
  // Blocks until the request completes; its Status.
  Status wait();
  // As wait(), but gives up after `timeout` with Timeout (the request goes on).
  Status wait_for(std::chrono::milliseconds timeout);

  // A future and the callback that completes it (for code that offers both
  // a future and a callback form of an operation).
  static std::pair<IoFuture, std::function<void(const Status&, const IoResult&)>> make();

 private:
  struct State;
  explicit IoFuture(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

using IoCallback = std::function<void(const Status& status, const IoResult& result)>;

struct EngineStats {
  std::uint64_t requests = 0;
  std::uint64_t pieces = 0;            // submissions, resubmissions included
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t short_transfers = 0;   // resubmitted for the rest
  std::uint64_t retries = 0;           // EAGAIN / EINTR
  std::uint64_t errors = 0;            // failed requests
  std::uint64_t fixed_buffer_pieces = 0;  // submitted with a registered buffer
  // Nanoseconds with at least one read (write) request submitted and not yet
  // complete: bytes_read / read_busy_ns is the rate the device gave while it
  // was asked to read (Note [Busy time] in nvme/src/io_engine_internal.h).
  std::uint64_t read_busy_ns = 0;
  std::uint64_t write_busy_ns = 0;
  std::uint64_t io_busy_ns = 0;  // with a request of either direction in flight: the drives' busy time
};

// One request segment as submitted, for replaying a workload's I/O pattern
// (tierzero-nvme-bench --replay; Note [I/O logs] in nvme/src/io_engine.cpp).
struct IoLogEntry {
  IoOp op = IoOp::kRead;
  std::string path;           // the file as opened
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

// Writes entries as a fio version 2 I/O log (the format fio's read_iolog
// replays): a header, "PATH add" and "PATH open" once per file, a
// "PATH read|write OFFSET LENGTH" line per entry in order, "PATH close" at the
// end. Written to a temporary name and renamed.
Status write_fio_iolog(const std::string& path, const std::vector<IoLogEntry>& entries);
// Reads such a log back (also one fio wrote); errors name the file and line.
Expected<std::vector<IoLogEntry>> read_fio_iolog(const std::string& path);

class IoEngine {
 public:
  // Validates the options (errors name the option and its range), starts the
  // rings' threads.
  static Expected<std::unique_ptr<IoEngine>> create(const EngineOptions& options);
  virtual ~IoEngine() = default;  // waits for every request in flight, then stops the threads

  virtual Expected<FileId> open(const std::string& path, const FileOptions& options) = 0;
  // Closes after the file's requests in flight complete. Closing a file with
  // requests still queued is FailedPrecondition.
  virtual Status close(FileId file) = 0;
  virtual Expected<FileInfo> file_info(FileId file) const = 0;

  // Registers [data, data + bytes) with every ring as fixed buffers: pieces
  // inside it use READ_FIXED/WRITE_FIXED. The kernel takes at most 1 GiB per
  // buffer slot, so a larger range fills several slots of
  // fixed_buffer_slot_bytes each, from `data` on; a piece that straddles two
  // slots goes the plain way. Optional, and never an error for the I/O:
  // where the kernel refuses with ENOMEM or EPERM (memlock limit), the engine
  // logs the errno once and stops using fixed buffers; any other refusal
  // leaves only this range unregistered, logged with its errno. The memory
  // must stay valid until unregister_buffer() or the engine's destruction.
  virtual Status register_buffer(void* data, std::size_t bytes) = 0;
  virtual Status unregister_buffer(void* data) = 0;

  // Queues a request; never blocks on I/O. Invalid requests (unknown file,
  // misaligned, zero segments, null buffer) complete at once with the error.
  virtual IoFuture submit(IoRequest request) = 0;
  virtual void submit(IoRequest request, IoCallback done) = 0;

  // Pieces `request` splits into (the number of checksums it needs).
  virtual std::size_t piece_count(const IoRequest& request) const = 0;

  virtual IoBackend backend() const = 0;          // kUring or kThreads, as running
  virtual const EngineOptions& options() const = 0;
  virtual EngineStats stats() const = 0;
  // While on, every valid submitted request's segments are appended to a log
  // in submission order; turning it on clears the log. take_log() returns it.
  virtual void record_log(bool on) = 0;
  virtual std::vector<IoLogEntry> take_log() = 0;
  // "io_uring, 2 rings x depth 32, 1 MiB blocks, fixed buffers" or why not.
  virtual std::string describe() const = 0;
};

// XXH3-64 of a byte range (the checksum the engine and the swap store use),
// by the variant checksum_variant() names. Every variant gives the same value.
std::uint64_t checksum(const void* data, std::size_t bytes);

// The XXH3 build checksum() runs: the widest this CPU supports of
// checksum_variants(), picked and logged (at info) on first use.
std::string_view checksum_variant();
// The variants compiled in and runnable on this CPU, narrowest first:
// "scalar", then on x86-64 "sse2", "avx2", "avx512" as supported.
std::vector<std::string_view> checksum_variants();
// checksum() by a named variant (tests, benchmarks); InvalidArgument naming
// the runnable ones for any other name.
Expected<std::uint64_t> checksum_with(std::string_view variant, const void* data, std::size_t bytes);

}  // namespace tz::nvme
