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
// CPU memory are stepped in place after a copy of the old ones is taken (on
// the optimizer's threads: CpuOptimizer::copy);
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
// Which windows speculate at all is the policy's (Note [When to speculate]
// below): by default only after calm steps, so a run that clips throughout
// pays nothing for this. The speculation also stops early, undoing what it did while backward goes on,
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
// of the blocks redone are read and written once more: Note [What a redo
// costs]). The engine adds both to its plan's CPU and NVMe breakdowns, and
// the planner counts the same from the layout (add_step_ahead in
// offload/src/planner.cpp), so tierzero-estimate shows it too. The CPU tier's headroom in the
// plan decides how many blocks may (those whose gradients complete first in
// backward, the last blocks); where no block fits, or the NVMe headroom does
// not hold the second copy, or tierzero.step_under_backward is false, or the
// optimizer runs on the GPU, the step runs after backward as before and the
// step report's ahead_off says why.
//
// Note [What a redo costs]
// A block undone is stepped again by run(): what its speculation read and
// wrote on NVMe (its master and moments, and its gradient and 16-bit shard
// where those live there, read; the new states written to the second copy),
// and its optimizer seconds, were spent for nothing. The pass counts those
// bytes per block as it issues them (OptimizerPass::take_ahead_io: the
// shards' stored bytes, the same the engine's NVMe counters count), and the
// step report gives the undone blocks' share beside ahead_redone
// (ahead_redone_read_bytes, _write_bytes, _seconds), with the reason: the
// step clipped, overflowed, ran with other hyperparameters (a learning rate
// or weight decay set after the window opened) or another step number, a
// cancel, or a fault of some blocks. With states in CPU memory a redo costs
// CPU time only; on NVMe it costs a step's state traffic again: on the
// GPT-2-shaped bench of bench/RESULTS.md (remainder + int8 on NVMe), 11.3
// B/param more than the 17.7 of a step after backward, and drive wear.
//
// Note [When to speculate]
// tierzero.step_under_backward = true speculates in every window, false
// never, "auto" (the default) where the last windows say the step will be
// kept (AheadPolicy):
// - calm: the last kCalmWindows (2) windows each stepped with a global norm
//   at most kNormMargin (1.0) x max norm (any norm when clipping is off);
//   an overflow or a clipped step restarts the count. A step's norm is known
//   only at its end, and a norm hovering at the max norm clips on some steps
//   and not the next: a second calm window keeps it from speculating on the
//   step after each crossing;
// - large blocks only: "auto" leaves blocks whose shard has fewer than
//   ZeroOptions::auto_ahead_min_block_numel (2^20) elements to run(). Each
//   block stepped ahead pays its own staging claim, reads and their wait, step
//   and writes on the optimizer thread (the commit is one batch for the whole
//   window: Note [Committing steps under backward]), where run() moves a
//   sub-group of blocks per round trip. Measured (bench/RESULTS.md, "Batched
//   commits and the floor"), tierzero-overlap-bench, NVMe, every block kept,
//   whole step on / off side by side: where compute leaves the CPU free (a
//   sleep, as a GPU's would) speculation paid at every size from 66K
//   elements (0.89 at 66K, 0.80 at 263K, 0.73 at 1.05M, 0.87 at 4.2M) and
//   broke even at 16.5K (0.96); where compute is the CPU's own (the MLP's
//   arithmetic on a core of the 2-core VM, as the Host backend's and the
//   GPT-2 bench's is) it cost 11% at 66K and 3% at 263K and paid from 1.05M
//   (0.69). 2^20 is the smallest measured size that pays in both; a lower
//   floor where compute runs on a GPU is likely (the sleep runs) but not
//   measured on one;
// - back-off: a window whose speculation was undone anyway (for any reason
//   but a cancel) makes the next 2^k - 1 windows step after backward, k the
//   failures in a row (at most kMaxBackoffShift); a kept window resets k. A
//   caller that changes the learning rate after every backward (the torch
//   wrapper did, until it handed the rate over at forward) speculates in
//   windows 2, 4, 8, 16, ... only, not in every one.
// Measured by replaying the GPT-2-shaped bench's 200 norms (57 clip; the
// norms do not depend on the rule, the weights being the same bits:
// bench/python/ahead_policy_sim.py, bench/RESULTS.md "what a redo costs"):
// the old rule (speculate unless the last step clipped) kept 122 windows and
// redid 21 for clipping; 1 calm window: 113 and 13; 2: 110 and 10; 3: 102
// and 8; a margin below the max norm cost kept windows without saving redos
// (0.95 x / 2: 103 and 10; 0.9 x / 3: 64 and 5), hence 1.0 x / 2. A kept
// window hides optimizer time; a redone one costs its state traffic again.
// A run with nothing near the max norm speculates from its third window on;
// one that clips every step (early training, the README's job) never does.
// - measured pace: "auto" times each window (step() to step()) and compares
//   the first kProbeWindows kept speculating windows of each run of them
//   with the last kProbeWindows windows that stepped after backward before
//   them (the fastest of each, so a warm-up spike decides nothing; a window
//   that did not step, an overflow, and one after a cancel, which may hold
//   a checkpoint save, are not timed). Where speculating was more than
//   kSlowerMargin slower, the next kSlowSkip windows step after backward,
//   and then it probes again (the run's pace may change). Measured on the H200 (16
//   cores, bench/RESULTS.md, twentieth session), states in CPU memory,
//   clipping off so every block was kept: at 3.2B speculating took 2.42 s a
//   step against 1.59 s after backward with one micro-batch a step (one
//   call, alternating runs); with four, 3.07 s (the nineteenth session's run
//   after backward took 2.26 s). The old states' copies and the steps
//   take the cores and memory bandwidth the gradient path needs (a block's
//   gradient copy-out took 0.07-0.13 s beside them against 0.025 s after
//   backward), so backward slowed by more than the optimizer time it hid.
//   On the 2-vCPU VM with NVMe states it paid (the overlap bench above).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
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

