// BlockTable on its own: every legal transition of Note [Block states], and
// a gradient of a block without values refused naming it.
#include <gtest/gtest.h>

#include "../../engine/src/block_table.h"

namespace tz::detail {
namespace {

ModelLayout layout() {
  return ModelLayout::make({{"embed", {{"w", {8, 4}}}}, {"layer0", {{"w", {4, 4}}}}, {"head", {{"w", {4}}}}}, 1, 0)
      .value();
}

TEST(BlockTable, AWindowGoesIdleReducedIdle) {
  const ModelLayout l = layout();
  BlockTable t(l, BlockState::kIdle);
  EXPECT_TRUE(t.has_values(0) && t.has_values(2));
  EXPECT_FALSE(t.has_values(3));  // no such block
  EXPECT_EQ(t.reduce(1, "reduce_grads").value(), true);   // the window's first gradient
  EXPECT_EQ(t.reduce(1, "reduce_grads").value(), false);  // a later micro-batch
  EXPECT_EQ(t.state(1), BlockState::kReduced);
  EXPECT_EQ(t.count(BlockState::kReduced), 1u);
  t.set_values(1);  // set_master in the window keeps the gradient
  EXPECT_EQ(t.state(1), BlockState::kReduced);
  t.end_window();
  EXPECT_EQ(t.count(BlockState::kIdle), 3u);
  EXPECT_EQ(t.reduce(1, "reduce_grads").value(), true);  // a new window's first
}

TEST(BlockTable, BlocksWithoutValuesRefuseGradientsUntilSetOrLoaded) {
  const ModelLayout l = layout();
  BlockTable t(l, BlockState::kUnset);
  EXPECT_EQ(t.first(BlockState::kUnset), std::optional<std::size_t>(0));
  const auto refused = t.reduce(2, "reduce_grads");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("reduce_grads: block 'head' has no values yet"), std::string::npos)
      << refused.status().to_string();
  EXPECT_EQ(t.state(2), BlockState::kUnset);  // a refusal changes nothing
  t.set_values(0);
  EXPECT_EQ(t.state(0), BlockState::kIdle);
  EXPECT_EQ(t.first(BlockState::kUnset), std::optional<std::size_t>(1));
  t.loaded();
  EXPECT_EQ(t.count(BlockState::kIdle), 3u);
  EXPECT_TRUE(t.reduce(0, "reduce_grads").ok());
  t.unset_all();  // a load that failed part way: reduced or not, nothing has values
  EXPECT_EQ(t.count(BlockState::kUnset), 3u);
  EXPECT_EQ(block_state_name(BlockState::kReduced), "reduced");
}

}  // namespace
}  // namespace tz::detail
