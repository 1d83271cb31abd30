// tierzero-train stopped by SIGTERM and SIGINT mid-run (Note [Stopping on a
// signal] in train/tools/stop_signals.cpp): the real binary, a real signal.
// It must end by that signal (a shell's 128 + N), write the summary, loss CSV
// and trace of the steps that ran, and leave its NVMe folder empty; a second
// signal aborts at once and still removes the swap file.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tierzero/testing/ranks.h"

extern char** environ;

namespace tzt {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// tierzero-train with `args`, its stdout and stderr into one pipe.
class Trainer {
 public:
  // `env`: NAME=value entries added to this process's environment.
  explicit Trainer(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
    int out[2];
    if (::pipe2(out, O_CLOEXEC) != 0) std::abort();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDERR_FILENO);
    std::vector<std::string> all{TIERZERO_TRAIN_EXE};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> vars = env;
    for (char** e = environ; *e != nullptr; ++e) vars.emplace_back(*e);  // later duplicates lose (getenv: first)
    std::vector<char*> envp;
    for (std::string& v : vars) envp.push_back(v.data());
    envp.push_back(nullptr);
    if (::posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), envp.data()) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&actions);
    ::close(out[1]);
    out_ = out[0];
  }
  ~Trainer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) ::close(out_);
  }
  bool started() const { return pid_ > 0; }
  const std::string& output() const { return output_; }

  // Reads output until it matches `pattern` (true) or the trainer ends or
  // the time is up (false).
  bool wait_for(const std::regex& pattern, std::chrono::seconds limit) {
    const auto end = Clock::now() + limit;
    while (!std::regex_search(output_, pattern)) {
      if (Clock::now() > end || !read_some(500)) return false;
    }
    return true;
  }
  void signal(int sig) { ::kill(pid_, sig); }
  // Reads to the end of output, then the wait status.
  int finish(std::chrono::seconds limit) {
    const auto end = Clock::now() + limit;
    while (Clock::now() < end && read_some(500)) {
    }
    int status = 0;
    ::waitpid(std::exchange(pid_, -1), &status, 0);
    return status;
  }

 private:
  // false at end of output
  bool read_some(int timeout_ms) {
    pollfd p{.fd = out_, .events = POLLIN, .revents = 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return true;
    char buf[4096];
    const ssize_t n = ::read(out_, buf, sizeof buf);
    if (n <= 0) return false;
    output_.append(buf, static_cast<std::size_t>(n));
    return true;
  }

  pid_t pid_ = -1;
  int out_ = -1;
  std::string output_;
};

std::vector<std::string> tiny_run(const tz::test::TempDir& dir, int steps) {
  return {"--backend", "host", "--preset", "tiny", "--steps", std::to_string(steps), "--eval-every", "0",
          "--log-every", "1", "--nvme-path", dir.path() + "/nvme", "--out", dir.path() + "/out"};
}

std::size_t lines_in(const std::string& path) {
  std::ifstream in(path);
  std::size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "exit " + std::to_string(WEXITSTATUS(status));
}

void stops_cleanly_on(int sig, const std::string& name) {
  tz::test::TempDir dir;
  Trainer run(tiny_run(dir, 100000));
  ASSERT_TRUE(run.started());
  ASSERT_TRUE(run.wait_for(std::regex(R"(step +3/)"), std::chrono::seconds(120))) << run.output();
  ASSERT_FALSE(fs::is_empty(dir.path() + "/nvme")) << "the run's swap file is there while it runs";
  run.signal(sig);
  const int status = run.finish(std::chrono::seconds(120));
  const std::string& out = run.output();
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << describe(status) << "\n" << out;
  EXPECT_TRUE(fs::is_empty(dir.path() + "/nvme")) << "the swap file was removed";
  EXPECT_NE(out.find(name + ": stopping when this step ends"), std::string::npos) << out;
  std::ifstream in(dir.path() + "/out/summary.json");
  ASSERT_TRUE(in.good()) << out;
  const nlohmann::json summary = nlohmann::json::parse(in);
  ASSERT_TRUE(summary["stopped"].is_object()) << summary.dump(1);
  EXPECT_EQ(summary["stopped"]["by"], name);
  const std::int64_t after = summary["stopped"]["after_step"].get<std::int64_t>();
  EXPECT_GE(after, 3);
  EXPECT_EQ(summary["step_records"].size(), static_cast<std::size_t>(after)) << "every step that ran";
  EXPECT_NE(out.find("stopped by " + name + " after step " + std::to_string(after)), std::string::npos) << out;
  EXPECT_EQ(lines_in(dir.path() + "/out/loss.csv"), static_cast<std::size_t>(after) + 1) << "a header and each step";
  EXPECT_TRUE(fs::exists(dir.path() + "/out/loss.png"));
  EXPECT_TRUE(fs::exists(dir.path() + "/out/trace.json")) << "step 2, the traced one, ran";
}

TEST(TrainSignals, SigtermStopsAfterTheStepWritesTheOutputsAndLeavesNoSwapFile) { stops_cleanly_on(SIGTERM, "SIGTERM"); }

