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
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <iterator>
#include <regex>
#include <sstream>
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
  // `env`: NAME=value entries added to this process's environment;
  // `launcher`: a command that runs the trainer (found on PATH), or none.
  explicit Trainer(const std::vector<std::string>& args, const std::vector<std::string>& env = {},
                   const std::vector<std::string>& launcher = {}) {
    int out[2];
    if (::pipe2(out, O_CLOEXEC) != 0) std::abort();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
    posix_spawn_file_actions_adddup2(&actions, out[1], STDERR_FILENO);
    std::vector<std::string> all = launcher;
    all.emplace_back(TIERZERO_TRAIN_EXE);
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> vars = env;
    for (char** e = environ; *e != nullptr; ++e) vars.emplace_back(*e);  // later duplicates lose (getenv: first)
    std::vector<char*> envp;
    for (std::string& v : vars) envp.push_back(v.data());
    envp.push_back(nullptr);
    if (::posix_spawnp(&pid_, argv[0], &actions, nullptr, argv.data(), envp.data()) != 0) pid_ = -1;
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
  pid_t pid() const { return pid_; }
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

// Two ranks of an endless tiny run (torchrun's variables), each with its own
// NVMe folder (DIR/nvme<r>) and outputs (DIR/out<r>); `extra` adds flags.
std::vector<std::unique_ptr<Trainer>> two_ranks(const tz::test::TempDir& dir, const std::vector<std::string>& extra = {}) {
  const int port = tz::test::next_port();
  std::vector<std::unique_ptr<Trainer>> ranks;
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> args = tiny_run(dir, 100000);
    args[args.size() - 3] = dir.path() + "/nvme" + std::to_string(r);  // --nvme-path: one folder each
    args.back() = dir.path() + "/out" + std::to_string(r);
    args.insert(args.end(), extra.begin(), extra.end());
    ranks.push_back(std::make_unique<Trainer>(
        args, std::vector<std::string>{"RANK=" + std::to_string(r), "WORLD_SIZE=2", "LOCAL_RANK=" + std::to_string(r),
                                       "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                                       "MASTER_PORT=" + std::to_string(port),
                                       "TIERZERO_RENDEZVOUS_DIR=" + dir.path() + "/rendezvous"}));
  }
  return ranks;
}

