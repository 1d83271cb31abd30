// The Host backend: "device" memory is host memory, and each stream is a
// worker thread that runs its operations in issue order. This gives CPU-only
// machines the same asynchronous contract as CUDA, so the engine's overlap
// logic runs, and is tested, without a GPU.
//
// Note [Idle streams run cheap work inline]
// Handing an operation to the stream's thread and waiting for it costs two
// thread wake-ups (tens of microseconds on a loaded machine), far more than a
// small copy or an event record. So when a stream is idle (nothing queued,
// nothing running) such work runs on the calling thread, with the stream
// marked busy meanwhile so that work issued by other threads queues behind
// it: the order is the same, only the thread differs. Large copies and host
// functions always go to the stream's thread, where they overlap with the
// caller as on a GPU.
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <thread>

#include "device_internal.h"
#include "tierzero/offload/device.h"

namespace tz {
namespace {

constexpr std::size_t kHostDeviceAlignment = 4096;  // enough for O_DIRECT from "device" buffers
// Copies and fills up to this size run inline on an idle stream (Note [Idle
// streams run cheap work inline]): a few microseconds of memcpy at most.
constexpr std::size_t kInlineBytes = 64 * 1024;

// Completion flag shared between an event and the stream task that sets it.
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = true;

  void set_done() {
    {
      std::lock_guard lock(mu);
      done = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return done; });
  }
  bool is_done() {
    std::lock_guard lock(mu);
    return done;
  }
};

class HostEvent final : public Event {
 public:
  // Re-recording swaps in a fresh state, so waits issued earlier keep waiting
  // for the earlier record point (CUDA semantics).
  std::shared_ptr<EventState> arm() {
    auto state = std::make_shared<EventState>();
    state->done = false;
    std::lock_guard lock(mu_);
    state_ = state;
    return state;
  }
  std::shared_ptr<EventState> current() {
    std::lock_guard lock(mu_);
    return state_;
  }

 private:
  std::mutex mu_;
  std::shared_ptr<EventState> state_ = std::make_shared<EventState>();
};

class HostStream final : public Stream {
 public:
  HostStream() : worker_([this] { run(); }) {}
  void* native_handle() const override { return nullptr; }
  ~HostStream() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();  // run() drains the queue before it returns
  }

  void enqueue(std::function<void()> task) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

  // Note [Idle streams run cheap work inline]. `task` must be cheap and must
  // not use this stream.
  template <typename Task>
  void run_or_enqueue(Task&& task) {
    std::unique_lock lock(mu_);
    if (!queue_.empty() || busy_) {
      queue_.emplace_back(std::forward<Task>(task));
      lock.unlock();
      cv_.notify_one();
      return;
    }
    busy_ = true;
    lock.unlock();
    task();
    lock.lock();
    busy_ = false;
    const bool wake = !queue_.empty() || stopping_;  // issued by another thread meanwhile; or being destroyed
    lock.unlock();
    if (wake) cv_.notify_one();
  }

  // Work over `bytes` of memory: inline when small and the stream idle, else
  // on the stream's thread.
  template <typename Task>
  void submit_bytes(std::size_t bytes, Task&& task) {
    if (bytes <= kInlineBytes) {
      run_or_enqueue(std::forward<Task>(task));
    } else {
      enqueue(std::forward<Task>(task));
    }
  }

 private:
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return !busy_ && (stopping_ || !queue_.empty()); });
      if (queue_.empty()) return;  // stopping, and nothing left
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      task();
      lock.lock();
      busy_ = false;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false;  // a task is running (on the worker, or inline on a caller)
  bool stopping_ = false;
  std::thread worker_;  // last: starts after the members it uses
};

HostStream& host(Stream& stream) { return static_cast<HostStream&>(stream); }
HostEvent& host(Event& event) { return static_cast<HostEvent&>(event); }

class HostDevice final : public Device {
 public:
  BackendKind kind() const override { return BackendKind::kHost; }
  std::string name() const override { return "host (device memory is host memory)"; }
  int numa_node() const override { return -1; }

  Expected<DeviceMemoryInfo> memory_info() override {
    TZ_ASSIGN_OR_RETURN(HostMemoryReading reading, read_host_memory());
    return DeviceMemoryInfo{reading.available_bytes, reading.total_bytes};
  }

  Expected<std::unique_ptr<Stream>> create_stream() override {
    return std::unique_ptr<Stream>(std::make_unique<HostStream>());
  }
  Expected<std::unique_ptr<Event>> create_event() override {
    return std::unique_ptr<Event>(std::make_unique<HostEvent>());
  }

  Expected<void*> allocate(std::size_t bytes, Stream* /*stream*/) override {
    // Allocation needs no ordering on the host: memory is usable at once.
    if (bytes > (std::numeric_limits<std::size_t>::max() >> 1)) {
      return invalid_argument("host device: allocation of {} bytes is beyond any address space", bytes);
    }
    void* ptr = std::aligned_alloc(kHostDeviceAlignment, align_up(bytes == 0 ? 1 : bytes, kHostDeviceAlignment));
    if (ptr == nullptr) {
      return out_of_memory("host device: allocating {} failed", format_bytes(bytes));
    }
    return ptr;
  }

  Status deallocate(void* d_ptr, std::size_t /*bytes*/, Stream* stream) override {
    if (stream != nullptr) {
      host(*stream).run_or_enqueue([d_ptr] { std::free(d_ptr); });  // after the stream's earlier work
    } else {
      std::free(d_ptr);
    }
    return ok_status();
  }

  Status pin(void* h_ptr, std::size_t bytes) override { return lock_host_pages(h_ptr, bytes); }
  Status unpin(void* h_ptr, std::size_t bytes) override { return unlock_host_pages(h_ptr, bytes); }

  Status copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) override {
    host(stream).submit_bytes(bytes, [dst, src, bytes] { std::memcpy(dst, src, bytes); });
    return ok_status();
  }
  Status memset_async(void* d_ptr, int value, std::size_t bytes, Stream& stream) override {
    host(stream).submit_bytes(bytes, [d_ptr, value, bytes] { std::memset(d_ptr, value, bytes); });
    return ok_status();
  }
  Status launch_host_func(Stream& stream, std::function<void()> fn) override {
    host(stream).enqueue(std::move(fn));
    return ok_status();
  }

  Status record_event(Event& event, Stream& stream) override {
    std::shared_ptr<EventState> state = host(event).arm();
    host(stream).run_or_enqueue([state] { state->set_done(); });
    return ok_status();
  }
  Status stream_wait_event(Stream& stream, Event& event) override {
    std::shared_ptr<EventState> state = host(event).current();
    if (!state->is_done()) host(stream).enqueue([state] { state->wait(); });
    return ok_status();
  }
  // Foreign CPU work is done by the time its arrays are handed over.
  Status stream_wait_native(Stream& /*stream*/, void* /*native_stream*/) override { return ok_status(); }
  Expected<bool> event_done(Event& event) override { return host(event).current()->is_done(); }
  Status synchronize_event(Event& event) override {
    count_host_wait();
    host(event).current()->wait();
    return ok_status();
  }
  Status synchronize_stream(Stream& stream) override {
    HostEvent marker;
    TZ_TRY(record_event(marker, stream));
    return synchronize_event(marker);  // counted there
  }
};

}  // namespace

std::unique_ptr<Device> create_host_device() { return std::make_unique<HostDevice>(); }

}  // namespace tz
