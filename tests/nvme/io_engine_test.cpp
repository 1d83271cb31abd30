// IoEngine: round trips on every backend, and each failure caused for real
// (injected errors and short transfers, files shorter than asked, misaligned
// requests, tmpfs and unwritable paths).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <latch>
#include <thread>

#include "nvme_test_util.h"

namespace tzt {
namespace {

using tz::ErrorCode;
using tz::nvme::EngineOptions;
using tz::nvme::FileId;
using tz::nvme::FileOptions;
using tz::nvme::IoBackend;
using tz::nvme::IoEngine;
using tz::nvme::IoOp;
using tz::nvme::IoRequest;

std::unique_ptr<IoEngine> make_engine(EngineOptions o) {
  auto e = IoEngine::create(o);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

FileId open_new(IoEngine& engine, const std::string& path, std::uint64_t size = 0) {
  auto f = engine.open(path, {.create = true, .size_bytes = size});
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  return f.ok() ? *f : FileId{};
}

IoRequest whole(IoOp op, void* buf, FileId f, std::size_t bytes, std::uint64_t offset = 0) {
  return {.op = op, .buffer = buf, .segments = {{f, offset, bytes}}};
}

class IoEngineBackends : public ::testing::TestWithParam<IoBackend> {};

TEST_P(IoEngineBackends, WritesAndReadsBackEveryByteAcrossRingsAndBlockSizes) {
  TempDir dir;
  for (const auto& [block, rings, depth] : {std::tuple{4096, 1, 1}, {65536, 2, 4}, {1 << 20, 3, 16}}) {
    auto engine = make_engine({.block_size_bytes = static_cast<std::size_t>(block), .queue_depth = depth,
                               .rings = rings, .backend = GetParam()});
    ASSERT_TRUE(engine);
    EXPECT_EQ(engine->backend(), GetParam());
    const std::size_t bytes = 5 * (std::size_t{1} << 20) + 3 * 4096;  // not a whole number of blocks
    const FileId f = open_new(*engine, dir.file("rt-" + std::to_string(block)), bytes);
    AlignedBuffer out(bytes), in(bytes);
    out.fill_random(block);
    ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, out.data(), f, bytes)).wait().ok());
    in.fill(0);
    ASSERT_TRUE(engine->submit(whole(IoOp::kRead, in.data(), f, bytes)).wait().ok());
    EXPECT_TRUE(in.same_as(out)) << "block " << block;
    const auto stats = engine->stats();
    EXPECT_EQ(stats.bytes_written, bytes);
    EXPECT_EQ(stats.bytes_read, bytes);
    EXPECT_EQ(stats.pieces, 2 * ((bytes + block - 1) / block));
    EXPECT_TRUE(engine->close(f).ok());
  }
}

TEST_P(IoEngineBackends, ARequestOverSeveralFilesStripesAndReassembles) {
  TempDir a, b;
  auto engine = make_engine({.block_size_bytes = 65536, .queue_depth = 8, .rings = 2, .backend = GetParam()});
  ASSERT_TRUE(engine);
  const FileId fa = open_new(*engine, a.file("s0"), 1 << 20), fb = open_new(*engine, b.file("s1"), 1 << 20);
  // Buffer order: fa[0, 64K), fb[0, 64K), fa[64K, 192K), fb[128K, 132K).
  IoRequest w{.op = IoOp::kWrite,
              .segments = {{fa, 0, 65536}, {fb, 0, 65536}, {fa, 65536, 131072}, {fb, 131072, 4096}}};
  const std::size_t bytes = 65536 * 4 + 4096;
  AlignedBuffer out(bytes), in(bytes), direct(131072);
  out.fill_random(7);
  w.buffer = out.data();
  ASSERT_TRUE(engine->submit(w).wait().ok());
  IoRequest r = w;
  r.op = IoOp::kRead;
  r.buffer = in.data();
  ASSERT_TRUE(engine->submit(r).wait().ok());
  EXPECT_TRUE(in.same_as(out));
  // The bytes landed where the segments said: fa[64K, 192K) holds buffer [128K, 256K).
  ASSERT_TRUE(engine->submit(whole(IoOp::kRead, direct.data(), fa, 131072, 65536)).wait().ok());
  EXPECT_EQ(std::memcmp(direct.data(), out.data() + 131072, 131072), 0);
}

