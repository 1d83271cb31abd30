// FaultyDevice: a Device that forwards every call to another and fails the
// operations a test switches on, to cause the faults a real GPU gives
// rarely (a record or a wait that the driver refuses).
#pragma once

#include <atomic>
#include <memory>

#include "tierzero/offload.h"

namespace tz {

class FaultyDevice final : public Device {
 public:
  explicit FaultyDevice(std::unique_ptr<Device> inner) : inner_(std::move(inner)) {}

  std::atomic<bool> fail_record_event{false};  // "injected record_event failure"
  std::atomic<bool> fail_stream_wait{false};   // stream_wait_event and stream_wait_native: "injected stream wait failure"

  BackendKind kind() const override { return inner_->kind(); }
  std::string name() const override { return inner_->name(); }
  int numa_node() const override { return inner_->numa_node(); }
  Expected<DeviceMemoryInfo> memory_info() override { return inner_->memory_info(); }
  Expected<std::unique_ptr<Stream>> create_stream() override { return inner_->create_stream(); }
  Expected<std::unique_ptr<Event>> create_event() override { return inner_->create_event(); }
  Expected<void*> allocate(std::size_t b, Stream* s) override { return inner_->allocate(b, s); }
  Status deallocate(void* p, std::size_t b, Stream* s) override { return inner_->deallocate(p, b, s); }
  Status pin(void* p, std::size_t b) override { return inner_->pin(p, b); }
  Status unpin(void* p, std::size_t b) override { return inner_->unpin(p, b); }
  Status copy_async(void* d, const void* s, std::size_t b, Stream& st) override { return inner_->copy_async(d, s, b, st); }
  Status memset_async(void* d, int v, std::size_t b, Stream& st) override { return inner_->memset_async(d, v, b, st); }
  Status launch_host_func(Stream& st, std::function<void()> fn) override {
    return inner_->launch_host_func(st, std::move(fn));
  }
  Status record_event(Event& e, Stream& st) override {
    return fail_record_event ? internal_error("injected record_event failure") : inner_->record_event(e, st);
  }
  Status stream_wait_event(Stream& st, Event& e) override {
    return fail_stream_wait ? internal_error("injected stream wait failure") : inner_->stream_wait_event(st, e);
  }
  Status stream_wait_native(Stream& st, void* n) override {
    return fail_stream_wait ? internal_error("injected stream wait failure") : inner_->stream_wait_native(st, n);
  }
  Expected<bool> event_done(Event& e) override { return inner_->event_done(e); }
  Status synchronize_event(Event& e) override { return inner_->synchronize_event(e); }
  Status synchronize_stream(Stream& st) override { return inner_->synchronize_stream(st); }

 private:
  std::unique_ptr<Device> inner_;
};

}  // namespace tz
