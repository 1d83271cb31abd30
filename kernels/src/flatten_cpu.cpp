// Flatten / unflatten CPU twins (tierzero/kernels.h), and the CUDA entry
// points of builds without CUDA.
#include <cstring>

#include "tierzero/kernels.h"

namespace tz::kernels {

void flatten_cpu(const Slice* slices, std::size_t count, void* flat) {
  for (std::size_t i = 0; i < count; ++i) {
    char* at = static_cast<char*>(flat) + slices[i].offset;
    if (slices[i].bytes == 0) continue;
    if (slices[i].tensor == nullptr) {
      std::memset(at, 0, slices[i].bytes);
    } else {
      std::memcpy(at, slices[i].tensor, slices[i].bytes);
    }
  }
}

void unflatten_cpu(const void* flat, const Slice* slices, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i) {
    if (slices[i].bytes > 0 && slices[i].tensor != nullptr) {
      std::memcpy(slices[i].tensor, static_cast<const char*>(flat) + slices[i].offset, slices[i].bytes);
    }
  }
}

#if !defined(TIERZERO_WITH_CUDA)
Status flatten_cuda(const Slice*, std::size_t, void*, void*) {
  return unavailable("flatten_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
Status unflatten_cuda(const void*, const Slice*, std::size_t, void*) {
  return unavailable("unflatten_cuda: built without CUDA (-DTIERZERO_CUDA=OFF)");
}
#endif

}  // namespace tz::kernels
