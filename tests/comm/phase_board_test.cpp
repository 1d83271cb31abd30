// PhaseBoard (comm/src/phase_board.h): what one rank posts about its
// collectives, read back as another rank's timeout would read it (Note [What
// the other ranks were doing]). Two boards in one process stand for two ranks
// (their files are locked by separate opens, as two processes' would be); a
// forked child that dies without cleaning up stands for a killed rank.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "../../comm/src/phase_board.h"
#include "tierzero/testing/ranks.h"

namespace tz::comm_detail {
namespace {

namespace fs = std::filesystem;

std::unique_ptr<PhaseBoard> open_board(const std::string& dir, int rank, int size = 2) {
  auto board = PhaseBoard::open(dir, "127.0.0.1-29500.run1", rank, size);
  EXPECT_TRUE(board.ok()) << board.status().to_string();
  return board.ok() ? std::move(*board) : nullptr;
}

TEST(PhaseBoard, ARankThatHasNotEnteredTheCollectiveIsNamedWithWhatItLastDid) {
  test::TempDir dir;
  auto zero = open_board(dir.path(), 0);
  auto one = open_board(dir.path(), 1);
  ASSERT_TRUE(zero && one);
  for (PhaseBoard* b : {zero.get(), one.get()}) {
    b->set_step(7);
    b->set_activity("checkpoint /x");
    b->enter("all_reduce of 1 int64");
    b->leave();
    b->set_activity("");
  }
  zero->set_step(8);
  zero->enter("all_gather of 4096 bf16");  // rank 1 never comes
  EXPECT_EQ(zero->describe_mine(), "#2 (step 8)");
  const std::string others = zero->describe_others();
  EXPECT_NE(others.find("rank 1 has not entered #2: it left #1 (all_reduce of 1 int64, step 7, for checkpoint /x)"),
            std::string::npos)
      << others;
}

TEST(PhaseBoard, ARankInTheSameCollectiveOrAheadIsSaidSo) {
  test::TempDir dir;
  auto zero = open_board(dir.path(), 0, 3);
  auto one = open_board(dir.path(), 1, 3);
  auto two = open_board(dir.path(), 2, 3);
  ASSERT_TRUE(zero && one && two);
  zero->enter("barrier");
  one->enter("barrier");
  two->enter("barrier");
  two->leave();
  two->set_step(3);
  two->enter("broadcast of 8 bytes from rank 0");
  const std::string others = zero->describe_others();
  EXPECT_NE(others.find("rank 1 is in the same collective #1 (barrier)"), std::string::npos) << others;
  EXPECT_NE(others.find("rank 2 is ahead, in #2 (broadcast of 8 bytes from rank 0, step 3)"), std::string::npos)
      << others;
}

// A rank killed outright leaves its file unlocked: the reader says the process
// is gone, and the next board opened in the folder removes the file.
TEST(PhaseBoard, AKilledRanksFileSaysItIsGoneAndIsReclaimed) {
  test::TempDir dir;
  auto zero = open_board(dir.path(), 0);
  ASSERT_TRUE(zero);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto one = PhaseBoard::open(dir.path(), "127.0.0.1-29500.run1", 1, 2);
    if (!one.ok()) ::_exit(1);
    (*one)->set_step(5);
    (*one)->enter("reduce_scatter of 64 fp32");
    ::_exit(0);  // no destructor: the file stays, its lock goes with the process
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const std::string rank1 = zero->path_of(1);
  ASSERT_TRUE(fs::exists(rank1));
  zero->enter("barrier");
  const std::string others = zero->describe_others();
  EXPECT_NE(others.find("rank 1's process is gone (it last posted #1 (reduce_scatter of 64 fp32, step 5)"),
            std::string::npos)
      << others;
  auto other_run = PhaseBoard::open(dir.path(), "127.0.0.1-29500.run2", 0, 1);
  ASSERT_TRUE(other_run.ok()) << other_run.status().to_string();
  EXPECT_FALSE(fs::exists(rank1)) << "the dead rank's file was reclaimed";
  EXPECT_TRUE(fs::exists(zero->path_of(0))) << "a live rank's file is left alone";
}

TEST(PhaseBoard, AMissingRankAndACleanEndAreSaidSoAndLeaveNothing) {
  test::TempDir dir;
  {
    auto zero = open_board(dir.path(), 0);
    ASSERT_TRUE(zero);
    zero->enter("barrier");
    const std::string others = zero->describe_others();
    EXPECT_NE(others.find("rank 1 posted nothing"), std::string::npos) << others;
  }
  EXPECT_TRUE(fs::is_empty(dir.path())) << "a board's end removes its file";
}

}  // namespace
}  // namespace tz::comm_detail
