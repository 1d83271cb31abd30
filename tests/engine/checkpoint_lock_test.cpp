// Note [One saver a folder] (engine/src/checkpoint.cpp): two processes save
// into one folder at once. The first is held inside its save (its NVMe reads
// wait on the parent); the second must fail at once, naming the folder and
// the first's PID, and leave the first's .partial alone; the first then
// publishes a checkpoint that loads.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "../nvme/nvme_test_util.h"
#include "tierzero/testing/engine.h"

namespace tzt {
namespace {

namespace fs = std::filesystem;
using tz::Tier;

constexpr tz::mlp::MlpConfig kMlp{.layers = 2, .hidden = 32, .batch = 4, .seed = 7};
const Placement kNvme{Tier::kNvme, Tier::kCpu, Tier::kNvme, Tier::kNvme};

std::unique_ptr<tz::ZeroEngine> make(const std::string& nvme, tz::nvme::FaultInjector injector = nullptr) {
  auto e = tz::ZeroEngine::create({.config = test_config(nvme, 3, 1), .placement = kNvme,
                                   .nvme_fault_injector = std::move(injector)},
                                  tz::mlp::model(kMlp), tz::mlp::init(kMlp));
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

std::vector<std::string> partials(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().ends_with(".partial")) out.push_back(e.path().string());
  }
  return out;
}

TEST(CheckpointLock, ASecondRunSavingIntoTheFolderIsRefusedAndTheFirstPublishes) {
  TempDir nvme_a, nvme_b, ckpt;
  int inside[2], go[2];
  ASSERT_EQ(::pipe(inside), 0);
  ASSERT_EQ(::pipe(go), 0);
  const pid_t first = ::fork();
  if (first == 0) {  // the first run: its save waits, once inside, for the parent
    ::close(inside[0]);
    ::close(go[1]);
    std::atomic<bool> armed{false};
    auto engine = make(nvme_a.path(), [&](const tz::nvme::PieceInfo& p) {
      if (p.op == tz::nvme::IoOp::kRead && armed.exchange(false)) {
        char c = 1;
        (void)!::write(inside[1], &c, 1);
        (void)!::read(go[0], &c, 1);
      }
      return tz::nvme::Fault{};
    });
    if (!engine) ::_exit(2);
    armed = true;
    const tz::Status saved = engine->save_checkpoint(ckpt.path());
    ::_exit(saved.ok() ? 0 : 3);
  }
  ::close(inside[1]);
  ::close(go[0]);
  char c = 0;
  ASSERT_EQ(::read(inside[0], &c, 1), 1) << "the first run did not reach its save";
  // The first run holds the folder: it has made its .partial and is writing into it.
  ASSERT_EQ(partials(ckpt.path()).size(), 1U);
  const std::string theirs = partials(ckpt.path())[0];

  auto second = make(nvme_b.path());
  ASSERT_TRUE(second);
  const tz::Status refused = second->save_checkpoint(ckpt.path());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.code(), tz::ErrorCode::kUnavailable) << refused.to_string();
  EXPECT_NE(refused.message().find("another run is saving into " + ckpt.path()), std::string::npos)
      << refused.message();
  EXPECT_NE(refused.message().find("pid " + std::to_string(first) + " on "), std::string::npos) << refused.message();
  EXPECT_TRUE(fs::exists(theirs)) << "the refused save left the first run's .partial alone";

  ::close(go[1]);  // let the first run finish
  int status = 0;
  ASSERT_EQ(::waitpid(first, &status, 0), first);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the first run's save failed: status " << status;
  EXPECT_TRUE(partials(ckpt.path()).empty());
  auto loaded = second->load_checkpoint(ckpt.path(), tz::CheckpointLoad{});
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(fs::path(loaded->path).filename(), "step-0");
  // The folder is free again: the second run saves after it.
  auto again = second->save_checkpoint(ckpt.path(), tz::CheckpointSave{.tag = "second"});
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  ::close(inside[0]);
}

TEST(CheckpointLock, AFailedSaveRemovesItsOwnPartial) {
  TempDir nvme, ckpt;
  std::atomic<bool> fail{false};
  auto engine = make(nvme.path(), [&](const tz::nvme::PieceInfo& p) {
    return p.op == tz::nvme::IoOp::kRead && fail.load() ? tz::nvme::Fault{.error = EIO} : tz::nvme::Fault{};
  });
  ASSERT_TRUE(engine);
  fail = true;
  const tz::Status s = engine->save_checkpoint(ckpt.path());
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(partials(ckpt.path()).empty()) << "nothing half-written stays";
  fail = false;
  EXPECT_FALSE(fs::exists(ckpt.path() + "/latest"));
}

}  // namespace
}  // namespace tzt