// Why a window's steps under backward were undone (Note [What a redo costs]).
enum class AheadRedo : std::uint8_t {
  kNone,             // nothing undone
  kClip,             // the global norm clipped
  kOverflow,         // non-finite gradients (fp16), the step skipped
  kHyperparameters,  // the learning rate, a weight decay or the gradient scale changed after the window opened
  kStepNumber,       // the step taken was not the one speculated
  kCancel,           // a checkpoint, set_master, gather_master, ... read or wrote states mid-window
  kFault,            // some blocks only: an NVMe write failed, or a gradient arrived twice
};
std::string_view ahead_redo_name(AheadRedo why);  // "clip", "overflow", "hyperparameters", ...

// The step step() takes, against the speculated arguments: kNone where it
// runs with exactly them (the window's steps are kept). A step skipped for
// an overflow is kOverflow without asking.
AheadRedo verdict(const AheadArgs& a, double clip_coef, const cpu_adam::Hyper& h, std::int64_t step,
                  double grad_scale);

// What the window's speculation did, for the step report.
struct AheadOutcome {
  std::uint64_t committed = 0, redone = 0;
  double busy_seconds = 0;    // optimizer work on the optimizer thread this window
  double hidden_seconds = 0;  // of it, before step() began (under backward)
  // Note [What a redo costs]: of the work under backward, what was undone.
  double redone_seconds = 0;
  AheadIo redone_io;          // NVMe bytes
  AheadRedo why = AheadRedo::kNone;
};

// Note [When to speculate]
// Whether a window speculates at all. tierzero.step_under_backward = true:
// every window; "auto": only where the last windows say it will be kept.
class AheadPolicy {
 public:
  static constexpr int kCalmWindows = 2;       // stepped windows in a row, each ...
  static constexpr double kNormMargin = 1.0;   // ... with its global norm at most this x max norm
  static constexpr int kMaxBackoffShift = 6;   // after failures in a row: skip up to 2^6 - 1 = 63 windows
  static constexpr int kProbeWindows = 2;      // kept speculating windows timed before judging the pace
  static constexpr double kSlowerMargin = 0.05;
  static constexpr int kSlowSkip = 63;         // windows after backward once speculating measured slower

  explicit AheadPolicy(bool always, bool by_pace = true) : always_(always), by_pace_(by_pace) {}
  // Whether the next window speculates; where not, `why_not` says why.
  bool speculate(std::string& why_not) const;
  // At each step() that ends a window: what the window did. `speculated`:
  // it opened; `why`: its outcome's (kNone: kept, or nothing to keep).
  void record(bool stepped, bool overflow, double grad_norm, double max_norm, bool speculated, AheadRedo why);
  // Then the window's seconds, step() to step() (0: unknown: the first, one
  // after a cancel), for the measured-pace rule. Call record() first.
  void record_pace(double seconds, bool stepped, bool speculated, AheadRedo why);

 private:
  bool always_;
  bool by_pace_;       // ZeroOptions::auto_ahead_by_pace
  int calm_ = 0;       // the last windows in a row that stepped below the margin
  double last_norm_ = 0, last_max_norm_ = 0;
  bool last_overflow_ = false;
  int failures_ = 0;   // speculating windows undone in a row (a cancel does not count)
  int skip_ = 0;       // windows left to skip
  AheadRedo last_why_ = AheadRedo::kNone;
  std::vector<double> after_recent_;  // the last kProbeWindows stepped windows after backward
  std::vector<double> probe_s_;       // the kept speculating windows of this probe
  bool probing_ = true;               // the current run of speculating windows is not judged yet
  int slow_skip_ = 0;              // windows left to step after backward: speculating measured slower
  double slow_after_s_ = 0, slow_ahead_s_ = 0;
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
  Status finish(AheadRedo verdict, std::vector<bool>& done, std::chrono::steady_clock::time_point step_began,
                AheadOutcome& outcome);
  // Undoes whatever was stepped and stops this window's speculation (the
  // step then runs after backward). For anything that reads or writes states
  // (kCancel), or changes the step's arguments (kHyperparameters: a weight decay).
  Status cancel(AheadRedo why = AheadRedo::kCancel);

 private:
  enum class Window : std::uint8_t { kClosed, kOpen, kCancelled };
  enum class Block : std::uint8_t { kNone, kPosted, kStepped, kRedo };
  Status step_block(std::size_t block);
  Status undo_all();  // on the optimizer thread, or with it idle
  void undo_blocks(std::span<const std::size_t> blocks);  // a failure goes to undo_error_

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
  AheadRedo stopped_why_ = AheadRedo::kNone;  // why the window stopped early, or was cancelled
  double partial_sum_squares_ = 0;
  std::vector<double> seconds_;  // per block, its step's
  std::vector<std::pair<std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point>> spans_;
  std::uint64_t undone_ = 0;
  Status undo_error_;
  TaskThread thread_{"optimizer"};
};

}  // namespace tz::detail
