// The prefetch scheduler (Note [Prefetch window] in prefetch.h).
#include "prefetch.h"

#include <condition_variable>

#include "kept_params.h"
#include "tierzero/comm/host_collectives.h"

namespace tz::detail {

using Clock = std::chrono::steady_clock;

struct Prefetcher::Entry {
  std::size_t block = 0;
  PoolBlock owned;                    // the gathered buffer, when the pool's
  void* whole = nullptr;              // (whole_numel,) 16-bit, device memory
  PoolBlock staging;                  // NVMe -> pinned; released by the training thread (deterministic pool use)
  std::uint64_t version = 0;          // the param16 store's shard_version when the read was issued
  std::unique_ptr<Event> h2d_done;
  std::mutex mu;
  std::condition_variable cv;
  bool copy_issued = false;           // guarded by mu
  bool ready = false;                 // guarded by mu
  bool gather_posted = false;         // training thread only
  Status error;                       // guarded by mu
  Clock::time_point t_issue, t_read_done, t_h2d_done, t_gather_done;

  // The Host backend's copy end: the first to see it stamps it (Note in
  // start_copy); guarded by mu until then.
  void stamp_h2d_done() {
    std::lock_guard<std::mutex> lock(mu);
    if (t_h2d_done == Clock::time_point{}) t_h2d_done = Clock::now();
  }

  void fail(Status s) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (error.ok()) error = std::move(s);
    }
    cv.notify_all();
  }
};

Prefetcher::Prefetcher(const PrefetchDeps& deps, std::uint64_t window_bytes)
    : deps_(deps), window_bytes_(window_bytes) {
  h2d_stream_ = deps_.device->create_stream().value();
}

Prefetcher::~Prefetcher() {
  drain();
  (void)deps_.comm_thread->wait_idle();
  (void)deps_.device->synchronize_stream(*h2d_stream_);
}

Status Prefetcher::start_copy(const std::shared_ptr<Entry>& e, const void* src) {
  const std::size_t bytes = deps_.param16->shard_bytes(e->block);
  void* slot = static_cast<char*>(e->whole) + static_cast<std::uint64_t>(deps_.comm->rank()) * bytes;
  Device& d = *deps_.device;
  TZ_TRY(d.copy_async(slot, src, bytes, *h2d_stream_));
  // The copy's end, for the timeline and the stage waits. CUDA: a host
  // function in stream order, before the event (so it is written when the
  // event is seen done). Host backend: a small copy on an idle stream has run
  // by now (the event is done at once: stamped here, no hand-off); a queued
  // one is stamped by a host function after the event, or by gather() when
  // it sees the event done, whichever comes first.
  const bool cuda = d.kind() == BackendKind::kCuda;
  if (cuda) TZ_TRY(d.launch_host_func(*h2d_stream_, [e] { e->t_h2d_done = Clock::now(); }));
  if (!e->h2d_done) {
    TZ_ASSIGN_OR_RETURN(e->h2d_done, d.create_event());
  }
  TZ_TRY(d.record_event(*e->h2d_done, *h2d_stream_));
  if (!cuda) {
    TZ_ASSIGN_OR_RETURN(bool landed, d.event_done(*e->h2d_done));
    if (landed) {
      e->stamp_h2d_done();
    } else {
      TZ_TRY(d.launch_host_func(*h2d_stream_, [e] { e->stamp_h2d_done(); }));
    }
  }
  {
    std::lock_guard<std::mutex> lock(e->mu);
    e->copy_issued = true;
  }
  e->cv.notify_all();
  return ok_status();
}

