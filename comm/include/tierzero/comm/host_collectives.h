// Collectives on small host arrays (the gradient norm, the trace check),
// whatever memory the communicator works on: Gloo takes host memory as it
// is; NCCL needs a round trip through device memory.
#pragma once

#include "tierzero/comm/communicator.h"
#include "tierzero/offload.h"

namespace tz::detail {

// Runs collective(buffer, stream) over `bytes` of host data: on the data
// itself where the device is the Host backend, else on a device copy.
template <typename Collective>
Status through_device(Device& device, MemoryPool& device_pool, void* data, std::size_t bytes, Collective&& collective) {
  if (device.kind() == BackendKind::kHost) return collective(data, nullptr);
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.create_stream());
  TZ_ASSIGN_OR_RETURN(PoolBlock d, device_pool.allocate(bytes));
  TZ_TRY(device.copy_async(d.data(), data, bytes, *stream));
  TZ_TRY(collective(d.data(), stream.get()));
  TZ_TRY(device.copy_async(data, d.data(), bytes, *stream));
  return device.synchronize_stream(*stream);
}

inline Status all_reduce_host(Communicator& comm, Device& device, MemoryPool& device_pool, void* data,
                              std::size_t count, DType type, ReduceOp op) {
  if (comm.size() == 1) return ok_status();
  return through_device(device, device_pool, data, count * dtype_bytes(type), [&](void* buf, Stream* stream) {
    return comm.all_reduce(buf, count, type, op, stream);
  });
}

inline Status broadcast_host(Communicator& comm, Device& device, MemoryPool& device_pool, void* data,
                             std::size_t bytes, int root) {
  if (comm.size() == 1) return ok_status();
  return through_device(device, device_pool, data, bytes,
                        [&](void* buf, Stream* stream) { return comm.broadcast(buf, bytes, root, stream); });
}

}  // namespace tz::detail
