// Collectives on small host arrays (the gradient norm, the trace check),
// whatever memory the communicator works on: Gloo takes host memory as it
// is; NCCL needs a round trip through device memory.
#pragma once

#include "tierzero/engine/comm.h"
#include "tierzero/offload.h"

namespace tz::detail {

inline Status all_reduce_host(Communicator& comm, Device& device, MemoryPool& device_pool, void* data,
                              std::size_t count, DataType type, ReduceOp op) {
  if (comm.size() == 1) return ok_status();
  if (device.kind() == BackendKind::kHost) return comm.all_reduce(data, count, type, op);
  const std::size_t bytes = count * data_type_bytes(type);
  TZ_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.create_stream());
  TZ_ASSIGN_OR_RETURN(PoolBlock d, device_pool.allocate(bytes));
  TZ_TRY(device.copy_async(d.data(), data, bytes, *stream));
  TZ_TRY(comm.all_reduce(d.data(), count, type, op, stream.get()));
  TZ_TRY(device.copy_async(data, d.data(), bytes, *stream));
  return device.synchronize_stream(*stream);
}

}  // namespace tz::detail
