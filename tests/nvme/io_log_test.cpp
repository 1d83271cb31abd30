// Note [I/O logs]: what the engine records and the fio version 2 logs it writes and reads.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "nvme_test_util.h"
#include "tierzero/nvme.h"

namespace tzt {
namespace {

using tz::ErrorCode;
using tz::nvme::IoEngine;
using tz::nvme::IoLogEntry;
using tz::nvme::IoOp;

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(IoLog, TheEngineRecordsEachSegmentInSubmissionOrderWhileOn) {
  TempDir dir;
  auto engine = IoEngine::create({.block_size_bytes = 1 << 16, .queue_depth = 4});
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  const std::string a = dir.file("a"), b = dir.file("b");
  auto fa = (*engine)->open(a, {.create = true, .size_bytes = 1 << 20});
  auto fb = (*engine)->open(b, {.create = true, .size_bytes = 1 << 20});
  ASSERT_TRUE(fa.ok() && fb.ok());
  AlignedBuffer buf(1 << 18);
  buf.fill_random(3);
  auto write = [&](std::uint64_t offset) {
    return (*engine)->submit({.op = IoOp::kWrite, .buffer = buf.data(),
                              .segments = {{*fa, offset, 1 << 17}, {*fb, offset, 1 << 17}}}).wait();
  };
  ASSERT_TRUE(write(0).ok());  // not recorded: the log is off
  (*engine)->record_log(true);
  ASSERT_TRUE(write(1 << 17).ok());
  ASSERT_TRUE((*engine)->submit({.op = IoOp::kRead, .buffer = buf.data(), .segments = {{*fb, 4096, 8192}}}).wait().ok());
  // A request refused before any I/O (misaligned) is not part of the pattern.
  EXPECT_FALSE((*engine)->submit({.op = IoOp::kRead, .buffer = buf.data(), .segments = {{*fb, 1, 8192}}}).wait().ok());
  (*engine)->record_log(false);
  ASSERT_TRUE(write(0).ok());  // off again
  const std::vector<IoLogEntry> log = (*engine)->take_log();
  ASSERT_EQ(log.size(), 3U);
  EXPECT_EQ(log[0].op, IoOp::kWrite);
  EXPECT_EQ(log[0].path, a);
  EXPECT_EQ(log[0].offset, 1U << 17);
  EXPECT_EQ(log[0].length, 1U << 17);
  EXPECT_EQ(log[1].path, b);
  EXPECT_EQ(log[2].op, IoOp::kRead);
  EXPECT_EQ(log[2].offset, 4096U);
  EXPECT_EQ(log[2].length, 8192U);
  EXPECT_TRUE((*engine)->take_log().empty()) << "taken once";
  (*engine)->record_log(true);  // turning it on starts afresh
  (*engine)->record_log(false);
  EXPECT_TRUE((*engine)->take_log().empty());
}

TEST(IoLog, AWrittenLogReadsBackAsItWasAndInFiosFormat) {
  TempDir dir;
  const std::vector<IoLogEntry> entries = {{IoOp::kRead, "/data/swap file-0.bin", 0, 4096},
                                           {IoOp::kWrite, "/data/other.bin", 1 << 20, 3 << 20},
                                           {IoOp::kRead, "/data/swap file-0.bin", 8192, 4096}};
  const std::string path = dir.file("step.iolog");
  ASSERT_TRUE(tz::nvme::write_fio_iolog(path, entries).ok());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  const std::string text = slurp(path);
  EXPECT_EQ(text.rfind("fio version 2 iolog\n", 0), 0U) << text;
  EXPECT_NE(text.find("/data/other.bin add\n"), std::string::npos) << text;
  EXPECT_NE(text.find("/data/other.bin open\n"), std::string::npos) << text;
  EXPECT_NE(text.find("/data/other.bin write 1048576 3145728\n"), std::string::npos) << text;
  EXPECT_NE(text.find("/data/swap file-0.bin close\n"), std::string::npos) << text;
  auto back = tz::nvme::read_fio_iolog(path);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  ASSERT_EQ(back->size(), entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    EXPECT_EQ((*back)[i].op, entries[i].op) << i;
    EXPECT_EQ((*back)[i].path, entries[i].path) << i;
    EXPECT_EQ((*back)[i].offset, entries[i].offset) << i;
    EXPECT_EQ((*back)[i].length, entries[i].length) << i;
  }
}

TEST(IoLog, ABadLogIsRefusedNamingTheFileAndLine) {
  TempDir dir;
  auto refused = [&](const std::string& text) {
    const std::string path = dir.file("bad.iolog");
    std::ofstream(path) << text;
    auto got = tz::nvme::read_fio_iolog(path);
    EXPECT_FALSE(got.ok()) << text;
    return got.ok() ? std::string() : got.status().message();
  };
  EXPECT_NE(refused("fio version 3 iolog\n/f read 0 4096\n").find("line 1"), std::string::npos);
  EXPECT_NE(refused("fio version 2 iolog\n/f add\n/f jump 0 4096\n").find("line 3"), std::string::npos);
  EXPECT_NE(refused("fio version 2 iolog\n/f trim 0 4096\n").find("only reads and writes"), std::string::npos);
  EXPECT_NE(refused("fio version 2 iolog\n/f read 0 0\n").find("above 0"), std::string::npos);
  EXPECT_NE(refused("fio version 2 iolog\n/f read -1 4096\n").find("whole numbers"), std::string::npos);
  EXPECT_NE(refused("fio version 2 iolog\n/f add\n/f open\n/f close\n").find("no reads or writes"), std::string::npos);
  auto missing = tz::nvme::read_fio_iolog(dir.file("none.iolog"));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("none.iolog"), std::string::npos);
}

}  // namespace
}  // namespace tzt
