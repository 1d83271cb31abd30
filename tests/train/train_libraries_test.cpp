// Which CUDA libraries the trainer maps (Note [CUDA libraries load on first
// use] in common/src/shared_library.cpp): a CPU run of the real tierzero-train
// maps none of cudart, cuBLAS, cuBLASLt or NCCL, read from its /proc/PID/maps
// while it trains; and, in a CUDA build, loading cuBLAS is what maps it, so
// the check above would see a library linked or loaded again.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

// First: checks.h defines its CUDA macros for a file that includes
// cuda_runtime.h before any tierzero header.
#if defined(TIERZERO_WITH_CUDA)
#include <cuda_runtime.h>

#include "../../train/src/gpt_cuda.h"
#endif

#include "tierzero/testing/maps.h"
#include "tierzero/testing/ranks.h"

namespace tzt {
namespace {

// tierzero-train with `args`, stdout and stderr into a pipe this test reads
// line by line; killed (SIGKILL) and reaped when the test is done with it.
class RunningTrainer {
 public:
  explicit RunningTrainer(std::vector<std::string> args) {
    int out[2];
    if (::pipe(out) != 0) return;
    args.insert(args.begin(), TIERZERO_TRAIN_EXE);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(out[1], STDERR_FILENO);
      ::close(out[0]);
      ::close(out[1]);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    output_.reset(::fdopen(out[0], "r"));
  }
  ~RunningTrainer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  const std::string& seen() const { return seen_; }

  // Reads lines until one matches `pattern` (true) or the output ends (false).
  bool read_until(const std::regex& pattern) {
    if (!output_) return false;
    char line[4096];
    while (std::fgets(line, sizeof line, output_.get()) != nullptr) {
      seen_ += line;
      if (std::regex_search(line, pattern)) return true;
    }
    return false;
  }

 private:
  struct Close {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  pid_t pid_ = -1;
  std::unique_ptr<std::FILE, Close> output_;
  std::string seen_;
};

bool maps_name(pid_t pid, const std::string& part) {
  std::FILE* maps = std::fopen(("/proc/" + std::to_string(pid) + "/maps").c_str(), "r");
  if (maps == nullptr) return false;
  bool found = false;
  char line[4096];
  while (!found && std::fgets(line, sizeof line, maps) != nullptr) found = std::string(line).find(part) != std::string::npos;
  std::fclose(maps);
  return found;
}

// The README's main job on the CPU, shrunk: after its first step every
// library the CPU path uses is mapped, and no CUDA one may be.
TEST(TrainLibraries, CpuTrainerMapsNoCudaLibrary) {
  tz::test::TempDir dir;
  RunningTrainer run({"--backend", "host", "--preset", "tiny", "--steps", "100000", "--eval-every", "0",
                      "--log-every", "1", "--nvme-path", dir.path(), "--out", dir.path() + "/out"});
  ASSERT_GT(run.pid(), 0);
  ASSERT_TRUE(run.read_until(std::regex(R"(step +1/)"))) << run.seen();
  // Still running (it has 100000 steps to go): its maps are the live process's.
  ASSERT_TRUE(maps_name(run.pid(), "tierzero-train")) << "could not read the trainer's /proc/PID/maps";
  EXPECT_EQ(tz::test::mapped_cuda_libraries(run.pid()), std::set<std::string>{}) << run.seen();
}

#if defined(TIERZERO_WITH_CUDA)
// The check above can fail: loading cuBLAS maps it (and cuBLASLt), and the
// entry points forward to it. No GPU is needed to load the library or to
// name a status.
TEST(TrainLibraries, CublasIsMappedOnlyOnceLoaded) {
  ASSERT_EQ(tz::test::mapped_cuda_libraries(), std::set<std::string>{});
  const tz::Status loaded = tz::train::cuda::load_cublas();
  ASSERT_TRUE(loaded.ok()) << loaded.to_string();
  const std::set<std::string> mapped = tz::test::mapped_cuda_libraries();
  EXPECT_EQ(mapped.size(), 2U);  // libcublas and libcublasLt
  EXPECT_TRUE(maps_name(::getpid(), "libcublas.so"));
  EXPECT_STREQ(cublasGetStatusName(CUBLAS_STATUS_SUCCESS), "CUBLAS_STATUS_SUCCESS");
  EXPECT_TRUE(tz::train::cuda::load_cublas().ok());  // once: the same result again
}
#endif

}  // namespace
}  // namespace tzt
