// tierzero-nvme-bench's shared pieces (beyond bench_common.h): size flags,
// host buffers, the scratch files striped over the paths, and the page cache.
//
// Scratch files are created exclusively in each --path as
// tierzero-nvme-bench-<pid>-<n>.bin, reserved with fallocate, and removed by
// ScratchFiles' destructor, on any error, and by SIGINT/SIGTERM (the signal
// handler unlinks every registered path, then exits 128 + signal).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bench_common.h"
#include "tierzero/common.h"
#include "tierzero/nvme.h"

namespace tzbench {

// Byte sizes ("128KiB,1MiB"; a bare K/M/G means KiB/MiB/GiB here, as fio's bs does).
tz::Expected<std::vector<std::uint64_t>> parse_byte_list(const std::string& flag, const std::string& text);
tz::Expected<std::uint64_t> parse_size(const std::string& flag, const std::string& text);
tz::Expected<std::vector<int>> parse_int_list(const std::string& flag, const std::string& text, int lo, int hi);

// Anonymous memory aligned to 2 MiB, unmapped on destruction. With
// `hugepages`, madvise(MADV_HUGEPAGE) before the first touch, so transparent
// huge pages back it where the kernel allows (see Note [Huge pages]); without,
// first touched by the kernel's pinning (Note [First touch by pinning]).
class HostBuffer {
 public:
  HostBuffer() = default;
  static tz::Expected<HostBuffer> map(std::size_t bytes, bool hugepages);
  char* data() const { return data_; }
  std::size_t size_bytes() const { return bytes_; }
  // Fills with xorshift64* output from `seed` (incompressible, reproducible).
  void fill_random(std::uint64_t seed);

 private:
  tz::MappedRegion region_;
  char* data_ = nullptr;  // region_ rounded up to 2 MiB
  std::size_t bytes_ = 0;
};

// Note [Huge pages]
// A buffer on 4 KiB pages is physically scattered: every page is a DMA
// segment, so the block layer splits a 1 MiB piece into requests of at most
// max_segments pages (and, with io_uring fixed buffers, 512 KiB here) and
// cannot merge neighbours. On 2 MiB pages a piece is one or two segments and
// neighbouring pieces merge up to max_sectors_kb. On the virtio disk of the
// machine this was written on that is 1.2 vs 3.3 GB/s for 1 MiB reads at
// depth 16. fio gets the same chance: its buffers come from malloc, and with
// huge pages on it runs with GLIBC_TUNABLES=glibc.malloc.hugetlb=1, which makes
// glibc madvise them, and iomem_align=2m, which starts them on a huge page.

// Note [First touch by pinning]
// On 4 KiB pages what a buffer's pages are depends on who touches them first.
// Touched by the process (a fill loop), consecutive pages came out physically
// scattered (/proc/self/pagemap here: 7012 runs of contiguous frames over 8192
// pages); faulted in by the kernel's pinning (an io_uring buffer registration,
// as fio's buffers are when it registers them or when its first O_DIRECT I/O
// pins them) they came out in runs (2671 runs), which the block layer merges
// into fewer segments. Sequential 1 MiB reads at depth 32 went from 1.24-1.47
// to 1.99-2.13 GB/s, fio's 2.15 (bench/RESULTS.md, issue #25). So without huge
// pages a bench buffer is faulted in through a throwaway registration before
// anything writes it; fio's first touch is the kernel's too.

// The largest buffer the kernel registers in one io_uring fixed-buffer slot
// (io_uring/rsrc.c refuses iov_len > 1 GiB).
inline constexpr std::size_t kMaxFixedBufferBytes = std::size_t{1} << 30;

// Registers [data, data + bytes) with the engine in chunks of at most
// kMaxFixedBufferBytes, each a multiple of `unit`; returns the chunk starts
// for unregistering. The engine would split a larger range over 1 GiB slots
// itself, but from the range's start: a `unit` that does not divide 1 GiB
// would leave a piece across each boundary on the plain path. Chunks of whole
// units keep every piece of unit-aligned requests inside one slot.
tz::Expected<std::vector<void*>> register_chunks(tz::nvme::IoEngine& engine, char* data, std::size_t bytes,
                                                 std::size_t unit);
void unregister_chunks(tz::nvme::IoEngine& engine, const std::vector<void*>& chunks);

// Removes registered paths on SIGINT/SIGTERM. At most kMaxCleanupPaths.
void install_signal_cleanup();
void add_cleanup_path(const std::string& path);
void remove_cleanup_path(const std::string& path);

// One scratch file per path, each file_bytes long (the benchmark's file is
// striped across them). Removed on destruction.
class ScratchFiles {
 public:
  ScratchFiles() = default;
  static tz::Expected<ScratchFiles> create(const std::vector<std::string>& dirs, std::uint64_t file_bytes,
                                           const std::string& tag);
  ScratchFiles(ScratchFiles&& other) noexcept;
  ScratchFiles& operator=(ScratchFiles&& other) noexcept;
  ScratchFiles(const ScratchFiles&) = delete;
  ScratchFiles& operator=(const ScratchFiles&) = delete;
  ~ScratchFiles();

  const std::vector<std::string>& paths() const { return paths_; }
  std::uint64_t file_bytes() const { return file_bytes_; }          // each
  std::uint64_t total_bytes() const { return file_bytes_ * paths_.size(); }

 private:
  void remove_all();
  std::vector<std::string> paths_;
  std::uint64_t file_bytes_ = 0;
};

// Fails with NoSpace naming the directory, the bytes needed there and the bytes
// free when `need_bytes` exceeds the free space under `dir`.
tz::Status check_free_space(const std::string& dir, std::uint64_t need_bytes, const std::string& what);

// Where the benchmark runs buffered: writes back dirty pages and drops the
// page cache between runs (echo 1 > /proc/sys/vm/drop_caches) where allowed.
class PageCache {
 public:
  explicit PageCache(bool buffered);
  // Before a run; a no-op for O_DIRECT.
  void drop() const;
  bool buffered() const { return buffered_; }
  bool can_drop() const { return can_drop_; }
  // "" for O_DIRECT; else what the buffered figures mean.
  std::string note() const;

 private:
  bool buffered_;
  bool can_drop_ = false;
};

}  // namespace tzbench
