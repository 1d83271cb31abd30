// The checkpoint directory's writing side: the streaming O_DIRECT writer,
// tags, and the exchange that publishes a checkpoint and prunes old ones
// (checkpoint_files.h; the reading side is checkpoint_files.cpp).
#include "checkpoint_files.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE (glibc 2.28)
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tierzero/common/durable_file.h"
#include "tierzero/common/log.h"
#include "tierzero/common/units.h"
#include "tierzero/nvme.h"

namespace tz::detail {

namespace fs = std::filesystem;

std::string hex(std::uint64_t x) { return fmt::format("{:016x}", x); }

// Note [Checkpoint files bypass the page cache]
// A checkpoint's states are gigabytes written once and not read back soon.
// Written through the page cache, the kernel's copy into it set the pace: on
// the CI machine a 3 GiB save ran at 0.3-0.5 GB/s, two thirds of its CPU time
// in copy_folio_from_iter_atomic, against 6 GB/s for O_DIRECT writes to the
// same disk (bench/RESULTS.md). So FileWriter writes with O_DIRECT, whole 4 KiB
// blocks from aligned memory: the caller's where it is aligned, else through
// an aligned buffer. The last partial block goes through the page cache (O_DIRECT
// cleared with fcntl) before the fsync. A file system that refuses O_DIRECT
// (tmpfs) gets plain buffered writes.
Expected<FileWriter> FileWriter::open(const std::string& path) {
  FileWriter w;
  w.path_ = path;
  const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  if (Expected<UniqueFd> direct = open_file(path, flags | O_DIRECT); direct.ok()) {
    w.fd_ = std::move(*direct);
    w.buffer_.reset(static_cast<char*>(std::aligned_alloc(kAlign, kBuffer)));
    if (w.buffer_ == nullptr) return out_of_memory("checkpoint: no memory for a {} write buffer", kBuffer);
  } else {
    TZ_ASSIGN_OR_RETURN(w.fd_, open_file(path, flags));
  }
  return w;
}

Status FileWriter::append(const void* data, std::size_t bytes) {
  if (buffer_ == nullptr) return write_all(fd_.get(), data, bytes, path_);
  const char* p = static_cast<const char*>(data);
  if (used_ == 0 && reinterpret_cast<std::uintptr_t>(p) % kAlign == 0) {  // straight from the caller's memory
    const std::size_t whole = bytes / kAlign * kAlign;
    TZ_TRY(write_all(fd_.get(), p, whole, path_));
    p += whole;
    bytes -= whole;
  }
  while (bytes > 0) {
    const std::size_t n = std::min(bytes, kBuffer - used_);
    std::memcpy(buffer_.get() + used_, p, n);
    used_ += n;
    p += n;
    bytes -= n;
    if (used_ == kBuffer) {
      TZ_TRY(write_all(fd_.get(), buffer_.get(), kBuffer, path_));
      used_ = 0;
    }
  }
  return ok_status();
}

Status FileWriter::finish() {
  if (buffer_ != nullptr && used_ > 0) {
    const std::size_t whole = used_ / kAlign * kAlign;
    TZ_TRY(write_all(fd_.get(), buffer_.get(), whole, path_));
    if (whole < used_) {
      const int flags = ::fcntl(fd_.get(), F_GETFL);
      if (flags < 0 || ::fcntl(fd_.get(), F_SETFL, flags & ~O_DIRECT) != 0) {
        return errno_status(errno, "writing " + path_);
      }
      TZ_TRY(write_all(fd_.get(), buffer_.get() + whole, used_ - whole, path_));
    }
    used_ = 0;
  }
  if (::fsync(fd_.get()) != 0) return errno_status(errno, "syncing " + path_);
  return fd_.close();
}

// n floats (at least one) at a FileWriter::kAlign boundary, for O_DIRECT.
Expected<AlignedFloats> aligned_floats(std::uint64_t n) {
  const std::uint64_t bytes = align_up(std::max<std::uint64_t>(n, 1) * 4, FileWriter::kAlign);
  AlignedFloats memory(static_cast<float*>(std::aligned_alloc(FileWriter::kAlign, bytes)), &std::free);
  if (memory == nullptr) return out_of_memory("checkpoint: no memory for a {}-byte state buffer", bytes);
  return memory;
}

Status check_tag(const std::string& tag) {
  if (tag.empty() || tag == "." || tag == ".." || tag.find('/') != std::string::npos ||
      tag.find('\0') != std::string::npos || tag.size() > 200) {
    return invalid_argument("checkpoint tag '{}' is not a directory name (1 to 200 characters, no '/', not '.' or '..')",
                            tag);
  }
  if (tag == "latest" || tag == "latest.tmp" || tag.ends_with(".partial")) {
    return invalid_argument("checkpoint tag '{}' is a name the checkpoint directory uses itself ('latest', "
                            "'latest.tmp', '*.partial')",
                            tag);
  }
  return ok_status();
}

// Note [Replacing a checkpoint]
// Saving under an existing tag must not leave a moment with no complete
// checkpoint there: `latest` may point at it, and a crash would leave it
// dangling. So the new one is written beside it (<tag>.partial) and the two
// directories swap names in one renameat2(RENAME_EXCHANGE); the old one, now
// <tag>.partial, is then removed (or, after a crash, by the next save of that
// tag). A file system without the exchange gets an error, not a replacement
// that could lose both.
static Status exchange(const std::string& a, const std::string& b) {
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return ok_status();
  const int err = errno;
  if (err == EINVAL || err == ENOSYS || err == ENOTSUP) {
    return failed_precondition("checkpoint: replacing {} needs an atomic exchange of directories (renameat2 "
                               "RENAME_EXCHANGE), which this file system refuses; save under a new tag",
                               b);
  }
  return errno_status(err, "checkpoint: exchanging " + a + " with " + b);
}

Status publish(const std::string& partial, const std::string& final_dir) {
  std::error_code ec;
  if (!fs::exists(final_dir, ec)) {
    fs::rename(partial, final_dir, ec);
    if (ec) return io_error("checkpoint: renaming {} to {}: {}", partial, final_dir, ec.message());
    return ok_status();
  }
  TZ_TRY(exchange(partial, final_dir));
  // The exchange is durable before the replaced checkpoint's files go: after
  // a power loss <tag> is the new checkpoint or the whole old one.
  TZ_TRY(sync_directory(fs::path(final_dir).parent_path().string()));
  fs::remove_all(partial, ec);  // the replaced checkpoint
  if (ec) TZ_LOG_WARN("engine", "checkpoint: the replaced checkpoint {} could not be removed: {}", partial, ec.message());
  return ok_status();
}

Expected<std::vector<std::string>> prune_checkpoints(const std::string& dir, int keep,
                                                     const std::vector<std::string>& keep_too) {
  struct Found {
    std::int64_t step;
    fs::file_time_type time;
    std::string name;
  };
  std::vector<Found> found;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory(ec) || !check_tag(name).ok() || !fs::exists(e.path() / "manifest.json", ec)) continue;
    Expected<Manifest> m = read_manifest(e.path().string());
    if (!m.ok()) continue;  // not ours to judge, nor to remove
    found.push_back({m->step, fs::last_write_time(e.path() / "manifest.json", ec), name});
  }
  if (ec) return io_error("checkpoint: listing {}: {}", dir, ec.message());
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return a.step != b.step ? a.step > b.step : a.time > b.time;  // newest first
  });
  std::vector<std::string> removed;
  for (std::size_t i = static_cast<std::size_t>(std::max(keep, 0)); i < found.size(); ++i) {
    if (std::find(keep_too.begin(), keep_too.end(), found[i].name) != keep_too.end()) continue;
    const std::string path = dir + "/" + found[i].name;
    if (!fs::remove(path + "/manifest.json", ec) || ec) {
      return io_error("checkpoint: removing {}/manifest.json (keep_last): {}", path, ec.message());
    }
    TZ_TRY(sync_directory(path));
    fs::remove_all(path, ec);
    if (ec) return io_error("checkpoint: removing {} (keep_last): {}", path, ec.message());
    removed.push_back(found[i].name);
  }
  return removed;
}

// A file system that cannot exchange (NFS, some FUSE ones) is found out on two
// empty directories before anything is written, not after every rank has
// written its shards.
Status probe_exchange(const std::string& final_dir) {
  const std::string a = final_dir + ".exchange-a.partial", b = final_dir + ".exchange-b.partial";
  std::error_code ec;
  fs::create_directories(a, ec);
  if (!ec) fs::create_directories(b, ec);
  if (ec) return errno_status(ec.value(), fmt::format("checkpoint: preparing {}", a));
  const Status exchanged = exchange(a, b);
  fs::remove_all(a, ec);
  fs::remove_all(b, ec);
  return exchanged;
}

// A manifest's format version, if this tierzero reads it (file names it for the error).

}  // namespace tz::detail
