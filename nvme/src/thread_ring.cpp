// The fallback where io_uring is refused: queue_depth threads per ring, each
// doing one pread/pwrite at a time, with the same settle rules as io_uring.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <thread>

#include "engine_internal.h"

namespace tz::nvme::detail {
namespace {

constexpr int kMaxThreadsPerRing = 64;

class ThreadRing final : public Ring {
 public:
  ThreadRing(EngineCore& core, int id) : core_(core) {
    const int threads = std::clamp(core.options().queue_depth, 1, kMaxThreadsPerRing);
    TZ_LOG_DEBUG("nvme", "thread ring {}: {} pread/pwrite threads", id, threads);
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
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
  bool set_buffer(int, void* data, std::size_t) override { return data == nullptr; }

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
      transfer(*p);
      core_.finish(*p);
    }
  }

  // Runs one piece to its end: every retry and short-transfer rest in place.
  void transfer(Piece& p) {
    for (;;) {
      if (EngineCore::skip(p)) return;
      core_.prepare(p);
      std::size_t length = p.length - p.done;
      const Fault fault = core_.consult_injector(p, length);
      long res = 0;
      if (fault.error > 0) {
        res = -fault.error;
      } else {
        if (fault.short_bytes > 0 && fault.short_bytes < length) length = fault.short_bytes;
        const auto offset = static_cast<off_t>(p.offset + p.done);
        const ssize_t n = p.request->op == IoOp::kRead ? ::pread(p.file->fd.get(), p.data + p.done, length, offset)
                                                       : ::pwrite(p.file->fd.get(), p.data + p.done, length, offset);
        res = n < 0 ? -errno : n;
      }
      if (core_.settle(p, res) == EngineCore::Next::kFinished) return;
    }
  }

  EngineCore& core_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece*> queue_;  // guarded by mu_
  bool stop_ = false;         // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<Ring> make_thread_ring(EngineCore& core, int id) { return std::make_unique<ThreadRing>(core, id); }

}  // namespace tz::nvme::detail
