#include "tierzero/common/probe.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;

constexpr long kTmpfsMagic = 0x01021994;

bool is_power_of_two(std::uint32_t v) { return v != 0 && (v & (v - 1)) == 0; }

long filesystem_magic(const std::string& path) {
  struct statfs st {};
  return ::statfs(path.c_str(), &st) == 0 ? static_cast<long>(st.f_type) : -1;
}

// A fresh directory made with mkdtemp under `parent`, removed with its contents
// at the end of the test (unmounting it first if the test mounted a tmpfs there).
class TempDir {
 public:
  explicit TempDir(const std::string& parent) {
    std::string pattern = parent + "/tz-probe-test-XXXXXX";
    if (::mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TempDir() {
    if (path_.empty()) return;
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  void set_mounted() { mounted_ = true; }

 private:
  std::string path_;
  bool mounted_ = false;
};

// A directory on the disk the build lives on: /var/tmp, or the current
// directory where /var/tmp is itself in memory.
std::string work_disk_parent() {
  if (fs::is_directory("/var/tmp") && filesystem_magic("/var/tmp") != kTmpfsMagic) return "/var/tmp";
  return fs::current_path().string();
}

size_t entries_in(const std::string& dir) {
  return static_cast<size_t>(std::distance(fs::directory_iterator(dir), fs::directory_iterator()));
}

// Kept first: the first calls to capabilities() in this process race here.
TEST(Capabilities, ConcurrentFirstCallsShareOneProbe) {
  constexpr int kThreads = 8;
  std::vector<const tz::Capabilities*> seen(kThreads, nullptr);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&seen, i] { seen[static_cast<size_t>(i)] = &tz::capabilities(); });
  }
  for (auto& t : threads) t.join();
  for (const auto* caps : seen) EXPECT_EQ(caps, seen[0]);
}

TEST(Capabilities, IsCachedAcrossCalls) {
  EXPECT_EQ(&tz::capabilities(), &tz::capabilities());
}

TEST(Capabilities, ReportsKernelRelease) {
  EXPECT_FALSE(tz::capabilities().kernel_release.empty());
}

TEST(Capabilities, IoUringHasReadWriteOrSaysWhyNot) {
  const tz::UringCapabilities& uring = tz::capabilities().uring;
  if (!uring.available) {
    EXPECT_FALSE(uring.unavailable_reason.empty());
    return;
  }
  EXPECT_TRUE(uring.unavailable_reason.empty());
  EXPECT_NE(uring.features, 0u);
  EXPECT_TRUE(uring.has_op_read);
  EXPECT_TRUE(uring.has_op_write);
  EXPECT_EQ(std::count(uring.missing_ops.begin(), uring.missing_ops.end(), "READ"), 0);
}

TEST(Capabilities, CountsLogicalCpus) {
  const tz::CpuCapabilities& cpu = tz::capabilities().cpu;
  int hw = static_cast<int>(std::thread::hardware_concurrency());
  int online = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  EXPECT_TRUE(cpu.logical_cpus == hw || cpu.logical_cpus == online)
      << cpu.logical_cpus << " vs hardware_concurrency " << hw << ", online " << online;
  EXPECT_FALSE(cpu.model.empty());
}

TEST(Capabilities, BestSimdAgreesWithCpuFlags) {
  const tz::CpuCapabilities& cpu = tz::capabilities().cpu;
  ASSERT_FALSE(cpu.best_simd.empty());
  bool says_avx512 = cpu.best_simd.starts_with("avx512");
  bool says_avx2 = cpu.best_simd.find("avx2") != std::string::npos;
  // Each line reads "flag => what best_simd must say".
  EXPECT_TRUE(cpu.avx512f || !says_avx512) << cpu.best_simd;
  EXPECT_TRUE(cpu.avx2 || !says_avx2) << cpu.best_simd;
  EXPECT_TRUE(!cpu.avx2 || says_avx2 || says_avx512) << cpu.best_simd;
  EXPECT_TRUE(!cpu.avx512bw || says_avx512) << cpu.best_simd;
}

