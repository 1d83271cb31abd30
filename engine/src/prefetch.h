// The prefetch scheduler: brings blocks' 16-bit parameters up the tiers and
// all-gathers them ahead of use.
//
// Note [Prefetch window]
// The first micro-batch records the order of fetch() calls (the trace);
// step() checks that every rank recorded the same one. From then on, each
// fetch at trace position i makes sure positions i+1 .. i+k are in flight,
// k as large as fits in the window's byte budget (stage3_prefetch_bucket_size
// elements of 16-bit, at least one block). An entry in flight moves through
// NVMe read (swap store, into pinned staging) -> host-to-device copy (its own
// stream, an event marks the end) -> all-gather (the comm thread, Note
// [Collective order]); reads and copies start as soon as an entry enters the
// window, its all-gather is queued when the block before it is fetched. The window depends only on block sizes and the trace,
// so every rank issues the same collectives in the same order. An untraced
// fetch (an evaluation's) is fetched on demand beside the window, and the
// trace goes on after it.
//
// Note [A trace that stops holding]
// A fetch that does not follow the trace (a submodule called on its own in
// training mode, a forward abandoned without rewind()) makes the rest of its
// micro-batch fetch on demand, and the next micro-batch records the order
// again (checked across ranks as the first was); prefetching resumes with
// the one after. Each rank decides this from its own fetches, which are the
// same on every rank (their all-gathers pair up), so every rank re-records at
// the same point. Only data-dependent control flow, where no trace holds for
// a whole micro-batch kMaxFailedTraces times running, switches prefetching
// off for good; both are said once. A forward that raised rewinds to where it
// began (rewind()): the trace goes on from there, nothing re-recorded. A
// micro-batch that fetched nothing by the trace (a step() with no forward, a
// model of persistent blocks) leaves the trace, or its recording, as it was.
//
// Note [The next forward's fetches under the optimizer]
// A step's optimizer pass writes each block's new parameters to their tier;
// the next forward's first window used to be issued only when the whole pass
// (and the persistent blocks' gathers) had ended. Now the micro-batch that
// ends an accumulation closes its pass first (begin_step_pass()), and the
// optimizer pass tells the prefetcher which blocks' new parameters have
// reached their tier (block_stepped()). The CPU pass tells a sub-group once
// its parameter writes have landed: it looks between sub-groups (a write
// still in flight is not waited for there) and when it reuses the
// sub-group's staging set, always in sub-group order; parameters stepped in
// place in CPU memory have landed when stepped, and blocks stepped under
// backward and committed before the pass count from the start. The window
// fills in trace order, stopping at the first trace position whose block is
// not yet stepped, so a read never sees parameters older than the step's
// (the swap store refuses a read of an extent with a write in flight, which
// is how tests/engine/next_fetches_test.cpp fails when a block is told too
// early), and the first blocks' NVMe reads and host-to-device copies run
// under the optimizer's last sub-groups. end_step_pass() lifts the gate and
// fills the rest of the window; a step that fails lifts it without issuing.
// Under the gate only NVMe reads and host-to-device copies start: the
// window's all-gathers are posted by end_step_pass(), after the persistent
// blocks' gathers, so the collectives keep the order they had before (when
// a read starts may differ between ranks; what is gathered, and in which
// order, does not), a step that fails on one rank leaves none queued, and a
// failure to issue (the device pool) is returned there, after a whole pass,
// as it was. The GPU optimizer pass reports nothing: its next window starts
// after it, as before.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "tierzero/comm/communicator.h"
#include "tierzero/engine/zero.h"
#include "trace.h"
#include "workers.h"

namespace tz::detail {

class KeptParams;

struct PrefetchDeps {
  Device* device = nullptr;
  Communicator* comm = nullptr;
  TaskThread* comm_thread = nullptr;
  Stream* comm_stream = nullptr;    // collectives run here (NCCL); synchronised before a gather counts as done
  MemoryPool* device_pool = nullptr;
  MemoryPool* host_pool = nullptr;
  TieredStore* param16 = nullptr;
  const ModelLayout* layout = nullptr;
  DType param_type = DType::kBf16;
  Timeline* timeline = nullptr;
  // Note [The step keeps backward's parameter shards] (kept_params.h): where
  // set, each fetch's NVMe staging goes there once the block is gathered.
  KeptParams* kept = nullptr;
};

// Seconds compute spent waiting on each stage, summed over fetches.
struct StageWaits {
  double nvme = 0, h2d = 0, gather = 0;
  std::uint64_t fetches = 0, prefetched = 0;
  std::uint64_t h2d_bytes = 0, gather_bytes = 0;  // NVMe bytes: the stores count them (NvmeTraffic)
};

class Prefetcher {
 public:
  Prefetcher(const PrefetchDeps& deps, std::uint64_t window_bytes);
  ~Prefetcher();  // waits for everything in flight