TEST(TrainSignals, SigintStopsAfterTheStepWritesTheOutputsAndLeavesNoSwapFile) { stops_cleanly_on(SIGINT, "SIGINT"); }

TEST(TrainSignals, ASignalRightAfterStartUpStillWritesTheSummary) {
  tz::test::TempDir dir;
  Trainer run(tiny_run(dir, 100000));
  ASSERT_TRUE(run.started());
  ASSERT_TRUE(run.wait_for(std::regex("learning rate: "), std::chrono::seconds(120))) << run.output();
  run.signal(SIGTERM);  // lands in the first step or just before it
  const int status = run.finish(std::chrono::seconds(120));
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << describe(status) << "\n" << run.output();
  EXPECT_TRUE(fs::is_empty(dir.path() + "/nvme"));
  std::ifstream in(dir.path() + "/out/summary.json");
  ASSERT_TRUE(in.good()) << run.output();
  EXPECT_EQ(nlohmann::json::parse(in)["stopped"]["by"], "SIGTERM");
}

// Two ranks; only rank 0 is signalled. Both must stop after the same step
// (they agree after each one), neither waiting for the other until the
// collective timeout; rank 1 exits with status 1, and neither leaves a swap file.
TEST(TrainSignals, WithTwoRanksASignalToOneStopsBothAfterTheSameStep) {
  tz::test::TempDir dir;
  const int port = tz::test::next_port();
  std::vector<std::unique_ptr<Trainer>> ranks;
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> args = tiny_run(dir, 100000);
    args[args.size() - 3] = dir.path() + "/nvme" + std::to_string(r);  // --nvme-path: one folder each
    args.back() = dir.path() + "/out" + std::to_string(r);
    ranks.push_back(std::make_unique<Trainer>(
        args, std::vector<std::string>{"RANK=" + std::to_string(r), "WORLD_SIZE=2", "LOCAL_RANK=" + std::to_string(r),
                                       "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                                       "MASTER_PORT=" + std::to_string(port),
                                       "TIERZERO_RENDEZVOUS_DIR=" + dir.path() + "/rendezvous"}));
    ASSERT_TRUE(ranks.back()->started());
  }
  ASSERT_TRUE(ranks[0]->wait_for(std::regex(R"(step +3/)"), std::chrono::seconds(180))) << ranks[0]->output();
  ranks[0]->signal(SIGTERM);
  const auto begin = Clock::now();
  const int status0 = ranks[0]->finish(std::chrono::seconds(120));
  const int status1 = ranks[1]->finish(std::chrono::seconds(120));
  EXPECT_LT(Clock::now() - begin, std::chrono::seconds(60)) << "no rank waited out a collective timeout";
  ASSERT_TRUE(WIFSIGNALED(status0) && WTERMSIG(status0) == SIGTERM) << describe(status0) << "\n" << ranks[0]->output();
  ASSERT_TRUE(WIFEXITED(status1) && WEXITSTATUS(status1) == 1) << describe(status1) << "\n" << ranks[1]->output();
  EXPECT_NE(ranks[1]->output().find("stopped early: a signal to another rank"), std::string::npos)
      << ranks[1]->output();
  EXPECT_TRUE(fs::is_empty(dir.path() + "/nvme0"));
  EXPECT_TRUE(fs::is_empty(dir.path() + "/nvme1"));
  std::ifstream in(dir.path() + "/out0/summary.json");
  ASSERT_TRUE(in.good()) << ranks[0]->output();
  const nlohmann::json summary = nlohmann::json::parse(in);
  EXPECT_EQ(summary["stopped"]["by"], "SIGTERM");
  EXPECT_EQ(summary["step_records"].size(), summary["stopped"]["after_step"].get<std::size_t>());
}

// Slow steps (a wider model, larger batches), so the second signal comes while
// the first waits for its step to end.
TEST(TrainSignals, ASecondSignalAbortsAtOnceAndStillRemovesTheSwapFile) {
  tz::test::TempDir dir;
  std::vector<std::string> args = tiny_run(dir, 100000);
  for (const char* a : {"--hidden", "256", "--layers", "4", "--batch", "16", "--seq", "128"}) args.emplace_back(a);
  Trainer run(args);
  ASSERT_TRUE(run.started());
  ASSERT_TRUE(run.wait_for(std::regex(R"(step +1/)"), std::chrono::seconds(180))) << run.output();
  run.signal(SIGTERM);
  ASSERT_TRUE(run.wait_for(std::regex("SIGTERM: stopping"), std::chrono::seconds(30))) << run.output();
  run.signal(SIGINT);
  const int status = run.finish(std::chrono::seconds(120));
  const std::string& out = run.output();
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << describe(status) << "\n" << out;
  EXPECT_NE(out.find("a second signal: aborting now"), std::string::npos) << out;
  EXPECT_TRUE(fs::is_empty(dir.path() + "/nvme")) << "the handler removed the swap file";
  EXPECT_FALSE(fs::exists(dir.path() + "/out/summary.json")) << "aborted, not stopped:\n" << out;
}

}  // namespace
}  // namespace tzt
