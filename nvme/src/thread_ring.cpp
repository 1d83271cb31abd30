// The fallback where io_uring is refused: threads doing one pread/pwrite
// each, with the same settle rules as io_uring.
//
// queue_depth I/O slots per ring, and one thread more than slots: a thread
// gives its slot back as soon as its transfer is done and only then hashes
// (Note [Checksums off the I/O path] in io_engine_internal.h), so the spare
// thread keeps the depth full meanwhile. Even at depth 1 the hashing of one
// piece overlaps the transfer of the next.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <semaphore>
#include <thread>

#include "io_engine_internal.h"

namespace tz::nvme::detail {
namespace {

constexpr int kMaxSlotsPerRing = 64;

class ThreadRing final : public Ring {
 public:
  ThreadRing(IoEngineCore& core, int id)
      : core_(core), slots_(std::clamp(core.options().queue_depth, 1, kMaxSlotsPerRing)) {
    const int slots = std::clamp(core.options().queue_depth, 1, kMaxSlotsPerRing);
    TZ_LOG_DEBUG("nvme", "thread ring {}: {} pread/pwrite slots, {} threads", id, slots, slots + 1);
    for (int i = 0; i <= slots; ++i) threads_.emplace_back([this] { run(); });
  }

  ~ThreadRing() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  void enqueue(std::vector<Piece*> pieces) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.insert(queue_.end(), pieces.begin(), pieces.end());
    }
    cv_.notify_all();
  }

  void set_file(std::uint32_t, int) override {}
  int set_buffer(int, void* data, std::size_t) override { return data == nullptr ? 0 : EOPNOTSUPP; }

 private:
  void run() {
    for (;;) {
      Piece* p = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and drained
        p = queue_.front();
        queue_.pop_front();
      }
      slots_.acquire();
      const IoEngineCore::Next next = transfer(*p);
      slots_.release();
      if (next == IoEngineCore::Next::kComplete) core_.check(*p);
      core_.finish(*p);
    }
  }

  // Runs one piece's I/O to its end: every retry and short-transfer rest in
  // place. kComplete or kFinished.
  IoEngineCore::Next transfer(Piece& p) {
    for (;;) {
      if (IoEngineCore::skip(p)) return IoEngineCore::Next::kFinished;
      std::size_t length = p.length - p.done;
      const Fault fault = core_.consult_injector(p, length);
      long res = 0;
      if (fault.error > 0) {
        res = -fault.error;
      } else if (!fault.no_bytes) {
        if (fault.short_bytes > 0 && fault.short_bytes < length) length = fault.short_bytes;
        const auto offset = static_cast<off_t>(p.offset + p.done);
        const ssize_t n = p.request->op == IoOp::kRead ? ::pread(p.file->fd.get(), p.data + p.done, length, offset)
                                                       : ::pwrite(p.file->fd.get(), p.data + p.done, length, offset);
        res = n < 0 ? -errno : n;
      }
      const IoEngineCore::Next next = core_.settle(p, res);
      if (next != IoEngineCore::Next::kResubmit) return next;
    }
  }

  IoEngineCore& core_;
  std::counting_semaphore<kMaxSlotsPerRing> slots_;  // transfers in progress at most
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece*> queue_;  // guarded by mu_
  bool stop_ = false;         // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<Ring> make_thread_ring(IoEngineCore& core, int id) { return std::make_unique<ThreadRing>(core, id); }

}  // namespace tz::nvme::detail
