#include "tierzero/common/state_format.h"

#include <gtest/gtest.h>

namespace tz {
namespace {

TEST(StateFormat, NamesAreTheConfigsSpellings) {
  EXPECT_EQ(master_format_name(MasterFormat::kFp32), "fp32");
  EXPECT_EQ(master_format_name(MasterFormat::kRemainder), "remainder");
  EXPECT_EQ(moment_format_name(MomentFormat::kFp32), "fp32");
  EXPECT_EQ(moment_format_name(MomentFormat::kBf16), "bf16");
  EXPECT_EQ(moment_format_name(MomentFormat::kInt8), "int8");
  EXPECT_TRUE(StateFormats{}.is_default());
  EXPECT_FALSE((StateFormats{MasterFormat::kFp32, MomentFormat::kBf16}.is_default()));
}

TEST(StateFormat, BytesPerElementOfEachFormat) {
  EXPECT_EQ(master_bytes_per_elem(MasterFormat::kFp32), 4.0);
  EXPECT_EQ(master_bytes_per_elem(MasterFormat::kRemainder), 2.125);  // int16 + one tie bit
  EXPECT_EQ(moments_bytes_per_elem(MomentFormat::kFp32), 8.0);
  EXPECT_EQ(moments_bytes_per_elem(MomentFormat::kBf16), 4.0);
  EXPECT_EQ(kInt8MomentBlockNumel, 256u);
  EXPECT_EQ(moments_bytes_per_elem(MomentFormat::kInt8), 2.03125);  // 2 x (1 + 4 / 256)
}

TEST(StateFormat, ShardBytesAreExactForWholeBlocksAndRoundUpOtherwise) {
  // A shard is a whole number of 2048 elements (the planner's alignment):
  // whole tie-bit bytes and whole scale blocks, so bytes = numel x bytes/elem.
  constexpr std::uint64_t n = 2048 * 1000;
  EXPECT_EQ(master_bytes(MasterFormat::kFp32, n), 4 * n);
  EXPECT_EQ(master_bytes(MasterFormat::kRemainder, n), 2 * n + n / 8);
  EXPECT_EQ(moments_bytes(MomentFormat::kFp32, n), 8 * n);
  EXPECT_EQ(moments_bytes(MomentFormat::kBf16, n), 4 * n);
  EXPECT_EQ(moments_bytes(MomentFormat::kInt8, n), 2 * n + 2 * 4 * (n / 256));
  for (std::uint64_t k : {n, std::uint64_t{2048}}) {
    EXPECT_EQ(static_cast<double>(master_bytes(MasterFormat::kRemainder, k)),
              master_bytes_per_elem(MasterFormat::kRemainder) * static_cast<double>(k));
    EXPECT_EQ(static_cast<double>(moments_bytes(MomentFormat::kInt8, k)),
              moments_bytes_per_elem(MomentFormat::kInt8) * static_cast<double>(k));
  }
  // A partial byte of tie bits, a partial block of codes: each rounds up.
  EXPECT_EQ(master_bytes(MasterFormat::kRemainder, 1), 3u);
  EXPECT_EQ(master_bytes(MasterFormat::kRemainder, 9), 18u + 2u);
  EXPECT_EQ(moments_bytes(MomentFormat::kInt8, 1), 2u * (1 + 4));
  EXPECT_EQ(moments_bytes(MomentFormat::kInt8, 257), 2u * (257 + 2 * 4));
  EXPECT_EQ(master_bytes(MasterFormat::kRemainder, 0), 0u);
  EXPECT_EQ(moments_bytes(MomentFormat::kInt8, 0), 0u);
}

}  // namespace
}  // namespace tz
