// TZ_CUDA_CHECK turns a cudaError_t into a Status naming the call and the
// error. cudaGetErrorString needs no GPU, so this runs in CI too.
#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include "tierzero/common/checks.h"

namespace tz {
namespace {

Status fails_with(cudaError_t err) {
  TZ_CUDA_CHECK(err);
  return ok_status();
}

TEST(CudaCheck, NamesTheCallAndTheError) {
  EXPECT_TRUE(fails_with(cudaSuccess).ok());
  Status oom = fails_with(cudaErrorMemoryAllocation);
  EXPECT_EQ(oom.code(), ErrorCode::kOutOfMemory);
  EXPECT_NE(oom.message().find("cudaErrorMemoryAllocation"), std::string::npos) << oom.message();
  EXPECT_EQ(oom.message().rfind("err: ", 0), 0u) << "names the call (the macro's argument): " << oom.message();
  Status no_device = fails_with(cudaErrorNoDevice);
  EXPECT_EQ(no_device.code(), ErrorCode::kUnavailable);
}

}  // namespace
}  // namespace tz
