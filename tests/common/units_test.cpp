#include "tierzero/common/units.h"

#include <gtest/gtest.h>

namespace tz {
namespace {

TEST(Units, ParsesSiAndIecSizes) {
  EXPECT_EQ(*parse_bytes("80GB"), 80'000'000'000ULL);
  EXPECT_EQ(*parse_bytes("80 GiB"), 80ULL << 30);
  EXPECT_EQ(*parse_bytes("2TB"), 2'000'000'000'000ULL);
  EXPECT_EQ(*parse_bytes("1.5e9"), 1'500'000'000ULL);
  EXPECT_EQ(*parse_bytes("4096"), 4096ULL);
  EXPECT_EQ(*parse_bytes("512mib"), 512ULL << 20);
  EXPECT_EQ(*parse_bytes("1.5KiB"), 1536ULL);
}

TEST(Units, RejectsGarbageWithTheText) {
  Expected<std::uint64_t> r = parse_bytes("eighty gigs");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("eighty gigs"), std::string::npos);
  r = parse_bytes("80 GX");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("gx"), std::string::npos) << r.status().message();
  EXPECT_FALSE(parse_bytes("-1GB").ok());
  EXPECT_FALSE(parse_bytes("1e30").ok());
}

TEST(Units, ParsesCounts) {
  EXPECT_DOUBLE_EQ(*parse_count("20e9"), 20e9);
  EXPECT_DOUBLE_EQ(*parse_count("1.3B"), 1.3e9);
  EXPECT_DOUBLE_EQ(*parse_count("350M"), 350e6);
  EXPECT_FALSE(parse_count("12Q").ok());
}

TEST(Units, FormatsBytes) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(4096), "4.00 KiB");
  EXPECT_EQ(format_bytes(3ULL << 29), "1.50 GiB");
  EXPECT_EQ(format_count(20e9), "20.0B");
}

TEST(Units, AlignUp) {
  EXPECT_EQ(align_up(1, 4096), 4096u);
  EXPECT_EQ(align_up(4096, 4096), 4096u);
  EXPECT_EQ(align_up(0, 512), 0u);
}

}  // namespace
}  // namespace tz
