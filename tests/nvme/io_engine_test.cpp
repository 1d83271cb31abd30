// IoEngine: round trips on every backend, and each failure caused for real
// (injected errors, short and zero-byte transfers, files shorter than asked,
// corrupted checksums, misaligned requests, tmpfs and unwritable paths);
// registered buffers split over slots; every XXH3 build against the scalar one.
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <latch>
#include <chrono>
#include <thread>

#include "nvme_test_util.h"

#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_SCALAR
#include <xxhash.h>  // the reference the engine's builds are compared with

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

// Note [Busy time]: each direction's clock runs while at least one of its
// requests is in flight, once however many overlap, and not in the gaps.
TEST_P(IoEngineBackends, BusyTimeIsTheUnionOfEachDirectionsRequestsInFlight) {
  TempDir dir;
  auto engine = make_engine({.block_size_bytes = 1 << 20, .queue_depth = 8, .rings = 2, .backend = GetParam()});
  ASSERT_TRUE(engine);
  const std::size_t bytes = 8 << 20;
  const FileId f = open_new(*engine, dir.file("busy"), 4 * bytes);
  AlignedBuffer out(4 * bytes), in(4 * bytes);
  out.fill_random(7);
  ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, out.data(), f, 4 * bytes)).wait().ok());
  const auto written = engine->stats();
  EXPECT_GT(written.write_busy_ns, 0U);
  EXPECT_EQ(written.read_busy_ns, 0U) << "no read ran";
  using Clock = std::chrono::steady_clock;
  const auto begin = Clock::now();
  std::vector<tz::nvme::IoFuture> reads;
  for (int i = 0; i < 4; ++i) {  // four at once: their overlap counts once
    reads.push_back(engine->submit(whole(IoOp::kRead, in.data() + i * bytes, f, bytes, i * bytes)));
  }
  for (auto& r : reads) ASSERT_TRUE(r.wait().ok());
  const double overlapped_ns = std::chrono::duration<double, std::nano>(Clock::now() - begin).count();
  const auto after_overlap = engine->stats();
  // The union of four requests in flight together is at most the time they
  // took together (their latencies summed would be up to four times it).
  EXPECT_LE(static_cast<double>(after_overlap.read_busy_ns), overlapped_ns);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a gap, not counted
  ASSERT_TRUE(engine->submit(whole(IoOp::kRead, in.data(), f, bytes)).wait().ok());
  const double wall_ns = std::chrono::duration<double, std::nano>(Clock::now() - begin).count();
  const auto read = engine->stats();
  EXPECT_GT(read.read_busy_ns, 0U);
  EXPECT_LE(static_cast<double>(read.read_busy_ns), wall_ns - 100e6) << "the gap was counted";
  EXPECT_EQ(read.write_busy_ns, written.write_busy_ns) << "reads moved the write clock";
  EXPECT_TRUE(engine->close(f).ok());
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