TEST_P(IoEngineBackends, ShortTransfersAreResubmittedForTheRest) {
  TempDir dir;
  std::atomic<int> shortened{0};
  EngineOptions o{.block_size_bytes = 1 << 20, .queue_depth = 4, .backend = GetParam()};
  // Every first submission of a piece moves only 8 KiB; the rest must follow.
  o.fault_injector = [&](const tz::nvme::PieceInfo& p) {
    if (p.length > 8192 && p.offset % (1 << 20) == 0) {
      ++shortened;
      return tz::nvme::Fault{.short_bytes = 8192};
    }
    return tz::nvme::Fault{};
  };
  auto engine = make_engine(o);
  ASSERT_TRUE(engine);
  const std::size_t bytes = 4 << 20;
  const FileId f = open_new(*engine, dir.file("short"), bytes);
  AlignedBuffer out(bytes), in(bytes);
  out.fill_random(3);
  ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, out.data(), f, bytes)).wait().ok());
  ASSERT_TRUE(engine->submit(whole(IoOp::kRead, in.data(), f, bytes)).wait().ok());
  EXPECT_TRUE(in.same_as(out));
  EXPECT_EQ(shortened.load(), 8);
  EXPECT_EQ(engine->stats().short_transfers, 8U);
}

TEST_P(IoEngineBackends, EagainAndEintrAreRetried) {
  TempDir dir;
  EngineOptions o{.block_size_bytes = 65536, .queue_depth = 2, .backend = GetParam()};
  o.fault_injector = [](const tz::nvme::PieceInfo& p) {
    return p.sequence % 3 == 0 ? tz::nvme::Fault{.error = p.sequence % 2 == 0 ? EAGAIN : EINTR} : tz::nvme::Fault{};
  };
  auto engine = make_engine(o);
  ASSERT_TRUE(engine);
  const std::size_t bytes = 1 << 20;
  const FileId f = open_new(*engine, dir.file("retry"), bytes);
  AlignedBuffer out(bytes), in(bytes);
  out.fill_random(5);
  ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, out.data(), f, bytes)).wait().ok());
  ASSERT_TRUE(engine->submit(whole(IoOp::kRead, in.data(), f, bytes)).wait().ok());
  EXPECT_TRUE(in.same_as(out));
  EXPECT_GT(engine->stats().retries, 0U);
}

TEST_P(IoEngineBackends, EioOnTheNthOperationFailsTheRequestNamingFileOffsetAndErrno) {
  TempDir dir;
  EngineOptions o{.block_size_bytes = 65536, .queue_depth = 4, .backend = GetParam()};
  o.fault_injector = fail_nth(5, EIO);
  auto engine = make_engine(o);
  ASSERT_TRUE(engine);
  const std::size_t bytes = 1 << 20;
  const std::string path = dir.file("eio");
  const FileId f = open_new(*engine, path, bytes);
  AlignedBuffer out(bytes);
  out.fill_random(9);
  IoRequest w = whole(IoOp::kWrite, out.data(), f, bytes);
  w.label = "tensor 3";
  const tz::Status s = engine->submit(w).wait();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kIoError);
  EXPECT_EQ(s.sys_errno(), EIO);
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("tensor 3"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("offset"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("Input/output error"), std::string::npos) << s.message();
  EXPECT_EQ(engine->stats().errors, 1U);
  // The engine goes on: the next request works.
  ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, out.data(), f, bytes)).wait().ok());
}

