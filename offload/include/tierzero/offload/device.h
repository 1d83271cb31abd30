// Device: the one interface the engine uses for device memory, streams, events
// and copies, with two backends picked at run time.
//
//   CUDA  streams, events, stream-ordered device memory (cudaMallocAsync on the
//         device's memory pool), async H2D/D2H copies, cudaHostRegister pinning.
//   Host  device memory is host memory; each stream is a worker thread that runs
//         its operations in order, so copies are asynchronous with the same
//         contract (ordered per stream, completion observed through events).
//         Pinning is mlock.
//
// Example:
//   TZ_ASSIGN_OR_RETURN(auto device, tz::create_device({}));   // CUDA if a GPU is present
//   TZ_ASSIGN_OR_RETURN(auto stream, device->create_stream());
//   TZ_ASSIGN_OR_RETURN(auto done, device->create_event());
//   TZ_ASSIGN_OR_RETURN(void* d_buf, device->allocate(bytes, stream.get()));
//   TZ_TRY(device->copy_async(d_buf, h_src, bytes, *stream));   // H2D
//   TZ_TRY(device->record_event(*done, *stream));
//   ... other work ...
//   TZ_TRY(device->synchronize_event(*done));
//
// Threads: a Device and its streams may be used from any thread; operations
// issued to one stream from several threads are ordered as they are issued.
// Errors: every call returns Status; CUDA's asynchronous errors surface at the
// next synchronizing call on that stream or event.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tierzero/common.h"

namespace tz {

enum class BackendKind { kHost, kCuda };
std::string_view backend_name(BackendKind kind);  // "host" | "cuda"

// A queue of operations that run in order. Created by a Device; destroying it
// waits for its pending work.
class Stream {
 public:
  virtual ~Stream() = default;
  // The backend's handle: a cudaStream_t on CUDA (pass it to tz::kernels'
  // *_cuda functions to order kernels with this stream's copies), nullptr on Host.
  virtual void* native_handle() const = 0;
};

// A point in a stream's work. Recording it again moves the point; an event
// never recorded counts as complete (as in CUDA).
class Event {
 public:
  virtual ~Event() = default;
};

struct DeviceMemoryInfo {
  std::uint64_t free_bytes = 0;
  std::uint64_t total_bytes = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual BackendKind kind() const = 0;
  // "cuda:0 NVIDIA H100 80GB HBM3 (sm_90)" or "host (device memory is host memory)".
  virtual std::string name() const = 0;
  // NUMA node nearest the device (-1 when unknown or irrelevant).
  virtual int numa_node() const = 0;
  virtual Expected<DeviceMemoryInfo> memory_info() = 0;

  virtual Expected<std::unique_ptr<Stream>> create_stream() = 0;
  virtual Expected<std::unique_ptr<Event>> create_event() = 0;

  // Device memory, at least 256-byte aligned (4096 on the Host backend). With a
  // stream the allocation and the free are ordered on it; without, they are
  // synchronous. `bytes` passed to deallocate must match allocate's.
  virtual Expected<void*> allocate(std::size_t bytes, Stream* stream) = 0;
  virtual Status deallocate(void* d_ptr, std::size_t bytes, Stream* stream) = 0;

  // Page-locks host memory so copies from/to it are truly asynchronous
  // (cudaHostRegister / mlock). The range must stay valid until unpin().
  virtual Status pin(void* h_ptr, std::size_t bytes) = 0;
  virtual Status unpin(void* h_ptr, std::size_t bytes) = 0;

  // Copies `bytes` from src to dst in stream order; either side may be host or
  // device memory (direction inferred). Host memory should be pinned.
  virtual Status copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) = 0;
  virtual Status memset_async(void* d_ptr, int value, std::size_t bytes, Stream& stream) = 0;
  // Runs fn on a host thread after all earlier work on `stream`; later work on
  // the stream waits for it. As with cudaLaunchHostFunc, fn must not call this
  // Device (or a pool that records events on it), must not block on other
  // streams' work, and must not throw: CUDA forbids device calls there and may
  // run several streams' host functions one at a time on one thread. The Host
  // backend is more lenient; code written for both must follow these rules.
  virtual Status launch_host_func(Stream& stream, std::function<void()> fn) = 0;

  virtual Status record_event(Event& event, Stream& stream) = 0;
  // Later work on `stream` waits until `event` completes (no host blocking).
  virtual Status stream_wait_event(Stream& stream, Event& event) = 0;
  // Later work on `stream` waits for the work queued so far on a stream this
  // Device did not create: another library's (a framework's compute stream,
  // handed over as DLPack hands streams over). CUDA: `native_stream` is a
  // cudaStream_t, nullptr meaning the legacy default stream. Host: there is no
  // foreign queued work (CPU arrays are ready when handed over); a no-op.
  virtual Status stream_wait_native(Stream& stream, void* native_stream) = 0;
  // True when the work before the event's record point is done.
  virtual Expected<bool> event_done(Event& event) = 0;
  // Block the calling thread until the event (the stream's work so far) is
  // done. Each call counts as one host wait.
  virtual Status synchronize_event(Event& event) = 0;
  virtual Status synchronize_stream(Stream& stream) = 0;

  // Host waits (synchronize_event/synchronize_stream calls) since creation,
  // from every thread: the engine's step report counts them per step.
  std::uint64_t host_waits() const { return host_waits_.load(std::memory_order_relaxed); }

 protected:
  void count_host_wait() { host_waits_.fetch_add(1, std::memory_order_relaxed); }

 private:
  std::atomic<std::uint64_t> host_waits_{0};
};

struct DeviceOptions {
  BackendChoice backend = BackendChoice::kAuto;  // auto: CUDA where a GPU is present
  int ordinal = 0;                               // CUDA device index
};

// Picks the backend: kAuto -> CUDA when built with it and a device is present,
// Host otherwise (logged once). kCuda without a GPU is an Unavailable error
// that says why (from the probe).
Expected<std::unique_ptr<Device>> create_device(const DeviceOptions& options);
std::unique_ptr<Device> create_host_device();

}  // namespace tz
