// StepAhead: the CPU optimizer's step of each block under backward, as soon
// as the block's gradient is complete, kept only when it is the step the
// engine would have taken after backward.
//
// Note [Stepping under backward]
// On the micro-batch that ends an accumulation window, a block's step needs
// only its own gradient, states and the step's arguments, except for two
// things known when backward ends: the global gradient norm (clipping scales
// every gradient by clip_coef = max_norm / (norm + 1e-6) when that is below
// 1) and an fp16 overflow anywhere (the step must not happen). So each block
// whose last gradient of the window has been accumulated is stepped at once,
// on the "optimizer" thread, speculatively: with the arguments step() would
// pass when nothing clips, i.e. grad_scale = 1 / loss scale (step() passes
// clip_coef / loss scale and clip_coef is exactly 1.0 then, so the double is
// the same), the learning rate and hyperparameters of this step, step number
// step_ + 1. cpu_adam is element-wise, so stepping a block alone gives the
// bits run() gives it in its sub-group (OptimizerPass::step_ahead).
//
// What it keeps to be undone, per stepped block: the master and moments as
// they were, and the new parameters, which stay out of their tier (in CPU
// memory) until the commit, so fetches and prefetches during the rest of
// backward (a block used twice, an evaluation) read the old ones. States in
// CPU memory are stepped in place after a copy of the old ones is taken;
// states on NVMe are read, stepped in staging and written to a second copy
// of their store (the shadow: same shards, other extents), and the commit
// trades the two extents (TieredStore::swap_shard), so the old ones stay
// where they were and an undo moves nothing. Either way the new states'
// traffic runs under backward.
//
// At step(), once the global norm is known (every rank's blocks count, after
// the all-reduce), the stepped blocks are committed (new parameters to their
// tier) when the step runs with exactly the speculated arguments: no
// overflow, clip_coef == 1.0, the same learning rate and hyperparameters
// (set_learning_rate after backward changes them) and step number. Otherwise
// each stepped block's old states are put back and run() steps every block
// as it does without this (the redo: "blocks redone" in the step report).
// Blocks not stepped ahead (no gradient this window, not stepped in time, a
// block whose gradient arrived twice in the last micro-batch: its second
// accumulation waits for the optimizer thread and marks it redone) step in
// run() after backward, which skips the committed ones.
//
// A window after a step that clipped or overflowed does not speculate at
// all (clipping tends to last, early in training every step; the norm of
// every step says when it stops), so a run that clips throughout pays
// nothing for this. The speculation also stops early, undoing what it did while backward goes on,
// once it is certain not to commit: a non-finite gradient (an overflow), or
// this rank's sum of squares so far already clipping (it is a lower bound of
// the global one; a 0.1% margin keeps rounding from deciding). Everything
// that reads or writes states outside a step (a checkpoint save or load,
// set_master, gather_master, exports) cancels it first: the stepped blocks
// are undone and the window's step runs after backward, so no one sees a
// half-taken step, and a run stopped mid-speculation leaves its checkpoints
// as they were (the tiers themselves are the process's own).
//
// Cost, per rank: CPU memory for the new parameter shard of each block that
// may step ahead (2 B/param in bf16), for the old master and moments of the
// states that live in CPU memory (12 B/param with fp32 states), and three
// blocks' NVMe-resident states and gradient as staging (Note [Pipelined steps
// under backward]); NVMe space for a second copy of the NVMe master and
// moments (12 B/param); no extra NVMe traffic except the redo's (the states
// of the blocks redone are read and written once more). The engine adds
// both to its plan's CPU and NVMe breakdowns. The CPU tier's headroom in the
// plan decides how many blocks may (those whose gradients complete first in
// backward, the last blocks); where no block fits, or the NVMe headroom does
// not hold the second copy, or tierzero.step_under_backward is false, or the
// optimizer runs on the GPU, the step runs after backward as before and the
// step report's ahead_off says why.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gradient_path.h"
#include "optimizer_pass.h"
#include "trace.h"
#include "workers.h"

namespace tz::detail {

struct StepAheadDeps {
  OptimizerPass* pass = nullptr;
  GradientPath* grads = nullptr;
  const ModelLayout* layout = nullptr;
  Timeline* timeline = nullptr;
};

// The speculated step's arguments (what step() passes when nothing clips).
struct AheadArgs {
  cpu_adam::Hyper hyper;
  std::int64_t step = 0;
  double grad_scale = 1;   // 1 / loss scale
  double max_norm = 0;     // gradient_clipping (0: off)
  double loss_scale = 1;
};

bool same_args(const AheadArgs& a, const cpu_adam::Hyper& h, std::int64_t step, double grad_scale);

// What the window's speculation did, for the step report.
struct AheadOutcome {
  std::uint64_t committed = 0, redone = 0;
  double busy_seconds = 0;    // optimizer work on the optimizer thread this window
  double hidden_seconds = 0;  // of it, before step() began (under backward)
};

class StepAhead final : public AccumulationObserver {
 public:
  // may[b]: block b may step ahead (its slot fits the budget).
  StepAhead(const StepAheadDeps& deps, std::vector<bool> may);
  ~StepAhead() override;  // waits for the optimizer thread

  // The window's last micro-batch is under way: every accumulation from now
  // on is the block's last of the window (or marks it redone). Once per window.
  void open(const AheadArgs& args);
  bool is_open() const { return window_ == Window::kOpen; }
  const AheadArgs& args() const { return args_; }

  void before_accumulate(std::size_t block) override;
  void after_accumulate(std::size_t block, bool ok) override;

  // At step(), after every accumulation: waits for the optimizer thread.
  // commit: the step runs with `args`-equal arguments; the stepped blocks'
  // parameters go to their tier and done[b] says which run() must skip.
  // Otherwise every stepped block is undone. Either way the window closes.
  Status finish(bool commit, std::vector<bool>& done, std::chrono::steady_clock::time_point step_began,
                AheadOutcome& outcome);
  // Undoes whatever was stepped and stops this window's speculation (the
  // step then runs after backward). For anything that reads or writes states.
  Status cancel();

 private:
  enum class Window : std::uint8_t { kClosed, kOpen, kCancelled };
  enum class Block : std::uint8_t { kNone, kPosted, kStepped, kRedo };
  Status step_block(std::size_t block);
  Status undo_all();  // on the optimizer thread, or with it idle

  StepAheadDeps deps_;
  std::vector<bool> may_;
  AheadArgs args_;
  std::atomic<Window> window_{Window::kClosed};
  // Per block; written by the grad path (kPosted, kRedo) and the optimizer thread (kStepped), which
  // never touch one block at once: before_accumulate waits for the thread.
  std::vector<std::atomic<Block>> state_;
  std::vector<AheadSlot> slots_;
  // The optimizer thread's own.
  bool stopped_ = false;
  double partial_sum_squares_ = 0;
  std::vector<std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point>> spans_;
  std::uint64_t undone_ = 0;
  Status undo_error_;
  TaskThread thread_{"optimizer"};
};

}  // namespace tz::detail
