#include "block_table.h"

#include <algorithm>

namespace tz::detail {

std::string_view block_state_name(BlockState state) {
  switch (state) {
    case BlockState::kUnset: return "unset";
    case BlockState::kIdle: return "idle";
    case BlockState::kReduced: return "reduced";
  }
  return "?";
}

BlockTable::BlockTable(const ModelLayout& layout, BlockState initial)
    : layout_(&layout), states_(layout.blocks.size(), initial) {}

std::size_t BlockTable::count(BlockState state) const {
  return static_cast<std::size_t>(std::count(states_.begin(), states_.end(), state));
}

std::optional<std::size_t> BlockTable::first(BlockState state) const {
  const auto it = std::find(states_.begin(), states_.end(), state);
  if (it == states_.end()) return std::nullopt;
  return static_cast<std::size_t>(it - states_.begin());
}

Status BlockTable::check_set(std::size_t block, std::string_view what) const {
  if (has_values(block)) return ok_status();
  return failed_precondition("{}: block '{}' has no values yet (the engine was made with initial_values = kSetLater, "
                             "and {} of its {} blocks are still unset): set_master() it, or load a checkpoint",
                             what, layout_->blocks[block].name, count(BlockState::kUnset), states_.size());
}

Status BlockTable::check_all_set(std::string_view what) const {
  const std::optional<std::size_t> unset = first(BlockState::kUnset);
  return unset ? check_set(*unset, what) : ok_status();
}

void BlockTable::set_values(std::size_t block) {
  if (states_[block] == BlockState::kUnset) states_[block] = BlockState::kIdle;  // kIdle and kReduced stay
}

Expected<bool> BlockTable::reduce(std::size_t block, std::string_view what) {
  switch (states_[block]) {
    case BlockState::kUnset:
      return check_set(block, what);
    case BlockState::kIdle:
      states_[block] = BlockState::kReduced;
      return true;
    case BlockState::kReduced:
      return false;
  }
  return internal_error("{}: block '{}' is in no known state", what, layout_->blocks[block].name);
}

void BlockTable::end_window() {
  std::replace(states_.begin(), states_.end(), BlockState::kReduced, BlockState::kIdle);
}

void BlockTable::loaded() { std::fill(states_.begin(), states_.end(), BlockState::kIdle); }

void BlockTable::unset_all() { std::fill(states_.begin(), states_.end(), BlockState::kUnset); }

}  // namespace tz::detail
