// What the engine's front (engine.cpp) shares with its rings (uring_ring.cpp,
// thread_ring.cpp): requests split into pieces, and the rule that settles a
// piece from one completion's result.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tierzero/nvme/io_engine.h"

namespace tz::nvme::detail {

// An open file as the rings see it. Owned by the engine's file table; lives
// until close(), which waits for its requests.
struct OpenFile {
  std::string path;
  UniqueFd fd;
  std::uint32_t index = 0;           // FileId and registered-file slot
  bool fixed = false;                // registered with every ring
  bool writable = false;
  FileInfo info;
  std::atomic<std::int64_t> active_requests{0};
};

struct RequestState;

// At most block_size bytes of one request in one file.
struct Piece {
  RequestState* request = nullptr;
  OpenFile* file = nullptr;
  char* data = nullptr;              // (length,) in the caller's buffer
  std::uint64_t offset = 0;          // file offset of data[0]
  std::size_t length = 0;
  std::size_t done = 0;              // bytes transferred so far
  std::size_t index = 0;             // checksum slot
  int buffer_index = -1;             // registered buffer holding data, -1 none
  int retries = 0;                   // EAGAIN / EINTR so far
  bool hashed = false;               // a write's checksum is computed (IoEngineCore::hash_write)
};

class IoEngineCore;

// One request in flight: its pieces, the first error, and how to complete.
struct RequestState {
  IoOp op = IoOp::kRead;
  std::string label;
  std::uint64_t* checksums = nullptr;
  std::size_t total_bytes = 0;
  std::vector<Piece> pieces;
  std::vector<OpenFile*> files;      // one active_requests count held on each
  std::atomic<std::size_t> pieces_left{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  Status error;                      // guarded by mu: the first failure
  IoCallback callback;
  IoEngineCore* core = nullptr;
};

// Note [Checksums off the I/O path]
// Hashing is the one CPU-heavy step of a piece (XXH3 runs at 15 to 35 GB/s,
// a few times the device's rate, not hundreds). A ring that hashed a write
// before queueing it, and verified each read of a completion batch before
// refilling the slots the batch freed, would leave the device idle while its
// thread hashed: the checksums would cost their whole time on top of the I/O.
// So the rings keep hashing out of that path:
// - A write's checksum is computed after the piece is submitted. The buffer
//   is the caller's and does not change while the request is in flight, so
//   the hash is the one it would have been before submission; it only has to
//   be done before the piece finishes (the checksums are the caller's once the
//   request completes). The io_uring ring hashes the pieces it has just
//   submitted before it next reaps; the thread ring hashes after its pwrite,
//   outside its I/O slot.
// - A read's checksum is verified after the ring has refilled the slots that
//   completions freed, so the next pieces are on the device while it hashes.
// Nothing else moves: each completion is settled (result checked, short
// transfers and retries resubmitted) as it is reaped, a mismatch fails the
// request before its callback, and a piece finishes only after its check.

// The counters and piece logic every ring shares.
class IoEngineCore {
 public:
  explicit IoEngineCore(const EngineOptions& options) : options_(options) {}

  const EngineOptions& options() const { return options_; }

  // The test hook's verdict for one submission; counts the submission.
  Fault consult_injector(const Piece& piece, std::size_t length);

  // Whether the piece is a write whose checksum is still to be computed.
  static bool needs_hash(const Piece& piece);
  // Computes a write piece's checksum (once). Any time from just before its
  // first submission until finish(): see Note [Checksums off the I/O path].
  void hash_write(Piece& piece);

  enum class Next {
    kResubmit,  // the rest of a short transfer, or a retry: submit again
    kComplete,  // every byte transferred: call check(piece), then finish(piece)
    kFinished,  // failed, or skipped because its request failed: call finish(piece)
  };
  // Settles one completion of `piece` with result `res` (bytes, or -errno).
  // Cheap: the checksum work of a complete piece is left to check(), which a
  // ring runs once it has refilled its queue. The caller forgets the piece
  // before finish().
  Next settle(Piece& piece, long res);
  // The checksum work of a piece settle() called complete: a read's checksum
  // is verified (a mismatch fails the request with DataCorruption naming the
  // file and offset); a write's is computed if it was not yet.
  void check(Piece& piece);
  // Counts the piece out of its request; the last one completes the request
  // (callback or future) and frees it.
  void finish(Piece& piece);
  // Whether the piece's request already failed (then it is not submitted).
  static bool skip(const Piece& piece) { return piece.request->failed.load(std::memory_order_acquire); }

