// The torch comparison: the script, run in a child process per size.
#include "adam_bench_torch.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tzbench::adam {
namespace {

constexpr const char* kTorchScript = R"PY(
# tierzero-adam-bench's torch side. argv: n, thread counts (comma list), repeats.
# "fused" and "default": median time of optimizer.step() over one flat fp32
# parameter. "whole": the whole per-step optimizer work of a bf16
# mixed-precision step as a torch user writes it: the bf16 gradient (scaled by
# 4096) lands in the fp32 .grad, GradScaler.unscale_ (unscale + inf check),
# clip_grad_norm_(1.0), scaler.step with fused AdamW, and the bf16 copy of the
# new parameter.
import json, statistics, sys, time
import torch
n, threads, repeats = int(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])
print(json.dumps({"torch_version": torch.__version__}), flush=True)
g = torch.Generator().manual_seed(0)
for variant in ("fused", "default", "whole"):
    for t in threads:
        torch.set_num_threads(t)
        try:
            p = torch.nn.Parameter(torch.rand(n, generator=g) * 2 - 1)
            p.grad = (torch.rand(n, generator=g) * 2 - 1) * 1e-3
            kw = {} if variant == "default" else {"fused": True}
            opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **kw)
            if variant == "whole":
                g16 = ((torch.rand(n, generator=g) * 8 - 4)).bfloat16()
                p16 = torch.empty(n, dtype=torch.bfloat16)
                scaler = torch.amp.GradScaler("cpu", init_scale=4096.0, growth_interval=10**9)
                def work():
                    scaler.scale(torch.ones(()))  # what scaler.scale(loss) does before backward
                    p.grad.copy_(g16)
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_([p], 1.0, foreach=True)
                    scaler.step(opt)
                    scaler.update()
                    p16.copy_(p.detach())
            else:
                work = opt.step
            work()  # warm-up: creates and touches the state
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                work()
                times.append(time.perf_counter() - start)
            print(json.dumps({"variant": variant, "threads": t, "seconds": times,
                              "median_s": statistics.median(times)}), flush=True)
            del opt, p, work
        except Exception as e:  # e.g. fused=True unsupported on CPU in this torch
            print(json.dumps({"variant": variant, "threads": t, "error": f"{type(e).__name__}: {e}"}), flush=True)
)PY";

}  // namespace

std::string torch_unavailable_reason(const std::string& python) {
  const std::string command = python + " -c 'import torch' >/dev/null 2>&1";
  const int rc = std::system(command.c_str());
  if (rc == 0) return "";
  return fmt::format("'{} -c \"import torch\"' failed (exit status {})", python,
                     WIFEXITED(rc) ? WEXITSTATUS(rc) : -1);
}

namespace {

// Runs the script for one size; returns its JSON lines (one per variant and
// thread count, plus the version line).
tz::Expected<std::vector<nlohmann::json>> run_torch(const std::string& python, std::size_t n,
                                                    const std::vector<int>& threads, int repeats) {
  char path[] = "/tmp/tierzero-adam-bench-torch-XXXXXX.py";
  const int fd = ::mkstemps(path, 3);
  if (fd < 0) return tz::errno_status(errno, "creating the torch script");
  const std::size_t len = std::strlen(kTorchScript);
  const bool written = ::write(fd, kTorchScript, len) == static_cast<ssize_t>(len);
  ::close(fd);
  if (!written) {
    ::unlink(path);
    return tz::io_error("writing the torch script {}", path);
  }
  std::string thread_list;
  for (int t : threads) {  // appended piece by piece: GCC 12 -O3 warns (-Wrestrict) on "," + std::string here
    if (!thread_list.empty()) thread_list += ',';
    thread_list += std::to_string(t);
  }
  const std::string command = fmt::format("{} {} {} {} {}", python, path, n, thread_list, repeats);
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) {
    ::unlink(path);
    return tz::errno_status(errno, "starting " + command);
  }
  std::vector<nlohmann::json> lines;
  std::string line;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), pipe) != nullptr) {
    line += buf;
    if (line.empty() || line.back() != '\n') continue;
    if (line.front() == '{') {
      nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_discarded()) lines.push_back(std::move(j));
    }
    line.clear();
  }
  const int rc = ::pclose(pipe);
  ::unlink(path);
  if (rc != 0 && lines.size() <= 1) return tz::internal_error("'{}' failed (status {})", command, rc);
  return lines;
}

// The script's lines for one size into `out`: the version line kept aside,
// each median filed under (size, threads) by variant.
void add_lines(std::size_t n, std::vector<nlohmann::json>& lines, TorchRuns& out) {
  for (nlohmann::json& j : lines) {
    if (j.contains("torch_version")) {
      out.info["version"] = j["torch_version"];
      continue;
    }
    j["size"] = n;
    if (j.contains("median_s")) {
      auto& slot = out.medians[{n, j["threads"].get<int>()}];
      const double median_s = j["median_s"].get<double>();
      if (j["variant"] == "fused") slot.fused = median_s;
      if (j["variant"] == "default") slot.dflt = median_s;
      if (j["variant"] == "whole") slot.whole = median_s;
    }
    out.runs.push_back(j);
  }
}

}  // namespace

tz::Status time_torch(const std::string& python, std::size_t n, const std::vector<int>& threads, int repeats,
                      Progress& progress, TorchRuns& out) {
  TZ_ASSIGN_OR_RETURN(tz::HostMemoryReading now, tz::read_host_memory());
  // p, grad, two moments, and the default implementation's temporaries.
  if (std::uint64_t{24} * n + kHeadroomBytes > now.available_bytes) {
    out.runs.push_back({{"size", n}, {"error", "skipped: not enough MemAvailable for 24 B/param"}});
    return tz::ok_status();
  }
  progress.show("size {}: torch.optim.AdamW", tz::format_count(static_cast<double>(n)));
  tz::Expected<std::vector<nlohmann::json>> lines = run_torch(python, n, threads, repeats);
  if (!lines.ok()) {
    out.runs.push_back({{"size", n}, {"error", lines.status().message()}});
    return tz::ok_status();
  }
  add_lines(n, *lines, out);
  return tz::ok_status();
}

}  // namespace tzbench::adam
