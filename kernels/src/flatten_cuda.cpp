// Status wrappers around the flatten launcher (see cuda_launch.h for why).
#include <cuda_runtime.h>

#include <vector>

#include "cuda_launch.h"
#include "tierzero/common/checks.h"
#include "tierzero/kernels.h"

namespace tz::kernels {
namespace {

Status copy(const char* what, const Slice* slices, std::size_t count, void* flat, bool into_flat, void* stream) {
  std::vector<launch::Copy> copies;
  copies.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    char* at = static_cast<char*>(flat) + slices[i].offset;
    if (!into_flat && slices[i].tensor == nullptr) continue;  // a gap: nothing to unflatten
    copies.push_back(into_flat ? launch::Copy{at, slices[i].tensor, slices[i].bytes}
                               : launch::Copy{slices[i].tensor, at, slices[i].bytes});
  }
  if (cudaError_t err = launch::copy_slices(copies.data(), copies.size(), static_cast<cudaStream_t>(stream)); err != cudaSuccess) {
    (void)cudaGetLastError();  // the launch error is returned, not left for the next call
    return ::tz::detail::cuda_error(err, what, std::source_location::current());
  }
  return ok_status();
}

}  // namespace

Status flatten_cuda(const Slice* slices, std::size_t count, void* d_flat, void* cuda_stream) {
  return copy("flatten_cuda", slices, count, d_flat, true, cuda_stream);
}

Status unflatten_cuda(const void* d_flat, const Slice* slices, std::size_t count, void* cuda_stream) {
  return copy("unflatten_cuda", slices, count, const_cast<void*>(d_flat), false, cuda_stream);
}

}  // namespace tz::kernels
