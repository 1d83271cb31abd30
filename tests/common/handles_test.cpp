#include "tierzero/common/handles.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

namespace tz {
namespace {

bool fd_is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(UniqueFd, ClosesOnDestructionAndMoves) {
  int raw = -1;
  {
    Expected<UniqueFd> fd = open_file("/dev/null", O_RDONLY);
    ASSERT_TRUE(fd.ok()) << fd.status().to_string();
    raw = fd->get();
    EXPECT_TRUE(fd_is_open(raw));
    UniqueFd moved = std::move(*fd);
    EXPECT_FALSE(fd->valid());
    EXPECT_EQ(moved.get(), raw);
  }
  EXPECT_FALSE(fd_is_open(raw));
}

TEST(UniqueFd, ReleaseHandsOwnershipBack) {
  Expected<UniqueFd> fd = open_file("/dev/null", O_RDONLY);
  ASSERT_TRUE(fd.ok());
  int raw = fd->release();
  EXPECT_TRUE(fd_is_open(raw));
  ::close(raw);
}

TEST(UniqueFd, OpenErrorNamesThePath) {
  Expected<UniqueFd> fd = open_file("/nonexistent/dir/file", O_RDONLY);
  ASSERT_FALSE(fd.ok());
  EXPECT_EQ(fd.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(fd.status().message().find("/nonexistent/dir/file"), std::string::npos);
}

TEST(MappedRegion, UnmapsOnDestruction) {
  void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  { MappedRegion region(p, 4096); static_cast<char*>(region.data())[0] = 1; }
  // mincore on an unmapped page fails with ENOMEM.
  unsigned char vec;
  EXPECT_EQ(::mincore(p, 4096, &vec), -1);
  EXPECT_EQ(errno, ENOMEM);
}

TEST(Cleanup, RunsUnlessCancelled) {
  int runs = 0;
  { Cleanup c([&] { ++runs; }); }
  EXPECT_EQ(runs, 1);
  {
    Cleanup c([&] { ++runs; });
    c.cancel();
  }
  EXPECT_EQ(runs, 1);
}

}  // namespace
}  // namespace tz
