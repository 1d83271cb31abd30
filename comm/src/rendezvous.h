// Where ranks meet: a key-value store through which they exchange, once,
// what Gloo's pairs and NCCL's bootstrap need. Three kinds, one interface:
//   FileRendezvous   a run in a rendezvous directory (Gloo's FileStore); Note [Rendezvous runs]
//   StoreRendezvous  a RendezvousStore on the network (torch's TCPStore); Note [Store rendezvous]
//   MpiRendezvous    MPI point-to-point messages under mpirun; Note [MPI rendezvous]
//
//   TZ_ASSIGN_OR_RETURN(auto rendezvous, open_rendezvous(options));
//   rendezvous->publish_host(address);                        // for errors naming hosts
//   context->connectFullMesh(rendezvous->store(), device);   // may throw
//   ... a barrier: every rank is done reading the store ...
//   rendezvous.reset();   // removes this rank's keys
//
// Every wait in the store ends at open time + timeout, and throws
// gloo::IoException then; failure_status() turns that into a Timeout naming
// where the ranks meet and the ranks that did not arrive (with their hosts
// where they told them).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <string_view>
#include <vector>

#include "tierzero/common.h"
#include "tierzero/comm/communicator.h"

namespace gloo::rendezvous {
class Store;
}  // namespace gloo::rendezvous

namespace tz::comm_detail {

struct ResolvedCommOptions;

class Rendezvous {
 public:
  using Clock = std::chrono::steady_clock;

  virtual ~Rendezvous() = default;

  // Gloo's view of the exchange. Keys written through it are this rank's to
  // remove when the rendezvous closes.
  virtual gloo::rendezvous::Store& store() = 0;
  // "file rendezvous in /tmp/x (run 5f..)", "torch TCPStore at 10.0.0.1:29500 (communicator 3)", "MPI (Open MPI 4.1.4)"
  virtual std::string describe() const = 0;
  // The directory the ranks meet in and this run's id there, for the phase
  // board (comm/src/phase_board.h); none where they meet through a store or MPI.
  virtual std::optional<std::pair<std::string, std::string>> shared_dir_and_run() const { return std::nullopt; }
  // Every rank has read everything (after the barrier that ends creation):
  // the keys this rank wrote may go when the rendezvous closes. Until then
  // they stay, so a rank that fails leaves its host for the others' errors.
  virtual void completed() {}
  Clock::time_point deadline() const { return deadline_; }

  // Tells the other ranks this rank's host and address (for their errors).
  // Best effort: failing to write it only makes errors less specific.
  virtual void publish_host(const std::string& address) = 0;
  // The Status for an exception `what` thrown while the store was in use:
  // Timeout naming where the ranks meet and the missing ranks when a store
  // wait hit the deadline, otherwise `fallback` with the ranks' hosts added.
  Status failure_status(std::string_view what, Status fallback);

 protected:
  Rendezvous(const RankInfo& ranks, std::chrono::milliseconds timeout)
      : ranks_(ranks), timeout_(timeout), deadline_(Clock::now() + timeout) {}

  // The value some rank set at `key` (as Gloo names keys), without waiting.
  virtual std::optional<std::string> peek(const std::string& key) = 0;
  // The keys whose wait hit the deadline (empty when none did).
  virtual std::vector<std::string> timed_out_keys() const = 0;
  // What a rank that did not arrive should check, for the Timeout message.
  virtual std::string hint() const = 0;
  // "rank 0 on hostA (10.0.0.1); rank 1 not heard from": what publish_host() told.
  std::string hosts_line();

  RankInfo ranks_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_;
};

// Opens the rendezvous the options name (store, MPI or directory; see
// comm/communicator.h). Every rank of the group must pick the same kind.
Expected<std::unique_ptr<Rendezvous>> open_rendezvous(const ResolvedCommOptions& options);

Expected<std::unique_ptr<Rendezvous>> open_file_rendezvous(const RankInfo& ranks, const std::string& dir,
                                                           std::chrono::milliseconds timeout);
Expected<std::unique_ptr<Rendezvous>> open_store_rendezvous(const RankInfo& ranks,
                                                            std::shared_ptr<RendezvousStore> store,
                                                            std::chrono::milliseconds timeout);
// Defined only in builds with MPI (TIERZERO_WITH_MPI).
Expected<std::unique_ptr<Rendezvous>> open_mpi_rendezvous(const RankInfo& ranks, std::chrono::milliseconds timeout);

// "tierzero/127.0.0.1:29500/<run>/3" or ".../rank_3" -> 3; -1 for other keys.
int rank_of_key(std::string_view key);
// This machine's name ("?" when it has none).
std::string host_name();
// The key publish_host() writes for `rank`.
std::string host_key(int rank);

}  // namespace tz::comm_detail