std::size_t lines_in(const std::string& path) {
  std::ifstream in(path);
  std::size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<std::string> csv_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
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
  std::vector<std::unique_ptr<Trainer>> ranks = two_ranks(dir);
  for (const auto& rank : ranks) ASSERT_TRUE(rank->started());
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

// --save-on-stop (Slurm's preemption): SIGTERM saves the last completed step;
// the same command run again resumes there and ends with the unbroken run's
// weights, byte for byte, and its losses; nothing is left in the NVMe folder
// or as a .partial.
TEST(TrainSignals, SaveOnStopSavesTheLastStepAndTheRestartEndsBitForBit) {
  tz::test::TempDir dir;
  auto job = [&](const std::string& name, bool restartable) {
    std::vector<std::string> args = tiny_run(dir, 1);
    args[5] = "12";  // --steps 12 becomes --until-step 12: the same command line resumes to the same end
    args[4] = "--until-step";
    args[args.size() - 1] = dir.path() + "/out-" + name;
    for (const std::string& a : {std::string("--save"), dir.path() + "/" + name}) args.push_back(a);
    if (restartable) {
      for (const std::string& a : {std::string("--save-on-stop"), std::string("--resume"), dir.path() + "/" + name,
                                   std::string("--resume-if-present")}) {
        args.push_back(a);
      }
    }
    return args;
  };
  {
    Trainer unbroken(job("ref", false));
    const int status = unbroken.finish(std::chrono::seconds(180));
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << describe(status) << "\n" << unbroken.output();
  }
  std::int64_t after = 0;
  {
    Trainer run(job("ckpt", true));
    ASSERT_TRUE(run.wait_for(std::regex(R"(step +4/)"), std::chrono::seconds(120))) << run.output();
    run.signal(SIGTERM);
    const int status = run.finish(std::chrono::seconds(120));
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << describe(status) << "\n" << run.output();
    std::ifstream in(dir.path() + "/out-ckpt/summary.json");
    ASSERT_TRUE(in.good()) << run.output();
    after = nlohmann::json::parse(in)["stopped"]["after_step"].get<std::int64_t>();
    ASSERT_GE(after, 4);
    ASSERT_LT(after, 12) << "stopped before the end";
    EXPECT_NE(run.output().find("saving step " + std::to_string(after) + " before stopping (--save-on-stop)"),
              std::string::npos) << run.output();
    std::ifstream latest(dir.path() + "/ckpt/latest");
    std::string named;
    latest >> named;
    EXPECT_EQ(named, "step-" + std::to_string(after)) << "latest names the step the signal stopped after";
  }
  EXPECT_TRUE(fs::is_empty(dir.path() + "/nvme"));
  Trainer again(job("ckpt", true));
  const int status = again.finish(std::chrono::seconds(180));
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << describe(status) << "\n" << again.output();
  EXPECT_NE(again.output().find("at step " + std::to_string(after)), std::string::npos) << again.output();
  EXPECT_TRUE(fs::is_empty(dir.path() + "/nvme"));
  // The weights and optimizer states: every file of the final checkpoint.
  std::size_t compared = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(dir.path() + "/ref/step-12")) {
    const fs::path mine = fs::path(dir.path()) / "ckpt/step-12" / e.path().filename();
    EXPECT_EQ(read_bytes(e.path()), read_bytes(mine)) << e.path().filename() << " differs";
    ++compared;
  }
  EXPECT_GE(compared, 2u);
  for (const fs::directory_entry& e : fs::directory_iterator(dir.path() + "/ckpt")) {
    EXPECT_FALSE(e.path().filename().string().ends_with(".partial")) << e.path();
  }
  // The losses of the steps the restart took are the unbroken run's (the CSV's 10 digits).
  const std::vector<std::string> ref = csv_lines(dir.path() + "/out-ref/loss.csv");
  const std::vector<std::string> resumed = csv_lines(dir.path() + "/out-ckpt/loss.csv");
  ASSERT_EQ(ref.size(), 13u);
  ASSERT_EQ(resumed.size(), static_cast<std::size_t>(13 - after));
  for (std::size_t i = 1; i < resumed.size(); ++i) {
    EXPECT_EQ(resumed[i].substr(0, resumed[i].find(',', resumed[i].find(',') + 1)),
              ref[after + i].substr(0, ref[after + i].find(',', ref[after + i].find(',') + 1)));
  }
}

// As the first process of a PID namespace (a container's entry point) the
// kernel drops a signal whose action is the default, so re-raising one does
// nothing there. The first SIGTERM must still stop the run (exit 143, the
// summary written) and a second signal still abort it at once (exit 130), not
// leave it training without its swap file.
std::vector<std::string> pid_namespace() {
  const int rc = std::system("unshare --pid --fork --mount-proc true > /dev/null 2>&1");
  if (rc != 0) return {};
  return {"unshare", "--pid", "--fork", "--mount-proc"};
}

