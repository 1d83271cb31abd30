#include "nvme_bench_fio.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <sstream>

extern char** environ;

namespace tzbench {
namespace {

constexpr std::size_t kErrorTailChars = 2000;

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (const std::string& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

// A temporary file removed on destruction.
struct TempFile {
  std::string path;
  explicit TempFile(const char* pattern) : path(pattern) {
    const int fd = ::mkstemp(path.data());
    if (fd >= 0) {
      ::close(fd);
    } else {
      path.clear();
    }
  }
  ~TempFile() {
    if (!path.empty()) ::unlink(path.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
};

// This process's environment with `extra` ("NAME=value") added; a variable
// already set gets the value appended after a ':' (GLIBC_TUNABLES' separator).
std::vector<std::string> environment_with(const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
  for (const std::string& x : extra) {
    const std::string name = x.substr(0, x.find('=') + 1);
    auto it = std::find_if(env.begin(), env.end(), [&](const std::string& e) { return e.rfind(name, 0) == 0; });
    if (it == env.end()) {
      env.push_back(x);
    } else {
      *it += ":" + x.substr(name.size());
    }
  }
  return env;
}

std::vector<char*> c_strings(const std::vector<std::string>& items) {
  std::vector<char*> out;
  for (const std::string& s : items) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// Runs argv with `extra_env`, stdout and stderr into `log_path`; the exit status.
tz::Expected<int> spawn_and_wait(const std::vector<std::string>& argv, const std::string& log_path,
                                 const std::vector<std::string>& extra_env = {}) {
  std::vector<char*> args = c_strings(argv);
  const std::vector<std::string> env_strings = environment_with(extra_env);
  std::vector<char*> env = c_strings(env_strings);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_TRUNC, 0);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) return tz::errno_status(rc, fmt::format("starting {}", argv[0]));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return tz::errno_status(errno, fmt::format("waiting for {}", argv[0]));
  }
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

}  // namespace

tz::Expected<std::string> fio_version(const std::string& fio) {
  TempFile log("/tmp/tierzero-nvme-bench-fio-XXXXXX");
  if (log.path.empty()) return tz::errno_status(errno, "creating a temporary file for fio's output");
  TZ_ASSIGN_OR_RETURN(int rc, spawn_and_wait({fio, "--version"}, log.path));
  std::string text = read_all(log.path);
  text.erase(std::find_if(text.rbegin(), text.rend(), [](char c) { return c != '\n' && c != ' '; }).base(), text.end());
  if (rc != 0 || text.rfind("fio-", 0) != 0) {
    return tz::unavailable("'{} --version' did not answer as fio does (exit status {}): {}", fio, rc, text);
  }
  return text;
}

std::vector<std::string> fio_args(const FioSpec& spec, const std::string& output_path) {
  const EngineConfig& c = spec.config;
  const auto jobs = static_cast<std::uint64_t>(c.rings);
  // Each job covers its own 1/jobs of every file, in whole blocks.
  const std::uint64_t share = spec.file_bytes / jobs / c.block_bytes * c.block_bytes;
  std::vector<std::string> a = {spec.fio,
                                "--name=tierzero-peer",
                                "--filename=" + join(spec.files, ":"),
                                "--ioengine=io_uring",
                                fmt::format("--direct={}", c.direct ? 1 : 0),
                                fmt::format("--rw={}", workload_name(spec.workload)),
                                fmt::format("--bs={}", c.block_bytes),
                                fmt::format("--iodepth={}", c.queue_depth),
                                fmt::format("--numjobs={}", c.rings),
                                fmt::format("--size={}", share * spec.files.size()),
                                "--hipri=0",
                                "--allow_file_create=0",
                                "--output-format=json",
                                "--output=" + output_path};
  if (jobs > 1) a.push_back(fmt::format("--offset_increment={}", share));
  if (spec.files.size() > 1) a.push_back("--file_service_type=roundrobin");
  // The whole buffer on huge pages, as ours (Note [Huge pages]).
  if (spec.hugepages) a.push_back("--iomem_align=2m");
  if (c.fixed_buffers) a.push_back("--fixedbufs=1");
  if (c.fixed_files) a.push_back("--registerfiles=1");
  if (c.sqpoll) a.push_back("--sqthread_poll=1");
  if (!c.direct && workload_op(spec.workload) == tz::nvme::IoOp::kWrite) a.push_back("--end_fsync=1");
  if (spec.limits.runtime_s > 0) {
    a.push_back("--time_based=1");
    a.push_back(fmt::format("--runtime={}ms", static_cast<std::uint64_t>(std::llround(spec.limits.runtime_s * 1000))));
  } else if (spec.limits.io_bytes > 0) {
    const std::uint64_t per_job = std::max<std::uint64_t>(c.block_bytes, spec.limits.io_bytes / jobs);
    a.push_back(fmt::format("--io_size={}", std::min(per_job, share * spec.files.size())));
  }
  return a;
}

tz::Expected<FioResult> parse_fio_json(const std::string& text) {
  // fio may print notes before the JSON document.
  const auto brace = text.find('{');
  if (brace == std::string::npos) return tz::internal_error("fio's output holds no JSON document");
  nlohmann::json j = nlohmann::json::parse(text.substr(brace), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("jobs") || !j["jobs"].is_array() || j["jobs"].empty()) {
    return tz::internal_error("fio's JSON has no jobs array");
  }
  FioResult r;
  double longest_s = 0, latency_weighted = 0, ios = 0;
  for (const nlohmann::json& job : j["jobs"]) {
    if (job.value("error", 0) != 0) return tz::io_error("fio job failed with error {}", job.value("error", 0));
    for (const char* dir : {"read", "write"}) {
      const nlohmann::json& d = job.at(dir);
      r.gbps += d.value("bw_bytes", 0.0) / 1e9;
      r.io_bytes += d.value("io_bytes", std::uint64_t{0});
      longest_s = std::max(longest_s, d.value("runtime", 0.0) / 1e3);
      const double n = d.value("total_ios", 0.0);
      if (n > 0 && d.contains("lat_ns")) latency_weighted += d["lat_ns"].value("mean", 0.0) * n;
      ios += n;
    }
  }
  r.aggregate_gbps = longest_s > 0 ? static_cast<double>(r.io_bytes) / longest_s / 1e9 : 0;
  r.mean_latency_us = ios > 0 ? latency_weighted / ios / 1e3 : 0;
  return r;
}

tz::Expected<FioResult> run_fio(const FioSpec& spec) {
  return run_fio_with([&](const std::string& output) { return fio_args(spec, output); }, spec.hugepages);
}

tz::Expected<FioResult> run_fio_with(const std::function<std::vector<std::string>(const std::string&)>& make_args,
                                     bool hugepages) {
  TempFile output("/tmp/tierzero-nvme-bench-fio-XXXXXX");
  TempFile log("/tmp/tierzero-nvme-bench-fio-XXXXXX");
  if (output.path.empty() || log.path.empty()) return tz::errno_status(errno, "creating temporary files for fio");
  const std::vector<std::string> argv = make_args(output.path);
  std::vector<std::string> env;
  if (hugepages) env.push_back("GLIBC_TUNABLES=glibc.malloc.hugetlb=1");
  const std::string command = join(env, " ") + (env.empty() ? "" : " ") + join(argv, " ");
  TZ_ASSIGN_OR_RETURN(int rc, spawn_and_wait(argv, log.path, env));
  if (rc != 0) {
    std::string said = read_all(log.path);
    if (said.size() > kErrorTailChars) said = said.substr(said.size() - kErrorTailChars);
    return tz::io_error("'{}' failed (exit status {}): {}", command, rc, said);
  }
  tz::Expected<FioResult> result = parse_fio_json(read_all(output.path));
  TZ_TRY_CTX(result, "reading the output of '{}'", command);
  result->command = command;
  return result;
}

}  // namespace tzbench
