// The CUDA backend. Compiled only with TIERZERO_CUDA; every call makes the
// device current first, because the engine calls in from several threads.
#include <cuda_runtime.h>

#include "device_internal.h"
#include "tierzero/common/checks.h"
#include "tierzero/offload/device.h"

namespace tz {
namespace {

class CudaStream final : public Stream {
 public:
  explicit CudaStream(cudaStream_t s) : stream_(s) {}
  void* native_handle() const override { return stream_; }
  ~CudaStream() override {
    // cudaStreamDestroy returns at once; the contract (device.h) is that the
    // stream's work is finished, so memory freed next is no longer in use.
    if (stream_ == nullptr) return;
    if (cudaStreamSynchronize(stream_) != cudaSuccess) (void)cudaGetLastError();
    if (cudaStreamDestroy(stream_) != cudaSuccess) (void)cudaGetLastError();
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_;
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(cudaEvent_t e) : event_(e) {}
  ~CudaEvent() override {
    if (event_ != nullptr && cudaEventDestroy(event_) != cudaSuccess) (void)cudaGetLastError();
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_;
};

cudaStream_t raw(Stream& s) { return static_cast<CudaStream&>(s).get(); }
cudaEvent_t raw(Event& e) { return static_cast<CudaEvent&>(e).get(); }

void CUDART_CB run_host_func(void* arg) {
  std::unique_ptr<std::function<void()>> fn(static_cast<std::function<void()>*>(arg));
  (*fn)();
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, std::string name, int numa_node)
      : ordinal_(ordinal), name_(std::move(name)), numa_node_(numa_node) {}

  // Caching is MemoryPool's job (it allocates synchronously, below the
  // stream-ordered allocator); the driver's default pool keeps its default
  // release threshold, so other libraries sharing it see no change.
  Status init() { return make_current(); }

  BackendKind kind() const override { return BackendKind::kCuda; }
  std::string name() const override { return name_; }
  int numa_node() const override { return numa_node_; }

  Expected<DeviceMemoryInfo> memory_info() override {
    TZ_TRY(make_current());
    std::size_t free_bytes = 0, total_bytes = 0;
    TZ_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return DeviceMemoryInfo{free_bytes, total_bytes};
  }

  Expected<std::unique_ptr<Stream>> create_stream() override {
    TZ_TRY(make_current());
    cudaStream_t s = nullptr;
    TZ_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return std::unique_ptr<Stream>(std::make_unique<CudaStream>(s));
  }
  Expected<std::unique_ptr<Event>> create_event() override {
    TZ_TRY(make_current());
    cudaEvent_t e = nullptr;
    TZ_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return std::unique_ptr<Event>(std::make_unique<CudaEvent>(e));
  }

  Expected<void*> allocate(std::size_t bytes, Stream* stream) override {
    TZ_TRY(make_current());
    void* ptr = nullptr;
    if (stream != nullptr) {
      TZ_CUDA_CHECK(cudaMallocAsync(&ptr, bytes, raw(*stream)));
    } else {
      TZ_CUDA_CHECK(cudaMalloc(&ptr, bytes));
    }
    return ptr;
  }
  Status deallocate(void* d_ptr, std::size_t /*bytes*/, Stream* stream) override {
    TZ_TRY(make_current());
    if (stream != nullptr) {
      TZ_CUDA_CHECK(cudaFreeAsync(d_ptr, raw(*stream)));
    } else {
      TZ_CUDA_CHECK(cudaFree(d_ptr));
    }
    return ok_status();
  }

  Status pin(void* h_ptr, std::size_t bytes) override {
    TZ_TRY(make_current());
    TZ_CUDA_CHECK(cudaHostRegister(h_ptr, bytes, cudaHostRegisterPortable));
    return ok_status();
  }
  Status unpin(void* h_ptr, std::size_t /*bytes*/) override {
    TZ_TRY(make_current());
    TZ_CUDA_CHECK(cudaHostUnregister(h_ptr));
    return ok_status();
  }

  Status copy_async(void* dst, const void* src, std::size_t bytes, Stream& stream) override {
    TZ_TRY(make_current());
    TZ_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, raw(stream)));
    return ok_status();
  }
  Status memset_async(void* d_ptr, int value, std::size_t bytes, Stream& stream) override {
    TZ_TRY(make_current());
    TZ_CUDA_CHECK(cudaMemsetAsync(d_ptr, value, bytes, raw(stream)));
    return ok_status();
  }
  Status launch_host_func(Stream& stream, std::function<void()> fn) override {
    TZ_TRY(make_current());
    auto* boxed = new std::function<void()>(std::move(fn));  // owned by run_host_func
    cudaError_t err = cudaLaunchHostFunc(raw(stream), run_host_func, boxed);
    if (err != cudaSuccess) delete boxed;
    TZ_CUDA_CHECK(err);
    return ok_status();
  }

