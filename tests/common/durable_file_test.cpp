#include "tierzero/common/durable_file.h"

#include <sys/stat.h>
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

TEST_F(DurableFileTest, AReadOnlyDirectoryIsAnErrorAndTheOldContentStays) {
  ASSERT_TRUE(write_file_durably(path("out"), "old").ok());
  fs::permissions(dir_, fs::perms::owner_read | fs::perms::owner_exec, fs::perm_options::replace);
  const Status s = write_file_durably(path("out"), "new");
  fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::replace);
  EXPECT_EQ(read_all(path("out")), s.ok() ? "new" : "old");
  EXPECT_EQ(names(), std::vector<std::string>{"out"});  // no temporary file either way
  // root (CAP_DAC_OVERRIDE) writes into a read-only directory all the same,
  // so only an unprivileged run can see the refusal.
  if (::geteuid() == 0) GTEST_SKIP() << "running as root: directory permissions do not bite";
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