TEST(Capabilities, NumaNodesCoverCpuZeroAndHaveMemory) {
  const tz::Capabilities& caps = tz::capabilities();
  ASSERT_FALSE(caps.numa_nodes.empty()) << caps.numa_error;
  EXPECT_TRUE(caps.numa_error.empty()) << caps.numa_error;
  std::set<int> cpus;
  for (const tz::NumaNode& node : caps.numa_nodes) {
    cpus.insert(node.cpus.begin(), node.cpus.end());
  }
  EXPECT_TRUE(cpus.contains(0));
  std::uint64_t memory = 0;
  for (const tz::NumaNode& node : caps.numa_nodes) memory += node.memory_bytes;
  EXPECT_GT(memory, 0u);
}

TEST(Capabilities, MemoryTotalAtLeastAvailable) {
  const tz::MemoryCapabilities& memory = tz::capabilities().memory;
  EXPECT_GT(memory.available_bytes, 0u);
  EXPECT_GE(memory.total_bytes, memory.available_bytes);
  EXPECT_GT(memory.memlock_limit_bytes, 0u);
}

TEST(Capabilities, CudaDevicesMatchCountOrStatusSaysWhy) {
  const tz::CudaCapabilities& cuda = tz::capabilities().cuda;
  EXPECT_FALSE(cuda.status.empty());
  EXPECT_EQ(cuda.devices.size(), static_cast<size_t>(cuda.device_count));
  if (!cuda.compiled) {
    EXPECT_EQ(cuda.device_count, 0);
    EXPECT_NE(cuda.status.find("without CUDA"), std::string::npos) << cuda.status;
    return;
  }
  EXPECT_GT(cuda.runtime_version, 0);
  if (cuda.driver_version == 0) {  // no libcuda: said as such, not as an "insufficient" driver
    EXPECT_TRUE(cuda.status.starts_with("no CUDA driver")) << cuda.status;
  }
  if (cuda.device_count == 0) {
    EXPECT_NE(cuda.status, "ok");
    return;
  }
  EXPECT_EQ(cuda.status, "ok");
  for (const tz::GpuDevice& gpu : cuda.devices) {
    EXPECT_GE(gpu.cc_major, 7) << gpu.name;
    EXPECT_GT(gpu.total_memory_bytes, 0u);
    EXPECT_FALSE(gpu.pci_bus_id.empty());
  }
}

TEST(Capabilities, FreshProbeAgreesWithCachedOne) {
  tz::Capabilities fresh = tz::probe_capabilities();
  const tz::Capabilities& cached = tz::capabilities();
  EXPECT_EQ(fresh.kernel_release, cached.kernel_release);
  EXPECT_EQ(fresh.cpu.best_simd, cached.cpu.best_simd);
  EXPECT_EQ(fresh.numa_nodes.size(), cached.numa_nodes.size());
  EXPECT_EQ(fresh.cuda.device_count, cached.cuda.device_count);
}

TEST(Capabilities, DescribeNamesTheKeyFacts) {
  const tz::Capabilities& caps = tz::capabilities();
  std::string text = tz::describe(caps);
  for (const char* key : {"kernel:", "io_uring:", "CPU:", "NUMA:", "memory:", "CUDA:", "memlock limit"}) {
    EXPECT_NE(text.find(key), std::string::npos) << key << " missing from\n" << text;
  }
  EXPECT_NE(text.find(caps.kernel_release), std::string::npos);
  EXPECT_NE(text.find(caps.cpu.best_simd), std::string::npos);
  EXPECT_NE(text.find(caps.cpu.model), std::string::npos);
  if (caps.uring.available) {
    EXPECT_NE(text.find("io_uring: available"), std::string::npos) << text;
  }
}

