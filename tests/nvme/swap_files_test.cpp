// Swap files owned by a lock (Note [Swap file ownership]): a killed run's file
// is reclaimed by the next store, a live run's is left alone and named when
// space is short, and stores share a folder. The dead and live runs are real
// child processes.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <regex>

#include "nvme_test_util.h"

namespace tzt {
namespace {

namespace fs = std::filesystem;
using tz::ErrorCode;
using tz::nvme::SwapOptions;
using tz::nvme::SwapStore;

constexpr std::uint64_t kCapacity = 4 << 20;

std::unique_ptr<SwapStore> make_store(const std::string& dir, std::uint64_t capacity = kCapacity) {
  auto s = SwapStore::create({.paths = {dir}, .capacity_bytes = capacity});
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? std::move(*s) : nullptr;
}

// A child process that makes a store in `dir` and reports its swap file. With
// `hold`, it then keeps the store until release() or kill(); without, it
// _exit()s at once, as a crash would, leaving the file behind.
class StoreChild {
 public:
  StoreChild(const std::string& dir, bool hold, std::uint64_t capacity = kCapacity) {
    int report[2], go[2];
    if (::pipe(report) != 0 || ::pipe(go) != 0) std::abort();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(report[0]);
      ::close(go[1]);
      auto store = SwapStore::create({.paths = {dir}, .capacity_bytes = capacity});
      const std::string path = store.ok() ? (*store)->file_paths()[0] : "";
      (void)!::write(report[1], path.data(), path.size());
      ::close(report[1]);
      char c;
      if (hold) (void)!::read(go[0], &c, 1);
      if (store.ok()) (void)store->release();  // no destructor: the file stays, as after a crash
      ::_exit(store.ok() ? 0 : 1);
    }
    ::close(report[1]);
    ::close(go[0]);
    release_ = go[1];
    char buf[4096];
    ssize_t n;
    while ((n = ::read(report[0], buf, sizeof buf)) > 0) path_.append(buf, static_cast<std::size_t>(n));
    ::close(report[0]);
  }
  ~StoreChild() { release(); }
  const std::string& path() const { return path_; }
  void kill9() {
    if (pid_ > 0) ::kill(pid_, SIGKILL);
    release();
  }
  void release() {
    if (release_ >= 0) ::close(std::exchange(release_, -1));
    if (pid_ > 0) ::waitpid(std::exchange(pid_, -1), nullptr, 0);
  }

 private:
  pid_t pid_ = -1;
  int release_ = -1;
  std::string path_;
};

TEST(SwapFiles, AFileLeftByAKilledProcessIsReclaimedByTheNextStore) {
  TempDir dir;
  StoreChild child(dir.path(), /*hold=*/true);
  ASSERT_FALSE(child.path().empty());
  child.kill9();
  ASSERT_TRUE(fs::exists(child.path())) << "kill -9 left the swap file";
  tz::log::configure("info");
  testing::internal::CaptureStderr();
  auto store = make_store(dir.path());
  const std::string log = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(store);
  EXPECT_FALSE(fs::exists(child.path())) << "reclaimed";
  EXPECT_NE(log.find("removed the stale swap file " + child.path()), std::string::npos) << log;
  EXPECT_NE(log.find(tz::format_bytes(kCapacity)), std::string::npos) << "names its size: " << log;
  EXPECT_NE(store->file_paths()[0], child.path());
}

TEST(SwapFiles, ALiveRunsFileIsLeftAloneAndNamedWhenSpaceIsShort) {
  TempDir dir;
  StoreChild live(dir.path(), /*hold=*/true);
  ASSERT_FALSE(live.path().empty());
  auto caps = tz::probe_path(dir.path());
  ASSERT_TRUE(caps.ok());
  auto too_big = SwapStore::create({.paths = {dir.path()}, .capacity_bytes = caps->free_bytes + (64ULL << 30)});
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), ErrorCode::kNoSpace);
  const std::string msg = too_big.status().message();
  EXPECT_NE(msg.find(live.path()), std::string::npos) << msg;
  EXPECT_NE(msg.find("another live run, which holds their lock"), std::string::npos) << msg;
  EXPECT_TRUE(fs::exists(live.path()));
  {
    auto beside = make_store(dir.path());  // room for both: the live one's file is left alone
    ASSERT_TRUE(beside);
    EXPECT_TRUE(fs::exists(live.path()));
  }
  live.release();  // it ends without removing its file
  ASSERT_TRUE(fs::exists(live.path()));
  auto after = make_store(dir.path());
  ASSERT_TRUE(after);
  EXPECT_FALSE(fs::exists(live.path())) << "reclaimed once its run ended";
}

