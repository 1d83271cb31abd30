// BlockTable: each block's life as one state, with the legal transitions
// checked.
//
// Note [Block states]
//   kUnset    no values yet: the engine was made with InitialValues::kSetLater
//             and nothing has set it, or a load failed part way (Note
//             [Initial values], Note [Streamed checkpoints]). fetch, step,
//             saves, exports and reduce_grads refuse it.
//   kIdle     values set; no gradient has reached the gradient path in this
//             accumulation window (at the boundary it steps with zeros).
//   kReduced  values set; a gradient has reached the gradient path in this
//             window (the first one started its accumulator).
//
//   kUnset   -> kIdle      set_values (set_master), loaded (a load succeeded)
//   kIdle    -> kIdle      set_values, loaded, end_window
//   kIdle    -> kReduced   reduce (the window's first gradient of the block)
//   kReduced -> kReduced   reduce (a later micro-batch), set_values
//   kReduced -> kIdle      end_window (the step at the boundary), loaded
//   any      -> kUnset     unset_all (a load that failed part way)
// reduce on a kUnset block is refused, naming the block. Whether a block is
// gathered is not a state of the block: several fetches of one block can be
// live at once (forward and evaluation), so the engine tracks each gathered
// buffer by its memory (Note [Stream-ordered release]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "tierzero/engine/model.h"

namespace tz::detail {

enum class BlockState : std::uint8_t { kUnset, kIdle, kReduced };
std::string_view block_state_name(BlockState state);  // "unset" | "idle" | "reduced"

class BlockTable {
 public:
  BlockTable() = default;
  BlockTable(const ModelLayout& layout, BlockState initial);

  std::size_t size() const { return states_.size(); }
  BlockState state(std::size_t block) const { return states_[block]; }
  bool has_values(std::size_t block) const { return block < states_.size() && states_[block] != BlockState::kUnset; }
  std::size_t count(BlockState state) const;
  std::optional<std::size_t> first(BlockState state) const;
  // Note [Initial values]: FailedPrecondition while `block` (or any block)
  // has no values yet, naming it, `what` asked, and how many are unset.
  Status check_set(std::size_t block, std::string_view what) const;
  Status check_all_set(std::string_view what) const;

  // set_master wrote the block's values.
  void set_values(std::size_t block);
  // A gradient of the block reached the gradient path: true when it is the
  // window's first (the accumulator starts from it). check_set's refusal on a
  // kUnset block.
  Expected<bool> reduce(std::size_t block, std::string_view what);
  // The accumulation window ended: every kReduced block is kIdle again.
  void end_window();
  // Every block has the values a load put (kIdle), or none after a load that failed part way (kUnset).
  void loaded();
  void unset_all();

 private:
  const ModelLayout* layout_ = nullptr;
  std::vector<BlockState> states_;
};

}  // namespace tz::detail