TEST_P(IoEngineBackends, ReadingPastTheEndOfAShortFileIsAnErrorNotZeros) {
  TempDir dir;
  auto engine = make_engine({.block_size_bytes = 65536, .backend = GetParam()});
  ASSERT_TRUE(engine);
  const std::string path = dir.file("short-file");
  const FileId f = open_new(*engine, path, 65536);  // 64 KiB on disk
  AlignedBuffer in(262144);
  in.fill(0xAB);
  const tz::Status s = engine->submit(whole(IoOp::kRead, in.data(), f, 262144)).wait();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kIoError);
  EXPECT_NE(s.message().find("end of file"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
}

TEST_P(IoEngineBackends, CallbacksRunOnceAndMayCatchUpWithManySmallRequests) {
  TempDir dir;
  auto engine = make_engine({.block_size_bytes = 4096, .queue_depth = 8, .rings = 2, .backend = GetParam()});
  ASSERT_TRUE(engine);
  constexpr int kRequests = 256;
  const FileId f = open_new(*engine, dir.file("cb"), kRequests * 4096);
  AlignedBuffer out(kRequests * 4096);
  out.fill_random(11);
  std::latch done(kRequests);
  std::atomic<int> ok{0};
  for (int i = 0; i < kRequests; ++i) {
    engine->submit(whole(IoOp::kWrite, out.data() + i * 4096, f, 4096, static_cast<std::uint64_t>(i) * 4096),
                   [&](const tz::Status& s, const tz::nvme::IoResult& r) {
                     if (s.ok() && r.bytes == 4096) ++ok;
                     done.count_down();
                   });
  }
  done.wait();
  EXPECT_EQ(ok.load(), kRequests);
}

TEST_P(IoEngineBackends, ChecksumsAreComputedOnWriteAndCatchAFlippedByteOnRead) {
  TempDir dir;
  auto engine = make_engine({.block_size_bytes = 65536, .queue_depth = 4, .backend = GetParam()});
  ASSERT_TRUE(engine);
  const std::size_t bytes = 1 << 20;
  const std::string path = dir.file("sum");
  const FileId f = open_new(*engine, path, bytes);
  AlignedBuffer out(bytes), in(bytes);
  out.fill_random(13);
  IoRequest w = whole(IoOp::kWrite, out.data(), f, bytes);
  std::vector<std::uint64_t> sums(engine->piece_count(w));
  ASSERT_EQ(sums.size(), 16U);
  w.checksums = sums.data();
  ASSERT_TRUE(engine->submit(w).wait().ok());
  EXPECT_EQ(sums[3], tz::nvme::checksum(out.data() + 3 * 65536, 65536));
  IoRequest r = whole(IoOp::kRead, in.data(), f, bytes);
  r.checksums = sums.data();
  ASSERT_TRUE(engine->submit(r).wait().ok());
  // Flip one byte behind the engine's back, in piece 9.
  {
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    std::uint8_t byte = 0;
    ASSERT_EQ(::pread(fd, &byte, 1, 9 * 65536 + 100), 1);
    byte ^= 0x10;
    ASSERT_EQ(::pwrite(fd, &byte, 1, 9 * 65536 + 100), 1);
    ::fsync(fd);
    ::close(fd);
  }
  const tz::Status s = engine->submit(r).wait();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kDataCorruption);
  EXPECT_NE(s.message().find("offset 589824"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
}

std::string backend_test_name(const ::testing::TestParamInfo<IoBackend>& p) {
  return p.param == IoBackend::kUring ? "Uring" : "Threads";
}
INSTANTIATE_TEST_SUITE_P(, IoEngineBackends, ::testing::ValuesIn(runnable_backends()), backend_test_name);

TEST(IoEngine, IoUringRunsWhereTheProbeSaysItIsAvailable) {
  auto engine = make_engine({});
  ASSERT_TRUE(engine);
  EXPECT_EQ(engine->backend() == IoBackend::kUring, tz::capabilities().uring.available)
      << tz::capabilities().uring.unavailable_reason;
  std::printf("[ nvme ] %s\n", engine->describe().c_str());
}

TEST(IoEngine, RegisteredBuffersAreUsedForPiecesInsideThem) {
  if (!tz::capabilities().uring.available) GTEST_SKIP() << "io_uring unavailable: " << tz::capabilities().uring.unavailable_reason;
  TempDir dir;
  auto engine = make_engine({.block_size_bytes = 65536, .queue_depth = 4});
  ASSERT_TRUE(engine);
  const std::size_t bytes = 1 << 20;
  const FileId f = open_new(*engine, dir.file("fixed"), bytes);
  AlignedBuffer out(bytes), in(bytes);
  out.fill_random(17);
  ASSERT_TRUE(engine->register_buffer(out.data(), bytes).ok());
  ASSERT_TRUE(engine->register_buffer(in.data(), bytes).ok());
  ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, out.data(), f, bytes)).wait().ok());
  ASSERT_TRUE(engine->submit(whole(IoOp::kRead, in.data(), f, bytes)).wait().ok());
  EXPECT_TRUE(in.same_as(out));
  EXPECT_EQ(engine->stats().fixed_buffer_pieces, 32U);
  EXPECT_NE(engine->describe().find("fixed buffers"), std::string::npos) << engine->describe();
  ASSERT_TRUE(engine->unregister_buffer(in.data()).ok());
  in.fill(0);
  ASSERT_TRUE(engine->submit(whole(IoOp::kRead, in.data(), f, bytes)).wait().ok());
  EXPECT_TRUE(in.same_as(out));
  EXPECT_EQ(engine->stats().fixed_buffer_pieces, 32U);  // the unregistered buffer went the plain way
}

TEST(IoEngine, MisalignedRequestsAreRefusedBeforeAnyIo) {
  TempDir dir;
  auto engine = make_engine({});
  ASSERT_TRUE(engine);
  const FileId f = open_new(*engine, dir.file("align"), 1 << 20);
  AlignedBuffer buf(1 << 20);
  tz::Status s = engine->submit(whole(IoOp::kWrite, buf.data() + 1, f, 4096)).wait();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not aligned"), std::string::npos) << s.message();
  s = engine->submit(whole(IoOp::kWrite, buf.data(), f, 4096, 100)).wait();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("offset 100"), std::string::npos) << s.message();
  s = engine->submit(whole(IoOp::kWrite, buf.data(), f, 1000)).wait();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(engine->stats().pieces, 0U);
  s = engine->submit(IoRequest{.op = IoOp::kRead, .buffer = buf.data(), .segments = {{FileId{42}, 0, 4096}}}).wait();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not open"), std::string::npos) << s.message();
}