TEST(SwapFiles, WhenSpaceIsStillShortTheReclaimedFilesAreNamed) {
  TempDir dir;
  StoreChild dead(dir.path(), /*hold=*/false);
  ASSERT_FALSE(dead.path().empty());
  dead.release();
  auto caps = tz::probe_path(dir.path());
  ASSERT_TRUE(caps.ok());
  auto too_big = SwapStore::create({.paths = {dir.path()}, .capacity_bytes = caps->free_bytes + (64ULL << 30)});
  ASSERT_FALSE(too_big.ok());
  const std::string msg = too_big.status().message();
  EXPECT_NE(msg.find("were removed first: " + dead.path()), std::string::npos) << msg;
  EXPECT_TRUE(fs::is_empty(dir.path())) << "the stale file and the half-made one are both gone";
}

// The restart of issue #23: a disk with room for one run's swap file, the
// dead run's file on it. The next store fits once that file is reclaimed, at
// once (the dead run's io_uring lets go of the file a moment after it is
// reaped: Note [Space of a removed file]).
TEST(SwapFiles, OnANearlyFullDiskTheDeadRunsFileMakesRoomForTheNext) {
  TempDir dir;
  LoopMount fs(dir, 16);
  if (!fs.mounted()) GTEST_SKIP() << fs.why_not();
  constexpr std::uint64_t kBig = 10 << 20;  // of about 14 MiB free
  StoreChild dead(fs.path(), /*hold=*/true, kBig);
  ASSERT_FALSE(dead.path().empty());
  dead.kill9();
  auto caps = tz::probe_path(fs.path());
  ASSERT_TRUE(caps.ok());
  ASSERT_LT(caps->free_bytes, kBig) << "the dead run's file takes the room";
  auto next = make_store(fs.path(), kBig);
  ASSERT_TRUE(next) << "refused for want of the room the dead run's file held";
  EXPECT_FALSE(fs::exists(dead.path()));
}

TEST(SwapFiles, TwoStoresInOneFolderAtOnceEachKeepTheirOwnFile) {
  TempDir dir;
  auto a = make_store(dir.path());
  auto b = make_store(dir.path());
  ASSERT_TRUE(a && b);
  const std::string fa = a->file_paths()[0], fb = b->file_paths()[0];
  EXPECT_NE(fa, fb);
  const std::regex name(R"(tierzero-swap-[0-9a-f]{16}\.bin)");
  EXPECT_TRUE(std::regex_match(fs::path(fa).filename().string(), name)) << fa;
  EXPECT_EQ(fa.find(std::to_string(::getpid())), std::string::npos) << "not named by the PID: " << fa;
  AlignedBuffer out_a(1 << 20), out_b(1 << 20), in(1 << 20);
  out_a.fill_random(1);
  out_b.fill_random(2);
  auto ea = a->allocate(1 << 20), eb = b->allocate(1 << 20);
  ASSERT_TRUE(ea.ok() && eb.ok());
  ASSERT_TRUE(a->write(*ea, out_a.data()).wait().ok());
  ASSERT_TRUE(b->write(*eb, out_b.data()).wait().ok());
  auto c = make_store(dir.path());  // a third, made while both live, leaves both alone
  ASSERT_TRUE(c);
  ASSERT_TRUE(a->read(*ea, in.data()).wait().ok());
  EXPECT_TRUE(in.same_as(out_a));
  ASSERT_TRUE(b->read(*eb, in.data()).wait().ok());
  EXPECT_TRUE(in.same_as(out_b));
  a.reset();
  b.reset();
  c.reset();
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(SwapFiles, AnOlderVersionsPidNamedFileIsReclaimedButNotWhatIsNotAFile) {
  TempDir dir;
  const std::string old = dir.file("tierzero-swap-1-0.bin");
  std::ofstream(old) << "left by a run named by its PID";
  fs::create_directory(dir.file("tierzero-swap-folder.bin"));
  fs::create_symlink(dir.file("elsewhere"), dir.file("tierzero-swap-link.bin"));
  std::ofstream(dir.file("elsewhere")) << "not a swap file";
  auto store = make_store(dir.path());
  ASSERT_TRUE(store);
  EXPECT_FALSE(fs::exists(old));
  EXPECT_TRUE(fs::is_directory(dir.file("tierzero-swap-folder.bin")));
  EXPECT_TRUE(fs::is_symlink(dir.file("tierzero-swap-link.bin")));
  EXPECT_TRUE(fs::exists(dir.file("elsewhere")));
}

TEST(SwapFiles, RemoveSwapFilesNowUnlinksThoseOfEveryLiveStore) {
  TempDir a, b;
  auto one = make_store(a.path());
  auto two = make_store(b.path());
  ASSERT_TRUE(one && two);
  tz::nvme::remove_swap_files_now();
  EXPECT_TRUE(fs::is_empty(a.path()));
  EXPECT_TRUE(fs::is_empty(b.path()));
  // The stores still work on their open files; their destructors find nothing left to remove.
  AlignedBuffer out(4096), in(4096);
  out.fill_random(3);
  auto e = one->allocate(4096);
  ASSERT_TRUE(e.ok());
  ASSERT_TRUE(one->write(*e, out.data()).wait().ok());
  ASSERT_TRUE(one->read(*e, in.data()).wait().ok());
  EXPECT_TRUE(in.same_as(out));
}

}  // namespace
}  // namespace tzt
