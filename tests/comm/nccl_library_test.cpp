// NCCL loads on first use (Note [CUDA libraries load on first use] in
// common/src/shared_library.cpp): a process that made no NCCL communicator
// has not mapped libnccl; load_nccl() maps it and the entry points forward to
// it. Built with NCCL only; no GPU is needed to load NCCL or ask its version.
#include <nccl.h>

#include <gtest/gtest.h>

#include <set>
#include <string>

#include "../../comm/src/internal.h"
#include "tierzero/testing/maps.h"

namespace tz {
namespace {

TEST(NcclLibrary, IsMappedOnlyOnceLoaded) {
  ASSERT_EQ(test::mapped_cuda_libraries(), std::set<std::string>{});
  const Status loaded = comm_detail::load_nccl();
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();
  const std::set<std::string> mapped = test::mapped_cuda_libraries();
  ASSERT_EQ(mapped.size(), 1U);
  EXPECT_NE(mapped.begin()->find("libnccl.so"), std::string::npos) << *mapped.begin();
  int version = 0;
  ASSERT_EQ(ncclGetVersion(&version), ncclSuccess);
  EXPECT_EQ(version / 10000, NCCL_MAJOR) << version;  // the soname's major is the header's
  EXPECT_STREQ(ncclGetErrorString(ncclSuccess), "no error");
  EXPECT_TRUE(comm_detail::load_nccl().ok());  // once: the same result again
}

}  // namespace
}  // namespace tz
