// SwapStore: striping, reuse, and every way its data can go bad caused for
// real: flipped bytes, truncated and overwritten swap files, failed writes,
// full disks.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>

#include <filesystem>
#include <thread>

#include "nvme_test_util.h"

namespace tzt {
namespace {

using tz::ErrorCode;
using tz::nvme::ExtentId;
using tz::nvme::SwapOptions;
using tz::nvme::SwapStore;

std::unique_ptr<SwapStore> make_store(SwapOptions o) {
  auto s = SwapStore::create(o);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? std::move(*s) : nullptr;
}

void flip_byte(const std::string& path, std::uint64_t offset) {
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  std::uint8_t byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(offset)), 1);
  byte ^= 0x01;
  ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(offset)), 1);
  ASSERT_EQ(::fsync(fd), 0);
  ::close(fd);
}

TEST(SwapStore, ExtentsRoundTripStripedOverTwoPaths) {
  TempDir a, b;
  auto store = make_store({.paths = {a.path(), b.path()}, .capacity_bytes = 64 << 20, .stripe_bytes = 1 << 20,
                           .engine = {.block_size_bytes = 256 << 10, .queue_depth = 8, .rings = 2}});
  ASSERT_TRUE(store);
  ASSERT_EQ(store->file_paths().size(), 2U);
  EXPECT_EQ(std::filesystem::path(store->file_paths()[0]).parent_path(), a.path());
  // Sizes: under a stripe, several stripes with a part-stripe tail, an odd size.
  for (std::size_t bytes : {std::size_t{4096}, std::size_t{5 << 20} + 12288, std::size_t{3 << 20} + 17}) {
    auto e = store->allocate(bytes);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    const std::size_t padded = store->padded_bytes(bytes);
    EXPECT_EQ(padded % 4096, 0U);
    AlignedBuffer out(padded), in(padded);
    out.fill_random(bytes);
    ASSERT_TRUE(store->write(*e, out.data()).wait().ok());
    ASSERT_TRUE(store->read(*e, in.data()).wait().ok());
    EXPECT_TRUE(in.same_as(out)) << bytes;
    auto where = store->placement(*e);
    ASSERT_TRUE(where.ok());
    if (bytes > (1 << 20)) {
      ASSERT_EQ(where->size(), 2U) << "an extent of several stripes uses both paths";
      EXPECT_NE((*where)[0].path, (*where)[1].path);
      EXPECT_EQ((*where)[0].bytes + (*where)[1].bytes, padded);
    }
  }
  const auto stats = store->stats();
  EXPECT_EQ(stats.extents, 3U);
  EXPECT_GT(stats.bytes_read, 0U);
  EXPECT_EQ(stats.bytes_read, stats.bytes_written);
}

TEST(SwapStore, FreedSpaceIsReusedAndCoalesced) {
  TempDir dir;
  auto store = make_store({.paths = {dir.path()}, .capacity_bytes = 8 << 20});
  ASSERT_TRUE(store);
  std::vector<ExtentId> ids;
  for (int i = 0; i < 8; ++i) {
    auto e = store->allocate(1 << 20);
    ASSERT_TRUE(e.ok()) << i << ": " << e.status().to_string();
    ids.push_back(*e);
  }
  auto full = store->allocate(4096);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), ErrorCode::kNoSpace);
  EXPECT_NE(full.status().message().find("nvme_bytes"), std::string::npos) << full.status().message();
  // Free two neighbours: a 2 MiB extent fits in the merged hole.
  ASSERT_TRUE(store->free(ids[3]).ok());
  ASSERT_TRUE(store->free(ids[4]).ok());
  auto big = store->allocate(2 << 20);
  ASSERT_TRUE(big.ok()) << big.status().to_string();
  EXPECT_EQ(store->stats().peak_used_bytes, 8U << 20);
  EXPECT_EQ(store->free(12345).code(), ErrorCode::kInvalidArgument);
}