TEST_P(IoEngineBackends, AWriteTheDeviceAcceptsNoBytesOfFailsAsAnIoErrorNotEndOfFile) {
  TempDir dir;
  EngineOptions o{.block_size_bytes = 65536, .queue_depth = 4, .backend = GetParam()};
  std::atomic<int> submissions{0};
  o.fault_injector = [&](const tz::nvme::PieceInfo& p) {
    ++submissions;
    return p.offset == 3 * 65536 ? tz::nvme::Fault{.no_bytes = true} : tz::nvme::Fault{};
  };
  auto engine = make_engine(o);
  ASSERT_TRUE(engine);
  const std::size_t bytes = 1 << 20;
  const std::string path = dir.file("zero-write");
  const FileId f = open_new(*engine, path, bytes);
  AlignedBuffer out(bytes);
  out.fill_random(23);
  const tz::Status s = engine->submit(whole(IoOp::kWrite, out.data(), f, bytes)).wait_for(std::chrono::seconds(30));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kIoError) << s.to_string();
  EXPECT_NE(s.message().find("accepted no bytes"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find("end of file"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("offset 196608"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_LE(submissions.load(), 16) << "the zero-byte piece was not retried";
  // A read that gets 0 bytes is still end of file.
  AlignedBuffer in(bytes);
  const tz::Status r = engine->submit(whole(IoOp::kRead, in.data(), f, bytes)).wait();
  EXPECT_NE(r.message().find("end of file"), std::string::npos) << r.message();
}

// The write's checksums are computed off the submission path and the read's
// verified after the queue is refilled (Note [Checksums off the I/O path]):
// each must still be of its own piece, whatever the order of completions,
// retries and short transfers.
TEST_P(IoEngineBackends, ChecksumsStayExactWithManyPiecesInFlightRetriesAndShortTransfers) {
  TempDir dir;
  EngineOptions o{.block_size_bytes = 65536, .queue_depth = 8, .rings = 2, .backend = GetParam()};
  o.fault_injector = [](const tz::nvme::PieceInfo& p) {
    if (p.sequence % 7 == 3) return tz::nvme::Fault{.error = EAGAIN};
    if (p.sequence % 5 == 1 && p.length > 8192) return tz::nvme::Fault{.short_bytes = 8192};
    return tz::nvme::Fault{};
  };
  auto engine = make_engine(o);
  ASSERT_TRUE(engine);
  const std::size_t bytes = 4 << 20;
  const std::string path = dir.file("sums");
  const FileId f = open_new(*engine, path, bytes);
  AlignedBuffer out(bytes), in(bytes);
  out.fill_random(29);
  IoRequest w = whole(IoOp::kWrite, out.data(), f, bytes);
  std::vector<std::uint64_t> sums(engine->piece_count(w));
  ASSERT_EQ(sums.size(), 64U);
  w.checksums = sums.data();
  ASSERT_TRUE(engine->submit(w).wait().ok());
  for (std::size_t i = 0; i < sums.size(); ++i) {
    ASSERT_EQ(sums[i], XXH3_64bits(out.data() + i * 65536, 65536)) << "piece " << i;
  }
  IoRequest r = whole(IoOp::kRead, in.data(), f, bytes);
  r.checksums = sums.data();
  ASSERT_TRUE(engine->submit(r).wait().ok());
  EXPECT_TRUE(in.same_as(out));
  EXPECT_GT(engine->stats().short_transfers, 0U);
  EXPECT_GT(engine->stats().retries, 0U);
  // A stored checksum that no longer matches (piece 41) fails the read naming
  // the piece's file and offset; every callback still comes exactly once.
  sums[41] ^= 1;
  std::atomic<int> calls{0};
  std::latch done(1);
  tz::Status failed;
  engine->submit(r, [&](const tz::Status& st, const tz::nvme::IoResult&) {
    failed = st;
    ++calls;
    done.count_down();
  });
  done.wait();
  EXPECT_EQ(failed.code(), ErrorCode::kDataCorruption) << failed.to_string();
  EXPECT_NE(failed.message().find("offset 2686976"), std::string::npos) << failed.message();
  EXPECT_NE(failed.message().find(path), std::string::npos) << failed.message();
  EXPECT_EQ(engine->stats().errors, 1U);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(calls.load(), 1);
}

std::string backend_test_name(const ::testing::TestParamInfo<IoBackend>& p) {
  return p.param == IoBackend::kUring ? "Uring" : "Threads";
}
INSTANTIATE_TEST_SUITE_P(, IoEngineBackends, ::testing::ValuesIn(runnable_backends()), backend_test_name);

// Makes io_uring_setup fail with EPERM in this process, as a seccomp policy
// (a container runtime's default profile) does.
bool refuse_io_uring() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

TEST(IoEngine, WhereSeccompRefusesIoUringTheThreadPoolTakesOver) {
  TempDir dir;
  const pid_t child = ::fork();
  if (child == 0) {
    // Exit codes: 0 fell back and worked; 1 no seccomp here; 2.. failures.
    if (!refuse_io_uring()) ::_exit(1);
    auto engine = IoEngine::create({.block_size_bytes = 65536, .backend = IoBackend::kAuto});
    if (!engine.ok()) ::_exit(2);
    if ((*engine)->backend() != IoBackend::kThreads) ::_exit(3);
    auto f = (*engine)->open(dir.file("seccomp"), {.create = true, .size_bytes = 1 << 20});
    if (!f.ok()) ::_exit(4);
    AlignedBuffer out(1 << 20), in(1 << 20);
    out.fill_random(31);
    if (!(*engine)->submit(whole(IoOp::kWrite, out.data(), *f, 1 << 20)).wait().ok()) ::_exit(5);
    if (!(*engine)->submit(whole(IoOp::kRead, in.data(), *f, 1 << 20)).wait().ok()) ::_exit(6);
    // Asking for io_uring by name is an error, not a silent fallback.
    auto forced = IoEngine::create({.backend = IoBackend::kUring});
    if (forced.ok() || forced.status().sys_errno() != EPERM) ::_exit(7);
    ::_exit(in.same_as(out) ? 0 : 8);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the exit codes in the child";
}

TEST(IoEngine, SqpollRingsMoveEveryByte) {
  if (!tz::capabilities().uring.available) GTEST_SKIP() << "io_uring unavailable: " << tz::capabilities().uring.unavailable_reason;
  TempDir dir;
  auto engine = make_engine({.block_size_bytes = 262144, .queue_depth = 8, .rings = 2, .sqpoll = true});
  ASSERT_TRUE(engine);
  std::printf("[ nvme ] %s\n", engine->describe().c_str());
  const std::size_t bytes = 8 << 20;
  const FileId f = open_new(*engine, dir.file("sqpoll"), bytes);
  AlignedBuffer out(bytes), in(bytes);
  out.fill_random(41);
  ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, out.data(), f, bytes)).wait().ok());
  ASSERT_TRUE(engine->submit(whole(IoOp::kRead, in.data(), f, bytes)).wait().ok());
  EXPECT_TRUE(in.same_as(out));
}

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

// Note [Registered buffer slots], with slots of 96 KiB and 64 KiB pieces:
// of every three pieces from the start of a buffer, one straddles a slot
// boundary (64 KiB..128 KiB crosses 96 KiB) and goes the plain way.
TEST(IoEngine, ARegisteredBufferOverTheSlotLimitIsSplitOverSeveralSlots) {
  if (!tz::capabilities().uring.available) GTEST_SKIP() << "io_uring unavailable: " << tz::capabilities().uring.unavailable_reason;
  TempDir dir;
  auto engine = make_engine({.block_size_bytes = 65536, .queue_depth = 4, .fixed_buffer_slot_bytes = 98304});
  ASSERT_TRUE(engine);
  const std::size_t bytes = 1 << 20;  // 16 pieces, 11 slots
  const FileId f = open_new(*engine, dir.file("slots"), bytes);
  AlignedBuffer out(bytes), in(bytes);
  out.fill_random(31);
  ASSERT_TRUE(engine->register_buffer(out.data(), bytes).ok());
  ASSERT_TRUE(engine->register_buffer(in.data(), bytes).ok());
  ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, out.data(), f, bytes)).wait().ok());
  in.fill(0);
  ASSERT_TRUE(engine->submit(whole(IoOp::kRead, in.data(), f, bytes)).wait().ok());
  EXPECT_TRUE(in.same_as(out));
  EXPECT_EQ(engine->stats().fixed_buffer_pieces, 22U) << "11 of each request's 16 pieces lie inside one slot";
  EXPECT_EQ(engine->describe().find("refused"), std::string::npos) << engine->describe();
  // 22 of the 64 slots are taken: a range that needs 43 more is left out,
  // without turning fixed buffers off; unregistering gives slots back.
  AlignedBuffer big(43 * 98304);
  ASSERT_TRUE(engine->register_buffer(big.data(), big.size()).ok());
  ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, big.data(), f, bytes)).wait().ok());
  EXPECT_EQ(engine->stats().fixed_buffer_pieces, 22U);
  ASSERT_TRUE(engine->unregister_buffer(in.data()).ok());
  ASSERT_TRUE(engine->register_buffer(big.data(), big.size()).ok());
  ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, big.data(), f, bytes)).wait().ok());
  EXPECT_EQ(engine->stats().fixed_buffer_pieces, 33U);
}