  // The whole gathered block for the next fetch of `block`: prefetched when
  // the trace predicted it, else fetched now. Waits; records the waits.
  // Untraced (an evaluation's fetch, tz::FetchFor): fetched now, and neither
  // recorded nor checked against the trace.
  Expected<PoolBlock> acquire(std::size_t block, bool traced = true);
  // End of a micro-batch: a recorded order is checked across ranks (a
  // collective) and prefetching starts with the next; a pass that left the
  // trace makes the next one record it again.
  Status end_micro_batch();
  // Drops everything in flight (e.g. before a checkpoint load replaces the
  // parameters) and starts the micro-batch over; the trace is kept.
  void reset();
  // This micro-batch's traced fetches so far: a mark for rewind().
  FetchMark mark() const { return {passes_, this_pass_.size()}; }
  // Forgets the traced fetches after `mark` (this micro-batch's, from mark()),
  // as though they had not happened: a forward that raised half-way. What is
  // in flight is dropped and the window issued again from there; a departure
  // from the trace after the mark is forgotten too. Every rank rewinds at the
  // same point, or none does (its collectives are the ranks').
  Status rewind(const FetchMark& mark);
  // Drops everything in flight (their parameters are about to be replaced,
  // set_master) and issues it again from this micro-batch's position after
  // reissue(): the fetches so far still count against the trace.
  void drop_in_flight();
  Status reissue() { return prefetching() ? prefetch_next() : ok_status(); }
  // Starts the next micro-batch's first window (when prefetching is on).
  Status prefetch_next();
  // Note [The next forward's fetches under the optimizer]: the end of the
  // micro-batch that ends an accumulation, before the optimizer pass (as
  // end_micro_batch(), with the window gated: nothing is issued yet);
  // block_stepped() as each block's new parameters reach their tier (may
  // issue the window's next entries); end_step_pass() lifts the gate and
  // fills the window; lift_gate() lifts it without issuing (a failed step).
  Status begin_step_pass();
  void block_stepped(std::size_t block, bool more_to_step);
  Status end_step_pass();
  void lift_gate() { gated_ = false; }
  // Entries issued while the optimizer pass had sub-groups left to step,
  // since the last take (the step report's next_fetches_under_step).
  std::uint64_t take_issued_under_step() { return std::exchange(issued_under_step_, 0); }
  bool prefetching() const { return active_ && !disabled_ && !diverged_; }
  // Fetches into an existing buffer on demand (persistent blocks).
  Status gather_into(std::size_t block, void* d_whole);

  StageWaits take_waits();
  bool active() const { return active_; }
  const std::vector<std::size_t>& trace() const { return trace_; }

 private:
  static constexpr int kMaxFailedTraces = 3;  // Note [A trace that stops holding]
  struct Entry;
  std::shared_ptr<Entry> issue(std::size_t block, void* whole, PoolBlock owned);
  void post_gather(const std::shared_ptr<Entry>& e);
  Status gather(const std::shared_ptr<Entry>& e);
  Status start_copy(const std::shared_ptr<Entry>& e, const void* src);
  Status top_up();
  Status close_pass();
  void drain();  // waits for every entry in flight and drops them
  Status wait_ready(Entry& e, std::chrono::steady_clock::time_point start);
  // A gathered entry's staging: to deps_.kept, or back to the pool.
  void done_with_staging(Entry& e);

  PrefetchDeps deps_;
  std::uint64_t window_bytes_;
  std::unique_ptr<Stream> h2d_stream_;
  std::vector<std::size_t> trace_;          // recorded block order of one micro-batch
  std::vector<std::size_t> this_pass_;      // fetches since the last end_micro_batch
  bool recording_ = true, active_ = false;
  bool diverged_ = false;                   // this micro-batch left the trace: on demand until it ends
  std::size_t diverged_at_ = 0;             // ... at this fetch of it
  std::uint64_t passes_ = 0;                // micro-batches ended or restarted (FetchMark::micro_batch)
  bool disabled_ = false;                   // off for good (Note [A trace that stops holding])
  int failed_traces_ = 0;                   // traces running that no micro-batch followed to the end
  std::size_t position_ = 0;                // next trace position to be fetched
  std::size_t issued_until_ = 0;            // trace positions below this are in flight or used
  std::deque<std::shared_ptr<Entry>> in_flight_;  // in trace order
  bool gated_ = false;                      // Note [The next forward's fetches under the optimizer]
  std::vector<bool> stepped_;               // ... per block, while gated_
  bool pass_busy_ = false;                  // ... the pass has sub-groups left to step
  Status gate_error_;                       // ... the first failure to issue under it
  std::uint64_t issued_under_step_ = 0;
  std::mutex waits_mu_;
  StageWaits waits_;
};

}  // namespace tz::detail