TEST(SwapStore, AFlippedByteInTheSwapFileIsReportedNotReturned) {
  TempDir a, b;
  auto store = make_store({.paths = {a.path(), b.path()}, .capacity_bytes = 16 << 20, .stripe_bytes = 1 << 20});
  ASSERT_TRUE(store);
  const std::size_t bytes = 4 << 20;
  auto e = store->allocate(bytes);
  ASSERT_TRUE(e.ok());
  AlignedBuffer out(bytes), in(bytes);
  out.fill_random(21);
  ASSERT_TRUE(store->write(*e, out.data()).wait().ok());
  auto where = store->placement(*e);
  ASSERT_TRUE(where.ok());
  const auto& share = (*where)[1];  // the second path's share
  flip_byte(share.path, share.offset + share.bytes - 1000);
  const tz::Status s = store->read(*e, in.data()).wait();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kDataCorruption);
  EXPECT_NE(s.message().find("swap extent " + std::to_string(*e)), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(share.path), std::string::npos) << s.message();
  EXPECT_EQ(store->stats().corrupt_reads, 1U);
  // Rewriting the extent makes it good again.
  ASSERT_TRUE(store->write(*e, out.data()).wait().ok());
  ASSERT_TRUE(store->read(*e, in.data()).wait().ok());
  EXPECT_TRUE(in.same_as(out));
}

TEST(SwapStore, ATruncatedSwapFileIsAnErrorNamingTheFile) {
  TempDir dir;
  auto store = make_store({.paths = {dir.path()}, .capacity_bytes = 8 << 20});
  ASSERT_TRUE(store);
  auto first = store->allocate(2 << 20), second = store->allocate(2 << 20);
  ASSERT_TRUE(first.ok() && second.ok());
  AlignedBuffer out(2 << 20), in(2 << 20);
  out.fill_random(23);
  ASSERT_TRUE(store->write(*first, out.data()).wait().ok());
  ASSERT_TRUE(store->write(*second, out.data()).wait().ok());
  const std::string file = store->file_paths()[0];
  ASSERT_EQ(::truncate(file.c_str(), (2 << 20) + (1 << 19)), 0);  // cuts the second extent in half
  ASSERT_TRUE(store->read(*first, in.data()).wait().ok());
  const tz::Status s = store->read(*second, in.data()).wait();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find(file), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("end of file"), std::string::npos) << s.message();
}

TEST(SwapStore, StaleDataFromAnotherExtentFailsTheChecksum) {
  TempDir dir;
  auto store = make_store({.paths = {dir.path()}, .capacity_bytes = 8 << 20});
  ASSERT_TRUE(store);
  auto e = store->allocate(1 << 20);
  ASSERT_TRUE(e.ok());
  AlignedBuffer first(1 << 20), second(1 << 20), in(1 << 20);
  first.fill_random(1);
  second.fill_random(2);
  ASSERT_TRUE(store->write(*e, first.data()).wait().ok());
  // A lost write: the file goes back to older contents behind the store's back.
  std::vector<std::uint8_t> saved(1 << 20);
  const std::string file = store->file_paths()[0];
  const auto offset = static_cast<off_t>((*store->placement(*e))[0].offset);
  {
    const int fd = ::open(file.c_str(), O_RDONLY);
    ASSERT_EQ(::pread(fd, saved.data(), saved.size(), offset), static_cast<ssize_t>(saved.size()));
    ::close(fd);
  }
  ASSERT_TRUE(store->write(*e, second.data()).wait().ok());
  {
    const int fd = ::open(file.c_str(), O_WRONLY);
    ASSERT_EQ(::pwrite(fd, saved.data(), saved.size(), offset), static_cast<ssize_t>(saved.size()));
    ::fsync(fd);
    ::close(fd);
  }
  EXPECT_EQ(store->read(*e, in.data()).wait().code(), ErrorCode::kDataCorruption);
}