std::shared_ptr<Prefetcher::Entry> Prefetcher::issue(std::size_t block, void* whole, PoolBlock owned) {
  auto e = std::make_shared<Entry>();
  e->block = block;
  e->whole = whole;
  e->owned = std::move(owned);
  e->t_issue = Clock::now();
  const std::size_t bytes = deps_.param16->shard_bytes(block);
  const std::string& name = deps_.layout->blocks[block].name;
  if (!deps_.param16->resident()) {
    Expected<PoolBlock> staging = deps_.host_pool->allocate(bytes);
    if (!staging.ok()) {
      e->fail(std::move(staging).status().with_context(fmt::format("staging {} from NVMe", name)));
    } else {
      e->staging = std::move(*staging);
      e->version = deps_.param16->shard_version(block);  // Note [The step keeps backward's parameter shards]
      deps_.param16->read(block, e->staging.data(), [this, e, name](const Status& s, const nvme::IoResult&) {
        e->t_read_done = Clock::now();
        deps_.timeline->record(Track::kNvme, name, e->t_issue, e->t_read_done);
        Status copied = s.ok() ? start_copy(e, e->staging.data()) : s;
        if (!copied.ok()) e->fail(std::move(copied).with_context(fmt::format("fetching {}", name)));
      });
    }
  } else {
    e->t_read_done = e->t_issue;
    Status copied = start_copy(e, deps_.param16->memory(block));
    if (!copied.ok()) e->fail(std::move(copied));
  }
  return e;
}

// Queues the all-gather of an issued entry (Note [Collective order]): called
// from the training thread at fixed points, for the block being fetched and
// the one after it, so gradient reduce-scatters posted in between are not
// stuck behind gathers of blocks whose NVMe reads are still far off. The
// gather starts once this rank's shard has landed.
//
// Note [Single-rank gathers inline]
// With one rank the "gather" is the shard itself (the all-gather copies
// nothing) and there is no collective order to keep with peers. When the
// shard has already landed (the copy was issued and its event is done: small
// blocks on the Host backend, blocks the GPU copied while compute ran), the
// gather is finished on the calling thread instead of through the comm
// thread: two thread hand-offs less per fetch (a fetch on demand went from
// ~80 to ~1.5 us on the Host backend, bench/RESULTS.md; in training the
// prefetcher had mostly hidden them already). A shard still on its way goes through
// the comm thread as before, so the training thread never waits here for a
// block it has not asked for yet.
void Prefetcher::post_gather(const std::shared_ptr<Entry>& e) {
  if (e->gather_posted) return;
  e->gather_posted = true;
  if (deps_.comm->size() == 1 && deps_.comm_thread->error().ok()) {
    bool landed = false;
    {
      std::lock_guard<std::mutex> lock(e->mu);
      landed = e->copy_issued && e->error.ok();
    }
    Expected<bool> done = landed ? deps_.device->event_done(*e->h2d_done) : Expected<bool>(false);
    if (done.ok() && *done) {
      // A failure is the entry's (wait_ready returns it), and the comm
      // thread's too, as on the queued path: later gradient work fails with it.
      if (Status s = gather(e); !s.ok()) deps_.comm_thread->post([s] { return s; });
      return;
    }
  }
  deps_.comm_thread->post([this, e]() -> Status {
    // After a failed collective this rank takes part in no other: its peers
    // fail on the one it missed (timeout) instead of pairing it with the next.
    if (Status prior = deps_.comm_thread->error(); !prior.ok()) {
      e->fail(prior);
      return prior;
    }
    {
      std::unique_lock<std::mutex> lock(e->mu);
      e->cv.wait(lock, [&] { return e->copy_issued || !e->error.ok(); });
      if (!e->error.ok()) return e->error;  // skipped: the others time out on it, naming it
    }
    return gather(e);
  });
}

// The entry's shard has been copied (or is being): waits for it, all-gathers
// the block and marks the entry ready (or failed).
Status Prefetcher::gather(const std::shared_ptr<Entry>& e) {
  const std::string& name = deps_.layout->blocks[e->block].name;
  const std::size_t bytes = deps_.param16->shard_bytes(e->block);
  Status s = deps_.device->synchronize_event(*e->h2d_done);
  if (deps_.device->kind() != BackendKind::kCuda) e->stamp_h2d_done();  // see start_copy
  const BlockLayout& b = deps_.layout->blocks[e->block];
  void* slot = static_cast<char*>(e->whole) + static_cast<std::uint64_t>(deps_.comm->rank()) * bytes;
  const auto start = Clock::now();
  if (s.ok()) {
    s = deps_.comm->all_gather(slot, e->whole, b.shard_numel, (deps_.param_type), deps_.comm_stream);
  }
  // NCCL only enqueues: the block is ready when the stream is done with it.
  // One rank's gather enqueues nothing (the shard is the block), and waiting
  // would hold the caller behind the gradient copies the comm thread queued.
  if (s.ok() && deps_.comm->size() > 1) s = deps_.device->synchronize_stream(*deps_.comm_stream);
  e->t_gather_done = Clock::now();
  deps_.timeline->record(Track::kH2D, name, e->t_read_done, e->t_h2d_done);
  deps_.timeline->record(Track::kComm, "all-gather " + name, start, e->t_gather_done);
  if (!s.ok()) {
    s = std::move(s).with_context(fmt::format("all-gathering {}", name));
    e->fail(s);
    return s;
  }
  {
    std::lock_guard<std::mutex> lock(e->mu);
    e->ready = true;
  }
  e->cv.notify_all();
  return ok_status();
}