TEST(ProbePath, WorkDiskDoesDirectIo) {
  TempDir dir(work_disk_parent());
  ASSERT_TRUE(dir.ok()) << "mkdtemp under " << work_disk_parent();
  tz::Expected<tz::PathCapabilities> caps = tz::probe_path(dir.path());
  ASSERT_TRUE(caps.ok()) << caps.status().to_string();
  EXPECT_EQ(caps->path, dir.path());
  EXPECT_TRUE(caps->o_direct_accepted);
  EXPECT_TRUE(caps->o_direct) << caps->note;
  EXPECT_TRUE(caps->note.empty()) << caps->note;
  // Offsets and lengths align to the logical block size; NVMe drives may
  // report a memory alignment as small as 4 bytes.
  EXPECT_TRUE(is_power_of_two(caps->dio_offset_align)) << caps->dio_offset_align;
  EXPECT_GE(caps->dio_offset_align, 512u);
  EXPECT_LE(caps->dio_offset_align, 4096u);
  EXPECT_TRUE(is_power_of_two(caps->dio_mem_align)) << caps->dio_mem_align;
  EXPECT_GE(caps->dio_mem_align, 1u);
  EXPECT_LE(caps->dio_mem_align, 4096u);
  EXPECT_FALSE(caps->device.empty());
  EXPECT_FALSE(caps->filesystem.empty());
  EXPECT_EQ(caps->filesystem.find("unknown"), std::string::npos) << caps->filesystem;
  EXPECT_GT(caps->total_bytes, 0u);
  EXPECT_GE(caps->total_bytes, caps->free_bytes);
}

TEST(ProbePath, TmpfsIsNotADirectIoTier) {
  // /dev/shm is tmpfs on Linux; where it is missing, mount a tmpfs ourselves.
  std::string parent = "/dev/shm";
  TempDir mount_point(work_disk_parent());
  if (!fs::is_directory(parent) || filesystem_magic(parent) != kTmpfsMagic) {
    ASSERT_TRUE(mount_point.ok());
    ASSERT_EQ(::mount("tmpfs", mount_point.path().c_str(), "tmpfs", 0, "size=16m"), 0)
        << "/dev/shm is not a tmpfs and mounting one failed (errno " << errno << ")";
    mount_point.set_mounted();
    parent = mount_point.path();
  }
  TempDir dir(parent);
  ASSERT_TRUE(dir.ok()) << "mkdtemp under " << parent;
  tz::Expected<tz::PathCapabilities> caps = tz::probe_path(dir.path());
  ASSERT_TRUE(caps.ok()) << caps.status().to_string();
  EXPECT_EQ(caps->filesystem, "tmpfs");
  EXPECT_FALSE(caps->o_direct);
  EXPECT_EQ(caps->dio_mem_align, 0u);
  EXPECT_EQ(caps->dio_offset_align, 0u);
  EXPECT_TRUE(caps->device.empty()) << caps->device;
  EXPECT_NE(caps->note.find("tmpfs"), std::string::npos) << caps->note;
}

TEST(ProbePath, MissingDirectoryIsNotFoundNamingThePath) {
  TempDir dir(work_disk_parent());
  ASSERT_TRUE(dir.ok());
  std::string missing = dir.path() + "/does-not-exist";
  tz::Expected<tz::PathCapabilities> caps = tz::probe_path(missing);
  ASSERT_FALSE(caps.ok());
  EXPECT_EQ(caps.status().code(), tz::ErrorCode::kNotFound);
  EXPECT_NE(caps.status().message().find(missing), std::string::npos) << caps.status().message();
}

TEST(ProbePath, RegularFileIsInvalidArgument) {
  TempDir dir(work_disk_parent());
  ASSERT_TRUE(dir.ok());
  std::string file = dir.path() + "/plain-file";
  std::ofstream(file) << "x";
  tz::Expected<tz::PathCapabilities> caps = tz::probe_path(file);
  ASSERT_FALSE(caps.ok());
  EXPECT_EQ(caps.status().code(), tz::ErrorCode::kInvalidArgument);
  EXPECT_NE(caps.status().message().find(file), std::string::npos) << caps.status().message();
}

