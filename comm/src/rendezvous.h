// Where ranks meet: a run in the rendezvous directory, and a key-value store
// (Gloo's FileStore) scoped to that run. Gloo exchanges pair addresses
// through it; NCCL its ncclUniqueId. See Note [Rendezvous runs] in the .cpp.
//
//   TZ_ASSIGN_OR_RETURN(auto rendezvous, Rendezvous::join(ranks, dir, timeout));
//   context->connectFullMesh(rendezvous->store(), device);   // may throw
//   ... a barrier: every rank is done reading the store ...
//   rendezvous.reset();   // removes this rank's files
//
// Every wait in the store ends at join time + timeout, and throws
// gloo::IoException then; failure_status() turns that into a Timeout naming
// the directory and the ranks that did not arrive.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tierzero/common.h"
#include "tierzero/comm/communicator.h"

namespace gloo::rendezvous {
class Store;
class PrefixStore;
}  // namespace gloo::rendezvous

namespace tz::comm_detail {

class DeadlineFileStore;

class Rendezvous {
 public:
  using Clock = std::chrono::steady_clock;

  // Rank 0 publishes a new run for (master_addr, master_port) in `dir`; the
  // other ranks wait (until the timeout) for a run that a live rank 0 holds.
  // AlreadyExists when another live job's rank 0 holds the same run file.
  static Expected<std::unique_ptr<Rendezvous>> join(const RankInfo& ranks, const std::string& dir,
                                                    std::chrono::milliseconds timeout);
  // Removes the keys this rank wrote; rank 0 also withdraws the run file.
  // Destroy only when every rank is past its last read of the store (after
  // a barrier), or on failure.
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  gloo::rendezvous::Store& store();
  const std::string& dir() const { return dir_; }
  const std::string& run_id() const { return run_id_; }
  Clock::time_point deadline() const { return deadline_; }

  // The Status for an exception `what` thrown while the store was in use:
  // Timeout naming the directory and the missing ranks when a store wait hit
  // the deadline, otherwise `fallback`.
  Status failure_status(std::string_view what, Status fallback) const;

 private:
  Rendezvous(RankInfo ranks, std::string dir, std::chrono::milliseconds timeout);
  Status open_store();

  RankInfo ranks_;
  std::string dir_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_;
  std::string run_path_;
  std::string run_id_;
  UniqueFd run_fd_;  // rank 0: the published run file, flock()ed while the rendezvous is open
  std::unique_ptr<DeadlineFileStore> files_;
  std::unique_ptr<gloo::rendezvous::PrefixStore> store_;
};

}  // namespace tz::comm_detail
