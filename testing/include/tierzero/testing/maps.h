// Which CUDA libraries a process has mapped (Note [CUDA libraries load on
// first use]): the files in /proc/PID/maps whose name starts libcudart,
// libcublas (cuBLASLt included) or libnccl. Header-only, for tests.
//
//   EXPECT_EQ(tz::test::mapped_cuda_libraries(pid), std::set<std::string>{});
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <set>
#include <string>

namespace tz::test {

// The paths of the mapped CUDA libraries, each once. A process that has gone
// (or whose maps cannot be read) maps nothing: callers check it is alive.
inline std::set<std::string> mapped_cuda_libraries(pid_t pid = ::getpid()) {
  static const std::regex kCudaLibrary(R"((^|/)lib(cudart|cublas|cublasLt|nccl)\.so[^/]*$)");
  std::set<std::string> found;
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  for (std::string line; std::getline(maps, line);) {
    // address perms offset dev inode path: the path starts at the first '/'.
    const std::size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    if (std::regex_search(path, kCudaLibrary)) found.insert(path);
  }
  return found;
}

}  // namespace tz::test
