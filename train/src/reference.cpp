// The in-memory reference training of the GPT (tierzero/train/gpt.h). It
// runs forward_backward<float>, the arithmetic GptTrainer runs, on weights
// rounded the way the engine hands them out, and repeats the engine's
// gradient path (rounding to the gradient type, the sum over ranks in it,
// the fp32 mean) and a plain Adam in double: it differs from the engine only
// where the engine's fp32 optimizer rounds differently from double.
#include <algorithm>
#include <cmath>

#include "tierzero/kernels.h"
#include "tierzero/train/gpt.h"

namespace tz::train {
namespace {

using Blocks = std::vector<std::vector<float>>;

Blocks zeros_like(const Blocks& like) {
  Blocks out;
  for (const auto& b : like) out.emplace_back(b.size(), 0.0F);
  return out;
}

}  // namespace

Reference::Reference(const GptConfig& cfg, const Config& config, int world_size, BatchFn batches,
                     std::optional<DType> grad_type)
    : cfg_(cfg), world_(world_size), batches_(std::move(batches)), states_(model(cfg), init(cfg), config, world_size) {
  grad_type_ = grad_type.value_or(states_.param_type());
}

double Reference::train_step(std::int64_t step) {
  const double loss_scale = states_.loss_scale();
  const int gas = states_.gradient_accumulation_steps();
  const Blocks& masters = states_.masters();
  Blocks weights = masters;  // the 16-bit parameters, as fp32
  for (auto& block : weights) {
    for (float& x : block) x = round_through(x, states_.param_type());
  }
  Blocks acc = zeros_like(masters);
  const float scale = static_cast<float>(1.0 / (static_cast<double>(world_) * gas));
  double loss_sum = 0;
  for (int micro = 0; micro < gas; ++micro) {
    Blocks sum = zeros_like(masters);
    for (int rank = 0; rank < world_; ++rank) {
      Blocks grads = zeros_like(masters);
      loss_sum += forward_backward<float>(cfg_, states_.layout(), weights, batches_(rank, micro, step), loss_scale, &grads);
      // The sum over ranks, in the gradient type (as the reduction stores it).
      for (std::size_t b = 0; b < sum.size(); ++b) {
        for (std::size_t i = 0; i < sum[b].size(); ++i) {
          sum[b][i] = round_through(sum[b][i] + round_through(grads[b][i], grad_type_), grad_type_);
        }
      }
    }
    for (std::size_t b = 0; b < acc.size(); ++b) {
      for (std::size_t i = 0; i < acc[b].size(); ++i) acc[b][i] += scale * sum[b][i];
    }
  }
  states_.step(acc);
  return loss_sum / (static_cast<double>(world_) * gas);
}

}  // namespace tz::train
