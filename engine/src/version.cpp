#include "tierzero/engine.h"

#include "tierzero/kernels.h"

namespace tz {

std::string version() { return TIERZERO_VERSION; }

std::string build_summary() {
  return fmt::format("tierzero {} ({}, CUDA {}{}, {})", TIERZERO_VERSION, TIERZERO_BUILD_TYPE,
                     kernels::cuda_kernels_built() ? "on" : "off",
                     kernels::cuda_kernels_built() ? fmt::format(" sm_{}", TIERZERO_CUDA_ARCHS) : "",
                     TIERZERO_SANITIZED ? "ASan+UBSan" : "no sanitizers");
}

}  // namespace tz
