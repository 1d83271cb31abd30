// Swap files on disk: their names, the locks that say whose they are, and
// the process-wide list a signal handler removes them by (Note [Swap file
// ownership] in swap_files.cpp; reclaim_stale_swap_files is public, in
// swap_store.h). Private to nvme/; SwapStore uses it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tierzero/common.h"
#include "tierzero/nvme/swap_store.h"

namespace tz::nvme::detail {

// Every swap file is named <kSwapPrefix><16 hex digits><kSwapSuffix>; a file
// in a swap folder with this prefix and suffix is a swap file of some run.
inline constexpr std::string_view kSwapPrefix = "tierzero-swap-";
inline constexpr std::string_view kSwapSuffix = ".bin";

// A swap file of this process: created exclusively in `dir` under a fresh
// random name and locked through `lock`, its own open of the file (held for
// the store's life; the I/O engine opens the file separately).
struct OwnedSwapFile {
  std::string path;
  UniqueFd lock;
};
Expected<OwnedSwapFile> create_owned_swap_file(const std::string& dir);

// Lists `path` for remove_swap_files_now() until the object is destroyed.
// A full list (more than kExitSlots live swap files) or a path too long for a
// slot is logged once and left off: the file is then removed by its store
// only, or reclaimed by the next run.
class ExitRemoval {
 public:
  static constexpr int kExitSlots = 64;
  static constexpr std::size_t kMaxPathBytes = 1024;
  ExitRemoval() = default;
  explicit ExitRemoval(const std::string& path);
  ~ExitRemoval() { reset(); }
  ExitRemoval(ExitRemoval&& other) noexcept : slot_(std::exchange(other.slot_, -1)) {}
  ExitRemoval& operator=(ExitRemoval&& other) noexcept;
  ExitRemoval(const ExitRemoval&) = delete;
  ExitRemoval& operator=(const ExitRemoval&) = delete;

 private:
  void reset();
  int slot_ = -1;
};

}  // namespace tz::nvme::detail