TEST(SwapStore, AFailedWriteLeavesAnExtentThatRefusesToBeRead) {
  for (int error : {EIO, ENOSPC}) {
    TempDir dir;
    std::atomic<bool> armed{false};
    SwapOptions o{.paths = {dir.path()}, .capacity_bytes = 8 << 20, .engine = {.block_size_bytes = 65536}};
    o.engine.fault_injector = [&](const tz::nvme::PieceInfo& p) {
      // Fails the third piece of the armed write, after two pieces landed.
      return armed.load() && p.offset % (1 << 20) == 2 * 65536 ? tz::nvme::Fault{.error = error} : tz::nvme::Fault{};
    };
    auto store = make_store(o);
    ASSERT_TRUE(store);
    auto e = store->allocate(1 << 20);
    ASSERT_TRUE(e.ok());
    AlignedBuffer good(1 << 20), newer(1 << 20), in(1 << 20);
    good.fill_random(3);
    newer.fill_random(4);
    ASSERT_TRUE(store->write(*e, good.data()).wait().ok());
    armed = true;
    const tz::Status w = store->write(*e, newer.data()).wait();
    armed = false;
    ASSERT_FALSE(w.ok());
    EXPECT_EQ(w.code(), error == ENOSPC ? ErrorCode::kNoSpace : ErrorCode::kIoError) << w.to_string();
    // Half old, half new on disk: the store must not hand either back.
    const tz::Status r = store->read(*e, in.data()).wait();
    EXPECT_EQ(r.code(), ErrorCode::kFailedPrecondition) << r.to_string();
    EXPECT_NE(r.message().find("last write failed"), std::string::npos) << r.message();
    EXPECT_EQ(store->stats().failed_writes, 1U);
    ASSERT_TRUE(store->write(*e, newer.data()).wait().ok());
    ASSERT_TRUE(store->read(*e, in.data()).wait().ok());
    EXPECT_TRUE(in.same_as(newer));
  }
}

TEST(SwapStore, ReadingANeverWrittenExtentOrOverlappingOperationsAreRefused) {
  TempDir dir;
  auto store = make_store({.paths = {dir.path()}, .capacity_bytes = 4 << 20});
  ASSERT_TRUE(store);
  auto e = store->allocate(1 << 20);
  ASSERT_TRUE(e.ok());
  AlignedBuffer buf(1 << 20);
  const tz::Status s = store->read(*e, buf.data()).wait();
  EXPECT_EQ(s.code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("never written"), std::string::npos) << s.message();
  EXPECT_EQ(store->read(999, buf.data()).wait().code(), ErrorCode::kInvalidArgument);
}

TEST(SwapStore, ACapacityBeyondTheDiskIsRefusedAtCreationAndLeavesNoFiles) {
  TempDir dir;
  auto caps = tz::probe_path(dir.path());
  ASSERT_TRUE(caps.ok());
  const std::uint64_t too_much = caps->free_bytes + (std::uint64_t{64} << 30);
  auto store = SwapStore::create({.paths = {dir.path()}, .capacity_bytes = too_much});
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), ErrorCode::kNoSpace) << store.status().to_string();
  EXPECT_NE(store.status().message().find(dir.path()), std::string::npos) << store.status().message();
  EXPECT_NE(store.status().message().find("free there"), std::string::npos) << store.status().message();
  EXPECT_NE(store.status().message().find(tz::format_bytes(too_much / 2 * 2)), std::string::npos)
      << "names the size asked: " << store.status().message();
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "the half-made swap file was removed";
}

TEST(SwapStore, SwapFilesAreRemovedWithTheStore) {
  TempDir a, b;
  std::vector<std::string> files;
  AlignedBuffer buf(1 << 20);  // outlives the store, which may still be writing it
  buf.fill_random(5);
  {
    auto store = make_store({.paths = {a.path(), b.path()}, .capacity_bytes = 4 << 20});
    ASSERT_TRUE(store);
    files = store->file_paths();
    for (const auto& f : files) EXPECT_TRUE(std::filesystem::exists(f)) << f;
    auto e = store->allocate(1 << 20);
    ASSERT_TRUE(e.ok());
    store->write(*e, buf.data(), [](const tz::Status&, const tz::nvme::IoResult&) {});
    // Destroyed with the write possibly in flight: it waits, then removes.
  }
  for (const auto& f : files) EXPECT_FALSE(std::filesystem::exists(f)) << f;
}

