// The in-memory side of the engine's correctness checks: what an offloaded
// run is compared against. ReferenceStates holds every block's fp32 master
// weights and Adam moments in ordinary memory and takes the optimizer step
// the way the engine's DeepSpeed-style config says (global-norm clipping,
// fp16 loss scale, Adam/AdamW with torch.optim semantics), computed in
// double. A workload's reference (tz::mlp::Reference, tz::train::Reference)
// adds its own forward and backward and hands the step the accumulated
// gradients.
//
//   tz::ReferenceStates states(model, init, config, world_size);
//   ... weights = round_through(states.masters()[b][i], states.param_type()) ...
//   states.step(acc);   // acc: per block, (used_numel,) fp32, the loss-scaled mean gradient
#pragma once

#include <cstdint>
#include <vector>

#include "tierzero/engine/zero.h"

namespace tz {

// x rounded through `type` and back (what storing it in that type keeps).
float round_through(float x, DType type);

class ReferenceStates {
 public:
  ReferenceStates(const std::vector<BlockSpec>& model, const ParamInit& init, const Config& config, int world_size);

  const ModelLayout& layout() const { return layout_; }
  // Per block, (used_numel,) fp32, as the engine stores them.
  const std::vector<std::vector<float>>& masters() const { return master_; }
  // Block b's master weights in the engine's layout (whole, padded with zeros).
  std::vector<float> master(std::size_t block) const;
  // The engine's parameter type for this config (fp16, bf16, else fp32).
  DType param_type() const { return param_type_; }
  // The fp16 loss scale the engine starts with (1 without fp16).
  double loss_scale() const;
  int gradient_accumulation_steps() const;
  void set_learning_rate(double lr) { config_.optimizer.lr = lr; }

  // One step from `acc` (per block, (used_numel,), the loss-scaled mean
  // gradient over ranks and micro-batches): global norm, clipping, Adam or
  // AdamW in double, masters stored back as fp32.
  void step(const std::vector<std::vector<float>>& acc);

 private:
  Config config_;
  DType param_type_ = DType::kBf16;
  ModelLayout layout_;
  std::vector<std::vector<float>> master_;
  std::vector<std::vector<double>> m_, v_;
  std::int64_t steps_ = 0;
};

}  // namespace tz
