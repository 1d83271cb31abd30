// What the engine's front (engine.cpp) shares with its rings (uring_ring.cpp,
// thread_ring.cpp): requests split into pieces, and the rule that settles a
// piece from one completion's result.
#pragma once

#include <atomic>
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
  bool prepared = false;             // EngineCore::prepare ran
};

class EngineCore;

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
  EngineCore* core = nullptr;
};

// The counters and piece logic every ring shares.
class EngineCore {
 public:
  explicit EngineCore(const EngineOptions& options) : options_(options) {}

  const EngineOptions& options() const { return options_; }

  // Before each submission of a piece: the first time, a write computes its
  // checksum.
  void prepare(Piece& piece);
  // The test hook's verdict for one submission; counts the submission.
  Fault consult_injector(const Piece& piece, std::size_t length);

  enum class Next { kResubmit, kFinished };
  // Settles one completion of `piece` with result `res` (bytes, or -errno):
  // kResubmit for the rest of a short transfer or a retry, kFinished when the
  // piece is done (complete, failed, or skipped because its request failed).
  // On kFinished the caller must call finish(piece) after forgetting it.
  Next settle(Piece& piece, long res);
  // Counts the piece out of its request; the last one completes the request
  // (callback or future) and frees it.
  void finish(Piece& piece);
  // Whether the piece's request already failed (then it is not submitted).
  static bool skip(const Piece& piece) { return piece.request->failed.load(std::memory_order_acquire); }

  void fail(RequestState& request, Status status);
  void count_request() { requests_.fetch_add(1, std::memory_order_relaxed); }
  void count_fixed_buffer() { fixed_buffer_pieces_.fetch_add(1, std::memory_order_relaxed); }
  EngineStats stats() const;

 private:
  const EngineOptions options_;
  std::atomic<std::uint64_t> requests_{0}, pieces_{0}, bytes_read_{0}, bytes_written_{0};
  std::atomic<std::uint64_t> short_transfers_{0}, retries_{0}, errors_{0}, fixed_buffer_pieces_{0};
};

// A ring: pieces go in, completions come out through EngineCore.
class Ring {
 public:
  virtual ~Ring() = default;  // drains: every enqueued piece finishes first
  virtual void enqueue(std::vector<Piece*> pieces) = 0;
  // Registered files and buffers (no-ops where unsupported).
  virtual void set_file(std::uint32_t index, int fd) = 0;
  virtual bool set_buffer(int index, void* data, std::size_t bytes) = 0;
};

inline constexpr int kMaxFixedBuffers = 64;
inline constexpr std::uint32_t kMaxFiles = 4096;
inline constexpr int kMaxRetries = 1000;

// io_uring ring with its own thread. Fails (ENOSYS, EPERM under seccomp, ...)
// where the kernel refuses io_uring; `fixed_files` is cleared where the kernel
// refuses a registered file table.
Expected<std::unique_ptr<Ring>> make_uring_ring(EngineCore& core, int id, bool& fixed_files);
// pread/pwrite on queue_depth threads.
std::unique_ptr<Ring> make_thread_ring(EngineCore& core, int id);

}  // namespace tz::nvme::detail