  void fail(RequestState& request, Status status);
  void count_request() { requests_.fetch_add(1, std::memory_order_relaxed); }
  // Note [Busy time]: a request of `op` enters (submit) or leaves (its last piece finished).
  void busy_begin(IoOp op) {
    busy_[op == IoOp::kRead ? 0 : 1].begin();
    busy_[2].begin();
  }
  void busy_end(IoOp op) {
    busy_[op == IoOp::kRead ? 0 : 1].end();
    busy_[2].end();
  }
  void count_fixed_buffer() { fixed_buffer_pieces_.fetch_add(1, std::memory_order_relaxed); }
  EngineStats stats() const;

 private:
  // Note [Busy time]
  // A rate is bytes over the time the device was asked for them: the union
  // of the intervals in which at least one request of the direction was in
  // flight (submitted, last piece not finished), not the wall time (which
  // holds the callers' gaps) nor the sum of latencies (which counts
  // overlapping requests many times). One mutex per direction, taken twice a
  // request (requests are pieces of a MiB or more): cheap beside the I/O.
  class BusyClock {
   public:
    void begin() {
      std::lock_guard<std::mutex> lock(mu_);
      if (inflight_++ == 0) since_ = std::chrono::steady_clock::now();
    }
    void end() {
      std::lock_guard<std::mutex> lock(mu_);
      if (--inflight_ == 0) busy_ += std::chrono::steady_clock::now() - since_;
    }
    std::uint64_t ns() const {  // the open interval included
      std::lock_guard<std::mutex> lock(mu_);
      auto busy = busy_;
      if (inflight_ > 0) busy += std::chrono::steady_clock::now() - since_;
      return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(busy).count());
    }

   private:
    mutable std::mutex mu_;
    std::int64_t inflight_ = 0;
    std::chrono::steady_clock::time_point since_;
    std::chrono::steady_clock::duration busy_{0};
  };
  BusyClock busy_[3];  // read, write, either
  const EngineOptions options_;
  std::atomic<std::uint64_t> requests_{0}, pieces_{0}, bytes_read_{0}, bytes_written_{0};
  std::atomic<std::uint64_t> short_transfers_{0}, retries_{0}, errors_{0}, fixed_buffer_pieces_{0};
};

// A ring: pieces go in, completions come out through IoEngineCore.
class Ring {
 public:
  virtual ~Ring() = default;  // drains: every enqueued piece finishes first
  virtual void enqueue(std::vector<Piece*> pieces) = 0;
  // Registered files and buffers (no-ops where unsupported).
  virtual void set_file(std::uint32_t index, int fd) = 0;
  // Fills (data != nullptr) or clears registered-buffer slot `index`: 0, or
  // the errno the kernel refused with.
  virtual int set_buffer(int index, void* data, std::size_t bytes) = 0;
};

inline constexpr int kMaxFixedBuffers = 64;
inline constexpr std::size_t kMaxFixedBufferSlotBytes = std::size_t{1} << 30;  // the kernel's limit
inline constexpr std::uint32_t kMaxFiles = 4096;
inline constexpr int kMaxRetries = 1000;

// io_uring ring with its own thread. Fails (ENOSYS, EPERM under seccomp, ...)
// where the kernel refuses io_uring; `fixed_files` is cleared where the kernel
// refuses a registered file table.
Expected<std::unique_ptr<Ring>> make_uring_ring(IoEngineCore& core, int id, bool& fixed_files);
// pread/pwrite on queue_depth threads.
std::unique_ptr<Ring> make_thread_ring(IoEngineCore& core, int id);

}  // namespace tz::nvme::detail
