// An engine's swap files (Note [Swap file ownership] in nvme/src/swap_files.cpp):
// the restart of issue #23, on a nearly full disk beside a dead run's swap
// file, with "nvme_bytes": "auto". The dead run's file is reclaimed before
// the budget reads the free space, so the restart is not refused for want of
// the room that file held; and ZeroEngine::swap_files() names the engine's own.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <filesystem>

#include "../nvme/nvme_test_util.h"
#include "tierzero/testing/engine.h"

namespace tzt {
namespace {

namespace fs = std::filesystem;

// 3.2M parameters: about 57 MB of states (bf16 parameters, fp32 gradients,
// master weights and moments), most of which must go to NVMe beside a device
// budget of 16 MiB and a CPU budget of 24 MiB.
constexpr tz::mlp::MlpConfig kMlp{.layers = 12, .hidden = 512, .batch = 2, .seed = 3};

tz::Config auto_nvme_config(const std::string& nvme) {
  tz::Config config = test_config(nvme, 3, 1);
  config.tiers.gpu = tz::ByteBudget::of(16 << 20);
  config.tiers.cpu = tz::ByteBudget::of(24 << 20);
  config.tiers.nvme = tz::ByteBudget::automatic();  // the free space there
  config.zero.stage3_prefetch_bucket_size = 300'000;  // about one block ahead
  return config;
}

// A swap file as a run killed with its store alive leaves it: named as
// stores name them, its space allocated, no lock held.
void leave_dead_swap_file(const std::string& path, std::uint64_t bytes) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0644);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::posix_fallocate(fd, 0, static_cast<off_t>(bytes)), 0);
  ::close(fd);
}

TEST(SwapReclaim, ADeadRunsSwapFileIsReclaimedBeforeTheAutoNvmeBudgetReadsTheFreeSpace) {
  TempDir dir;
  LoopMount disk(dir, 128);
  if (!disk.mounted()) GTEST_SKIP() << disk.why_not();
  const std::string stale = disk.path() + "/tierzero-swap-00000000deadbeef.bin";
  leave_dead_swap_file(stale, 100 << 20);
  // statvfs, not tz::probe_path: the probe is cached, and the "auto" budget must see the space as it is then.
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(disk.path().c_str(), &vfs), 0);
  ASSERT_LT(vfs.f_bavail * vfs.f_frsize, std::uint64_t{20} << 20) << "the dead run's file takes most of the disk";

  auto engine = tz::ZeroEngine::create({.config = auto_nvme_config(disk.path())}, tz::mlp::model(kMlp),
                                       tz::mlp::init(kMlp));
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  EXPECT_FALSE(fs::exists(stale));
  const std::vector<std::string> mine = (*engine)->swap_files();
  ASSERT_EQ(mine.size(), 1U);
  EXPECT_EQ(fs::path(mine[0]).parent_path(), disk.path());
  const auto trained = tz::mlp::train_micro_batch(**engine, kMlp, tz::mlp::make_batch(kMlp, 0, 0, 0));
  EXPECT_TRUE(trained.ok()) << trained.status().to_string();
  const auto stepped = (*engine)->step();
  EXPECT_TRUE(stepped.ok()) << stepped.status().to_string();
  engine->reset();
  EXPECT_FALSE(fs::exists(mine[0])) << "removed with the engine";
}

TEST(SwapReclaim, ALiveRunsSwapFileIsNamedWhenTheModelDoesNotFitBesideIt) {
  TempDir dir;
  LoopMount disk(dir, 128);
  if (!disk.mounted()) GTEST_SKIP() << disk.why_not();
  const std::string held = disk.path() + "/tierzero-swap-00000000000a11fe.bin";
  leave_dead_swap_file(held, 100 << 20);
  auto fd = tz::open_file(held, O_RDWR);  // this process holds its lock: a live run's file
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(tz::try_lock_file(fd->get(), held).value_or(false));

  auto refused = tz::ZeroEngine::create({.config = auto_nvme_config(disk.path())}, tz::mlp::model(kMlp),
                                        tz::mlp::init(kMlp));
  ASSERT_FALSE(refused.ok());
  const std::string msg = refused.status().message();
  EXPECT_NE(msg.find("nvme_bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find(held), std::string::npos) << msg;
  EXPECT_NE(msg.find("another live run, which holds their lock"), std::string::npos) << msg;
  EXPECT_TRUE(fs::exists(held));
}

}  // namespace
}  // namespace tzt
