#include "tierzero/common/durable_file.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

namespace tz {
namespace {

namespace fs = std::filesystem;

// A fresh directory under the system's temporary one, removed afterwards.
class DurableFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / fmt::format("tz-durable-{}-{}", ::getpid(),
                                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add);
    fs::remove_all(dir_);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Only the names in the directory: a leftover temporary file shows here.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

  fs::path dir_;
};

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST_F(DurableFileTest, WritesTheWholeBufferAndLeavesNoTemporaryFile) {
  const std::string bytes("binary\0data\n", 12);
  ASSERT_TRUE(write_file_durably(path("out"), bytes).ok());
  EXPECT_EQ(read_all(path("out")), bytes);
  EXPECT_EQ(names(), std::vector<std::string>{"out"});
}

TEST_F(DurableFileTest, ReplacesAnExistingFileWhole) {
  ASSERT_TRUE(write_file_durably(path("out"), "a much longer old content").ok());
  ASSERT_TRUE(write_file_durably(path("out"), "new").ok());
  EXPECT_EQ(read_all(path("out")), "new");
  EXPECT_EQ(names(), std::vector<std::string>{"out"});
}

TEST_F(DurableFileTest, AMissingDirectoryIsAnErrorNamingThePathAndErrno) {
  const std::string target = path("no-such-dir/out");
  const Status s = write_file_durably(target, "x");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kNotFound);
  EXPECT_TRUE(contains(s.message(), target)) << s.message();
  EXPECT_TRUE(contains(s.message(), "No such file or directory")) << s.message();
  EXPECT_EQ(names(), std::vector<std::string>{});
}

// write_file_durably as an unprivileged user. Root (CAP_DAC_OVERRIDE) writes
// into a read-only directory all the same, so as root the write runs in a
// child that first becomes nobody (uid and gid 65534), and its Status comes
// back through a pipe.
Status write_unprivileged(const std::string& target, const std::string& text) {
  if (::geteuid() != 0) return write_file_durably(target, text);
  int fds[2];
  if (::pipe(fds) != 0) return Status(ErrorCode::kInternal, "pipe failed");
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    std::string report = "setuid failed";
    if (::setgid(65534) == 0 && ::setuid(65534) == 0) {
      const Status s = write_file_durably(target, text);
      report = std::to_string(static_cast<int>(s.code())) + "\n" + s.message();
    }
    (void)!::write(fds[1], report.data(), report.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string report;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) report.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int wstatus = 0;
  ::waitpid(pid, &wstatus, 0);
  const std::size_t eol = report.find('\n');
  if (eol == std::string::npos) return Status(ErrorCode::kInternal, "the unprivileged child said: " + report);
  return Status(static_cast<ErrorCode>(std::stoi(report.substr(0, eol))), report.substr(eol + 1));
}

TEST_F(DurableFileTest, AReadOnlyDirectoryIsAnErrorAndTheOldContentStays) {
  ASSERT_TRUE(write_file_durably(path("out"), "old").ok());
  // r-x for everyone: the unprivileged writer can reach the file, not add one beside it.
  fs::permissions(dir_, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read | fs::perms::group_exec |
                            fs::perms::others_read | fs::perms::others_exec,
                  fs::perm_options::replace);
  const Status s = write_unprivileged(path("out"), "new");
  fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::replace);
  EXPECT_EQ(read_all(path("out")), "old");
  EXPECT_EQ(names(), std::vector<std::string>{"out"});  // no temporary file
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kPermissionDenied);
  EXPECT_TRUE(contains(s.message(), path("out"))) << s.message();
  EXPECT_TRUE(contains(s.message(), "Permission denied")) << s.message();
}

TEST_F(DurableFileTest, ATargetThatIsADirectoryIsRefusedAndNoTemporaryFileStays) {
  fs::create_directories(path("out"));
  std::ofstream(path("out/inside")) << "kept";
  const Status s = write_file_durably(path("out"), "x");
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.message(), path("out"))) << s.message();
  EXPECT_TRUE(contains(s.message(), "Is a directory")) << s.message();
  EXPECT_EQ(names(), std::vector<std::string>{"out"});
  EXPECT_EQ(read_all(path("out/inside")), "kept");
}

TEST_F(DurableFileTest, AFailedReplaceRemovesTheCallersTemporaryFile) {
  // The streaming form: the caller wrote the temporary file itself.
  ASSERT_TRUE(write_file_durably(path("out"), "old").ok());
  fs::create_directories(path("dir"));
  const std::string temp = durable_temp_path(path("dir"));
  ASSERT_TRUE(write_file_synced(temp, "new").ok());
  EXPECT_FALSE(replace_file_durably(temp, path("dir")).ok());
  EXPECT_FALSE(fs::exists(temp));
  ASSERT_TRUE(write_file_synced(durable_temp_path(path("out")), "new").ok());
  ASSERT_TRUE(replace_file_durably(durable_temp_path(path("out")), path("out")).ok());
  EXPECT_EQ(read_all(path("out")), "new");
  EXPECT_EQ(names(), (std::vector<std::string>{"dir", "out"}));
}

TEST_F(DurableFileTest, SyncingAMissingDirectoryNamesIt) {
  const Status s = sync_directory(path("gone"));
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(contains(s.message(), path("gone"))) << s.message();
}

}  // namespace
}  // namespace tz