TEST(SwapStore, MissingPathsAndBadOptionsAreNamed) {
  auto s = SwapStore::create({.paths = {"/nonexistent-tierzero/swap"}, .capacity_bytes = 1 << 20});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("/nonexistent-tierzero/swap"), std::string::npos) << s.status().message();
  s = SwapStore::create({.paths = {}, .capacity_bytes = 1 << 20});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("nvme_path"), std::string::npos);
  TempDir dir;
  s = SwapStore::create({.paths = {dir.path()}, .capacity_bytes = 1 << 20, .stripe_bytes = 1000});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("stripe_bytes = 1000"), std::string::npos);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(SwapStore, ReadsOfOneExtentMayOverlapButAWriteMayNot) {
  TempDir dir;
  std::atomic<bool> hold{true};
  SwapOptions o{.paths = {dir.path()}, .capacity_bytes = 4 << 20,
                .engine = {.block_size_bytes = 65536, .queue_depth = 4, .backend = tz::nvme::IoBackend::kThreads}};
  o.engine.fault_injector = [&](const tz::nvme::PieceInfo& p) {
    while (p.op == tz::nvme::IoOp::kRead && hold.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return tz::nvme::Fault{};
  };
  auto store = make_store(o);
  ASSERT_TRUE(store);
  auto e = store->allocate(1 << 20);
  ASSERT_TRUE(e.ok());
  AlignedBuffer out(1 << 20), in1(1 << 20), in2(1 << 20);
  out.fill_random(8);
  hold = false;
  ASSERT_TRUE(store->write(*e, out.data()).wait().ok());
  hold = true;  // reads now wait in the engine until released
  auto r1 = store->read(*e, in1.data());
  auto r2 = store->read(*e, in2.data());
  EXPECT_EQ(store->write(*e, out.data()).wait().code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(store->free(*e).code(), ErrorCode::kFailedPrecondition);
  hold = false;
  ASSERT_TRUE(r1.wait().ok());
  ASSERT_TRUE(r2.wait().ok());
  EXPECT_TRUE(in1.same_as(out));
  EXPECT_TRUE(in2.same_as(out));
  EXPECT_TRUE(store->free(*e).ok());
}

TEST(SwapStore, AFullLoopMountedFileSystemIsReportedAtSizingAndOnTheFailingWrite) {
  TempDir dir;
  LoopMount fs(dir);
  if (!fs.mounted()) GTEST_SKIP() << fs.why_not();
  // Sizing: 64 MiB asked of a 16 MiB file system.
  auto store = SwapStore::create({.paths = {fs.path()}, .capacity_bytes = 64 << 20});
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), ErrorCode::kNoSpace) << store.status().to_string();
  EXPECT_NE(store.status().message().find(fs.path()), std::string::npos) << store.status().message();
  EXPECT_TRUE(std::filesystem::is_empty(fs.path()) ||
              std::filesystem::directory_iterator(fs.path())->path().filename() == "lost+found");
  // The failing write: an unreserved file written until the disk is full.
  auto engine = tz::nvme::IoEngine::create({.block_size_bytes = 1 << 20});
  ASSERT_TRUE(engine.ok());
  auto f = (*engine)->open(fs.path() + "/grow.bin", {.create = true});
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  AlignedBuffer buf(32 << 20);
  buf.fill_random(6);
  const tz::Status s = (*engine)->submit({.op = tz::nvme::IoOp::kWrite, .buffer = buf.data(),
                                          .segments = {{*f, 0, buf.size()}}}).wait();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kNoSpace) << s.to_string();
  EXPECT_NE(s.message().find(fs.path() + "/grow.bin"), std::string::npos) << s.message();
  EXPECT_TRUE((*engine)->close(*f).ok());
}

}  // namespace
}  // namespace tzt
