#include "step_ahead.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

namespace tz::detail {

std::string_view ahead_redo_name(AheadRedo why) {
  switch (why) {
    case AheadRedo::kNone: return "";
    case AheadRedo::kClip: return "clip";
    case AheadRedo::kOverflow: return "overflow";
    case AheadRedo::kHyperparameters: return "hyperparameters";
    case AheadRedo::kStepNumber: return "step number";
    case AheadRedo::kCancel: return "cancel";
    case AheadRedo::kFault: break;
  }
  return "fault";
}

AheadRedo verdict(const AheadArgs& a, double clip_coef, const cpu_adam::Hyper& h, std::int64_t step,
                  double grad_scale) {
  if (clip_coef < 1.0) return AheadRedo::kClip;
  if (a.step != step) return AheadRedo::kStepNumber;
  const cpu_adam::Hyper& s = a.hyper;
  const bool same = s.algorithm == h.algorithm && s.lr == h.lr && s.beta1 == h.beta1 && s.beta2 == h.beta2 &&
                    s.eps == h.eps && s.weight_decay == h.weight_decay && s.amsgrad == h.amsgrad &&
                    s.lr_decay == h.lr_decay && a.grad_scale == grad_scale;
  return same ? AheadRedo::kNone : AheadRedo::kHyperparameters;
}

// Note [When to speculate]
bool AheadPolicy::speculate(std::string& why_not) const {
  if (always_) return true;
  if (slow_skip_ > 0) {
    why_not = fmt::format("auto: stepping under backward measured slower here ({:.3f} s a step against {:.3f} s "
                          "after backward): {} more window(s) step after backward, then it measures again",
                          slow_ahead_s_, slow_after_s_, slow_skip_);
    return false;
  }
  if (skip_ > 0) {
    why_not = fmt::format("auto: the last {} window(s) that stepped under backward were redone ({}): {} more "
                          "window(s) step after backward", failures_, ahead_redo_name(last_why_), skip_);
    return false;
  }
  if (calm_ >= kCalmWindows) return true;
  if (last_overflow_) {
    why_not = "auto: the last step overflowed";
  } else if (last_max_norm_ > 0 && last_norm_ > kNormMargin * last_max_norm_) {
    why_not = fmt::format("auto: the last step's gradient norm {:.4g} was above {:.4g} ({} x the max norm)",
                          last_norm_, kNormMargin * last_max_norm_, kNormMargin);
  } else {
    why_not = fmt::format("auto: {} of the {} windows before a speculation stepped at or below {} x the max norm",
                          calm_, kCalmWindows, kNormMargin);
  }
  return false;
}

void AheadPolicy::record(bool stepped, bool overflow, double grad_norm, double max_norm, bool speculated,
                         AheadRedo why) {
  last_overflow_ = overflow;
  last_norm_ = grad_norm;
  last_max_norm_ = max_norm;
  const bool calm = stepped && !overflow && (max_norm <= 0 || grad_norm <= kNormMargin * max_norm);
  calm_ = calm ? calm_ + 1 : 0;
  if (skip_ > 0 && !speculated) --skip_;
  if (!speculated || why == AheadRedo::kCancel) return;
  last_why_ = why;
  if (why == AheadRedo::kNone) {
    failures_ = 0;
    return;
  }
  failures_ = std::min(failures_ + 1, kMaxBackoffShift);
  skip_ = (1 << failures_) - 1;
}

void AheadPolicy::record_pace(double seconds, bool stepped, bool speculated, AheadRedo why) {
  if (always_ || !by_pace_) return;
  if (!speculated) {
    if (slow_skip_ > 0) --slow_skip_;
    probe_s_.clear();
    probing_ = true;  // the next run of speculating windows is judged afresh
    // A window that did not step (an overflow) skipped the optimizer: no measure of either way.
    if (!stepped || seconds <= 0) return;
    after_recent_.push_back(seconds);
    if (after_recent_.size() > static_cast<std::size_t>(kProbeWindows)) after_recent_.erase(after_recent_.begin());
    return;
  }
  if (why != AheadRedo::kNone || !stepped || seconds <= 0) {  // undone or untimed: the probe starts over
    probe_s_.clear();
    return;
  }
  if (!probing_) return;  // judged: speculate on until a window after backward comes between
  probe_s_.push_back(seconds);
  if (probe_s_.size() < static_cast<std::size_t>(kProbeWindows)) return;
  probing_ = false;
  const double ahead = *std::min_element(probe_s_.begin(), probe_s_.end());
  probe_s_.clear();
  if (after_recent_.size() < static_cast<std::size_t>(kProbeWindows)) return;  // nothing alike to compare with
  const double after = *std::min_element(after_recent_.begin(), after_recent_.end());
  if (ahead > (1 + kSlowerMargin) * after) {
    slow_skip_ = kSlowSkip;
    slow_after_s_ = after;
    slow_ahead_s_ = ahead;
    after_recent_.clear();
  }
}

StepAhead::StepAhead(const StepAheadDeps& deps, std::vector<bool> may)
    : deps_(deps),
      may_(std::move(may)),
      state_(deps.layout->blocks.size()),
      slots_(deps.layout->blocks.size()),
      seconds_(deps.layout->blocks.size(), 0.0) {}

StepAhead::~StepAhead() {
  (void)thread_.wait_idle();
  (void)deps_.pass->ahead_flush();  // no read or write of a step under backward outlives the engine's stores
}

void StepAhead::open(const AheadArgs& args) {
  if (window_ != Window::kClosed) return;
  args_ = args;
  stopped_ = false;
  stopped_why_ = AheadRedo::kNone;
  partial_sum_squares_ = 0;
  spans_.clear();
  std::fill(seconds_.begin(), seconds_.end(), 0.0);
  undone_ = 0;
  undo_error_ = ok_status();
  for (auto& s : state_) s = Block::kNone;
  window_ = Window::kOpen;
}

// A later gradient of a block already posted: the optimizer thread must be
// done with the block's accumulator before it changes, and the step taken
// from it is not the window's.
void StepAhead::before_accumulate(std::size_t block) {
  if (window_ != Window::kOpen || state_[block] == Block::kNone) return;
  (void)thread_.wait_idle();
  state_[block] = Block::kRedo;
}

void StepAhead::after_accumulate(std::size_t block, bool ok) {
  if (window_ != Window::kOpen) return;
  if (!ok || state_[block] != Block::kNone) {
    if (state_[block] == Block::kNone) state_[block] = Block::kRedo;  // its accumulator is in doubt: run() redoes it
    return;
  }
  state_[block] = Block::kPosted;
  thread_.post([this, block] { return step_block(block); });
}

Status StepAhead::step_block(std::size_t block) {
  if (stopped_ || state_[block] != Block::kPosted) return ok_status();
  // Certain not to commit: an overflow, or clipping already (this rank's
  // sum so far is a lower bound of the global one). Undo now, under backward.
  const GradientPath& grads = *deps_.grads;
  partial_sum_squares_ += grads.sum_squares(block);
  const double norm_so_far = std::sqrt(partial_sum_squares_) / args_.loss_scale;
  if (grads.non_finite(block) || !std::isfinite(partial_sum_squares_) ||
      (args_.max_norm > 0 && norm_so_far > args_.max_norm * 1.001 + 1e-6)) {
    stopped_ = true;
    stopped_why_ = grads.non_finite(block) || !std::isfinite(partial_sum_squares_) ? AheadRedo::kOverflow
                                                                                    : AheadRedo::kClip;
    return undo_all();
  }
  if (!may_[block]) return ok_status();
  // Backward reaches the block before this one next (a hint: its states are read meanwhile).
  const std::size_t next = block > 0 && may_[block - 1] ? block - 1 : kNoBlock;
  const auto begin = std::chrono::steady_clock::now();
  Status s = deps_.pass->step_ahead(block, next, args_.hyper, args_.step, args_.grad_scale, slots_[block]);
  spans_.emplace_back(begin, std::chrono::steady_clock::now());
  seconds_[block] += std::chrono::duration<double>(spans_.back().second - begin).count();
  if (s.ok()) state_[block] = Block::kStepped;
  const std::vector<std::size_t> failed = deps_.pass->take_failed_ahead();  // earlier blocks' writes
  for (std::size_t b : failed) state_[b] = Block::kRedo;
  if (s.ok() && failed.empty()) return ok_status();
  // Not fatal by itself: the block is put back and run() takes its step
  // after backward (and meets the fault again, if it lasts, and reports it).
  state_[block] = Block::kRedo;
  stopped_ = true;
  stopped_why_ = AheadRedo::kFault;
  return undo_all();
}

Status StepAhead::undo_all() {
  (void)deps_.pass->ahead_flush();  // a failed write is named below; its block is undone like the rest
  (void)deps_.pass->take_failed_ahead();
  std::vector<std::size_t> undo;
  for (std::size_t b = 0; b < slots_.size(); ++b) {
    if (!slots_[b].changed) continue;
    undo.push_back(b);
    if (state_[b] == Block::kStepped) state_[b] = Block::kRedo;
  }
  undo_blocks(undo);
  return ok_status();  // undo_error_ is reported by finish() / cancel()
}

// Note [Committing steps under backward] (optimizer_pass_ahead.cpp): together.
void StepAhead::undo_blocks(std::span<const std::size_t> blocks) {
  if (blocks.empty()) return;
  Status s = deps_.pass->undo_ahead(blocks, slots_);
  if (!s.ok() && undo_error_.ok()) undo_error_ = std::move(s);
  undone_ += blocks.size();
}

Status StepAhead::finish(AheadRedo verdict, std::vector<bool>& done, std::chrono::steady_clock::time_point step_began,
                         AheadOutcome& outcome) {
  const bool commit = verdict == AheadRedo::kNone;
  done.assign(slots_.size(), false);
  outcome = {};
  if (window_ == Window::kClosed) return ok_status();
  const bool was_open = window_ == Window::kOpen;
  window_ = Window::kClosed;
  Status s = thread_.wait_idle();  // step_block never fails; this is for form
  if (was_open) {
    // Every write under backward lands before a commit or an undo; a block
    // whose write failed is undone and redone.
    (void)deps_.pass->ahead_flush();
    for (std::size_t b : deps_.pass->take_failed_ahead()) state_[b] = Block::kRedo;
    // Undone: the blocks marked redone after their step, and where the step
    // is not the one speculated, every stepped block; the rest commit.
    std::vector<std::size_t> undo, keep;
    for (std::size_t b = 0; b < slots_.size(); ++b) {
      if (state_[b] == Block::kStepped) {
        (commit ? keep : undo).push_back(b);
      } else if (slots_[b].changed) {
        undo.push_back(b);
      }
    }
    undo_blocks(undo);
    Status c = keep.empty() ? ok_status() : deps_.pass->commit_ahead(keep, slots_);
    if (!c.ok() && s.ok()) s = std::move(c);
    for (std::size_t b : keep) done[b] = true;
    outcome.committed = keep.size();
  }
  outcome.redone = undone_;
  // Note [What a redo costs]: whatever was read, stepped or written for a
  // block that run() steps again.
  for (std::size_t b = 0; b < slots_.size(); ++b) {
    const AheadIo io = deps_.pass->take_ahead_io(b);
    if (done[b]) continue;
    outcome.redone_io.read_bytes += io.read_bytes;
    outcome.redone_io.write_bytes += io.write_bytes;
    outcome.redone_seconds += seconds_[b];
  }
  if (outcome.redone > 0 || outcome.redone_io.read_bytes + outcome.redone_io.write_bytes > 0) {
    outcome.why = !was_open || verdict == AheadRedo::kNone ? stopped_why_ : verdict;
    if (outcome.why == AheadRedo::kNone) outcome.why = AheadRedo::kFault;  // some blocks only
  }
  for (const auto& [begin, end] : spans_) {
    outcome.busy_seconds += std::chrono::duration<double>(end - begin).count();
    if (begin < step_began) outcome.hidden_seconds += std::chrono::duration<double>(std::min(end, step_began) - begin).count();
  }
  TZ_TRY_CTX(std::exchange(undo_error_, ok_status()), "undoing steps taken under backward");
  return s;
}

Status StepAhead::cancel(AheadRedo why) {
  if (window_ != Window::kOpen) return ok_status();
  window_ = Window::kCancelled;
  TZ_TRY(thread_.run([this, why] {
    stopped_ = true;
    stopped_why_ = why;
    return undo_all();
  }));
  return std::exchange(undo_error_, ok_status());
}

}  // namespace tz::detail