// The kernel's own limit: one slot holds at most 1 GiB (EFAULT beyond). 1.25
// GiB of address space, of which the test writes 8 MiB; registering pins all
// of it (1.25 GiB of memory, for the test's length).
TEST(IoEngine, ABufferOverOneGibIsRegisteredInSlotsAndUsed) {
  if (!tz::capabilities().uring.available) GTEST_SKIP() << "io_uring unavailable: " << tz::capabilities().uring.unavailable_reason;
  constexpr std::size_t kGiB = std::size_t{1} << 30;
  const std::size_t bytes = kGiB + kGiB / 4;
  void* map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  ASSERT_NE(map, MAP_FAILED) << std::strerror(errno);
  std::unique_ptr<void, std::function<void(void*)>> unmap(map, [bytes](void* p) { ::munmap(p, bytes); });
  auto* base = static_cast<std::uint8_t*>(map);
  TempDir dir;
  auto engine = make_engine({.block_size_bytes = 1 << 20, .queue_depth = 4});
  ASSERT_TRUE(engine);
  ASSERT_TRUE(engine->register_buffer(base, bytes).ok());
  const std::string described = engine->describe();
  if (described.find("refused (Cannot allocate memory)") != std::string::npos ||
      described.find("refused (Operation not permitted)") != std::string::npos) {
    GTEST_SKIP() << "the kernel will not pin 1.25 GiB here (memlock limit): " << described;
  }
  ASSERT_EQ(described.find("refused"), std::string::npos) << described;
  // 4 MiB in the first slot and 4 MiB in the second (past 1 GiB), out and back.
  const std::size_t chunk = 4 << 20;
  std::uint8_t* low = base + (64 << 20);
  std::uint8_t* high = base + kGiB + (64 << 20);
  std::mt19937_64 rng(37);
  for (std::size_t i = 0; i < chunk; i += 8) {
    const std::uint64_t x = rng();
    std::memcpy(low + i, &x, 8);
  }
  const FileId f = open_new(*engine, dir.file("big"), chunk);
  ASSERT_TRUE(engine->submit(whole(IoOp::kWrite, low, f, chunk)).wait().ok());
  ASSERT_TRUE(engine->submit(whole(IoOp::kRead, high, f, chunk)).wait().ok());
  EXPECT_EQ(std::memcmp(low, high, chunk), 0);
  EXPECT_EQ(engine->stats().fixed_buffer_pieces, 8U);
  // A piece across the slot boundary at 1 GiB goes the plain way, correctly.
  std::uint8_t* across = base + kGiB - (512 << 10);
  ASSERT_TRUE(engine->submit(whole(IoOp::kRead, across, f, 1 << 20)).wait().ok());
  EXPECT_EQ(std::memcmp(across, low, 1 << 20), 0);
  EXPECT_EQ(engine->stats().fixed_buffer_pieces, 8U);
  ASSERT_TRUE(engine->unregister_buffer(base).ok());
}

