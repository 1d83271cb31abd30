// Advisory locks: who holds them across opens, processes and fork(), caused
// for real with child processes.
#include "tierzero/common/file_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>

namespace tz {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "tz-lock-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

UniqueFd open_rw(const std::string& path) {
  Expected<UniqueFd> fd = open_file(path, O_RDWR | O_CREAT);
  EXPECT_TRUE(fd.ok()) << fd.status().to_string();
  return fd.ok() ? std::move(*fd) : UniqueFd();
}

bool lockable(const std::string& path) {
  UniqueFd fd = open_rw(path);
  Expected<bool> mine = try_lock_file(fd.get(), path);
  EXPECT_TRUE(mine.ok()) << mine.status().to_string();
  return mine.ok() && *mine;
}

// A child that runs `body` and then waits for a byte on `go` (or its end)
// before it _exit()s; the parent's end of the pipe is returned in `*release`.
pid_t child_holding(const std::function<void()>& body, int* release) {
  int ready[2], go[2];
  if (::pipe(ready) != 0 || ::pipe(go) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(ready[0]);
    ::close(go[1]);
    body();
    char c = 1;
    (void)!::write(ready[1], &c, 1);
    (void)!::read(go[0], &c, 1);
    ::_exit(0);
  }
  ::close(ready[1]);
  ::close(go[0]);
  char c = 0;
  (void)!::read(ready[0], &c, 1);  // the child has done `body`
  ::close(ready[0]);
  *release = go[1];
  return pid;
}

void end_child(pid_t pid, int release) {
  ::close(release);
  int status = 0;
  ::waitpid(pid, &status, 0);
}

TEST(FileLock, TwoOpensOfOneFileExcludeEachOtherInOneProcess) {
  TempDir dir;
  const std::string path = dir.file("a");
  UniqueFd first = open_rw(path);
  ASSERT_TRUE(try_lock_file(first.get(), path).value());
  EXPECT_FALSE(lockable(path)) << "a second open() of the file is another owner";
  UniqueFd other = open_rw(path);
  other.reset();  // closing another descriptor of the file does not drop the lock
  EXPECT_FALSE(lockable(path));
  first.reset();
  EXPECT_TRUE(lockable(path));
}

TEST(FileLock, TheLockEndsWithAProcessKilledWhileHoldingIt) {
  TempDir dir;
  const std::string path = dir.file("a");
  int release = -1;
  const pid_t pid = child_holding([&] {
    UniqueFd fd = open_rw(path);
    if (!try_lock_file(fd.get(), path).value_or(false)) ::_exit(3);
    (void)fd.release();  // held until the process ends
  }, &release);
  ASSERT_GT(pid, 0);
  EXPECT_FALSE(lockable(path)) << "the live child holds it";
  ::kill(pid, SIGKILL);
  end_child(pid, release);
  EXPECT_TRUE(lockable(path)) << "kill -9 released it";
}

// Note [Open file description locks]: a forked child shares the parent's open
// file description, so the file stays locked while either holds it.
TEST(FileLock, AForkedChildSharesItsParentsLock) {
  TempDir dir;
  const std::string path = dir.file("a");
  UniqueFd fd = open_rw(path);
  ASSERT_TRUE(try_lock_file(fd.get(), path).value());
  int release = -1;
  const pid_t pid = child_holding([] {}, &release);  // inherits fd
  ASSERT_GT(pid, 0);
  fd.reset();  // the parent lets go; the child's copy still holds the lock
  EXPECT_FALSE(lockable(path));
  end_child(pid, release);
  EXPECT_TRUE(lockable(path));
}

TEST(LockFile, TheSecondHolderIsRefusedNamingTheFirst) {
  TempDir dir;
  const std::string path = dir.file(".lock");
  Expected<LockFile> first = LockFile::acquire(path, "saving into x");
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  Expected<LockFile> second = LockFile::acquire(path, "saving into x");
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), ErrorCode::kUnavailable);
  const std::string msg = second.status().message();
  EXPECT_NE(msg.find("saving into x"), std::string::npos) << msg;
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find(this_process_description()), std::string::npos) << msg;
  first->release();
  EXPECT_TRUE(LockFile::acquire(path, "saving into x").ok());
  EXPECT_TRUE(fs::exists(path)) << "the lock file stays";
}

}  // namespace
}  // namespace tz