Status Prefetcher::wait_ready(Entry& e, Clock::time_point start) {
  {
    std::unique_lock<std::mutex> lock(e.mu);
    e.cv.wait(lock, [&] { return e.ready || !e.error.ok(); });
    if (!e.error.ok()) return e.error;
  }
  const Clock::time_point end = Clock::now();
  auto span = [](Clock::time_point a, Clock::time_point b) {
    return b > a ? std::chrono::duration<double>(b - a).count() : 0.0;
  };
  // Compute waited from `start` to `end`; each stage owns the part of that
  // interval before it finished and after the previous stage did.
  const Clock::time_point read = std::min(std::max(e.t_read_done, start), end);
  const Clock::time_point h2d = std::min(std::max(e.t_h2d_done, read), end);
  std::lock_guard<std::mutex> lock(waits_mu_);
  waits_.nvme += span(start, read);
  waits_.h2d += span(read, h2d);
  waits_.gather += span(h2d, end);
  ++waits_.fetches;
  const std::uint64_t shard = deps_.param16->shard_bytes(e.block);
  // Parameters that live in device memory are copied within it, not up from
  // the host: host-to-device counts only what crosses (as the planner does).
  if (deps_.param16->device_memory(e.block) == nullptr) waits_.h2d_bytes += shard;
  waits_.gather_bytes += shard * static_cast<std::uint64_t>(deps_.comm->size() - 1);
  return ok_status();
}

// The window is decided by block sizes and the trace alone, never by whether
// an allocation happened to succeed: that depends on when worker threads
// free buffers, and ranks must post the same gathers at the same points
// (Note [Collective order]). A device pool too small for the window is an
// error, not a silently narrower window.
Status Prefetcher::top_up() {
  std::uint64_t in_flight_bytes = 0;
  for (const auto& e : in_flight_) in_flight_bytes += deps_.layout->blocks[e->block].whole_numel;
  const std::size_t elem = dtype_bytes(deps_.param_type);
  in_flight_bytes *= elem;
  while (issued_until_ < trace_.size()) {
    const std::size_t block = trace_[issued_until_];
    const std::uint64_t bytes = deps_.layout->blocks[block].whole_numel * elem;
    if (!in_flight_.empty() && in_flight_bytes + bytes > window_bytes_) break;
    if (gated_ && !stepped_[block]) break;  // Note [The next forward's fetches under the optimizer]
    Expected<PoolBlock> whole = deps_.device_pool->allocate(bytes);
    TZ_TRY_CTX(whole, "prefetching {} ({} of prefetch window in flight; lower "
               "zero_optimization.stage3_prefetch_bucket_size or raise the device budget)",
               deps_.layout->blocks[block].name, format_bytes(in_flight_bytes));
    void* data = whole->data();
    in_flight_.push_back(issue(block, data, std::move(*whole)));
    in_flight_bytes += bytes;
    ++issued_until_;
    if (gated_ && pass_busy_) ++issued_under_step_;
  }
  return ok_status();
}