TEST(ProbePath, UnwritableDirectoryIsPermissionDenied) {
  // Root ignores mode bits, so use /proc: no one can create a file there.
  tz::Expected<tz::PathCapabilities> caps = tz::probe_path("/proc");
  ASSERT_FALSE(caps.ok());
  EXPECT_EQ(caps.status().code(), tz::ErrorCode::kPermissionDenied) << caps.status().to_string();
  EXPECT_NE(caps.status().message().find("/proc"), std::string::npos) << caps.status().message();
  EXPECT_NE(caps.status().message().find("not writable"), std::string::npos) << caps.status().message();
}

TEST(ProbePath, LeavesNoFileBehind) {
  TempDir dir(work_disk_parent());
  ASSERT_TRUE(dir.ok());
  ASSERT_TRUE(tz::probe_path(dir.path()).ok());
  EXPECT_EQ(entries_in(dir.path()), 0u);
}

TEST(ProbePath, IsCachedPerPath) {
  TempDir dir(work_disk_parent());
  ASSERT_TRUE(dir.ok());
  tz::Expected<tz::PathCapabilities> first = tz::probe_path(dir.path());
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  // Another spelling of the same directory hits the cache and keeps its own name.
  tz::Expected<tz::PathCapabilities> second = tz::probe_path(dir.path() + "/./");
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  EXPECT_EQ(second->path, dir.path() + "/./");
  EXPECT_EQ(second->filesystem, first->filesystem);
  EXPECT_EQ(second->dio_offset_align, first->dio_offset_align);
  EXPECT_EQ(second->total_bytes, first->total_bytes);
}

TEST(ProbePath, MeasuredAlignmentMatchesWhatTheKernelReports) {
  TempDir dir(work_disk_parent());
  ASSERT_TRUE(dir.ok());
  tz::Expected<tz::PathCapabilities> caps = tz::probe_path(dir.path());
  ASSERT_TRUE(caps.ok()) << caps.status().to_string();
  ASSERT_TRUE(caps->o_direct) << caps->note;
  std::string file = dir.path() + "/measure";
  int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_DIRECT | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0) << "errno " << errno;
  std::uint32_t mem_align = 0, offset_align = 0;
  tz::Status status = tz::detail::measure_dio_alignment(fd, &mem_align, &offset_align);
  ::close(fd);
  ASSERT_TRUE(status.ok()) << status.to_string();
  EXPECT_EQ(offset_align, std::max<std::uint32_t>(caps->dio_offset_align, 512));
  EXPECT_EQ(mem_align, std::max<std::uint32_t>(caps->dio_mem_align, 512));
}

TEST(ProbePath, DescribeNamesTheKeyFacts) {
  TempDir dir(work_disk_parent());
  ASSERT_TRUE(dir.ok());
  tz::Expected<tz::PathCapabilities> caps = tz::probe_path(dir.path());
  ASSERT_TRUE(caps.ok()) << caps.status().to_string();
  std::string text = tz::describe(*caps);
  EXPECT_EQ(text.rfind(dir.path() + ": " + caps->filesystem, 0), 0u) << text;
  EXPECT_NE(text.find("on " + caps->device), std::string::npos) << text;
  EXPECT_NE(text.find("free of"), std::string::npos) << text;
  EXPECT_NE(text.find("O_DIRECT yes"), std::string::npos) << text;
  EXPECT_NE(text.find("offset align"), std::string::npos) << text;

  tz::PathCapabilities tmpfs;
  tmpfs.path = "/dev/shm/x";
  tmpfs.filesystem = "tmpfs";
  tmpfs.o_direct_accepted = true;
  tmpfs.note = "tmpfs: O_DIRECT is accepted but data stays in memory";
  std::string tmpfs_text = tz::describe(tmpfs);
  EXPECT_NE(tmpfs_text.find("O_DIRECT no"), std::string::npos) << tmpfs_text;
  EXPECT_NE(tmpfs_text.find("no block device"), std::string::npos) << tmpfs_text;
  EXPECT_NE(tmpfs_text.find(tmpfs.note), std::string::npos) << tmpfs_text;
}

}  // namespace