TEST(IoEngine, EveryChecksumBuildAgreesWithTheScalarReference) {
  const std::vector<std::string_view> variants = tz::nvme::checksum_variants();
  ASSERT_FALSE(variants.empty());
  EXPECT_EQ(variants.back(), tz::nvme::checksum_variant()) << "checksum() runs the widest runnable build";
  EXPECT_EQ(tz::nvme::checksum(nullptr, 0), 0x2D06800538D394C2ULL);  // XXH3-64 of nothing (xxhash's test vector)
  // Every length class of XXH3 (0-16, 17-128, 129-240, long: stripes, blocks
  // and the last partial stripe), at odd addresses.
  AlignedBuffer data(3 << 20);
  data.fill_random(41);
  std::mt19937_64 rng(43);
  std::vector<std::size_t> lengths{0, 1, 3, 4, 8, 9, 16, 17, 64, 128, 129, 200, 240, 241, 1023, 1024, 1025, 65536, 1 << 20,
                                   (3 << 20) - 7};
  for (int i = 0; i < 200; ++i) lengths.push_back(rng() % (1 << 20));
  std::size_t compared = 0;
  for (std::size_t length : lengths) {
    const std::size_t at = length >= data.size() ? 0 : rng() % (data.size() - length);
    const std::uint64_t want = XXH3_64bits(data.data() + at, length);
    EXPECT_EQ(tz::nvme::checksum(data.data() + at, length), want) << "length " << length;
    for (std::string_view v : variants) {
      auto got = tz::nvme::checksum_with(v, data.data() + at, length);
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      EXPECT_EQ(*got, want) << v << ", length " << length << " at +" << at;
      ++compared;
    }
  }
  std::string names;
  for (std::string_view v : variants) names += std::string(names.empty() ? "" : ", ") + std::string(v);
  std::printf("[ nvme ] checksum builds: %s; running %s; %zu hashes compared, 0 allowed to differ\n", names.c_str(),
              std::string(tz::nvme::checksum_variant()).c_str(), compared);
  auto unknown = tz::nvme::checksum_with("neon9", data.data(), 16);
  EXPECT_EQ(unknown.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("scalar"), std::string::npos) << unknown.status().message();
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
  // A length no buffer has, or an end past 2^64: refused before anything is sized from it (it was std::bad_alloc).
  s = engine->submit(IoRequest{.op = IoOp::kRead, .buffer = buf.data(), .segments = {{f, 0, ~std::uint64_t{4095}}}})
          .wait();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("out of range"), std::string::npos) << s.message();
  s = engine->submit(IoRequest{.op = IoOp::kRead, .buffer = buf.data(), .segments = {{f, ~std::uint64_t{4095}, 8192}}})
          .wait();
  EXPECT_NE(s.message().find("out of range"), std::string::npos) << s.message();
  EXPECT_EQ(engine->stats().pieces, 0U);
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
  e = IoEngine::create({.fixed_buffer_slot_bytes = (std::size_t{1} << 30) + 4096});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("fixed_buffer_slot_bytes"), std::string::npos);
}

// The config loader's aio ranges are these same constants (Note [Config key
// ranges]): a config at the limits loads and makes an engine; one past them
// the engine refuses, as the loader does (tests/common/config_test.cpp).
TEST(IoEngine, TheLimitsAreAcceptedAndTheNextValuesRefused) {
  auto config = tz::parse_config(fmt::format(R"({{"aio": {{"block_size": {}, "queue_depth": {},
                                                          "intra_op_parallelism": {}}}}})",
                                             tz::nvme::kMaxBlockSizeBytes, tz::nvme::kMaxQueueDepth,
                                             tz::nvme::kMaxRings));
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EngineOptions o = EngineOptions::from_config(config->aio);
  o.backend = IoBackend::kThreads;  // 64 rings of 4097 io_uring entries would take locked memory
  EXPECT_TRUE(IoEngine::create(o).ok());
  for (EngineOptions over : {EngineOptions{.block_size_bytes = tz::nvme::kMaxBlockSizeBytes + 4096},
                             EngineOptions{.queue_depth = tz::nvme::kMaxQueueDepth + 1},
                             EngineOptions{.rings = tz::nvme::kMaxRings + 1}}) {
    EXPECT_FALSE(IoEngine::create(over).ok());
  }
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