Expected<PoolBlock> Prefetcher::acquire(std::size_t block, bool traced) {
  const Clock::time_point start = Clock::now();
  if (traced && (recording_ || active_)) this_pass_.push_back(block);
  if (traced && prefetching()) {
    if (position_ < trace_.size() && trace_[position_] == block) {
      if (in_flight_.empty()) TZ_TRY(top_up());
      if (!in_flight_.empty() && in_flight_.front()->block == block) {
        std::shared_ptr<Entry> e = in_flight_.front();
        in_flight_.pop_front();
        ++position_;
        post_gather(e);
        TZ_TRY(top_up());
        if (!in_flight_.empty()) post_gather(in_flight_.front());
        TZ_TRY(wait_ready(*e, start));
        done_with_staging(*e);
        std::lock_guard<std::mutex> lock(waits_mu_);
        ++waits_.prefetched;
        return std::move(e->owned);
      }
    }
    TZ_LOG_ONCE_WARN("engine", "the order of fetched blocks differs from the recorded one (block {} at position "
                     "{}): this micro-batch fetches on demand, and the next one records the order again "
                     "(Note [A trace that stops holding])", block, position_);
    diverged_ = true;
    diverged_at_ = this_pass_.size() - 1;
    drain();
  }
  const std::uint64_t bytes = deps_.layout->blocks[block].whole_numel * dtype_bytes(deps_.param_type);
  Expected<PoolBlock> whole = deps_.device_pool->allocate(bytes);
  TZ_TRY_CTX(whole, "gathering {}", deps_.layout->blocks[block].name);
  void* data = whole->data();
  std::shared_ptr<Entry> e = issue(block, data, std::move(*whole));
  post_gather(e);
  TZ_TRY(wait_ready(*e, start));
  done_with_staging(*e);
  return std::move(e->owned);
}

// Note [The step keeps backward's parameter shards] (kept_params.h): the
// block is gathered, so its staging holds the shard as read and nothing
// reads it any more.
void Prefetcher::done_with_staging(Entry& e) {
  if (deps_.kept != nullptr && e.staging.valid()) {
    deps_.kept->keep(e.block, std::move(e.staging), e.version);
  } else {
    e.staging.reset();
  }
}

Status Prefetcher::gather_into(std::size_t block, void* d_whole) {
  std::shared_ptr<Entry> e = issue(block, d_whole, PoolBlock());
  post_gather(e);
  Status s = wait_ready(*e, Clock::now());
  e->staging.reset();
  return s;
}

// Entries whose gather was posted are waited for; the others only for their
// copy (their gather is never posted, on any rank).
void Prefetcher::drain() {
  for (const auto& e : in_flight_) {
    std::unique_lock<std::mutex> lock(e->mu);
    e->cv.wait(lock, [&] { return (e->gather_posted ? e->ready : e->copy_issued) || !e->error.ok(); });
    if (!e->gather_posted && e->copy_issued && e->error.ok()) {
      lock.unlock();
      (void)deps_.device->synchronize_event(*e->h2d_done);
    }
    e->staging.reset();
  }
  in_flight_.clear();
}

Status Prefetcher::end_micro_batch() {
  // A micro-batch that fetched nothing by the trace (a step() with no
  // forward, a model of persistent blocks) says nothing about the order: the
  // trace, or its recording, goes on with the next one. Every rank's passes
  // are alike, so every rank skips close_pass()'s agreement together.
  if (!this_pass_.empty()) TZ_TRY(close_pass());
  diverged_ = false;
  ++passes_;
  drain();
  this_pass_.clear();
  position_ = 0;
  issued_until_ = 0;
  if (prefetching()) return prefetch_next();
  return ok_status();
}

