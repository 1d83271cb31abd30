// PhaseBoard: each rank posts what it is doing (its collectives, counted,
// the optimizer step under way, an activity label) where the other ranks can
// read it, so that a collective that times out can say what the others were
// doing. Note [What the other ranks were doing] in phase_board.cpp.
//
//   TZ_ASSIGN_OR_RETURN(auto board, PhaseBoard::open(dir, "127.0.0.1-29500.<run>", rank, size));
//   board->set_step(12);                 // any thread
//   board->enter("all_reduce of 1 fp32 (rank 0 of 2)");  // the collective's thread
//   ... the collective ...
//   board->leave();
//   // on a timeout: "rank 1: finished #56 (...) 2.0 s ago and has not entered #57"
//   std::string others = board->describe_others();
//
// Cost: enter() and leave() write a few dozen bytes into a shared mapping
// (no system call); the file is read only by describe_others().
// Thread safety: set_step/set_activity from any thread; enter/leave/
// describe_others from the thread that runs the collectives (one at a time).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "tierzero/common.h"

namespace tz::comm_detail {

class PhaseBoard {
 public:
  // Creates this rank's file `<dir>/<tag>.rank<rank>.phase` (locked for the
  // board's life) and removes the unlocked phase files of dead runs there.
  static Expected<std::unique_ptr<PhaseBoard>> open(const std::string& dir, const std::string& tag, int rank,
                                                   int size);
  ~PhaseBoard();  // removes this rank's file
  PhaseBoard(const PhaseBoard&) = delete;
  PhaseBoard& operator=(const PhaseBoard&) = delete;

  // The optimizer step under way (1-based; <= 0: none yet).
  void set_step(std::int64_t step) { step_.store(step, std::memory_order_relaxed); }
  // What the coming collectives are for ("" for nothing in particular).
  void set_activity(std::string_view activity);

  void enter(std::string_view call);
  void leave();

  // This rank's current collective: "#57 (step 13, for <activity>)".
  std::string describe_mine() const;
  // One clause per other rank, from what it last posted.
  std::string describe_others() const;

  // The record's path for `rank` (tests).
  std::string path_of(int rank) const;

 struct Record;  // the file's layout (phase_board.cpp)

 private:
  PhaseBoard(std::string dir, std::string tag, int rank, int size);

  std::string dir_, tag_;
  int rank_ = 0, size_ = 1;
  UniqueFd fd_;          // this rank's file, OFD-locked
  MappedRegion mapping_; // its Record
  Record* mine_ = nullptr;
  std::atomic<std::int64_t> step_{0};
  mutable std::mutex activity_mu_;
  std::string activity_;
};

}  // namespace tz::comm_detail
