// Advisory file locks (open file description locks) and lock files.
//
// Note [Open file description locks]
// Three kinds of lock were on offer; OFD locks (fcntl F_OFD_SETLK, Linux
// 3.15) are the ones whose owner is what we mean by "the owner":
// - Classic POSIX locks (F_SETLK) belong to a process: any close() of any
//   descriptor of the file by that process drops them (a probe that opens
//   the swap file to look at it would), a fork()ed child does not inherit
//   them, and two stores of one process never conflict, so a second store
//   would take the first one's file for a dead run's.
// - flock() and OFD locks belong to an open file description: a second open()
//   of the file, even in the same process, conflicts, and closing another
//   descriptor does not drop them. Across fork() the child shares the parent's
//   open file description and so its lock: the file counts as in use while
//   any process holding that descriptor lives. That is the right answer for
//   the engine's forked test ranks (testing/ranks.h): a rank that inherited a
//   store (it never uses it; ranks make their own) keeps the file from being
//   reclaimed under the parent, and neither can release the other's lock.
//   Descriptors are opened O_CLOEXEC, so a program exec()ed from a rank does
//   not hold it.
// - Between those two, OFD locks are POSIX locks to the kernel, so NFS and
//   cluster file systems pass them to the server with the open file
//   description as the owner; flock() on NFS is emulated by a whole-file
//   classic POSIX lock, with classic semantics. A shared NVMe folder across
//   containers is local; a scratch folder on a network mount need not be.
#include "tierzero/common/file_lock.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <string>

#include "tierzero/common/checks.h"
#include "tierzero/common/durable_file.h"
#include "tierzero/common/log.h"

namespace tz {
namespace {

struct flock whole_file_write_lock() {
  struct flock lk {};
  lk.l_type = F_WRLCK;
  lk.l_whence = SEEK_SET;
  lk.l_start = 0;
  lk.l_len = 0;  // to the end, however the file grows
  lk.l_pid = 0;  // required to be 0 for OFD locks
  return lk;
}

// What a lock file's holder wrote into it ("" when nothing could be read).
std::string read_holder(int fd) {
  char buf[256];
  ssize_t n;
  do {
    n = ::pread(fd, buf, sizeof buf - 1, 0);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) return "";
  std::string s(buf, static_cast<std::size_t>(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  return s;
}

}  // namespace

Expected<bool> try_lock_file(int fd, const std::string& path) {
  struct flock lk = whole_file_write_lock();
  int rc;
  do {
    rc = ::fcntl(fd, F_OFD_SETLK, &lk);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return true;
  if (errno == EAGAIN || errno == EACCES) return false;
  return errno_status(errno, fmt::format("locking {} (fcntl F_OFD_SETLK)", path));
}

Status lock_file(int fd, const std::string& path) {
  struct flock lk = whole_file_write_lock();
  int rc;
  do {
    rc = ::fcntl(fd, F_OFD_SETLKW, &lk);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) return errno_status(errno, fmt::format("locking {} (fcntl F_OFD_SETLKW)", path));
  return ok_status();
}

std::string this_process_description() {
  char host[HOST_NAME_MAX + 1] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  return fmt::format("pid {} on {}", ::getpid(), host[0] != '\0' ? host : "an unnamed host");
}

Expected<LockFile> LockFile::acquire(const std::string& path, std::string_view what) {
  TZ_ASSIGN_OR_RETURN(UniqueFd fd, open_file(path, O_RDWR | O_CREAT));
  TZ_ASSIGN_OR_RETURN(bool mine, try_lock_file(fd.get(), path));
  if (!mine) {
    const std::string holder = read_holder(fd.get());
    return unavailable("{}: {} is locked by another process ({}); it is released when that process ends", what, path,
                       holder.empty() ? "it has not said which" : holder);
  }
  // For the messages of those kept out; a failure here only makes them vaguer.
  const std::string me = this_process_description() + "\n";
  if (::ftruncate(fd.get(), 0) != 0 || ::pwrite(fd.get(), me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    TZ_LOG_DEBUG("common", "{}: could not record the holder: errno {}", path, errno);
  }
  return LockFile(path, std::move(fd));
}

}  // namespace tz
