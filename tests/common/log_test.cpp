#include "tierzero/common/log.h"

#include <gtest/gtest.h>

namespace tz::log {
namespace {

TEST(Log, ParsesLevels) {
  Level level;
  ASSERT_TRUE(parse_level("DEBUG", &level));
  EXPECT_EQ(level, Level::kDebug);
  ASSERT_TRUE(parse_level("warning", &level));
  EXPECT_EQ(level, Level::kWarn);
  EXPECT_FALSE(parse_level("loud", &level));
}

TEST(Log, PerSubsystemLevels) {
  ASSERT_TRUE(configure("warn,nvme=trace"));
  EXPECT_TRUE(enabled("nvme", Level::kTrace));
  EXPECT_FALSE(enabled("offload", Level::kInfo));
  EXPECT_TRUE(enabled("offload", Level::kError));
  EXPECT_FALSE(configure("nvme=shout"));          // rejected, nothing changed
  EXPECT_TRUE(enabled("nvme", Level::kTrace));
  ASSERT_TRUE(configure("info"));
}

TEST(Log, WritesTaggedLinesToStderrNotStdout) {
  ASSERT_TRUE(configure("info"));
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  TZ_LOG_INFO("offload", "pool of {} bytes", 4096);
  TZ_LOG_DEBUG("offload", "hidden at info");
  std::string err = testing::internal::GetCapturedStderr();
  std::string out = testing::internal::GetCapturedStdout();
  EXPECT_EQ(out, "");
  EXPECT_NE(err.find("[tierzero:offload] [info] pool of 4096 bytes"), std::string::npos) << err;
  EXPECT_EQ(err.find("hidden at info"), std::string::npos) << err;
}

TEST(Log, OnceMacroLogsOncePerSite) {
  ASSERT_TRUE(configure("info"));
  testing::internal::CaptureStderr();
  for (int i = 0; i < 3; ++i) TZ_LOG_ONCE_WARN("nvme", "falling back, try {}", i);
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("falling back, try 0"), std::string::npos) << err;
  EXPECT_EQ(err.find("try 1"), std::string::npos) << err;
}

}  // namespace
}  // namespace tz::log
