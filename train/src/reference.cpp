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

// x rounded through `type` and back (what storing it in that type keeps).
float round_through(float x, ElemType type) {
  switch (type) {
    case ElemType::kFp32: return x;
    case ElemType::kBf16: return kernels::bf16_to_fp32(kernels::fp32_to_bf16(x));
    case ElemType::kFp16: return kernels::fp16_to_fp32(kernels::fp32_to_fp16(x));
  }
  return x;
}

using Blocks = std::vector<std::vector<float>>;

Blocks zeros_like(const Blocks& like) {
  Blocks out;
  for (const auto& b : like) out.emplace_back(b.size(), 0.0F);
  return out;
}

}  // namespace

Reference::Reference(const GptConfig& cfg, const Config& config, int world_size, BatchFn batches,
                     std::optional<ElemType> grad_type)
    : cfg_(cfg), config_(config), world_(world_size), batches_(std::move(batches)) {
  param_type_ = config.precision.fp16 ? ElemType::kFp16 : config.precision.bf16 ? ElemType::kBf16 : ElemType::kFp32;
  grad_type_ = grad_type.value_or(param_type_);
  layout_ = ModelLayout::make(model(cfg), world_size, 0).value();
  const ParamInit initialise = init(cfg);
  for (std::size_t b = 0; b < layout_.blocks.size(); ++b) {
    const BlockLayout& block = layout_.blocks[b];
    std::vector<float> whole(block.used_numel, 0.0F);
    for (std::size_t p = 0; p < block.params.size(); ++p) {
      initialise(b, p, whole.data() + block.params[p].offset, block.params[p].numel);
    }
    master_.push_back(whole);
    m_.emplace_back(whole.size(), 0.0);
    v_.emplace_back(whole.size(), 0.0);
  }
}

std::vector<float> Reference::master(std::size_t block) const {
  std::vector<float> out(layout_.blocks[block].whole_numel, 0.0F);
  std::copy(master_[block].begin(), master_[block].end(), out.begin());
  return out;
}

double Reference::train_step(std::int64_t step) {
  const double loss_scale = config_.precision.fp16 ? std::ldexp(1.0, config_.precision.initial_scale_power) : 1.0;
  const int gas = static_cast<int>(std::max<std::int64_t>(config_.gradient_accumulation_steps, 1));
  Blocks weights = master_;  // the 16-bit parameters, as fp32
  for (auto& block : weights) {
    for (float& x : block) x = round_through(x, param_type_);
  }
  Blocks acc = zeros_like(master_);
  const float scale = static_cast<float>(1.0 / (static_cast<double>(world_) * gas));
  double loss_sum = 0;
  for (int micro = 0; micro < gas; ++micro) {
    Blocks sum = zeros_like(master_);
    for (int rank = 0; rank < world_; ++rank) {
      Blocks grads = zeros_like(master_);
      loss_sum += forward_backward<float>(cfg_, layout_, weights, batches_(rank, micro, step), loss_scale, &grads);
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
  // Global norm, clipping, Adam in double (torch.optim semantics).
  double ss = 0;
  for (const auto& a : acc) {
    for (float g : a) ss += static_cast<double>(g) * g;
  }
  const double norm = std::sqrt(ss) / loss_scale;
  const double max_norm = config_.gradient_clipping;
  const double clip = max_norm > 0 ? std::min(1.0, max_norm / (norm + 1e-6)) : 1.0;
  const OptimizerConfig& o = config_.optimizer;
  const bool adamw = o.type == "AdamW";
  ++steps_;
  const double bc1 = 1 - std::pow(o.beta1, static_cast<double>(steps_));
  const double bc2 = 1 - std::pow(o.beta2, static_cast<double>(steps_));
  for (std::size_t b = 0; b < acc.size(); ++b) {
    for (std::size_t i = 0; i < acc[b].size(); ++i) {
      double p = master_[b][i];
      double g = acc[b][i] * (clip / loss_scale);
      if (adamw) {
        p *= 1 - o.lr * o.weight_decay;
      } else {
        g += o.weight_decay * p;
      }
      m_[b][i] = o.beta1 * m_[b][i] + (1 - o.beta1) * g;
      v_[b][i] = o.beta2 * v_[b][i] + (1 - o.beta2) * g * g;
      p -= o.lr / bc1 * m_[b][i] / (std::sqrt(v_[b][i]) / std::sqrt(bc2) + o.eps);
      master_[b][i] = static_cast<float>(p);
    }
  }
  return loss_sum / (static_cast<double>(world_) * gas);
}

}  // namespace tz::train
