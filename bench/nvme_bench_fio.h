// fio's io_uring engine on the same files, as the peer of the raw runs.
//
// One fio run mirrors one of ours: ioengine=io_uring, direct=1 (0 and
// end_fsync=1 when ours runs buffered), the same files (filename=a:b:...
// with file_service_type=roundrobin for several paths), bs = block size,
// iodepth = queue depth, numjobs = rings with size and offset_increment
// splitting each file so the jobs cover it once, the same rw mode, hipri=0,
// and fixedbufs / registerfiles / sqthread_poll when ours uses them; with
// huge pages, GLIBC_TUNABLES=glibc.malloc.hugetlb=1 and iomem_align=2m, so
// its buffers sit on huge pages as ours do (Note [Huge pages]). The
// figure is the sum over jobs of read.bw_bytes + write.bw_bytes, as fio
// reports it (per-job bytes over per-job time); the aggregate (all bytes over
// the longest job's time) is kept beside it.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "nvme_bench_raw.h"

namespace tzbench {

struct FioSpec {
  std::string fio = "fio";
  std::vector<std::string> files;
  std::uint64_t file_bytes = 0;  // each
  Workload workload = Workload::kRead;
  EngineConfig config;           // block size, queue depth, rings = jobs, fixed buffers/files, sqpoll, direct
  RunLimits limits;
  bool hugepages = false;        // run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (Note [Huge pages])
};

struct FioResult {
  double gbps = 0;            // sum over jobs of bw_bytes, 10^9 B/s
  double aggregate_gbps = 0;  // all jobs' bytes / the longest job's runtime
  std::uint64_t io_bytes = 0;
  double mean_latency_us = 0;  // lat_ns mean, weighted by each job's I/O count
  std::string command;         // with the environment it was given
};

// "fio-3.33", or an error saying why fio cannot be run.
tz::Expected<std::string> fio_version(const std::string& fio);
std::vector<std::string> fio_args(const FioSpec& spec, const std::string& output_path);
tz::Expected<FioResult> run_fio(const FioSpec& spec);
// Runs fio with the arguments make_args(output path) gives (they must write
// --output-format=json to that path), with huge pages as above; its JSON read back.
tz::Expected<FioResult> run_fio_with(const std::function<std::vector<std::string>(const std::string&)>& make_args,
                                     bool hugepages);
// Parses fio's --output-format=json text.
tz::Expected<FioResult> parse_fio_json(const std::string& text);

}  // namespace tzbench