TEST(IoEngine, BadOptionsAreRefusedByName) {
  auto e = IoEngine::create({.block_size_bytes = 1000});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("block_size = 1000"), std::string::npos);
  e = IoEngine::create({.queue_depth = 0});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("queue_depth = 0"), std::string::npos);
  e = IoEngine::create({.rings = 100});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("intra_op_parallelism"), std::string::npos);
}

TEST(IoEngine, OptionsFollowTheAioConfigBlock) {
  auto config = tz::parse_config(R"({"aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2,
                                             "single_submit": true}})");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  const EngineOptions o = EngineOptions::from_config(config->aio);
  EXPECT_EQ(o.block_size_bytes, 262144U);
  EXPECT_EQ(o.queue_depth, 16);
  EXPECT_EQ(o.rings, 2);
  EXPECT_TRUE(o.single_submit);
}

TEST(IoEngine, ATmpfsPathIsRefusedUnlessBufferedIoIsAllowed) {
  if (::access("/dev/shm", W_OK) != 0) GTEST_SKIP() << "no writable /dev/shm";
  TempDir dir("/dev/shm");
  auto engine = make_engine({});
  ASSERT_TRUE(engine);
  auto f = engine->open(dir.file("x"), {.create = true, .size_bytes = 65536});
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find(dir.file("x")), std::string::npos) << f.status().message();
  EXPECT_NE(f.status().message().find("allow_buffered_io"), std::string::npos) << f.status().message();
  EXPECT_FALSE(std::filesystem::exists(dir.file("x"))) << "a refused open leaves no file";
  f = engine->open(dir.file("x"), {.create = true, .size_bytes = 65536, .allow_buffered = true});
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_FALSE(engine->file_info(*f)->direct);
  AlignedBuffer out(65536), in(65536);
  out.fill_random(19);
  ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, out.data(), *f, 65536)).wait().ok());
  ASSERT_TRUE(engine->submit(whole(IoOp::kRead, in.data(), *f, 65536)).wait().ok());
  EXPECT_TRUE(in.same_as(out));
}

TEST(IoEngine, AnUnwritableOrMissingPathIsNamed) {
  auto engine = make_engine({});
  ASSERT_TRUE(engine);
  auto f = engine->open("/nonexistent-tierzero-dir/x.bin", {.create = true});
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("/nonexistent-tierzero-dir"), std::string::npos) << f.status().message();
  TempDir dir;
  const std::string ro = dir.file("ro");
  ASSERT_EQ(::mkdir(ro.c_str(), 0555), 0);
  if (::geteuid() == 0) {
    // root ignores directory permissions; a read-only file opened for reading
    // still refuses writes through the engine.
    const std::string path = dir.file("ro.bin");
    { auto w = engine->open(path, {.create = true, .size_bytes = 4096}); ASSERT_TRUE(w.ok()); ASSERT_TRUE(engine->close(*w).ok()); }
    auto r = engine->open(path, {.writable = false});
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    AlignedBuffer buf(4096);
    const tz::Status s = engine->submit(whole(IoOp::kWrite, buf.data(), *r, 4096)).wait();
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(s.message().find("read-only"), std::string::npos) << s.message();
  } else {
    f = engine->open(ro + "/x.bin", {.create = true});
    ASSERT_FALSE(f.ok());
    EXPECT_NE(f.status().message().find(ro), std::string::npos) << f.status().message();
  }
}

TEST(IoEngine, ClosingAFileWithRequestsInFlightIsRefused) {
  TempDir dir;
  std::atomic<bool> release{false};
  EngineOptions o{.block_size_bytes = 4096, .queue_depth = 1, .backend = IoBackend::kThreads};
  o.fault_injector = [&](const tz::nvme::PieceInfo&) {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return tz::nvme::Fault{};
  };
  auto engine = make_engine(o);
  ASSERT_TRUE(engine);
  const FileId f = open_new(*engine, dir.file("busy"), 4096);
  AlignedBuffer buf(4096);
  auto future = engine->submit(whole(IoOp::kWrite, buf.data(), f, 4096));
  const tz::Status s = engine->close(f);
  EXPECT_EQ(s.code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(future.wait_for(std::chrono::milliseconds(1)).code(), ErrorCode::kTimeout);
  release = true;
  EXPECT_TRUE(future.wait().ok());
  EXPECT_TRUE(engine->close(f).ok());
}

}  // namespace
}  // namespace tzt