// The trainer under `unshare` (its child), found through /proc.
pid_t child_of(pid_t parent) {
  for (int i = 0; i < 500; ++i) {
    for (const fs::directory_entry& e : fs::directory_iterator("/proc")) {
      const std::string name = e.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      std::ifstream stat(e.path() / "stat");
      std::string line;
      std::getline(stat, line);
      const std::size_t close = line.rfind(')');
      if (close == std::string::npos) continue;
      std::istringstream rest(line.substr(close + 2));
      char state = 0;
      pid_t ppid = 0;
      rest >> state >> ppid;
      if (ppid == parent) return static_cast<pid_t>(std::stol(name));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

TEST(TrainSignals, AsPidOneOfANamespaceTheFirstSignalStopsAndASecondAborts) {
  const std::vector<std::string> unshare = pid_namespace();
  if (unshare.empty()) GTEST_SKIP() << "unshare --pid --fork --mount-proc is refused here (not root?)";
  {
    tz::test::TempDir dir;
    Trainer run(tiny_run(dir, 100000), {}, unshare);
    ASSERT_TRUE(run.wait_for(std::regex(R"(step +2/)"), std::chrono::seconds(120))) << run.output();
    const pid_t trainer = child_of(run.pid());
    ASSERT_GT(trainer, 0);
    ::kill(trainer, SIGTERM);
    const int status = run.finish(std::chrono::seconds(60));
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM) << describe(status) << "\n"
                                                                          << run.output();
    EXPECT_TRUE(fs::exists(dir.path() + "/out/summary.json")) << run.output();
    EXPECT_TRUE(fs::is_empty(dir.path() + "/nvme"));
  }
  tz::test::TempDir dir;
  std::vector<std::string> args = tiny_run(dir, 100000);
  for (const char* a : {"--hidden", "256", "--layers", "4", "--batch", "16", "--seq", "128"}) args.emplace_back(a);
  Trainer run(args, {}, unshare);
  ASSERT_TRUE(run.wait_for(std::regex(R"(step +1/)"), std::chrono::seconds(180))) << run.output();
  const pid_t trainer = child_of(run.pid());
  ASSERT_GT(trainer, 0);
  ::kill(trainer, SIGTERM);
  ASSERT_TRUE(run.wait_for(std::regex("SIGTERM: stopping"), std::chrono::seconds(30))) << run.output();
  ::kill(trainer, SIGINT);
  const int status = run.finish(std::chrono::seconds(120));
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGINT) << describe(status) << "\n" << run.output();
  EXPECT_NE(run.output().find("a second signal: aborting now"), std::string::npos) << run.output();
  EXPECT_TRUE(fs::is_empty(dir.path() + "/nvme"));
  EXPECT_FALSE(fs::exists(dir.path() + "/out/summary.json")) << "aborted, not stopped:\n" << run.output();
}

// --collective-timeout with a rank that stops answering mid-run (SIGSTOP):
// the other's error names the collective and step it was in and what the
// stopped rank last posted (Note [What the other ranks were doing]), and it
// leaves no swap file.
TEST(TrainCollectiveTimeout, TheErrorSaysWhatTheSilentRankWasDoing) {
  tz::test::TempDir dir;
  std::vector<std::unique_ptr<Trainer>> ranks = two_ranks(dir, {"--collective-timeout", "2"});
  for (const auto& rank : ranks) ASSERT_TRUE(rank->started());
  ASSERT_TRUE(ranks[0]->wait_for(std::regex(R"(step +3/)"), std::chrono::seconds(180))) << ranks[0]->output();
  ranks[1]->signal(SIGSTOP);
  const int status0 = ranks[0]->finish(std::chrono::seconds(60));
  ranks[1]->signal(SIGKILL);
  const std::string& out = ranks[0]->output();
  ASSERT_TRUE(WIFEXITED(status0) && WEXITSTATUS(status0) == 1) << describe(status0) << "\n" << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(timed out after \d+ ms \(timeout 2000 ms)"))) << out;
  EXPECT_TRUE(std::regex_search(out, std::regex(R"(this rank was in its collective #\d+ \(step \d+)"))) << out;
  EXPECT_TRUE(std::regex_search(
      out, std::regex(R"(rank 1 (has not entered #\d+: it (left|entered)|is in the same collective) #\d+ \(.*step \d+)")))
      << out;
  EXPECT_TRUE(fs::is_empty(dir.path() + "/nvme0"));
  std::smatch line;
  if (std::regex_search(out, line, std::regex("tierzero-train: .*timed out.*"))) std::fprintf(stderr, "  %s\n", line.str().c_str());
}

}  // namespace
}  // namespace tzt
