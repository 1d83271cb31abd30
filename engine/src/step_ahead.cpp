#include "step_ahead.h"

#include <cmath>
#include <utility>

namespace tz::detail {

bool same_args(const AheadArgs& a, const cpu_adam::Hyper& h, std::int64_t step, double grad_scale) {
  const cpu_adam::Hyper& s = a.hyper;
  return s.algorithm == h.algorithm && s.lr == h.lr && s.beta1 == h.beta1 && s.beta2 == h.beta2 && s.eps == h.eps &&
         s.weight_decay == h.weight_decay && s.amsgrad == h.amsgrad && s.lr_decay == h.lr_decay && a.step == step &&
         a.grad_scale == grad_scale;
}

StepAhead::StepAhead(const StepAheadDeps& deps, std::vector<bool> may)
    : deps_(deps), may_(std::move(may)), state_(deps.layout->blocks.size()), slots_(deps.layout->blocks.size()) {}

StepAhead::~StepAhead() {
  (void)thread_.wait_idle();
  (void)deps_.pass->ahead_flush();  // no read or write of a step under backward outlives the engine's stores
}

void StepAhead::open(const AheadArgs& args) {
  if (window_ != Window::kClosed) return;
  args_ = args;
  stopped_ = false;
  partial_sum_squares_ = 0;
  spans_.clear();
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
    return undo_all();
  }
  if (!may_[block]) return ok_status();
  // Backward reaches the block before this one next (a hint: its states are read meanwhile).
  const std::size_t next = block > 0 && may_[block - 1] ? block - 1 : kNoBlock;
  const auto begin = std::chrono::steady_clock::now();
  Status s = deps_.pass->step_ahead(block, next, args_.hyper, args_.step, args_.grad_scale, slots_[block]);
  spans_.emplace_back(begin, std::chrono::steady_clock::now());
  if (s.ok()) state_[block] = Block::kStepped;
  const std::vector<std::size_t> failed = deps_.pass->take_failed_ahead();  // earlier blocks' writes
  for (std::size_t b : failed) state_[b] = Block::kRedo;
  if (s.ok() && failed.empty()) return ok_status();
  // Not fatal by itself: the block is put back and run() takes its step
  // after backward (and meets the fault again, if it lasts, and reports it).
  state_[block] = Block::kRedo;
  stopped_ = true;
  return undo_all();
}

Status StepAhead::undo_all() {
  (void)deps_.pass->ahead_flush();  // a failed write is named below; its block is undone like the rest
  (void)deps_.pass->take_failed_ahead();
  for (std::size_t b = 0; b < slots_.size(); ++b) {
    if (!slots_[b].changed) continue;
    Status s = deps_.pass->undo_ahead(b, slots_[b]);
    if (!s.ok() && undo_error_.ok()) undo_error_ = std::move(s);
    ++undone_;
    if (state_[b] == Block::kStepped) state_[b] = Block::kRedo;
  }
  return ok_status();  // undo_error_ is reported by finish() / cancel()
}

Status StepAhead::finish(bool commit, std::vector<bool>& done, std::chrono::steady_clock::time_point step_began,
                         AheadOutcome& outcome) {
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
    for (std::size_t b = 0; b < slots_.size(); ++b) {
      if (!slots_[b].changed || state_[b] == Block::kStepped) continue;
      Status u = deps_.pass->undo_ahead(b, slots_[b]);  // a block marked redone after its step
      if (!u.ok() && undo_error_.ok()) undo_error_ = std::move(u);
      ++undone_;
    }
    for (std::size_t b = 0; b < slots_.size(); ++b) {
      if (state_[b] != Block::kStepped) continue;
      if (commit) {
        Status c = deps_.pass->commit_ahead(b, slots_[b]);
        if (!c.ok() && s.ok()) s = std::move(c);
        done[b] = true;
        ++outcome.committed;
      } else {
        Status u = deps_.pass->undo_ahead(b, slots_[b]);
        if (!u.ok() && undo_error_.ok()) undo_error_ = std::move(u);
        ++undone_;
      }
    }
  }
  outcome.redone = undone_;
  for (const auto& [begin, end] : spans_) {
    outcome.busy_seconds += std::chrono::duration<double>(end - begin).count();
    if (begin < step_began) outcome.hidden_seconds += std::chrono::duration<double>(std::min(end, step_began) - begin).count();
  }
  TZ_TRY_CTX(std::exchange(undo_error_, ok_status()), "undoing steps taken under backward");
  return s;
}

Status StepAhead::cancel() {
  if (window_ != Window::kOpen) return ok_status();
  window_ = Window::kCancelled;
  TZ_TRY(thread_.run([this] {
    stopped_ = true;
    return undo_all();
  }));
  return std::exchange(undo_error_, ok_status());
}

}  // namespace tz::detail
