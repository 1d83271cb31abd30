// RankAgreement: the collective checks that come before work every rank must
// do alike (a save, a load, creating an engine, a broadcast), and small host
// transfers, over a Communicator.
//
// Each check is a collective: every rank calls it at the same point, and all
// of them return the same verdict. A rank that refuses (passes a failed
// Status) returns its own reason; the others learn how many refused. Values
// are compared through a 62-bit hash, so the ranks exchange two integers
// whatever the value's size.
//
//   RankAgreement ranks(comm, device, device_pool);
//   TZ_TRY(ranks.agree_on(dir, "checkpoint", "checkpoints", "pass the same directory"));
//   TZ_TRY(ranks.agree(write_my_files(), "checkpoint " + dir));   // everyone fails if anyone did
//
// Threads: `serialise` runs each collective where the owner's other
// collectives run (the engine's comm thread, so they keep one order on every
// rank); without it they run on the caller. Memory: the data is host memory;
// on a device whose communicator takes device memory (NCCL) it goes through a
// copy in `device_pool` (host_collectives.h).
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>
#include <utility>

#include "tierzero/comm/communicator.h"
#include "tierzero/offload.h"

namespace tz {

class RankAgreement {
 public:
  using Serialiser = std::function<Status(const std::function<Status()>&)>;

  RankAgreement(Communicator& comm, Device& device, MemoryPool& device_pool, Serialiser serialise = nullptr)
      : comm_(comm), device_(device), device_pool_(device_pool), serialise_(std::move(serialise)) {}

  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }

  Status barrier();
  // Every rank passes its own result; all return an error if any rank failed
  // (this rank's own, or "N other rank(s) failed" naming `what`).
  Status agree(const Status& mine, std::string_view what);
  // Every rank names the same `value` (a checkpoint directory, a block, a
  // model's digest). Otherwise kInvalidArgument on every rank: "<what>: the
  // ranks name different <noun> (this rank: '<value>'); every rank must <advice>".
  Status agree_on(const std::string& value, std::string_view what, std::string_view noun = "values",
                  std::string_view advice = "do the same");
  // Both: fails on every rank when any passes a `refusal` (checked first, so a
  // refusing rank reports its reason even when the values differ too) or when
  // the ranks' `value`s differ.
  Status agree(const std::string& value, const Status& refusal, std::string_view what);
  // Every rank has the same settings: (name, value) pairs, built by the same
  // code so the names come in the same order. Otherwise kInvalidArgument on
  // every rank naming the first setting that differs, rank 0's value and the
  // first differing rank's: "<what>: the ranks' settings differ, first at
  // optimizer.lr: rank 0 has 0.0003, rank 1 has 0.001; <advice>".
  using Settings = std::vector<std::pair<std::string, std::string>>;
  Status agree_on_settings(const Settings& settings, std::string_view what, std::string_view advice);
  // Rank `root`'s `bytes` bytes at `data` (host memory) into every rank's
  // `data`. The ranks first agree on the size and the root, so a mismatch is
  // an error naming them rather than a collective that reads garbage or hangs.
  Status broadcast(void* data, std::size_t bytes, int root);

 private:
  // Whether every rank passed the same `value` (one all-reduce of its hash).
  Expected<bool> same_everywhere(const std::string& value, std::string_view what);
  // Runs `collective` with `what` posted as this rank's activity (Note [What
  // the other ranks were doing]).
  Status run(std::string_view what, const std::function<Status()>& collective) const {
    const std::function<Status()> labelled = [&] {
      comm_.note_activity(what);
      Status s = collective();
      comm_.note_activity("");
      return s;
    };
    return serialise_ ? serialise_(labelled) : labelled();
  }

  Communicator& comm_;
  Device& device_;
  MemoryPool& device_pool_;
  Serialiser serialise_;
};

}  // namespace tz