  Status record_event(Event& event, Stream& stream) override {
    TZ_TRY(make_current());
    TZ_CUDA_CHECK(cudaEventRecord(raw(event), raw(stream)));
    return ok_status();
  }
  Status stream_wait_event(Stream& stream, Event& event) override {
    TZ_TRY(make_current());
    TZ_CUDA_CHECK(cudaStreamWaitEvent(raw(stream), raw(event), 0));
    return ok_status();
  }
  Status stream_wait_native(Stream& stream, void* native_stream) override {
    TZ_TRY(make_current());
    cudaStream_t producer = native_stream == nullptr ? cudaStreamLegacy : static_cast<cudaStream_t>(native_stream);
    // A fresh event each time: the wait is enqueued by the time it returns, and
    // destroying an event with a pending wait on it is allowed (its resources
    // go when the wait is done).
    cudaEvent_t e = nullptr;
    TZ_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cudaError_t err = cudaEventRecord(e, producer);
    if (err == cudaSuccess) err = cudaStreamWaitEvent(raw(stream), e, 0);
    const cudaError_t destroyed = cudaEventDestroy(e);
    TZ_CUDA_CHECK(err != cudaSuccess ? err : destroyed);
    return ok_status();
  }
  Expected<bool> event_done(Event& event) override {
    TZ_TRY(make_current());
    cudaError_t err = cudaEventQuery(raw(event));
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    TZ_CUDA_CHECK(err);
    return true;
  }
  Status synchronize_event(Event& event) override {
    count_host_wait();
    TZ_TRY(make_current());
    TZ_CUDA_CHECK(cudaEventSynchronize(raw(event)));
    return ok_status();
  }
  Status synchronize_stream(Stream& stream) override {
    count_host_wait();
    TZ_TRY(make_current());
    TZ_CUDA_CHECK(cudaStreamSynchronize(raw(stream)));
    return ok_status();
  }

 private:
  Status make_current() {
    int current = -1;
    TZ_CUDA_CHECK(cudaGetDevice(&current));
    if (current != ordinal_) TZ_CUDA_CHECK(cudaSetDevice(ordinal_));
    return ok_status();
  }

  int ordinal_;
  std::string name_;
  int numa_node_;
};

}  // namespace

Expected<std::unique_ptr<Device>> create_cuda_device(int ordinal) {
  const CudaCapabilities& cuda = capabilities().cuda;
  if (ordinal < 0 || ordinal >= cuda.device_count) {
    return unavailable("CUDA device {} does not exist ({} device(s): {})", ordinal, cuda.device_count, cuda.status);
  }
  const GpuDevice& info = cuda.devices[static_cast<std::size_t>(ordinal)];
  auto device = std::make_unique<CudaDevice>(
      ordinal, fmt::format("cuda:{} {} (sm_{}{})", ordinal, info.name, info.cc_major, info.cc_minor), info.numa_node);
  TZ_TRY_CTX(device->init(), "initialising cuda:{}", ordinal);
  return std::unique_ptr<Device>(std::move(device));
}

}  // namespace tz
