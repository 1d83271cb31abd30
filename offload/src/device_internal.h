// Private to offload/: pieces the backends share.
#pragma once

#include <cstddef>
#include <memory>

#include "tierzero/common.h"

namespace tz {

class Device;

// mlock with an error that says what to change when RLIMIT_MEMLOCK is the cause.
Status lock_host_pages(void* h_ptr, std::size_t bytes);
Status unlock_host_pages(void* h_ptr, std::size_t bytes);
// The text appended to memlock failures: the limit and the settings that help.
std::string memlock_advice(std::size_t requested_bytes);

#if defined(TIERZERO_WITH_CUDA)
Expected<std::unique_ptr<Device>> create_cuda_device(int ordinal);
#endif

}  // namespace tz
