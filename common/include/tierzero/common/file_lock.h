// Advisory file locks: who owns a scratch file, who is saving into a folder.
//
// The locks are Linux open file description (OFD) locks on the whole file
// (Note [Open file description locks]): a lock belongs to one open() of the
// file, lasts until every descriptor sharing that open is closed (close,
// exit, kill -9: the kernel drops it), and conflicts with every other open()
// of the file, in this process or another. Advisory: only code that asks for
// the lock is kept out.
//
//   TZ_ASSIGN_OR_RETURN(tz::UniqueFd fd, tz::open_file(path, O_RDWR | O_CREAT));
//   TZ_ASSIGN_OR_RETURN(bool mine, tz::try_lock_file(fd.get(), path));
//   if (!mine) ...   // another open() of it holds the lock: a live owner
//
//   // A lock file: held while a save runs; the loser's error names the holder.
//   TZ_ASSIGN_OR_RETURN(tz::LockFile lock, tz::LockFile::acquire(dir + "/.tierzero-save.lock", "saving into " + dir));
//
// Thread safety: the functions touch no shared state; a LockFile is owned by
// one thread at a time.
#pragma once

#include <string>
#include <string_view>

#include "tierzero/common/handles.h"
#include "tierzero/common/status.h"

namespace tz {

// Takes an exclusive lock on the whole of the open file `fd` without
// waiting. true: taken; false: another open file description holds a lock on
// it. An error (EINVAL from a file system without OFD locks, say) names `path`.
Expected<bool> try_lock_file(int fd, const std::string& path);
// The same, waiting for the lock.
[[nodiscard]] Status lock_file(int fd, const std::string& path);

// "pid <pid> on <host>", what a lock holder writes into its lock file.
std::string this_process_description();

// A file held locked for as long as the object lives; the holder writes
// this_process_description() into it, for the messages of those it keeps
// out (never to decide anything: PIDs repeat across containers). The file
// stays when the lock is released: removing it would let a new holder lock
// a file that a waiting one then no longer finds by its name.
class LockFile {
 public:
  LockFile() = default;
  // Opens `path` (creating it, 0644) and takes its lock without waiting.
  // Held elsewhere: kUnavailable "<what>: <path> is locked by pid N on H".
  static Expected<LockFile> acquire(const std::string& path, std::string_view what);
  bool held() const { return fd_.valid(); }
  const std::string& path() const { return path_; }
  void release() { fd_.reset(); }

 private:
  LockFile(std::string path, UniqueFd fd) : path_(std::move(path)), fd_(std::move(fd)) {}
  std::string path_;
  UniqueFd fd_;
};

}  // namespace tz