// The micro-batch's fetches against the trace (Note [A trace that stops
// holding]): a recording becomes the trace once the ranks agree on it; a
// pass that left the trace makes the next one record it again.
Status Prefetcher::close_pass() {
  if (recording_) {
    recording_ = false;
    trace_ = this_pass_;
    // Every rank must have recorded the same order (a collective: every rank
    // calls this at the same point of its step()).
    std::uint64_t h = 1469598103934665603ULL;
    for (std::size_t b : trace_) h = (h ^ b) * 1099511628211ULL;
    auto hash = static_cast<std::int64_t>(h >> 1);
    std::int64_t both[2] = {hash, -hash};
    TZ_TRY(deps_.comm_thread->run([&] {
      return all_reduce_host(*deps_.comm, *deps_.device, *deps_.device_pool, both, 2, DType::kInt64, ReduceOp::kMax);
    }));
    if (both[0] != hash || -both[1] != hash) {
      TZ_LOG_ONCE_WARN("engine", "ranks recorded different block orders in a micro-batch: prefetching is off, "
                       "blocks are fetched on demand");
      disabled_ = true;
    }
    active_ = !disabled_;
    return ok_status();
  }
  if (!active_ || disabled_) return ok_status();
  if (!diverged_ && this_pass_ == trace_) {
    failed_traces_ = 0;
    return ok_status();
  }
  if (++failed_traces_ >= kMaxFailedTraces) {
    TZ_LOG_ONCE_WARN("engine", "the order of fetched blocks changed in {} micro-batches running ({} blocks fetched "
                     "where the last trace has {}): prefetching is off, blocks are fetched on demand",
                     failed_traces_, this_pass_.size(), trace_.size());
    disabled_ = true;
    return ok_status();
  }
  if (!diverged_) {
    TZ_LOG_ONCE_WARN("engine", "a micro-batch fetched {} blocks where the trace has {}: the next one records the "
                     "order again (Note [A trace that stops holding])", this_pass_.size(), trace_.size());
  }
  recording_ = true;
  active_ = false;
  return ok_status();
}

// Note [The next forward's fetches under the optimizer] (prefetch.h).
Status Prefetcher::begin_step_pass() {
  stepped_.assign(deps_.layout->blocks.size(), false);
  issued_under_step_ = 0;
  pass_busy_ = false;
  gate_error_ = ok_status();
  gated_ = true;  // end_micro_batch's prefetch_next() issues nothing: no block is stepped
  Status ended = end_micro_batch();
  if (!ended.ok()) gated_ = false;
  return ended;
}

// Reads and copies only: the gathers are posted after the pass (Note [The
// next forward's fetches under the optimizer]). A failure to issue is kept
// for end_step_pass(), so the optimizer pass itself always runs to its end.
void Prefetcher::block_stepped(std::size_t block, bool more_to_step) {
  if (!gated_ || !gate_error_.ok()) return;
  stepped_[block] = true;
  pass_busy_ = more_to_step;
  if (!prefetching() || issued_until_ >= trace_.size() || trace_[issued_until_] != block) return;
  gate_error_ = top_up();
}

Status Prefetcher::end_step_pass() {
  gated_ = false;
  TZ_TRY(std::exchange(gate_error_, ok_status()));
  return prefetching() ? prefetch_next() : ok_status();
}

// The next micro-batch's first blocks, now (after a step or a load).
Status Prefetcher::prefetch_next() {
  TZ_TRY(top_up());
  if (!in_flight_.empty()) post_gather(in_flight_.front());
  return ok_status();
}

void Prefetcher::reset() {
  drain();
  this_pass_.clear();
  diverged_ = false;
  ++passes_;
  position_ = 0;
  issued_until_ = 0;
}

Status Prefetcher::rewind(const FetchMark& mark) {
  if (mark.micro_batch != passes_) {
    return invalid_argument("rewind: the mark is from micro-batch {}, and this is micro-batch {} (a mark is good "
                            "until step() or a checkpoint load)", mark.micro_batch, passes_);
  }
  if (mark.fetches > this_pass_.size()) {
    return invalid_argument("rewind: the mark is at fetch {} of this micro-batch, past its {} traced fetches (it "
                            "was rewound to before the mark already)", mark.fetches, this_pass_.size());
  }
  if (mark.fetches == this_pass_.size()) return ok_status();  // nothing traced since (an evaluation's): the window stands
  drain();
  this_pass_.resize(mark.fetches);
  if (diverged_ && mark.fetches <= diverged_at_) diverged_ = false;  // the departure was the abandoned fetches'
  if (!prefetching()) return ok_status();  // nothing prefetched by position
  position_ = issued_until_ = mark.fetches;
  return prefetch_next();
}

void Prefetcher::drop_in_flight() {
  drain();
  issued_until_ = position_;
}

StageWaits Prefetcher::take_waits() {
  std::lock_guard<std::mutex> lock(waits_mu_);
  return std::exchange(waits_, StageWaits{});
}

}  // namespace tz::detail
